"""Fused cross-entropy: functional ``cross_entropy``, its ``autograd.Function``\\ s, the ``CrossEntropyLoss``
module, and the ``torch.ops.mfuwatch.cross_entropy`` / ``cross_entropy_backward`` custom ops.

``cross_entropy(logits, target)`` computes what ``torch.nn.functional.cross_entropy(logits.float(), target)``
computes (class-index targets, ``ignore_index``, ``reduction``, ``label_smoothing``), plus two options LLM
training uses: a logit softcap ``c * tanh(x / c)`` applied before the softmax (Gemma 2/3) and a z-loss
``z_loss * logsumexp^2`` added to every counted row's loss (PaLM, Chowdhery et al. 2022, section 5). The
math and the bytes are in :mod:`._cross_entropy_triton`.

Bytes (``E = rows x V`` elements of ``b`` bytes): eager PyTorch reads the logits, writes and re-reads a
log-softmax (and an fp32 copy for bf16 logits) forward, and moves several more passes backward; the
floor is one read forward and one read plus one write of the gradient backward (``3 E b``, or ``2 E b``
when the gradient is formed while the row is still in cache). Paths:

* **Eager, ``reduction`` "mean"/"sum", logits requiring grad** (:class:`FusedCrossEntropyFunction`): one
  launch computes the loss and writes the gradient (scaled by ``1 / count`` for the mean, read on the
  device) into a new buffer; the backward multiplies it by the upstream gradient in place, a kernel that
  does nothing when that gradient is 1 (``loss.backward()``). No host-device sync. A second backward
  through a retained graph recomputes the gradient from the saved logits.
* **Eager, ``reduction="none"``** (:class:`CrossEntropyFunction`): the forward saves the per-row
  log-sum-exp; the backward reads the logits once more with the per-row upstream gradient.
* **torch.compile**: the reference math in PyTorch ops (:func:`reference_cross_entropy`), which Inductor
  fuses itself (as fast as a hand kernel, and it can fuse the surrounding ops too).
* **Dispatch modes (FlopCounterMode, FakeTensorMode) and tensor subclasses**: the custom ops, whose
  FLOPs are registered in :mod:`._flops` (the counts per logit: :data:`FACTS`).

The gradient is never written into a tensor autograd can see: the logits may feed another loss.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _cross_entropy_triton as K
from . import _flops
from ._facts import Bytes, KernelFacts, Remedy, Step, aten, patch_line
from ._dispatch import first_order_only, needs_grad, use_custom_op
from ._launch import use_triton

REDUCTIONS = ("none", "mean", "sum")


def check_options(ignore_index, reduction, label_smoothing, z_loss, softcap) -> float:
    """Validate the shared options; return the softcap as a float (0.0 for none).

    Raises:
        ValueError: ``reduction`` not in :data:`REDUCTIONS`, ``label_smoothing`` outside [0, 1],
            a negative or non-finite ``z_loss``, a ``softcap`` that is not None or a positive number,
            or a non-int ``ignore_index``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {REDUCTIONS}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index={ignore_index!r}: expected an int")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing={label_smoothing!r}: expected a float in [0, 1]")
    if not (isinstance(z_loss, (int, float)) and math.isfinite(z_loss) and z_loss >= 0.0):
        raise ValueError(f"z_loss={z_loss!r}: expected a finite float >= 0")
    if softcap is None:
        return 0.0
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap={softcap!r}: expected None or a positive float")
    return float(softcap)


def flatten(logits: Tensor, target: Tensor) -> Tuple[Tensor, Tensor, Tuple[int, ...]]:
    """(rows view of the logits (rows, C), targets (rows,), shape of the unreduced loss), with the layouts
    ``F.cross_entropy`` accepts: (C,) with a 0-d target, (N, C) with (N,), (N, C, d1, ...) with (N, d1, ...).

    Raises:
        ValueError: a target shape that does not match, or 0-d logits.
    """
    if logits.dim() == 0:
        raise ValueError("logits are a 0-d tensor: expected (C,), (N, C) or (N, C, d1, ...)")
    if logits.dim() == 1:
        if target.dim() != 0:
            raise ValueError(f"target shape {tuple(target.shape)} != () for logits of shape {tuple(logits.shape)}")
        return logits.unsqueeze(0), target.reshape(1), ()
    want = (logits.shape[0], *logits.shape[2:])
    if tuple(target.shape) != want:
        raise ValueError(f"target shape {tuple(target.shape)} != {want} for logits of shape {tuple(logits.shape)}")
    if logits.dim() == 2:
        return logits, target, tuple(target.shape)
    c = logits.shape[1]
    return logits.movedim(1, -1).reshape(-1, c), target.reshape(-1), tuple(target.shape)


def reduce_rows(rows: Tensor, target: Tensor, ignore_index: int, reduction: str, shape) -> Tensor:
    """Per-row losses (fp32) to the requested reduction; the mean divides by the count of rows whose target
    is not ``ignore_index`` on the device (0 / 0 = NaN when all are ignored, as torch)."""
    if reduction == "none":
        return rows.reshape(shape)
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (target != ignore_index).sum()


# ---------------------------------------------------------------- custom ops (dispatch modes, subclasses)

@torch.library.custom_op("mfuwatch::cross_entropy", mutates_args=())
def _ce_op(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
           softcap: float) -> Tuple[Tensor, Tensor]:
    return K.ce_fwd(logits, target, ignore_index, label_smoothing, z_loss, softcap)


@_ce_op.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("mfuwatch::cross_entropy_backward", mutates_args=())
def _ce_bwd_op(grad_rows: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
               label_smoothing: float, z_loss: float, softcap: float) -> Tensor:
    return K.ce_bwd(grad_rows, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap)


@_ce_bwd_op.register_fake
def _(grad_rows, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap):
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, target, ctx.ignore_index, ctx.smoothing, ctx.z_loss, ctx.softcap = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_rows, _dlse):
    logits, target, lse = ctx.saved_tensors
    dx = torch.ops.mfuwatch.cross_entropy_backward(grad_rows, logits, target, lse, ctx.ignore_index,
                                                   ctx.smoothing, ctx.z_loss, ctx.softcap)
    return dx, None, None, None, None, None


_ce_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- what this kernel declares (kernels/_facts.py)

FACTS = KernelFacts(
    name="cross_entropy",
    # bytes (E = tokens x V logits): forward reads the logits: E*b; backward reads the logits and writes
    # dlogits: 2*E*b (the per-row loss and log-sum-exp, 4 bytes each, left out). Also the count for the chunked
    # LM head + loss (linear_cross_entropy): its logits chunks are formed by the GEMM and read back while hot
    forward=Bytes(activations=1), backward=Bytes(activations=2),
    # FLOPs per logit: forward x - max, exp, running sum, running max: 4, softcap c*tanh(x/c) (divide, tanh,
    # mul) +3; backward z - lse, exp, *(1 + 2 zl lse), -eps/V, *upstream gradient: 5, softcap: z again (3),
    # 1 - (z/c)^2 (2), * : +6
    flops={"forward": 4, "backward": 5, "forward_softcap": 7, "backward_softcap": 11},
    remedy=Remedy(
        kernel="cross_entropy", kind="bundled",
        title="Fused cross-entropy (Triton drop-in): a Hugging Face causal LM's head + loss in chunks without "
              "the full logits (linear_cross_entropy); elsewhere mfuwatch.kernels.cross_entropy(logits, targets)",
        apply=patch_line("cross_entropy"),
        replaces="[logits.float()] → log_softmax → nll_loss, or cross_entropy_loss",
        sequence=(Step(aten("to", "_to_copy"), optional=True),
                  Step(aten("cross_entropy_loss", "log_softmax", "_log_softmax")),
                  Step(aten("nll_loss", "nll_loss_nd"), optional=True)),
        anchor_arg=0,
        note="bytes from mfuwatch.kernels.traffic: forward reads the logits, backward reads them again and "
             "writes dlogits (the fused forward forms the gradient while the row is in cache). For model code "
             "outside the recognised families: loss = mfuwatch.kernels.cross_entropy(logits, targets), or "
             "mfuwatch.kernels.linear_cross_entropy(hidden, lm_head.weight, targets) to skip the logits; "
             "under torch.compile, compiling F.cross_entropy fuses the same ops",
    ),
    exports=("cross_entropy", "CrossEntropyLoss"),
    exports_from={".linear_cross_entropy": ("linear_cross_entropy", "LinearCrossEntropyLoss")},
    patch="._hf_lm_head",
)


def ce_flops(direction: str, softcap: float) -> int:
    """FLOPs per logit of the ``"forward"`` or ``"backward"`` pass (:data:`FACTS`), with a softcap when > 0."""
    return FACTS.flops[direction + ("_softcap" if softcap > 0 else "")]


def _fwd_flops(x, t, *args, out_shape=None, **kw):
    softcap = args[3] if len(args) > 3 else 0.0
    return _flops.numel(x) * ce_flops("forward", softcap)


def _bwd_flops(g, x, t, lse, *args, out_shape=None, **kw):
    softcap = args[3] if len(args) > 3 else 0.0
    return _flops.numel(x) * ce_flops("backward", softcap)


_flops.register(torch.ops.mfuwatch.cross_entropy, _fwd_flops)
_flops.register(torch.ops.mfuwatch.cross_entropy_backward, _bwd_flops)


# ---------------------------------------------------------------- eager paths

class CrossEntropyFunction(torch.autograd.Function):
    """``apply(logits (rows, V), target (rows,), ignore_index, label_smoothing, z_loss, softcap) -> loss (rows,)``
    fp32 per-row losses; ``softcap`` 0.0 for none. Saves the logits and the per-row log-sum-exp; the
    backward reads the logits once more (any per-row upstream gradient)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, z_loss, softcap):
        rows, lse = K.ce_fwd(logits, target, ignore_index, smoothing, z_loss, softcap)
        ctx.save_for_backward(logits, target, lse)
        ctx.opts = (ignore_index, smoothing, z_loss, softcap)
        return rows

    @staticmethod
    @first_order_only
    def backward(ctx, grad_rows):
        logits, target, lse = ctx.saved_tensors
        return (K.ce_bwd(grad_rows, logits, target, lse, *ctx.opts), None, None, None, None, None)


class FusedCrossEntropyFunction(torch.autograd.Function):
    """``apply(logits (rows, V), target (rows,), ignore_index, label_smoothing, z_loss, softcap, mean) -> loss``
    (0-d fp32, the mean over counted rows when ``mean`` else the sum). The forward's launch also writes the
    gradient into a private buffer; the backward scales it by the upstream gradient in place (nothing to do
    for 1) and hands it over. A second backward (``retain_graph=True``) recomputes it from the logits."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, z_loss, softcap, mean):
        n = (target != ignore_index).sum()
        scale = (1.0 / n) if mean else torch.ones((), device=logits.device)  # inf when all rows are ignored:
        # those rows' gradients are written as 0 whatever the scale
        dx = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        rows, lse = K.ce_fwd(logits, target, ignore_index, smoothing, z_loss, softcap, grad_scale=scale.float(),
                             dx=dx)
        ctx.save_for_backward(logits, target, lse, scale)
        ctx.dx = dx
        ctx.opts = (ignore_index, smoothing, z_loss, softcap)
        return rows.sum() / n if mean else rows.sum()

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        logits, target, lse, scale = ctx.saved_tensors
        dx, ctx.dx = ctx.dx, None
        if dx is None:  # a second backward through a retained graph: the buffer was handed over already
            grad_rows = (g.float() * scale).reshape(1).expand(logits.shape[0])
            dx = K.ce_bwd(grad_rows, logits, target, lse, *ctx.opts)
        else:
            K.scale_(dx, g)
        return dx, None, None, None, None, None, None


def reference_cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                            label_smoothing: float = 0.0, z_loss: float = 0.0,
                            softcap: Optional[float] = None) -> Tensor:
    """:func:`cross_entropy` written in PyTorch ops (fp32), differentiable by autograd: what a compiled graph
    gets, so that Inductor fuses it with its neighbours. Same arguments, result and errors."""
    cap = check_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
    x2, t1, shape = flatten(logits, target)
    z = x2.float()
    if cap > 0:
        z = cap * torch.tanh(z / cap)
    rows = F.cross_entropy(z, t1.long(), ignore_index=ignore_index, reduction="none",
                           label_smoothing=float(label_smoothing))
    if z_loss > 0:  # where, not a multiply by the mask: an ignored row's gradient stays 0 under an inf scale
        rows = rows + torch.where(t1 != ignore_index, z_loss * torch.logsumexp(z, -1) ** 2, 0.0)
    return reduce_rows(rows, t1, ignore_index, reduction, shape)


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None) -> Tensor:
    """Cross-entropy of class logits against class indices, fused (``F.cross_entropy`` semantics in fp32).

    Args:
        logits: (N, C), (C,) or (N, C, d1, ...) float32/float16/bfloat16 on a CUDA device (or the CPU:
            PyTorch fallback, or Triton's interpreter under ``TRITON_INTERPRET=1``); any strides (rows are
            read in place when the class dimension has unit stride, else copied once). C up to 262144
            and beyond (rows are streamed in blocks).
        target: int64/int32 class indices, shaped (N,), () or (N, d1, ...) to match.
        ignore_index: targets equal to it count neither in the loss nor in the mean's denominator and
            get a zero gradient.
        reduction: ``"mean"`` (over counted rows; NaN with zero gradients when every row is ignored, as
            torch), ``"sum"`` or ``"none"`` (fp32 loss per target element; its backward takes any
            per-element upstream gradient).
        label_smoothing: in [0, 1], torch's definition (``eps / C`` on every class).
        z_loss: weight of ``logsumexp(z)^2`` added to each counted row's loss (0 disables).
        softcap: None, or ``c > 0`` for logits ``c * tanh(x / c)`` before the softmax.
    Returns:
        fp32 loss: a 0-d tensor for "mean"/"sum", else shaped like ``target``. Equals
        ``F.cross_entropy(softcapped(logits.float()), target, ...)`` + the z-loss term. The gradient has
        the logits' dtype and shape. A target outside [0, C) that is not ``ignore_index`` gives NaN
        (checking would need a host-device sync; torch raises).
    Raises:
        ValueError: bad options (see :func:`check_options`), mismatched shapes, dtypes or devices.
    """
    cap = check_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
    if torch.compiler.is_compiling():  # Inductor fuses the plain math itself
        return reference_cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                                       label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    x2, t1, shape = flatten(logits, target)
    K.check_inputs(x2, t1)
    opts = (ignore_index, float(label_smoothing), float(z_loss), cap)
    if use_custom_op(logits, target):
        rows = torch.ops.mfuwatch.cross_entropy(x2, t1, *opts)[0]
    elif not needs_grad(logits):
        rows = K.ce_fwd(x2, t1, *opts)[0]
    elif reduction != "none" and use_triton(x2) and x2.numel() > 0:
        return FusedCrossEntropyFunction.apply(x2, t1, *opts, reduction == "mean")
    else:
        rows = CrossEntropyFunction.apply(x2, t1, *opts)
    return reduce_rows(rows, t1, ignore_index, reduction, shape)


class CrossEntropyLoss(nn.Module):
    """``nn.Module`` around :func:`cross_entropy`: ``CrossEntropyLoss(ignore_index=-100, reduction="mean",
    label_smoothing=0.0, z_loss=0.0, softcap=None)(logits, target)``. Options are validated at
    construction (ValueError naming the option and the accepted values)."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: Optional[float] = None) -> None:
        super().__init__()
        check_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss, self.softcap = label_smoothing, z_loss, softcap

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}")


class _CallableModule(types.ModuleType):
    """This module's type: calling the module calls :func:`cross_entropy`.

    The file stem equals the function's name, and Python's import system sets the package attribute
    ``mfuwatch.kernels.cross_entropy`` to the *module* whenever the module is first imported directly
    (``import mfuwatch.kernels.cross_entropy``, or by a sibling module); with this class
    ``mfuwatch.kernels.cross_entropy(logits, target)`` computes the loss either way.
    """

    def __call__(self, *args, **kwargs):
        return cross_entropy(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
