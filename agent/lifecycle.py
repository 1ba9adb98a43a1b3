"""Start-up and shut-down of an agent's components, in their order.

Start: exporter HTTP server, OTLP bridge, file_sd target, timeline, step clock, fleet
accounting, NVML (first: its PCI id identifies the GPU for the peak table), the peak,
alerts, profiler, hooks, then the agent thread. A start-up that raises is undone by
``_abort_start`` (hooks, threads, port, files) before the exception leaves ``Agent()``.
Close runs the same parts in reverse dependency order; every failure there is counted
(``close`` and the part's own component) and closing goes on.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import weakref
from typing import Any, Optional

import torch
from torch import nn

from .agent_thread import _ReportSums
from .clock import StepClock
from .config import ConfigError
from .fleet import FleetAccounting
from .timeline import Timeline

log = logging.getLogger("mfuwatch")


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


class Lifecycle:
    """Mixin of :class:`~mfuwatch.agent.core.Agent`: starts and closes its components.

    Sets ``exporter_url``, ``otlp``, ``_sd_target``, ``timeline``, ``clock``, ``fleet``,
    ``nvml``, ``alerts``, ``profiler``, ``_acc`` and ``_thread``; ``close()`` is idempotent.
    """

    def _start(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Everything after the exporter object exists; on any exception ``__init__`` undoes it."""
        cfg = self.config
        if cfg.file_sd_dir and cfg.exporter:
            _check_writable_dir(cfg.file_sd_dir)
        self.errors.listeners.append(self.exporter.count_error)
        self.exporter.on_error = self.errors.count  # a collector failing at scrape time is counted, once logged
        self.exporter_url = ""
        if cfg.exporter:
            try:
                from .live.settings import auth_from_config  # harden (#28): bounded server, optional auth

                self.exporter_url = self.exporter.serve(
                    cfg.exporter_port, cfg.bind, cfg.tls_certfile, cfg.tls_keyfile,
                    auth=auth_from_config(cfg.exporter_auth, ConfigError),
                    max_connections=cfg.exporter_max_connections, read_timeout_s=cfg.exporter_read_timeout_seconds,
                    handshake_timeout_s=cfg.tls_handshake_timeout_seconds, max_cpu_share=cfg.exporter_max_cpu_share,
                    render_interval_s=cfg.exporter_render_interval_seconds)
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
        # the run record goes first once the dtype and peak settle (the first forward); the timeline holds
        # what comes before it, such as the attempt record (agent/timeline.py)
        self.timeline.start_header(self._run_record)
        # fleet: the attempt record (and what the previous attempt lost) is written by the agent thread once the
        # resume read, off this thread, has finished (harden #28: FleetAccounting.ensure_attempt_written)
        self._run_info_dirty = False
        self._acc = _ReportSums()
        self._thread = threading.Thread(target=self._loop, name="mfuwatch-agent", daemon=True)
        self._thread.start()
        others = [a for a in list(_live_agents) if a is not self and not getattr(a, "_closed", True)]
        if others:
            log.warning("mfuwatch: another agent is already running in this process (run=%s rank=%d); both count "
                        "the same steps under the same labels, so job-level sums (tokens, FLOPs, goodput) count "
                        "them twice. Close the first agent (agent.close() or its with-block) before starting "
                        "another.", others[0].config.run, others[0].config.rank)
        _live_agents.add(self)
        # harden (#28): a forked child gets an inert agent; preemption signals close the agent, then pass on
        from .live import forksafe, preemption

        self._unfork = forksafe.protect_agent(self, _live_agents)
        self._unsignal = lambda: None
        try:
            self._unsignal = preemption.attach(self)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("preemption", exc)
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

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float = 1.0, *, reason: str = "run ended", budget_s: Optional[float] = None) -> None:
        """Remove the hooks, flush the last measurement, stop threads and the server. Idempotent.

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
        import time as _time

        deadline = None if budget_s is None else _time.monotonic() + budget_s

        def left(default: float, share: float = 1.0) -> float:  # harden (#28): a wait's share of the budget
            if deadline is None:
                return default
            return max(0.0, min(default, (deadline - _time.monotonic()) * share))

        for undo in (getattr(self, "_unsignal", None), getattr(self, "_unfork", None)):
            if undo is not None:
                with self.errors.guard("close"):
                    undo()
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
            self._thread.join(timeout=left(5.0, 0.4))
        if self.profiler is not None:
            with self.errors.guard("close"):
                self.profiler.close(wait_seconds=left(timeout, 0.2))
        if self.nvml is not None:
            with self.errors.guard("close"):
                self.nvml.close()
        if self.alerts is not None:
            with self.errors.guard("close"):
                self.alerts.evaluate()  # once more: the last report and window arrived during close
                self.alerts.close(timeout=left(2.0, 0.75), reason=reason)
        with self.errors.guard("close"):
            self.exporter.close(timeout=left(1.0, 0.5))
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


_live_agents: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for a in list(_live_agents):
        try:
            a.close()
        except Exception:  # noqa: BLE001
            pass


atexit.register(_close_all_at_exit)
