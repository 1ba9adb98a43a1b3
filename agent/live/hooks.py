"""The training-thread side of the agent: forward hooks, the optimizer step hook, ``step()``, phases.

These run on the training thread and do the least: add a batch's tokens (shape reads
only), record a step-clock marker (a CUDA event on GPUs: no host-device sync), and hand
the FLOP model its forward. Every failure is caught and counted under ``hooks``; none
reaches the training loop.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..device import peaks

log = logging.getLogger("mfuwatch")


def count_tokens(args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """Tokens in one forward call's inputs: ``(tokens, seq_len or None)``.

    The input is ``input_ids`` / ``inputs_embeds`` if passed by keyword or inside a
    dict passed as an argument (``model(batch)`` with ``{"input_ids": …}``, a Hugging
    Face ``BatchEncoding``), else the first tensor argument. Integer tensors (token
    ids) of shape (B, T) give B·T; float tensors of shape (B, T, C) give B·T; any
    other shape counts its first dimension (samples, e.g. images). Shape reads only:
    no device sync.
    """
    t = None
    maps = [kwargs] + [a for a in args if isinstance(a, Mapping)]
    for key in ("input_ids", "inputs_embeds", "idx", "tokens", "x"):
        v = next((m.get(key) for m in maps if isinstance(m.get(key), torch.Tensor)), None)
        if isinstance(v, torch.Tensor):
            t = v
            break
    if t is None:
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None:
        t = next((a for a in kwargs.values() if isinstance(a, torch.Tensor)), None)
    if t is None or t.dim() == 0:
        return 0, None
    if not t.is_floating_point() and t.dim() <= 2:
        return int(t.numel()), int(t.shape[-1])
    if t.is_floating_point() and t.dim() == 3:
        return int(t.shape[0] * t.shape[1]), int(t.shape[1])
    return int(t.shape[0]), None



class TrainingHooks:
    """Mixin of :class:`~mfuwatch.agent.core.Agent`: everything the training thread calls.

    Owns the training-thread state ``_step``, ``_pending_tokens``, ``_seq_len``,
    ``_pending_loss``, ``_clock_started``, ``_explicit_warned`` and ``_handles``; sets
    ``_dtype_key`` at the first training forward; feeds ``clock``, ``flop_model``,
    ``fleet``, ``profiler`` and the exporter's last-step time.
    """

    def _install_hooks(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> None:
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._post_forward))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._post_optimizer_step))

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            if not torch.is_grad_enabled() or not module.training:
                # Training tokens are those of forwards with autograd on and the model in train mode;
                # a metric pass in model.eval() (with or without no_grad) is not training. A model trained
                # in eval mode passes its tokens with step(tokens=...) or tokens_per_step.
                return None
            if self.fleet is not None:
                self.fleet.forward_start()  # fleet: goodput's input-wait / step split
            if self.config.tokens_per_step is None:
                n, seq = count_tokens(args, kwargs)
                self._pending_tokens += n
                if seq:
                    self._seq_len = seq
            if self._step == 0 and not self._clock_started:
                self._clock_started = True
                self.clock.start()  # time the first step from its first forward
            if self.config.dtype is None:  # a configured dtype is final
                self._detect_dtype(module)  # the first forward shows the dtype; a change re-chooses the peak
            self.flop_model.on_forward_start(args, kwargs, self._step)  # never raises
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)
        return None

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.flop_model.on_forward_end()  # never raises
        return None

    def _detect_dtype(self, module: nn.Module) -> None:
        dev = self.device.type
        autocast_dtype = None
        try:
            if torch.is_autocast_enabled(dev) if _autocast_takes_device() else (
                    torch.is_autocast_enabled() if dev == "cuda" else torch.is_autocast_cpu_enabled()):
                autocast_dtype = torch.get_autocast_dtype(dev) if hasattr(torch, "get_autocast_dtype") else (
                    torch.get_autocast_gpu_dtype() if dev == "cuda" else torch.get_autocast_cpu_dtype())
        except Exception:  # noqa: BLE001
            autocast_dtype = None
        p = next(module.parameters(), None)
        param_dtype = p.dtype if p is not None else torch.float32
        key = peaks.training_dtype_key(param_dtype, autocast_dtype, dev == "cuda" and peaks.torch_allows_tf32())
        if key == self._dtype_key and self._dtype_detected:
            return
        self._dtype_detected = True
        changed = key != self._dtype_key
        self._dtype_key = key
        self.run_info.dtype = key
        self._run_info_dirty = True
        if changed or self._peak is None:
            self._choose_mfu_peak()

    def _post_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._boundary(None, None)

    def step(self, tokens: Optional[int] = None, loss: Any = None) -> None:
        """Mark the end of one optimizer step (use when no optimizer was given to the agent).

        Args:
            tokens: tokens processed in this step (all micro-batches); default: counted
                from the model's inputs, or ``tokens_per_step``.
            loss: optional loss value (float or 0-d tensor), recorded in the timeline
                without a device sync on this thread.
        """
        if self.optimizer is not None:
            if not self._explicit_warned:
                self._explicit_warned = True
                log.warning("mfuwatch: agent.step() ignored: the optimizer's step hook already marks steps "
                            "(use record_loss() to attach a loss)")
            return
        self._boundary(tokens, loss)

    def mark_gap(self) -> None:
        """Leave the time since the last optimizer step out of step timing (evaluation, checkpointing).

        Call between optimizer steps on the training thread; the next step is timed
        from here. Records one marker (a CUDA event on GPUs): no device sync.
        Framework callbacks call it after evaluation and checkpoint saves.
        """
        if self._closed or (self._step == 0 and not self._clock_started):
            return  # nothing is being timed yet
        try:
            self.clock.mark_gap(self._step)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)

    # ------------------------------------------------------------------ phases
    def phase(self, name: str) -> Any:
        """``with agent.phase("eval"):`` / ``"checkpoint"`` / ``"checkpoint_load"``: time that is not training.

        The block's time goes to its goodput bucket (``mfuwatch_goodput_seconds_total{bucket}``),
        stays out of step time (the next step is timed from the block's end) and pauses the
        stalled-loop alert (``TrainingStalled``) and the hang watchdog. Use it between optimizer
        steps on the training thread. Exceptions inside the block propagate unchanged.

        Raises:
            ValueError: an unknown phase name (the message lists the accepted ones).
        """
        from ..fleet.goodput import phase_bucket

        bucket = phase_bucket(name)  # a typo fails at the call, naming the accepted names
        fleet = self.fleet
        if fleet is None or self._closed:
            return contextlib.nullcontext()
        from ..fleet.accounting import Phase

        return Phase(fleet, name, bucket)

    def begin_phase(self, name: str) -> None:
        """Open phase ``name`` without a ``with`` block (framework callbacks); never raises."""
        if self.fleet is not None and not self._closed:
            self.fleet.enter(name)

    def end_phase(self, name: Optional[str] = None) -> None:
        """Close the innermost open phase (only if it is ``name``, when given); never raises."""
        if self.fleet is not None and not self._closed:
            self.fleet.exit(name)

    def record_loss(self, loss: Any) -> None:
        """Attach a loss (float or tensor) to the current step; read later without a sync on this thread."""
        try:
            self._pending_loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)

    def _boundary(self, tokens: Optional[int], loss: Any) -> None:
        if self._closed:
            return
        try:
            self._step += 1
            if tokens is None:
                tokens = self.config.tokens_per_step if self.config.tokens_per_step is not None else self._pending_tokens
            self._pending_tokens = 0
            if loss is None:
                loss, self._pending_loss = self._pending_loss, None
            elif isinstance(loss, torch.Tensor):
                loss = loss.detach()
            self.flop_model.on_step_end(tokens)  # never raises; always leaves FlopCounterMode
            # the boundary's own wall-clock stamp: mfuwatch_last_step_timestamp_seconds moves per step, not per report
            self.exporter.collector.last_step_wall = self.clock.mark(self._step, int(tokens or 0), loss)
            if self.fleet is not None:
                self.fleet.boundary(self._step)  # fleet: goodput bucket of the step, hang watchdog
            prof = self.profiler
            if prof is not None:
                prof.on_step(self._step, self.latest.step_time_seconds if self.latest else None)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)


def _autocast_takes_device() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:
        return False
