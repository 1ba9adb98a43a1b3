"""Fused rotary position embedding: ``apply_rotary``, ``RotaryFunction`` and the ``torch.ops.mfuwatch.rotary`` /
``rotary_backward`` custom ops.

``apply_rotary(q, k, cos, sin)`` computes Hugging Face's ``apply_rotary_pos_emb``::

    q_embed = q * cos + rotate_half(q) * sin      (cos, sin broadcast over the heads)

for the first ``R = cos.shape[-1]`` dims of each head, passing dims ``R..D`` through
(partial rotary, as Phi-3 and GPT-NeoX write it). ``rotate_half(x) = cat(-x[R/2:], x[:R/2])``;
with ``interleaved=True`` the pairs are ``(x[2j], x[2j+1])`` (GPT-J, GLM):
``rotate(x)[2j] = -x[2j+1]``, ``rotate(x)[2j+1] = x[2j]``. Kernels: :mod:`._rotary_triton`.

Dispatch: eager calls run :class:`RotaryFunction`; a ``TorchDispatchMode`` (``FlopCounterMode``)
or a tensor subclass takes the custom op (FLOPs counted, :data:`FACTS`); under
``torch.compile`` the op is written out in PyTorch ops (:func:`._rotary_triton.reference`), which
Inductor fuses with its neighbours (see :func:`._dispatch.compile_decomposes`).
"""

from typing import Tuple

import torch
from torch import Tensor

from . import _flops
from . import _rotary_triton as K
from ._facts import Bytes, KernelFacts, Remedy, Step, aten, patch_line
from ._dispatch import compile_decomposes, first_order_only, needs_grad, use_custom_op

# ---------------------------------------------------------------- custom ops

@torch.library.custom_op("mfuwatch::rotary", mutates_args=())
def _rotary_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tuple[Tensor, Tensor]:
    return K.rotary(q, k, cos, sin, interleaved)


@_rotary_op.register_fake
def _(q, k, cos, sin, interleaved):
    K.check(q, k, cos, sin)
    return (torch.empty_like(q, dtype=K.out_dtype(q, cos, sin)),
            torch.empty_like(k, dtype=K.out_dtype(k, cos, sin)))


@torch.library.custom_op("mfuwatch::rotary_backward", mutates_args=())
def _rotary_bwd_op(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
                   q_dtype: torch.dtype, k_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    return K.rotary(dq, dk, cos, sin, interleaved, True, q_dtype, k_dtype)


@_rotary_bwd_op.register_fake
def _(dq, dk, cos, sin, interleaved, q_dtype, k_dtype):
    return torch.empty_like(dq, dtype=q_dtype), torch.empty_like(dk, dtype=k_dtype)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.dtypes = interleaved, (q.dtype, k.dtype)


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    gq, gk = torch.ops.mfuwatch.rotary_backward(dq, dk, cos, sin, ctx.interleaved, *ctx.dtypes)
    return gq, gk, None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- what this kernel declares (kernels/_facts.py)

FACTS = KernelFacts(
    name="rotary",
    # bytes of one of q, k (rows = B*H*T, hidden = D): forward reads x and writes x_embed: 2*E*b; backward reads
    # dy and writes dx: 2*E*b (cos/sin: 2*B*T*R elements per call, shared by all heads, left out)
    forward=Bytes(activations=2), backward=Bytes(activations=2),
    # FLOPs per rotated element (one of the R dims of one head of q or k), forward and backward alike:
    # x1 c1 - x2 s1 is two multiplies and one subtract per output element (the copied dims cost none)
    flops={"forward": 3, "backward": 3},
    remedy=Remedy(
        kernel="rotary", kind="bundled",
        title="Fused rotary embedding (Triton drop-in) instead of rotate_half written out as mul, neg, cat, mul, add",
        apply=patch_line("rotary"),
        replaces="x * cos + cat(-x2, x1) * sin (Hugging Face apply_rotary_pos_emb, once for q and once for k)",
        sequence=(Step(aten("mul")), Step(aten("neg")), Step(aten("cat")), Step(aten("mul")), Step(aten("add"))),
        anchor_arg=0,
        # rotate_half's x[..., :h] and x[..., h:] are views (nothing launched in the forward); their backward
        # (SliceBackward0: zero-fill, copy, add of the two halves) is eager's, gone with the drop-in
        views=aten("slice"),
        # RotaryFunction.backward writes dq, dk in q's and k's forward strides (ctx.layouts), where eager's come
        # back contiguous in (B, H, T, D): slice_backward's zero-filled buffers, accumulated into
        returns_input_layout=True,
        note="anchor = q or k (B, H, T, D); bytes from mfuwatch.kernels.traffic: forward reads x and writes "
             "x_embed, backward reads the gradient and writes dx (cos/sin, shared by all heads, left out)",
    ),
    exports=("apply_rotary", "RotaryFunction"),
    patch="._hf_rotary",
)


def _flop_counter(direction: str):
    def count(q_shape, k_shape, cos_shape, *args, out_shape=None, **kwargs) -> int:
        b, hq, t, _ = q_shape
        return FACTS.flops[direction] * b * t * (hq + k_shape[1]) * cos_shape[-1]
    return count


_flops.register(torch.ops.mfuwatch.rotary, _flop_counter("forward"))
_flops.register(torch.ops.mfuwatch.rotary_backward, _flop_counter("backward"))


# ---------------------------------------------------------------- eager fast path

class RotaryFunction(torch.autograd.Function):
    """``autograd.Function``: ``apply(q, k, cos, sin, interleaved) -> (q_embed, k_embed)``.

    Saves only ``cos`` and ``sin``: the backward is the inverse rotation of the incoming
    gradients. No gradient flows to ``cos``/``sin`` (:func:`apply_rotary` refuses ones that need it).
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.dtypes = interleaved, (q.dtype, k.dtype)
        ctx.layouts = (q.stride(), k.stride())
        return K.rotary(q, k, cos, sin, interleaved)

    @staticmethod
    @first_order_only  # a clear error for double backward (the kernels have no second derivative)
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # the gradients laid out as q and k were (e.g. transposed projections), whatever layout dq/dk arrive in:
        # autograd then hands them to the projections' outputs without a copy
        gq, gk = K.rotary(dq, dk, cos, sin, ctx.interleaved, True, *ctx.dtypes, layouts=ctx.layouts)
        return gq, gk, None, None, None


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False
                 ) -> Tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k``, fused (one read and one write of each, cos/sin read once per token).

    Args:
        q: (B, Hq, T, D) queries, fp32/fp16/bf16, any strides (e.g. ``q_proj(x).view(B, T, Hq, D).transpose(1, 2)``).
        k: (B, Hk, T, D) keys, any number of heads (1 included), same dtype rules.
        cos, sin: (B, T, R) or (1, T, R), as the model's rotary module returns them (rope scaling included);
            ``R <= D``, even: the first ``R`` dims of each head are rotated, the rest passed through.
        interleaved: pairs ``(2j, 2j+1)`` (GPT-J) instead of ``(j, j + R/2)`` (Llama, rotate-half).
    Returns:
        ``(q_embed, k_embed)``: new tensors shaped like ``q``/``k``, in the dtype ``x * cos`` would have
        (``promote(q.dtype, cos.dtype)``), with ``q``/``k``'s strides when those are dense. The inputs are
        not modified. Computed in fp32, rounded once.
    Raises:
        ValueError: shapes that do not fit (both printed), R odd or > D, an unsupported dtype, tensors on
            different devices, or ``cos``/``sin`` that require grad (this op gives them no gradient).
    """
    K.check(q, k, cos, sin)
    if compile_decomposes():
        return (K.reference(q, cos, sin, interleaved, dtype=K.out_dtype(q, cos, sin)),
                K.reference(k, cos, sin, interleaved, dtype=K.out_dtype(k, cos, sin)))
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("cos/sin require grad: apply_rotary gives them no gradient; compute them under "
                         "torch.no_grad() (as Hugging Face's rotary modules do) or detach them")
    if use_custom_op(q, k, cos, sin):
        return torch.ops.mfuwatch.rotary(q, k, cos, sin, bool(interleaved))
    if not needs_grad(q, k):
        return K.rotary(q, k, cos, sin, bool(interleaved))
    return RotaryFunction.apply(q, k, cos, sin, bool(interleaved))
