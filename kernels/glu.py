"""Fused gated activations and the gated MLPs built on them.

* ``swiglu(gate, up) = silu(gate) * up`` (Llama, Mistral, Qwen MLPs);
* ``geglu(gate, up, approximate="none"|"tanh") = gelu(gate) * up`` (Gemma; T5 v1.1 computes the same);
* ``SwiGLUMLP`` / ``GeGLUMLP``: ``down_proj(act(gate_proj(x)) * up_proj(x))``,
  with the parameter names and ``state_dict`` of Hugging Face's ``LlamaMLP``.

Kernels and the math are in :mod:`._glu_triton`; dispatch (eager fast path vs.
the ``torch.ops.mfuwatch.swiglu``/``geglu`` custom ops under ``torch.compile``
and dispatch modes) as in :mod:`.rms_norm`.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from . import _flops
from . import _glu_triton as K
from ._facts import Bytes, KernelFacts, Remedy, Step, aten, patch_line
from ._dispatch import compile_decomposes, first_order_only, needs_grad, use_custom_op
from ._patch_types import Candidate

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

# ---------------------------------------------------------------- what these kernels declare (kernels/_facts.py)

FACTS = (
    KernelFacts(
        name="swiglu",
        # bytes (E = rows x the intermediate size): forward reads gate, up and writes y: 3*E*b; backward reads
        # gate, up, dy and writes dgate, dup: 5*E*b
        forward=Bytes(activations=3), backward=Bytes(activations=5),
        # FLOPs per element of gate: forward sigmoid (exp, add, divide: 3), *g, *u: 5; backward sigmoid (3),
        # a = g*s, s*(1 + g*(1 - s)) (4), dy*a, dy*u*da (2): 11
        flops={"forward": 5, "backward": 11},
        remedy=Remedy(
            kernel="swiglu", kind="bundled",
            title="Fused SwiGLU (Triton drop-in): silu(gate) * up in one kernel",
            apply=patch_line("swiglu"),
            replaces="silu → [up projection] → mul",
            sequence=(Step(aten("silu")), Step(aten("mul"), gap=2)), anchor_arg=0,
            note="bytes from mfuwatch.kernels.traffic: forward reads gate and up, writes h; backward reads dh, "
                 "gate, up and writes dgate, dup",
        ),
        exports=("swiglu", "SwiGLUMLP", "GLUFunction"),
        patch=".glu",
    ),
    KernelFacts(
        name="geglu",
        forward=Bytes(activations=3), backward=Bytes(activations=5),  # as swiglu
        # FLOPs per element of gate, exact GELU: forward Phi = 0.5*(1 + erf(g/sqrt2)) (4), *g, *u: 6; backward
        # Phi (4), a, the density g*exp(-g^2/2)/sqrt(2pi) (5), +Phi, dy*a, dy*u*da (2): 14. Tanh GELU: forward
        # g^3 (2), *0.044715, +g, *sqrt(2/pi), tanh, 1 + t, *0.5, *g, *u: 10; backward t as above (6),
        # a = 0.5*g*(1 + t) (3), da (11), dy*a, dy*u*da (2): 23
        flops={"forward": 6, "backward": 14, "forward_tanh": 10, "backward_tanh": 23},
        remedy=Remedy(
            kernel="geglu", kind="bundled",
            title="Fused GEGLU (Triton drop-in): gelu(gate) * up in one kernel",
            apply=patch_line("geglu"),
            replaces="gelu → [up projection] → mul",
            sequence=(Step(aten("gelu")), Step(aten("mul"), gap=2)), anchor_arg=0,
        ),
        exports=("geglu", "GeGLUMLP"),
        patch=".glu",
    ),
)
_SWIGLU, _GEGLU = FACTS
_GELU_CASE = {"none": "", "tanh": "_tanh"}


def _geglu_flops(direction: str, approximate: str) -> int:
    _gelu_kind(approximate)  # a ValueError for an unknown approximation
    return _GEGLU.flops[direction + _GELU_CASE[approximate]]


_flops.register(torch.ops.mfuwatch.swiglu,
                lambda g, u, out_shape=None, **kw: _flops.numel(g) * _SWIGLU.flops["forward"])
_flops.register(torch.ops.mfuwatch.swiglu_backward,
                lambda dy, g, u, out_shape=None, **kw: _flops.numel(g) * _SWIGLU.flops["backward"])
_flops.register(torch.ops.mfuwatch.geglu,
                lambda g, u, a, out_shape=None, **kw: _flops.numel(g) * _geglu_flops("forward", a))
_flops.register(torch.ops.mfuwatch.geglu_backward,
                lambda dy, g, u, a, out_shape=None, **kw: _flops.numel(g) * _geglu_flops("backward", a))


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


class GLUDownFunction(torch.autograd.Function):
    """``autograd.Function``: ``apply(gate, up, weight, bias, activation) -> linear(act(gate) * up, weight, bias)``
    that keeps ``gate`` and ``up`` but not their product ``h`` (the down projection's input).

    gate, up: (..., I), same dtype (the GEMM's), contiguous or not; weight (O, I) and bias (O,) or None, in
    that dtype or cast to it (an fp32 master weight under autocast; the cast copy is kept for the backward, as
    ``F.linear`` under autocast keeps it). Returns (..., O) in gate's dtype. The backward forms ``h`` again in
    the launch that computes the activation's gradient (``glu_bwd(..., want_y=True)``, one more write of h),
    then ``dweight = dy^T h``: the unfused MLP keeps ``h`` from the forward to the backward as well as gate and
    up, so this saves ``h``'s bytes per layer (88 MiB per Llama layer at 8192 tokens x 5632) for one extra
    write of them in the backward. Gradients: gate, up (gate's dtype), weight and bias (their own dtypes).
    """

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation):
        dt = gate.dtype
        w = weight if weight.dtype == dt else weight.to(dt)
        b = bias if bias is None or bias.dtype == dt else bias.to(dt)
        with torch.autocast(gate.device.type, enabled=False):
            y = torch.nn.functional.linear(K.glu_fwd(gate, up, activation), w, b)
        ctx.save_for_backward(gate, up, w)
        ctx.activation, ctx.has_bias = activation, bias is not None
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        gate, up, w = ctx.saved_tensors
        rows, i = math.prod(gate.shape[:-1]), gate.shape[-1]  # explicit: a 0 hidden or intermediate size
        d2 = dy.to(w.dtype).reshape(rows, dy.shape[-1])
        dh = (d2 @ w).view(gate.shape)
        dg, du, h = K.glu_bwd(dh, gate, up, ctx.activation, want_y=True)
        del dh
        dw = (d2.t() @ h.view(rows, i)).to(ctx.dtypes[0]) if ctx.needs_input_grad[2] else None
        # the bias gradient summed in the GEMM's dtype, as F.linear's backward sums it (bit for bit the unfused MLP)
        db = d2.sum(0).to(ctx.dtypes[1]) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dg, du, dw, db, None


#: Whether the patched gated MLPs (:class:`SwiGLUMLP`, :class:`GeGLUMLP`) keep gate and up but not their product
#: ``h`` (the down projection's input) for the backward. True by default. In eager training they run the
#: activation and the down projection as one :class:`GLUDownFunction`, where that cannot change what runs
#: otherwise: ``down_proj`` a plain ``nn.Linear`` without hooks and with PyTorch's own ``forward`` (not replaced
#: on the instance, as accelerate's hooks do, nor on the class), no global module hooks, not under a dispatch
#: mode (that takes the custom ops), and autocast (if on) computing in gate's dtype. Under ``torch.compile``
#: the activation is traced inside a non-reentrant ``torch.utils.checkpoint`` region, so that AOTAutograd's
#: partitioner recomputes ``h`` in the backward from the saved gate and up (any ``down_proj``, hooks
#: included). Set False for the unfused form everywhere.
RECOMPUTE_DOWN_INPUT = True


_LINEAR_FORWARD = torch.nn.modules.linear.Linear.forward  # PyTorch's, unless replaced before this import
if getattr(_LINEAR_FORWARD, "__module__", "") != "torch.nn.modules.linear":
    _LINEAR_FORWARD = None  # replaced already: the fused form never applies


def _fused_down_ok(down: nn.Module, gate: Tensor, up: Tensor) -> bool:
    """Whether :class:`GLUDownFunction` may replace ``down(act(gate, up))`` (:data:`RECOMPUTE_DOWN_INPUT`)."""
    if not RECOMPUTE_DOWN_INPUT or type(down) is not nn.Linear or "forward" in down.__dict__ \
            or nn.Linear.forward is not _LINEAR_FORWARD:
        return False  # a subclass, or a forward replaced on the instance (accelerate's hooks) or on the class
    if down._forward_hooks or down._forward_pre_hooks or down._backward_hooks or down._backward_pre_hooks:
        return False
    mm = nn.modules.module
    if mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks \
            or mm._global_backward_pre_hooks:
        return False
    w = down.weight
    if not needs_grad(gate, up, w) or compile_decomposes() or use_custom_op(gate, up, w):
        return False
    if gate.dtype != up.dtype or gate.device != w.device or gate.shape != up.shape:
        return False  # the unfused path raises or promotes as PyTorch would
    dev = gate.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev) == gate.dtype
    return w.dtype == gate.dtype and (down.bias is None or down.bias.dtype == gate.dtype)


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

    def _kind(self) -> str:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if _fused_down_ok(self.down_proj, gate, up):  # act + down projection without keeping their input
            return GLUDownFunction.apply(gate, up, self.down_proj.weight, self.down_proj.bias, self._kind())
        if RECOMPUTE_DOWN_INPUT and torch.compiler.is_compiling() and needs_grad(gate, up):
            # the activation as a checkpointed region: AOTAutograd's partitioner then forms h again in the
            # backward instead of keeping it (docs/benchmarks.md, issue 27 run 12: same step time on the H200)
            return self.down_proj(_checkpoint(self._act, gate, up, use_reentrant=False))
        return self.down_proj(self._act(gate, up))


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

    def _kind(self) -> str:
        return "silu"


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

    def _kind(self) -> str:
        return _gelu_kind(self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# ---------------------------------------------------------------- patch rule (kernels/_patch_types.py)

#: Kernel label of a gated MLP that neither GLU kernel can take (an activation other than SiLU or GELU): it is
#: reported as left whenever either GLU kernel is requested.
ANY_GLU = "swiglu or geglu"
_ACT_ATTRS = ("act_fn", "act", "activation_fn", "activation")
_GELU_TANH_NAMES = ("PytorchGELUTanh", "GELUTanh", "NewGELUActivation", "GELUPytorchTanh", "GeluTanh")


def _glu_of(act) -> Tuple[str, Optional[str], str]:
    """(kernel, GELU approximation or None, "") for an activation a GLU kernel computes, else (ANY_GLU, None,
    reason). ``act`` is a module (``nn.SiLU``, ``nn.GELU``, Hugging Face's activation classes) or a function
    (``torch.nn.functional.silu`` / ``gelu``)."""
    import torch.nn.functional as F

    if act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU", "Swish"):
        return "swiglu", None, ""
    if act is F.gelu:
        return "geglu", "none", ""
    if isinstance(act, nn.GELU):
        return "geglu", getattr(act, "approximate", "none"), ""
    name = type(act).__name__
    if name in _GELU_TANH_NAMES:
        return "geglu", "tanh", ""
    if name == "GELUActivation":
        return "geglu", "none", ""
    label = getattr(act, "__name__", None) if callable(act) and not isinstance(act, nn.Module) else None
    return ANY_GLU, None, f"activation {label or name} has no fused kernel"


def swap_candidate(m: nn.Module) -> Optional[Candidate]:
    """A gated MLP: ``gate_proj``/``up_proj``/``down_proj`` ``nn.Linear`` children and a SiLU (``swiglu``) or
    GELU (``geglu``, exact or tanh) activation attribute; None for other modules.

    The activation decides the kernel; an activation without one is the reason reported, before any
    other (e.g. a dropout submodule), so that the report names the real blocker.
    """
    if not all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")):
        return None
    both = ("swiglu", "geglu")
    act = next((getattr(m, a) for a in _ACT_ATTRS if getattr(m, a, None) is not None), None)
    if act is None:
        return Candidate(ANY_GLU, None, f"no activation attribute among {_ACT_ATTRS}", requested_by=both)
    kind, approx, reason = _glu_of(act)
    if reason:
        return Candidate(kind, None, reason, requested_by=both if kind == ANY_GLU else ())
    g, u, d = m.gate_proj, m.up_proj, m.down_proj
    act_attr = next(a for a in _ACT_ATTRS if getattr(m, a, None) is act)
    extra = [n for n, _c in m.named_children() if n not in ("gate_proj", "up_proj", "down_proj", act_attr)]
    if extra:  # e.g. a dropout: identity in eval mode, so the probe would pass, and lost after .train()
        return Candidate(kind, None, f"it has submodules the fused MLP would drop: {', '.join(extra)}")
    shape = (4, g.in_features)
    if kind == "swiglu":
        return Candidate("swiglu", [lambda: SwiGLUMLP.from_linears(g, u, d)], probe_shape=shape)
    return Candidate("geglu", [lambda: GeGLUMLP.from_linears(g, u, d, approximate=approx)], probe_shape=shape)
