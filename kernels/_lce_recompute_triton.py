"""Triton kernels of linear + cross-entropy's ``mode="recompute"``: no logits tile ever goes to device memory.

Shapes: hidden ``h`` (N, H), weight ``W`` (V, H), optional bias ``b`` (V,), targets ``t`` (N,). The logits
``x = h W^T + b`` exist only as (BM, BN) tiles in registers, formed by ``tl.dot`` over blocks of H in the
compute dtype (bf16/fp16 operands, fp32 accumulation; fp32 operands in IEEE fp32). The per-row math is
:mod:`._cross_entropy_triton`'s (softcap, label smoothing ``eps``, z-loss ``zl``)::

    z = c tanh(x / c) (softcap) or x;  lse = log sum_j exp(z_j);  loss = (1-eps)(lse - z_t) + eps (lse - mean z) + zl lse^2
    g_j = coef * (p_j (1 + 2 zl lse) - eps / V - (1 - eps)[j == t]) * dz/dx        p = exp(z - lse)

**Forward** (:func:`lse_forward`): one program per (block of BM rows, slice of the vocabulary); it walks its
slice in BN-column tiles keeping a running max and rescaled sum per row (the online log-sum-exp of Milakov &
Gimelshein 2018), the sum of z (for smoothing) and the target's z. Each program writes those four per-row
partials; the few slices per row are combined by torch ops on (slices, N) tensors (no host-device sync).

**Backward** (:func:`grad_backward`): one program per (BM, BN) tile: the tile's logits are formed again (the
recompute: one more GEMM than the chunked mode), turned into the gradient tile ``g`` in registers with the
saved ``lse``, and then, block of H by block of H, ``g @ W[tile]`` is added into dh and ``g^T @ h[tile]`` into
dW with fp32 atomic adds (``tl.atomic_add``; the order of the adds varies, so the last bits of dh and dW may
differ from run to run), and the tile's column sums into db. The accumulators are fp32: dh (N, H) and the
dW rows of one vocabulary chunk (:data:`VOCAB_CHUNK` rows; the caller launches once per chunk and rounds each
chunk once into dW's dtype); when the weight is fp32 the accumulator is dW itself (no extra memory). This is
the design of Apple's Cut Cross-Entropy (Wijmans et al. 2024), written here from the paper's description,
without its gradient filtering (which skips tiles whose gradient is below a threshold and so changes the
result): every tile is computed.

Under ``TRITON_INTERPRET=1`` the tiles are converted to fp32 before ``tl.dot`` (the interpreter stores bf16 as
raw bits).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._env import INTERPRET
from ._launch import cdiv, device_guard, sm_count
from ._cross_entropy_triton import _tanh, _tanh_sech2

#: Rows of dW accumulated in fp32 per backward launch when the weight is not fp32 (fp32 (VOCAB_CHUNK, H)
#: accumulator: 32 MiB at H = 4096).
VOCAB_CHUNK = 2048
#: Bytes of the fp32 dh accumulator of one row chunk when ``h`` is not fp32 (64 MiB: 4096 rows at H = 4096).
ROW_CHUNK_BYTES = 1 << 26
#: (BM, BN, BK, num_warps, num_stages) of the forward and of the backward on a GPU.
#: (BK = 32: at BK = 64 both kernels spill registers in Triton 3.9's sm_90 build, read with cuobjdump.)
FWD_SETTING = (128, 128, 64, 8, 3)
BWD_SETTING = (128, 128, 64, 8, 2)
#: Settings under the interpreter (small tiles: it is slow per element either way).
INTERP_SETTING = (16, 16, 16, 1, 1)


@triton.jit
def _logits_tile(Hp, Wp, Bp, rows, cols, N, V, K, stride_h, stride_w,
                 HAS_BIAS: tl.constexpr, F32: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 (BM, BN) tile of ``h[rows] @ W[cols]^T (+ b[cols])``; rows/cols past N/V read as 0."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    rm = rows < N
    cm = cols < V
    ks = tl.arange(0, BK)
    h_ptr = Hp + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
    w_ptr = Wp + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    for k in tl.range(0, K, BK, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(h_ptr + k, mask=rm[:, None], other=0.0)
            b = tl.load(w_ptr + k, mask=cm[:, None], other=0.0)
        else:
            km = (k + ks) < K
            a = tl.load(h_ptr + k, mask=rm[:, None] & km[None, :], other=0.0)
            b = tl.load(w_ptr + k, mask=cm[:, None] & km[None, :], other=0.0)
        if F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            a = a.to(DT)
            b = b.to(DT)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc += tl.load(Bp + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _lse_fwd_kernel(
    Hp, Wp, Bp, T, PM, PS, PZ, PT,  # h (N, K), W (V, K), b (V,), t (N,); partials (SPLITS, N) fp32
    N, V, K, stride_h, stride_w, cols_per_split, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, F32: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n_mb = tl.cdiv(N, BM)
    mb = pid % n_mb  # row blocks fastest: the programs running together share the slice's W tiles in L2
    sp = pid // n_mb
    rows = mb * BM + tl.arange(0, BM)
    rm = rows < N
    t = tl.load(T + rows, mask=rm, other=0).to(tl.int64)
    mx = tl.full((BM,), -float("inf"), tl.float32)
    s = tl.zeros((BM,), tl.float32)
    zs = tl.zeros((BM,), tl.float32)
    zt = tl.zeros((BM,), tl.float32)
    c0 = sp * cols_per_split
    c1 = tl.minimum(c0 + cols_per_split, V)
    for n0 in range(c0, c1, BN):
        cols = n0 + tl.arange(0, BN)
        x = _logits_tile(Hp, Wp, Bp, rows, cols, N, V, K, stride_h, stride_w, HAS_BIAS, F32, IEEE, DT,
                         BM, BN, BK, STAGES, EVEN_K)
        if HAS_SOFTCAP:
            x = softcap * _tanh(x * (1.0 / softcap))
        cm = cols < c1
        zs += tl.sum(tl.where(cm[None, :], x, 0.0), 1)
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], x, 0.0), 1)
        x = tl.where(cm[None, :], x, -float("inf"))
        new = tl.maximum(mx, tl.max(x, 1))
        s = s * tl.exp(mx - new) + tl.sum(tl.exp(x - new[:, None]), 1)
        mx = new
    off = sp.to(tl.int64) * N + rows
    tl.store(PM + off, mx, mask=rm)
    tl.store(PS + off, s, mask=rm)
    tl.store(PZ + off, zs, mask=rm)
    tl.store(PT + off, zt, mask=rm)


@triton.jit
def _grad_bwd_kernel(
    Hp, Wp, Bp, T, LSE, COEF, DH, DW, DB,  # h, W, b, t as above; LSE, COEF (N,) fp32; DH (N, K) fp32;
    # DW (V, K) or (chunk, K) fp32 (see DW_OFFSET), DB (V,) fp32
    N, V, K, stride_h, stride_w, v0, chunk, smoothing, z_loss, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr, DW_OFFSET: tl.constexpr, F32: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
):
    # DW_OFFSET: DW is the whole (V, K) gradient (rows v0 + ...), else the (chunk, K) accumulator of this chunk
    pid = tl.program_id(0)
    n_mb = tl.cdiv(N, BM)
    mb = pid % n_mb
    nb = pid // n_mb
    rows = mb * BM + tl.arange(0, BM)
    lcols = nb * BN + tl.arange(0, BN)  # columns within the chunk
    cols = v0 + lcols
    rm = rows < N
    cm = (lcols < chunk) & (cols < V)
    x = _logits_tile(Hp, Wp, Bp, rows, tl.where(cm, cols, V), N, V, K, stride_h, stride_w, HAS_BIAS, F32, IEEE,
                     DT, BM, BN, BK, STAGES, EVEN_K)
    t = tl.load(T + rows, mask=rm, other=-1).to(tl.int64)
    lse = tl.load(LSE + rows, mask=rm, other=0.0)
    coef = tl.load(COEF + rows, mask=rm, other=0.0)
    if HAS_SOFTCAP:
        th, dzdx = _tanh_sech2(x * (1.0 / softcap))
        z = softcap * th
    else:
        z = x
    p = tl.exp(z - lse[:, None])
    g = p * (1.0 + 2.0 * z_loss * lse)[:, None] - smoothing / V
    g = g - tl.where(cols[None, :] == t[:, None], 1.0 - smoothing, 0.0)
    if HAS_SOFTCAP:
        g = g * dzdx
    g = g * coef[:, None]
    g = tl.where(rm[:, None] & cm[None, :], g, 0.0)
    if NEED_DB:
        tl.atomic_add(DB + cols, tl.sum(g, 0), mask=cm)
    if F32:
        gq = g
    else:
        gq = g.to(DT)
    ks = tl.arange(0, BK)
    h_ptr = Hp + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
    w_ptr = Wp + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    dh_ptr = DH + rows[:, None].to(tl.int64) * K + ks[None, :]
    if DW_OFFSET:
        dw_ptr = DW + cols[:, None].to(tl.int64) * K + ks[None, :]
    else:
        dw_ptr = DW + lcols[:, None].to(tl.int64) * K + ks[None, :]
    for k in range(0, K, BK):
        if EVEN_K:
            km = ks < BK
        else:
            km = (k + ks) < K
        if NEED_DH:
            w = tl.load(w_ptr + k, mask=cm[:, None] & km[None, :], other=0.0)
            w = w.to(tl.float32) if F32 else w.to(DT)
            if IEEE:
                dh = tl.dot(gq, w, input_precision="ieee")
            else:
                dh = tl.dot(gq, w)
            tl.atomic_add(dh_ptr + k, dh, mask=rm[:, None] & km[None, :], sem="relaxed")
        if NEED_DW:
            a = tl.load(h_ptr + k, mask=rm[:, None] & km[None, :], other=0.0)
            a = a.to(tl.float32) if F32 else a.to(DT)
            if IEEE:
                dw = tl.dot(tl.trans(gq), a, input_precision="ieee")
            else:
                dw = tl.dot(tl.trans(gq), a)
            tl.atomic_add(dw_ptr + k, dw, mask=cm[:, None] & km[None, :], sem="relaxed")


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _flags(h: torch.Tensor, dtype: torch.dtype):
    f32 = INTERPRET or dtype == torch.float32
    return {"F32": f32, "IEEE": (not INTERPRET) and dtype == torch.float32, "DT": _TL[dtype]}


def _setting(fwd: bool, h: torch.Tensor):
    if INTERPRET or not h.is_cuda:
        return INTERP_SETTING
    return FWD_SETTING if fwd else BWD_SETTING


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def lse_forward(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], t: torch.Tensor, dtype: torch.dtype,
                ignore_index: int, smoothing: float, z_loss: float, softcap: float
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, lse), both fp32 (N,), of ``h @ w.T + b`` against ``t`` without forming the logits.

    h (N, H), w (V, H), b (V,) or None: any float dtypes, cast tile by tile to ``dtype`` (the GEMM dtype);
    t (N,) int. Ignored rows get loss 0; a target outside [0, V) that is not ``ignore_index`` NaN."""
    N, K = h.shape
    V = w.shape[0]
    h, w = _rowmajor(h), _rowmajor(w)
    BM, BN, BK, warps, stages = _setting(True, h)
    n_mb = cdiv(N, BM)
    # slices of the vocabulary: enough programs for two waves, slices a multiple of BN
    splits = 1 if INTERPRET or not h.is_cuda else max(1, min(cdiv(V, BN), cdiv(2 * sm_count(h.device), n_mb)))
    per = cdiv(cdiv(V, splits), BN) * BN
    splits = cdiv(V, per)
    part = torch.empty((4, splits, N), dtype=torch.float32, device=h.device)
    tt = t.contiguous()
    with device_guard(h):
        _lse_fwd_kernel[(n_mb * splits,)](
            h, w, b if b is not None else h, tt, part[0], part[1], part[2], part[3],
            N, V, K, h.stride(0), w.stride(0), per, float(softcap) if softcap > 0 else 1.0,
            HAS_BIAS=b is not None, HAS_SOFTCAP=softcap > 0, **_flags(h, dtype), BM=BM, BN=BN, BK=BK,
            STAGES=stages, EVEN_K=K % BK == 0, num_warps=warps, num_stages=stages)
    pm, ps, pz, pt = part
    gm = pm.max(0).values
    lse = gm + torch.log((ps * torch.exp(pm - gm)).sum(0))
    zsum, zt = pz.sum(0), pt.sum(0)
    tl_ = tt.long()
    valid = (tl_ >= 0) & (tl_ < V)
    loss = (1.0 - smoothing) * (lse - zt) + smoothing * (lse - zsum / V) + z_loss * lse * lse
    loss = torch.where(valid, loss, float("nan"))
    loss = torch.where(tl_ == ignore_index, 0.0, loss)
    return loss, lse


def grad_backward(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], t: torch.Tensor, lse: torch.Tensor,
                  coef: torch.Tensor, dtype: torch.dtype, ignore_index: int, smoothing: float, z_loss: float,
                  softcap: float, need: Tuple[bool, bool, bool]):
    """(dh, dW, db) of ``sum(coef * loss_rows)`` (each None unless asked for in ``need``), in the dtypes of
    ``h``, ``w`` and ``b``. ``coef`` (N,) fp32: the upstream gradient per row (an ignored row gets 0 here, an
    invalid target NaN).

    fp32 accumulators: the weight's gradient itself when the weight is fp32, else :data:`VOCAB_CHUNK` rows of it
    at a time; dh in row chunks of at most :data:`ROW_CHUNK_BYTES` (itself when ``h`` is fp32 and it fits). A
    bf16/fp16 dW is thus rounded once per row chunk (once when N fits one)."""
    N, K = h.shape
    V = w.shape[0]
    h, w = _rowmajor(h), _rowmajor(w)
    dev = h.device
    tt = t.contiguous()
    tl_ = tt.long()
    coef = torch.where((tl_ >= 0) & (tl_ < V), coef.float(), float("nan"))
    coef = torch.where(tl_ == ignore_index, 0.0, coef).contiguous()
    BM, BN, BK, warps, stages = _setting(False, h)
    dh = None
    if need[0]:
        dh = torch.zeros((N, K), dtype=torch.float32, device=dev) if h.dtype == torch.float32 else \
            torch.empty((N, K), dtype=h.dtype, device=dev)
    dw = None
    if need[1]:
        dw = (torch.zeros((V, K), dtype=torch.float32, device=dev) if w.dtype == torch.float32
              else torch.empty((V, K), dtype=w.dtype, device=dev))
    db32 = torch.zeros(V, dtype=torch.float32, device=dev) if need[2] else None
    direct_dw = dw is None or dw.dtype == torch.float32
    chunk = V if direct_dw else min(V, VOCAB_CHUNK)
    acc = None if direct_dw else torch.empty((chunk, K), dtype=torch.float32, device=dev)
    direct_dh = dh is None or dh.dtype == torch.float32
    rc = N if direct_dh else max(BM, min(N, (ROW_CHUNK_BYTES // (4 * max(K, 1))) // BM * BM))
    dh32 = None if direct_dh else torch.empty((rc, K), dtype=torch.float32, device=dev)
    dummy = lse
    with device_guard(h):
        for r0 in range(0, N, rc):
            r1 = min(N, r0 + rc)
            n_mb = cdiv(r1 - r0, BM)
            if dh32 is not None:
                dh32.zero_()
            dh_t = dh[r0:r1] if direct_dh and dh is not None else (dh32 if dh32 is not None else dummy)
            for v0 in range(0, V, chunk):
                c = min(chunk, V - v0)
                if acc is not None:
                    acc.zero_()
                dw_t = acc if acc is not None else (dw if dw is not None else dummy)
                _grad_bwd_kernel[(n_mb * cdiv(c, BN),)](
                    h[r0:r1], w, b if b is not None else h, tt[r0:r1], lse[r0:r1], coef[r0:r1], dh_t, dw_t,
                    db32 if db32 is not None else dummy,
                    r1 - r0, V, K, h.stride(0), w.stride(0), v0, c, float(smoothing), float(z_loss),
                    float(softcap) if softcap > 0 else 1.0,
                    HAS_BIAS=b is not None, HAS_SOFTCAP=softcap > 0, NEED_DH=need[0], NEED_DW=need[1],
                    NEED_DB=need[2], DW_OFFSET=acc is None, **_flags(h, dtype), BM=BM, BN=BN, BK=BK, STAGES=stages,
                    EVEN_K=K % BK == 0, num_warps=warps, num_stages=stages)
                if acc is not None:
                    part = dw[v0:v0 + c]
                    if r0 > 0:  # a later row chunk: add to what the earlier ones left (one rounding per chunk)
                        acc[:c].add_(part)
                    part.copy_(acc[:c])
            if dh32 is not None:
                dh[r0:r1].copy_(dh32[:r1 - r0])
    db = None if db32 is None else (db32 if b.dtype == torch.float32 else db32.to(b.dtype))
    return dh, dw, db
