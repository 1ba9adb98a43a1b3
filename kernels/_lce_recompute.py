"""Linear + cross-entropy's ``mode="recompute"``: the logits exist only as one small tile at a time.

Shapes: hidden ``h`` (N, H), weight ``W`` (V, H), optional bias ``b`` (V,), targets ``t`` (N,). The (N, V) logits
``x = h W^T + b`` are cut into (R, C) tiles, R rows by C classes (:func:`tile_shape`); one tile buffer of
R x C elements in the compute dtype is all the logits memory there is (32 MiB of bf16 by default, less than the
H200's 50 MB L2, so the kernels that follow each GEMM mostly read it from L2). The per-row math is
:mod:`._cross_entropy_triton`'s (softcap ``c``, label smoothing ``eps``, z-loss ``zl``)::

    z = c tanh(x / c) (softcap) or x;  lse = log sum_j exp(z_j);  loss = (1-eps)(lse - z_t) + eps (lse - mean z) + zl lse^2
    g_j = coef * (p_j (1 + 2 zl lse) - eps / V - (1 - eps)[j == t]) * dz/dx        p = exp(z - lse)

**Forward** (:func:`lse_forward`): for each block of R rows and each slice of C classes, cuBLAS forms the tile
(``torch.mm`` into the buffer), then one kernel folds the tile into four running per-row values: the max ``m`` of
z, the sum ``s`` of exp(z - m), the sum of z (for smoothing) and z at the target (the online log-sum-exp of
Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", merged across tiles). ``lse = m + log s``.

**Backward** (:func:`grad_backward`): the same walk; each tile is formed again (the recompute: one GEMM more than
the chunked mode, four in all), one kernel writes the gradient over it, then cuBLAS adds ``g @ W_c`` into the
block's fp32 dh accumulator (R x H; dh itself when ``h`` is fp32) and writes ``g^T @ h_r`` into dW's rows of the
slice (the first row block with beta = 0, later ones adding with beta = 1: one rounding per row block for a
bf16/fp16 dW, none for an fp32 dW, which accumulates in place), and the tile's column sums into db.

Memory above inputs and gradients: the tile, the dh accumulator (when ``h`` is not fp32), one cast of the
block's rows of ``h`` (when ``h`` is not in the compute dtype) and of the slice's rows of ``W`` (likewise; an fp32
weight under autocast is cast slice by slice, never whole), and a few (N,) fp32 vectors: at most
:data:`BUDGET_BYTES`. Outside that budget: an fp32 dW accumulator when asked for (``dw_fp32``), and one (R, H) or
(C, H) product in the compute dtype on the fallback paths (no fp32-output GEMM in this torch or on this device; a
bf16/fp16 weight in a dtype other than the compute dtype). The tile shape minimises the bytes the GEMMs and accumulators move (see
:func:`tile_shape`); each slice's GEMMs are large enough (R, C >= 1024 where N and V allow) to run near cuBLAS's
full rate. This is the recompute design of Apple's Cut Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models"), written from the paper's description, with cuBLAS GEMMs and a tile held in
device memory instead of registers, and without its gradient filtering (every tile is computed).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import _cross_entropy_triton as K
from ._cross_entropy_triton import _grad_elems, _tanh
from ._launch import Launcher, cdiv, device_guard, pow2_at_least, use_triton

#: Elements of the logits tile (2^24: 32 MiB of bf16).
TILE_ELEMENTS = 1 << 24
#: Most bytes the mode holds above inputs, gradients and (N,) vectors: tile + dh accumulator + casts (96 MiB).
BUDGET_BYTES = 96 << 20
#: Tile rows and columns are multiples of this (GEMM tiles), unless N or V is smaller.
ALIGN = 128
#: A fixed (R, C) tile instead of :func:`tile_shape`'s (tests and benchmarks).
TILE: Optional[Tuple[int, int]] = None
#: Columns per block of the two tile kernels, and their warps: at the benchmark's 4096 x 4096 bf16 tiles on the
#: H200 both kernels took 1.93-1.99 ms a step against 2.07-2.16 at (4096, 8) (docs/benchmarks.md, issue 27 run 13).
BLOCK = 4096
WARPS = 4

_ADDMM_OUT_DTYPE: dict = {}


def fp32_addmm_works(acc: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` accumulates bf16/fp16 products into an
    fp32 ``c`` in place on this device (the cuBLAS fp32-output GEMM, torch >= 2.9 on CUDA); probed once per device
    and dtype on a 16 x 8 problem (one host-device sync, at first use outside a CUDA-graph capture; inside one, False
    without probing)."""
    key = (acc.device, g.dtype)
    ok = _ADDMM_OUT_DTYPE.get(key)
    if ok is None:
        ok = False
        if acc.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # no host sync inside a CUDA-graph capture: the fallback now, the probe at a later call
        if acc.is_cuda:
            try:
                c = torch.ones(16, 8, device=acc.device)
                a = torch.ones(16, 4, dtype=g.dtype, device=acc.device)
                b = torch.ones(4, 8, dtype=g.dtype, device=acc.device)
                torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
                ok = bool((c == 5.0).all())
            except Exception:  # noqa: BLE001 - no such overload here: the caller's fallback
                ok = False
        _ADDMM_OUT_DTYPE[key] = ok
    return ok


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place; ``a``, ``b`` in the compute dtype, ``acc`` in it or fp32 (the fp32-output GEMM
    where torch has it, else the product in the compute dtype added in fp32: one more rounding)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif fp32_addmm_works(acc, a):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


# ---------------------------------------------------------------- tile kernels

@triton.jit
def _tile_stats_kernel(X, T, M, S, SZ, ZT, stride_x, ncols, col0, softcap,
                       HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    """Fold row ``r`` of a (rows, ncols) tile of classes [col0, col0 + ncols) into the running per-row max M, sum
    S of exp(z - M), sum SZ of z (with SMOOTH) and z at the target ZT (written by the tile holding it)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    t = tl.load(T + row).to(tl.int64) - col0
    m0 = tl.load(M + row)  # before the row's loads, so that the two round trips overlap
    s0 = tl.load(S + row)
    mx = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    zs = tl.full((), 0.0, tl.float32)
    for start in range(0, ncols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < ncols
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(x * (1.0 / softcap))
        else:
            z = x
        if SMOOTH:
            zs += tl.sum(tl.where(m, z, 0.0), axis=0)
        z = tl.where(m, z, float("-inf"))
        nm = tl.maximum(mx, tl.max(z, axis=0))
        s = s * tl.exp(mx - nm) + tl.sum(tl.exp(z - nm), axis=0)
        mx = nm
    nm = tl.maximum(m0, mx)
    tl.store(S + row, s0 * tl.exp(m0 - nm) + s * tl.exp(mx - nm))
    tl.store(M + row, nm)
    if SMOOTH:
        tl.store(SZ + row, tl.load(SZ + row) + zs)
    if (t >= 0) & (t < ncols):
        xt = tl.load(x_row + t).to(tl.float32)
        if HAS_SOFTCAP:
            xt = softcap * _tanh(xt * (1.0 / softcap))
        tl.store(ZT + row, xt)


@triton.jit
def _tile_grad_kernel(X, T, LSE, COEF, stride_x, ncols, col0, V, smoothing, z_loss, softcap,
                      HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """Write ``COEF[r] * dloss_r/dx`` over row ``r`` of a (rows, ncols) tile of classes [col0, col0 + ncols) (the
    module docstring's formula; V: all classes, for smoothing's eps / V). COEF already holds 0 for ignored rows and
    NaN for a target outside [0, V)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    t = tl.load(T + row).to(tl.int64) - col0
    lse = tl.load(LSE + row)
    coef = tl.load(COEF + row)
    grow = 1.0 + 2.0 * z_loss * lse
    for start in range(0, ncols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < ncols
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        g = _grad_elems(x, cols, t, lse, grow, smoothing, V, softcap, HAS_SOFTCAP)
        tl.store(x_row + cols, (g * coef).to(X.dtype.element_ty), mask=m)


_STATS = Launcher(_tile_stats_kernel)
_GRAD = Launcher(_tile_grad_kernel)


def _fold_stats(tile: torch.Tensor, t: torch.Tensor, col0: int, stats, softcap: float, smooth: bool) -> None:
    """Fold a (rows, C) tile into ``stats`` = (M, S, SZ, ZT) views of the tile's rows (see _tile_stats_kernel)."""
    M, S, SZ, ZT = stats
    rows, C = tile.shape
    if use_triton(tile):
        block = min(BLOCK, pow2_at_least(C))
        with device_guard(tile):
            _STATS(rows, (tile, t, M, S, SZ, ZT, tile.stride(0), C, col0, float(softcap) if softcap > 0 else 1.0),
                   {"HAS_SOFTCAP": softcap > 0, "SMOOTH": smooth, "BLOCK": block}, WARPS)
        return
    z = K.torch_z(tile, softcap)
    mx = z.max(1).values
    nm = torch.maximum(M, mx)
    S.copy_(S * torch.exp(M - nm) + torch.exp(z - nm.unsqueeze(1)).sum(1))
    M.copy_(nm)
    if smooth:
        SZ.add_(z.sum(1))
    loc = t.long() - col0
    inside = (loc >= 0) & (loc < C)
    zt = z.gather(1, torch.where(inside, loc, 0).unsqueeze(1)).squeeze(1)
    ZT.copy_(torch.where(inside, zt, ZT))


def _write_grad(tile: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, col0: int, V: int,
                smoothing: float, z_loss: float, softcap: float) -> None:
    """Write the gradient over a (rows, C) tile in place (see _tile_grad_kernel)."""
    rows, C = tile.shape
    if use_triton(tile):
        block = min(BLOCK, pow2_at_least(C))
        with device_guard(tile):
            _GRAD(rows, (tile, t, lse, coef, tile.stride(0), C, col0, V, float(smoothing), float(z_loss),
                         float(softcap) if softcap > 0 else 1.0), {"HAS_SOFTCAP": softcap > 0, "BLOCK": block}, WARPS)
        return
    every = torch.ones(rows, dtype=torch.bool, device=tile.device)  # coef already holds ignored / invalid rows
    tile.copy_(K._torch_grad(K.torch_z(tile, softcap), tile, t, lse, coef, (every, ~every), smoothing, z_loss,
                             softcap, V=V, col0=col0))


# ---------------------------------------------------------------- tiling

def tile_shape(N: int, V: int, H: int, itemsize: int, need_dh: bool, acc_dh: bool, dw_itemsize: int,
               cast_h: bool, cast_w: bool) -> Tuple[int, int]:
    """(R, C): rows and classes per tile, R * C <= :data:`TILE_ELEMENTS` (or :data:`TILE` when set).

    Candidates: R = N or ALIGN times a power of two below N; C = the most whole :data:`ALIGN` columns that fit, or
    ALIGN times a power of two below that (at most V). Among those within :data:`BUDGET_BYTES` (tile ``R C
    itemsize``, dh accumulator ``4 R H`` with ``acc_dh``, casts ``R H itemsize`` / ``C H itemsize`` with ``cast_h`` /
    ``cast_w``), the one whose backward moves the fewest bytes through its GEMMs, counted as: the fp32 dh
    accumulator read and written by every tile's GEMM (``8 N H ceil(V / C)`` with ``need_dh``), dW's rows written
    by the first row block and read and written by each later one (``V H dw_itemsize (2 ceil(N / R) - 1)``;
    ``dw_itemsize`` 0 when dW is not needed), and the operands (h: ``N H itemsize ceil(V / C)``; W: ``V H itemsize
    ceil(N / R)``, 6 bytes per element more when cast from fp32). Ties go to the larger R. When no candidate fits
    the budget (H in the hundreds of thousands), the smallest. ``N, V, H >= 1``; ``itemsize`` is the compute
    dtype's."""
    if TILE is not None:
        return max(1, min(N, TILE[0])), max(1, min(V, TILE[1]))
    best = None
    for R in _pow2_steps(N):
        for C in _pow2_steps(min(V, max(ALIGN, (TILE_ELEMENTS // R) // ALIGN * ALIGN))):
            mem = R * C * itemsize + (4 * R * H if acc_dh else 0) + (R * H * itemsize if cast_h else 0) + \
                (C * H * itemsize if cast_w else 0)
            nr, nc = cdiv(N, R), cdiv(V, C)
            moved = (8 * N * H * nc if need_dh else 0) + V * H * dw_itemsize * (2 * nr - 1) + \
                N * H * itemsize * nc + V * H * (itemsize + (6 if cast_w else 0)) * nr
            key = (max(0, mem - BUDGET_BYTES), moved, -R)
            if best is None or key < best[0]:
                best = (key, (R, C))
    return best[1]


def _pow2_steps(n: int):
    """ALIGN, 2 ALIGN, 4 ALIGN, ... below ``n``, then ``n``."""
    k = ALIGN
    while k < n:
        yield k
        k *= 2
    yield n


def _plan(h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> Tuple[int, int]:
    """The tile shape of both passes (the same in the forward and the backward, so that both form the same logits),
    for a backward that needs dh and dW."""
    N, H = h.shape
    V = w.shape[0]
    return tile_shape(N, V, H, torch.finfo(dtype).bits // 8, True, h.dtype != torch.float32,
                      4 if w.dtype == torch.float32 else w.element_size(), h.dtype != dtype, w.dtype != dtype)


def _tiles(N: int, V: int, R: int, C: int):
    """(r0, r1, c0, c1) of every tile, row blocks outer."""
    for r0 in range(0, N, R):
        for c0 in range(0, V, C):
            yield r0, min(N, r0 + R), c0, min(V, c0 + C)


def _form(buf: torch.Tensor, h_r: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], c0: int, c1: int,
          dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tile = h_r @ W[c0:c1]^T + b[c0:c1] in ``buf``'s first elements, W[c0:c1] in ``dtype``)."""
    w_c = w[c0:c1].to(dtype)
    tile = buf[:h_r.shape[0] * (c1 - c0)].view(h_r.shape[0], c1 - c0)
    if b is not None:
        torch.addmm(b[c0:c1].to(dtype), h_r, w_c.t(), out=tile)
    else:
        torch.mm(h_r, w_c.t(), out=tile)
    return tile, w_c


def lse_forward(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], t: torch.Tensor, dtype: torch.dtype,
                ignore_index: int, smoothing: float, z_loss: float, softcap: float
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, lse), both fp32 (N,), of ``h @ w.T + b`` against ``t``, one logits tile at a time.

    h (N, H), w (V, H), b (V,) or None: float32/float16/bfloat16, cast block by block to ``dtype`` (the GEMMs'
    dtype); t (N,) int. Ignored rows get loss 0; a target outside [0, V) that is not ``ignore_index`` NaN."""
    N, H = h.shape
    V = w.shape[0]
    dev = h.device
    M = torch.full((N,), float("-inf"), dtype=torch.float32, device=dev)
    S = torch.zeros(N, dtype=torch.float32, device=dev)
    SZ = torch.zeros(N, dtype=torch.float32, device=dev)
    ZT = torch.zeros(N, dtype=torch.float32, device=dev)
    tt = t.contiguous()
    if N and V:
        R, C = _plan(h, w, dtype)
        with torch.autocast(dev.type, enabled=False):
            buf = torch.empty(R * C, dtype=dtype, device=dev)
            h_r = None
            for r0, r1, c0, c1 in _tiles(N, V, R, C):
                if c0 == 0:
                    h_r = h[r0:r1].to(dtype)
                tile, _ = _form(buf, h_r, w, b, c0, c1, dtype)
                _fold_stats(tile, tt[r0:r1], c0, (M[r0:r1], S[r0:r1], SZ[r0:r1], ZT[r0:r1]), softcap, smoothing != 0)
    lse = M + torch.log(S)
    tl_ = tt.long()
    valid = (tl_ >= 0) & (tl_ < V)
    loss = (1.0 - smoothing) * (lse - ZT) + smoothing * (lse - SZ / max(V, 1)) + z_loss * lse * lse
    loss = torch.where(valid, loss, float("nan"))
    loss = torch.where(tl_ == ignore_index, 0.0, loss)
    return loss, lse


def grad_backward(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], t: torch.Tensor, lse: torch.Tensor,
                  coef: torch.Tensor, dtype: torch.dtype, ignore_index: int, smoothing: float, z_loss: float,
                  softcap: float, need: Tuple[bool, bool, bool], dw_fp32: bool = False):
    """(dh, dW, db) of ``sum(coef * loss_rows)`` (each None unless asked for in ``need``), in the dtypes of ``h``,
    ``w`` and ``b``. ``coef`` (N,): the upstream gradient per row (an ignored row gets 0 here, an invalid target
    NaN); ``lse`` (N,) fp32: :func:`lse_forward`'s. ``dw_fp32``: accumulate a bf16/fp16 dW in an fp32 (V, H)
    buffer (rounded once at the end; ``4 V H`` bytes more, outside the tile budget) instead of adding to it in its
    own dtype once per row block."""
    N, H = h.shape
    V = w.shape[0]
    dev = h.device
    tt = t.contiguous()
    tl_ = tt.long()
    coef = torch.where((tl_ >= 0) & (tl_ < V), coef.float(), float("nan"))
    coef = torch.where(tl_ == ignore_index, 0.0, coef).contiguous()
    lse = lse.contiguous()
    f32 = torch.float32
    dh = dw = db = None
    if need[0]:
        dh = torch.zeros((N, H), dtype=f32, device=dev) if h.dtype == f32 else torch.empty((N, H), dtype=h.dtype,
                                                                                            device=dev)
    if need[1]:
        dw = torch.zeros((V, H), dtype=f32, device=dev) if w.dtype == f32 or dw_fp32 else \
            torch.empty((V, H), dtype=w.dtype, device=dev)
    if need[2]:
        db = torch.zeros(V, dtype=f32, device=dev)
    if N and V:
        R, C = _plan(h, w, dtype)
        acc = torch.empty((R, H), dtype=f32, device=dev) if need[0] and h.dtype != f32 else None
        with torch.autocast(dev.type, enabled=False):
            buf = torch.empty(R * C, dtype=dtype, device=dev)
            h_r = a_r = None
            for r0, r1, c0, c1 in _tiles(N, V, R, C):
                if c0 == 0:
                    h_r = h[r0:r1].to(dtype)
                    if need[0]:
                        a_r = acc[:r1 - r0] if acc is not None else dh[r0:r1]
                        if acc is not None:
                            a_r.zero_()
                tile, w_c = _form(buf, h_r, w, b, c0, c1, dtype)
                _write_grad(tile, tt[r0:r1], lse[r0:r1], coef[r0:r1], c0, V, smoothing, z_loss, softcap)
                if need[0]:
                    add_product_(a_r, tile, w_c)
                if need[1]:
                    d = dw[c0:c1]
                    if d.dtype == f32:
                        add_product_(d, tile.t(), h_r)
                    elif d.dtype == dtype:
                        if r0 == 0:
                            torch.mm(tile.t(), h_r, out=d)
                        else:
                            d.addmm_(tile.t(), h_r)
                    elif r0 == 0:
                        d.copy_(tile.t() @ h_r)
                    else:
                        d.add_(tile.t() @ h_r)
                if need[2]:
                    db[c0:c1] += tile.sum(0, dtype=f32)
                if acc is not None and c1 == V:
                    dh[r0:r1].copy_(a_r)
    elif need[1] and dw.dtype != f32:
        dw.zero_()
    if need[1] and dw.dtype != w.dtype:
        dw = dw.to(w.dtype)
    if db is not None and b.dtype != f32:
        db = db.to(b.dtype)
    return dh, dw, db
