"""Fused gated activations and the gated MLPs built on them.

* ``swiglu(gate, up) = silu(gate) * up`` (Llama, Mistral, Qwen MLPs);
* ``geglu(gate, up, approximate="none"|"tanh") = gelu(gate) * up`` (Gemma; T5 v1.1 computes the same);
* ``SwiGLUMLP`` / ``GeGLUMLP``: ``down_proj(act(gate_proj(x)) * up_proj(x))``,
  with the parameter names and ``state_dict`` of Hugging Face's ``LlamaMLP``.

Kernels and the math are in :mod:`._glu_triton`; dispatch (eager fast path vs.
the ``torch.ops.mfuwatch.swiglu``/``geglu`` custom ops under ``torch.compile``
and dispatch modes) as in :mod:`.rms_norm`.
"""

from typing import Tuple

import torch
from torch import Tensor, nn

from . import _flops
from . import _glu_triton as K
from ._dispatch import compile_decomposes, first_order_only, needs_grad, use_custom_op

_APPROX = {"none": "gelu", "tanh": "gelu_tanh"}


def _gelu_kind(approximate: str) -> str:
    kind = _APPROX.get(approximate)
    if kind is None:
        raise ValueError(f"approximate={approximate!r}: expected one of {sorted(_APPROX)}")
    return kind


# ---------------------------------------------------------------- custom ops

@torch.library.custom_op("mfuwatch::swiglu", mutates_args=())
def _swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    return K.glu_fwd(gate, up, "silu")


@torch.library.custom_op("mfuwatch::swiglu_backward", mutates_args=())
def _swiglu_bwd_op(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    return K.glu_bwd(dy, gate, up, "silu")


@torch.library.custom_op("mfuwatch::geglu", mutates_args=())
def _geglu_op(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    return K.glu_fwd(gate, up, _gelu_kind(approximate))


@torch.library.custom_op("mfuwatch::geglu_backward", mutates_args=())
def _geglu_bwd_op(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    return K.glu_bwd(dy, gate, up, _gelu_kind(approximate))


@_swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@_geglu_op.register_fake
def _(gate, up, approximate):
    return gate.new_empty(gate.shape)


@_swiglu_bwd_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@_geglu_bwd_op.register_fake
def _(dy, gate, up, approximate):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2] if len(inputs) > 2 else None


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.mfuwatch.swiglu_backward(dy, gate, up)


def _geglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.mfuwatch.geglu_backward(dy, gate, up, ctx.approximate)
    return dg, du, None


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_setup_context)
_geglu_op.register_autograd(_geglu_backward, setup_context=_setup_context)

_flops.register(torch.ops.mfuwatch.swiglu,
                lambda g, u, out_shape=None, **kw: _flops.numel(g) * _flops.GLU_FWD["silu"])
_flops.register(torch.ops.mfuwatch.swiglu_backward,
                lambda dy, g, u, out_shape=None, **kw: _flops.numel(g) * _flops.GLU_BWD["silu"])
_flops.register(torch.ops.mfuwatch.geglu,
                lambda g, u, a, out_shape=None, **kw: _flops.numel(g) * _flops.GLU_FWD[_gelu_kind(a)])
_flops.register(torch.ops.mfuwatch.geglu_backward,
                lambda dy, g, u, a, out_shape=None, **kw: _flops.numel(g) * _flops.GLU_BWD[_gelu_kind(a)])


# ---------------------------------------------------------------- eager fast path

class GLUFunction(torch.autograd.Function):
    """``autograd.Function``: ``apply(gate, up, activation) -> act(gate) * up``.

    activation: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``. Saves ``gate`` and
    ``up``; the backward recomputes the activation (no extra tensor kept).
    """

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return K.glu_fwd(gate, up, activation)

    @staticmethod
    @first_order_only  # a clear error for double backward (the kernels have no second derivative)
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = K.glu_bwd(dy, gate, up, ctx.activation)
        return dg, du, None


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``, fused (one read of each input, one write).

    Args:
        gate, up: same shape, dtype (fp32/fp16/bf16) and device; any strides
            (the halves of ``h.chunk(2, -1)`` are read in place).
    Returns:
        Contiguous tensor shaped like ``gate``, in its dtype (computed in fp32,
        rounded once).
    Raises:
        ValueError: shapes, dtypes or devices differ (both values printed).
    """
    if compile_decomposes():  # Inductor fuses the written-out activation with its neighbours
        return K.reference(gate, up, "silu")
    if use_custom_op(gate, up):
        return torch.ops.mfuwatch.swiglu(gate, up)
    if not needs_grad(gate, up):
        return K.glu_fwd(gate, up, "silu")
    return GLUFunction.apply(gate, up, "silu")


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(gate, approximate) * up``, fused; ``approximate`` as in ``torch.nn.functional.gelu``.

    Arguments, result and errors as :func:`swiglu`; also ValueError for an
    ``approximate`` other than ``"none"`` or ``"tanh"``.
    """
    kind = _gelu_kind(approximate)
    if compile_decomposes():  # Inductor fuses the written-out activation with its neighbours
        return K.reference(gate, up, kind)
    if use_custom_op(gate, up):
        return torch.ops.mfuwatch.geglu(gate, up, approximate)
    if not needs_grad(gate, up):
        return K.glu_fwd(gate, up, kind)
    return GLUFunction.apply(gate, up, kind)


# ---------------------------------------------------------------- modules

class _GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_linears(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, **kwargs):
        """Build around existing projections: their modules and parameters are shared, not copied."""
        new = cls(gate_proj.in_features, gate_proj.out_features, bias=False, device="meta", **kwargs)
        new.gate_proj, new.up_proj, new.down_proj = gate_proj, up_proj, down_proj
        return new

    def _act(self, gate: Tensor, up: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))


class SwiGLUMLP(_GatedMLP):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the fused :func:`swiglu`.

    Args: ``hidden_size``, ``intermediate_size``, ``bias`` (default False, as
    Llama), ``device``, ``dtype``. Parameters ``gate_proj.weight``
    (intermediate, hidden), ``up_proj.weight`` (intermediate, hidden),
    ``down_proj.weight`` (hidden, intermediate) (+ biases): the ``state_dict``
    of Hugging Face's ``LlamaMLP``/``MistralMLP``/``Qwen2MLP``.
    """

    def _act(self, gate: Tensor, up: Tensor) -> Tensor:
        return swiglu(gate, up)


class GeGLUMLP(_GatedMLP):
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))`` with the fused :func:`geglu`.

    Arguments as :class:`SwiGLUMLP`, plus keyword ``approximate`` (``"none"``
    or ``"tanh"``; Gemma uses ``"tanh"``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None,
                 dtype=None, *, approximate: str = "none") -> None:
        super().__init__(hidden_size, intermediate_size, bias, device, dtype)
        _gelu_kind(approximate)
        self.approximate = approximate

    def _act(self, gate: Tensor, up: Tensor) -> Tensor:
        return geglu(gate, up, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
