"""Fused LayerNorm: functional ``layer_norm``, ``LayerNormFunction``, the ``LayerNorm`` module, and the
``torch.ops.mfuwatch.layer_norm`` / ``layer_norm_backward`` custom ops.

LayerNorm (Ba, Kiros & Hinton 2016) over the trailing ``normalized_shape``::

    y = (x - mean(x)) / sqrt(var(x) + eps) * w + b      (biased variance, as torch)

Statistics in fp32 (mean first, then the centred variance, so large offsets
do not cancel), output in ``x``'s dtype, as ``torch.nn.functional.layer_norm``.
Under ``torch.autocast`` torch upcasts LayerNorm inputs to fp32; the fused op
does not (it would cost a copy): it computes in fp32 and returns ``x``'s dtype.
"""

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import _flops
from . import _norm_launch as K
from ._facts import Bytes, KernelFacts, Remedy, Step, aten, patch_line
from ._dispatch import compile_decomposes, first_order_only, needs_grad, use_custom_op
from ._norm_common import empty_width_norm
from ._patch_types import Candidate


def _numel(x: Tensor, n_dims: int) -> int:
    n = 1
    for d in x.shape[x.dim() - n_dims:]:
        n *= d
    return n


@torch.library.custom_op("mfuwatch::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], n_dims: int,
                   eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    y, _, mean, rstd = K.norm_fwd(x, weight, bias, None, _numel(x, n_dims), eps, 0.0, False, False)
    stat_shape = x.shape[: x.dim() - n_dims]
    return y, mean.view(stat_shape), rstd.view(stat_shape)


@_layer_norm_op.register_fake
def _(x, weight, bias, n_dims, eps):
    stat_shape = x.shape[: x.dim() - n_dims]
    return (x.new_empty(x.shape), x.new_empty(stat_shape, dtype=torch.float32),
            x.new_empty(stat_shape, dtype=torch.float32))


@torch.library.custom_op("mfuwatch::layer_norm_backward", mutates_args=())
def _layer_norm_bwd_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                       rstd: Tensor, n_dims: int) -> Tuple[Tensor, Tensor, Tensor]:
    # bias: only its presence and dtype are used (db is written in the bias's dtype)
    dx, dw, db = K.norm_bwd(dy, x, weight, bias is not None, mean.reshape(-1), rstd.reshape(-1), None,
                            _numel(x, n_dims), 0.0, False, False, bias.dtype if bias is not None else None)
    empty = x.new_empty(0)
    db = db.view(x.shape[x.dim() - n_dims:]) if db is not None else empty.clone()
    return dx, (dw if dw is not None else empty), db


@_layer_norm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd, n_dims):
    dw = weight.new_empty(weight.shape) if weight is not None else x.new_empty(0)
    db = bias.new_empty(x.shape[x.dim() - n_dims:]) if bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, n_dims, _eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.n_dims, ctx.has_bias = n_dims, bias is not None
    ctx.bias_shape = tuple(bias.shape) if bias is not None else None


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.mfuwatch.layer_norm_backward(dy, x, weight, bias, mean, rstd, ctx.n_dims)
    return (dx, dw if weight is not None else None, db.view(ctx.bias_shape) if ctx.has_bias else None,
            None, None)


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- what this kernel declares (kernels/_facts.py)

FACTS = KernelFacts(
    name="layer_norm",
    # bytes (E = rows x N, H = N): forward reads x, w, b and writes y: 2*E*b + 2*H*wb; backward reads x, dy,
    # w, b and writes dx, dw, db: 3*E*b + 4*H*wb
    forward=Bytes(activations=2, weights=2), backward=Bytes(activations=3, weights=4),
    # FLOPs per element of x: forward sum, s-mu, (.)^2 and sum (2), *rstd, *w, +b: 7 (6 without bias or without
    # weight, 5 without both); backward xhat (2), g = dy*w, sum(g), sum(g*xhat) (2), (g - c2 - xhat*c1)*rstd (4),
    # dw (2), db (1): 13 (12 without bias, 10 without weight, 9 without both)
    flops={"forward": 7, "forward_no_bias": 6, "forward_no_weight": 6, "forward_no_weight_no_bias": 5,
           "backward": 13, "backward_no_bias": 12, "backward_no_weight": 10, "backward_no_weight_no_bias": 9},
    remedy=Remedy(
        kernel="layer_norm", kind="bundled",
        title="Fused LayerNorm (Triton drop-in) for aten::native_layer_norm",
        apply=patch_line("layer_norm"),
        replaces="layer_norm / native_layer_norm",
        sequence=(Step(aten("layer_norm", "native_layer_norm")),), anchor_arg=0,
    ),
    exports=("layer_norm", "LayerNorm", "LayerNormFunction"),
    patch=".layer_norm",
)


def _case(direction: str, w_shape, b_shape) -> str:
    return direction + ("" if w_shape is not None else "_no_weight") + ("" if b_shape is not None else "_no_bias")


def _fwd_flops(x_shape, w_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return _flops.numel(x_shape) * FACTS.flops[_case("forward", w_shape, b_shape)]


def _bwd_flops(dy_shape, x_shape, w_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return _flops.numel(x_shape) * FACTS.flops[_case("backward", w_shape, b_shape)]


_flops.register(torch.ops.mfuwatch.layer_norm, _fwd_flops)
_flops.register(torch.ops.mfuwatch.layer_norm_backward, _bwd_flops)


class LayerNormFunction(torch.autograd.Function):
    """``autograd.Function``: ``apply(x, weight, bias, n_dims, eps) -> y``, normalising the last ``n_dims`` dims."""

    @staticmethod
    def forward(ctx, x, weight, bias, n_dims, eps):
        y, _, mean, rstd = K.norm_fwd(x, weight, bias, None, _numel(x, n_dims), eps, 0.0, False, False)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.n_dims, ctx.has_bias = n_dims, bias is not None
        ctx.bias_shape = tuple(bias.shape) if bias is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    @first_order_only  # a clear error for double backward (the kernels have no second derivative)
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = K.norm_bwd(dy, x, weight, ctx.has_bias, mean, rstd, None, _numel(x, ctx.n_dims), 0.0,
                                False, False, ctx.bias_dtype)
        return (dx, dw, db.view(ctx.bias_shape) if db is not None else None, None, None)


def layer_norm(x: Tensor, normalized_shape: Union[int, Sequence[int]], weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """Fused LayerNorm, arguments in ``torch.nn.functional.layer_norm``'s order.

    Args:
        x: (..., *normalized_shape), fp32/fp16/bf16, any strides.
        normalized_shape: the trailing dims to normalise over (int or sequence).
        weight, bias: shaped ``normalized_shape``, or None.
        eps: added to the variance.
    Returns:
        Tensor shaped like ``x``, contiguous, in ``x``'s dtype.
    Raises:
        ValueError: ``x`` does not end with ``normalized_shape``, or a
        weight/bias not shaped ``normalized_shape`` (the shapes are printed).
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    n_dims = len(normalized_shape)
    if n_dims == 0 or tuple(x.shape[x.dim() - n_dims:]) != tuple(normalized_shape) or x.dim() < n_dims:
        raise ValueError(f"input shape {tuple(x.shape)} does not end with normalized_shape "
                         f"{tuple(normalized_shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != tuple(normalized_shape):
            raise ValueError(f"{name} shape {tuple(p.shape)} != normalized_shape {tuple(normalized_shape)}")
    if _numel(x, n_dims) == 0:  # nothing to normalise (F.layer_norm would refuse dtype mixes we accept)
        return empty_width_norm(x, weight, 0.0, False, bias)
    if compile_decomposes():  # Inductor fuses the written-out norm with its neighbours
        return K.norm_reference(x, weight, bias, None, _numel(x, n_dims), float(eps), 0.0, False, False)[0]
    if use_custom_op(x, weight, bias):
        return torch.ops.mfuwatch.layer_norm(x, weight, bias, n_dims, float(eps))[0]
    if not needs_grad(x, weight, bias):
        return K.norm_fwd(x, weight, bias, None, _numel(x, n_dims), float(eps), 0.0, False, False)[0]
    return LayerNormFunction.apply(x, weight, bias, n_dims, float(eps))


class LayerNorm(nn.Module):
    """Drop-in ``torch.nn.LayerNorm`` on the fused kernels.

    Same constructor (``normalized_shape, eps=1e-5, elementwise_affine=True,
    bias=True, device=None, dtype=None``), parameters (``weight`` ones,
    ``bias`` zeros, shaped ``normalized_shape``) and ``state_dict``.
    """

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones, bias to zeros (as ``torch.nn.LayerNorm``)."""
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


# ---------------------------------------------------------------- patch rule (kernels/_patch_types.py)

def swap_candidate(m: nn.Module) -> Optional[Candidate]:
    """``torch.nn.LayerNorm`` (and subclasses): a :class:`LayerNorm` sharing its parameters; None otherwise."""
    if not isinstance(m, nn.LayerNorm):
        return None

    def build():
        new = LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, bias=m.bias is not None, device="meta")
        if m.weight is not None:
            new.weight = m.weight
        if m.bias is not None:
            new.bias = m.bias
        return new
    return Candidate("layer_norm", [build], probe_shape=(4, *m.normalized_shape))
