"""How a fused op's call is dispatched: the eager fast path (a plain ``autograd.Function``, or the launcher
itself when no autograd history is recorded), the registered ``torch.ops.mfuwatch`` custom op (under
``torch.compile``, dispatch modes and tensor subclasses), or the op written out in PyTorch ops for Inductor;
and :func:`first_order_only`, the decorator every fused backward wears.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch.autograd import forward_ad as _forward_ad

from ._env import env_flag

#: Under ``torch.compile``, hand Inductor the ops it fuses itself (norms, GLUs, rotary) as PyTorch ops instead of
#: the custom ops (``MFUWATCH_KERNELS_COMPILE_DECOMPOSE=0`` keeps the Triton kernels inside compiled graphs).
COMPILE_DECOMPOSE = env_flag("MFUWATCH_KERNELS_COMPILE_DECOMPOSE", True)


def compile_decomposes() -> bool:
    """Whether a fused op should be written out in PyTorch ops here: while ``torch.compile`` traces (and
    :data:`COMPILE_DECOMPOSE` is on).

    A custom op is opaque to Inductor, which then cannot fuse the op with its neighbours (the cast before a
    norm, the residual add, the projection's epilogue); the written-out form lets it, and computes as the
    kernels do (fp32 math, one rounding per output). ``FlopCounterMode`` and tensor subclasses outside
    ``torch.compile`` still take the custom ops (:func:`use_custom_op`).
    """
    return COMPILE_DECOMPOSE and torch.compiler.is_compiling()


def use_custom_op(*tensors) -> bool:
    """Whether a call must go through the registered ``torch.ops.mfuwatch`` op.

    True while ``torch.compile`` traces, while a ``TorchDispatchMode`` such as
    ``FlopCounterMode`` or ``FakeTensorMode`` is active, or when an input is a
    tensor subclass (DTensor, FakeTensor, ...); those need the dispatcher to
    see the op. Otherwise the eager fast path (a plain ``autograd.Function``,
    about 10-30 microseconds less Python per call) is taken: same launchers,
    same results.
    """
    if torch.compiler.is_compiling():
        return True
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return True
    return False


def needs_grad(a: torch.Tensor, b: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None) -> bool:
    """Whether a call records autograd history: grad mode on and an input that requires grad, or a forward-mode
    AD level open (``torch.autograd.forward_ad.dual_level``).

    When it does not (inference, ``torch.no_grad()``, evaluation, frozen inputs), the functionals call the
    launcher directly and skip the ``autograd.Function`` and its host time; the outputs are the same tensors
    either way. Under
    forward-mode AD they take the ``autograd.Function``, which raises PyTorch's "implement the jvp" error
    for a dual input: the direct launch would return a result without its tangent.
    """
    return (torch.is_grad_enabled() and (a.requires_grad or (b is not None and b.requires_grad)
                                         or (c is not None and c.requires_grad))) or _forward_ad._current_level >= 0


def first_order_only(backward: Callable) -> Callable:
    """Decorator for the ``backward`` of the fused ops' ``autograd.Function``: differentiable once, and a clear
    error when differentiated twice.

    The kernels have no second derivative. Like ``torch.autograd.function.once_differentiable``, the
    backward runs without grad mode and, when the caller asked for a graph (``create_graph=True``), its
    results are marked so that differentiating them raises "differentiate twice". Torch's decorator
    marks them only when an incoming gradient requires grad; ours also does when a saved input does
    (``x``, the weight). Without that, ``grad(y.sum(), x, create_graph=True)`` returned a gradient that
    silently counted as a constant in a later backward. The error node's graph edges also lead to
    the tensors it was marked for (the gradients and saved inputs that require grad): torch's node
    leads only to detached copies of the results, so a second ``torch.autograd.grad(..., inputs=[x])``
    (or ``backward(inputs=...)``), which runs only the nodes on a path to ``x``, skipped it and
    silently dropped the op's second-order term.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():  # the usual backward (no create_graph): nothing more to do
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        links = [t for t in (*grads, *ctx.saved_tensors) if t is not None and t.requires_grad]
        if not links:
            return outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        err = torch._C._functions.DelayedError(
            b"mfuwatch.kernels: trying to differentiate twice an op whose fused kernels are differentiable once "
            b"(use the PyTorch op for higher-order gradients)", len(outs) + len(links))

        def marked(t):
            if t is None:
                return None
            t = t.detach()
            t.requires_grad = True
            return t
        # the error node's outputs alias its inputs: the first len(outs) are the results; the rest, aliases of
        # the links, are dropped (they exist so that the node has graph edges to the links)
        return tuple(err(*[marked(t) for t in outs], *links)[:len(outs)])

    return wrapper
