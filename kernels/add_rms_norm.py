"""Fused residual add + RMSNorm: ``add_rms_norm(x, residual, weight) -> (normed, new_residual)``.

The pre-norm transformer block computes ``h = residual + x`` and then
``rms_norm(h)``; unfused that is three trips through memory for ``h``
(write the sum, read it for the statistics, read it again to scale). The
fused kernel reads ``x`` and ``residual`` once and writes ``h`` and the normed
output once::

    new_residual = (x + residual) rounded to promote(x.dtype, residual.dtype)
    normed       = rms_norm(new_residual, weight, eps, offset)

The norm is taken of the *rounded* sum, exactly what the unfused code
normalises. Backward: ``d(sum) = rms_norm_backward(d normed) + d(new_residual)``,
which is the gradient of both ``x`` and ``residual``. Casting modes as in
:mod:`.rms_norm`. No module pattern replaces this op (the residual add lives
in a decoder layer's ``forward``): call it from model code, or use
``RMSNorm.forward(x, residual)``.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _flops
from . import _norm_launch as K
from ._facts import Bytes, KernelFacts
from ._dispatch import compile_decomposes, first_order_only, needs_grad, use_custom_op
from ._norm_common import check_rms_inputs, empty_width_norm, resolve_casting


def _width(x: Tensor, n_dims: int) -> int:
    """Elements normalised per row: the product of ``x``'s trailing ``n_dims`` sizes."""
    return math.prod(x.shape[x.dim() - n_dims:])


@torch.library.custom_op("mfuwatch::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, offset: float,
                     llama_cast: bool, n_dims: int) -> Tuple[Tensor, Tensor, Tensor]:
    y, s, _, rstd = K.norm_fwd(x, weight, None, residual, _width(x, n_dims), eps, offset, True, llama_cast)
    return y, s, rstd.view(x.shape[:x.dim() - n_dims])


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, llama_cast, n_dims):
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
    s_dt = torch.promote_types(x.dtype, residual.dtype)
    y_dt = torch.promote_types(s_dt, weight.dtype) if (llama_cast and weight is not None) else s_dt
    return (x.new_empty(x.shape, dtype=y_dt), x.new_empty(x.shape, dtype=s_dt),
            x.new_empty(x.shape[:x.dim() - n_dims], dtype=torch.float32))


@torch.library.custom_op("mfuwatch::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_bwd_op(dy: Tensor, dres: Optional[Tensor], s: Tensor, weight: Optional[Tensor],
                         rstd: Tensor, offset: float, llama_cast: bool, n_dims: int,
                         two_grads: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(d sum, its second copy (empty unless two_grads), dw (empty without a weight))``."""
    ds, ds2, dw = _sum_grad(dy, dres, s, weight, rstd.reshape(-1), offset, llama_cast, _width(s, n_dims), two_grads)
    return ds, (ds2 if ds2 is not None else s.new_empty(0)), (dw if dw is not None else s.new_empty(0))


@_add_rms_norm_bwd_op.register_fake
def _(dy, dres, s, weight, rstd, offset, llama_cast, n_dims, two_grads):
    dw = weight.new_empty(weight.shape) if weight is not None else s.new_empty(0)
    return s.new_empty(s.shape), (s.new_empty(s.shape) if two_grads else s.new_empty(0)), dw


def _sum_grad(dy: Tensor, dres: Optional[Tensor], s: Tensor, weight: Optional[Tensor], rstd: Tensor, offset: float,
              llama_cast: bool, n: int, two_grads: bool) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(d sum, its second copy or None, dw or None)`` by the fused backward; the copy (``two_grads``) is
    written by the kernel, see :func:`_two_grads`. rstd: fp32 ``(rows,)``."""
    ds2 = torch.empty_like(s, memory_format=torch.contiguous_format) if two_grads else None
    ds, dw, _ = K.norm_bwd(dy, s, weight, False, None, rstd, dres, n, offset, True, llama_cast, dx_copy=ds2)
    return ds, ds2, dw


def _grads(ds: Tensor, ds2: Optional[Tensor], x_dtype: torch.dtype, r_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """The sum's gradient as the gradients of ``x`` and ``residual``: ``(ds, ds2)`` when there is a second copy,
    else ``ds`` for both (cast to an input's dtype where it differs)."""
    if ds2 is not None:
        return ds, ds2
    dx = ds if ds.dtype == x_dtype else ds.to(x_dtype)
    dr = ds if ds.dtype == r_dtype else ds.to(r_dtype)
    return dx, dr


def _save(ctx, x: Tensor, residual: Tensor, weight: Optional[Tensor], s: Tensor, rstd: Tensor, offset: float,
          llama_cast: bool, two_grads: bool) -> None:
    """What both backward paths (``AddRMSNormFunction``, the custom op's autograd) keep on ``ctx``."""
    ctx.save_for_backward(s, weight, rstd)
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):  # only the weight: x + residual has no grad
        ctx.mark_non_differentiable(s)
    ctx.set_materialize_grads(False)  # an unused new_residual then costs no zero-filled gradient
    ctx.offset, ctx.llama_cast, ctx.two_grads = offset, llama_cast, two_grads
    ctx.dtypes = (x.dtype, residual.dtype)


def _setup_context(ctx, inputs, output):
    x, residual, weight, _eps, offset, llama_cast, n_dims = inputs
    ctx.mark_non_differentiable(output[2])
    # two gradient tensors whenever both inputs need one: here (torch.compile, dispatch modes) whether an
    # input is a leaf, or a view of one, cannot be told from what the op is given
    _save(ctx, x, residual, weight, output[1], output[2], offset, llama_cast,
          ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and x.dtype == residual.dtype)
    ctx.n_dims = n_dims


def _backward(ctx, dy, dres, _drstd):
    s, weight, rstd = ctx.saved_tensors
    if dy is None:  # only the new residual was used
        if dres is None:
            return None, None, None, None, None, None, None
        return (*_grads(dres, None, *ctx.dtypes), None, None, None, None, None)
    ds, ds2, dw = torch.ops.mfuwatch.add_rms_norm_backward(dy, dres, s, weight, rstd, ctx.offset, ctx.llama_cast,
                                                           ctx.n_dims, ctx.two_grads)
    return (*_grads(ds, ds2 if ctx.two_grads else None, *ctx.dtypes), (dw if weight is not None else None),
            None, None, None, None)


_add_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- what this kernel declares (kernels/_facts.py)

FACTS = KernelFacts(
    name="add_rms_norm",
    # bytes (E = rows x N, H = N): forward reads x, residual, w and writes y, the new residual: 4*E*b + H*wb;
    # backward reads s, dy, d(new residual), w and writes d(sum), dw: 4*E*b + 2*H*wb
    forward=Bytes(activations=4, weights=1), backward=Bytes(activations=4, weights=2),
    # FLOPs per element of x: as rms_norm plus the residual add (5; 4 without weight); backward as rms_norm
    # (9; 6 without weight), plus one add when the new residual has a gradient too
    flops={"forward": 5, "forward_no_weight": 4, "backward": 9, "backward_no_weight": 6,
           "backward_dres": 10, "backward_dres_no_weight": 7},
    exports=("add_rms_norm", "AddRMSNormFunction"),
    patch_note="add_rms_norm has no module pattern (the residual add is in the decoder layer's forward): call "
               "mfuwatch.kernels.add_rms_norm(x, residual, weight) in model code",
)


def _fwd_flops(x_shape, r_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return _flops.numel(x_shape) * FACTS.flops["forward" if w_shape is not None else "forward_no_weight"]


def _bwd_flops(dy_shape, dres_shape, s_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    case = "backward" + ("_dres" if dres_shape is not None else "") + ("" if w_shape is not None else "_no_weight")
    return _flops.numel(s_shape) * FACTS.flops[case]


_flops.register(torch.ops.mfuwatch.add_rms_norm, _fwd_flops)
_flops.register(torch.ops.mfuwatch.add_rms_norm_backward, _bwd_flops)


class AddRMSNormFunction(torch.autograd.Function):
    """``autograd.Function``: ``apply(x, residual, weight, eps, offset, llama_cast, n) -> (normed, new_residual)``.

    x, residual: (..., trailing dims of ``n`` elements in all), normalised over those ``n``
    elements; weight: ``n`` elements (any shape, e.g. the trailing dims) or None.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, llama_cast, n):
        y, s, _, rstd = K.norm_fwd(x, weight, None, residual, n, eps, offset, True, llama_cast)
        _save(ctx, x, residual, weight, s, rstd, offset, llama_cast, _two_grads(ctx, x, residual))
        ctx.n = n
        return y, s

    @staticmethod
    @first_order_only  # a clear error for double backward (the kernels have no second derivative)
    def backward(ctx, dy, dres):
        s, weight, rstd = ctx.saved_tensors
        if dy is None:
            if dres is None:
                return None, None, None, None, None, None, None
            return (*_grads(dres, None, *ctx.dtypes), None, None, None, None, None)
        ds, ds2, dw = _sum_grad(dy, dres, s, weight, rstd, ctx.offset, ctx.llama_cast, ctx.n, ctx.two_grads)
        return (*_grads(ds, ds2, *ctx.dtypes), dw, None, None, None, None)


def _two_grads(ctx, x: Tensor, residual: Tensor) -> bool:
    """Whether the backward should write the sum's gradient twice, once for ``x`` and once for ``residual``.

    Both inputs get the same gradient. Returned as one tensor for both, it costs nothing unless
    a leaf takes it: autograd's ``AccumulateGrad`` then copies a gradient that another input still
    holds (a read and a write of the whole tensor), which
    the kernel's second store (one write) replaces; and when both inputs are views of leaves (say
    ``a.view(...)`` and ``b.view(...)``), each leaf would take a view of that one tensor as its
    ``.grad``, so that zeroing one zeroed the other (PyTorch's own ``a.view(...) + b.view(...)``
    does that). So: True when both inputs need a gradient, one of them is a leaf or a view of one
    (a parameter-like input, or a block's input under reentrant activation checkpointing), and
    their dtypes agree (otherwise one gradient is a cast, already a new tensor).
    """
    return (ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and x.dtype == residual.dtype
            and (_leaf_or_view_of_leaf(x) or _leaf_or_view_of_leaf(residual)))


def _leaf_or_view_of_leaf(t: Tensor) -> bool:
    """``t`` (which requires grad) is a leaf, or a view whose base is one."""
    return t.grad_fn is None or (t._base is not None and t._base.grad_fn is None)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6,
                 offset: float = 0.0, *, casting: str = "auto") -> Tuple[Tensor, Tensor]:
    """Fused ``h = x + residual; return rms_norm(h, weight, eps, offset), h``.

    Args:
        x, residual: (..., N), same shape, fp32/fp16/bf16 (may differ; the sum
            takes the promoted dtype), any strides.
        weight: (N,) or None. eps, offset, casting: as :func:`~mfuwatch.kernels.rms_norm`.
    Returns:
        ``(normed, new_residual)``, both shaped like ``x`` and contiguous.
    Raises:
        ValueError: shapes differ (both printed), weight not shaped (N,), a 0-d ``x``, unknown casting.
    """
    llama = resolve_casting(casting, offset)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
    check_rms_inputs(x, weight)
    return add_rms_norm_trailing(x, residual, weight, float(eps), float(offset), llama, 1)


def add_rms_norm_trailing(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, offset: float,
                          llama: bool, n_dims: int) -> Tuple[Tensor, Tensor]:
    """:func:`add_rms_norm` over the trailing ``n_dims`` dims of ``x`` (``RMSNorm`` with a multi-dim
    ``normalized_shape``), on ``x`` and ``residual`` as given: no reshape, so that autograd sees the
    caller's tensors (a leaf stays a leaf, see :func:`_two_grads`).

    x, residual: the same shape, at least ``n_dims`` dims; weight: None or ``n`` elements, ``n`` the
    product of the trailing sizes (e.g. shaped like those dims). Shapes are the caller's to check.
    """
    n = _width(x, n_dims)
    if n == 0:  # nothing to normalise: empty results, autograd-linked
        h = x + residual
        return empty_width_norm(h, weight, offset, llama), h
    if compile_decomposes():  # Inductor fuses the written-out add and norm with their neighbours
        return K.norm_reference(x, weight, None, residual, n, eps, offset, True, llama)
    if use_custom_op(x, residual, weight):
        y, s, _ = torch.ops.mfuwatch.add_rms_norm(x, residual, weight, eps, offset, llama, n_dims)
        return y, s
    if not needs_grad(x, residual, weight):
        y, s, _, _ = K.norm_fwd(x, weight, None, residual, n, eps, offset, True, llama)
        return y, s
    return AddRMSNormFunction.apply(x, residual, weight, eps, offset, llama, n)
