"""Fleet accounting of one agent: aggregation-friendly counters, goodput, phases, hang watchdog, straggler score.

One :class:`FleetAccounting` per :class:`~mfuwatch.agent.core.Agent` (``agent.fleet``). It owns

* the monotonic counters that make job-level figures plain PromQL over ``rate()``:
  ``mfuwatch_model_flops_total``, ``mfuwatch_hardware_flops_total`` (FLOPs of the
  steps measured so far) and ``mfuwatch_step_seconds_total`` (device time of the
  timed steps), beside ``steps_total``/``tokens_total``;
* goodput (:mod:`mfuwatch.agent.fleet.goodput`): ``mfuwatch_goodput_seconds_total{bucket}``
  and ``mfuwatch_goodput_ratio``;
* ``agent.phase("eval")`` / ``agent.phase("checkpoint")``: the phase's time goes to
  its goodput bucket, is left out of step time (the step clock restarts at the
  phase's end) and pauses both the in-process ``TrainingStalled`` watchdog and the
  hang watchdog; ``mfuwatch_phase_in_progress`` (1 while a phase is open) and
  ``mfuwatch_last_phase_end_timestamp_seconds`` let the Prometheus ``TrainingStalled``
  rules pause and restart their stall clock the same way;
* the hang watchdog (:mod:`mfuwatch.agent.fleet.watchdog`): ``mfuwatch_hangs_total``,
  ``mfuwatch_hang_info{frame}`` while a step is stuck, ``hang`` timeline records, and the
  report handed to ``on_hang`` (the agent wires it to the alert engine's ``observe_hang``, and
  :meth:`FleetAccounting.stall_context` to its ``stall_probe``, so a ``TrainingStalled`` that fires
  before the watchdog judges still says where the thread waits);
* the straggler score (:mod:`mfuwatch.agent.fleet.straggler`): ``mfuwatch_straggler_score_ratio``;
* lost progress after a restart, from the run's own timeline.

Training-thread calls (:meth:`forward_start`, :meth:`boundary`, phases) cost a
``perf_counter()`` and a few attribute writes; everything else runs on the
agent's and the watchdog's threads. Every failure is counted under the
components ``goodput``, ``watchdog``, ``phase`` or ``checkpoint`` and never
reaches the training loop.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from . import checkpoint_hooks
from .goodput import BUCKETS, GoodputClock, ResumeReader, phase_bucket
from ..schema import M
from .straggler import StragglerScore
from .watchdog import HangReport, HangWatchdog, last_nccl_collective, thread_stack

log = logging.getLogger("mfuwatch")


class Phase:
    """``with agent.phase("eval"):`` — the context manager returned by :meth:`FleetAccounting.phase`.

    Re-entrant use nests (an inner phase's time goes to the inner bucket).
    Exceptions inside the block propagate unchanged.
    """

    def __init__(self, fleet: "FleetAccounting", name: str, bucket: str) -> None:
        self._fleet, self.name, self.bucket = fleet, name, bucket

    def __enter__(self) -> "Phase":
        self._fleet.enter(self.name, self.bucket)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._fleet.exit(self.name)


class _FleetCollector(Collector):
    """Scrape-time series: goodput buckets and ratio, straggler score, hang info, phase state."""

    def __init__(self, fleet: "FleetAccounting") -> None:
        self.fleet = fleet

    def collect(self) -> Iterable[Any]:
        f = self.fleet
        base = [f.run, f.rank]
        seconds = f.goodput.snapshot()
        c = CounterMetricFamily(M.GOODPUT_SECONDS_TOTAL, "Wall time of this rank by goodput bucket "
                                "(productive, input_wait, warmup, checkpoint_save, checkpoint_load, eval, "
                                "lost_progress, startup, other)", labels=["run", "rank", "bucket"])
        for b in BUCKETS:
            c.add_metric(base + [b], seconds.get(b, 0.0))
        yield c
        ratio = GoodputClock.ratio(seconds)
        if ratio is not None:
            g = GaugeMetricFamily(M.GOODPUT_RATIO, "Productive step time / wall time since the agent started",
                                  labels=["run", "rank"])
            g.add_metric(base, ratio)
            yield g
        score = f.straggler.score()
        if score is not None:
            g = GaugeMetricFamily(M.STRAGGLER_SCORE, "Best recent step time / current median step time of this "
                                  "rank (1 = as fast as its own best)", labels=["run", "rank"])
            g.add_metric(base, score)
            yield g
        hang = f.current_hang
        g = GaugeMetricFamily(M.HANG_INFO, "1 while the hang watchdog finds the current step stuck; frame = where "
                              "the training thread waits", labels=["run", "rank", "frame", "collective"])
        if hang is not None:
            g.add_metric(base + [hang.where[-200:], (hang.last_collective or "")[:100]], 1.0)
        yield g
        # read the open flag before the end time (enter/exit write them in the other order): a scrape never
        # pairs "no phase open" with the end time of the phase before the one that just closed
        in_phase, ended = f.phase_in_progress, f.last_phase_end_wall
        g = GaugeMetricFamily(M.PHASE_IN_PROGRESS, "1 while an agent phase (eval, checkpoint save or load) is open "
                              "on this rank, else 0: the TrainingStalled rules do not fire then", labels=["run", "rank"])
        g.add_metric(base, 1.0 if in_phase else 0.0)
        yield g
        # from the start (0 before the first phase): a series that appeared only at a phase's end could reach a
        # store's index after the scrape that clears the open flag, and the stall rule would miss it once
        g = GaugeMetricFamily(M.LAST_PHASE_END_TIMESTAMP_SECONDS, "Unix time at which the last agent phase ended "
                              "(0 before the first): the TrainingStalled rules count stalled time from the later of "
                              "this and the last step's end", labels=["run", "rank"])
        g.add_metric(base, ended)
        yield g


@dataclass(frozen=True)
class FleetSettings:
    """The settings fleet accounting reads: the series labels, the timeline to resume from (a path or
    None), goodput's warm-up steps, the hang watchdog (on, factor, floor in seconds) and whether
    ``torch.save``/``load`` are timed as checkpoint phases. :meth:`from_config` takes them from an
    :class:`~mfuwatch.agent.config.AgentConfig`."""

    run: str
    rank: int
    timeline: Optional[str] = None
    goodput_warmup_steps: int = 2
    hang_watchdog: bool = True
    hang_factor: float = 5.0
    hang_floor_seconds: float = 60.0
    auto_checkpoint_phases: bool = True

    @classmethod
    def from_config(cls, cfg: Any) -> "FleetSettings":
        return cls(run=cfg.run, rank=cfg.rank, timeline=cfg.timeline, goodput_warmup_steps=cfg.goodput_warmup_steps,
                   hang_watchdog=cfg.hang_watchdog, hang_factor=cfg.hang_factor,
                   hang_floor_seconds=cfg.hang_floor_seconds, auto_checkpoint_phases=cfg.auto_checkpoint_phases)


def _nothing(*args: Any) -> None:
    return None


class FleetAccounting:
    """The fleet side of one agent (``agent.fleet``); never raises into its callers.

    Args:
        settings: :class:`FleetSettings`.
        registry: the Prometheus registry its counters and collector join.
        errors: the agent's :class:`~mfuwatch.agent.errors.ErrorCounter` (``count``, ``guard``).
        write: appends one timeline record (a dict).
        mark_gap: restarts the step clock (called when the last open phase closes between steps).
        current_step: the training thread's optimizer step count now.
        on_phase: ``on_phase(True)`` when a phase opens, ``on_phase(False)`` when one closes (the agent
            pauses and resumes the alert engine's stall clock with it).
        on_hang: the hang watchdog's report as a mapping when a step is stuck, ``None`` when it recovers.
        now: ``time.perf_counter``-like clock (tests).
    """

    def __init__(self, settings: FleetSettings, *, registry: Any, errors: Any, write: Callable[[dict], None],
                 mark_gap: Callable[[], None] = _nothing, current_step: Callable[[], int] = lambda: 0,
                 on_phase: Callable[[bool], None] = _nothing,
                 on_hang: Callable[[Optional[dict]], None] = _nothing,
                 now: Callable[[], float] = time.perf_counter) -> None:
        cfg = settings
        self.errors = errors
        self._write_record, self._mark_gap, self._current_step = write, mark_gap, current_step
        self._on_phase, self._on_hang_report = on_phase, on_hang
        self.run, self.rank = cfg.run, str(cfg.rank)
        self._base = (self.run, self.rank)
        self._train_thread: Optional[int] = None
        # the thread that builds the agent stands for the training thread until a forward or step names it:
        # a restart loads its checkpoint (torch.distributed.checkpoint.load, torch.load) before the first step
        self._init_thread = threading.get_ident()
        self._in_step = False
        self._closed = False
        self.current_hang: Optional[HangReport] = None
        self._open: list = []  # open phases: (name, bucket, perf_counter at entry)
        #: phase state for the Prometheus stall rules, served at scrape time by _FleetCollector: whether a phase
        #: is open (bool) and the unix time (seconds) the last phase ended (0.0 before the first)
        self.phase_in_progress = False
        self.last_phase_end_wall = 0.0
        self.resume = dict(ResumeReader.ZERO)
        self.goodput = GoodputClock(warmup_steps=cfg.goodput_warmup_steps, redo_steps=0, now=now)
        # harden (#28): the previous attempt's tail is read on its own thread, bounded and validated
        self._attempt_ts = time.time()
        self._attempt_written = False
        self._resume_reader: Optional[ResumeReader] = (ResumeReader(cfg.timeline, on_done=self._resume_ready)
                                                       if cfg.timeline else None)
        if self._resume_reader is not None:
            self._resume_reader.start()
        self.straggler = StragglerScore()
        lab = ["run", "rank"]
        reg = registry
        self.model_flops = Counter(M.MODEL_FLOPS_TOTAL.removesuffix("_total"), "Model FLOPs of the timed "
                                   "optimizer steps (no recomputation)", lab, registry=reg)
        self.hardware_flops = Counter(M.HARDWARE_FLOPS_TOTAL.removesuffix("_total"), "Executed FLOPs of the "
                                      "measured optimizer steps (recomputation included)", lab, registry=reg)
        self.step_seconds = Counter(M.STEP_SECONDS_TOTAL.removesuffix("_total"), "Device time of the timed "
                                    "optimizer steps (phases and gaps excluded)", lab, registry=reg)
        self.hangs = Counter(M.HANGS_TOTAL.removesuffix("_total"), "Steps the hang watchdog found stuck", lab,
                             registry=reg)
        for c in (self.model_flops, self.hardware_flops, self.step_seconds, self.hangs):
            c.labels(*self._base)
        reg.register(_FleetCollector(self))
        self.watchdog: Optional[HangWatchdog] = None
        if cfg.hang_watchdog:
            self.watchdog = HangWatchdog(factor=cfg.hang_factor, floor_seconds=cfg.hang_floor_seconds,
                                         check_interval_seconds=min(1.0, cfg.hang_floor_seconds / 4),
                                         on_hang=self._on_hang, on_recover=self._on_recover,
                                         on_error=self.errors.count, now=now).start()
        self._auto_ckpt = bool(cfg.auto_checkpoint_phases)
        if self._auto_ckpt:
            try:
                checkpoint_hooks.install(self)
            except Exception as exc:  # noqa: BLE001
                self._auto_ckpt = False
                self.errors.count("checkpoint", exc)
        self._graphs = self._compiled_graphs()

    def attempt_record(self) -> dict:
        """The ``attempt`` timeline record that opens this process's part of the timeline, stamped at the
        agent's start.

        ``lost_*``: progress the previous attempt lost (its steps after its last checkpoint, which this
        attempt re-does and counts as ``lost_progress``); ``lost_ignored``: records of its tail ignored as
        implausible (:func:`~.goodput.steps_to_redo`).
        """
        import os
        import socket

        reader = self._resume_reader
        rec = {"kind": "attempt", "pid": os.getpid(), "host": socket.gethostname(), "timestamp": self._attempt_ts,
               **{f"lost_{k}": v for k, v in self.resume.items()}}
        if reader is not None:
            rec["lost_ignored"] = reader.ignored
            if not reader.done:
                rec["lost_pending"] = True  # the read outlasted its wait: the figures above are not known
        return rec

    def _resume_ready(self, out: dict) -> None:
        """The resume read finished (reader thread): the steps to redo start counting as ``lost_progress``."""
        reader = self._resume_reader
        if reader is not None and reader.error is not None:
            self.errors.count("goodput", reader.error)
        self.resume = out
        self.goodput.redo_steps = int(out["steps"])
        if reader is not None and reader.ignored:
            # one warning line (docs/reliability.md): the read did not fail, it skipped records; each is counted
            # in mfuwatch_agent_errors_total{component="resume"}
            text = (f"{reader.ignored} record(s) of the timeline's tail ignored for the lost-progress figure "
                    "(implausible step numbers, non-finite values, oversized or garbled lines)")
            log.warning("mfuwatch: %s; counted in mfuwatch_agent_errors_total{component=\"resume\"}", text)
            exc = ValueError(text)
            for _ in range(reader.ignored):
                self.errors.count("resume", exc, quiet=True)

    def ensure_attempt_written(self, timeout: float = 5.0) -> None:
        """Write the ``attempt`` record once (agent thread, before the run record releases the held ones), after
        the resume read — waited for at most ``timeout`` seconds, once."""
        if self._attempt_written:
            return
        self._attempt_written = True
        if self._resume_reader is not None:
            self._resume_reader.result(timeout)
        self._write(self.attempt_record())

    def _wait_resume(self, step: int) -> None:
        """Training thread, only in a race: a step past warm-up before the read finished waits for it (1 s
        at most), so the steps to redo are counted as lost progress from the first one."""
        reader = self._resume_reader
        if reader is not None and not reader.done and step > self.goodput.warmup_steps:
            reader.result(1.0)

    # ---------------------------------------------------------------- training thread
    def forward_start(self) -> None:
        """A training forward began (the model's forward pre-hook); counts once per step."""
        if self._in_step:
            return
        try:
            self._in_step = True
            if self._train_thread is None:
                self._train_thread = threading.get_ident()
            self.goodput.forward_start()
        except Exception as exc:  # noqa: BLE001
            self.errors.count("goodput", exc)

    def boundary(self, step: int) -> None:
        """Optimizer step ``step`` ended (the agent's step boundary)."""
        try:
            self._in_step = False
            if self._train_thread is None:
                self._train_thread = threading.get_ident()
            graphs = self._compiled_graphs()
            compiled = graphs > self._graphs
            self._graphs = graphs
            self._wait_resume(step)
            self.goodput.boundary(step, compiled)
            if self.watchdog is not None:
                self.watchdog.boundary(step)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("goodput", exc)

    @staticmethod
    def _compiled_graphs() -> int:
        """Graphs compiled by ``torch.compile`` so far (0 when dynamo was never imported): a dict read."""
        dyn = sys.modules.get("torch._dynamo.utils")
        if dyn is None:
            return 0
        try:
            return int(dyn.counters["stats"]["unique_graphs"])
        except Exception:  # noqa: BLE001 - a torch without this counter: no recompilation detection
            return 0

    def phase(self, name: str) -> Phase:
        """A context manager for a phase (``"eval"``, ``"checkpoint"``, ``"checkpoint_load"``).

        Raises:
            ValueError: an unknown phase name (listing the accepted ones), at the call.
        """
        return Phase(self, name, phase_bucket(name))

    def enter(self, name: str, bucket: Optional[str] = None) -> None:
        """Open phase ``name`` (also for framework callbacks with no ``with`` block). Never raises."""
        try:
            bucket = bucket or phase_bucket(name)
            if self._train_thread is None:
                self._train_thread = threading.get_ident()
            self.goodput.enter(bucket)
            if self.watchdog is not None:
                self.watchdog.pause()
            self._on_phase(True)
            self._open.append((name, bucket, time.perf_counter()))
        except Exception as exc:  # noqa: BLE001
            self.errors.count("phase", exc)
        self._phase_gauges(None)

    def _phase_gauges(self, ended_at: Optional[float]) -> None:
        """Set the phase series after an enter (``ended_at`` None) or an exit (unix time it ended). Never raises.

        Two attribute stores on the calling (training) thread; the end time is written before the open flag
        (the collector reads them in the other order). Failures are counted under ``phase``.
        """
        try:
            if ended_at is not None:
                self.last_phase_end_wall = float(ended_at)
            self.phase_in_progress = bool(self._open)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("phase", exc)

    def exit(self, name: Optional[str] = None) -> None:
        """Close the innermost open phase (``name``, when given, must match it, else nothing happens)."""
        try:
            opened = self._open
            if not opened or (name is not None and opened[-1][0] != name):
                return
            pname, bucket, t0 = opened.pop()
            wall = time.time()
            self._phase_gauges(wall)  # first: a failure below must not leave the stall rules paused
            state = self.goodput.exit()
            if self.watchdog is not None:
                self.watchdog.resume()
            self._on_phase(False)
            if state == "between" and not opened:
                self._mark_gap()  # the next step is timed from here: the phase stays out of step time
            rec = {"kind": "phase", "name": pname, "bucket": bucket, "step": int(self._current_step()),
                   "seconds": time.perf_counter() - t0, "timestamp": wall}
            self._write(rec)
            if bucket == "checkpoint_save":
                self._write({"kind": "checkpoint", "phase": "save", "step": rec["step"], "seconds": rec["seconds"],
                             "source": pname, "timestamp": rec["timestamp"]})
        except Exception as exc:  # noqa: BLE001
            self.errors.count("phase", exc)

    def open_phase(self) -> Optional[str]:
        """The name of the innermost open phase, or ``None``."""
        opened = self._open
        return opened[-1][0] if opened else None

    # checkpoint_hooks listener protocol
    def owns_thread(self, thread_id: int) -> bool:
        """Whether ``thread_id`` is this agent's training thread (known from its first step or forward)."""
        if self._closed:
            return False
        return self._train_thread == thread_id if self._train_thread is not None else self._init_thread == thread_id

    def checkpoint_enter(self, kind: str, source: str) -> None:
        """A hooked checkpoint call (``source``, e.g. ``"torch.save"``) begins on the training thread."""
        self.enter(source, "checkpoint_save" if kind == "save" else "checkpoint_load")

    def checkpoint_exit(self, kind: str, seconds: float, source: str) -> None:
        """The hooked call ended (or raised): its phase closes."""
        self.exit(source)

    def _write(self, record: dict) -> None:
        try:
            self._write_record(record)
        except Exception as exc:  # noqa: BLE001 - a full disk must not break a phase
            self.errors.count("timeline", exc)

    # ---------------------------------------------------------------- agent thread
    def on_interval(self, steps: int, seconds: float, tokens: int, flops_per_step: Callable[[float], tuple]) -> None:
        """Completed steps from the step clock: FLOP and step-time counters, straggler score.

        ``seconds`` is the interval's device time (NaN for untimed steps);
        ``flops_per_step(tokens_per_step)`` gives ``(model, hardware)`` FLOPs of one step.
        """
        try:
            if steps <= 0:
                return
            if not (seconds == seconds and seconds > 0):  # NaN: the untimed first step
                return  # its FLOPs too stay out: the job MFU is FLOPs over the step time that did them
            model, hw = flops_per_step(tokens / steps)
            if model:
                self.model_flops.labels(*self._base).inc(model * steps)
                self.hardware_flops.labels(*self._base).inc((hw or model) * steps)
            self.step_seconds.labels(*self._base).inc(seconds)
            self.straggler.observe(seconds / steps, steps)
        except Exception as exc:  # noqa: BLE001
            self.errors.count("goodput", exc)

    def _on_hang(self, report: HangReport) -> None:
        self.current_hang = report
        self.hangs.labels(*self._base).inc()
        log.warning("mfuwatch: step %d has run %.0f s (threshold %.0f s, median step %.3g s); the training thread "
                    "waits at %s%s", report.step + 1, report.elapsed_seconds, report.threshold_seconds,
                    report.median_step_seconds, report.where,
                    f"; last collective: {report.last_collective}" if report.last_collective else "")
        import dataclasses

        self._write({"kind": "hang", **dataclasses.asdict(report)})
        self._tell_alerts(self._hang_mapping(report))

    @staticmethod
    def _hang_mapping(report: HangReport) -> dict:
        """A hang report as the plain mapping the alert engine takes (``alerts.signals.hang_context``)."""
        return {"where": report.where, "stack": list(report.stack), "last_collective": report.last_collective,
                "step": report.step, "elapsed_seconds": report.elapsed_seconds, "source": "hang_watchdog"}

    def _tell_alerts(self, report: Optional[dict]) -> None:
        with self.errors.guard("watchdog"):
            self._on_hang_report(report)

    def stall_context(self) -> Optional[dict]:
        """Where the training thread waits now, for a ``TrainingStalled`` alert (the engine's ``stall_probe``).

        The hang watchdog's report of the current step when it has one, else the training thread's
        Python stack taken now (``sys._current_frames()``: the thread is not paused) and the last NCCL
        flight-recorder entry. ``None`` before the training thread is known. Called on the alert
        engine's watchdog thread; never raises (failures are counted under ``watchdog``).
        """
        try:
            hang = self.current_hang
            if hang is not None:
                return self._hang_mapping(hang)
            tid = self._train_thread
            stack = thread_stack(tid) if tid is not None else []
            if not stack:
                return None
            collective = None
            try:
                collective = last_nccl_collective()
            except Exception as exc:  # noqa: BLE001 - the flight recorder is optional
                self.errors.count("watchdog", exc)
            return {"where": stack[-1], "stack": stack, "last_collective": collective,
                    "step": int(self._current_step() or 0), "source": "alert"}
        except Exception as exc:  # noqa: BLE001
            self.errors.count("watchdog", exc)
            return None

    def _on_recover(self, step: int) -> None:
        hang, self.current_hang = self.current_hang, None
        self._tell_alerts(None)
        if hang is not None:
            self._write({"kind": "hang_resolved", "step": step + 1, "timestamp": time.time(),
                         "stuck_seconds": time.time() - hang.timestamp + hang.elapsed_seconds})

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Stop the watchdog, unhook checkpoints, count the tail as ``other``. Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            with self.errors.guard("watchdog"):
                self.watchdog.close()
        if self._auto_ckpt:
            with self.errors.guard("checkpoint"):
                checkpoint_hooks.uninstall(self)
        with self.errors.guard("goodput"):
            self.goodput.close()
