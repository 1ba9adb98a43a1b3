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

``Agent`` is the composition root. It builds its parts in one order — exporter server, OTLP
bridge, file-SD target, timeline, step clock, reporter (the agent thread's loop, not yet
running), alert engine, fleet accounting, NVML sampler (its PCI id picks the peak-table row),
the peak, profiler sampler, training-thread hooks, then starts the reporter's thread and installs
the hooks — recording each part's close in one list, which ``close()`` and a failed start-up both
walk in reverse. Each part owns its state and is handed narrow callables or small dataclasses
(:class:`~.live.hooks.HookWiring`, :class:`~.live.reporter.ReportWiring`,
:class:`~.fleet.accounting.FleetSettings`), never the agent; the wiring between parts (fleet's
phases and hangs to the alert engine, the dtype to the peak) is done here. The MFU denominator is
:func:`~.device.peak_choice.choose_mfu_peak`'s, called on the training thread when the dtype is known.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import time
import weakref
from typing import Any, Callable, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .config import AgentConfig, ConfigError, load_config  # noqa: F401  (ConfigError: raised by Agent())
from .device import calibrate, peaks
from .device.peak_choice import MfuPeak, PeakSettings
from .errors import ErrorCounter
from .fleet.accounting import FleetAccounting, FleetSettings
from .fleet.job import job_labelled_view, resolve_job
from .flops import model as flops_mod
from .live.clock import StepClock
from .live.exporter import Exporter
from .live.hooks import HookWiring, TrainingHooks, count_tokens  # noqa: F401  (count_tokens: public, used by integrations)
from .live.reporter import Reporter, ReportWiring
from .live.timeline import Timeline
from .activity import ActivityAverager
from .plausibility import ImplausibleRatioGuard
from .flops.conventions import formula_inputs
from .schema import RunInfo, StepMeasurement, WindowMeasurement

log = logging.getLogger("mfuwatch")


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
        self._closed = False
        self._started = False
        self._close_timeout = 1.0
        #: (component, close) of every part started so far, in start order; closed in reverse
        self._parts: List[Tuple[str, Callable[[], None]]] = []
        self.flop_model = flops_mod.FlopModel(model, cfg, self.errors)
        self.run_info = RunInfo(
            run=cfg.run, rank=cfg.rank, local_rank=cfg.local_rank, world_size=cfg.world_size,
            host=socket.gethostname(), device=str(self.device), gpu_name=self._gpu_name(),
            dtype=cfg.dtype or "", flops_source=self.flop_model.source,
            flops_convention=cfg.flops_convention or "", flops_inputs=formula_inputs(self.flop_model),
            versions={"torch": torch.__version__.split("+")[0], "mfuwatch": _version()},
        )
        self.run_info.job = resolve_job(cfg.run, cfg.job)  # fleet: the `job` label (agent/fleet/job.py)
        share = self._calibration_share()
        self.peak = MfuPeak(PeakSettings(cfg.peak_flops, cfg.calibrate, self.device.type, model is not None),
                            device=self.device, run_info=self.run_info, errors=self.errors,
                            measure=lambda key: calibrate.measured(self.device, key, share),
                            on_change=lambda: self.reporter.facts_changed())
        self.exporter = Exporter(self.run_info)
        # judge (issue 24): one stall clock for both alert paths, GPM averaged per report interval
        from mfuwatch.alerts.stall import StallClock  # no engine import: alerts may be off

        self.stall_clock = StallClock()
        self.exporter.collector.stall_seconds = self.stall_clock.seconds
        self.registry = self.exporter.registry
        self.exporter.exposed_registry = job_labelled_view(self.exporter.exposed_registry, self.run_info.job)
        self.exporter_url = ""
        self._sd_target = None
        self.otlp = None  # fleet: optional OTLP export of the same series (agent/live/otlp.py)
        self.timeline = Timeline(None)
        self.clock: Optional[StepClock] = None
        self.reporter: Optional[Reporter] = None
        self.alerts = None
        self.fleet: Optional[FleetAccounting] = None  # fleet: counters, goodput, phases, hang watchdog
        self.nvml = None
        self.profiler = None
        self.hooks: Optional[TrainingHooks] = None
        try:
            self._start(model, optimizer)
        except BaseException:
            self._close_parts()  # nothing the failed start-up began may outlive it: port, threads, hooks
            self._closed = True
            _live_agents.discard(self)
            raise

    # ------------------------------------------------------------------ start-up, in order
    def _part(self, component: str, close: Callable[[], None]) -> None:
        """Record a started part's close; :meth:`_close_parts` runs them in reverse, each under ``component``.

        Each close reads its part at close time (``lambda: self.nvml.close()``), so a part replaced after
        start-up (a test's stand-in) is the one closed."""
        self._parts.append((component, close))

    def _left(self, default: float, share: float = 1.0) -> float:
        """A close wait's bound: ``default`` seconds, or its ``share`` of what is left of ``close``'s budget."""
        deadline = getattr(self, "_close_deadline", None)
        if deadline is None:
            return default
        return max(0.0, min(default, (deadline - time.monotonic()) * share))

    def _close_parts(self) -> None:
        while self._parts:
            component, close = self._parts.pop()
            with self.errors.guard(component):
                close()

    def _start(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> None:
        cfg = self.config
        if cfg.file_sd_dir and cfg.exporter:
            _check_writable_dir(cfg.file_sd_dir)
        self.errors.listeners.append(self.exporter.count_error)
        self.exporter.on_error = self.errors.count  # a collector failing at scrape time is counted, once logged
        self._part("close", lambda: self.exporter.close(timeout=self._left(1.0, 0.5)))
        if cfg.exporter:
            try:
                from .live.settings import auth_from_config  # harden (#28): bounded server, optional auth

                self.exporter_url = self.exporter.serve(
                    cfg.exporter_port, cfg.bind, cfg.tls_certfile, cfg.tls_keyfile,
                    auth=auth_from_config(cfg.exporter_auth, ConfigError),
                    max_connections=cfg.exporter_max_connections, read_timeout_s=cfg.exporter_read_timeout_seconds,
                    handshake_timeout_s=cfg.tls_handshake_timeout_seconds, max_cpu_share=cfg.exporter_max_cpu_share,
                    render_interval_s=cfg.exporter_render_interval_seconds, mode=cfg.exporter_server,
                    server_cpus=cfg.exporter_server_cpus)
                self.run_info.exporter_url = self.exporter_url
            except OSError as exc:
                self.errors.count("exporter", exc)
        self._start_otlp()
        if cfg.file_sd_dir and self.exporter_url:
            from .distributed import register_agent

            self._sd_target = register_agent(self, cfg.file_sd_dir)  # counts its own failures
            if self._sd_target is not None:
                self._part("close", lambda: self._sd_target.remove())
        try:
            self.timeline = Timeline(cfg.timeline)
        except OSError as exc:  # e.g. the timeline's directory is not writable
            raise ConfigError(f"timeline: cannot open {cfg.timeline!r} for appending ({type(exc).__name__}: "
                              f"{exc.strerror or exc}); expected a writable file path or null") from None
        self._part("timeline", lambda: self.timeline.close())
        self.clock = StepClock(self.device)
        self.reporter = Reporter(
            run_info=self.run_info, timeline=self.timeline, exporter=self.exporter, errors=self.errors,
            report_every_steps=cfg.report_every_steps,
            activity=ActivityAverager(),  # GPM averaged over each report's own steps (agent/activity.py)
            ratio_guard=ImplausibleRatioGuard(self.registry, self.run_info),  # MFU/HFU above 1 withheld
            wiring=ReportWiring(poll=lambda: self.clock.poll(), pending=lambda: self.clock.pending,
                                flops_per_step=self.flops_per_step, peak=lambda: self.peak.value,
                                dtype_known=lambda: self._dtype_key is not None, progress_on=self._progress_on))
        self._start_alerts()
        self._start_fleet()
        self._start_nvml()  # before the peak: its PCI device id identifies the GPU in the peak table
        self.peak.resolve_gpu(getattr(self.nvml, "pci_device_id", None) if self.nvml is not None else None)
        self.peak.choose(cfg.dtype)  # the user's peak or a configured dtype's now; else at the first forward
        self._start_profiler()
        self.hooks = TrainingHooks(device=self.device, flop_model=self.flop_model, errors=self.errors,
                                   tokens_per_step=cfg.tokens_per_step, dtype=cfg.dtype,
                                   has_optimizer=optimizer is not None, wiring=self._hook_wiring())
        # the run record goes first once the dtype and peak settle (the first forward); the timeline holds
        # what comes before it, such as the attempt record (agent/live/timeline.py)
        self.timeline.start_header(self._run_record)
        # fleet: the attempt record (and what the previous attempt lost) is written by the reporter once the
        # resume read, off this thread, has finished (FleetAccounting.ensure_attempt_written, issue 28)
        self.reporter.start()
        # at close, once the reporter's final pass wrote the last step record, the local steps come before any
        # wait on the network (alert notifiers, OTLP, the exporter): the file-SD target is removed, the held
        # records reach the timeline and later ones (the alerts' resolutions) go straight out; a close cut
        # short (a past-bound preemption close, a second signal) has done them (issue 28)
        self._part("close", lambda: self._sd_target.remove() if self._sd_target is not None else None)
        self._part("timeline", lambda: self.timeline.release())
        self._part("agent", lambda: self.reporter.close(self._left(5.0, 0.4)))  # stops after one final pass over the last boundaries
        self.hooks.install(model, optimizer)
        self._part("close", self._close_hooks)
        self._started = True
        others = [a for a in list(_live_agents) if a is not self and not getattr(a, "_closed", True)]
        if others:
            log.warning("mfuwatch: another agent is already running in this process (run=%s rank=%d); both count "
                        "the same steps under the same labels, so job-level sums (tokens, FLOPs, goodput) count "
                        "them twice. Close the first agent (agent.close() or its with-block) before starting "
                        "another.", others[0].config.run, others[0].config.rank)
        _live_agents.add(self)
        # a forked child gets an inert agent; preemption signals close the agent, then pass on (issue 28)
        from .live import forksafe, preemption

        self._part("close", forksafe.protect_agent(self, _live_agents))
        try:
            self._part("close", preemption.attach(self))
        except Exception as exc:  # noqa: BLE001
            self.errors.count("preemption", exc)
        if self.exporter_url:
            log.info("mfuwatch: exporting metrics at %s (run=%s rank=%d)", self.exporter_url, cfg.run, cfg.rank)

    def _start_otlp(self) -> None:
        if not self.config.otlp_endpoint:
            return
        try:
            from .live.otlp import OtlpBridge

            self.otlp = OtlpBridge(self.exporter.exposed_registry, endpoint=self.config.otlp_endpoint)
            self._part("otlp", lambda: self.otlp.close())
        except ImportError as exc:
            log.warning("mfuwatch: %s; OTLP export is off", exc)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("otlp", exc)

    def _start_alerts(self) -> None:
        if self.config.alerts is False:
            return
        try:
            from mfuwatch.alerts import AlertEngine

            alerts_cfg = None if self.config.alerts in (None, True) else self.config.alerts
            self.alerts = AlertEngine.from_config(alerts_cfg, run_info=self.run_info, registry=self.registry,
                                                  on_event=self.reporter.write, on_error=self.errors.count,
                                                  stall_clock=self.stall_clock)
            # a notification outcome reaches the next scrape at once (issue 28: a scrape after the send saw 0)
            self.alerts.on_notification = lambda _sink, _outcome: self.exporter.refresh(force=True)
            self.alerts.start()
            self._part("close", self._close_alerts)
            w = self.reporter.wiring
            w.observe_step, w.observe_gpu, w.observe_window = (self.alerts.observe_step, self.alerts.observe_gpu,
                                                               self.alerts.observe_window)
        except (ValueError, TypeError) as exc:
            if type(exc).__name__ == "AlertConfigError":
                # bad alert configuration fails fast, like any other config error (one exception type to catch)
                raise ConfigError(f"alerts: {exc}") from None
            self.errors.count("alerts", exc)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("alerts", exc)
            self.alerts = None

    def _close_alerts(self) -> None:
        if self._started:
            self.alerts.evaluate()  # once more: the last report and window arrived during close
        self.alerts.close(timeout=self._left(2.0, 0.75), reason=getattr(self, "_close_reason", "run ended"))

    def _start_fleet(self) -> None:
        """Fleet accounting, wired to the alert engine here: its phases pause the engine's stall clock, its
        hang reports reach ``observe_hang``, and the engine asks it where a stalled thread waits."""
        stall = self.stall_clock  # both alert paths read it (the engine, and mfuwatch_stall_seconds)

        def on_phase(opened: bool) -> None:
            stall.pause() if opened else stall.resume()

        try:
            self.fleet = FleetAccounting(
                FleetSettings.from_config(self.config), registry=self.registry, errors=self.errors,
                write=self.reporter.write, mark_gap=self.mark_gap, current_step=lambda: self.hooks.step if self.hooks else 0,
                on_phase=on_phase, on_hang=getattr(self.alerts, "observe_hang", lambda report: None))
            self._part("fleet", lambda: self.fleet.close())  # watchdog thread, checkpoint hooks, the goodput tail
            self.reporter.wiring.on_interval = self.fleet.on_interval
            self.reporter.wiring.on_tick = self.fleet.ensure_attempt_written
            fleet = self.fleet
            self.reporter.wiring.phase_state = lambda: (fleet.phase_in_progress, fleet.last_phase_end_wall)
            if self.alerts is not None and hasattr(self.alerts, "stall_probe"):
                self.alerts.stall_probe = self.fleet.stall_context
        except Exception as exc:  # noqa: BLE001
            self.errors.count("fleet", exc)
            self.fleet = None

    def _start_nvml(self) -> None:
        if not self.config.nvml or self.device.type != "cuda":
            return
        try:
            from .device.nvml import NvmlSampler

            self.nvml = NvmlSampler(torch_device=self.device, interval_seconds=self.config.nvml_interval_seconds,
                                    on_sample=self.reporter.on_gpu_sample, on_error=self.errors.count)
            self._part("close", lambda: self.nvml.close())
            self.nvml.start()
        except Exception as exc:  # noqa: BLE001
            self.errors.count("nvml", exc)
            self.nvml = None

    def _start_profiler(self) -> None:
        cfg = self.config
        pe = cfg.profile_every
        if not pe.enabled:
            return
        try:
            from .live.profiler import ProfilerSampler

            self.profiler = ProfilerSampler(
                every_steps=pe.steps, every_seconds=pe.seconds, warmup_steps=cfg.profile_warmup_steps,
                active_steps=cfg.profile_active_steps, device=self.device, peaks=self.gpu_peaks,
                top_k=cfg.top_k_ops, on_window=self.reporter.on_window, on_error=self.errors.count,
                shared_key=self._calibration_share(),
                on_outcome=self.exporter.count_window,  # ok, error, skipped_other_profiler, too_large
            )
            self._part("close", lambda: self.profiler.close(wait_seconds=self._left(self._close_timeout, 0.2)))
        except Exception as exc:  # noqa: BLE001
            self.errors.count("profiler", exc)
            self.profiler = None

    def _hook_wiring(self) -> HookWiring:
        fleet, profiler, reporter, collector = self.fleet, self.profiler, self.reporter, self.exporter.collector

        def last_step_wall(t: float) -> None:
            collector.last_step_wall = t

        def on_step(step: int) -> None:
            latest = reporter.latest
            profiler.on_step(step, latest.step_time_seconds if latest else None)

        # the step clock through self.clock at each call: a test may give the agent a clock on fake time
        return HookWiring(mark=lambda step, tokens, loss: self.clock.mark(step, tokens, loss),
                          clock_start=lambda: self.clock.start(), clock_gap=lambda step: self.clock.mark_gap(step),
                          on_dtype=self._on_dtype,
                          forward_start=fleet.forward_start if fleet is not None else _nothing,
                          boundary=fleet.boundary if fleet is not None else _nothing,
                          on_step=on_step if profiler is not None else _nothing, last_step_wall=last_step_wall,
                          stall_step=self.stall_clock.step)

    def _close_hooks(self) -> None:
        self.hooks.close()
        self.flop_model.close()
        if self.device.type == "cuda":
            # let the last boundaries complete so the final interval is reported (close() is off the hot path)
            with self.errors.guard("close"):
                torch.cuda.synchronize(self.device)

    def _progress_on(self) -> bool:
        on = self.config.progress
        return on is True or (on == "auto" and not self.exporter_url)

    # ------------------------------------------------------------------ peak FLOP/s
    @property
    def _dtype_key(self) -> Optional[str]:
        return self.hooks.dtype_key if self.hooks is not None else self.config.dtype

    def _calibration_share(self) -> Optional[str]:
        """The scope in which CPU ranks of one job share calibrations (``"<run>|<host>"``), else None."""
        if self.config.world_size > 1 and self.device.type == "cpu":
            return f"{self.config.run}|{socket.gethostname()}"
        return None

    @property
    def gpu_peaks(self) -> Optional[peaks.Peaks]:
        """The GPU's peaks from :func:`peaks.resolve_peaks` (None off CUDA or for a GPU not in the table)."""
        return self.peak.gpu_peaks

    def _on_dtype(self, key: str) -> None:
        """Training thread: a forward showed the training dtype (first, or a new one)."""
        self.run_info.dtype = key
        self.reporter.facts_changed()
        self.peak.choose(key)

    # ------------------------------------------------------------------ the training loop's calls
    def step(self, tokens: Optional[int] = None, loss: Any = None) -> None:
        """Mark the end of one optimizer step (use when no optimizer was given to the agent).

        Args:
            tokens: tokens processed in this step (all micro-batches); default: counted
                from the model's inputs, or ``tokens_per_step``.
            loss: optional loss value (float or 0-d tensor), recorded in the timeline
                without a device sync on this thread.
        """
        self.hooks.explicit_step(tokens, loss)

    def mark_gap(self) -> None:
        """Leave the time since the last optimizer step out of step timing (evaluation, checkpointing).

        Call between optimizer steps on the training thread; the next step is timed
        from here. Records one marker (a CUDA event on GPUs): no device sync.
        Framework callbacks call it after evaluation and checkpoint saves.
        """
        if self.hooks is not None and not self._closed:
            self.hooks.mark_gap()

    def record_loss(self, loss: Any) -> None:
        """Attach a loss (float or tensor) to the current step; read later without a sync on this thread."""
        self.hooks.record_loss(loss)

    def phase(self, name: str) -> Any:
        """``with agent.phase("eval"):`` / ``"checkpoint"`` / ``"checkpoint_load"``: time that is not training.

        The block's time goes to its goodput bucket (``mfuwatch_goodput_seconds_total{bucket}``),
        stays out of step time (the next step is timed from the block's end) and pauses the
        stalled-loop alert (``TrainingStalled``) and the hang watchdog. Use it between optimizer
        steps on the training thread. Exceptions inside the block propagate unchanged.

        Raises:
            ValueError: an unknown phase name (the message lists the accepted ones).
        """
        from .fleet.accounting import Phase
        from .fleet.goodput import phase_bucket

        bucket = phase_bucket(name)  # a typo fails at the call, naming the accepted names
        if self.fleet is None or self._closed:
            return contextlib.nullcontext()
        return Phase(self.fleet, name, bucket)

    def begin_phase(self, name: str) -> None:
        """Open phase ``name`` without a ``with`` block (framework callbacks); never raises."""
        if self.fleet is not None and not self._closed:
            self.fleet.enter(name)

    def end_phase(self, name: Optional[str] = None) -> None:
        """Close the innermost open phase (only if it is ``name``, when given); never raises."""
        if self.fleet is not None and not self._closed:
            self.fleet.exit(name)

    # ------------------------------------------------------------------ measurements
    @property
    def latest(self) -> Optional[StepMeasurement]:
        """The latest step report (None before the first)."""
        return self.reporter.latest if self.reporter is not None else None

    @property
    def latest_window(self) -> Optional[WindowMeasurement]:
        """The latest profiler window's measurement (None before the first)."""
        return self.reporter.latest_window if self.reporter is not None else None

    def flops_per_step(self, tokens_per_step: float) -> tuple:
        """``(model, hardware)`` FLOPs for one optimizer step of ``tokens_per_step`` tokens, or ``(None, None)``."""
        seq_len = self.hooks.seq_len if self.hooks else None
        if self._note_seq_len(seq_len) and self.reporter is not None:
            self.reporter.facts_changed()  # learnt after the run record went out: a later run record says it
        return self.flop_model.flops_per_step(tokens_per_step, seq_len)

    def _note_seq_len(self, seq_len: Optional[int]) -> bool:
        """Put the first training forward's sequence length into ``run_info.flops_inputs``; whether it changed."""
        if seq_len and self.run_info.flops_inputs and "seq_len" not in self.run_info.flops_inputs:
            self.run_info.flops_inputs = formula_inputs(self.flop_model, seq_len)
            return True
        return False

    def _run_record(self) -> dict:
        # the run record is written after the first step: its sequence length is known
        self._note_seq_len(self.hooks.seq_len if self.hooks else None)
        return self.reporter.run_record()

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
        text = self.flop_model.breakdown(tokens, self.hooks.seq_len if self.hooks else None, count=count)
        if print_it:
            print(text)
        return text

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float = 1.0, *, reason: str = "run ended", budget_s: Optional[float] = None) -> None:
        """Remove the hooks, flush the last measurement, stop threads and the server: the parts in reverse
        start order. Idempotent.

        Args:
            timeout: seconds a profiler-window analysis still running may take to deliver its window
                (its result is dropped after that). The default keeps ``close()`` short at the end of a
                job; the demo passes a longer one so a short run still shows its last window.
            reason: the ``resolved_reason`` of the alerts still firing (``"run preempted (SIGTERM)"`` from
                :mod:`mfuwatch.agent.live.preemption`).
            budget_s: when given, the whole close is paced to end within about this many seconds (the
                preemption handler's bound): each wait gets its share of what is left.
        """
        if self._closed:
            return
        self._closed = True
        self._close_timeout = timeout
        self._close_reason = reason
        self._close_deadline = None if budget_s is None else time.monotonic() + budget_s
        self._close_parts()
        _live_agents.discard(self)

    # ------------------------------------------------------------------ set-up helpers
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


def _nothing(*args: Any) -> None:
    return None


def _check_writable_dir(path: str) -> None:
    """ConfigError unless ``path`` is (or can be made) a directory this process can write a file in."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".mfuwatch-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"file_sd_dir: cannot write target files in {path!r} ({type(exc).__name__}: "
                          f"{exc.strerror or exc}); expected a writable directory or null") from None


_live_agents: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for a in list(_live_agents):
        try:
            a.close()
        except Exception:  # noqa: BLE001
            pass


atexit.register(_close_all_at_exit)


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
