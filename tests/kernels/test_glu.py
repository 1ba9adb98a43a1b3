"""SwiGLU / GeGLU kernels and the gated MLP modules against float64 references."""

import math

import pytest
import torch

from mfuwatch.kernels import glu
from mfuwatch.kernels.glu import GeGLUMLP, SwiGLUMLP, geglu, swiglu
from tests.helpers.kernel_checks import DEVICE, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The interpreter evaluates sigmoid's exp in numpy, which warns where it overflows to inf
# (large |gate|); the result (sigmoid = 0 or 1) is the correct limit and is checked below.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def ref_act(g, kind):
    """float64 activations written from their definitions (not torch's implementations)."""
    g = g.double()
    if kind == "silu":
        return g / (1.0 + torch.exp(-g))
    if kind == "none":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


def fused(kind, gate, up):
    return swiglu(gate, up) if kind == "silu" else geglu(gate, up, approximate=kind)


def assert_matches_float64(kind, gate, up, dtype, gen):
    gate, up = gate.to(DEVICE).detach().requires_grad_(), up.to(DEVICE).detach().requires_grad_()
    y = fused(kind, gate, up)
    assert y.shape == gate.shape and y.dtype == dtype
    dy = torch.randn(y.shape, generator=gen).to(dtype).to(DEVICE)
    y.backward(dy)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    yr = ref_act(g64, kind) * u64
    yr.backward(dy.double())
    assert_close(y, yr, dtype, "y")
    assert_close(gate.grad, g64.grad, dtype, "dgate")
    assert_close(up.grad, u64.grad, dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["silu", "none", "tanh"])
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (5, 17), (2, 5120), (2, 3, 40)], ids=str)
def test_forward_backward_match_float64(shape, kind, dtype, gen):
    gate = (3.0 * torch.randn(*shape, generator=gen)).to(dtype)  # wide range: both tails of the activation
    up = torch.randn(*shape, generator=gen).to(dtype)
    assert_matches_float64(kind, gate, up, dtype, gen)


@pytest.mark.parametrize("kind", ["silu", "tanh"])
def test_strided_halves_of_a_fused_projection(kind, gen):
    # gate and up as the two halves of one (rows, 2N) projection: row stride 2N, read in place
    h = torch.randn(7, 2 * 48, generator=gen)
    gate, up = h.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    assert_matches_float64(kind, gate, up, torch.float32, gen)
    # and a transposed gate (last-dim stride != 1) is copied, not misread
    assert_matches_float64(kind, torch.randn(48, 7, generator=gen).t(), torch.randn(7, 48, generator=gen),
                  torch.float32, gen)


def test_large_magnitudes_stay_finite(gen):
    gate = torch.tensor([[-80.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 80.0, 300.0]]).to(torch.bfloat16)
    up = torch.ones_like(gate)
    for kind in ("silu", "none", "tanh"):
        assert_matches_float64(kind, gate, up, torch.bfloat16, gen)


def test_custom_op_path_equals_fast_path(monkeypatch, gen):
    gate, up, dy = (torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE) for _ in range(3))
    for kind in ("silu", "tanh"):
        results = []
        for forced in (False, True):
            monkeypatch.setattr(glu, "use_custom_op", lambda *t, f=forced: f)
            g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
            y = fused(kind, g, u)
            y.backward(dy)
            results.append((y, g.grad, u.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b)


def test_input_errors_name_both_values():
    a = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"gate shape \(2, 8\) != up shape \(2, 9\)"):
        swiglu(a, torch.randn(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="gate dtype torch.float32 != up dtype torch.bfloat16"):
        swiglu(a, a.to(torch.bfloat16))
    with pytest.raises(ValueError, match="approximate='fast'"):
        geglu(a, a, approximate="fast")


@pytest.mark.parametrize("cls, kind", [(SwiGLUMLP, "silu"), (GeGLUMLP, "tanh")])
def test_mlp_modules_match_reference(cls, kind, gen):
    kwargs = {"approximate": "tanh"} if cls is GeGLUMLP else {}
    m = cls(24, 40, **kwargs)
    assert [k for k in m.state_dict()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert m.gate_proj.weight.shape == (40, 24) and m.down_proj.weight.shape == (24, 40)
    m = m.to(DEVICE)
    x = torch.randn(2, 3, 24, generator=gen).to(DEVICE)
    y = m(x)
    w = {k: v.detach().double() for k, v in m.state_dict().items()}
    x64 = x.double()
    ref = (ref_act(x64 @ w["gate_proj.weight"].T, kind) * (x64 @ w["up_proj.weight"].T)) @ w["down_proj.weight"].T
    assert_close(y, ref, torch.float32, "mlp", scale=10.0)  # three fp32 matmuls besides the fused op
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    assert list(cls(24, 40, bias=True, **kwargs).state_dict())[1] == "gate_proj.bias"
