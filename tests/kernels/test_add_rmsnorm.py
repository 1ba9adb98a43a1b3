"""Fused residual add + RMSNorm against a float64 reference, both outputs and every gradient."""

import pytest
import torch

from mfuwatch.kernels import _norm_launch, add_rmsnorm
from mfuwatch.kernels.add_rmsnorm import add_rms_norm
from tests.helpers.kernel_checks import DEVICE, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ref_add_rms_norm(x, r, w, eps, offset=0.0):
    """float64 reference: h = x + r; (h / sqrt(mean(h^2) + eps) * (w + offset), h)."""
    h = x.double() + r.double()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y if w is None else y * (w.double() + offset)), h


def assert_matches_float64(x, r, w, dtype, gen, use_residual_grad=True, offset=0.0):
    x, r = x.to(DEVICE).detach().requires_grad_(), r.to(DEVICE).detach().requires_grad_()
    w = w.to(DEVICE).detach().requires_grad_() if w is not None else None
    y, h = add_rms_norm(x, r, w, 1e-6, offset)
    assert y.shape == h.shape == x.shape
    dy = torch.randn(y.shape, generator=gen).to(y.dtype).to(DEVICE)
    dh = torch.randn(h.shape, generator=gen).to(h.dtype).to(DEVICE)
    (y * dy).sum().add((h * dh).sum() if use_residual_grad else 0).backward()
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, r, w)]
    yr, hr = ref_add_rms_norm(*leaves, 1e-6, offset)
    (yr * dy.double()).sum().add((hr * dh.double()).sum() if use_residual_grad else 0).backward()
    assert_close(y, yr, dtype, "normed")
    assert_close(h, hr, dtype, "new residual")
    for name, t, ref in zip(("dx", "dresidual", "dw"), (x, r, w), leaves):
        if t is not None:
            assert t.grad.dtype == t.dtype
            assert_close(t.grad, ref.grad, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0, 32), (1, 64), (5, 17), (2, 5120), (2, 3, 40), (70, 24)], ids=str)
def test_forward_backward_match_float64(shape, dtype, gen):
    x = torch.randn(*shape, generator=gen).to(dtype)
    r = torch.randn(*shape, generator=gen).to(dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    assert_matches_float64(x, r, w, dtype, gen)


def test_unused_new_residual_and_gemma_offset(gen):
    x = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    r = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    assert_matches_float64(x, r, (0.1 * torch.randn(96, generator=gen)).to(torch.bfloat16), torch.bfloat16, gen,
                  use_residual_grad=False, offset=1.0)


def test_mixed_dtypes_promote_the_sum(gen):
    # a bf16 branch added to an fp32 residual stream (autocast training): the sum is fp32
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(3, 64, generator=gen).to(DEVICE)
    y, h = add_rms_norm(x, r, torch.ones(64, device=DEVICE))
    assert h.dtype == torch.float32 and y.dtype == torch.float32
    assert_close(h, x.double() + r.double(), torch.float32, "sum")


def test_transposed_inputs_and_wide_rows(monkeypatch, gen):
    monkeypatch.setattr(_norm_launch, "FWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "BWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "LOOP_BLOCK", 64)
    x = torch.randn(200, 21, generator=gen).t()
    r = torch.randn(21, 200, generator=gen)
    assert_matches_float64(x, r, 1.0 + 0.1 * torch.randn(200, generator=gen), torch.float32, gen)


def test_custom_op_path_equals_fast_path(monkeypatch, gen):
    ins = [torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE) for _ in range(3)]
    dy, dh = (torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE) for _ in range(2))
    results = []
    for forced in (False, True):
        monkeypatch.setattr(add_rmsnorm, "use_custom_op", lambda *t, f=forced: f)
        x, r = ins[0].clone().requires_grad_(), ins[1].clone().requires_grad_()
        w = ins[2][0].clone().requires_grad_()
        y, h = add_rms_norm(x, r, w)
        torch.autograd.backward([y, h], [dy, dh])
        results.append((y, h, x.grad, r.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"residual shape \(2, 7\) != input shape \(2, 8\)"):
        add_rms_norm(torch.randn(2, 8, device=DEVICE), torch.randn(2, 7, device=DEVICE), None)
    with pytest.raises(ValueError, match=r"weight shape \(1, 8\) != \(8,\)"):
        add_rms_norm(torch.randn(2, 8, device=DEVICE), torch.randn(2, 8, device=DEVICE), torch.ones(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="0-d tensor"):
        add_rms_norm(torch.tensor(1.0, device=DEVICE), torch.tensor(2.0, device=DEVICE), None)
