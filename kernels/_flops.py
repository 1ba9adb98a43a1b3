"""FLOP counts of the fused ops, as registered with ``torch.utils.flop_counter``.

``FlopCounterMode`` (which the mfuwatch agent uses to count a model's FLOPs)
only knows the formulas registered for an op; an op without one counts as
zero. The fused ops register the counts below, per element of the input
(``rows x N``; for the GLUs, per element of ``gate``).

Convention (ours, stated so that the numbers can be checked by hand): every
add, subtract, multiply, divide and every special function (exp, erf, tanh,
rsqrt) is one FLOP; a sum over a row costs one add per element; per-row
scalars (the rsqrt of the variance, the means) and anything done once per
column (``w + offset``) are left out. Norms::

    rms_norm fwd:    s^2, sum, *rstd, *w                            4 (3 without weight)
    rms_norm bwd:    xhat=s*rstd, g=dy*w, sum(g*xhat) (2),
                     (g - xhat*c)*rstd (3), dw += dy*xhat (2)       9 (6 without weight)
    add_rms_norm:    as rms_norm, plus the residual add             5 fwd; bwd 9, +1 with d(new residual)
    layer_norm fwd:  sum, s-mu, (.)^2 and sum (2), *rstd, *w, +b    7 (6 without bias, 5 without both)
    layer_norm bwd:  xhat (2), g=dy*w, sum(g), sum(g*xhat) (2),
                     (g - c2 - xhat*c1)*rstd (4), dw (2), db (1)    13 (12 without bias, 9 without both)

GLUs (``g`` = gate, ``u`` = up)::

    swiglu fwd:      sigmoid (exp, add, divide: 3), *g, *u          5
    swiglu bwd:      sigmoid (3), a=g*s, s*(1+g*(1-s)) (4),
                     dy*a, dy*u*da (2)                              11
    geglu fwd:       Phi = 0.5*(1+erf(g/sqrt2)) (4), *g, *u         6
    geglu bwd:       Phi (4), a, density g*exp(-g^2/2)/sqrt(2pi) (5),
                     +Phi, dy*a, dy*u*da (2)                        14
    geglu tanh fwd:  g^3 (2), *0.044715, +g, *sqrt(2/pi), tanh,
                     1+t, *0.5, *g, *u                              10
    geglu tanh bwd:  t as above (6), a=0.5*g*(1+t) (3), da (11),
                     dy*a, dy*u*da (2)                              23

Cross-entropy, per logit (``rows x V``)::

    cross_entropy fwd:   x - max, exp, running sum, running max    4
                         softcap c*tanh(x/c): divide, tanh, mul    +3
    cross_entropy bwd:   z - lse, exp, *(1 + 2 zl lse), -eps/V,
                         *upstream gradient                        5
                         softcap: z again (3), 1 - (z/c)^2 (2), *  +6

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

RMS_FWD, RMS_FWD_NO_W = 4, 3
RMS_BWD, RMS_BWD_NO_W = 9, 6
ADD_FWD_EXTRA, ADD_BWD_DRES_EXTRA = 1, 1
LN_FWD = {(True, True): 7, (True, False): 6, (False, False): 5, (False, True): 6}  # (has weight, has bias)
LN_BWD = {(True, True): 13, (True, False): 12, (False, False): 9, (False, True): 10}
GLU_FWD = {"silu": 5, "gelu": 6, "gelu_tanh": 10}
GLU_BWD = {"silu": 11, "gelu": 14, "gelu_tanh": 23}
CE_FWD, CE_SOFTCAP_FWD = 4, 3
CE_BWD, CE_SOFTCAP_BWD = 5, 6


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
