"""Lightning integration: live MFU for ``Trainer.fit()`` with one ``lightning.pytorch.Callback``.

Usage::

    from mfuwatch.agent.integrations.lightning import MFUWatchCallback

    trainer = L.Trainer(callbacks=[MFUWatchCallback(patch_kernels=True)], accumulate_grad_batches=4)
    trainer.fit(module, datamodule)                  # exporter on 127.0.0.1:9478 + local rank

Step boundaries come from ``on_train_batch_end`` whenever ``trainer.global_step`` moved (once per
optimizer step, manual optimization included), tokens from the batch in
``on_train_batch_start`` (B x T per micro-batch, padding included), FLOPs from a Hugging Face
``config`` on the module or its first submodule that has one (else ``model_shape``,
``flops_per_step`` or one FlopCounterMode step), rank / world size / dtype from the trainer
(``bf16-mixed`` -> bf16, ``16-mixed`` -> fp16) unless the agent config sets them; validation and
checkpoints are gaps; ``patch_kernels`` patches in ``setup``. In detail: docs/integrations.md.

Requires ``lightning`` (``pip install 'mfuwatch[lightning]'``); importing
:mod:`mfuwatch.agent` alone never imports it.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional, Union

try:
    from lightning.pytorch import Callback
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("mfuwatch.agent.integrations.lightning needs the lightning package: "
                      "pip install 'mfuwatch[lightning]'") from _exc

from . import _common

log = logging.getLogger("mfuwatch")

__all__ = ["MFUWatchCallback", "find_transformer"]

#: ``trainer.precision`` -> the agent's training dtype (the peak to divide by).
PRECISION_DTYPES = {
    "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16": "bf16",
    "16-mixed": "fp16", "16-true": "fp16", "16": "fp16",
}


def find_transformer(module: Any) -> Any:
    """``module`` or its first submodule whose Hugging Face ``config`` gives layers and width; else ``module``."""
    from ..flops.model import shape_from_hf_config

    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and not isinstance(cfg, Mapping) and shape_from_hf_config(m) is not None:
            return m
    return module


class MFUWatchCallback(Callback):
    """A Lightning ``Callback`` that runs an mfuwatch :class:`~mfuwatch.agent.Agent` during ``fit``.

    Args:
        config: agent configuration: a YAML path, a mapping, an ``AgentConfig``,
            or ``None`` (``$MFUWATCH_CONFIG``, else defaults).
        model: the ``nn.Module`` whose forward the agent hooks (dtype detection,
            FlopCounterMode); default: :func:`find_transformer` of the LightningModule.
        patch_kernels: ``False``; ``True`` to apply ``mfuwatch.kernels.patch``;
            or a mapping of keyword arguments for ``patch``.
        file_sd_dir: write this rank's Prometheus file-SD target there.
        **overrides: agent config keys (``port``, ``peak_flops``, ``alerts``, ...).

    Raises:
        ConfigError: at ``on_train_start``, for a bad agent setting (fail fast).

    After ``fit``, :attr:`agent` holds the closed agent (``agent.latest``).
    """

    def __init__(self, config: Any = None, *, model: Any = None,
                 patch_kernels: Union[bool, Mapping[str, Any]] = False, file_sd_dir: Optional[str] = None,
                 **overrides: Any) -> None:
        super().__init__()
        self.config = config
        self.overrides: Dict[str, Any] = dict(overrides)
        self.model = model
        self.patch_kernels = patch_kernels
        self.file_sd_dir = file_sd_dir
        self.agent: Any = None
        self.patch_report: Any = None
        self.sd_target: Any = None
        self._setup_arch: Any = None  # architectures.ArchitectureModel of the unsharded model
        self._tokens = 0  # tokens of the micro-batches since the last boundary
        self._last_global_step = 0
        self._gap = False

    # -- set-up -----------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Before the optimizers exist: patch kernels, count matmul weights while they are unsharded."""
        if stage != "fit":
            return
        if self.patch_kernels and self.patch_report is None:
            self.patch_report = _common.apply_kernel_patch(pl_module, self.patch_kernels)
        try:
            from ..flops.architectures import from_model

            self._setup_arch = from_model(self.model or find_transformer(pl_module))  # before any sharding
        except Exception as exc:  # noqa: BLE001 - the agent reads or counts the model itself
            log.debug("mfuwatch: no analytic FLOP model at setup: %r", exc)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the agent (one per ``fit``)."""
        self._close()
        from ..core import Agent

        facts: Dict[str, Any] = {
            "rank": trainer.global_rank, "local_rank": trainer.local_rank, "world_size": trainer.world_size,
            "dtype": PRECISION_DTYPES.get(str(trainer.precision)),
        }
        cfg = _common.build_config(self.config, self.overrides, facts)
        self.agent = Agent(self.model or find_transformer(pl_module), None, config=cfg)
        _common.adopt_architecture(self.agent, self._setup_arch)  # the strategy hid the weights' shapes
        self._tokens = 0
        self._last_global_step = trainer.global_step
        self._gap = False
        if self.file_sd_dir:
            from ..distributed import register_agent

            self.sd_target = register_agent(self.agent, self.file_sd_dir)

    # -- training ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Count the micro-batch's tokens; close a gap (validation, checkpoint) left before it."""
        agent = self.agent
        if agent is None:
            return
        if self._gap:
            self._gap = False
            _common.end_phase(agent, "checkpoint")  # fleet: the checkpoint write ended before this batch
            if self._tokens == 0:  # only between optimizer steps, never inside an accumulation
                _common.mark_gap(agent)
        try:
            self._tokens += _common.tokens_in_batch(batch)
        except Exception as exc:  # noqa: BLE001
            agent.errors.count("integration", exc)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A boundary when the optimizer stepped during this batch (``global_step`` moved)."""
        agent = self.agent
        if agent is None or trainer.global_step == self._last_global_step:
            return
        self._last_global_step = trainer.global_step
        tokens, self._tokens = self._tokens, 0
        agent.step(tokens=tokens or None)  # None: fall back to the forward hook's count

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """fleet: validation is the eval phase (stall alert and hang watchdog paused, goodput ``eval``)."""
        if self.agent is not None and not trainer.sanity_checking:
            _common.begin_phase(self.agent, "eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.agent is not None and not trainer.sanity_checking:
            _common.end_phase(self.agent, "eval")
            self._gap = True

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        """The checkpoint dict is built; Lightning writes it next: the checkpoint phase runs until the next batch."""
        if self.agent is not None:
            if _common.open_phase(self.agent) != "checkpoint":
                _common.begin_phase(self.agent, "checkpoint")
            self._gap = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Flush the last measurement, stop the exporter, remove the discovery file."""
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.agent is not None:
            _common.close_quietly(self.agent, self.sd_target)  # close() is idempotent
        self.sd_target = None
