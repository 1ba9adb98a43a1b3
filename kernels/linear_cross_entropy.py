"""Linear + cross-entropy (the LM head and its loss) in row chunks, so the full ``N x V`` logits never exist.

``linear_cross_entropy(hidden, weight, target, bias)`` equals
``cross_entropy(hidden @ weight.T + bias, target, ...)`` (:func:`mfuwatch.kernels.cross_entropy`, same
options). For each chunk of ``C`` rows of ``hidden``::

    logits_c = hidden_c @ weight.T (+ bias)        (C, V), in the compute dtype       GEMM 1
    loss_c, dlogits_c = cross-entropy kernel        dlogits written over logits_c      (one launch)
    dhidden_c = dlogits_c @ weight                  (C, H)                             GEMM 2
    dweight  += dlogits_c.T @ hidden_c              (V, H), see ACCUMULATE_FP32         GEMM 3
    dbias    += sum of dlogits_c over rows          (V,), fp32

so the three GEMMs of the unfused op run once each and only one ``C x V`` chunk of logits is alive.
``C`` is the largest power of two with ``C x V <= CHUNK_ELEMENTS`` (2^27: 256 MiB of bf16 logits), and at
least 2048 rows (2048 at V = 128256): GEMM 3 then has an arithmetic intensity of about ``C H / (C + H)`` FLOP
per byte (1365 at C = 2048, H = 4096), far above the H200's machine balance (about 206), so accumulating dW in
chunks stays compute-bound. With an fp32 weight (autocast with fp32
master weights) dW is accumulated in fp32 into a buffer that becomes the weight's gradient: no extra
memory. With a bf16/fp16 weight (the default :data:`ACCUMULATE_FP32` = None) the first chunk's GEMM
writes dW in the weight's dtype and later chunks add to it with the GEMM's ``beta = 1`` (fp32 inside
each GEMM; one rounding per chunk); ``ACCUMULATE_FP32 = True`` keeps an fp32 (V, H) accumulator instead
(2 x V x H bytes more), added to through torch's fp32-output GEMM or in slabs of ``SLAB_ELEMENTS``.

Reductions "mean"/"sum" form the gradients in the forward (the upstream gradient of a reduced loss is
one scalar, applied in the backward by an in-place kernel that skips 1, without a host-device sync);
``reduction="none"`` saves the per-row log-sum-exp and recomputes the logits chunk by chunk in the
backward with the per-row upstream gradient (one GEMM more). Under autocast the GEMMs run in the
autocast dtype, as ``nn.Linear`` would. ``torch.compile`` and dispatch modes use the custom ops
``mfuwatch::linear_cross_entropy`` (+ ``_backward``): the chunked path stays under compile, since
Inductor cannot avoid materialising the logits.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import _cross_entropy_triton as K
from . import _flops
from . import _lce_recompute as R
from ._dispatch import first_order_only, needs_grad, use_custom_op
from ._lce_recompute import fp32_addmm_works
from .cross_entropy import ce_flops, check_options, reduce_rows

#: Values of ``mode``: "chunked" (the default: row chunks of logits formed by cuBLAS GEMMs, the gradient
#: written over them, then the dhidden/dweight GEMMs) and "recompute" (the logits only as one tile of at most
#: 2^24 elements, 32 MiB of bf16: the forward keeps an online log-sum-exp per row, the backward forms each tile
#: again; see :mod:`._lce_recompute`).
MODES = ("chunked", "recompute")


def check_mode(mode, name: str = "mode") -> str:
    """``mode`` if it is one of :data:`MODES`, else ValueError naming the argument (``name``), the accepted
    values and the nearest one."""
    if mode in MODES:
        return mode
    import difflib

    near = difflib.get_close_matches(str(mode).lower(), MODES, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"{name}={mode!r}{hint}: expected one of {MODES}")


def _recompute_forward(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], opts,
                       dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(loss rows fp32 (N,), lse fp32 (N,)) of mode "recompute" (:func:`._lce_recompute.lse_forward`)."""
    return R.lse_forward(hidden, weight, bias, target, dtype, *opts)


def _recompute_backward(coef: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                        lse: Tensor, opts, dtype: torch.dtype, need: Tuple[bool, bool, bool]):
    """(dhidden, dweight, dbias) of ``sum(coef * loss_rows)`` (None where not in ``need``) of mode "recompute"
    (:func:`._lce_recompute.grad_backward`)."""
    return R.grad_backward(hidden, weight, bias, target, lse, coef, dtype, *opts, need,
                           dw_fp32=accumulate_fp32(dtype, weight.dtype))


#: Elements of logits per chunk: rows per chunk = the largest power of two with rows x V <= this, but at least
#: MIN_CHUNK_ROWS. 2^27 is 256 MiB of bf16 logits (4096 rows at V = 32000); at V = 128256 the floor of 2048 rows
#: decides (512 MiB). Measured on the H200 as the HF Llama end to end runs it (hidden 8192 x 2048, fp32 weight under
#: bf16 autocast, docs/gpu-runs/cross_entropy-run3.md): V = 32000, 4096-row chunks 5.46 ms and 0.41 GiB above
#: inputs and gradients against 5.37-5.54 ms and 0.67 GiB for one 8192-row chunk; V = 128256, 2048-row chunks
#: 22.3 ms, 1024-row 24.6 ms, 512-row 29.4 ms.
CHUNK_ELEMENTS = 1 << 27
#: Rows per chunk at least (unless N is smaller): GEMM 3 (dW) then stays compute-bound and the fp32 dW
#: accumulator is read and written once per 2048 rows, not more often (the measured cost of smaller chunks above).
MIN_CHUNK_ROWS = 2048
#: Elements of one slab of the dW product added to the fp32 accumulator.
SLAB_ELEMENTS = 1 << 27
#: How dW is accumulated over the chunks. None (the default): in fp32 when the weight (or the compute dtype) is
#: fp32 -- the accumulator is then the weight's gradient itself, no extra memory -- else in the weight's
#: bf16/fp16 dtype: the first chunk's GEMM writes dW (beta = 0), later chunks add to it with the GEMM's
#: beta = 1 (fp32 inside each GEMM, one rounding per chunk, four at 8192 x 128256): no (V, H) fp32 buffer,
#: 2 x V x H bytes less memory (1.96 GiB at 128256 x 4096) and no passes over one. True: always an fp32
#: accumulator (one rounding in all; for a bf16 weight a (V, H) fp32 buffer). False: always the compute dtype.
#: Mode "recompute" follows it too (its bf16/fp16 dW is rounded once per row block of its tiles).
ACCUMULATE_FP32: Optional[bool] = None
#: Overlap the chunks on CUDA: chunk k's GEMMs 2 and 3 (dhidden, dweight) run on a side stream while GEMM 1 and
#: the cross-entropy kernel of chunk k+1 run on the caller's stream, over two preallocated chunk buffers (two
#: chunks of logits alive). None (the default): only when a chunk's logits take at most OVERLAP_MAX_BYTES, where
#: the second buffer is cheap and the overlap pays (measured: 512-row chunks at V = 128256, 28.3 ms overlapped
#: against 29.4 ms); 2048-row chunks at V = 128256 were as fast or faster on one stream (22.26 against 22.43 ms,
#: 1.02 against 1.51 GiB). True: always; False: never (one stream, one chunk alive).
OVERLAP: Optional[bool] = None
#: Largest chunk of logits (bytes) overlapped when OVERLAP is None.
OVERLAP_MAX_BYTES = 1 << 27
_SIDE: dict = {}


def _side_stream(dev: torch.device) -> "torch.cuda.Stream":
    """One side stream per CUDA device (created at first use)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    st = _SIDE.get(idx)
    if st is None:
        st = _SIDE[idx] = torch.cuda.Stream(device=idx)
    return st


def chunk_rows(n: int, v: int) -> int:
    """Rows per chunk for ``n`` rows and ``v`` classes (:data:`CHUNK_ELEMENTS`, :data:`MIN_CHUNK_ROWS`)."""
    c = max(1, CHUNK_ELEMENTS // max(v, 1))
    c = 1 << (c.bit_length() - 1)
    return max(1, min(n, max(c, MIN_CHUNK_ROWS)))


def overlaps(rows: int, v: int, itemsize: int) -> bool:
    """Whether chunks of ``rows`` x ``v`` logits of ``itemsize`` bytes run overlapped (:data:`OVERLAP`)."""
    if OVERLAP is None:
        return rows * v * itemsize <= OVERLAP_MAX_BYTES
    return bool(OVERLAP)


def compute_dtype(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> torch.dtype:
    """The GEMMs' dtype: autocast's for the device when autocast is on (as ``nn.Linear``), else the
    promotion of the inputs' dtypes."""
    dev = hidden.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except TypeError:  # torch < 2.4 spells it per device; only CUDA autocast then
        if dev == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    dt = torch.promote_types(hidden.dtype, weight.dtype)
    return torch.promote_types(dt, bias.dtype) if bias is not None else dt


def accumulate_fp32(dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether dW is accumulated in fp32 for GEMMs in ``dtype`` and a weight of ``weight_dtype``
    (:data:`ACCUMULATE_FP32`)."""
    if dtype == torch.float32:
        return True
    if ACCUMULATE_FP32 is None:
        return weight_dtype == torch.float32
    return bool(ACCUMULATE_FP32)


def _accumulate_dw(acc: Tensor, g: Tensor, h: Tensor) -> None:
    """``acc (V, H) += g.T @ h`` with g (C, V), h (C, H) in the compute dtype; ``acc`` fp32 (or, with
    :data:`ACCUMULATE_FP32` off, the compute dtype). An fp32 ``acc`` with bf16/fp16 operands takes the
    fp32-output GEMM where torch has it, else slabs of rows: each slab's product in the compute dtype,
    added to the accumulator in fp32."""
    V, H = acc.shape
    if acc.dtype == g.dtype:
        acc.addmm_(g.t(), h)
        return
    if fp32_addmm_works(acc, g):
        torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
        return
    s = max(1, SLAB_ELEMENTS // max(H, 1))
    for a in range(0, V, s):
        acc[a:a + s].add_(g[:, a:a + s].t() @ h)


def _chunked(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], opts, dtype: torch.dtype,
             grad_scale: Optional[Tensor], grad_rows: Optional[Tensor], lse_in: Optional[Tensor],
             need: Tuple[bool, bool, bool]):
    """The chunk loop. Forward only (both None), forward with gradients (``grad_scale``), or the
    recomputing backward (``grad_rows`` per row and the forward's ``lse_in``). Returns
    (loss rows fp32 (N,), lse fp32 (N,), dhidden or None, dweight or None, dbias or None)."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    grads = grad_scale is not None or grad_rows is not None
    rows = torch.empty(N, dtype=torch.float32, device=dev)
    lse = torch.empty(N, dtype=torch.float32, device=dev) if lse_in is None else lse_in
    dh = dw = db = None
    if grads:
        if need[0]:
            dh = torch.empty((N, H), dtype=hidden.dtype, device=dev)
        if need[1] and accumulate_fp32(dtype, weight.dtype):
            dw = torch.zeros((V, H), dtype=torch.float32, device=dev)  # else the first chunk's GEMM creates it
        if need[2]:
            db = torch.zeros(V, dtype=torch.float32, device=dev)
    with torch.autocast(dev.type, enabled=False):
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        h_all = hidden.to(dtype)
        c = chunk_rows(N, V)
        two = (grads and dev.type == "cuda" and N > c and overlaps(c, V, w.element_size())
               and not torch.cuda.is_current_stream_capturing())
        if two:  # chunk k's GEMMs 2 and 3 on a side stream while GEMM 1 and the CE kernel of chunk k+1 run
            main, side = torch.cuda.current_stream(dev), _side_stream(dev)
            bufs = [torch.empty((c, V), dtype=dtype, device=dev) for _ in range(2)]  # two chunks alive at most
            done: List[Optional[torch.cuda.Event]] = [None, None]
            fresh_dw = need[1] and dw is None
            if fresh_dw:  # allocated here, on the main stream, so no block of it belongs to the side stream
                dw = torch.empty((V, H), dtype=dtype, device=dev)
        for k, a in enumerate(range(0, N, c)):
            e = min(N, a + c)
            h = h_all[a:e]
            if two:
                if done[k % 2] is not None:
                    main.wait_event(done[k % 2])  # the side stream is done with this buffer
                logits = bufs[k % 2][:e - a]
                if b is not None:
                    torch.addmm(b, h, w.t(), out=logits)
                else:
                    torch.mm(h, w.t(), out=logits)
            else:
                logits = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()  # (C, V)
            t = target[a:e]
            if grad_rows is not None:
                K.ce_bwd(grad_rows[a:e], logits, t, lse[a:e], *opts, out=logits)
            elif grad_scale is not None:
                r, l_ = K.ce_fwd(logits, t, *opts, grad_scale=grad_scale, dx=logits)
                rows[a:e], lse[a:e] = r, l_
            else:
                r, l_ = K.ce_fwd(logits, t, *opts)
                rows[a:e], lse[a:e] = r, l_
            if not grads:
                continue
            if two:
                ready = torch.cuda.Event()
                ready.record(main)
                side.wait_event(ready)
            with torch.cuda.stream(side) if two else contextlib.nullcontext():
                if dh is not None:
                    if dh.dtype == dtype:
                        torch.mm(logits, w, out=dh[a:e])
                    else:
                        dh[a:e] = logits @ w
                if need[1]:
                    if dw is None:
                        dw = torch.mm(logits.t(), h)  # (V, H) in the compute dtype, beta = 0: no zeros written
                    elif two and fresh_dw and k == 0:
                        torch.mm(logits.t(), h, out=dw)
                    else:
                        _accumulate_dw(dw, logits, h)
                if db is not None:
                    db += logits.sum(0, dtype=torch.float32)
            if two:
                done[k % 2] = torch.cuda.Event()
                done[k % 2].record(side)
            del logits
        if two:
            main.wait_stream(side)
    if need[1] and dw is None:  # no rows
        dw = torch.zeros((V, H), dtype=dtype, device=dev)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None and bias.dtype != torch.float32:
        db = db.to(bias.dtype)
    return rows, lse, dh, dw, db


def _check(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor]) -> None:
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden shape {tuple(hidden.shape)} and weight shape {tuple(weight.shape)}: expected "
                         "(..., H) and (V, H)")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} != {tuple(hidden.shape[:-1])}, hidden's leading dims")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} device {t.device} != hidden device {hidden.device}")
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} dtype {t.dtype} is not float32, float16 or bfloat16")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target dtype {target.dtype} is not int64 or int32")


def _empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty(0)


# ---------------------------------------------------------------- custom ops (torch.compile, dispatch modes)

@torch.library.custom_op("mfuwatch::linear_cross_entropy", mutates_args=())
def _lce_op(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
            label_smoothing: float, z_loss: float, softcap: float, dtype: torch.dtype, mean: bool,
            grads: List[bool], fused: bool, mode: str = "chunked") -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dhidden, dweight, dbias). ``grads``: which of hidden, weight, bias need a gradient. With
    ``fused`` (reductions "mean"/"sum", mode "chunked"): ``loss`` is the reduced 0-d loss and the gradients in
    ``grads`` are formed (for an upstream gradient of 1); else ``loss`` holds the (N,) per-row losses, the
    gradients are empty and the backward op recomputes (``mode`` "recompute": one logits tile at a time)."""
    opts = (ignore_index, label_smoothing, z_loss, softcap)
    if mode == "recompute":
        rows, lse = _recompute_forward(hidden, weight, target, bias, opts, dtype)
        e = hidden.new_empty(0)
        return rows, lse, e, weight.new_empty(0), _empty(None, bias if bias is not None else weight)
    need = tuple(g and fused for g in grads)
    scale = _scale(target, ignore_index, mean) if fused else None
    rows, lse, dh, dw, db = _chunked(hidden, weight, target, bias, opts, dtype, scale, None, None, need)
    loss = (rows.sum() * scale if mean else rows.sum()) if fused else rows
    return loss, lse, _empty(dh, hidden), _empty(dw, weight), _empty(db, bias if bias is not None else weight)


@_lce_op.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, dtype, mean, grads, fused,
      mode="chunked"):
    n = hidden.shape[0]
    f32 = torch.float32
    grads = [g and fused for g in grads]
    return (hidden.new_empty(() if fused else n, dtype=f32), hidden.new_empty(n, dtype=f32),
            hidden.new_empty(hidden.shape if grads[0] else 0), weight.new_empty(weight.shape if grads[1] else 0),
            weight.new_empty((weight.shape[0],) if grads[2] else 0, dtype=bias.dtype if bias is not None else None))


@torch.library.custom_op("mfuwatch::linear_cross_entropy_backward", mutates_args=())
def _lce_bwd_op(grad_rows: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                lse: Tensor, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
                dtype: torch.dtype, grads: List[bool], mode: str = "chunked") -> Tuple[Tensor, Tensor, Tensor]:
    opts = (ignore_index, label_smoothing, z_loss, softcap)
    if mode == "recompute":
        dh, dw, db = _recompute_backward(grad_rows.float(), hidden, weight, target, bias, lse, opts, dtype,
                                         tuple(grads))
    else:
        _, _, dh, dw, db = _chunked(hidden, weight, target, bias, opts, dtype, None, grad_rows.float(), lse,
                                    tuple(grads))
    return _empty(dh, hidden), _empty(dw, weight), _empty(db, bias if bias is not None else weight)


@_lce_bwd_op.register_fake
def _(grad_rows, hidden, weight, target, bias, lse, ignore_index, label_smoothing, z_loss, softcap, dtype, grads,
      mode="chunked"):
    return (hidden.new_empty(hidden.shape if grads[0] else 0), weight.new_empty(weight.shape if grads[1] else 0),
            weight.new_empty((weight.shape[0],) if grads[2] else 0, dtype=bias.dtype if bias is not None else None))


def _scale(target: Tensor, ignore_index: int, mean: bool) -> Tensor:
    """The gradients' factor as a 0-d fp32 device tensor: 1 / count for the mean (inf when every row is
    ignored; the kernels write 0 for ignored rows whatever it is), 1 for the sum."""
    if mean:
        return 1.0 / (target != ignore_index).sum().float()
    return torch.ones((), dtype=torch.float32, device=target.device)


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, ii, eps, zl, cap, dtype, mean, grads, fused, *mode = inputs
    loss, lse, dh, dw, db = output
    ctx.fused = fused
    ctx.mode = mode[0] if mode else "chunked"
    ctx.opts, ctx.dtype, ctx.grads = (ii, eps, zl, cap), dtype, list(grads)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(lse, dh, dw, db)
    if ctx.fused:
        ctx.save_for_backward(dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, target, bias, lse)


def _backward(ctx, grad_rows, *_unused):
    if ctx.fused:  # the reduced loss's 0-d upstream gradient
        dh, dw, db = ctx.saved_tensors
        g = grad_rows
        out = [t * g.to(t.dtype) if need else None for t, need in zip((dh, dw, db), ctx.grads)]
    else:
        hidden, weight, target, bias, lse = ctx.saved_tensors
        dh, dw, db = torch.ops.mfuwatch.linear_cross_entropy_backward(
            grad_rows, hidden, weight, target, bias, lse, *ctx.opts, ctx.dtype, ctx.grads, ctx.mode)
        out = [t if need else None for t, need in zip((dh, dw, db), ctx.grads)]
    return (out[0], out[1], None, (out[2] if ctx.has_bias else None), None, None, None, None, None, None, None, None,
            None)


_lce_op.register_autograd(_backward, setup_context=_setup_context)


def _fwd_flops(h, w, t, b, ii, eps, zl, cap, dtype, mean, grads, fused, mode="chunked", out_shape=None, **kw):
    n, v = _flops.numel(h[:-1]), w[0]
    gemm = 2 * n * h[-1] * v
    total = gemm + n * v * ce_flops("forward", cap)
    if fused and any(grads):
        total += n * v * ce_flops("backward", cap)
        total += gemm * (int(bool(grads[0])) + int(bool(grads[1]))) + (n * v if grads[2] else 0)
    return total


def _bwd_flops(g, h, w, t, b, lse, ii, eps, zl, cap, dtype, grads, mode="chunked", out_shape=None, **kw):
    n, v = _flops.numel(h[:-1]), w[0]
    gemm = 2 * n * h[-1] * v
    return (n * v * ce_flops("backward", cap)
            + gemm * (int(bool(grads[0])) + int(bool(grads[1]))) + (n * v if grads[2] else 0))


_flops.register(torch.ops.mfuwatch.linear_cross_entropy, _fwd_flops)
_flops.register(torch.ops.mfuwatch.linear_cross_entropy_backward, _bwd_flops)


# ---------------------------------------------------------------- eager path

class RecomputeLinearCrossEntropyFunction(torch.autograd.Function):
    """``apply(hidden (N, H), weight (V, H), target (N,), bias or None, ignore_index, label_smoothing, z_loss,
    softcap, dtype, reduction) -> loss`` of mode "recompute": the forward saves only the per-row log-sum-exp
    (and the mean's scale); the backward forms the logits tiles again. Any number of backwards through a
    retained graph (nothing is handed over)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ii, eps, zl, cap, dtype, reduction):
        opts = (ii, eps, zl, cap)
        ctx.opts, ctx.dtype, ctx.reduction = opts, dtype, reduction
        ctx.need = tuple(bool(ctx.needs_input_grad[i]) for i in (0, 1, 3))
        rows, lse = _recompute_forward(hidden, weight, target, bias, opts, dtype)
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target, bias, lse, None)
            return rows
        scale = _scale(target, ii, reduction == "mean")
        ctx.save_for_backward(hidden, weight, target, bias, lse, scale)
        return rows.sum() * scale if reduction == "mean" else rows.sum()

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        hidden, weight, target, bias, lse, scale = ctx.saved_tensors
        if ctx.reduction == "none":
            coef = g.float().reshape(-1)
        else:
            coef = (g.float() * scale).reshape(1).expand(hidden.shape[0])
        dh, dw, db = _recompute_backward(coef, hidden, weight, target, bias, lse, ctx.opts, ctx.dtype, ctx.need)
        return dh, dw, None, db, None, None, None, None, None, None


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``apply(hidden (N, H), weight (V, H), target (N,), bias (V,) or None, ignore_index, label_smoothing,
    z_loss, softcap, dtype, reduction) -> loss``: 0-d fp32 for "mean"/"sum" (gradients formed in the
    forward, scaled in place by the upstream gradient in the backward), fp32 (N,) for "none" (the backward
    recomputes the logits in chunks). A second backward through a retained graph is refused for the
    reduced forms (RuntimeError): their gradients were handed over by the first."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ii, eps, zl, cap, dtype, reduction):
        opts = (ii, eps, zl, cap)
        need = tuple(bool(ctx.needs_input_grad[i]) for i in (0, 1, 3))
        ctx.opts, ctx.dtype, ctx.need, ctx.reduction = opts, dtype, need, reduction
        if reduction == "none":
            rows, lse, _, _, _ = _chunked(hidden, weight, target, bias, opts, dtype, None, None, None, need)
            ctx.save_for_backward(hidden, weight, target, bias, lse)
            return rows
        scale = _scale(target, ii, reduction == "mean")
        rows, _, dh, dw, db = _chunked(hidden, weight, target, bias, opts, dtype, scale, None, None, need)
        ctx.held = [dh, dw, db]
        return rows.sum() * scale if reduction == "mean" else rows.sum()

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        if ctx.reduction == "none":
            hidden, weight, target, bias, lse = ctx.saved_tensors
            _, _, dh, dw, db = _chunked(hidden, weight, target, bias, ctx.opts, ctx.dtype, None, g.float(), lse,
                                        ctx.need)
        else:
            held, ctx.held = ctx.held, None
            if held is None:
                raise RuntimeError("mfuwatch.kernels.linear_cross_entropy: backward through the same graph twice "
                                   "(retain_graph=True) is not supported for reduction='mean'/'sum'; the "
                                   "gradients were formed in the forward and handed over by the first backward")
            dh, dw, db = (K.scale_(t, g) if t is not None else None for t in held)
        return dh, dw, None, db, None, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None, mode: str = "chunked") -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without materialising the logits.

    Args:
        hidden: (..., H) float32/float16/bfloat16 (a model's last hidden states), any strides.
        weight: (V, H) the LM head's weight; bias: (V,) or None.
        target: int64/int32 class indices shaped like ``hidden.shape[:-1]`` (already shifted for causal
            LM training), ``ignore_index`` for positions without a label.
        ignore_index, reduction, label_smoothing, z_loss, softcap: as :func:`mfuwatch.kernels.cross_entropy`.
        mode: "chunked" (default: fastest; one chunk of logits, 2048 rows at V = 128256, alive at a time) or
            "recompute" (for runs short of memory: the logits only as one tile, the backward forms them again,
            one GEMM more; at most 96 MiB above inputs and gradients, see :mod:`._lce_recompute`). Same loss
            and gradients up to rounding.
    Returns:
        fp32 loss: 0-d for "mean"/"sum", shaped like ``target`` for "none". Gradients flow to ``hidden``,
        ``weight`` and ``bias`` in their own dtypes (db accumulated in fp32; dW in fp32 for an fp32 weight, else
        as :data:`ACCUMULATE_FP32` says, in both modes). The GEMMs run in the
        autocast dtype under autocast, else in the inputs' promoted dtype.
    Raises:
        ValueError: bad options, shapes, dtypes or devices (the mismatched values are printed), or a ``mode``
            not in :data:`MODES`.
        RuntimeError: a second backward through a retained graph with reduction "mean"/"sum".
    """
    cap = check_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
    check_mode(mode)
    _check(hidden, weight, target, bias)
    H = hidden.shape[-1]
    h2, t1, shape = hidden.reshape(-1, H), target.reshape(-1), tuple(target.shape)
    dtype = compute_dtype(hidden, weight, bias)
    opts = (ignore_index, float(label_smoothing), float(z_loss), cap)
    grad = needs_grad(h2, weight, bias)
    if use_custom_op(hidden, weight, target, bias):
        grads = [bool(grad and t is not None and t.requires_grad) for t in (h2, weight, bias)]
        fused = reduction != "none" and any(grads) and mode == "chunked"
        loss = torch.ops.mfuwatch.linear_cross_entropy(
            h2, weight, t1, bias, *opts, dtype, reduction == "mean", grads, fused, mode)[0]
        return loss if fused else reduce_rows(loss, t1, ignore_index, reduction, shape)
    if not grad:
        if mode == "recompute":
            rows = _recompute_forward(h2, weight, t1, bias, opts, dtype)[0]
        else:
            rows = _chunked(h2, weight, t1, bias, opts, dtype, None, None, None, (False,) * 3)[0]
        return reduce_rows(rows, t1, ignore_index, reduction, shape)
    fn = RecomputeLinearCrossEntropyFunction if mode == "recompute" else LinearCrossEntropyFunction
    out = fn.apply(h2, weight, t1, bias, *opts, dtype, reduction)
    return out.reshape(shape) if reduction == "none" else out


class LinearCrossEntropyLoss(nn.Module):
    """``nn.Module`` around :func:`linear_cross_entropy`: ``LinearCrossEntropyLoss(**options)(hidden, weight,
    target, bias=None)``; options as :class:`mfuwatch.kernels.cross_entropy.CrossEntropyLoss`."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: Optional[float] = None, mode: str = "chunked") -> None:
        super().__init__()
        check_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
        self.opts = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         z_loss=z_loss, softcap=softcap, mode=check_mode(mode))

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return linear_cross_entropy(hidden, weight, target, bias, **self.opts)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.opts.items())


class _CallableModule(types.ModuleType):
    """This module's type: calling it calls :func:`linear_cross_entropy` (the package attribute of that name
    is this module when it was first imported directly; see :mod:`.cross_entropy`)."""

    def __call__(self, *args, **kwargs):
        return linear_cross_entropy(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
