"""Launchers of the row-norm kernels (:mod:`._norm_triton`): views, outputs, launch settings, CPU fallback.

:func:`norm_fwd` and :func:`norm_bwd` serve RMSNorm, LayerNorm and the residual
add + RMSNorm. They view inputs as ``(rows, N)`` (:func:`._common.as_rows`),
allocate the outputs, pick a launch setting (:func:`._common.tuned`; the
candidate lists below), launch on the tensors' device, and reduce the fp32
weight/bias partial sums. CPU tensors without the Triton interpreter take
:func:`_torch_fwd`/:func:`_torch_bwd`, the same math in PyTorch.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from ._common import as_rows, device_guard, pow2_at_least, row_bucket, sm_count, tuned, use_triton
from ._norm_triton import (_norm_bwd_fused, _norm_bwd_looped, _norm_fwd_fused, _norm_fwd_looped,
                           _norm_sum_partials)

#: Widest row (elements) kept in registers by the forward / backward; wider rows loop.
FWD_MAX_FUSED = 32768
BWD_MAX_FUSED = 16384
#: Chunk width (elements) of the looped kernels.
LOOP_BLOCK = 4096


def _reduce_partials(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of the fp32 partials ``part`` (programs, N), returned as (N,) in ``dtype``."""
    p, n = part.shape
    out = torch.empty(n, dtype=dtype, device=part.device)
    block_n = min(32, pow2_at_least(n))  # 128-byte row segments: coalesced, and n/32 programs
    _norm_sum_partials[(triton.cdiv(n, block_n),)](part, out, p, n, BLOCK_P=64, BLOCK_N=block_n, num_warps=4)
    return out


def _fwd_candidates(block_n: int):
    """(ROWS, num_warps) settings to try for the fused forward; the heuristic default first.

    4 to 16 elements per thread: more costs registers (fewer resident programs,
    fewer bytes in flight), fewer leaves warps idle on short rows (sm_90
    compiles of these settings use 30-110 registers per thread).
    """
    base = max(1, 2048 // block_n)
    out = []
    for rows in (base, base * 2):
        tile = rows * block_n
        default_w = max(1, min(32, tile // 512))
        ws = [default_w] + [w for w in (4, 8, 16, 32) if w != default_w and 4 <= tile // (32 * w) <= 16]
        out += [(rows, w) for w in ws]
    return out


def _bwd_candidates(block_n: int):
    """(programs per SM, num_warps) settings for the fused backward; the heuristic default first.

    At most 8 elements of a row per thread: the loop keeps x, dy, w, xhat and
    the dw/db accumulators in registers, and 16 elements per thread already
    take 150-250 registers on sm_90 (one resident program per SM).
    """
    default_w = max(1, min(32, block_n // 256))
    ws = [default_w] + [w for w in (4, 8, 16, 32) if w != default_w and 2 <= block_n // (32 * w) <= 8]
    return [(per_sm, w) for w in ws[:2] for per_sm in (4, 2, 8)]


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(name: str, t: torch.Tensor, device: Optional[torch.device] = None) -> None:
    """ValueError unless ``t`` is fp32/fp16/bf16 (and on ``device``): the kernels compute in fp32."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} is not supported (float32, float16 or bfloat16)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the input is on {device}")


def norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             residual: Optional[torch.Tensor], n: int, eps: float, offset: float, is_rms: bool,
             llama_cast: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Forward of a row norm over the trailing ``n`` elements of ``x``.

    Args:
        x: (..., N-shaped trailing dims), fp32/fp16/bf16, any strides.
        weight, bias: ``n`` elements each, or None.
        residual: same shape as ``x`` (add variant) or None.
    Returns:
        ``(y, s, mean, rstd)``: ``y`` shaped like ``x``, in ``x``'s dtype, or
        promote(s dtype, weight dtype) under Llama casting with a weight;
        ``s = x + residual`` (dtype promote(x, residual)) or None; ``mean``
        (LayerNorm only) and ``rstd`` as fp32 ``(rows,)``.
    Raises:
        ValueError: shapes that do not match (both sizes are printed), a dtype other
        than fp32/fp16/bf16, or tensors on different devices.
    """
    _check_dtype("input", x)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
        _check_dtype("residual", residual, x.device)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            if p.numel() != n:
                raise ValueError(f"{name} has {p.numel()} elements, expected {n} (the normalised size)")
            _check_dtype(name, p, x.device)
    x2, sx = as_rows(x, n)
    rows = x2.shape[0]
    s_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    y_dtype = torch.promote_types(s_dtype, weight.dtype) if (llama_cast and weight is not None) else s_dtype
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device) if residual is not None else None
    mean = None if is_rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, s, mean, rstd
    if not use_triton(x):
        return _torch_fwd(x2, residual, weight, bias, n, eps, offset, is_rms, llama_cast, y, s, mean, rstd)
    r2, sr = as_rows(residual, n) if residual is not None else (x2, sx)
    y2 = y.view(rows, n)
    s2 = s.view(rows, n) if s is not None else y2
    w = weight.reshape(n) if weight is not None else x2
    b = bias.reshape(n) if bias is not None else x2
    args = (x2, r2, w, b, y2, s2, mean if mean is not None else rstd, rstd, sx, sr, n, n, rows, n, eps, offset)
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None,
                 HAS_RES=residual is not None, LLAMA_CAST=llama_cast)
    with device_guard(x):
        if n > FWD_MAX_FUSED:
            _norm_fwd_looped[(rows,)](*args, **flags, BLOCK_N=LOOP_BLOCK, num_warps=8)
        else:
            block_n = pow2_at_least(n)

            def launch(c):
                _norm_fwd_fused[(triton.cdiv(rows, c[0]),)](*args, **flags, ROWS=c[0], BLOCK_N=block_n, num_warps=c[1])

            launch(tuned("norm_fwd", x.device, (n, x.dtype, y_dtype, tuple(flags.values()), row_bucket(rows)),
                         lambda: _fwd_candidates(block_n), launch, rows * n))
    return y, s, mean, rstd


def norm_bwd(dy: torch.Tensor, xs: torch.Tensor, weight: Optional[torch.Tensor], has_bias: bool,
             mean: Optional[torch.Tensor], rstd: torch.Tensor, dres: Optional[torch.Tensor], n: int,
             offset: float, is_rms: bool, llama_cast: bool,
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of :func:`norm_fwd`.

    Args:
        dy: gradient of ``y``, shaped like ``xs`` (any strides).
        xs: the normalised input (``x``, or ``s`` for the add variant).
        mean, rstd: from the forward (fp32, one per row).
        dres: gradient of the new residual ``s`` or None.
    Returns:
        ``(dxs, dw, db)``: ``dxs`` shaped like ``xs`` in its dtype; ``dw`` shaped
        like the weight, ``db`` as ``(N,)``, both in the weight's dtype (None
        when absent), reduced over rows in fp32.
    """
    if dy.shape != xs.shape:
        raise ValueError(f"gradient shape {tuple(dy.shape)} != input shape {tuple(xs.shape)}")
    _check_dtype("gradient", dy, xs.device)
    x2, sx = as_rows(xs, n)
    rows = x2.shape[0]
    dx = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device)
    p_dtype = weight.dtype if weight is not None else xs.dtype
    if rows == 0:
        dw = torch.zeros(weight.shape, dtype=p_dtype, device=xs.device) if weight is not None else None
        db = torch.zeros(n, dtype=p_dtype, device=xs.device) if has_bias else None
        return dx, dw, db
    dy2, sdy = as_rows(dy, n)
    if not use_triton(xs):
        return _torch_bwd(dy2, x2, weight, has_bias, mean, rstd, dres, n, offset, is_rms, llama_cast, dx)
    dres2, sdr = as_rows(dres, n) if dres is not None else (dy2, sdy)
    dx2 = dx.view(rows, n)
    w = weight.reshape(n) if weight is not None else x2
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=has_bias, HAS_DRES=dres is not None,
                 LLAMA_CAST=llama_cast)
    looped = n > BWD_MAX_FUSED
    alloc = torch.zeros if looped else torch.empty
    n_sm = sm_count(xs.device)

    def launch(c):
        rpp = triton.cdiv(rows, min(rows, c[0] * n_sm))
        grid = triton.cdiv(rows, rpp)
        dw_part = alloc((grid, n), dtype=torch.float32, device=xs.device) if weight is not None else dx2
        db_part = alloc((grid, n), dtype=torch.float32, device=xs.device) if has_bias else dx2
        args = (dy2, x2, w, mean if mean is not None else rstd, rstd, dres2, dx2, dw_part, db_part,
                sdy, sx, sdr, n, rows, n, rpp, offset)
        if looped:
            _norm_bwd_looped[(grid,)](*args, **flags, BLOCK_N=LOOP_BLOCK, num_warps=8)
        else:
            _norm_bwd_fused[(grid,)](*args, **flags, BLOCK_N=pow2_at_least(n), num_warps=c[1])
        # the reduction of the partials is part of what a setting costs (more programs, more partials)
        dw = _reduce_partials(dw_part, p_dtype).view(weight.shape) if weight is not None else None
        db = _reduce_partials(db_part, p_dtype) if has_bias else None
        return dw, db

    with device_guard(xs):
        if looped:
            cfg = (4, 8)
        else:
            cfg = tuned("norm_bwd", xs.device, (n, xs.dtype, tuple(flags.values()), row_bucket(rows)),
                        lambda: _bwd_candidates(pow2_at_least(n)), launch, rows * n)
        dw, db = launch(cfg)
    return dx, dw, db


# --------------------------------------------------------------------------------------------
# PyTorch fallback for CPU tensors when Triton cannot run (no GPU, interpreter off): same math.
# --------------------------------------------------------------------------------------------

def _torch_fwd(x2, residual, weight, bias, n, eps, offset, is_rms, llama_cast, y, s, mean, rstd):
    xs = x2
    if residual is not None:
        xs = (x2.float() + residual.reshape(-1, n).float()).to(s.dtype)
        s.view(-1, n).copy_(xs)
    xf = xs.float()
    if is_rms:
        xc = xf
    else:
        mu = xf.mean(-1)
        mean.copy_(mu)
        xc = xf - mu[:, None]
    r = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    rstd.copy_(r)
    out = xc * r[:, None]
    if weight is not None:
        if llama_cast:
            out = out.to(xs.dtype).float()
        out = out * (weight.reshape(n).float() + offset)
    if bias is not None:
        out = out + bias.reshape(n).float()
    y.view(-1, n).copy_(out)
    return y, s, mean, rstd


def _torch_bwd(dy2, x2, weight, has_bias, mean, rstd, dres, n, offset, is_rms, llama_cast, dx):
    xf = x2.float()
    dyf = dy2.float()
    xhat = (xf if is_rms else xf - mean[:, None]) * rstd[:, None]
    dw = db = None
    if weight is not None:
        g = dyf * (weight.reshape(n).float() + offset)
        xw = xhat.to(x2.dtype).float() if llama_cast else xhat
        dw = (dyf * xw).sum(0).to(weight.dtype).view(weight.shape)
    else:
        g = dyf
    if has_bias:
        db = dyf.sum(0).to(weight.dtype if weight is not None else x2.dtype)
    c1 = (g * xhat).mean(-1, keepdim=True)
    d = g - xhat * c1 if is_rms else g - g.mean(-1, keepdim=True) - xhat * c1
    d = d * rstd[:, None]
    if dres is not None:
        d = d + dres.reshape(-1, n).float()
    dx.view(-1, n).copy_(d)
    return dx, dw, db
