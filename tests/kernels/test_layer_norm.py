"""LayerNorm kernels against a float64 reference (forward and every gradient), on fresh random inputs."""

import importlib
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mfuwatch.kernels import _norm_launch
from mfuwatch.kernels.layer_norm import LayerNorm, layer_norm
from tests.helpers.kernel_checks import DEVICE, assert_close

layer_norm_mod = importlib.import_module("mfuwatch.kernels.layer_norm")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ref_layer_norm(x, n_dims, w, b, eps):
    """float64 reference: (x - mean) / sqrt(biased var + eps) * w + b over the last n_dims dims."""
    x = x.double()
    dims = tuple(range(x.dim() - n_dims, x.dim()))
    mu = x.mean(dims, keepdim=True)
    var = (x - mu).pow(2).mean(dims, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


def assert_matches_float64(x, shape, w, b, dtype, gen, eps=1e-5):
    x = x.to(DEVICE).detach().requires_grad_()
    w = w.to(DEVICE).detach().requires_grad_() if w is not None else None
    b = b.to(DEVICE).detach().requires_grad_() if b is not None else None
    y = layer_norm(x, shape, w, b, eps)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn(y.shape, generator=gen).to(dtype).to(DEVICE)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    n_dims = 1 if isinstance(shape, int) else len(shape)
    ref_layer_norm(leaves[0], n_dims, leaves[1], leaves[2], eps).backward(dy.double())
    assert_close(y, ref_layer_norm(x.detach(), n_dims, w, b, eps), dtype, "y")
    for name, t, r in zip(("dx", "dw", "db"), (x, w, b), leaves):
        if t is not None:
            assert t.grad.dtype == t.dtype
            assert_close(t.grad, r.grad, dtype, name)


SHAPES = [(0, 64), (1, 64), (5, 17), (3, 1536), (2, 5120), (2, 3, 40), (70, 24)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward_match_float64(shape, dtype, gen):
    # a mean far from 0 checks that the variance is centred before squaring
    x = (torch.randn(*shape, generator=gen) * 2.0 + 3.0).to(dtype)
    n = shape[-1]
    w = (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(n, generator=gen)).to(dtype)
    assert_matches_float64(x, (n,), w, b, dtype, gen)


@pytest.mark.parametrize("affine", ["none", "weight_only", "both"])
def test_affine_variants_and_transposed_input(affine, gen):
    x = torch.randn(48, 6, generator=gen).t()  # (6, 48) with last-dim stride 6: copied, not misread
    w = 1.0 + 0.1 * torch.randn(48, generator=gen) if affine != "none" else None
    b = 0.1 * torch.randn(48, generator=gen) if affine == "both" else None
    assert_matches_float64(x, 48, w, b, torch.float32, gen)


def test_multi_dim_normalized_shape(gen):
    x = torch.randn(3, 4, 8, generator=gen)
    assert_matches_float64(x, (4, 8), torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen),
                  torch.float32, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_looped_path_for_wide_rows(monkeypatch, dtype, gen):
    monkeypatch.setattr(_norm_launch, "FWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "BWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "LOOP_BLOCK", 64)
    x = (torch.randn(21, 300, generator=gen) + 5.0).to(dtype)
    w = (1.0 + 0.1 * torch.randn(300, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(300, generator=gen)).to(dtype)
    assert_matches_float64(x, (300,), w, b, dtype, gen)


def test_bf16_rows_with_large_outliers(gen):
    x = torch.randn(4, 1536, generator=gen)
    x[:, 3] = 2.0e4
    x[3, 900] = -5.0e4
    x = x.to(torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(1536, generator=gen)).to(torch.bfloat16)
    assert_matches_float64(x, (1536,), w, torch.zeros(1536, dtype=torch.bfloat16), torch.bfloat16, gen)


def test_custom_op_path_equals_fast_path(monkeypatch, gen):
    x = torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    w = torch.randn(40, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    b = torch.randn(40, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    dy = torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    results = []
    for forced in (False, True):
        monkeypatch.setattr(layer_norm_mod, "use_custom_op", lambda *t, f=forced: f)
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = layer_norm(leaves[0], (40,), leaves[1], leaves[2])
        y.backward(dy)
        results.append([y] + [t.grad for t in leaves])
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_module_matches_torch_layernorm(gen):
    ref = nn.LayerNorm(32, eps=1e-6)
    ours = LayerNorm(32, eps=1e-6)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32, generator=gen))
        ref.bias.copy_(torch.randn(32, generator=gen))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 32, generator=gen)
    assert_close(ours.to(DEVICE)(x.to(DEVICE)), F.layer_norm(x.double(), (32,), ref.weight.double(),
                                                             ref.bias.double(), 1e-6), torch.float32, "module")
    no_bias = LayerNorm(32, bias=False)
    assert list(no_bias.state_dict()) == list(nn.LayerNorm(32, bias=False).state_dict()) == ["weight"]
    assert list(LayerNorm(32, elementwise_affine=False).state_dict()) == []


def test_shape_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 8\) does not end with normalized_shape \(9,\)"):
        layer_norm(torch.randn(2, 8, device=DEVICE), (9,))
    with pytest.raises(ValueError, match=r"bias shape \(7,\) != normalized_shape \(8,\)"):
        layer_norm(torch.randn(2, 8, device=DEVICE), 8, torch.ones(8, device=DEVICE), torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight shape \(8, 1\) != normalized_shape \(8,\)"):
        layer_norm(torch.randn(2, 8, device=DEVICE), 8, torch.ones(8, 1, device=DEVICE))


@pytest.mark.parametrize("path", ["function", "custom_op", "torch_fallback"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, None])
def test_bias_gradient_is_written_in_the_bias_dtype(path, w_dtype, monkeypatch, gen):
    """An fp32 bias next to a bf16 weight (or no weight, bf16 input): db is the fp32 column sum of dy, rounded
    once to fp32, not rounded to bf16 on the way (which gave 3-4e-3 relative error)."""
    if path == "custom_op":
        monkeypatch.setattr(layer_norm_mod, "use_custom_op", lambda *t: True)
    elif path == "torch_fallback":
        monkeypatch.setattr(_norm_launch, "use_triton", lambda t: False)
    n = 48
    x = torch.randn(300, n, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    w = torch.ones(n, dtype=w_dtype).to(DEVICE).requires_grad_() if w_dtype is not None else None
    b = torch.zeros(n).to(DEVICE).requires_grad_()
    dy = torch.randn(300, n, generator=gen).to(DEVICE, torch.bfloat16)
    layer_norm_mod.layer_norm(x, (n,), w, b).backward(dy)
    ref = dy.double().sum(0)
    assert b.grad.dtype == torch.float32
    assert float((b.grad.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    if w is not None:
        assert w.grad.dtype == torch.bfloat16
