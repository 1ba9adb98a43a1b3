"""FLOP counts of the fused ops, as registered with ``torch.utils.flop_counter``.

``FlopCounterMode`` (which the mfuwatch agent uses to count a model's FLOPs)
only knows the formulas registered for an op; an op without one counts as
zero. The fused ops register their counts, per element of the input
(``rows x N``; for the GLUs, per element of ``gate``; for rotary, per rotated element).

Convention (ours, stated so that the numbers can be checked by hand): every
add, subtract, multiply, divide and every special function (exp, erf, tanh,
rsqrt) is one FLOP; a sum over a row costs one add per element; per-row
scalars (the rsqrt of the variance, the means) and anything done once per
column (``w + offset``) are left out. Each op declares its counts per element,
with their derivation, in its module's ``FACTS`` (``flops``, :mod:`._facts`), and
its formulas (registered here with :func:`register`) multiply them by the
element count; e.g. ``rms_norm`` forward: s^2, sum, *rstd, *w = 4 per element.

Linear + cross-entropy (``hidden`` (N, H), ``weight`` (V, H)): the three GEMMs count ``2 N H V`` each
(logits, dhidden, dweight), plus the cross-entropy FLOPs of the ``N x V`` logits and ``N x V`` for the
bias gradient when there is a bias. Its forward op counts the logits GEMM, and the two gradient GEMMs
when it forms the gradients in the forward (``reduction`` "mean"/"sum"); the ``reduction="none"``
backward op recomputes the logits, but counts only the two gradient GEMMs, as model FLOPs exclude
recomputation (PaLM appendix B).

These elementwise FLOPs are tiny next to a model's matmuls (for a
Llama-style block about 1e-4 of the total), so patching a model does not move
its MFU; PyTorch's own counter assigns the unfused norms and activations zero.
"""

from __future__ import annotations

import math
from typing import Callable


def numel(shape) -> int:
    """Number of elements of a shape tuple."""
    return int(math.prod(shape))


def register(op_packet, formula: Callable) -> None:
    """Register ``formula(*arg_shapes, out_shape=..., **kwargs) -> FLOPs`` for a ``torch.ops`` packet.

    Tensor arguments reach the formula as shape tuples (``torch.utils.flop_counter``
    converts them); registering twice (a module reload) is a no-op.
    """
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if op_packet not in flop_registry:
        register_flop_formula(op_packet)(formula)
    _add_to_active_counters(op_packet, flop_registry[op_packet])


def _add_to_active_counters(op_packet, wrapped: Callable) -> None:
    """Give the formula to ``FlopCounterMode`` instances that are already counting.

    A counter copies the registry when it is created, so an op module first
    imported inside ``with FlopCounterMode():`` (``mfuwatch.kernels`` loads its
    ops on first use) would otherwise count as zero until the next counter.
    """
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        modes = _get_current_dispatch_mode_stack()
    except Exception:  # noqa: BLE001 - a torch without this helper: counters opened later still count
        return
    for mode in modes:
        reg = getattr(getattr(mode, "counter", mode), "flop_registry", None)
        if isinstance(reg, dict):
            reg.setdefault(op_packet, wrapped)
