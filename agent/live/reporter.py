"""The agent thread: polls the step clock, sums intervals, reports one measurement per ``report_every_steps``.

A report turns the summed intervals into a :class:`StepMeasurement` (MFU, HFU, tokens/s,
step time) and hands it to the exporter, the timeline, the alert engine and, when the
exporter is off (config ``progress``), a one-line console summary (:func:`progress_line`);
NVML samples and profiler windows arrive here too. Each output has its own guard: a failing
one is counted under its component (``exporter``, ``timeline``, ``alerts``, ``fleet``,
``progress``) and the others go on.

MFU = model FLOPs per step / step time / peak FLOP/s of one GPU for the training dtype
(PaLM, Chowdhery et al. 2022, appendix B); HFU uses executed FLOPs (recomputation included).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from .clock import Interval
from ..schema import GpuHealth, StepMeasurement, WindowMeasurement, to_record

log = logging.getLogger("mfuwatch")
#: the console progress line's logger; with logging unconfigured its lines go to stderr (:func:`emit_progress`)
progress_log = logging.getLogger("mfuwatch.progress")
#: seconds between two progress lines at least (the final report's line is always printed): a line per
#: report would be ten a second with fast steps
PROGRESS_MIN_SECONDS = 10.0
_stderr_handler = logging.StreamHandler(sys.stderr)
_stderr_handler.setFormatter(logging.Formatter("%(message)s"))


def progress_line(m: StepMeasurement, window: Optional[WindowMeasurement] = None) -> str:
    """One compact console line for a report: step, MFU, tokens/s, step time, memory-bound share.

    ``m.mfu`` ``None`` (no peak FLOP/s) prints ``MFU n/a``; the memory-bound share is that of the
    latest profiler ``window`` (GPU time in memory-bound kernels / busy time), omitted before the first.
    """
    mfu = f"MFU {m.mfu * 100:.1f}%" if m.mfu is not None else "MFU n/a"
    st = m.step_time_seconds
    step_time = f"{st * 1e3:.1f} ms" if st < 1.0 else f"{st:.2f} s"
    parts = [f"mfuwatch: step {m.step}", mfu, f"{m.tokens_per_second:,.0f} tokens/s", f"step {step_time}"]
    if window is not None:
        parts.append(f"memory-bound {window.memory_bound_share * 100:.0f}% (window at step {window.step})")
    return " | ".join(parts)


def emit_progress(text: str) -> None:
    """Log ``text`` at INFO on ``mfuwatch.progress``. When logging is not configured (no handler on the
    logger or its ancestors) the line is written to stderr directly, since Python's last-resort handler
    shows only warnings; a level above INFO set on ``mfuwatch`` or ``mfuwatch.progress`` silences it."""
    if progress_log.hasHandlers():
        progress_log.info(text)
        return
    for name in ("mfuwatch.progress", "mfuwatch"):
        level = logging.getLogger(name).level
        if level != logging.NOTSET:
            if level > logging.INFO:
                return
            break
    _stderr_handler.handle(progress_log.makeRecord(progress_log.name, logging.INFO, __file__, 0, text, (), None))


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



def _nothing(*args: Any) -> None:
    return None


@dataclass
class ReportWiring:
    r"""What the reporter reads and feeds, as narrow callables (the agent sets the optional ones once the
    part they belong to exists).

    ``poll()`` returns the step clock's completed :class:`Interval`\ s and ``pending()`` how many
    boundaries it still holds; ``flops_per_step(tokens_per_step)`` gives ``(model, hardware)`` FLOPs of
    one step; ``peak()`` the MFU denominator now (FLOP/s or None); ``dtype_known()`` whether the
    training dtype is known; ``progress_on()`` whether the console progress line is shown (config
    ``progress``, and no exporter for "auto"); ``on_interval(steps, seconds, tokens, flops_per_step)``
    is fleet accounting's; ``observe_step/observe_gpu/observe_window`` the alert engine's.
    """

    poll: Callable[[], list]
    pending: Callable[[], int]
    flops_per_step: Callable[[float], tuple]
    peak: Callable[[], Optional[float]]
    dtype_known: Callable[[], bool]
    progress_on: Callable[[], bool]
    on_interval: Callable[..., None] = _nothing
    observe_step: Callable[[StepMeasurement], None] = _nothing
    observe_gpu: Callable[[GpuHealth], None] = _nothing
    observe_window: Callable[[WindowMeasurement], None] = _nothing
    #: called first in each tick (fleet's ``ensure_attempt_written``: the attempt record after the resume read)
    on_tick: Callable[[], None] = _nothing
    #: ``(phase open now, wall time of the last phase end)``: fleet accounting's (no cross-check over a phase)
    phase_state: Callable[[], tuple] = lambda: (False, 0.0)


class Reporter:
    """The agent thread's loop and its outputs: one :class:`StepMeasurement` per ``report_every_steps``.

    Owns the sums since the last report, :attr:`latest`, :attr:`latest_window`, the console progress
    state, the run record's state (``facts_changed()`` asks for an updated ``run`` record) and the
    timeline's watermark (:meth:`~mfuwatch.agent.live.timeline.Timeline.advance`); runs on its own
    thread from :meth:`start` until :meth:`close`, then reports once more.

    Args: ``run_info`` (the static facts, written as ``run`` records), ``timeline``, ``exporter`` (the
    output it feeds: ``observe_steps`` and ``collector.update(step=|gpu=|window=)``), ``errors`` (each output guarded under its component), ``report_every_steps``, ``wiring``
    (:class:`ReportWiring`).
    """

    def __init__(self, *, run_info: Any, timeline: Any, exporter: Any, errors: Any, report_every_steps: int,
                 wiring: ReportWiring, activity: Any = None, ratio_guard: Any = None) -> None:
        self.run_info, self.timeline, self.exporter = run_info, timeline, exporter
        self.errors, self.report_every_steps, self.wiring = errors, report_every_steps, wiring
        self.latest: Optional[StepMeasurement] = None
        self.latest_window: Optional[WindowMeasurement] = None
        self._acc = _ReportSums()
        self.facts_pending = False  # facts_changed() since the last run record
        self.activity = activity  # ActivityAverager (agent/activity.py): GPM over each report's steps, or None
        self._activity_since: Optional[float] = None  # wall end of the previous report
        self.ratio_guard = ratio_guard  # ImplausibleRatioGuard (agent/plausibility.py), or None
        self._last_progress: Optional[float] = None  # time.monotonic() of the last console progress line
        self._run_written: Optional[dict] = None  # the last "run" timeline record written
        self._dtype_seen = False  # the dtype was known at the previous tick
        self._last_gpu_write = 0.0  # before the NVML thread starts: its first sample may come at once
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ any thread
    def facts_changed(self) -> None:
        """The run's facts (dtype, peak) changed: the agent thread writes an updated ``run`` record."""
        self.facts_pending = True

    def write(self, record: Dict[str, Any]) -> None:
        """Append one timeline record (any thread; the timeline keeps timestamp order); a failing disk is
        counted (``timeline``) and nothing else stops."""
        with self.errors.guard("timeline"):
            self.timeline.write(record)

    def run_record(self) -> Dict[str, Any]:
        """The ``run`` timeline record of the facts known now (the timeline calls it when it writes it)."""
        rec = to_record("run", self.run_info)
        self._run_written = rec
        return rec

    def start(self) -> None:
        """Start the agent thread (after the timeline's header is pending and the parts are wired)."""
        self.facts_pending = False
        self._acc = _ReportSums()
        self._thread = threading.Thread(target=self._loop, name="mfuwatch-agent", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after one final pass (waits up to ``timeout`` seconds). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    # ------------------------------------------------------------------ agent thread
    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.tick(final=False)
        self.tick(final=True)

    def tick(self, final: bool) -> None:
        """One pass of the agent thread. Each part has its own guard: a full disk under the timeline or a
        broken exporter is counted under its component while steps are still counted and alerts still fed."""
        polled_at = time.time()
        with self.errors.guard("fleet"):  # the attempt record, after the resume read, before the run record
            self.wiring.on_tick()
        intervals = []
        with self.errors.guard("clock"):
            intervals = self.wiring.poll()
        with self.errors.guard("timeline"):
            self._settle_run_record(ready=bool(intervals) or final)
        for iv in intervals:
            with self.errors.guard("agent"):
                self._absorb(iv)
                if self._acc.steps >= self.report_every_steps:
                    self._report()  # one measurement per report_every_steps, however many steps one poll finds
        with self.errors.guard("agent"):
            acc = self._acc
            due = acc.steps > 0 and time.monotonic() - acc.start >= 10.0  # slow steps: at least every 10 s
            if due or (final and acc.steps > 0):
                self._report(final=final)
        with self.errors.guard("timeline"):
            self.timeline.advance(self._watermark(polled_at))

    def _settle_run_record(self, ready: bool) -> None:
        """Write the run record once its facts settle: the first step completed, or the dtype known since the
        previous tick (the peak is chosen in the same forward pre-hook, just after). Facts that change after
        it (a peak learnt later, a new dtype) go out as a later ``run`` record of the same run and rank."""
        if self.timeline.header_pending:
            if ready or self._dtype_seen:
                self.timeline.write_header()
            self._dtype_seen = self.wiring.dtype_known()
            return
        if self.facts_pending:
            self.facts_pending = False
            rec = to_record("run", self.run_info)
            if rec != self._run_written:  # the same facts again (e.g. the dtype re-detected): nothing to add
                self._run_written = rec
                self.write(rec)

    def _watermark(self, polled_at: float) -> Optional[float]:
        """The earliest timestamp a step record still to come can have (unix seconds), or ``None`` = unknown.

        Steps summed but not reported: their last boundary. Else, with no boundary left in the step clock,
        the time of this poll (a later boundary is stamped after it). Else (steps still running on the
        device) the watermark stays where the last report put it.
        """
        acc = self._acc
        if acc.steps > 0 and acc.last is not None:
            return acc.last.end_wall
        if self.wiring.pending() == 0:
            return polled_at
        return None

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
        with self.errors.guard("fleet"):  # fleet: FLOP and step-time counters, straggler score
            self.wiring.on_interval(iv.steps, iv.seconds, iv.tokens, self.wiring.flops_per_step)

    def _report(self, final: bool = False) -> None:
        acc, self._acc = self._acc, _ReportSums()
        last: Interval = acc.last
        loss = last.loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss.item())  # its step has completed on the device: no wait
        if acc.timed_steps == 0 or acc.seconds <= 0:
            return
        step_time = acc.seconds / acc.timed_steps
        tokens_per_step = acc.timed_tokens / acc.timed_steps
        model_f, hw_f = self.wiring.flops_per_step(tokens_per_step)
        peak = self.wiring.peak()
        mfs = model_f / step_time if model_f else 0.0
        activity = None
        if self.activity is not None:
            with self.errors.guard("nvml"):  # GPM over this report's timed steps, not the latest sample
                in_phase, phase_end = self.wiring.phase_state()
                activity = self.activity.for_report(last.end_wall, acc.seconds, self._activity_since,
                                                    bool(in_phase), phase_end)
        self._activity_since = last.end_wall
        m = StepMeasurement(
            step=last.last_step, steps=acc.steps, timestamp=last.end_wall, step_time_seconds=step_time,
            tokens=acc.tokens, tokens_per_second=tokens_per_step / step_time,
            model_flops=model_f or 0.0, hardware_flops=hw_f or 0.0, model_flops_per_second=mfs,
            mfu=(mfs / peak) if (peak and model_f) else None,
            hfu=(hw_f / step_time / peak) if (peak and hw_f) else None,
            loss=loss if (loss is None or math.isfinite(loss)) else None,
            tokens_per_step=tokens_per_step,
            tensor_active=activity and activity.tensor_active,
            tensor_active_bound=activity and activity.tensor_active_bound,
            sm_active=activity and activity.sm_active, dram_active=activity and activity.dram_active,
        )
        if self.ratio_guard is not None:
            m = self.ratio_guard.check(m)  # MFU/HFU above 1: withheld, counted, logged once (agent/plausibility.py)
        self.latest = m
        with self.errors.guard("exporter"):
            self.exporter.collector.update(step=m)
        with self.errors.guard("timeline"):  # after the records stamped before its last step, in time order
            self.timeline.write_in_order(to_record("step", m))
        with self.errors.guard("alerts"):
            self.wiring.observe_step(m)
        with self.errors.guard("progress"):
            self._progress(m, final)
        with self.errors.guard("exporter"):  # harden (#28): scrapes serve this report's bytes from now on
            self.exporter.refresh()

    def _progress(self, m: StepMeasurement, final: bool) -> None:
        """The console line of this report: config ``progress`` true, or ``"auto"`` when no exporter serves
        ``/metrics`` (off, or it failed to start: nothing else shows a sign of life then); at most one per
        :data:`PROGRESS_MIN_SECONDS`, and the final report's line always."""
        if not self.wiring.progress_on():
            return
        now = time.monotonic()
        last = self._last_progress
        if not final and last is not None and now - last < PROGRESS_MIN_SECONDS:
            return
        self._last_progress = now
        emit_progress(progress_line(m, self.latest_window))

    # ------------------------------------------------------------------ NVML and profiler threads
    def on_gpu_sample(self, sample: GpuHealth) -> None:
        """An NVML sample: to the activity average, the exporter and the alerts; to the timeline at most
        every 10 s."""
        if self.activity is not None:
            with self.errors.guard("nvml"):
                self.activity.add(sample)
        with self.errors.guard("exporter"):
            self.exporter.collector.update(gpu=sample)
        with self.errors.guard("alerts"):
            self.wiring.observe_gpu(sample)
        if sample.timestamp - self._last_gpu_write >= 10.0:
            self._last_gpu_write = sample.timestamp
            self.write(to_record("gpu", sample))

    def on_window(self, window: WindowMeasurement) -> None:
        """A profiler window's measurement: to the exporter, the timeline and the alerts."""
        self.latest_window = window
        with self.errors.guard("exporter"):
            self.exporter.collector.update(window=window)
        self.write(to_record("window", window))
        with self.errors.guard("alerts"):
            self.wiring.observe_window(window)
