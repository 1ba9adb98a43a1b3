"""Hugging Face Trainer integration: live MFU for ``Trainer.train()`` with one callback.

Usage::

    from mfuwatch.agent.integrations.hf import MFUWatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[MFUWatchCallback(patch_kernels=True)])   # agent config keys go here too
    trainer.train()                                  # exporter on 127.0.0.1:9478 + LOCAL_RANK

Step boundaries come from ``on_step_end`` (once per optimizer step, after all
``gradient_accumulation_steps`` micro-batches), tokens from the model's forward pre-hook
(B x T per training micro-batch, padding included), FLOPs from the unwrapped model's
architecture (docs/flops.md), rank / world size / dtype / run from ``TrainingArguments``
unless the agent config sets them. Evaluation and checkpoints run inside
``agent.phase("eval")``/``"checkpoint"`` (opened in ``on_step_end`` when the Trainer will
evaluate or save, closed in ``on_evaluate``/``on_save``), so the stall alert and the hang
watchdog pause and their time goes to the goodput buckets. ``patch_kernels`` patches in
``on_init_end``, before the optimizer exists. Where each fact comes from, in detail:
docs/integrations.md.

Requires ``transformers`` (``pip install 'mfuwatch[hf]'``); importing
:mod:`mfuwatch.agent` alone never imports it.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional, Union

try:
    from transformers import TrainerCallback
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("mfuwatch.agent.integrations.hf needs the transformers package: "
                      "pip install 'mfuwatch[hf]'") from _exc

from . import _common

log = logging.getLogger("mfuwatch")

__all__ = ["MFUWatchCallback"]


class MFUWatchCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs an mfuwatch :class:`~mfuwatch.agent.Agent` during training.

    Args:
        config: agent configuration: a YAML path, a mapping, an ``AgentConfig``,
            or ``None`` (``$MFUWATCH_CONFIG``, else defaults).
        patch_kernels: ``False``; ``True`` to apply ``mfuwatch.kernels.patch(model)``;
            or a mapping of keyword arguments for ``patch``.
        file_sd_dir: write this rank's Prometheus file-SD target there
            (:class:`~mfuwatch.agent.distributed.FileSDTarget`).
        **overrides: agent config keys (``port``, ``peak_flops``, ``alerts``, ...).

    Raises:
        ConfigError: at ``on_train_begin``, for a bad agent setting (fail fast).

    After training, :attr:`agent` holds the closed agent (``agent.latest`` is the
    last measurement) and :attr:`patch_report` the kernel patch's report.
    """

    def __init__(self, config: Any = None, *, patch_kernels: Union[bool, Mapping[str, Any]] = False,
                 file_sd_dir: Optional[str] = None, **overrides: Any) -> None:
        self.config = config
        self.overrides: Dict[str, Any] = dict(overrides)
        self.patch_kernels = patch_kernels
        self.file_sd_dir = file_sd_dir
        self.agent: Any = None
        self.patch_report: Any = None
        self.sd_target: Any = None
        self._patched = False
        self._init_arch: Any = None  # architectures.ArchitectureModel of the unwrapped model

    # -- set-up -----------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Patch kernels and count matmul weights while the model is still unwrapped."""
        if model is None:
            return
        if self.patch_kernels and not self._patched:
            self._patched = True
            self.patch_report = _common.apply_kernel_patch(model, self.patch_kernels)
        try:
            from ..flops.architectures import from_model

            self._init_arch = from_model(model)  # unsharded weights: read before a sharding wrapper flattens them
        except Exception as exc:  # noqa: BLE001 - the agent reads or counts the model at train begin
            log.debug("mfuwatch: no analytic FLOP model at init: %r", exc)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        """Start the agent on the model the Trainer trains (one agent per ``train()`` call)."""
        if self.patch_kernels and not self._patched and model is not None:
            self._patched = True
            self.patch_report = _common.apply_kernel_patch(model, self.patch_kernels, optimizer)
        self._close()
        from ..core import Agent

        cfg = _common.build_config(self.config, self.overrides, self._framework_facts(args))
        self.agent = Agent(model, None, config=cfg)  # boundaries come from on_step_end, not the optimizer
        _common.adopt_architecture(self.agent, self._init_arch)  # the wrapped model hid its shapes
        if self.file_sd_dir:
            from ..distributed import register_agent

            self.sd_target = register_agent(self.agent, self.file_sd_dir)

    def _framework_facts(self, args: Any) -> Dict[str, Any]:
        run = getattr(args, "run_name", None)
        if run and run == getattr(args, "output_dir", None):
            run = None  # transformers < 5 defaulted run_name to output_dir: not a run name
        dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
        facts: Dict[str, Any] = {
            "rank": getattr(args, "process_index", None), "local_rank": getattr(args, "local_process_index", None),
            "world_size": getattr(args, "world_size", None), "dtype": dtype, "run": run,
        }
        return facts

    # -- training ---------------------------------------------------------------------------
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """One optimizer step ended: its tokens are every micro-batch's, counted by the forward hook."""
        agent = self.agent
        if agent is not None:
            agent.step()  # never raises: the agent counts its own failures
            # fleet: the Trainer evaluates and saves right after this callback returns
            if getattr(control, "should_evaluate", False):
                _common.begin_phase(agent, "eval")
            elif getattr(control, "should_save", False):
                _common.begin_phase(agent, "checkpoint")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A new optimizer step begins: a phase announced in ``on_step_end`` that never ran is closed here."""
        agent = self.agent
        if agent is not None:
            for name in ("checkpoint", "eval"):
                _common.end_phase(agent, name)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An evaluation batch: opens the eval phase when the evaluation was not announced by ``on_step_end``."""
        agent = self.agent
        if agent is not None and _common.open_phase(agent) is None:
            _common.begin_phase(agent, "eval")

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Evaluation ran since the last step: not training time."""
        if self.agent is not None:
            _common.end_phase(self.agent, "eval")
            _common.mark_gap(self.agent)
            if getattr(control, "should_save", False):  # the save follows the evaluation
                _common.begin_phase(self.agent, "checkpoint")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A checkpoint was written since the last step: not training time."""
        if self.agent is not None:
            _common.end_phase(self.agent, "checkpoint")
            _common.mark_gap(self.agent)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Flush the last measurement, stop the exporter, remove the discovery file."""
        self._close()

    def _close(self) -> None:
        if self.agent is not None:
            _common.close_quietly(self.agent, self.sd_target)  # close() is idempotent
        self.sd_target = None
