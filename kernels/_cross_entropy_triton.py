"""Triton kernels (and their PyTorch fallback) for cross-entropy over a vocabulary: one program per row.

Per row of logits ``x`` (``V`` entries, any float dtype, math in fp32) with target ``t``::

    z     = c * tanh(x / c)                 (softcap c, Gemma 2/3; z = x without it)
    lse   = log(sum_j exp(z_j))             (online: running max and rescaled sum, one pass)
    loss  = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j) + zl * lse^2

(``eps`` = label smoothing as in ``torch.nn.functional.cross_entropy``, whose smoothed target puts
``eps / V`` on every class; ``zl`` = the z-loss weight of PaLM, Chowdhery et al. 2022, section 5).
Rows whose target is ``ignore_index`` give loss 0 and gradient 0; a target outside ``[0, V)`` that is
not ``ignore_index`` gives a NaN loss and NaN gradients (torch raises; a check here would cost a
host-device sync). Gradient, with ``p = softmax(z)``::

    dloss/dz_j = p_j * (1 + 2 zl lse) - eps / V - (1 - eps) [j == t]
    dz/dx      = 1 - (z / c)^2 = sech(x / c)^2   (softcap only; computed as 4e / (1 + e)^2, e = exp(-2|x / c|))

Lanes past ``V`` in the last block are set to ``-inf`` *after* the softcap, so they take no probability
mass (``c * tanh(-inf)`` would be ``-c``).

Bytes per element of ``b`` bytes: the forward reads the row once (``b``); the gradient pass reads it
again and writes ``dx`` (``2b``). The fused forward (``write_grad``) runs both passes in one program, one
program per row; thousands of rows are in flight, far more than L2 holds, so the second read comes from HBM
(ncu: 4.11 GB read for 2.10 GB of bf16 logits at 8192 x 128256, ``docs/gpu-runs/cross_entropy-run9.md``). The
gradient pass walks the row backwards (its first blocks are the ones the first pass read last) and both passes
pipeline their loads. The default kernel, ``_ce_fast_kernel`` (kind "fast"), does the fewest instructions per
element: full blocks unmasked and one masked tail, label smoothing and z-loss compiled out when 0, the target
column's ``- (1 - eps)`` written by one scalar store after the gradient pass instead of a compare and select per
element, exp as one ``ex2.approx.ftz`` (``tl.exp2`` adds a subnormal fix-up of three instructions) and the
reciprocal as one ``rcp.approx.ftz`` (both inline PTX on a GPU, plain ``tl`` in the interpreter), optionally the
reciprocal on the FMA pipe, optionally a per-thread forward (no cross-thread reduction per block; with a softcap
``c <= 40`` no running max either, since ``z <= c``): 16-20 instructions per logit against 41 for the earlier
"rev" kernel (``_ce_fwd_kernel``). Without a softcap it is then bound by HBM (6 bytes per logit at 98% of copy
bandwidth): 1.47-1.51 ms at 8192 x 128256 bf16 against 1.62-1.80 ms for "rev" in the same runs. With softcap 30
it is bound by the MUFU pipe (six per logit: ex2 and rcp for tanh, ex2 for the exponential, in each pass; ncu's XU
pipe 82-92% busy) at a clock the 700 W power cap holds at 1.4-2.0 GHz: 1.57-1.83 ms against 2.79 ms for the
register team kernel and 2.89 for "rev"/"row". Persistent grids with eviction hints (fewer rows in flight) and the
split kernel (each row read once) were measured slower or no faster; they stay as options. So do the persistent
team kernels (``_ce_team_kernel``: a row's segments held in registers by S co-resident programs;
``_ce_team_l2_kernel``: each segment streamed twice, the second read from L2), which read each logit from HBM
once (3.95-4.12 bytes per logit under ncu) but wait ~3 us per row step for the other segments' partials: 1.73-1.95
ms (``docs/gpu-runs/cross_entropy-run6.md`` to ``-run8.md``). The unfused backward reads the saved ``lse``.
Offsets are int64 (``row * stride`` past 2^31 elements). No host-device sync anywhere: the mean's
``1 / count`` and the upstream gradient are read from device memory by the kernels.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._env import INTERPRET
from ._launch import Launcher, as_rows, cdiv, device_guard, pow2_at_least, sm_count, use_triton
from ._tuning import row_bucket, tuned


@triton.jit
def _tanh_sech2(u):
    """(tanh(u), 1 - tanh(u)^2) from one exp, e = exp(-2|u|) in (0, 1] (no libdevice needed)::

        tanh(u) = sign(u) (1 - e) / (1 + e)        sech(u)^2 = 4 e / (1 + e)^2

    The second form keeps its relative accuracy where tanh(u) rounds to +-1 (``1 - th * th`` there is
    a difference of two numbers within an ulp of 1: an absolute error of ~1e-7 on a value that may be
    1e-10, which the gradient of a saturated softcap lane would carry)."""
    e = tl.exp(-2.0 * tl.abs(u))
    r = tl.fdiv(tl.full(e.shape, 1.0, tl.float32), 1.0 + e)  # the fast reciprocal (not IEEE division)
    th = (1.0 - e) * r
    return tl.where(u < 0, -th, th), 4.0 * e * r * r


@triton.jit
def _tanh(u):
    """tanh(u) (see ``_tanh_sech2``)."""
    th, _ = _tanh_sech2(u)
    return th


@triton.jit
def _store_loss(loss_ptr, lse_ptr, lse, zt, zsum, V, smoothing, z_loss, valid, ignored):
    """Store one row's loss (the module docstring's formula; NaN for a target outside [0, V), 0 when ignored)
    and its lse (fp32 scalars)."""
    loss = (1.0 - smoothing) * (lse - zt) + smoothing * (lse - zsum / V) + z_loss * lse * lse
    loss = tl.where(valid, loss, float("nan"))
    loss = tl.where(ignored, 0.0, loss)
    tl.store(loss_ptr, loss)
    tl.store(lse_ptr, lse)


@triton.jit
def _row_coef(coef, valid, ignored):
    """The gradient's factor of one row: ``coef`` (the mean's 1 / count or the upstream gradient), NaN for a
    target outside [0, V), 0 for an ignored row."""
    coef = tl.where(valid, coef, float("nan"))
    return tl.where(ignored, 0.0, coef)


@triton.jit
def _grad_elems(x, cols, t, lse, grow, smoothing, V, softcap, HAS_SOFTCAP: tl.constexpr):
    """``dloss/dx`` (before the row's factor) of fp32 logits ``x`` at columns ``cols`` of a row with target
    column ``t``, log-sum-exp ``lse`` and ``grow = 1 + 2 zl lse`` (the module docstring's gradient)."""
    if HAS_SOFTCAP:
        th, dzdx = _tanh_sech2(x * (1.0 / softcap))
        z = softcap * th
    else:
        z = x
    g = tl.exp(z - lse) * grow - smoothing / V - tl.where(cols == t, 1.0 - smoothing, 0.0)
    if HAS_SOFTCAP:
        g = g * dzdx
    return g


@triton.jit
def _grad_pass(x_row, dx_row, V, t, lse, coef, smoothing, z_loss, softcap,
               HAS_SOFTCAP: tl.constexpr, HINTS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr = 1,
               REVERSE: tl.constexpr = False):
    """Write ``coef * dloss/dx`` of one row (see the module docstring); ``coef`` is an fp32 scalar.
    ``REVERSE``: blocks from the row's end to its start, so that the blocks the first pass read last (the
    likeliest still in L2) are read again first."""
    grow = 1.0 + 2.0 * z_loss * lse
    nb = tl.cdiv(V, BLOCK)
    for i in tl.range(0, nb, num_stages=STAGES):
        if REVERSE:
            start = (nb - 1 - i) * BLOCK
        else:
            start = i * BLOCK
        cols = start + tl.arange(0, BLOCK)
        m = cols < V
        if HINTS:  # the row's last read: let it go first
            x = tl.load(x_row + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        g = _grad_elems(x, cols, t, lse, grow, smoothing, V, softcap, HAS_SOFTCAP)
        if HINTS:
            tl.store(dx_row + cols, (g * coef).to(dx_row.dtype.element_ty), mask=m, eviction_policy="evict_first")
        else:
            tl.store(dx_row + cols, (g * coef).to(dx_row.dtype.element_ty), mask=m)


@triton.jit
def _ce_fwd_kernel(
    X, T, LOSS, LSE, DX, SCALE,  # X: (rows, V) row stride stride_x; T: (rows,) int; LOSS, LSE: (rows,) fp32;
    # DX: (rows, V) row stride stride_dx (may alias X: each element is read before it is written);
    # SCALE: (1,) fp32, the gradient's factor (1 / count for the mean)
    rows, stride_x, stride_dx, V, ignore_index, smoothing, z_loss, softcap,
    HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, HINTS: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr, REVERSE: tl.constexpr, LANES: tl.constexpr = False,
):
    # program p takes rows p, p + P, p + 2P, ... (P programs): P bounds the rows in flight, so that a row's
    # second read (the gradient pass) can still find it in L2
    for r in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = tl.full((), 0, tl.int64) + r  # int64 (the interpreter's loop index is a Python int)
        x_row = X + row * stride_x
        t = tl.load(T + row).to(tl.int64)
        ignored = t == ignore_index
        valid = (t >= 0) & (t < V)
        t_safe = tl.where(valid, t, 0)
        if LANES:
            # per-lane running max and rescaled sum, one exp per element (e = exp(-|x - m|): a new max rescales
            # the old sum by e and counts 1, else e is added) and no cross-lane reduction until the row's end
            mv = tl.full((BLOCK,), -float("inf"), tl.float32)
            sv = tl.zeros((BLOCK,), tl.float32)
            zv = tl.zeros((BLOCK,), tl.float32)
            for start in tl.range(0, V, BLOCK, num_stages=STAGES):
                cols = start + tl.arange(0, BLOCK)
                m = cols < V
                if HINTS and WRITE_GRAD:
                    x = tl.load(x_row + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                else:
                    x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    x = softcap * _tanh(x * (1.0 / softcap))
                zv += tl.where(m, x, 0.0)
                d = x - mv
                e = tl.exp(-tl.abs(d))
                up = d > 0
                sv = tl.where(m, tl.where(up, sv * e + 1.0, sv + e), sv)
                mv = tl.where(m & up, x, mv)
            mx = tl.max(mv, 0)
            s = tl.sum(tl.where(sv > 0, sv * tl.exp(mv - mx), 0.0), 0)
            zsum = tl.sum(zv, 0)
        else:
            mx = -float("inf")
            s = 0.0
            zsum = 0.0
            for start in tl.range(0, V, BLOCK, num_stages=STAGES):  # STAGES > 1: loads issued ahead (pipelined)
                cols = start + tl.arange(0, BLOCK)
                m = cols < V
                if HINTS and WRITE_GRAD:  # keep the row in L2 for the gradient pass
                    x = tl.load(x_row + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                else:
                    x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    x = softcap * _tanh(x * (1.0 / softcap))
                zsum += tl.sum(tl.where(m, x, 0.0), 0)
                x = tl.where(m, x, -float("inf"))
                new_mx = tl.maximum(mx, tl.max(x, 0))
                s = s * tl.exp(mx - new_mx) + tl.sum(tl.exp(x - new_mx), 0)
                mx = new_mx
        lse = mx + tl.log(s)
        zt = tl.load(x_row + t_safe).to(tl.float32)
        if HAS_SOFTCAP:
            zt = softcap * _tanh(zt * (1.0 / softcap))
        _store_loss(LOSS + row, LSE + row, lse, zt, zsum, V, smoothing, z_loss, valid, ignored)
        if WRITE_GRAD:
            coef = _row_coef(tl.load(SCALE).to(tl.float32), valid, ignored)
            _grad_pass(x_row, DX + row * stride_dx, V, t_safe, lse, coef, smoothing, z_loss, softcap,
                       HAS_SOFTCAP, HINTS, BLOCK, STAGES, REVERSE)


@triton.jit
def _ce_fwd_split_kernel(
    X, T, LOSS, LSE, DX, SCALE, PM, PS, PZ, CNT,  # X, T, LOSS, LSE, DX, SCALE as _ce_fwd_kernel; PM, PS, PZ:
    # (rows * S,) fp32 per-segment max, rescaled sum and sum of z; CNT: (rows,) int32 zeros, segments done
    stride_x, stride_dx, V, ignore_index, smoothing, z_loss, softcap, max_spin,
    S: tl.constexpr, SP: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    # S programs per row, program s holding columns [s*BLOCK, (s+1)*BLOCK) in registers: the row is read from
    # memory once. Each publishes its segment's (max, sum exp, sum z), counts itself done with a release
    # atomic, waits (acquire) until all S segments of its row are published, and writes its part of the
    # gradient from the registers. Programs of a row have consecutive ids, so they are dispatched together;
    # the wait gives up after max_spin polls and writes NaN (never a hang).
    pid = tl.program_id(0)
    row = (pid // S).to(tl.int64)
    seg = pid % S
    cols = seg * BLOCK + tl.arange(0, BLOCK)
    m = cols < V
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if HAS_SOFTCAP:
        th, dzdx = _tanh_sech2(x * (1.0 / softcap))
        z = softcap * th
    else:
        z = x
    t = tl.load(T + row).to(tl.int64)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < V)
    zt = tl.sum(tl.where(cols == t, z, 0.0), 0)  # nonzero only in the segment holding the target
    zm = tl.where(m, z, -float("inf"))
    mx = tl.max(zm, 0)
    e = tl.exp(zm - mx)
    tl.store(PM + pid, mx)
    tl.store(PS + pid, tl.sum(e, 0))
    tl.store(PZ + pid, tl.sum(tl.where(m, z, 0.0), 0))
    n = tl.atomic_add(CNT + row, 1, sem="acq_rel") + 1
    spins = 0
    while (n < S) & (spins < max_spin):
        n = tl.atomic_add(CNT + row, 0, sem="acquire")
        spins += 1
    offs = tl.arange(0, SP)
    om = offs < S
    pm = tl.load(PM + row * S + offs, mask=om, other=-float("inf"), volatile=True)
    ps = tl.load(PS + row * S + offs, mask=om, other=0.0, volatile=True)
    gm = tl.max(pm, 0)
    lse = gm + tl.log(tl.sum(ps * tl.exp(pm - gm), 0))
    lse = tl.where(n >= S, lse, float("nan"))
    if seg == tl.where(valid, t // BLOCK, 0):  # one program per row writes the row's loss and lse
        zsum = tl.sum(tl.load(PZ + row * S + offs, mask=om, other=0.0, volatile=True), 0)
        _store_loss(LOSS + row, LSE + row, lse, zt, zsum, V, smoothing, z_loss, valid, ignored)
    coef = _row_coef(tl.load(SCALE).to(tl.float32), valid, ignored)
    g = e * (tl.exp(mx - lse) * (1.0 + 2.0 * z_loss * lse)) - smoothing / V
    g = g - tl.where(cols == t, 1.0 - smoothing, 0.0)
    if HAS_SOFTCAP:
        g = g * dzdx
    tl.store(DX + row * stride_dx + cols, (g * coef).to(DX.dtype.element_ty), mask=m,
             eviction_policy="evict_first")


@triton.jit
def _row_lse(x_row, V, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """``(lse, zsum)`` of one row read whole from memory (online max and sum of exponentials over BLOCK-wide
    blocks): the team kernels' fallback when a row's partial results do not all arrive. fp32; ``z`` is the
    softcapped logit where ``HAS_SOFTCAP``, ``zsum`` the sum of the row's ``z`` (for label smoothing)."""
    gm = -float("inf")
    ss = 0.0
    zsum = 0.0
    for j in range(0, tl.cdiv(V, BLOCK)):
        cj = j * BLOCK + tl.arange(0, BLOCK)
        mj = cj < V
        xj = tl.load(x_row + cj, mask=mj, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            xj = softcap * _tanh(xj * (1.0 / softcap))
        zsum += tl.sum(tl.where(mj, xj, 0.0), 0)
        xj = tl.where(mj, xj, -float("inf"))
        nm = tl.maximum(gm, tl.max(xj, 0))
        ss = ss * tl.exp(gm - nm) + tl.sum(tl.exp(xj - nm), 0)
        gm = nm
    return gm + tl.log(ss), zsum


@triton.jit
def _row_loss(x_row, t_ptr, loss_ptr, lse_ptr, lse, zsum, write, V, ignore_index, smoothing, z_loss, softcap,
              coef0, HAS_SOFTCAP: tl.constexpr):
    """The team kernels' per-row loss: reads the row's target, stores its loss and lse where ``write`` (one
    program per row), returns ``(target, coef)`` with ``coef`` ``coef0`` for a valid target, 0 for an
    ignored one and NaN for one outside ``[0, V)``. Loss: ``(1-s)(lse - z_t) + s(lse - zsum/V) + z_loss·lse²``."""
    t = tl.load(t_ptr).to(tl.int64)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < V)
    if write:
        zt = tl.load(x_row + tl.where(valid, t, 0)).to(tl.float32)
        if HAS_SOFTCAP:
            zt = softcap * _tanh(zt * (1.0 / softcap))
        _store_loss(loss_ptr, lse_ptr, lse, zt, zsum, V, smoothing, z_loss, valid, ignored)
    return t, _row_coef(coef0, valid, ignored)


@triton.jit
def _ce_team_kernel(
    X, T, LOSS, LSE, DX, SCALE, PM, PS, PZ, CNT,  # X, T, LOSS, LSE, DX, SCALE as _ce_fwd_kernel (DX must not
    # alias X); PM, PS, PZ: (rows * S,) fp32 per-segment max, sum of exp(z - max), sum of z; CNT: (rows,) int32
    # zeros, the segments of the row published so far
    rows, nteams, stride_x, stride_dx, V, ignore_index, smoothing, z_loss, softcap, neg2log2e_c, max_spin,
    S: tl.constexpr, SP: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, KEEP_EXP: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK: tl.constexpr,
):
    # A persistent grid of nteams teams of S programs; program (team, seg) holds columns [seg*BLOCK, (seg+1)*BLOCK)
    # of rows team, team + nteams, ... in registers, so each logit is read from memory once. Per row: publish the
    # segment's (max, sum exp, sum z), count it with a release atomic, wait (acquire) for the row's S segments,
    # combine them into the row's lse and write the gradient from the registers. The launcher sizes the grid to
    # the programs that fit on the GPU at once (registers capped with maxnreg), so the S programs of a team are
    # co-resident. Should a wait still outlast max_spin polls (other work holding SMs, or the interpreter, whose
    # programs run one after another), the program reads the whole row from memory itself and stops waiting from
    # then on: slower, never wrong, never a hang.
    LOG2E: tl.constexpr = 1.4426950408889634
    pid = tl.program_id(0)
    team = pid // S
    seg = pid % S
    cols = seg * BLOCK + tl.arange(0, BLOCK)
    m = cols < V
    offs = tl.arange(0, SP)
    om = offs < S
    coef0 = tl.load(SCALE).to(tl.float32)
    patience = max_spin
    r0 = tl.full((), 0, tl.int64) + team
    xb = tl.load(X + r0 * stride_x + cols, mask=cols < tl.where(r0 < rows, V, 0), other=0.0)
    for r in range(team, rows, nteams):
        row = tl.full((), 0, tl.int64) + r
        cur = xb
        x = cur.to(tl.float32)
        if HAS_SOFTCAP:  # tanh and sech^2 from one exp2 and one fast reciprocal (see _tanh_sech2)
            e = tl.exp2(tl.abs(x) * neg2log2e_c)
            rc = tl.fdiv(tl.full(e.shape, 1.0, tl.float32), 1.0 + e)
            er = e * rc
            th = rc - er
            z = tl.where(x < 0, -softcap, softcap) * th
            s2 = er * rc  # sech^2 / 4
        else:
            z = x
        zm = tl.where(m, z, -float("inf"))
        mloc = tl.max(zm, 0)
        el = tl.exp2((zm - mloc) * LOG2E)
        tl.store(PM + row * S + seg, mloc)
        tl.store(PS + row * S + seg, tl.sum(el, 0))
        if SMOOTH:
            tl.store(PZ + row * S + seg, tl.sum(tl.where(m, z, 0.0), 0))
        tl.debug_barrier()
        n = tl.atomic_add(CNT + row, 1, sem="release") + 1
        nr = row + nteams
        if PREFETCH:  # the next row's segment, in flight while this row's segments are waited for
            xb = tl.load(X + nr * stride_x + cols, mask=cols < tl.where(nr < rows, V, 0), other=0.0)
        spins = 0
        while (n < S) & (spins < patience):
            n = tl.atomic_add(CNT + row, 0, sem="acquire")
            spins += 1
        if n >= S:
            pm = tl.load(PM + row * S + offs, mask=om, other=-float("inf"), volatile=True)
            ps = tl.load(PS + row * S + offs, mask=om, other=0.0, volatile=True)
            gm = tl.max(pm, 0)
            lse = gm + tl.log(tl.sum(ps * tl.exp(pm - gm), 0))
            if SMOOTH:
                zsum = tl.sum(tl.load(PZ + row * S + offs, mask=om, other=0.0, volatile=True), 0)
            else:
                zsum = 0.0
        else:  # gave up waiting: the whole row from memory, and no more waits
            patience = 0
            lse, zsum = _row_lse(X + row * stride_x, V, softcap, HAS_SOFTCAP, BLOCK)
        t, coef = _row_loss(X + row * stride_x, T + row, LOSS + row, LSE + row, lse, zsum, seg == 0, V, ignore_index,
                            smoothing, z_loss, softcap, coef0, HAS_SOFTCAP)
        if HAS_SOFTCAP:
            coef = coef * 4.0
        a = (1.0 + 2.0 * z_loss * lse) * coef
        if KEEP_EXP or HAS_SOFTCAP:
            g = el * (tl.exp(mloc - lse) * a)
        else:
            g = tl.exp2((z - lse) * LOG2E) * a
        g = g - tl.where(cols == t, (1.0 - smoothing) * coef, 0.0)
        if SMOOTH:
            g = g - smoothing / V * coef
        if HAS_SOFTCAP:
            g = g * s2
        tl.store(DX + row * stride_dx + cols, g.to(DX.dtype.element_ty), mask=m)
        if not PREFETCH:
            xb = tl.load(X + nr * stride_x + cols, mask=cols < tl.where(nr < rows, V, 0), other=0.0)


@triton.jit
def _ce_team_l2_kernel(
    X, T, LOSS, LSE, DX, SCALE, PM, PS, PZ, CNT,  # as _ce_team_kernel
    rows, nteams, stride_x, stride_dx, V, ignore_index, smoothing, z_loss, softcap, max_spin,
    S: tl.constexpr, SP: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, SEG: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, FLAGS: tl.constexpr = False,
):
    # As _ce_team_kernel (teams of S co-resident programs per row, partials combined through global memory), but
    # program (team, seg) streams its SEG columns twice in BLOCK-wide blocks instead of holding them in
    # registers: the second read comes from L2, since only nteams rows (nteams * V * bytes, a few MB) are in
    # flight between a segment's two reads. Few registers, so many programs per SM hide the wait of each.
    # FLAGS: instead of a counter, each segment publishes (max, sum) as one 64-bit store into PM (int64 zeros,
    # viewed as such) and (sum z, 1) into PZ; waiting polls the row's S words until none is 0 (a sum of exps is
    # >= 1: its low half is never 0 once written). One store and one load round trip instead of a fence, an
    # atomic and a load. CNT and PS unused then.
    pid = tl.program_id(0)
    team = pid // S
    seg = pid % S
    offs = tl.arange(0, SP)
    om = offs < S
    coef0 = tl.load(SCALE).to(tl.float32)
    patience = max_spin
    c0 = seg * SEG
    NB: tl.constexpr = SEG // BLOCK
    for r in range(team, rows, nteams):
        row = tl.full((), 0, tl.int64) + r
        x_row = X + row * stride_x
        mx = -float("inf")
        ssum = 0.0
        zs = 0.0
        for i in tl.range(0, NB, num_stages=STAGES):
            cols = c0 + i * BLOCK + tl.arange(0, BLOCK)
            m = cols < V
            x = tl.load(x_row + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_SOFTCAP:
                x = softcap * _tanh(x * (1.0 / softcap))
            if SMOOTH:
                zs += tl.sum(tl.where(m, x, 0.0), 0)
            x = tl.where(m, x, -float("inf"))
            nm = tl.maximum(mx, tl.max(x, 0))
            ssum = ssum * tl.exp(mx - nm) + tl.sum(tl.exp(x - nm), 0)
            mx = nm
        if FLAGS:
            W = PM.to(tl.pointer_type(tl.int64))
            WZ = PZ.to(tl.pointer_type(tl.int64))
            LO: tl.constexpr = 0xFFFFFFFF
            tl.store(W + row * S + seg, (mx.to(tl.int32, bitcast=True).to(tl.int64) << 32)
                     | (ssum.to(tl.int32, bitcast=True).to(tl.int64) & LO))
            if SMOOTH:
                tl.store(WZ + row * S + seg, (zs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | 1)
            wv = tl.load(W + row * S + offs, mask=om, other=1, volatile=True)
            missing = tl.sum(tl.where((wv & LO) == 0, 1, 0), 0)
            if SMOOTH:
                wz = tl.load(WZ + row * S + offs, mask=om, other=1, volatile=True)
                missing += tl.sum(tl.where(wz == 0, 1, 0), 0)
            spins = 0
            while (missing > 0) & (spins < patience):
                wv = tl.load(W + row * S + offs, mask=om, other=1, volatile=True)
                missing = tl.sum(tl.where((wv & LO) == 0, 1, 0), 0)
                if SMOOTH:
                    wz = tl.load(WZ + row * S + offs, mask=om, other=1, volatile=True)
                    missing += tl.sum(tl.where(wz == 0, 1, 0), 0)
                spins += 1
            n = tl.where(missing == 0, S, 0)
            pm = tl.where(om, (wv >> 32).to(tl.int32).to(tl.float32, bitcast=True), -float("inf"))
            ps = tl.where(om, (wv & LO).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
            if SMOOTH:
                pz = tl.where(om, (wz >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
        else:
            tl.store(PM + row * S + seg, mx)
            tl.store(PS + row * S + seg, ssum)
            if SMOOTH:
                tl.store(PZ + row * S + seg, zs)
            tl.debug_barrier()
            n = tl.atomic_add(CNT + row, 1, sem="release") + 1
            spins = 0
            while (n < S) & (spins < patience):
                n = tl.atomic_add(CNT + row, 0, sem="acquire")
                spins += 1
            pm = tl.load(PM + row * S + offs, mask=om, other=-float("inf"), volatile=True)
            ps = tl.load(PS + row * S + offs, mask=om, other=0.0, volatile=True)
            if SMOOTH:
                pz = tl.load(PZ + row * S + offs, mask=om, other=0.0, volatile=True)
        if n >= S:
            gm = tl.max(pm, 0)
            lse = gm + tl.log(tl.sum(ps * tl.exp(pm - gm), 0))
            if SMOOTH:
                zsum = tl.sum(pz, 0)
            else:
                zsum = 0.0
        else:  # gave up waiting: the whole row from memory, and no more waits
            patience = 0
            lse, zsum = _row_lse(x_row, V, softcap, HAS_SOFTCAP, BLOCK)
        t, coef = _row_loss(x_row, T + row, LOSS + row, LSE + row, lse, zsum, seg == 0, V, ignore_index,
                            smoothing, z_loss, softcap, coef0, HAS_SOFTCAP)
        grow = 1.0 + 2.0 * z_loss * lse
        dx_row = DX + row * stride_dx
        for i in tl.range(0, NB, num_stages=STAGES):
            cols = c0 + (NB - 1 - i) * BLOCK + tl.arange(0, BLOCK)  # the blocks read last first
            m = cols < V
            x = tl.load(x_row + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            g = _grad_elems(x, cols, t, lse, grow, smoothing, V, softcap, HAS_SOFTCAP)
            tl.store(dx_row + cols, (g * coef).to(DX.dtype.element_ty), mask=m, eviction_policy="evict_first")


@triton.jit
def _ce_bwd_kernel(
    X, T, LSE, G, DX,  # X: (rows, V) row stride stride_x; T, LSE: (rows,); G: per-row upstream gradient
    # (fp32, stride stride_g; 0 for a broadcast scalar); DX: (rows, V) row stride stride_dx
    stride_x, stride_g, stride_dx, V, ignore_index, smoothing, z_loss, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row).to(tl.int64)
    valid = (t >= 0) & (t < V)
    coef = tl.load(G + row * stride_g).to(tl.float32)
    coef = tl.where(valid, coef, float("nan"))
    coef = tl.where(t == ignore_index, 0.0, coef)  # an ignored row: 0, even when the mean's 1/count is inf
    lse = tl.load(LSE + row)
    _grad_pass(X + row * stride_x, DX + row * stride_dx, V, tl.where(valid, t, 0), lse, coef, smoothing,
               z_loss, softcap, HAS_SOFTCAP, False, BLOCK)


@triton.jit
def _scale_kernel(DX, G, n, BLOCK: tl.constexpr):  # DX: (n,) contiguous, scaled in place; G: (1,) fp32
    g = tl.load(G).to(tl.float32)
    if g != 1.0:  # the usual loss.backward(): nothing to do, no bytes moved (one small grid, so ~3 us)
        for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = (tl.full((), 0, tl.int64) + b) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            d = tl.load(DX + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(DX + offs, (d * g).to(DX.dtype.element_ty), mask=m)


@triton.jit
def _ex2(x, ASM: tl.constexpr):
    """2^x in fp32. ``ASM`` (a GPU, not the interpreter, which cannot run inline PTX): ``ex2.approx.ftz.f32``, one
    MUFU.EX2; ``tl.exp2`` lowers to the non-ftz ``ex2.approx.f32``, which adds a compare and two predicated
    multiplies per element to scale subnormal results (seen in the SASS, docs/gpu-runs/cross_entropy-run9.md).
    Results below 2^-126 flush to 0: probabilities that small change no fp32 sum and no bf16/fp16 gradient
    by more than 2^-126 absolute."""
    if ASM:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def _rcp12(d, NEWTON: tl.constexpr, ASM: tl.constexpr):
    """1 / d for ``d`` in [1, 2], fp32. ``NEWTON``: on the FMA pipe alone (no MUFU.RCP): the minimax quadratic of
    relative error 1/99 (``d q(d) = 1 + T3(2d - 3) / 99``, T3 the Chebyshev polynomial, so
    ``q(d) = (32 d^2 - 144 d + 210) / 99``) and two Newton steps ``r += r (1 - d r)`` (error 1/99 -> 1e-4 -> 1e-8,
    then fp32 rounding): six FFMA. Else ``rcp.approx.ftz.f32`` (one MUFU.RCP, 1 ulp) on a GPU, a division in
    the interpreter."""
    if NEWTON:
        r = (d * (32.0 / 99.0) - 144.0 / 99.0) * d + 210.0 / 99.0
        r = r + r * (1.0 - d * r)
        r = r + r * (1.0 - d * r)
    elif ASM:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = 1.0 / d
    return r


@triton.jit
def _softcap_fast(x, k, c, NEWTON: tl.constexpr, ASM: tl.constexpr):
    """``(z, e, r)``: ``z = c tanh(x / c)``, ``e = exp(-2|x / c|)`` (``k = -2 log2(e) / c``), ``r = 1 / (1 + e)``;
    ``sech(x / c)^2 = 4 e r^2``. ``c tanh(|x| / c) = c (2 r - 1)`` (one FFMA), its sign set from ``x``'s sign bit
    (one LOP3). Absolute error of ``z`` ~ c * 1e-7 (that of the formula ``(1 - e) r`` too)."""
    e = _ex2(tl.abs(x) * k, ASM)
    r = _rcp12(1.0 + e, NEWTON, ASM)
    za = r * (2.0 * c) - c
    z = (za.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    return z, e, r


@triton.jit
def _fast_lse_step(x, mx, s, ASM: tl.constexpr):
    """One block of the online log-sum-exp: ``(max, sum exp(z - max))`` after the block ``x`` (fp32; masked
    lanes -inf), from the running ``(mx, s)``; exp as ex2 with the log2(e) scale folded into one FFMA."""
    LOG2E: tl.constexpr = 1.4426950408889634
    nm = tl.maximum(mx, tl.max(x, 0))
    return nm, s * _ex2((mx - nm) * LOG2E, ASM) + tl.sum(_ex2(x * LOG2E - nm * LOG2E, ASM), 0)


@triton.jit
def _fast_lse_step_local(x, mv, sv, softcap, FIXED: tl.constexpr, ASM: tl.constexpr):
    """The per-thread form of :func:`_fast_lse_step` on an (R, VEC) tile: a running max and sum per tile row
    (``mv``, ``sv``: (R,)); ``FIXED`` (softcap c <= FIXED_MAX_SOFTCAP): ``sv += sum exp(z - c)``, no max."""
    LOG2E: tl.constexpr = 1.4426950408889634
    if FIXED:  # z <= c: exp(z - c) in [exp(-2c), 1], no max needed (see the launcher)
        sv += tl.sum(_ex2(x * LOG2E - softcap * LOG2E, ASM), 1)
    else:
        nm = tl.maximum(mv, tl.max(x, 1))
        ns = tl.where(nm == -float("inf"), 0.0, nm) * LOG2E  # a row of -inf logits: no NaN
        sv = sv * _ex2(mv * LOG2E - ns, ASM) + tl.sum(_ex2(x * LOG2E - ns[:, None], ASM), 1)
        mv = nm
    return mv, sv


@triton.jit
def _fast_grad(x, kexp, softcap, a, b, sub, HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
               NEWTON: tl.constexpr, ASM: tl.constexpr):
    """The gradient of one block without the target column's term: ``a * exp(z - lse) - sub``, times
    ``sech^2 / 4`` with a softcap (the 4 is folded into ``a`` and ``sub``); ``b = lse * log2(e)``."""
    LOG2E: tl.constexpr = 1.4426950408889634
    if HAS_SOFTCAP:
        z, e, rc = _softcap_fast(x, kexp, softcap, NEWTON, ASM)
    else:
        z = x
    g = _ex2(z * LOG2E - b, ASM) * a
    if SMOOTH:
        g = g - sub
    if HAS_SOFTCAP:
        g = g * (e * rc * rc)
    return g


@triton.jit
def _ce_fast_kernel(
    X, T, LOSS, LSE, DX, SCALE,  # as _ce_fwd_kernel with WRITE_GRAD (DX may alias X)
    rows, stride_x, stride_dx, V, ignore_index, smoothing, z_loss, softcap, kexp,  # kexp = -2 log2(e) / softcap
    HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr, HINTS: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, NEWTON1: tl.constexpr, NEWTON2: tl.constexpr, ASM: tl.constexpr,
    LOCAL: tl.constexpr = False, VEC: tl.constexpr = 8, FIXED: tl.constexpr = False,
):
    # The "rev" kernel (_ce_fwd_kernel with WRITE_GRAD and REVERSE) with fewer instructions per element: the row's
    # V // BLOCK full blocks unmasked and one masked tail block; no sum of z unless SMOOTH (label smoothing), no
    # z-loss factor unless ZLOSS; exp as one ex2 (an FFMA folds the log2(e) scale and the max); the target
    # column's "- (1 - eps)" not as a compare and select per element but as one scalar store after the gradient
    # pass (behind a barrier, so that it lands after the vector store of its block). NEWTON1/NEWTON2: the softcap's
    # reciprocal on the FMA pipe in the forward / gradient pass (_rcp12). LOCAL: the forward keeps a running max
    # and sum per 16-byte vector of the block inside each thread (VEC elements), combined across threads once per
    # row; FIXED (LOCAL with a softcap c <= FIXED_MAX_SOFTCAP): sum exp(z - c), no max at all.
    LOG2E: tl.constexpr = 1.4426950408889634
    nfull = V // BLOCK
    tail = nfull * BLOCK
    for r in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = tl.full((), 0, tl.int64) + r
        x_row = X + row * stride_x
        t = tl.load(T + row).to(tl.int64)
        ignored = t == ignore_index
        valid = (t >= 0) & (t < V)
        t_safe = tl.where(valid, t, 0)
        if LOCAL:
            # per-thread state: the block as (R, VEC) rows of one 16-byte vector each, a running max and rescaled sum
            # per row of the tile (reductions along VEC stay in the thread), combined across threads once per row
            R: tl.constexpr = BLOCK // VEC
            offs = tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]
            mv = tl.full((R,), -float("inf"), tl.float32)
            sv = tl.zeros((R,), tl.float32)
            zv = tl.zeros((R,), tl.float32)
            for i in tl.range(0, nfull, num_stages=STAGES):
                if HINTS:
                    x = tl.load(x_row + i * BLOCK + offs, eviction_policy="evict_last").to(tl.float32)
                else:
                    x = tl.load(x_row + i * BLOCK + offs).to(tl.float32)
                if HAS_SOFTCAP:
                    x, _e, _r = _softcap_fast(x, kexp, softcap, NEWTON1, ASM)
                if SMOOTH:
                    zv += tl.sum(x, 1)
                mv, sv = _fast_lse_step_local(x, mv, sv, softcap, FIXED, ASM)
            if tail < V:
                m2 = tail + offs < V
                x = tl.load(x_row + tail + offs, mask=m2, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    x, _e, _r = _softcap_fast(x, kexp, softcap, NEWTON1, ASM)
                if SMOOTH:
                    zv += tl.sum(tl.where(m2, x, 0.0), 1)
                x = tl.where(m2, x, -float("inf"))
                mv, sv = _fast_lse_step_local(x, mv, sv, softcap, FIXED, ASM)
            if FIXED:
                mx = softcap
                s = tl.sum(sv, 0)
            else:
                mx = tl.max(mv, 0)
                s = tl.sum(sv * _ex2(mv * LOG2E - mx * LOG2E, ASM), 0)
            zsum = tl.sum(zv, 0)
        else:
            mx = -float("inf")
            s = 0.0
            zsum = 0.0
            for i in tl.range(0, nfull, num_stages=STAGES):
                cols = i * BLOCK + tl.arange(0, BLOCK)
                if HINTS:
                    x = tl.load(x_row + cols, eviction_policy="evict_last").to(tl.float32)
                else:
                    x = tl.load(x_row + cols).to(tl.float32)
                if HAS_SOFTCAP:
                    x, _e, _r = _softcap_fast(x, kexp, softcap, NEWTON1, ASM)
                if SMOOTH:
                    zsum += tl.sum(x, 0)
                mx, s = _fast_lse_step(x, mx, s, ASM)
            if tail < V:
                cols = tail + tl.arange(0, BLOCK)
                m = cols < V
                x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    x, _e, _r = _softcap_fast(x, kexp, softcap, NEWTON1, ASM)
                if SMOOTH:
                    zsum += tl.sum(tl.where(m, x, 0.0), 0)
                x = tl.where(m, x, -float("inf"))
                mx, s = _fast_lse_step(x, mx, s, ASM)
        lse = mx + tl.log(s)
        xt = tl.load(x_row + t_safe).to(tl.float32)
        if HAS_SOFTCAP:
            tht, dzdx_t = _tanh_sech2(xt * (1.0 / softcap))
            zt = softcap * tht
        else:
            zt = xt
            dzdx_t = 1.0
        _store_loss(LOSS + row, LSE + row, lse, zt, zsum, V, smoothing, z_loss, valid, ignored)
        coef = _row_coef(tl.load(SCALE).to(tl.float32), valid, ignored)
        if ZLOSS:
            grow = 1.0 + 2.0 * z_loss * lse
        else:
            grow = 1.0
        a = coef * grow
        sub = smoothing / V * coef
        if HAS_SOFTCAP:  # sech^2 = 4 e r^2: the 4 folded into the scalars
            a = a * 4.0
            sub = sub * 4.0
        b = lse * LOG2E
        dx_row = DX + row * stride_dx
        if tail < V:  # the blocks in reverse order: the tail first
            cols = tail + tl.arange(0, BLOCK)
            m = cols < V
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
            g = _fast_grad(x, kexp, softcap, a, b, sub, HAS_SOFTCAP, SMOOTH, NEWTON2, ASM)
            tl.store(dx_row + cols, g.to(DX.dtype.element_ty), mask=m)
        for i in tl.range(0, nfull, num_stages=STAGES):
            cols = (nfull - 1 - i) * BLOCK + tl.arange(0, BLOCK)
            if HINTS:
                x = tl.load(x_row + cols, eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(x_row + cols).to(tl.float32)
            g = _fast_grad(x, kexp, softcap, a, b, sub, HAS_SOFTCAP, SMOOTH, NEWTON2, ASM)
            if HINTS:
                tl.store(dx_row + cols, g.to(DX.dtype.element_ty), eviction_policy="evict_first")
            else:
                tl.store(dx_row + cols, g.to(DX.dtype.element_ty))
        # the target column: p_t grow - eps / V - (1 - eps), times dz/dx and coef, over what the pass wrote there
        tl.debug_barrier()
        gt = (tl.exp(zt - lse) * grow - smoothing / V - (1.0 - smoothing)) * dzdx_t * coef
        tl.store(dx_row + t_safe, gt.to(DX.dtype.element_ty))


_FWD = Launcher(_ce_fwd_kernel)
_FWD_FAST = Launcher(_ce_fast_kernel)
_FWD_SPLIT = Launcher(_ce_fwd_split_kernel)
_FWD_TEAM = Launcher(_ce_team_kernel)
_FWD_TEAM_L2 = Launcher(_ce_team_l2_kernel)
_BWD = Launcher(_ce_bwd_kernel)
_SCALE = Launcher(_scale_kernel)


#: A launch setting of the forward: (BLOCK, num_warps, kind, programs per SM, stages). kind "row": one program
#: per row (grid = rows when programs per SM is 0, else a persistent grid of that many programs per SM, with L2
#: eviction hints when writing the gradient), loads pipelined ``stages`` deep when > 1; kind "split":
#: S = ceil(V / BLOCK) programs per row, each holding its BLOCK columns in registers (gradient-writing launches
#: on a GPU only); kinds "rev" and "revh": as "row", the gradient pass walking the row backwards ("revh" also
#: with the L2 eviction hints on a grid of one program per row); kinds "lane" and "laneh": as "rev" and "revh"
#: with the forward's log-sum-exp kept per lane (one running max and sum per element of the block, reduced once at
#: the row's end instead of twice per block).
#: (BLOCK, num_warps) of the split kernel's candidates: none by default. Measured on the H200 (run 2 sweep,
#: 8192 x 128256 bf16 fwd+bwd): 2.73-3.75 ms against 1.86 ms for one program per row, so it is not tried.
SPLIT_SETTINGS: tuple = ()
#: Largest softcap c for which the "fast" kernel's per-thread forward sums exp(z - c) without a running max: z <= c,
#: so every term is at least exp(-2c), a normal fp32 number (>= 2^-126, ``ex2.approx.ftz`` flushes below) for
#: 2c log2(e) < 126, c < 43.6.
FIXED_MAX_SOFTCAP = 40.0
#: Most programs per row of the split kernel (its partials are read as one block of this many).
MAX_SPLIT = 64
#: Polls of a row's counter before the split kernel gives up and writes NaN (a safeguard: see the kernel).
MAX_SPIN = 1 << 16
#: Candidates of a gradient-writing forward launch (BLOCK, num_warps, kind, programs per SM, stages), the default
#: first. Kind "fast" (_ce_fast_kernel): stages = pipeline depth + 10 * (1: the forward's reciprocal on the FMA
#: pipe, 2: the gradient pass's) + 1000 (the per-thread forward, "LOCAL"); programs per SM > 0: a persistent grid
#: with L2 eviction hints. Measured on the H200 (docs/gpu-runs/cross_entropy-run9.md, 8192 x 128256 bf16, ce_fwd
#: writing the gradient, do_bench medians of two interleaved rounds): plain, (8192, 8, fast, 0, 3) 1.47-1.50 ms,
#: (4096, 8, fast, 2, 1004) 1.47, (8192, 8, fast, 0, 1003) 1.51, the earlier default (2048, 4, rev, 0, 4) 1.62-1.80
#: in the same runs; with softcap 30, (4096, 4, fast, 0, 1014) 1.71-1.77, (8192, 8, fast, 0, 1003) 1.76, the
#: register team (4096, 4, team, 4, 1) 2.77-2.79 and "row" 2.89. The plain kernel moves 6 bytes per logit at 98%
#: of copy bandwidth (ncu: the gradient pass's re-read comes from HBM), so its instruction cuts (38 -> 16 per
#: logit) buy 5-9%; the softcap kernel is MUFU-bound (ncu: XU pipe 82-92% busy) at a power-capped clock.
#: Earlier (cross_entropy-run3.md to -run8.md): "rev" other block/depth pairs 1.58-1.84 ms, persistent "rev" grids
#: 2.0-3.3 ms, the per-lane "lane" kinds 1.88-2.95 ms, "team2" 1.73-3.1 ms: none tried any more ("rev" and the
#: softcap team stay as candidates). The two unpipelined "fast" settings (stages 1: loads straight to registers,
#: no shared-memory staging, less on-chip traffic at a power-capped clock) were first timed in run 9's last call.
WRITE_SETTINGS: tuple = ((8192, 8, "fast", 0, 1003), (8192, 8, "fast", 0, 3), (4096, 8, "fast", 2, 1004),
                         (8192, 8, "fast", 2, 1003), (4096, 4, "fast", 0, 1014), (4096, 8, "fast", 0, 1014),
                         (2048, 4, "fast", 0, 1004), (4096, 4, "fast", 0, 1011), (8192, 8, "fast", 0, 1001),
                         (2048, 4, "rev", 0, 4), (4096, 4, "team", 4, 1))


def _candidates(V: int, write: bool = False, split: bool = False):
    """Launch settings to try (see :data:`SPLIT_SETTINGS`), the default first; BLOCK never far above V.

    ``write``: the launch writes the gradient (:data:`WRITE_SETTINGS`);
    ``split``: the split kernel may run (a CUDA device, not the interpreter, whose programs run one after
    another and could never wait for each other)."""
    cap = pow2_at_least(V)
    out = []
    if write and split:
        for b, w in SPLIT_SETTINGS:
            b = min(b, max(cap, 16))
            c = (b, min(w, max(1, b // 256)), "split", 0, 1)
            if cdiv(V, b) <= MAX_SPLIT and c not in out:
                out.append(c)
    if write:
        cands = list(WRITE_SETTINGS)
    else:
        cands = [(b, w, "row", pps, st) for b, w, pps, st in
                 ((4096, 8, 0, 1), (2048, 4, 0, 1), (16384, 16, 0, 1), (8192, 16, 0, 1), (1024, 4, 0, 1),
                  (2048, 4, 0, 3), (4096, 8, 0, 3))]
    for b, w, kind, pps, st in cands:
        b = min(b, max(cap, 16))
        c = (b, min(w, max(1, b // 256)), kind, pps, st)
        if c not in out:
            out.append(c)
    return out


def team_grid(S: int, warps: int, pps: int, device: torch.device) -> Tuple[int, Optional[int]]:
    """(programs, maxnreg) of a team launch: ``pps`` programs of ``warps`` warps per SM, registers capped so that
    they fit together in the SM's 65536 32-bit registers (the H100/H200 register file, NVIDIA's Hopper tuning
    guide; allocated per warp in units of 256, so per thread a multiple of 8) and threads within the 2048 an SM
    holds. Shared memory is not capped here: the team kernels use at most 16.4 KB per program (pipelined loads;
    Triton's report in docs/gpu-runs/cross_entropy-run7.md), within the H200's 228 KB per SM for up to 13 programs
    per SM. A grid of at most that many programs is resident at once on an otherwise idle GPU, so the S programs
    of a team run together (the kernel stays correct, only slower, if they do not: see _ce_team_kernel)."""
    threads = pps * warps * 32
    if threads > 2048:
        raise ValueError(f"{pps} programs of {warps} warps exceed an SM's 2048 threads")
    maxnreg = min(255, (65536 // threads) // 8 * 8)
    return max(S, (pps * sm_count(device)) // S * S), (None if INTERPRET else maxnreg)


def split_ok(x: torch.Tensor) -> bool:
    """Whether the split kernel may run on ``x``: a CUDA tensor outside the interpreter (whose programs run one
    after another, so that a program waiting for its row's other segments would give up and write NaN)."""
    return x.is_cuda and not INTERPRET


def check_inputs(x: torch.Tensor, target: torch.Tensor) -> None:
    """ValueError unless ``x`` is (rows, V) fp32/fp16/bf16 and ``target`` an integer (rows,) on its device."""
    if x.dim() != 2:
        raise ValueError(f"logits must be 2-D (rows, V) here, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits dtype {x.dtype} is not supported (float32, float16 or bfloat16)")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target dtype {target.dtype} is not int64 or int32 (class-probability targets are "
                         "not supported)")
    if tuple(target.shape) != (x.shape[0],):
        raise ValueError(f"target shape {tuple(target.shape)} != ({x.shape[0]},), the logits' rows")
    if target.device != x.device:
        raise ValueError(f"target device {target.device} != logits device {x.device}")


# ---------------------------------------------------------------- PyTorch fallback (CPU without the interpreter)

def _torch_rows(x: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float, z_loss: float,
                softcap: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, lse, loss rows, valid, ignored) computed with torch ops in fp32, no autograd needed."""
    z = torch_z(x, softcap)
    lse = torch.logsumexp(z, dim=-1)
    t = target.long()
    valid = (t >= 0) & (t < x.shape[1])
    ignored = t == ignore_index
    zt = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    loss = (1 - smoothing) * (lse - zt) + smoothing * (lse - z.mean(-1)) + z_loss * lse * lse
    loss = torch.where(valid, loss, float("nan"))
    return z, lse, torch.where(ignored, 0.0, loss), (valid, ignored)


def torch_z(x: torch.Tensor, softcap: float) -> torch.Tensor:
    """fp32 ``z`` of logits ``x``: ``c tanh(x / c)`` with a softcap ``c > 0``, else ``x``."""
    z = x.float()
    return softcap * torch.tanh(z / softcap) if softcap > 0 else z


def _torch_grad(z: torch.Tensor, x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                valid_ignored, smoothing: float, z_loss: float, softcap: float, V: Optional[int] = None,
                col0: int = 0) -> torch.Tensor:
    """fp32 gradient of the rows' loss times ``coef`` (per row, broadcastable). ``z``, ``x``: whole rows, or the
    columns [col0, col0 + z.shape[1]) of rows of ``V`` classes (then only a target inside them is subtracted)."""
    valid, ignored = valid_ignored
    C = z.shape[1]
    V = C if V is None else V
    p = torch.exp(z - lse.unsqueeze(1))
    g = p * (1 + 2 * z_loss * lse).unsqueeze(1) - smoothing / V
    loc = target.long() - col0
    hit = valid & (loc >= 0) & (loc < C)
    g.scatter_add_(1, torch.where(hit, loc, 0).unsqueeze(1),
                   torch.where(hit, -(1 - smoothing), 0.0).to(g.dtype).unsqueeze(1))
    if softcap > 0:
        g = g * torch.cosh(x.float() / softcap).pow(-2)  # sech^2, accurate where tanh rounds to +-1
    coef = torch.where(valid, coef.float(), float("nan"))
    coef = torch.where(ignored, 0.0, coef)
    return g * coef.unsqueeze(1)


# ---------------------------------------------------------------- launchers

def ce_fwd(x: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float, z_loss: float,
           softcap: float, grad_scale: Optional[torch.Tensor] = None, dx: Optional[torch.Tensor] = None,
           setting: Optional[tuple] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and lse (both fp32, (rows,)) of logits ``x`` (rows, V); ``softcap`` 0 means none.

    With ``grad_scale`` (a (1,) or 0-d fp32 device tensor) the same launch also writes
    ``grad_scale * dloss_row/dx`` into ``dx`` ((rows, V), contiguous; it may be ``x`` itself when ``x``
    is contiguous and private to the caller). ``x`` may have any row stride (unit column stride, else
    it is copied). ``setting``: a launch setting (see :data:`WRITE_SETTINGS`) instead of the tuned one (tests and
    benchmarks; a "team" setting only with a ``dx`` that is not ``x``).
    """
    check_inputs(x, target)
    rows, V = x.shape
    loss = torch.empty(rows, dtype=torch.float32, device=x.device)
    lse = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return loss, lse
    write = grad_scale is not None
    if not use_triton(x):
        z, lse_, loss_, vi = _torch_rows(x, target, ignore_index, smoothing, z_loss, softcap)
        if write:
            dx.copy_(_torch_grad(z, x, target, lse_, grad_scale.reshape(()).expand(rows), vi, smoothing, z_loss,
                                 softcap))
        return loss.copy_(loss_), lse.copy_(lse_)
    if V == 0:
        raise ValueError("logits have 0 classes")
    x2, sx = as_rows(x, V)
    t = target.contiguous()
    scale = grad_scale.reshape(1).float() if write else loss  # a placeholder pointer when not writing
    d2, sd = (dx, dx.stride(0)) if write else (x2, sx)

    split = write and split_ok(x)

    def launch(c):
        block, warps, kind, pps, stages = c
        cap = float(softcap) if softcap > 0 else 1.0
        if kind == "team2":  # stages: 1000 for the flag words + blocks per segment * 10 + pipeline depth
            flags, rest = divmod(stages, 1000)
            nblk, st = divmod(rest, 10)
            S = cdiv(V, block * nblk)
            progs, maxnreg = team_grid(S, warps, pps, x.device)
            nteams = min(rows, progs // S)
            part = (torch.zeros((3, rows * S), dtype=torch.int64, device=x.device) if flags else
                    torch.empty((3, rows * S), dtype=torch.float32, device=x.device))
            cnt = torch.zeros(rows, dtype=torch.int32, device=x.device)
            _FWD_TEAM_L2(nteams * S, (x2, t, loss, lse, d2, scale, part[0], part[1], part[2], cnt, rows, nteams, sx,
                                      sd, V, ignore_index, float(smoothing), float(z_loss), cap,
                                      0 if INTERPRET else MAX_SPIN),
                         {"S": S, "SP": pow2_at_least(S), "HAS_SOFTCAP": softcap > 0, "SMOOTH": smoothing > 0,
                          "SEG": block * nblk, "BLOCK": block, "STAGES": max(1, st), "FLAGS": bool(flags)}, warps,
                         maxnreg)
            return
        if kind == "team":
            S = cdiv(V, block)
            progs, maxnreg = team_grid(S, warps, pps, x.device)
            nteams = min(rows, progs // S)
            part = torch.empty((3, rows * S), dtype=torch.float32, device=x.device)
            cnt = torch.zeros(rows, dtype=torch.int32, device=x.device)
            _FWD_TEAM(nteams * S, (x2, t, loss, lse, d2, scale, part[0], part[1], part[2], cnt, rows, nteams, sx, sd,
                                   V, ignore_index, float(smoothing), float(z_loss), cap,
                                   -2.0 * math.log2(math.e) / cap,
                                   0 if INTERPRET else MAX_SPIN),
                      {"S": S, "SP": pow2_at_least(S), "HAS_SOFTCAP": softcap > 0, "SMOOTH": smoothing > 0,
                       "KEEP_EXP": bool(stages & 1), "PREFETCH": bool(stages & 2), "BLOCK": block}, warps, maxnreg)
            return
        if kind == "split":
            S = cdiv(V, block)
            part = torch.empty((3, rows * S), dtype=torch.float32, device=x.device)
            cnt = torch.zeros(rows, dtype=torch.int32, device=x.device)
            _FWD_SPLIT(rows * S, (x2, t, loss, lse, d2, scale, part[0], part[1], part[2], cnt, sx, sd, V,
                                  ignore_index, float(smoothing), float(z_loss), cap, MAX_SPIN),
                       {"S": S, "SP": pow2_at_least(S), "HAS_SOFTCAP": softcap > 0, "BLOCK": block}, warps)
            return
        grid = rows if pps == 0 else min(rows, pps * sm_count(x.device))
        if kind == "fast" and write:  # stages: pipeline depth + 10 * (1: the forward's reciprocal on the FMA pipe,
            # 2: the gradient pass's, 3: both) + 100 (tl.exp2 and divisions instead of the inline PTX: a benchmark's
            # ablation)
            local, rest = divmod(stages, 1000)
            plain_tl, rest = divmod(rest, 100)
            newton, st = divmod(rest, 10)
            _FWD_FAST(grid, (x2, t, loss, lse, d2, scale, rows, sx, sd, V, ignore_index, float(smoothing),
                             float(z_loss), cap, -2.0 * math.log2(math.e) / cap),
                      {"HAS_SOFTCAP": softcap > 0, "SMOOTH": smoothing != 0, "ZLOSS": z_loss != 0, "HINTS": pps > 0,
                       "BLOCK": block, "STAGES": max(1, st), "NEWTON1": bool(newton & 1), "NEWTON2": bool(newton & 2),
                       "ASM": not INTERPRET and not plain_tl, "LOCAL": bool(local), "VEC": 16 // x.element_size(),
                       "FIXED": bool(local) and 0 < softcap <= FIXED_MAX_SOFTCAP}, warps)
            return
        _FWD(grid, (x2, t, loss, lse, d2, scale, rows, sx, sd, V, ignore_index, float(smoothing), float(z_loss),
                    cap),
             {"HAS_SOFTCAP": softcap > 0, "WRITE_GRAD": write,
              "HINTS": write and (pps > 0 or kind in ("revh", "laneh")),
              "BLOCK": block, "STAGES": stages, "REVERSE": write and kind in ("rev", "revh", "lane", "laneh"),
              "LANES": kind in ("lane", "laneh")}, warps)

    with device_guard(x):
        if setting is not None:
            launch(setting)
        elif write and dx.data_ptr() == x2.data_ptr():  # in place: a timing run would read its own output
            c = _best("ce_fwd", x, V, write, softcap > 0, split)
            launch(WRITE_SETTINGS[0] if c[2] in ("team", "team2") else c)  # the team kernel's fallback reads whole rows
        else:
            launch(tuned("ce_fwd", x.device, (x.dtype, write, softcap > 0, split, V, row_bucket(rows)),
                         lambda: _candidates(V, write, split), launch, rows * V))
    return loss, lse


def _best(kernel: str, x: torch.Tensor, V: int, *flags):
    """The setting chosen earlier by a non-aliasing launch of ``kernel`` for this dtype, flags and V, else the
    default: an in-place launch cannot be timed (each timing run would read the previous one's output)."""
    from ._tuning import tuned_settings

    n = len(flags)
    for (k, dev, key), v in tuned_settings().items():
        if k == kernel and dev == x.device.index and key[0] == x.dtype and key[1:1 + n] == flags and V in key:
            return v
    return _candidates(V, *flags[:1], *flags[2:3])[0] if kernel == "ce_fwd" else _candidates(V)[0]


def ce_bwd(grad_rows: torch.Tensor, x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
           ignore_index: int, smoothing: float, z_loss: float, softcap: float,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gradient of ``sum(grad_rows * loss_rows)`` with respect to ``x`` (rows, V), in ``x``'s dtype.

    ``grad_rows``: (rows,) per-row upstream gradient, any float dtype, any stride (0 for a broadcast scalar).
    ``lse``: the forward's (rows,) fp32 log-sum-exp. Returns a new contiguous tensor, or ``out`` (contiguous,
    shaped and typed like ``x``; it may be ``x`` itself when ``x`` is contiguous and private to the caller).
    """
    check_inputs(x, target)
    rows, V = x.shape
    dx = torch.empty((rows, V), dtype=x.dtype, device=x.device) if out is None else out
    if dx.numel() == 0:
        return dx
    if not use_triton(x):
        z, _, _, vi = _torch_rows(x, target, ignore_index, smoothing, z_loss, softcap)
        return dx.copy_(_torch_grad(z, x, target, lse, grad_rows, vi, smoothing, z_loss, softcap))
    x2, sx = as_rows(x, V)
    g = grad_rows if grad_rows.dtype == torch.float32 else grad_rows.float()
    t = target.contiguous()

    def launch(c):
        _BWD(rows, (x2, t, lse, g, dx, sx, g.stride(0), V, V, ignore_index, float(smoothing), float(z_loss),
                    float(softcap) if softcap > 0 else 1.0),
             {"HAS_SOFTCAP": softcap > 0, "BLOCK": c[0]}, c[1])

    with device_guard(x):
        if dx.data_ptr() == x2.data_ptr():
            launch(_best("ce_bwd", x, V, softcap > 0))
        else:
            launch(tuned("ce_bwd", x.device, (x.dtype, softcap > 0, V, row_bucket(rows)),
                         lambda: _candidates(V), launch, rows * V))
    return dx


def scale_(dx: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``dx *= g`` in place (``dx`` contiguous and private; ``g`` a one-element tensor), skipped on the GPU
    when ``g == 1`` without a host-device sync (the kernel reads ``g``). Returns ``dx``."""
    if dx.numel() == 0:
        return dx
    if not use_triton(dx):
        return dx.mul_(g.reshape(()))
    gg = g.reshape(1).float()
    block = 4096
    with device_guard(dx):
        _SCALE(min(cdiv(dx.numel(), block), 4 * sm_count(dx.device)), (dx, gg, dx.numel()), {"BLOCK": block}, 8)
    return dx
