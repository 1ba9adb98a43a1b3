"""Triton kernels for the row norms: RMSNorm, LayerNorm and the residual-add + RMSNorm.

One family of kernels serves the three ops; ``constexpr`` flags switch the
parts on and off (``IS_RMS``, ``HAS_W``, ``HAS_B``, ``HAS_RES``, ``HAS_DRES``,
``LLAMA_CAST``). All arithmetic is in fp32, whatever the storage dtype.

Math (per row of ``N`` elements; ``s = x`` or ``s = x + residual`` rounded to
the residual stream's dtype, as the unfused code stores it)::

    mu   = mean(s)                     (0 for RMSNorm)
    rstd = 1 / sqrt(mean((s - mu)^2) + eps)
    xhat = (s - mu) * rstd
    y    = xhat' * (w + offset) + b     xhat' = xhat rounded to s's dtype under
                                        Llama casting, else xhat in fp32
Backward, with ``g = dy * (w + offset)`` (``dy`` without a weight)::

    ds = rstd * (g - mean(g) - xhat * mean(g * xhat))    (LayerNorm)
    ds = rstd * (g - xhat * mean(g * xhat))              (RMSNorm)
    ds += d(new residual)                                (add variant)
    dw = sum over rows of dy * xhat',   db = sum over rows of dy

Bytes each launch moves (the minimum any implementation must move, per
element of the ``rows x N`` input, ``e`` bytes per element): forward reads
``s`` (and the residual) and writes ``y`` (and the new residual), ``2e``
(``4e``); backward reads ``s`` and ``dy`` and writes ``ds``, ``3e`` (plus
``e`` for the residual's gradient). Weights, bias, ``mean``/``rstd`` and the
fp32 partial sums of ``dw``/``db`` are O(N + rows), negligible at LLM shapes.

Layout of the work:

* *fused* kernels keep a whole row in registers (``BLOCK_N`` = next power of
  two >= N, masked); the forward takes ``ROWS`` rows per program (small N),
  the backward loops over a contiguous chunk of rows per program and keeps
  fp32 partial sums of ``dw``/``db`` in registers, written once per program
  as a row of a ``(programs, N)`` buffer; :func:`_sum_partials` then sums
  that buffer over programs in fp32, in a fixed order (deterministic), and
  writes ``dw``/``db`` in the parameters' dtype. The backward's loop takes
  ``ROWS`` rows per step, so that each program has more loads in flight;
* *looped* kernels handle rows wider than the register budget
  (``_norm_launch.FWD_MAX_FUSED``/``BWD_MAX_FUSED``) by walking the row in ``LOOP_BLOCK``
  chunks: two or three passes, the extra passes served mostly from L2 (the
  forward's early passes load with ``evict_last``, its last pass with
  ``evict_first``; with a residual, they re-read ``s`` instead of ``x`` and
  the residual). With the row width compiled in (``N_FIXED``), the looped
  forward is also a tuner candidate for rows of more than 1,024 elements, where
  its smaller register footprint can beat the fused kernel (as
  ``torch.compile``'s two-pass reduction did at 16384 x 8192).

Row offsets are computed in int64 (``program_id(0).to(tl.int64)``), so
tensors past 2**31 elements are addressed correctly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load(P, off, mask, EVICT: tl.constexpr):
    """fp32 load with an L2 eviction hint: 0 none, 1 ``evict_last`` (read again soon), 2 ``evict_first`` (last read)."""
    if EVICT == 1:
        v = tl.load(P + off, mask=mask, other=0.0, eviction_policy="evict_last")
    elif EVICT == 2:
        v = tl.load(P + off, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        v = tl.load(P + off, mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _load_s(X, R, x_off, r_off, mask, HAS_RES: tl.constexpr, S_TY: tl.constexpr, EVICT: tl.constexpr = 0):
    """fp32 value of s = x (+ r rounded to the residual stream dtype ``S_TY``); ``EVICT`` as in :func:`_load`."""
    x = _load(X, x_off, mask, EVICT)
    if HAS_RES:
        r = _load(R, r_off, mask, EVICT)
        x = (x + r).to(S_TY).to(tl.float32)
    return x


@triton.jit
def _norm_fwd_fused(
    X, R, W, B, Y, S, MEAN, RSTD,  # X, R: (rows, N) inputs; W, B: (N,); Y, S: (rows, N) outputs; MEAN, RSTD: (rows,) fp32
    stride_x, stride_r, stride_y, stride_s,  # row strides (elements); the column stride is 1
    n_rows, N, eps, offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    LLAMA_CAST: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) int64
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    x = _load_s(X, R, rows[:, None] * stride_x + cols[None, :], rows[:, None] * stride_r + cols[None, :],
                mask, HAS_RES, S.dtype.element_ty)  # (ROWS, BLOCK_N) fp32
    if HAS_RES:
        tl.store(S + rows[:, None] * stride_s + cols[None, :], x.to(S.dtype.element_ty), mask=mask)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        tl.store(MEAN + rows, mean, mask=rmask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    y = xc * rstd[:, None]
    if HAS_W:
        if LLAMA_CAST:  # round xhat to the input's dtype before scaling (Hugging Face Llama)
            if HAS_RES:
                y = y.to(S.dtype.element_ty).to(tl.float32)
            else:
                y = y.to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
        y = y * w[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_fwd_looped(
    X, R, W, B, Y, S, MEAN, RSTD,  # as in _norm_fwd_fused
    stride_x, stride_r, stride_y, stride_s,
    n_rows, N, eps, offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    LLAMA_CAST: tl.constexpr, BLOCK_N: tl.constexpr, N_FIXED: tl.constexpr,
):
    if N_FIXED > 0:  # the row width as a compile-time constant (one compile per width): loops of known trip count
        N = N_FIXED
    row = tl.program_id(0).to(tl.int64)  # one row per program
    cols0 = tl.arange(0, BLOCK_N)
    # pass 1: the residual sum (stored) and sum(s) or sum(s^2)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + cols0
        m = cols < N
        if HAS_RES:  # x and r are read once: the later passes re-read s, written here
            x = _load_s(X, R, row * stride_x + cols, row * stride_r + cols, m, HAS_RES, S.dtype.element_ty, 2)
            tl.store(S + row * stride_s + cols, x.to(S.dtype.element_ty), mask=m)
        else:
            x = _load(X, row * stride_x + cols, m, 1)
        if IS_RMS:
            acc += x * x
        else:
            acc += x
    if HAS_RES:
        tl.debug_barrier()  # s of this row is re-read below, possibly by other threads of the program
        SRC = S
        stride_src = stride_s
    else:
        SRC = X
        stride_src = stride_x
    if IS_RMS:
        mean = 0.0
        var = tl.sum(acc, axis=0) / N
    else:
        mean = tl.sum(acc, axis=0) / N
        tl.store(MEAN + row, mean)
        acc2 = tl.zeros([BLOCK_N], tl.float32)
        for off in range(0, N, BLOCK_N):  # pass 2 (LayerNorm): centred variance
            cols = off + cols0
            m = cols < N
            x = _load(SRC, row * stride_src + cols, m, 1)
            xc = tl.where(m, x - mean, 0.0)
            acc2 += xc * xc
        var = tl.sum(acc2, axis=0) / N
    rstd = tl.rsqrt(var + eps)
    tl.store(RSTD + row, rstd)
    for off in range(0, N, BLOCK_N):  # last pass: normalise, scale, shift
        cols = off + cols0
        m = cols < N
        x = _load(SRC, row * stride_src + cols, m, 2)
        y = (x - mean) * rstd
        if HAS_W:
            if LLAMA_CAST:
                if HAS_RES:
                    y = y.to(S.dtype.element_ty).to(tl.float32)
                else:
                    y = y.to(X.dtype.element_ty).to(tl.float32)
            y = y * (_load(W, cols, m, 1) + offset)
        if HAS_B:
            y = y + _load(B, cols, m, 1)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _add_pair(a1, a2, b1, b2):
    """Combine function of a reduction over two tensors at once: elementwise sums."""
    return a1 + b1, a2 + b2


@triton.jit
def _norm_bwd_fused(
    DY, XS, W, MEAN, RSTD, DRES, DX, DX2, PART,  # DY, XS, DRES, DX, DX2: (rows, N); W: (N,)
    # DX2: a second copy of dx (HAS_DX2), with DX's row stride
    # PART: fp32 partial sums, one row of N per program: dw's rows first, db's from element db_off
    stride_dy, stride_xs, stride_dres, stride_dx,
    n_rows, N, rows_per_prog, db_off, offset,  # db_off: element offset of the db partials in PART
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DRES: tl.constexpr,
    LLAMA_CAST: tl.constexpr, HAS_DX2: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    # one (BLOCK_N,) accumulator each: the ROWS rows of a step sum inside each thread (the rows of a tile
    # sit in the same thread's registers), and a (ROWS, BLOCK_N) one cost ROWS times the registers
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_N], tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    n_steps = (row_end - row_start + ROWS - 1) // ROWS  # plain arithmetic: a 0-d value in every interpreter
    for k in range(0, n_steps):  # ROWS rows per step: more loads in flight per program
        rows = row_start + k * ROWS + tl.arange(0, ROWS)  # int64 (a bare loop variable may be 32-bit)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(XS + rows[:, None] * stride_xs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + rows, mask=rmask, other=0.0)[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w[None, :]
            if LLAMA_CAST:
                dw_acc += tl.sum(dy * xhat.to(XS.dtype.element_ty).to(tl.float32), axis=0)
            else:
                dw_acc += tl.sum(dy * xhat, axis=0)
        else:
            g = dy
        if HAS_B:
            db_acc += tl.sum(dy, axis=0)
        if IS_RMS:
            c1 = tl.sum(g * xhat, axis=1) / N
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:  # both row sums in one reduction: one cross-warp exchange per row instead of two
            s1, s2 = tl.reduce((g * xhat, g), 1, _add_pair)
            dx = (g - (s2 / N)[:, None] - xhat * (s1 / N)[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += tl.load(DRES + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DX2:
            tl.store(DX2 + rows[:, None] * stride_dx + cols[None, :], dx.to(DX2.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(PART + pid * N + cols, dw_acc, mask=cmask)
    if HAS_B:
        tl.store(PART + db_off + pid * N + cols, db_acc, mask=cmask)


@triton.jit
def _norm_bwd_looped(
    DY, XS, W, MEAN, RSTD, DRES, DX, DX2, PART,  # as in _norm_bwd_fused; PART zero-filled
    stride_dy, stride_xs, stride_dres, stride_dx,
    n_rows, N, rows_per_prog, db_off, offset,  # db_off: element offset of the db partials in PART
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DRES: tl.constexpr,
    LLAMA_CAST: tl.constexpr, HAS_DX2: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_N)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for i in range(0, row_end - row_start):
        row = row_start + i  # int64 (a bare loop variable may be 32-bit in the interpreter)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.load(MEAN + row)
        acc1 = tl.zeros([BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_N], tl.float32)
        for off in range(0, N, BLOCK_N):  # pass 1: the two row reductions
            cols = off + cols0
            m = cols < N
            x = tl.load(XS + row * stride_xs + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
            xhat = tl.where(m, (x - mean) * rstd, 0.0)
            if HAS_W:
                dy = dy * (tl.load(W + cols, mask=m, other=0.0).to(tl.float32) + offset)
            acc1 += dy * xhat
            acc2 += dy
        c1 = tl.sum(acc1, axis=0) / N
        c2 = tl.sum(acc2, axis=0) / N
        for off in range(0, N, BLOCK_N):  # pass 2: dx, and dw/db into this program's partial row
            cols = off + cols0
            m = cols < N
            x = tl.load(XS + row * stride_xs + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
            xhat = tl.where(m, (x - mean) * rstd, 0.0)
            if HAS_W:
                g = dy * (tl.load(W + cols, mask=m, other=0.0).to(tl.float32) + offset)
                xw = xhat
                if LLAMA_CAST:
                    xw = xhat.to(XS.dtype.element_ty).to(tl.float32)
                p = tl.load(PART + pid * N + cols, mask=m, other=0.0)
                tl.store(PART + pid * N + cols, p + dy * xw, mask=m)
            else:
                g = dy
            if HAS_B:
                q = tl.load(PART + db_off + pid * N + cols, mask=m, other=0.0)
                tl.store(PART + db_off + pid * N + cols, q + dy, mask=m)
            if IS_RMS:
                dx = (g - xhat * c1) * rstd
            else:
                dx = (g - c2 - xhat * c1) * rstd
            if HAS_DRES:
                dx += tl.load(DRES + row * stride_dres + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=m)
            if HAS_DX2:
                tl.store(DX2 + row * stride_dx + cols, dx.to(DX2.dtype.element_ty), mask=m)
        tl.debug_barrier()  # the next row re-reads the partial rows this one wrote


@triton.jit
def _sum_partials(
    P, OUT0, OUT1,  # P: (sets, n_parts, N) fp32 partial sums, contiguous; OUT0, OUT1: (N,) sums of set 0 and 1
    n_parts, N, n_col_blocks,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Column sums over ``n_parts`` of each set of partials, in fp32, stored in the outputs' dtype.

    Program ``pid`` sums columns ``(pid % n_col_blocks) * BLOCK_N + [0, BLOCK_N)``
    of set ``pid // n_col_blocks`` (0 writes ``OUT0``, 1 writes ``OUT1``), always
    in the same order: the result does not depend on timing (deterministic).
    """
    pid = tl.program_id(0)
    which = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    base = P + which.to(tl.int64) * n_parts * N
    parts = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        ps = p0 + parts
        acc += tl.load(base + ps[:, None] * N + cols[None, :], mask=(ps < n_parts)[:, None] & cmask[None, :],
                       other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=cmask)
    else:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=cmask)
