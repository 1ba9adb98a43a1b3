"""Every backward launch setting the autotuner may pick gives the float64 gradients, and the partial-sum
reduction is an exact fp32 column sum.

Under the interpreter (and on small shapes on the GPU) the launchers use the first candidate
setting; the others, e.g. two rows per loop step, are only chosen by timing on the GPU. These
tests run each candidate directly, with row counts that leave partial steps and uneven programs.
"""

import pytest
import torch
import torch.nn.functional as F

from mfuwatch.kernels import _norm_launch as K
from mfuwatch.kernels._launch import pow2_at_least
from mfuwatch.kernels._norm_triton import _sum_partials
from tests.helpers.kernel_checks import DEVICE, assert_close


def reference(kind, x, w, b, dy, dres, eps):
    """float64 gradients (dx [+ dres], dw, db) by autograd through the plain formulas."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    if kind == "rms":
        y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    else:
        y = F.layer_norm(x64, (x.shape[-1],), w64, b64, eps)
    y.backward(dy.double())
    dx = x64.grad + (dres.double() if dres is not None else 0)
    return dx, w64.grad, (b64.grad if b is not None else None)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("rows", [1, 7, 13])
@pytest.mark.parametrize("n", [40, 33])
def test_every_backward_setting_matches_float64(kind, rows, n, gen):
    dt = torch.float32
    x = torch.randn(rows, n, generator=gen).to(DEVICE)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE)
    b = (0.1 * torch.randn(n, generator=gen)).to(DEVICE) if kind == "layer" else None
    dy = torch.randn(rows, n, generator=gen).to(DEVICE)
    dres = torch.randn(rows, n, generator=gen).to(DEVICE) if kind == "rms" else None
    is_rms = kind == "rms"
    _, _, mean, rstd = K.norm_fwd(x, w, b, None, n, 1e-5, 0.0, is_rms, False)
    ref = reference(kind, x.cpu(), w.cpu(), b.cpu() if b is not None else None, dy.cpu(),
                    dres.cpu() if dres is not None else None, 1e-5)
    cands = K._bwd_candidates(pow2_at_least(n))
    assert {1, 2} <= {c[2] for c in cands}, "both one and two rows per step are candidates"
    # short rows (block 64 here): the default takes a (1024 // 64 = 16, 64) tile per step on 4 warps
    assert cands[0] == (8, 4, 16, None) and (8, 4, 32, None) in cands
    for c in cands:
        dx = torch.empty_like(x)
        red = K._bwd_launch(dy, x, w, mean if mean is not None else rstd, rstd, dres if dres is not None else dy,
                            dx, n, n, n, n, rows, True, b is not None, is_rms, dres is not None, False, 0.0, dt,
                            False, 2, c)
        dw, db = red if b is not None else (red, None)
        assert_close(dx, ref[0], dt, f"dx {c}")
        assert_close(dw, ref[1], dt, f"dw {c}")
        if b is not None:
            assert_close(db, ref[2], dt, f"db {c}")


@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_parts,n", [(1, 5), (33, 70), (70, 129), (130, 40)])
def test_sum_partials_is_the_fp32_column_sum_of_each_set(n_parts, n, out_dtype, block_n, gen):
    part = torch.randn(2, n_parts, n, generator=gen).to(DEVICE)
    out0 = torch.full((n,), float("nan"), dtype=out_dtype, device=DEVICE)
    out1 = torch.full((n,), float("nan"), dtype=out_dtype, device=DEVICE)
    ncb = -(-n // block_n)
    _sum_partials[(2 * ncb,)](part, out0, out1, n_parts, n, ncb, **K._SUM_CONSTS[block_n], num_warps=4)
    ref = part.double().sum(1).cpu()
    assert_close(out0, ref[0], out_dtype, "set 0")
    assert_close(out1, ref[1], out_dtype, "set 1")


def test_sum_block_n_gives_every_sm_a_program():
    """The widest column block that still makes one program per SM (132 on the H200), else the narrowest."""
    assert K.sum_block_n(2048, 132) == 16  # 128 programs: the narrowest tile
    assert K.sum_block_n(2 * 4096, 132) == 32  # LayerNorm's two sets at N = 4096: 256 programs
    assert K.sum_block_n(8192, 132) == 32
    assert K.sum_block_n(16384, 132) == 64
    assert K.sum_block_n(64 * 132, 132) == 64 and K.sum_block_n(64 * 132 - 1, 132) == 32


@pytest.mark.parametrize("n", [4096, 8192])
def test_wide_row_backward_settings_match_float64(n, gen):
    """The settings added for N = 4096/8192 (16 warps, two rows per step, a register cap at 4096) launch through
    the same path and give the float64 gradients (the interpreter ignores the cap; the GPU suite runs it)."""
    dt, rows = torch.float32, 5
    x = torch.randn(rows, n, generator=gen).to(DEVICE)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE)
    dy = torch.randn(rows, n, generator=gen).to(DEVICE)
    _, _, _, rstd = K.norm_fwd(x, w, None, None, n, 1e-5, 0.0, True, False)
    ref = reference("rms", x.cpu(), w.cpu(), None, dy.cpu(), None, 1e-5)
    cands = K._bwd_candidates(pow2_at_least(n))
    extra = [c for c in cands if c[1] == 16 and c[2] == 2]
    assert extra and all(len(c) == 4 for c in cands)
    assert (n == 4096) == any(c[3] == 64 for c in cands), "the register cap is a candidate at N = 4096 only"
    for c in extra:
        dx = torch.empty_like(x)
        dw = K._bwd_launch(dy, x, w, rstd, rstd, dy, dx, n, n, n, n, rows, True, False, True, False, False, 0.0, dt,
                           False, 2, c)
        assert_close(dx, ref[0], dt, f"dx {c}")
        assert_close(dw, ref[1], dt, f"dw {c}")


@pytest.mark.parametrize("kind", ["rms", "layer", "add"])
def test_every_forward_setting_matches_float64(kind, monkeypatch, gen):
    """Each forward candidate, fused or looped (chunks of 2,048-4,096 over a 4,100-wide row: a partial last chunk),
    gives the float64 normalisation, statistics and residual sum."""
    n, rows, dt, eps = 4100, 3, torch.float32, 1e-5
    x = torch.randn(rows, n, generator=gen).to(DEVICE) * 3 + 1
    r = torch.randn(rows, n, generator=gen).to(DEVICE) if kind == "add" else None
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE)
    b = (0.1 * torch.randn(n, generator=gen)).to(DEVICE) if kind == "layer" else None
    s64 = x.cpu().double() + (r.cpu().double() if r is not None else 0)
    if kind == "layer":
        mu = s64.mean(-1, keepdim=True)
        rstd = torch.rsqrt((s64 - mu).pow(2).mean(-1, keepdim=True) + eps)
        ref = (s64 - mu) * rstd * w.cpu().double() + b.cpu().double()
    else:
        rstd = torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
        ref = s64 * rstd * w.cpu().double()
    cands = K._fwd_candidates(pow2_at_least(n))
    assert sum(1 for c in cands if c[2]) >= 2, "looped settings are candidates at this width"
    for c in cands:
        K._FWD_SETTINGS.clear()
        monkeypatch.setattr(K, "tuned", lambda *a, c=c, **k: c)
        y, s, _, got_rstd = K.norm_fwd(x, w, b, r, n, eps, 0.0, kind != "layer", False)
        assert_close(y, ref, dt, f"y {c}")
        assert_close(got_rstd, rstd.squeeze(-1), dt, f"rstd {c}")
        if r is not None:
            assert_close(s, s64, dt, f"s {c}")
    K._FWD_SETTINGS.clear()
