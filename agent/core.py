"""The Agent: hooks into a training loop and turns step boundaries into MFU, HFU and tokens/s.

The training thread does the least: the optimizer's step post-hook records a
CUDA event and a token count (no host-device sync); the forward
pre-hook adds the batch's tokens. Everything else — reading the events,
arithmetic, the exporter, the timeline, alerts, NVML and profiler windows —
runs on the agent's own threads, and every failure there is caught, counted in
``mfuwatch_agent_errors_total{component}`` and logged once.

MFU = model FLOPs per step / step time / peak FLOP/s of one GPU for the training
dtype (PaLM, Chowdhery et al. 2022, appendix B); HFU uses executed FLOPs
(recomputation included).

``Agent`` is composed of one mixin per concept, each in its own module:
:class:`~.lifecycle.Lifecycle` (start-up and close of the components),
:class:`~.hooks.TrainingHooks` (the training-thread hooks and ``step()``),
:class:`~.agent_thread.AgentThread` (the agent thread's loop and reports) and
:class:`~.mfu_peak.MfuPeak` (the MFU denominator). This module holds the state they
share, set in ``__init__``, and the public entry points.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from . import flops as flops_mod
from . import peaks
from .agent_thread import AgentThread
from .config import AgentConfig, ConfigError, load_config  # noqa: F401  (ConfigError: raised by Agent())
from .errors import ErrorCounter
from .exporter import Exporter
from .fleet import FleetAccounting
from .flop_conventions import formula_inputs
from .hooks import TrainingHooks, count_tokens  # noqa: F401  (count_tokens: public, used by integrations)
from .job import job_labelled_view, resolve_job
from .lifecycle import Lifecycle
from .mfu_peak import MfuPeak
from .schema import RunInfo, StepMeasurement, WindowMeasurement
from .timeline import Timeline


class Agent(Lifecycle, TrainingHooks, AgentThread, MfuPeak):
    """Live MFU/HFU/tokens-per-second for one training process, exported to Prometheus.

    Args:
        model: the ``nn.Module`` being trained (for token counting, dtype, FLOPs). Optional
            when ``flops_per_step`` and ``tokens_per_step`` are given or ``step(tokens=)`` is used.
        optimizer: step boundaries come from its ``register_step_post_hook``. Without one,
            call :meth:`step` once per optimizer step.
        config: a path to a YAML file, a mapping, or an :class:`AgentConfig`
            (``$MFUWATCH_CONFIG`` if ``None``). ``**overrides`` are config keys.

    Raises:
        ConfigError: bad configuration, at construction (fail fast).

    The agent starts at construction; use it as a context manager or call :meth:`close`.
    """

    def __init__(self, model: Optional[nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 config: Union[None, str, os.PathLike, Mapping[str, Any], AgentConfig] = None, **overrides: Any) -> None:
        self.config: AgentConfig = load_config(config, **overrides)
        cfg = self.config
        self.errors = ErrorCounter()
        self.model = model
        self.optimizer = optimizer
        self.device = self._find_device(model)
        self.latest: Optional[StepMeasurement] = None
        self.latest_window: Optional[WindowMeasurement] = None
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._handles: list = []

        # training-thread state (touched only by hooks)
        self._step = 0
        self._pending_tokens = 0
        self._seq_len: Optional[int] = None
        self._pending_loss: Any = None
        self._dtype_key: Optional[str] = cfg.dtype
        self._explicit_warned = False
        self._clock_started = False

        self._last_gpu_write = 0.0  # before the NVML thread starts: its first sample may come at once
        self.flop_model = flops_mod.FlopModel(model, cfg, self.errors)

        self.run_info = RunInfo(
            run=cfg.run, rank=cfg.rank, local_rank=cfg.local_rank, world_size=cfg.world_size,
            host=socket.gethostname(), device=str(self.device), gpu_name=self._gpu_name(),
            dtype=self._dtype_key or "", flops_source=self.flop_model.source,
            flops_convention=cfg.flops_convention or "", flops_inputs=formula_inputs(self.flop_model),
            versions={"torch": torch.__version__.split("+")[0], "mfuwatch": _version()},
        )
        self.run_info.job = resolve_job(cfg.run, cfg.job)  # fleet: the `job` label (agent/job.py)
        self._peak: Optional[float] = None
        self._peak_warned = False
        self._run_info_dirty = False
        self._mfu_warned = False
        self._last_progress: Optional[float] = None  # time.monotonic() of the last console progress line
        self._run_written: Optional[dict] = None  # the last "run" timeline record written
        self._dtype_seen = False  # the agent thread saw the dtype known at its previous tick
        #: the GPU's peaks from :func:`peaks.resolve_peaks` (None off CUDA or for a GPU not in the table)
        self.gpu_peaks: Optional[peaks.Peaks] = None

        self.exporter = Exporter(self.run_info)
        self.registry = self.exporter.registry
        self.exporter.exposed_registry = job_labelled_view(self.exporter.exposed_registry, self.run_info.job)
        self._sd_target = None
        self.otlp = None  # fleet: optional OTLP export of the same series (agent/otlp.py)
        self.fleet: Optional[FleetAccounting] = None  # fleet: counters, goodput, phases, hang watchdog
        self.nvml = None
        self.profiler = None
        self.alerts = None
        self._thread: Optional[threading.Thread] = None
        self.timeline = Timeline(None)
        try:
            self._start(model, optimizer)
        except BaseException:
            self._abort_start()  # nothing the failed start-up began may outlive it: port, threads, hooks
            raise

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _find_device(model: Optional[nn.Module]) -> torch.device:
        if model is not None:
            p = next(model.parameters(), None)
            if p is not None:
                return p.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gpu_name(self) -> str:
        if self.device.type == "cuda":
            try:
                return torch.cuda.get_device_name(self.device)
            except Exception as exc:  # noqa: BLE001
                self.errors.count("device", exc)
        return ""

    # ------------------------------------------------------------------ FLOPs
    def flops_per_step(self, tokens_per_step: float) -> tuple:
        """``(model, hardware)`` FLOPs for one optimizer step of ``tokens_per_step`` tokens, or ``(None, None)``."""
        if self._note_seq_len():
            self._run_info_dirty = True  # learnt after the run record went out: a later run record says it
        return self.flop_model.flops_per_step(tokens_per_step, self._seq_len)

    def _note_seq_len(self) -> bool:
        """Put the first training forward's sequence length into ``run_info.flops_inputs``; whether it changed."""
        if self._seq_len and self.run_info.flops_inputs and "seq_len" not in self.run_info.flops_inputs:
            self.run_info.flops_inputs = formula_inputs(self.flop_model, self._seq_len)
            return True
        return False

    def _run_record(self) -> dict:
        self._note_seq_len()  # the run record is written after the first step: its sequence length is known
        return AgentThread._run_record(self)

    def flops_breakdown(self, print_it: bool = False, count: bool = False) -> str:
        """The FLOP number explained: source, per-component FLOPs of one step and the formula of each.

        Uses the latest report's tokens per step (one sequence before the first report).
        ``count=True`` adds FlopCounterMode's count of one step of the model rebuilt from its
        Hugging Face config on the meta device (no memory, no compute; adapters added after
        loading are not in the rebuild) and the compute ops that counted 0. Call it off the hot
        path. Returns the text (``print(agent.flops_breakdown())`` shows it); ``print_it=True`` also prints it.
        """
        m = self.latest
        tokens = m.tokens / m.steps if (m is not None and m.steps) else None
        text = self.flop_model.breakdown(tokens, self._seq_len, count=count)
        if print_it:
            print(text)
        return text

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001
            pass


def watch(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, **config: Any) -> Agent:
    """One call: attach an :class:`Agent` to ``model`` and ``optimizer`` and start exporting.

    ``config`` holds :class:`~mfuwatch.agent.config.AgentConfig` keys (or ``config=`` a path/mapping).
    """
    cfg = config.pop("config", None)
    return Agent(model, optimizer, config=cfg, **config)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mfuwatch")
    except Exception:  # noqa: BLE001
        return "0"
