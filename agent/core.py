"""The Agent: hooks into a training loop and turns step boundaries into MFU, HFU and tokens/s.

The training thread does the least: the optimizer's step post-hook records a
CUDA event and a token count (microseconds, no host-device sync); the forward
pre-hook adds the batch's tokens. Everything else — reading the events,
arithmetic, the exporter, the timeline, alerts, NVML and profiler windows —
runs on the agent's own threads, and every failure there is caught, counted in
``mfuwatch_agent_errors_total{component}`` and logged once.

MFU = model FLOPs per step / step time / peak FLOP/s of one GPU for the training
dtype (PaLM, Chowdhery et al. 2022, appendix B); HFU uses executed FLOPs
(recomputation included).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

import torch
from torch import nn

from . import flops as flops_mod
from . import calibrate, peaks
from .clock import Interval, StepClock
from .config import AgentConfig, ConfigError, load_config
from .errors import ErrorCounter
from .exporter import Exporter
from .fleet import FleetAccounting
from .job import job_labelled_view, resolve_job
from .schema import GpuHealth, RunInfo, StepMeasurement, WindowMeasurement, to_record
from .timeline import Timeline

log = logging.getLogger("mfuwatch")

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


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


@dataclass
class _ReportSums:
    """Sums over the step-clock intervals since the last report (agent thread only).

    ``seconds``/``timed_*`` leave out the untimed first step (its duration is NaN);
    ``start`` is ``time.monotonic()`` when the sums began; ``last`` the latest interval.
    """

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    timed_steps: int = 0
    timed_tokens: int = 0
    start: float = field(default_factory=time.monotonic)
    last: Optional[Interval] = None


class Agent:
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
            versions={"torch": torch.__version__.split("+")[0], "mfuwatch": _version()},
        )
        self.run_info.job = resolve_job(cfg.run, cfg.job)  # fleet: the `job` label (agent/job.py)
        self._peak: Optional[float] = None
        self._peak_warned = False
        self._run_info_dirty = False
        self._mfu_warned = False
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

    def _start(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Everything after the exporter object exists; on any exception ``__init__`` undoes it."""
        cfg = self.config
        self.errors.listeners.append(self.exporter.count_error)
        self.exporter.on_error = self.errors.count  # a collector failing at scrape time is counted, once logged
        self.exporter_url = ""
        if cfg.exporter:
            try:
                self.exporter_url = self.exporter.serve(cfg.exporter_port, cfg.bind, cfg.tls_certfile,
                                                        cfg.tls_keyfile)
                self.run_info.exporter_url = self.exporter_url
            except OSError as exc:
                self.errors.count("exporter", exc)
        if cfg.otlp_endpoint:
            try:
                from .otlp import OtlpBridge

                self.otlp = OtlpBridge(self.exporter.exposed_registry, endpoint=cfg.otlp_endpoint)
            except ImportError as exc:
                log.warning("mfuwatch: %s; OTLP export is off", exc)
            except Exception as exc:  # noqa: BLE001
                self.errors.count("otlp", exc)
        if cfg.file_sd_dir and self.exporter_url:
            from .distributed import register_agent

            self._sd_target = register_agent(self, cfg.file_sd_dir)  # counts its own failures
        try:
            self.timeline = Timeline(cfg.timeline)
        except OSError as exc:  # e.g. the timeline's directory is not writable
            raise ConfigError(f"timeline: cannot open {cfg.timeline!r} for appending ({type(exc).__name__}: "
                              f"{exc.strerror or exc}); expected a writable file path or null") from None
        self.clock = StepClock(self.device)
        try:
            self.fleet = FleetAccounting(self)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("fleet", exc)

        self._start_nvml()  # first: its PCI device id identifies the GPU in the peak table
        # peak FLOP/s (may wait for the dtype, known at the first forward under autocast)
        self._resolve_gpu_peaks()
        self._choose_mfu_peak()
        self._start_alerts()
        self._start_profiler()

        self._install_hooks(model, optimizer)
        self._write(to_record("run", self.run_info))
        if self.fleet is not None:  # fleet: opens this attempt (and what the previous one lost)
            self._write(self.fleet.attempt_record())
        self._run_info_dirty = False
        self._acc = _ReportSums()
        self._thread = threading.Thread(target=self._loop, name="mfuwatch-agent", daemon=True)
        self._thread.start()
        _live_agents.add(self)
        if self.exporter_url:
            log.info("mfuwatch: exporting metrics at %s (run=%s rank=%d)", self.exporter_url, cfg.run, cfg.rank)

    def _abort_start(self) -> None:
        """Undo a start-up that raised: remove hooks, stop threads and the HTTP server. Never raises."""
        self._closed = True
        for h in self._handles:
            with self.errors.guard("close"):
                h.remove()
        self._handles.clear()
        self._stop.set()
        for part in ("profiler", "nvml", "alerts"):
            obj = getattr(self, part, None)
            if obj is not None:
                with self.errors.guard("close"):
                    obj.close()
        with self.errors.guard("close"):
            self.exporter.close()
        if self._sd_target is not None:
            with self.errors.guard("close"):
                self._sd_target.remove()
        for part in ("fleet", "otlp"):
            obj = getattr(self, part, None)
            if obj is not None:
                with self.errors.guard("close"):
                    obj.close()
        with self.errors.guard("close"):
            self.timeline.close()
        _live_agents.discard(self)

    def _write(self, record: Dict[str, Any]) -> None:
        """Append one timeline record; a failing disk is counted (``timeline``) and nothing else stops."""
        with self.errors.guard("timeline"):
            self.timeline.write(record)

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

    def _resolve_gpu_peaks(self) -> None:
        """The GPU's :class:`peaks.Peaks` from the one resolver (NVML PCI id first, else the CUDA name).

        A GPU missing from the table gets ``None`` and one warning, unless ``peak_flops`` or
        ``calibrate`` gives the MFU denominator anyway.
        """
        if self.device.type != "cuda":
            return
        cfg = self.config
        try:
            self.gpu_peaks = peaks.resolve_peaks(self.run_info.gpu_name or None, self._pci_device_id(),
                                                 warn=cfg.peak_flops is None and not cfg.calibrate)
            if self.gpu_peaks is not None:
                self.run_info.peak_memory_bandwidth_bytes_per_second = self.gpu_peaks.memory_bandwidth_bytes_per_second
        except Exception as exc:  # noqa: BLE001
            self.errors.count("peak", exc)

    def _choose_mfu_peak(self) -> None:
        """Peak FLOP/s: user value > calibration > the GPU's peaks for the training dtype. Unknown => None."""
        cfg = self.config
        try:
            if cfg.peak_flops is not None:
                self._set_peak(cfg.peak_flops, "user (peak_flops)")
                return
            if cfg.calibrate:
                dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self._dtype_key or "", torch.float32)
                measure = lambda: calibrate.calibrate_matmul(self.device, dtype)  # noqa: E731
                if cfg.world_size > 1 and self.device.type == "cpu":
                    # CPU ranks of one job share one measurement (they would compete for the cores otherwise)
                    from .calib_cache import shared_value

                    measure = (lambda m=measure: shared_value(
                        f"peak|{cfg.run}|{socket.gethostname()}|{self.device}|{_dkey(dtype)}", m))
                self._set_peak(measure(), f"calibrated ({_dkey(dtype)} matmul)")
                return
            if self.device.type != "cuda":
                if not self._peak_warned:
                    self._peak_warned = True
                    log.warning("mfuwatch: no peak FLOP/s for device %s: MFU is not reported; pass calibrate=True "
                                "or peak_flops=<FLOP/s>", self.device)
                return
            if self._dtype_key is None:
                return  # wait for the first forward to know the training dtype
            value, source = peaks.mfu_peak(self.gpu_peaks, self._dtype_key)  # warns once for a missing dtype
            if value:
                self._set_peak(value, source)
            else:
                self._peak_warned = True  # final: the table has nothing for this GPU and dtype
        except Exception as exc:  # noqa: BLE001
            self.errors.count("peak", exc)

    def _pci_device_id(self) -> Optional[int]:
        nv = getattr(self, "nvml", None)
        return getattr(nv, "pci_device_id", None) if nv is not None else None

    def _set_peak(self, value: float, source: str) -> None:
        self._peak = float(value)
        self.run_info.peak_flops_per_second = self._peak
        self.run_info.peak_source = source
        self.run_info.dtype = self._dtype_key or self.run_info.dtype
        self._run_info_dirty = True  # the agent thread writes an updated "run" record to the timeline

    def _start_nvml(self) -> None:
        if not self.config.nvml or self.device.type != "cuda":
            return
        try:
            from .nvml import NvmlSampler

            self.nvml = NvmlSampler(torch_device=self.device, interval_seconds=self.config.nvml_interval_seconds,
                                    on_sample=self._on_gpu_sample, on_error=self.errors.count)
            self.nvml.start()
        except Exception as exc:  # noqa: BLE001
            self.errors.count("nvml", exc)
            self.nvml = None

    def _start_alerts(self) -> None:
        if self.config.alerts is False:
            return
        try:
            from mfuwatch.alerts import AlertEngine

            alerts_cfg = None if self.config.alerts in (None, True) else self.config.alerts
            self.alerts = AlertEngine.from_config(alerts_cfg, run_info=self.run_info, registry=self.registry,
                                                  on_event=self._write, on_error=self.errors.count)
            self.alerts.start()
        except (ValueError, TypeError) as exc:
            if type(exc).__name__ == "AlertConfigError":
                # bad alert configuration fails fast, like any other config error (one exception type to catch)
                raise ConfigError(f"alerts: {exc}") from None
            self.errors.count("alerts", exc)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("alerts", exc)
            self.alerts = None

    def _start_profiler(self) -> None:
        pe = self.config.profile_every
        if not pe.enabled:
            return
        try:
            from .profiler import ProfilerSampler

            self.profiler = ProfilerSampler(
                every_steps=pe.steps, every_seconds=pe.seconds, warmup_steps=self.config.profile_warmup_steps,
                active_steps=self.config.profile_active_steps, device=self.device, peaks=self.gpu_peaks,
                top_k=self.config.top_k_ops, on_window=self._on_window, on_error=self.errors.count,
                shared_key=(f"window|{self.config.run}|{socket.gethostname()}"
                            if self.config.world_size > 1 and self.device.type == "cpu" else None),
                on_outcome=self.exporter.count_window,  # ok, error, skipped_other_profiler, too_large
            )
        except Exception as exc:  # noqa: BLE001
            self.errors.count("profiler", exc)
            self.profiler = None

    def _install_hooks(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> None:
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._post_forward))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._post_optimizer_step))

    # ------------------------------------------------------------ training thread
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
            if self._dtype_key is None:
                self._detect_dtype(module)
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
        self._dtype_key = peaks.training_dtype_key(param_dtype, autocast_dtype, dev == "cuda" and peaks.torch_allows_tf32())
        self.run_info.dtype = self._dtype_key
        self._run_info_dirty = True
        if self._peak is None:
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

    # --- fleet (issue 18, issue 16): phases -------------------------------------------------
    def phase(self, name: str) -> Any:
        """``with agent.phase("eval"):`` / ``"checkpoint"`` / ``"checkpoint_load"``: time that is not training.

        The block's time goes to its goodput bucket (``mfuwatch_goodput_seconds_total{bucket}``),
        stays out of step time (the next step is timed from the block's end) and pauses the
        stalled-loop alert (``TrainingStalled``) and the hang watchdog. Use it between optimizer
        steps on the training thread. Exceptions inside the block propagate unchanged.

        Raises:
            ValueError: an unknown phase name (the message lists the accepted ones).
        """
        from .goodput import phase_bucket

        bucket = phase_bucket(name)  # a typo fails at the call, naming the accepted names
        fleet = self.fleet
        if fleet is None or self._closed:
            return contextlib.nullcontext()
        from .fleet import Phase

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
            self.clock.mark(self._step, int(tokens or 0), loss)
            if self.fleet is not None:
                self.fleet.boundary(self._step)  # fleet: goodput bucket of the step, hang watchdog
            prof = self.profiler
            if prof is not None:
                prof.on_step(self._step, self.latest.step_time_seconds if self.latest else None)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("hooks", exc)

    # -------------------------------------------------------------- agent thread
    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._tick(final=False)
        self._tick(final=True)

    def _tick(self, final: bool) -> None:
        """One pass of the agent thread. Each part has its own guard: a full disk under the timeline or a
        broken exporter is counted under its component while steps are still counted and alerts still fed."""
        if self._run_info_dirty:  # dtype / peak settled after start: a later "run" record supersedes
            self._run_info_dirty = False
            self._write(to_record("run", self.run_info))
        intervals = []
        with self.errors.guard("clock"):
            intervals = self.clock.poll()
        for iv in intervals:
            with self.errors.guard("agent"):
                self._absorb(iv)
                if self._acc.steps >= self.config.report_every_steps:
                    self._report()  # one measurement per report_every_steps, however many steps one poll finds
        with self.errors.guard("agent"):
            acc = self._acc
            due = acc.steps > 0 and time.monotonic() - acc.start >= 10.0  # slow steps: at least every 10 s
            if due or (final and acc.steps > 0):
                self._report()

    def _absorb(self, iv: Interval) -> None:
        acc = self._acc
        timed = iv.seconds == iv.seconds  # NaN for the untimed first step
        acc.steps += iv.steps
        acc.tokens += iv.tokens
        if timed:
            acc.seconds += iv.seconds
            acc.timed_steps += iv.steps
            acc.timed_tokens += iv.tokens
        acc.last = iv
        with self.errors.guard("exporter"):
            self.exporter.observe_steps(iv.steps, iv.tokens, iv.seconds / iv.steps if timed else None)
        if self.fleet is not None:  # fleet: FLOP and step-time counters, straggler score
            with self.errors.guard("fleet"):
                self.fleet.on_interval(iv.steps, iv.seconds, iv.tokens, self.flops_per_step)

    def flops_per_step(self, tokens_per_step: float) -> tuple:
        """``(model, hardware)`` FLOPs for one optimizer step of ``tokens_per_step`` tokens, or ``(None, None)``."""
        return self.flop_model.flops_per_step(tokens_per_step, self._seq_len)

    def flops_breakdown(self, print_it: bool = True, count: bool = False) -> str:
        """The FLOP number explained: source, per-component FLOPs of one step and the formula of each.

        Uses the latest report's tokens per step (one sequence before the first report).
        ``count=True`` adds FlopCounterMode's count of one step of the model rebuilt from its
        Hugging Face config on the meta device (no memory, no compute; adapters added after
        loading are not in the rebuild) and the compute ops that counted 0. Call it off the hot
        path. Returns the text; prints it too unless ``print_it`` is false.
        """
        m = self.latest
        tokens = m.tokens / m.steps if (m is not None and m.steps) else None
        text = self.flop_model.breakdown(tokens, self._seq_len, count=count)
        if print_it:
            print(text)
        return text

    def _report(self) -> None:
        acc, self._acc = self._acc, _ReportSums()
        last: Interval = acc.last
        loss = last.loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss.item())  # its step has completed on the device: no wait
        if acc.timed_steps == 0 or acc.seconds <= 0:
            return
        step_time = acc.seconds / acc.timed_steps
        tokens_per_step = acc.timed_tokens / acc.timed_steps
        model_f, hw_f = self.flops_per_step(tokens_per_step)
        if self._peak is None and self._dtype_key is not None and not self._peak_warned:
            self._choose_mfu_peak()
        peak = self._peak
        mfs = model_f / step_time if model_f else 0.0
        m = StepMeasurement(
            step=last.last_step, steps=acc.steps, timestamp=last.end_wall, step_time_seconds=step_time,
            tokens=acc.tokens, tokens_per_second=tokens_per_step / step_time,
            model_flops=model_f or 0.0, hardware_flops=hw_f or 0.0, model_flops_per_second=mfs,
            mfu=(mfs / peak) if (peak and model_f) else None,
            hfu=(hw_f / step_time / peak) if (peak and hw_f) else None,
            loss=loss if (loss is None or math.isfinite(loss)) else None,
            tokens_per_step=tokens_per_step,
        )
        if m.mfu is not None and m.mfu > 1.0 and not self._mfu_warned:
            self._mfu_warned = True
            log.warning("mfuwatch: MFU %.0f%% is above 100%%: the peak (%.3g FLOP/s, %s) is too low for this "
                        "device — a calibration taken while the machine was busy, or the wrong dtype; pass "
                        "peak_flops=<FLOP/s> for a trustworthy MFU", m.mfu * 100, peak, self.run_info.peak_source)
        self.latest = m
        with self.errors.guard("exporter"):
            self.exporter.collector.update(step=m)
        self._write(to_record("step", m))
        if self.alerts is not None:
            with self.errors.guard("alerts"):
                self.alerts.observe_step(m)

    def _on_gpu_sample(self, sample: GpuHealth) -> None:
        with self.errors.guard("exporter"):
            self.exporter.collector.update(gpu=sample)
        if self.alerts is not None:
            with self.errors.guard("alerts"):
                self.alerts.observe_gpu(sample)
        if sample.timestamp - self._last_gpu_write >= 10.0:
            self._last_gpu_write = sample.timestamp
            self._write(to_record("gpu", sample))

    def _on_window(self, window: WindowMeasurement) -> None:
        self.latest_window = window
        with self.errors.guard("exporter"):
            self.exporter.collector.update(window=window)
        self._write(to_record("window", window))
        if self.alerts is not None:
            with self.errors.guard("alerts"):
                self.alerts.observe_window(window)

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float = 1.0) -> None:
        """Remove the hooks, flush the last measurement, stop threads and the server. Idempotent.

        Args:
            timeout: seconds a profiler-window analysis still running may take to deliver its window
                (its result is dropped after that). The default keeps ``close()`` short at the end of a
                job; the demo passes a longer one so a short run still shows its last window.
        """
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            with self.errors.guard("close"):
                h.remove()
        self._handles.clear()
        self.flop_model.close()
        if self.device.type == "cuda":
            # let the last boundaries complete so the final interval is reported (close() is off the hot path)
            with self.errors.guard("close"):
                torch.cuda.synchronize(self.device)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.profiler is not None:
            with self.errors.guard("close"):
                self.profiler.close(wait_seconds=timeout)
        if self.nvml is not None:
            with self.errors.guard("close"):
                self.nvml.close()
        if self.alerts is not None:
            with self.errors.guard("close"):
                self.alerts.evaluate()  # once more: the last report and window arrived during close
                self.alerts.close()
        with self.errors.guard("close"):
            self.exporter.close()
        if self._sd_target is not None:
            with self.errors.guard("close"):
                self._sd_target.remove()
        if self.fleet is not None:
            with self.errors.guard("fleet"):
                self.fleet.close()  # fleet: watchdog thread, checkpoint hooks, the goodput tail
        if self.otlp is not None:
            with self.errors.guard("otlp"):
                self.otlp.close()
        with self.errors.guard("timeline"):
            self.timeline.close()
        _live_agents.discard(self)

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


_live_agents: "weakref.WeakSet[Agent]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for a in list(_live_agents):
        try:
            a.close()
        except Exception:  # noqa: BLE001
            pass


import atexit  # noqa: E402

atexit.register(_close_all_at_exit)


def _dkey(dtype: torch.dtype) -> str:
    return _DTYPE_KEYS.get(dtype, str(dtype))


def _autocast_takes_device() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:
        return False


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mfuwatch")
    except Exception:  # noqa: BLE001
        return "0"
