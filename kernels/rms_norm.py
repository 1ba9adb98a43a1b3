"""Fused RMSNorm: functional ``rms_norm``, ``RMSNormFunction``, the ``RMSNorm`` module, and the
``torch.ops.mfuwatch.rms_norm`` / ``rms_norm_backward`` custom ops.

RMSNorm (Zhang & Sennrich 2019) over the last dimension::

    y = x / sqrt(mean(x^2) + eps) * (w + offset)

Two casting modes, because models differ in where they round:

* ``"llama"`` (Hugging Face ``LlamaRMSNorm`` and most ``*RMSNorm`` there): the
  statistics and ``xhat`` in fp32, ``xhat`` cast back to the input dtype, then
  multiplied by the weight; the output dtype is ``promote(x.dtype, w.dtype)``.
* ``"fp32"`` (``torch.nn.RMSNorm`` and Gemma's ``x̂·(1+w)``): everything in fp32,
  ``w + offset`` formed in fp32, one rounding to the input dtype at the end.

``casting="auto"`` picks ``"llama"`` for ``offset == 0`` and ``"fp32"``
otherwise (Gemma, ``offset=1.0``).

Dispatch: in eager mode the functional calls :class:`RMSNormFunction`
directly; under ``torch.compile``, inside a ``TorchDispatchMode`` (such as
``FlopCounterMode``) or with tensor subclasses it calls the registered custom
op, which ``torch.compile`` keeps in one graph (no graph break) and whose FLOPs
``FlopCounterMode`` counts (:mod:`._flops`). Both paths run the same kernels
(:mod:`._norm_triton`, launched by :mod:`._norm_launch`).
"""

import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import _flops
from . import _norm_launch as K
from ._facts import Bytes, KernelFacts, Remedy, Step, aten, patch_line
from ._dispatch import compile_decomposes, first_order_only, needs_grad, use_custom_op
from ._norm_common import check_rms_inputs, empty_width_norm, resolve_casting
from ._patch_types import Candidate
from .add_rms_norm import add_rms_norm_trailing

# ---------------------------------------------------------------- custom ops (compile / dispatch modes)

@torch.library.custom_op("mfuwatch::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, offset: float,
                 llama_cast: bool) -> Tuple[Tensor, Tensor]:
    y, _, _, rstd = K.norm_fwd(x, weight, None, None, x.shape[-1], eps, offset, True, llama_cast)
    return y, rstd.view(x.shape[:-1])


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, llama_cast):
    dt = torch.promote_types(x.dtype, weight.dtype) if (llama_cast and weight is not None) else x.dtype
    return x.new_empty(x.shape, dtype=dt), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("mfuwatch::rms_norm_backward", mutates_args=())
def _rms_norm_bwd_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, offset: float,
                     llama_cast: bool) -> Tuple[Tensor, Tensor]:
    dx, dw, _ = K.norm_bwd(dy, x, weight, False, None, rstd.reshape(-1), None, x.shape[-1], offset,
                           True, llama_cast)
    return dx, (dw if dw is not None else x.new_empty(0))


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, offset, llama_cast):
    dw = weight.new_empty(weight.shape) if weight is not None else x.new_empty(0)
    return x.new_empty(x.shape), dw


def _setup_context(ctx, inputs, output):
    x, weight, _eps, offset, llama_cast = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.offset, ctx.llama_cast = offset, llama_cast


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.mfuwatch.rms_norm_backward(dy, x, weight, rstd, ctx.offset, ctx.llama_cast)
    return dx, (dw if weight is not None else None), None, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- what this kernel declares (kernels/_facts.py)

FACTS = KernelFacts(
    name="rms_norm",
    # bytes (E = rows x N elements, H = N): forward reads x, w and writes y: 2*E*b + H*wb;
    # backward reads x, dy, w and writes dx, dw: 3*E*b + 2*H*wb
    forward=Bytes(activations=2, weights=1), backward=Bytes(activations=3, weights=2),
    # FLOPs per element of x: forward s^2, sum, *rstd, *w (4; 3 without weight); backward xhat = s*rstd,
    # g = dy*w, sum(g*xhat) (2), (g - xhat*c)*rstd (3), dw += dy*xhat (2) (9; 6 without weight)
    flops={"forward": 4, "forward_no_weight": 3, "backward": 9, "backward_no_weight": 6},
    remedy=Remedy(
        kernel="rms_norm", kind="bundled",
        title="Fused RMSNorm (Triton drop-in) instead of RMSNorm written out as pow/mean/rsqrt/mul",
        apply=patch_line("rms_norm"),
        replaces="[to] → pow → mean → add → rsqrt → mul → [type_as] → [mul weight]",
        sequence=(
            Step(aten("to", "_to_copy"), optional=True),  # x.float()
            Step(aten("pow", "square")),
            Step(aten("mean")),
            Step(aten("add", "add_")),
            Step(aten("rsqrt")),
            Step(aten("mul")),
            Step(aten("type_as", "to", "_to_copy"), optional=True),  # .type_as(x) / .to(input_dtype)
            Step(aten("mul"), optional=True),  # * weight
        ),
        anchor_arg=0,
        note="bytes from mfuwatch.kernels.traffic: forward reads x, w and writes y; backward reads x, dy, w "
             "and writes dx, dw",
    ),
    exports=("rms_norm", "RMSNorm", "RMSNormFunction"),
    patch=".rms_norm",
)


def _fwd_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return _flops.numel(x_shape) * FACTS.flops["forward" if w_shape is not None else "forward_no_weight"]


def _bwd_flops(dy_shape, x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return _flops.numel(x_shape) * FACTS.flops["backward" if w_shape is not None else "backward_no_weight"]


_flops.register(torch.ops.mfuwatch.rms_norm, _fwd_flops)
_flops.register(torch.ops.mfuwatch.rms_norm_backward, _bwd_flops)


# ---------------------------------------------------------------- eager fast path

class RMSNormFunction(torch.autograd.Function):
    """``autograd.Function`` for RMSNorm: ``apply(x, weight, eps, offset, llama_cast) -> y``.

    x: (..., N) fp32/fp16/bf16, any strides; weight: (N,) or None. Saves
    ``x``, ``weight`` and the fp32 ``rstd`` (one per row) for the backward.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, offset, llama_cast):
        y, _, _, rstd = K.norm_fwd(x, weight, None, None, x.shape[-1], eps, offset, True, llama_cast)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.llama_cast = offset, llama_cast
        return y

    @staticmethod
    @first_order_only  # a clear error for double backward (the kernels have no second derivative)
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw, _ = K.norm_bwd(dy, x, weight, False, None, rstd, None, x.shape[-1], ctx.offset, True,
                               ctx.llama_cast)
        return dx, dw, None, None, None


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = 1e-6, offset: float = 0.0, *,
             casting: str = "auto") -> Tensor:
    """Fused RMSNorm over the last dimension.

    Args:
        x: (..., N), fp32/fp16/bf16, any shape and strides, on a CUDA device
            (CPU tensors run the Triton interpreter when ``TRITON_INTERPRET=1``,
            else a PyTorch fallback).
        weight: (N,) scale, or None for no affine scale.
        eps: added to the mean square (Llama 1e-6); None means
            ``torch.finfo(x.dtype).eps``, as in ``torch.nn.functional.rms_norm``.
        offset: added to the weight in fp32 (Gemma: 1.0, for ``x̂·(1+w)``).
        casting: ``"llama"``, ``"fp32"`` or ``"auto"`` (see the module docstring).
    Returns:
        Tensor shaped like ``x``, contiguous; dtype ``promote(x, weight)`` under
        Llama casting with a weight, else ``x.dtype``.
    Raises:
        ValueError: weight not shaped (N,), a 0-d ``x``, or an unknown casting mode.
    """
    llama = resolve_casting(casting, offset)
    check_rms_inputs(x, weight)
    if eps is None:  # as torch.nn.functional.rms_norm
        eps = torch.finfo(x.dtype).eps
    if x.shape[-1] == 0:  # nothing to normalise: an empty result, as torch.nn.functional.rms_norm returns
        return empty_width_norm(x, weight, offset, llama)
    if compile_decomposes():  # Inductor fuses the written-out norm with its neighbours
        return K.norm_reference(x, weight, None, None, x.shape[-1], float(eps), float(offset), True, llama)[0]
    if use_custom_op(x, weight):
        return torch.ops.mfuwatch.rms_norm(x, weight, float(eps), float(offset), llama)[0]
    if not needs_grad(x, weight):
        return K.norm_fwd(x, weight, None, None, x.shape[-1], float(eps), float(offset), True, llama)[0]
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), llama)


# ---------------------------------------------------------------- module

class RMSNorm(nn.Module):
    """Drop-in RMSNorm over the trailing ``normalized_shape`` dims, on the fused kernels.

    Constructor, parameters (``weight``, shape ``normalized_shape``) and
    ``state_dict`` match ``torch.nn.RMSNorm``; ``eps=None`` means
    ``torch.finfo(x.dtype).eps`` at call time, as there. Extra keyword-only
    arguments: ``offset`` (Gemma: 1.0; the weight then starts at zeros) and
    ``casting`` (``"llama"``, ``"fp32"`` or ``"auto"``, the default: ``"llama"``
    for ``offset == 0``, as Hugging Face Llama computes, ``"fp32"`` for Gemma's
    ``offset == 1``). ``torch.nn.RMSNorm`` computes as ``"fp32"``: pass
    ``casting="fp32"`` to match it exactly, including its output dtype (under
    ``"llama"`` a bf16 input with an fp32 weight gives an fp32 output, as in
    Hugging Face; ``patch`` picks the right mode for each module it swaps).

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)``
    returns ``(rms_norm(x + residual), x + residual)`` through the fused
    :func:`~mfuwatch.kernels.add_rms_norm` (over the trailing ``normalized_shape`` dims).
    """

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: Optional[float] = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *, offset: float = 0.0,
                 casting: str = "auto") -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
        resolve_casting(casting, self.offset)
        self.casting = casting
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones (zeros when ``offset`` is 1, so that the scale starts at 1)."""
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(1.0 - self.offset)

    @property
    def variance_epsilon(self) -> Optional[float]:
        """Alias of ``eps`` under the Hugging Face attribute name."""
        return self.eps

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        n_dims = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - n_dims:]) != self.normalized_shape:
            raise ValueError(f"input shape {tuple(x.shape)} does not end with {self.normalized_shape}")
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if residual is not None:  # x and residual as given (no reshape: a leaf stays a leaf for autograd)
            if residual.shape != x.shape:
                raise ValueError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
            return add_rms_norm_trailing(x, residual, self.weight, float(eps), self.offset,
                                         resolve_casting(self.casting, self.offset), n_dims)
        shape = x.shape
        if n_dims != 1:  # normalise over several trailing dims: flatten them into one (an explicit width:
            # -1 cannot be inferred for 0 rows)
            x = x.reshape(*shape[: x.dim() - n_dims], math.prod(self.normalized_shape))
        w = self.weight.reshape(-1) if (self.weight is not None and n_dims != 1) else self.weight
        return rms_norm(x, w, eps, self.offset, casting=self.casting).view(shape)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"offset={self.offset}, casting={self.casting!r}")


# ---------------------------------------------------------------- patch rule (kernels/_patch_types.py)

def swap_candidate(m: nn.Module) -> Optional[Candidate]:
    """``torch.nn.RMSNorm``, or a ``*RMSNorm`` class (Hugging Face Llama, Mistral, Qwen, Gemma, ...) with a 1-D
    ``weight`` and a float ``variance_epsilon`` or ``eps``; None for other modules. The replacements to try:
    Llama casting with ``w``, then fp32 casting with Gemma's ``1 + w`` (reversed for a Gemma class), so that
    ``patch``'s probe decides between the two."""
    if hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm):
        def build():
            new = RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta", casting="fp32")
            if m.weight is not None:
                new.weight = m.weight
            return new
        return Candidate("rms_norm", [build], probe_shape=(4, *m.normalized_shape))
    if isinstance(m, nn.LayerNorm) or not type(m).__name__.lower().endswith("rmsnorm"):
        return None
    w = getattr(m, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return Candidate("rms_norm", None, "no 1-D `weight` parameter")
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(eps, (int, float)):
        return Candidate("rms_norm", None, "no float `variance_epsilon`/`eps` attribute")
    if len(list(m.parameters(recurse=False))) != 1 or len(list(m.buffers(recurse=False))) != 0:
        return Candidate("rms_norm", None, "has parameters or buffers besides `weight`")
    variants = [(0.0, "llama"), (1.0, "fp32")]
    if "gemma" in type(m).__name__.lower():
        variants.reverse()

    def builder(offset, casting):
        def build():
            new = RMSNorm(w.shape[0], float(eps), device="meta", offset=offset, casting=casting)
            new.weight = w
            return new
        return build
    return Candidate("rms_norm", [builder(o, c) for o, c in variants], probe_shape=(4, w.shape[0]))
