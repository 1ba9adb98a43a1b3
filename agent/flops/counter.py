"""The counted path of the FLOP model: :class:`torch.utils.flop_counter.FlopCounterMode` over one training step.

:class:`StepFlopCounter` counts one real optimizer step (every micro-batch's forward and backward) on
the training thread; :func:`split_model_hardware` separates model FLOPs (MFU's numerator, no
recomputation) from hardware FLOPs with the matmul identity "backward = 2 x forward" (see
:mod:`mfuwatch.agent.flops.model`). CPU attention gets the op formulas of :mod:`.op_flops`
(:func:`ensure_cpu_sdpa_flop_formulas`); a counter that fails is always taken off the dispatch stack.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

log = logging.getLogger("mfuwatch")


_SDPA_REGISTERED = False


def ensure_cpu_sdpa_flop_formulas() -> None:
    """Register FLOP formulas for the CPU flash-attention ops, which FlopCounterMode counts as 0.

    On the CPU, ``F.scaled_dot_product_attention`` dispatches to
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``),
    which have no entry in older torch's FLOP registry, so attention FLOPs silently
    vanish. We register our formulas (:mod:`.op_flops`: 4·B·Hq·Tq·Tk·D forward,
    10·B·Hq·Tq·Tk·D backward) for them, globally, for code that runs its own
    ``FlopCounterMode``; the agent's counter passes them as ``custom_mapping`` instead.
    Idempotent; does nothing if the ops are missing or already registered.
    """
    global _SDPA_REGISTERED
    if _SDPA_REGISTERED:
        return
    _SDPA_REGISTERED = True
    from torch.utils import flop_counter as fc

    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    registry = getattr(fc, "flop_registry", {})
    from . import op_flops

    for op, name in ((fwd, "_scaled_dot_product_flash_attention_for_cpu"),
                     (bwd, "_scaled_dot_product_flash_attention_for_cpu_backward")):
        if op is not None and op not in registry and op.default not in registry:
            fc.register_flop_formula(op)(op_flops._shape_formula(name))  # ours: grouped-query shapes too


class CountingFailed(RuntimeError):
    """A FLOP formula raised while the counted step ran; the step itself went on."""


def _safe_flop_counter_mode() -> Any:
    """A ``FlopCounterMode`` subclass whose formula failures are recorded instead of raised into the user's step.

    Uses our attention and grouped-matmul formulas (:mod:`.op_flops`) through
    ``custom_mapping``. The first failure is kept in ``failure``; the op's
    result is returned untouched, so the training step computes what it would
    have without the counter.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from . import op_flops

    class SafeFlopCounterMode(FlopCounterMode):
        failure: Optional[BaseException] = None

        def _count_flops(self, func_packet, out, args, kwargs):  # noqa: ANN001
            try:
                return super()._count_flops(func_packet, out, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - never into the training step
                if self.failure is None:
                    self.failure = exc
                return out

    return SafeFlopCounterMode(display=False, custom_mapping=op_flops.flop_counter_mapping())


def _force_off(mode: Any) -> None:
    """Switch a ``FlopCounterMode`` off after its ``__exit__`` failed. Never raises.

    Takes its dispatch mode off torch's mode stack (only from the top: a mode
    entered above ours belongs to someone else) and removes the module tracker's
    global hooks.
    """
    try:
        from torch.utils import _python_dispatch as pd

        inner = getattr(mode, "mode", None)
        stack = pd._get_current_dispatch_mode_stack()
        while stack and (stack[-1] is inner or stack[-1] is mode):
            pd._pop_mode()
            stack = pd._get_current_dispatch_mode_stack()
    except Exception:  # noqa: BLE001
        pass
    try:
        tracker = getattr(mode, "mod_tracker", None)
        if tracker is not None:
            tracker.__exit__()
    except Exception:  # noqa: BLE001
        pass


class StepFlopCounter:
    """Counts FLOPs over one real optimizer step with ``FlopCounterMode``, driven by hooks.

    ``start()`` is called at the first forward of a step (the agent's forward
    pre-hook), ``mark_forward_start()``/``mark_forward_end()`` around each forward
    of the step, ``finish()`` at the optimizer step boundary. A formula that
    raises during the step does not reach the step: :meth:`finish` raises
    :class:`CountingFailed` afterwards. :meth:`finish` and :meth:`abort` always
    leave the mode, even when its ``__exit__`` fails.
    """

    def __init__(self) -> None:
        self._mode: Any = None
        self._fwd_start = 0
        self.forward_flops = 0
        self.active = False

    def start(self) -> None:
        """Enter the counting mode (the step's first forward). Raises what ``FlopCounterMode`` raises."""
        self._mode = _safe_flop_counter_mode()
        self._mode.__enter__()
        self.active = True
        self.forward_flops = 0

    def mark_forward_start(self) -> None:
        if self.active:
            self._fwd_start = self._mode.get_total_flops()

    def mark_forward_end(self) -> None:
        if self.active:
            self.forward_flops += self._mode.get_total_flops() - self._fwd_start

    def finish(self) -> tuple:
        """Leave the mode; return ``(executed_flops, forward_flops)`` for the step.

        Raises:
            CountingFailed: a formula raised during the step (the count is incomplete).
            Exception: leaving the mode failed (it is taken off the dispatch stack anyway).
        """
        mode, self._mode = self._mode, None
        self.active = False
        if mode is None:
            return 0, 0
        try:
            mode.__exit__(None, None, None)
        except Exception:
            _force_off(mode)
            raise
        failure = getattr(mode, "failure", None)
        if failure is not None:
            raise CountingFailed(f"a FLOP formula failed during the counted step: {type(failure).__name__}: "
                                 f"{failure}") from failure
        return int(mode.get_total_flops()), int(self.forward_flops)

    def abort(self) -> None:
        """Leave the mode after a failure, discarding the count. Never raises."""
        mode, self._mode = self._mode, None
        self.active = False
        if mode is None:
            return
        try:
            mode.__exit__(None, None, None)
        except Exception:  # noqa: BLE001
            _force_off(mode)


def split_model_hardware(executed: float, forward: float) -> tuple:
    """``(model, hardware)`` FLOPs from a FlopCounterMode count: ``(min(3*forward, executed), executed)``.

    Backward matmuls cost twice the forward ones (dX and dW, each as many FLOPs
    as the forward product), so a step without recomputation executes
    3 x forward FLOPs; anything above that is recomputation (HFU only).
    """
    if forward <= 0:
        return float(executed), float(executed)
    return float(min(3.0 * forward, executed)), float(executed)
