"""Launchers of the row-norm kernels (:mod:`._norm_triton`): views, outputs, launch settings, CPU fallback.

:func:`norm_fwd` and :func:`norm_bwd` serve RMSNorm, LayerNorm and the residual
add + RMSNorm. They view inputs as ``(rows, N)`` (:func:`._launch.as_rows`),
allocate the outputs, pick a launch setting (:func:`._tuning.tuned`; the
candidate lists below), launch on the tensors' device, and reduce the fp32
weight/bias partial sums. CPU tensors without the Triton interpreter take
:func:`_torch_fwd`/:func:`_torch_bwd`, the same math in PyTorch.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch

from ._launch import Launcher, as_rows, cdiv, kernel_rows, needs_device_switch, pow2_at_least, sm_count, use_triton
from ._tuning import MIN_TUNE_ELEMENTS, row_bucket, tuned
from ._norm_triton import _norm_bwd_fused, _norm_bwd_looped, _norm_fwd_fused, _norm_fwd_looped, _sum_partials

_FWD = Launcher(_norm_fwd_fused)
_FWD_LOOPED = Launcher(_norm_fwd_looped)
_BWD = Launcher(_norm_bwd_fused)
_BWD_LOOPED = Launcher(_norm_bwd_looped)
_SUM = Launcher(_sum_partials)

#: Widest row (elements) kept in registers by the forward / backward; wider rows loop.
FWD_MAX_FUSED = 32768
BWD_MAX_FUSED = 16384
#: Chunk width (elements) of the looped kernels.
LOOP_BLOCK = 4096


def _fwd_candidates(block_n: int):
    """(ROWS, num_warps, loop chunk) settings to try for the forward; the heuristic default first.

    Fused (chunk 0): the row in registers, ``ROWS`` rows per program, 4 to 16
    elements per thread: more costs registers (fewer resident programs, fewer
    bytes in flight), fewer leaves warps idle on short rows (sm_90 compiles of
    these settings use 30-110 registers per thread). Looped (chunk > 0, rows of
    more than 1,024 elements): :func:`._norm_triton._norm_fwd_looped` with the row
    width compiled in, one row per program walked in chunks of that many
    elements, the later passes from L2 (why both: ``docs/kernels.md``, launch settings).
    """
    base = max(1, 2048 // block_n)
    out = []
    for rows in (base, base * 2):
        tile = rows * block_n
        default_w = max(1, min(32, tile // 512))
        ws = [default_w] + [w for w in (4, 8, 16, 32) if w != default_w and 4 <= tile // (32 * w) <= 16]
        out += [(rows, w, 0) for w in ws]
    if block_n >= 2048:
        out += [(1, w, chunk) for chunk, w in _LOOP_FWD if chunk <= block_n]
    return out


#: (chunk, warps) settings of the looped forward offered to the tuner for rows of more than 1,024 elements.
_LOOP_FWD = ((2048, 8), (4096, 8), (4096, 16))


def _bwd_candidates(block_n: int):
    """(programs per SM, num_warps, rows per step, maxnreg) settings for the fused backward; the default first.

    At most 8 elements of a row per thread by default: the loop keeps x, dy, w,
    xhat and the dw/db accumulators in registers, and 16 elements per thread
    already take 150-250 registers on sm_90 (one resident program per SM). Two
    rows per step double the loads each program has in flight, for more
    registers. Two extra settings: at N = 4096, two rows per step on 16 warps with
    the registers capped at 64 (``maxnreg``, two programs per SM); at N = 8192, two
    rows per step on 16 warps. Rows of at most 512 elements first try ``1024 // N`` (and twice as many) rows per
    step on 4 warps with 8 or 16 programs per SM. The tuner measures and keeps the fastest.
    """
    default_w = max(1, min(32, block_n // 256))
    ws = [default_w] + [w for w in (4, 8, 16, 32) if w != default_w and 2 <= block_n // (32 * w) <= 8]
    rows = (1, 2) if block_n <= 8192 else (1,)
    out = []
    if block_n <= 512:  # short rows (a head's q/k norm, N = 128): a (1024 // N, N) tile per step on 4 warps, 8
        # programs per SM; one row per step on one warp (the default before) leaves each program one dependent
        # 256-byte load per step at N = 128 (Qwen3's q/k norms: docs/benchmarks.md, issue 27 run 10)
        r = 1024 // block_n
        out += [(8, 4, r, None), (16, 4, r, None), (8, 4, 2 * r, None)]
    out += [(per_sm, w, r, None) for r in rows for w in ws[:2] for per_sm in (2, 4, 1)]
    if block_n == 4096:
        out.append((2, 16, 2, 64))
    elif block_n == 8192:
        out += [(2, 16, 2, None), (1, 16, 2, None)]
    return out


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_param(name: str, p: torch.Tensor, n: int, device: torch.device) -> None:
    """ValueError unless the weight/bias ``p`` has ``n`` elements, a supported dtype, and is on ``device``."""
    if p.numel() != n:
        raise ValueError(f"{name} has {p.numel()} elements, expected {n} (the normalised size)")
    _check_dtype(name, p, device)


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
    # Every line here runs once per call: at small shapes the host time of this function is the
    # op's time, so checks are cheap comparisons and launch settings one dict lookup.
    _check_dtype("input", x)
    dev = x.device
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
        _check_dtype("residual", residual, dev)
    if weight is not None:
        _check_param("weight", weight, n, dev)
    if bias is not None:
        _check_param("bias", bias, n, dev)
    if n <= 0 or x.numel() % n:
        as_rows(x, n)  # raises the ValueError naming the shape
    rows = x.numel() // n
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y_dtype = torch.promote_types(s_dtype, weight.dtype) if (llama_cast and weight is not None) else s_dtype
    y = torch.empty(x.shape, dtype=y_dtype, device=dev)
    s = torch.empty(x.shape, dtype=s_dtype, device=dev) if residual is not None else None
    mean = None if is_rms else torch.empty(rows, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return y, s, mean, rstd
    if not use_triton(x):
        return _torch_fwd(as_rows(x, n)[0], residual, weight, bias, n, eps, offset, is_rms, llama_cast, y, s, mean,
                          rstd)
    x2, sx = kernel_rows(x, n)  # y and s are new contiguous tensors: handed over as they are, row stride n
    r2, sr = kernel_rows(residual, n) if residual is not None else (x2, sx)
    y2 = y
    s2 = s if s is not None else y
    w = _vec(weight, n) if weight is not None else x2
    b = _vec(bias, n) if bias is not None else x2
    args = (x2, r2, w, b, y2, s2, mean if mean is not None else rstd, rstd, sx, sr, n, n, rows, n, eps, offset)
    has_w, has_b, has_res = weight is not None, bias is not None, residual is not None
    if n > FWD_MAX_FUSED:
        if needs_device_switch(x):
            with torch.cuda.device(dev):
                _launch_fwd_looped(rows, args, is_rms, has_w, has_b, has_res, llama_cast)
        else:
            _launch_fwd_looped(rows, args, is_rms, has_w, has_b, has_res, llama_cast)
        return y, s, mean, rstd
    block_n = pow2_at_least(n)
    key = (dev.index, n, x.dtype, y_dtype, is_rms, has_w, has_b, has_res, llama_cast, row_bucket(rows),
           rows * n >= MIN_TUNE_ELEMENTS)
    switch = needs_device_switch(x)
    plan = _FWD_SETTINGS.get(key)
    if plan is None:
        flags = dict(IS_RMS=is_rms, HAS_W=has_w, HAS_B=has_b, HAS_RES=has_res, LLAMA_CAST=llama_cast)

        def plan_of(c):
            if c[2]:  # looped: one row per program, chunks of c[2] elements
                return (_FWD_LOOPED, 1, dict(flags, BLOCK_N=c[2], N_FIXED=n), c[1])
            return (_FWD, c[0], dict(flags, ROWS=c[0], BLOCK_N=block_n), c[1])

        def launch(c):
            p = plan_of(c)
            p[0](cdiv(rows, p[1]), args, p[2], p[3])

        with (torch.cuda.device(dev) if switch else contextlib.nullcontext()):
            c = tuned("norm_fwd", dev, (n, x.dtype, y_dtype, tuple(flags.values()), row_bucket(rows)),
                      lambda: _fwd_candidates(block_n), launch, rows * n)
        plan = plan_of(c)
        if not _capturing(x):
            _FWD_SETTINGS[key] = plan
    if switch:
        with torch.cuda.device(dev):
            plan[0](cdiv(rows, plan[1]), args, plan[2], plan[3])
    else:
        plan[0](cdiv(rows, plan[1]), args, plan[2], plan[3])
    return y, s, mean, rstd


def _launch_fwd_looped(rows, args, is_rms, has_w, has_b, has_res, llama_cast):
    _FWD_LOOPED(rows, args, dict(IS_RMS=is_rms, HAS_W=has_w, HAS_B=has_b, HAS_RES=has_res, LLAMA_CAST=llama_cast,
                                 BLOCK_N=LOOP_BLOCK, N_FIXED=0), 8)


def _vec(p: torch.Tensor, n: int) -> torch.Tensor:
    """A weight/bias whose ``n`` elements are contiguous (the kernels read ``W + cols``; the shape is not used)."""
    if p.is_contiguous():
        return p
    v = p.reshape(n)
    return v if v.stride(0) == 1 or n == 1 else v.contiguous()


def _capturing(t: torch.Tensor) -> bool:
    """True during CUDA-graph capture (the tuner then returns its default untimed: not cached)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


#: Launch settings by cheap key, filled on first use: a cache hit is one dict lookup.
_FWD_SETTINGS: Dict[tuple, Tuple[Launcher, int, Dict[str, object], int]] = {}  # (kernel, rows/program, consts, warps)
_BWD_SETTINGS: Dict[tuple, Tuple[int, int, int, Optional[int]]] = {}  # (per SM, warps, rows per step, maxnreg)


def _bwd_launch(dy2, x2, w, mean, rstd, dres2, dx2, sdy, sx, sdr, n, rows, has_w, has_b, is_rms, has_dres,
                llama_cast, offset, p_dtype, looped, n_sm, c, b_dtype=None, dx_copy=None):
    """The backward with setting ``c``: dx into ``dx2`` (and into ``dx_copy`` too when given: contiguous, like
    ``dx2``); returns None, dw or db, or (dw, db): dw in ``p_dtype``, db in ``b_dtype`` (``p_dtype`` when None).

    Two launches: the row kernel, which writes dx and one fp32 partial row of
    dw/db per program into a ``(sets, programs, N)`` buffer, and
    :func:`._norm_triton._sum_partials`, which sums the partials over
    programs into new ``(N,)`` tensors (one per set: dw and db never share
    storage, as parameters' gradients must not).
    """
    rpp = cdiv(rows, min(rows, c[0] * n_sm))
    grid = cdiv(rows, rpp)
    nparts = has_w + has_b
    # dw's partials first, then db's from element db_off (one buffer, no views: each view costs host time)
    part = ((torch.zeros if looped else torch.empty)((nparts, grid, n), dtype=torch.float32, device=x2.device)
            if nparts else None)
    db_off = (nparts - 1) * grid * n if has_b else 0
    args = (dy2, x2, w, mean, rstd, dres2, dx2, dx2 if dx_copy is None else dx_copy, part if nparts else dx2,
            sdy, sx, sdr, n, rows, n, rpp, db_off, offset)
    flags = dict(IS_RMS=is_rms, HAS_W=has_w, HAS_B=has_b, HAS_DRES=has_dres, LLAMA_CAST=llama_cast,
                 HAS_DX2=dx_copy is not None)
    if looped:
        _BWD_LOOPED(grid, args, dict(flags, BLOCK_N=LOOP_BLOCK), 8)
    else:
        _BWD(grid, args, dict(flags, ROWS=c[2], BLOCK_N=pow2_at_least(n)), c[1], c[3])
    if part is None:
        return None
    b_dtype = b_dtype or p_dtype
    out0 = torch.empty(n, dtype=p_dtype if has_w else b_dtype, device=x2.device)
    out1 = torch.empty(n, dtype=b_dtype, device=x2.device) if nparts == 2 else out0
    block_n = sum_block_n(nparts * n, n_sm)
    ncb = cdiv(n, block_n)
    _SUM(ncb * nparts, (part, out0, out1, grid, n, ncb), _SUM_CONSTS[block_n], 4)
    return (out0, out1) if nparts == 2 else out0


#: Tiles of :func:`._norm_triton._sum_partials` as {columns: constexprs}: partial rows x columns summed per
#: step by 4 warps, 16 elements per thread. One program per block of columns (per set), so narrow rows need
#: narrow blocks to give about every SM a program.
_SUM_CONSTS = {16: {"BLOCK_P": 128, "BLOCK_N": 16}, 32: {"BLOCK_P": 64, "BLOCK_N": 32},
               64: {"BLOCK_P": 32, "BLOCK_N": 64}}


def sum_block_n(columns: int, n_sm: int) -> int:
    """Column block of the partial-sum kernel: the widest of 64/32/16 that still makes ``n_sm`` programs
    for ``columns`` columns in all (16 when none does)."""
    for block_n in (64, 32):
        if columns >= block_n * n_sm:
            return block_n
    return 16


def norm_bwd(dy: torch.Tensor, xs: torch.Tensor, weight: Optional[torch.Tensor], has_bias: bool,
             mean: Optional[torch.Tensor], rstd: torch.Tensor, dres: Optional[torch.Tensor], n: int,
             offset: float, is_rms: bool, llama_cast: bool, b_dtype: Optional[torch.dtype] = None,
             dx_copy: Optional[torch.Tensor] = None,
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of :func:`norm_fwd`.

    Args:
        dy: gradient of ``y``, shaped like ``xs`` (any strides).
        xs: the normalised input (``x``, or ``s`` for the add variant).
        mean, rstd: from the forward (fp32, one per row).
        dres: gradient of the new residual ``s`` or None.
        b_dtype: the bias's dtype (LayerNorm with a bias); None means the weight's
            dtype, or ``xs``'s without a weight.
        dx_copy: None, or a new contiguous tensor shaped like ``xs`` in its dtype
            that the kernel also writes ``dxs`` into: a second gradient tensor for one
            more write, where a copy would read and write (see :mod:`.add_rms_norm`).
    Returns:
        ``(dxs, dw, db)``: ``dxs`` shaped like ``xs`` in its dtype; ``dw`` shaped
        like the weight, in its dtype; ``db`` as ``(N,)`` in ``b_dtype`` (None
        when absent); both reduced over rows in fp32 and rounded once.
    """
    if dy.shape != xs.shape:
        raise ValueError(f"gradient shape {tuple(dy.shape)} != input shape {tuple(xs.shape)}")
    dev = xs.device
    _check_dtype("gradient", dy, dev)
    if n <= 0 or xs.numel() % n:
        as_rows(xs, n)  # raises the ValueError naming the shape
    rows = xs.numel() // n
    dx = torch.empty(xs.shape, dtype=xs.dtype, device=dev)
    p_dtype = weight.dtype if weight is not None else xs.dtype
    b_dtype = b_dtype or p_dtype
    if rows == 0:
        dw = torch.zeros(weight.shape, dtype=p_dtype, device=dev) if weight is not None else None
        db = torch.zeros(n, dtype=b_dtype, device=dev) if has_bias else None
        return dx, dw, db
    if not use_triton(xs):
        out = _torch_bwd(as_rows(dy, n)[0], as_rows(xs, n)[0], weight, has_bias, mean, rstd, dres, n, offset,
                         is_rms, llama_cast, dx, b_dtype)
        if dx_copy is not None:
            dx_copy.copy_(dx)
        return out
    x2, sx = kernel_rows(xs, n)
    dy2, sdy = kernel_rows(dy, n)
    dres2, sdr = kernel_rows(dres, n) if dres is not None else (dy2, sdy)
    has_w = weight is not None
    bargs = (dy2, x2, _vec(weight, n) if has_w else x2, mean if mean is not None else rstd, rstd, dres2,
             dx, sdy, sx, sdr, n, rows, has_w, has_bias, is_rms, dres is not None, llama_cast, offset, p_dtype)
    looped = n > BWD_MAX_FUSED
    n_sm = sm_count(dev)
    switch = needs_device_switch(xs)
    if looped:
        c = (4, 8, 1, None)
    else:
        key = (dev.index, n, xs.dtype, p_dtype, is_rms, has_w, has_bias, dres is not None, llama_cast,
               dx_copy is not None, row_bucket(rows), rows * n >= MIN_TUNE_ELEMENTS)
        c = _BWD_SETTINGS.get(key)
        if c is None:
            def launch(c):  # the reduction of the partials is part of what a setting costs
                return _bwd_launch(*bargs, False, n_sm, c, b_dtype, dx_copy)

            flags = (is_rms, has_w, has_bias, dres is not None, llama_cast, dx_copy is not None)
            with (torch.cuda.device(dev) if switch else contextlib.nullcontext()):
                c = tuned("norm_bwd", dev, (n, xs.dtype, flags, row_bucket(rows)),
                          lambda: _bwd_candidates(pow2_at_least(n)), launch, rows * n)
            if not _capturing(xs):
                _BWD_SETTINGS[key] = c
    if switch:
        with torch.cuda.device(dev):
            red = _bwd_launch(*bargs, looped, n_sm, c, b_dtype, dx_copy)
    else:
        red = _bwd_launch(*bargs, looped, n_sm, c, b_dtype, dx_copy)
    if red is None:
        return dx, None, None
    if has_w and has_bias:
        dw, db = red
        return dx, (dw if weight.dim() == 1 else dw.view(weight.shape)), db
    if has_w:
        return dx, (red if weight.dim() == 1 else red.view(weight.shape)), None
    return dx, None, red


# --------------------------------------------------------------------------------------------
# PyTorch fallback for CPU tensors when Triton cannot run (no GPU, interpreter off): same math.
# --------------------------------------------------------------------------------------------

def norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   residual: Optional[torch.Tensor], n: int, eps: float, offset: float, is_rms: bool,
                   llama_cast: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(y, s)`` of :func:`norm_fwd` in differentiable PyTorch ops (the graph ``torch.compile`` is given).

    Same roundings as the kernels: the sum ``s`` rounded to its dtype, statistics in fp32, under Llama
    casting ``xhat`` rounded to ``s``'s dtype before the weight, one rounding of ``y``. ``n`` elements per row.
    """
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y_dtype = torch.promote_types(s_dtype, weight.dtype) if (llama_cast and weight is not None) else s_dtype
    s = None if residual is None else (x.float() + residual.float()).to(s_dtype)
    xs = x if s is None else s
    xf = xs.float().reshape(-1, n)
    xc = xf if is_rms else xf - xf.mean(-1, keepdim=True)
    out = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if llama_cast:
            out = out.to(s_dtype).float()
        out = out * (weight.reshape(n).float() + offset)
    if bias is not None:
        out = out + bias.reshape(n).float()
    return out.to(y_dtype).reshape(x.shape), s


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


def _torch_bwd(dy2, x2, weight, has_bias, mean, rstd, dres, n, offset, is_rms, llama_cast, dx, b_dtype):
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
        db = dyf.sum(0).to(b_dtype)
    c1 = (g * xhat).mean(-1, keepdim=True)
    d = g - xhat * c1 if is_rms else g - g.mean(-1, keepdim=True) - xhat * c1
    d = d * rstd[:, None]
    if dres is not None:
        d = d + dres.reshape(-1, n).float()
    dx.view(-1, n).copy_(d)
    return dx, dw, db
