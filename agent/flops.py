"""FLOPs per optimizer step: user value, analytic transformer formula, or a one-time FlopCounterMode count.

Order of preference (the first available wins):

1. ``flops_per_step`` given by the user (and ``hardware_flops_per_step``, if given);
2. the analytic decoder-transformer formula of PaLM (Chowdhery et al. 2022,
   appendix B), when the model's shape is known (``model_shape`` or a Hugging
   Face ``model.config``)::

       model FLOPs per token = 6 * N + 12 * L * d * T

   with N the number of parameters used in matmuls (embedding lookups
   excluded; the output projection is a matmul and counts), L layers, d the
   model width and T the sequence length. The first term is the forward (2N)
   and backward (4N) of every weight matmul; the second the attention score
   and value matmuls (QK^T and PV, forward and backward), not halved for a
   causal mask;
3. measured once with :class:`torch.utils.flop_counter.FlopCounterMode` over
   one real optimizer step (every micro-batch's forward and backward).

Model FLOPs (MFU's numerator) exclude activation recomputation; hardware FLOPs
(HFU's numerator) include it. FlopCounterMode counts what executes, so with
``torch.utils.checkpoint`` it sees the recomputed forward too. We separate the
two with the matmul identity "backward = 2 x forward": model FLOPs =
min(3 * forward-phase FLOPs, executed FLOPs) and hardware FLOPs = executed
FLOPs. (With frozen weights and checkpointing together this over-states model
FLOPs; give ``flops_per_step`` then.) The analytic path has no executed count:
its hardware FLOPs add one forward (2N + 4LdT per token, i.e. a third of the
model FLOPs) when the model reports gradient checkpointing
(``is_activation_checkpointing``, formerly ``is_gradient_checkpointing``, as Hugging Face models do).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

log = logging.getLogger("mfuwatch")


def analytic_flops_per_token(n_matmul_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Model FLOPs per token for one forward+backward: ``6 N + 12 L d T`` (PaLM appendix B).

    Args:
        n_matmul_params: N, parameters used in matmuls (embeddings excluded).
        n_layers: L. d_model: d. seq_len: T (tokens per sequence).

    Returns:
        FLOPs per token (float).

    Raises:
        ValueError: if any argument is negative.
    """
    if min(n_matmul_params, n_layers, d_model, seq_len) < 0:
        raise ValueError("analytic_flops_per_token: arguments must be non-negative")
    return 6.0 * n_matmul_params + 12.0 * n_layers * d_model * seq_len


def count_matmul_params(model: nn.Module) -> int:
    """N for the analytic formula: weights of every ``nn.Linear`` call site (and ``Conv1D``-style modules).

    A weight shared by two Linear modules (e.g. a tied output projection) counts
    once per module, since each module performs its own matmul. Embedding tables
    are excluded (a lookup is not a matmul); biases and norm weights are
    excluded (O(d) work per token, not O(d^2)).
    """
    n = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            n += mod.weight.numel()
        elif type(mod).__name__ == "Conv1D" and hasattr(mod, "weight") and getattr(mod.weight, "dim", lambda: 0)() == 2:
            n += mod.weight.numel()  # Hugging Face GPT-2's transposed Linear
    return n


@dataclass
class TransformerShape:
    """What the analytic formula needs; ``seq_len`` may be filled in from the inputs."""

    n_layers: int
    d_model: int
    n_params: int
    seq_len: Optional[int] = None
    gradient_checkpointing: bool = False


def uses_activation_checkpointing(model: Optional[nn.Module]) -> bool:
    """Whether a (Hugging Face) model reports activation checkpointing.

    transformers 5 names it ``is_activation_checkpointing`` (``is_gradient_checkpointing``
    is its deprecated alias); older versions have only the latter.
    """
    if model is None:
        return False
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in getattr(model, "__dict__", {}):
            return bool(getattr(model, name, False))
    return False


def shape_from_hf_config(model: nn.Module) -> Optional[TransformerShape]:
    """Read layers and width from a Hugging Face ``model.config``; ``None`` if absent or not a decoder LM."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    get = lambda *names: next((getattr(cfg, k) for k in names if isinstance(getattr(cfg, k, None), int)), None)  # noqa: E731
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    width = get("hidden_size", "n_embd", "d_model")
    if not layers or not width:
        return None
    return TransformerShape(
        n_layers=layers,
        d_model=width,
        n_params=count_matmul_params(model),
        seq_len=None,
        gradient_checkpointing=uses_activation_checkpointing(model),
    )


_SDPA_REGISTERED = False


def ensure_cpu_sdpa_flop_formulas() -> None:
    """Register FLOP formulas for the CPU flash-attention ops, which FlopCounterMode counts as 0.

    On the CPU, ``F.scaled_dot_product_attention`` dispatches to
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``),
    which have no entry in torch's FLOP registry, so attention FLOPs silently
    vanish. We register torch's own SDPA formulas (``sdpa_flop_count``:
    4·B·H·Tq·Tk·D forward; ``sdpa_backward_flop_count``: twice that) for them.
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
    if fwd is not None and fwd not in registry and fwd.default not in registry:

        @fc.register_flop_formula(fwd)
        def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

    if bwd is not None and bwd not in registry and bwd.default not in registry:

        @fc.register_flop_formula(bwd)
        def _cpu_sdpa_bwd_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


class StepFlopCounter:
    """Counts FLOPs over one real optimizer step with ``FlopCounterMode``, driven by hooks.

    ``start()`` is called at the first forward of a step (the agent's forward
    pre-hook), ``mark_forward_end()`` after each forward of the step (forward
    hook), ``finish()`` at the optimizer step boundary. Returns executed FLOPs
    and forward-phase FLOPs per step; see the module docstring for how model and
    hardware FLOPs follow from them.
    """

    def __init__(self) -> None:
        self._mode: Any = None
        self._fwd_start = 0
        self.forward_flops = 0
        self.active = False

    def start(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        ensure_cpu_sdpa_flop_formulas()
        self._mode = FlopCounterMode(display=False)
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
        """Leave the mode; return ``(executed_flops, forward_flops)`` for the step."""
        mode, self._mode = self._mode, None
        self.active = False
        if mode is None:
            return 0, 0
        mode.__exit__(None, None, None)
        return int(mode.get_total_flops()), int(self.forward_flops)

    def abort(self) -> None:
        """Leave the mode after a failure, discarding the count. Never raises."""
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        except Exception:  # noqa: BLE001
            pass
        self._mode = None
        self.active = False


def split_model_hardware(executed: float, forward: float) -> tuple:
    """``(model, hardware)`` FLOPs from a FlopCounterMode count: ``(min(3*forward, executed), executed)``.

    Backward matmuls cost twice the forward ones (dX and dW, each as many FLOPs
    as the forward product), so a step without recomputation executes
    3 x forward FLOPs; anything above that is recomputation (HFU only).
    """
    if forward <= 0:
        return float(executed), float(executed)
    return float(min(3.0 * forward, executed)), float(executed)
