"""The expressions a rule can alert on, each defined twice: over measurements and in PromQL.

A rule's ``expr`` names one signal from :data:`SIGNALS`; the rule compares the
signal's value with its threshold (``op``). Each signal knows how to compute its
value from the dataclasses of :mod:`mfuwatch.agent.schema` inside the training
process (:class:`MeasurementStore`) and how to write the same quantity as PromQL
over the exported metrics (:func:`Signal.promql`), which is what makes the
in-process engine and the generated Prometheus rules equivalent.

The store is fed on the training thread and the agent's threads: every
``observe_*`` is O(1) under a small lock and keeps only what the signals need.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

from mfuwatch.agent.schema import M, GpuHealth, StepMeasurement, WindowMeasurement

from .fleet_rules import stalled_seconds_expr
from .stall import StallClock
from .validation import format_duration

#: NVML clock-event reasons that mean the GPU slowed itself down (thermal, power brake,
#: hardware slowdown). ``sw_power_cap`` is left out by default: a training GPU at its
#: power limit is normal and would page all the time. Names are NVML's
#: ``nvmlClocksEventReason*`` constants in snake case (NVML API reference, "Clocks Event Reasons").
#: NVML clock-event reason names the agent reports (``nvmlClocksEventReason*``, NVML API reference,
#: "Clock Event Reasons"); a rule's ``reasons`` must name some of these.
THROTTLE_REASONS = ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
                    "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting")
DEFAULT_THROTTLE_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")

#: MFU samples kept for the regression baseline (one per agent report; 4096 reports
#: cover an hour at the default report interval with room to spare).
MFU_HISTORY = 4096


@dataclass(frozen=True)
class Signal:
    """One alertable quantity.

    ``unit`` drives formatting (``ratio`` → percent, ``seconds`` → duration,
    ``count`` → number); ``params`` lists the rule keys it reads (``window``,
    ``offset``, ``reasons``); ``in_process`` is false for signals only Prometheus
    can compute (they need every rank's series); ``dashboard`` is the Grafana
    dashboard uid that shows it.
    """

    name: str
    help: str
    unit: str
    params: Tuple[str, ...]
    in_process: bool
    dashboard: str
    _promql: Callable[[Mapping], str]

    def promql(self, rule: Mapping) -> str:
        """The PromQL expression of this signal (without the comparison) for a rule's params."""
        return self._promql(rule)


def _regex(values) -> str:
    return "|".join(v.replace("|", r"\|") for v in values)


#: The cross-check compares a report only while its steps are recent: the last step or phase end at most
#: this many step times ago, and at least this many seconds (a stalled run or an open phase: no comparison).
FRESH_STEPS = 3.0
FRESH_SECONDS = 60.0
_FRESH = (f"({M.STALL_SECONDS} < clamp_min({FRESH_STEPS:g} * {M.LAST_STEP_DURATION_SECONDS}, "
          f"{FRESH_SECONDS:g}))")

_TRAINING = "mfuwatch-training-mfu"
_GPU = "mfuwatch-gpu-health"
_RANKS = "mfuwatch-cross-rank"

SIGNALS: Dict[str, Signal] = {s.name: s for s in (
    Signal("mfu", "MFU of the latest report interval (None when the peak FLOP/s is unknown)", "ratio", (), True,
           _TRAINING, lambda r: M.MFU),
    Signal("mfu_vs_baseline",
           "MFU over the run's own median MFU in [now-offset-window, now-offset] (1.0 = no change)", "ratio",
           ("window", "offset"), True, _TRAINING,
           lambda r: f"{M.MFU} / quantile_over_time(0.5, {M.MFU}[{format_duration(r['window'])}] "
                     f"offset {format_duration(r['offset'])})"),
    Signal("memory_bound_share", "memory-bound share of GPU busy time in the latest profiler window", "ratio", (),
           True, _TRAINING, lambda r: M.MEMORY_BOUND_SHARE),
    Signal("idle_share", "idle share of wall time in the latest profiler window (input stalls, launch-bound)",
           "ratio", (), True, _TRAINING, lambda r: f'max without (category) ({M.GPU_TIME_SHARE}{{category="idle"}})'),
    # Prometheus: from the later of the last step and the last agent phase's end, no series while a phase is open
    # (the in-process value pauses and restarts the same way: MeasurementStore.pause_stall/resume_stall)
    Signal("seconds_since_last_step", "seconds since the last reported optimizer step (after the first one)",
           "seconds", (), True, _RANKS, lambda r: stalled_seconds_expr()),
    Signal("gpu_throttle_reasons", "number of the listed NVML clock-event reasons active in the latest sample",
           "count", ("reasons",), True, _GPU,
           lambda r: f'sum without (reason) ({M.GPU_CLOCK_EVENT_REASON}{{reason=~"{_regex(r["reasons"])}"}})'),
    # the three counts end with their process (`and` the counter itself: no series once it is stale), as the
    # engine resolves them at close; `increase` alone kept the counted samples for the whole window after the end
    Signal("gpu_xid_errors_increase", "new Xid errors over the last `window`", "count", ("window",), True, _GPU,
           lambda r: f"(increase({M.GPU_XID_ERRORS_TOTAL}[{format_duration(r['window'])}]) "
                     f"and {M.GPU_XID_ERRORS_TOTAL})"),
    Signal("gpu_ecc_uncorrected_increase", "new uncorrected ECC errors over the last `window`", "count", ("window",),
           True, _GPU,
           lambda r: f'sum without (type) (increase({M.GPU_ECC_ERRORS_TOTAL}{{type="uncorrected"}}'
                     f"[{format_duration(r['window'])}]) and {M.GPU_ECC_ERRORS_TOTAL})"),
    Signal("implausible_ratio_increase",
           "MFU and HFU values that came out above 1.0 (impossible; not exported) over the last `window`; a report "
           "with both withheld counts 2",
           "count", ("window",), True, _TRAINING,
           lambda r: f"sum without (ratio) (increase({M.IMPLAUSIBLE_RATIO_TOTAL}[{format_duration(r['window'])}]) "
                     f"and {M.IMPLAUSIBLE_RATIO_TOTAL})"),
    Signal("gpu_memory_used_ratio", "device memory used over total (NVML)", "ratio", (), True, _GPU,
           lambda r: f"{M.GPU_MEMORY_USED_BYTES} / {M.GPU_MEMORY_TOTAL_BYTES}"),
    # both sides over the same interval: the report's MFU and the GPM activity averaged over that report's
    # steps (agent/activity.py); no value while a phase is open or the last step is stale (cross_check_fresh)
    Signal("mfu_tensor_active_excess",
           "MFU minus the tensor-active bound (tensor-active ratio x SM clock / max SM clock, NVML GPM), both "
           "over the same report interval; > 0: more model FLOPs than the tensor cores could have done", "ratio",
           (), True, _GPU, lambda r: f"(({M.MFU} - {M.INTERVAL_TENSOR_ACTIVE_BOUND}) and {_FRESH})"),
    Signal("mfu_tensor_active_fraction",
           "MFU over the tensor-active bound, both over the same report interval; far below 1: FLOPs the model "
           "does not count", "ratio", (), True, _GPU,
           lambda r: f"(({M.MFU} / ({M.INTERVAL_TENSOR_ACTIVE_BOUND} > 0)) and {_FRESH})"),
    Signal("step_time_vs_run_median",
           "a rank's mean step time over `window` divided by the median over the run's ranks (Prometheus only)",
           "ratio", ("window",), False, _RANKS,
           lambda r: (f"(rate({M.STEP_DURATION_SECONDS}_sum[{format_duration(r['window'])}]) / "
                      f"rate({M.STEP_DURATION_SECONDS}_count[{format_duration(r['window'])}])) / on (run) "
                      f"group_left () quantile by (run) (0.5, rate({M.STEP_DURATION_SECONDS}_sum"
                      f"[{format_duration(r['window'])}]) / rate({M.STEP_DURATION_SECONDS}_count"
                      f"[{format_duration(r['window'])}]))")),
)}


class MeasurementStore:
    """The latest measurements and the short histories the signals need.

    ``clock`` is a monotonic clock in seconds (``time.monotonic``; injectable for tests): every duration
    the signals measure (stall, look-back windows) is taken on it, never on the wall clock. ``stall`` is
    the :class:`~mfuwatch.alerts.stall.StallClock` of ``seconds_since_last_step`` (the agent hands the one
    its step hook feeds and its exporter serves; a private one, fed by reports, otherwise). Thread-safe;
    every ``observe_*`` is O(1) amortised and never blocks for long.
    """

    def __init__(self, clock: Callable[[], float], stall: Optional[StallClock] = None) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.step: Optional[StepMeasurement] = None
        self.window: Optional[WindowMeasurement] = None
        self.gpu: Optional[GpuHealth] = None
        self.stall = stall if stall is not None else StallClock(clock)
        self._mfu: Deque[Tuple[float, float]] = collections.deque(maxlen=MFU_HISTORY)
        self._prev_errors: Optional[Tuple[int, int]] = None  # (xid, uncorrected ecc) of the previous sample
        self._xid_events: Deque[Tuple[float, int]] = collections.deque(maxlen=1024)
        self._ecc_events: Deque[Tuple[float, int]] = collections.deque(maxlen=1024)
        self._implausible: Deque[Tuple[float, int]] = collections.deque(maxlen=1024)  # (time, ratios withheld)
        self.hang: Optional[Dict[str, Any]] = None  # fleet: the hang watchdog's report of the current step

    # -- fleet: agent.phase() pauses the stalled-loop signal ------------------------------------
    def pause_stall(self) -> None:
        """An evaluation or checkpoint phase began: ``seconds_since_last_step`` has no value until it ends."""
        self.stall.pause()

    def resume_stall(self) -> None:
        """The phase ended: the stall clock restarts now (as if a step had just ended)."""
        self.stall.resume()

    @property
    def stall_paused(self) -> int:
        """Open agent phases (eval, checkpoint): not a stall."""
        return self.stall.paused

    @property
    def last_step_at(self) -> Optional[float]:
        """Monotonic seconds of the last progress (step or phase end), ``None`` before the first step."""
        return self.stall.last_progress

    # -- fleet: where a stuck training thread waits -------------------------------------------
    def observe_hang(self, report: Optional[Mapping[str, Any]]) -> None:
        """Hold the hang watchdog's report of the current step (``None``: the step ended, forget it).

        ``report`` keys (as :func:`hang_context` reads them): ``where`` (innermost frame,
        ``"path:line in function"``), ``stack`` (frames, outermost first), ``last_collective``
        (str or ``None``), ``step`` (last completed step), ``elapsed_seconds``.

        Raises:
            TypeError, ValueError: a report whose fields are not of those types (nothing is stored).
        """
        hang = None if report is None else hang_context(report)
        with self._lock:
            self.hang = hang

    def latest_hang(self) -> Optional[Dict[str, Any]]:
        """The held hang report (trimmed by :func:`hang_context`), or ``None``."""
        with self._lock:
            return self.hang

    # -- feeding (training thread / agent threads) --------------------------------------------
    def observe_step(self, m: StepMeasurement) -> None:
        """Record one report interval; MFU goes into the baseline history."""
        now = self._clock()
        mfu = None if m.mfu is None else float(m.mfu)  # a bad value raises here, before anything is stored
        with self._lock:
            self.step = m
            self.stall.report(now)
            if mfu is not None:
                self._mfu.append((now, mfu))
            if m.implausible:  # MFU/HFU above 1 withheld by the agent (agent/plausibility.py)
                self._implausible.append((now, len(m.implausible)))

    def observe_window(self, w: WindowMeasurement) -> None:
        """Record the latest profiler window."""
        with self._lock:
            self.window = w

    def observe_gpu(self, h: GpuHealth) -> None:
        """Record one NVML sample; new Xid/ECC errors are the increase over the previous sample.

        The first sample is the baseline (as Prometheus ``increase()`` ignores a
        counter's initial value); a counter that goes down is treated as a reset.
        """
        now = self._clock()
        xid = int(h.xid_errors or 0)
        ecc = int((h.ecc_errors or {}).get("uncorrected", 0) or 0)
        with self._lock:
            self.gpu = h
            if self._prev_errors is not None:
                px, pe = self._prev_errors
                dx = xid - px if xid >= px else xid
                de = ecc - pe if ecc >= pe else ecc
                if dx > 0:
                    self._xid_events.append((now, dx))
                if de > 0:
                    self._ecc_events.append((now, de))
            self._prev_errors = (xid, ecc)

    # -- reading (evaluation threads) ---------------------------------------------------------
    def value(self, signal: str, rule: Mapping, now: float) -> Optional[float]:
        """The signal's current value, or ``None`` when there is nothing to compare (no data yet)."""
        with self._lock:
            if signal == "mfu":
                return None if self.step is None or self.step.mfu is None else float(self.step.mfu)
            if signal == "mfu_vs_baseline":
                return self._mfu_vs_baseline(rule, now)
            if signal == "memory_bound_share":
                return None if self.window is None else float(self.window.memory_bound_share)
            if signal == "idle_share":
                if self.window is None or "idle" not in (self.window.breakdown or {}):
                    return None
                return float(self.window.breakdown["idle"])
            if signal == "seconds_since_last_step":  # None while an agent phase (eval, checkpoint) is open
                return self.stall.seconds(now)
            if signal == "gpu_throttle_reasons":
                if self.gpu is None or not self.gpu.clock_event_reasons:
                    return None
                return float(sum(1 for r in rule["reasons"] if self.gpu.clock_event_reasons.get(r)))
            if signal == "gpu_xid_errors_increase":
                return None if self._prev_errors is None else _sum_since(self._xid_events, now - rule["window"])
            if signal == "implausible_ratio_increase":
                return None if self.step is None else _sum_since(self._implausible, now - rule["window"])
            if signal == "gpu_ecc_uncorrected_increase":
                return None if self._prev_errors is None else _sum_since(self._ecc_events, now - rule["window"])
            if signal in ("mfu_tensor_active_excess", "mfu_tensor_active_fraction"):
                return self._tensor_active_check(signal, now)
            if signal == "gpu_memory_used_ratio":
                g = self.gpu
                if g is None or not g.memory_total_bytes or g.memory_used_bytes is None:
                    return None
                return float(g.memory_used_bytes) / float(g.memory_total_bytes)
        return None  # Prometheus-only signals have no in-process value

    def _tensor_active_check(self, signal: str, now: float) -> Optional[float]:
        """The report's MFU against its own interval's tensor-active bound (caller holds the lock).

        ``None`` without GPM, when the report's interval held a phase (its bound is ``None``), while a phase
        is open, and when the last step is older than ``max(FRESH_SECONDS, FRESH_STEPS x step time)``.
        """
        m = self.step
        if m is None or m.mfu is None or m.tensor_active_bound is None:
            return None
        age = self.stall.seconds(now)
        if age is None or age >= max(FRESH_SECONDS, FRESH_STEPS * float(m.step_time_seconds)):
            return None
        bound = float(m.tensor_active_bound)
        if signal == "mfu_tensor_active_excess":
            return float(m.mfu) - bound
        return float(m.mfu) / bound if bound > 0 else None

    def latest_window(self) -> Optional[WindowMeasurement]:
        """The latest profiler window (for suggestions and the top-ops table)."""
        with self._lock:
            return self.window

    def _mfu_vs_baseline(self, rule: Mapping, now: float) -> Optional[float]:
        if self.step is None or self.step.mfu is None:
            return None
        hi = now - rule["offset"]
        lo = hi - rule["window"]
        median = _held_median(self._mfu, lo, hi)
        return None if median is None or median <= 0 else float(self.step.mfu) / median


def _held_median(history: Deque[Tuple[float, float]], lo: float, hi: float) -> Optional[float]:
    """The median over time of a value held from each report to the next, over ``(lo, hi]``.

    Each report's value counts for as long as it was the latest one inside the range, as Prometheus's
    ``quantile_over_time`` over the scraped gauge weighs it (a scrape every interval reads the value held
    then); a median over report counts weighs a slower phase of the run less, since it reports less often.
    ``None`` when no report falls in the range.
    """
    held: List[Tuple[float, float]] = []  # (value, seconds)
    items = list(history)
    for i, (t, v) in enumerate(items):
        end = items[i + 1][0] if i + 1 < len(items) else hi
        w = min(end, hi) - max(t, lo)
        if w > 0 and t <= hi:
            held.append((v, w))
    if not any(lo < t <= hi for t, _ in items) or not held:
        return None
    held.sort()
    half, acc = sum(w for _, w in held) / 2.0, 0.0
    for v, w in held:
        acc += w
        if acc >= half:
            return v
    return held[-1][0]


def _sum_since(events: Deque[Tuple[float, int]], since: float) -> float:
    return float(sum(n for t, n in events if t > since))


#: Frames of a stuck training thread an alert carries (innermost first) and the length of each: enough to
#: see the wait (a data loader's queue.get, a collective's wait, a lock) and its caller in the training
#: script, short enough for a Slack section (3,000 characters) and a pager line.
HANG_FRAMES = 8
HANG_FRAME_CHARS = 160


def _cut_left(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters from the left (a frame's end holds ``file:line in function``)."""
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def hang_context(report: Mapping[str, Any]) -> Dict[str, Any]:
    """Where a stuck training thread waits, trimmed for an alert.

    ``report`` has ``where`` (str), ``stack`` (list of ``"path:line in function"``, outermost first) and
    optionally ``last_collective`` (str or None), ``step`` (int), ``elapsed_seconds`` (float), ``source``
    (str: who took the stack). Returns ``{"where", "frames", "last_collective", "step", "elapsed_seconds",
    "source"}`` with ``frames`` the innermost :data:`HANG_FRAMES` frames, innermost first, each at most
    :data:`HANG_FRAME_CHARS` characters.

    Raises:
        TypeError, ValueError: a field of the wrong type.
    """
    stack = [str(f) for f in (report.get("stack") or [])]
    where = str(report.get("where") or (stack[-1] if stack else "unknown"))
    collective = report.get("last_collective")
    step = report.get("step")
    elapsed = report.get("elapsed_seconds")
    return {"where": _cut_left(where, HANG_FRAME_CHARS),
            "frames": [_cut_left(f, HANG_FRAME_CHARS) for f in reversed(stack[-HANG_FRAMES:])],
            "last_collective": None if collective in (None, "") else _cut_left(str(collective), HANG_FRAME_CHARS),
            "step": None if step is None else int(step),
            "elapsed_seconds": None if elapsed is None else float(elapsed),
            "source": str(report.get("source") or "hang_watchdog")}


def suggestion_rows(window: Optional[WindowMeasurement], limit: int = 3) -> List[dict]:
    """The first ``limit`` suggestions of a window as plain dicts, in the agent's ranking order.

    The agent ranks existing PyTorch fixes first; when none of the first ``limit`` is a
    bundled mfuwatch kernel, a bundled one is appended, so the alert always names the
    drop-in when there is one: the first that no other suggested fix covers (``covered_by``
    None: e.g. not one whose ops ``torch.compile`` fuses too), else the first, which then
    carries its ``covered_by`` so the text can say that fix already covers it. Each row:
    ``kernel, title, apply, expected_gain, kind, ops, covered_by, gain_in_set``.
    """
    if window is None:
        return []
    every = list(window.suggestions or [])
    chosen = every[:limit]
    if not any(s.kind == "bundled" for s in chosen):
        rest = [s for s in every[limit:] if s.kind == "bundled"]
        chosen += ([s for s in rest if not getattr(s, "covered_by", None)] or rest)[:1]
    return [{"kernel": s.kernel, "title": s.title, "apply": s.apply, "expected_gain": float(s.expected_gain),
             "kind": s.kind, "ops": list(s.ops), "covered_by": getattr(s, "covered_by", None),
             "gain_in_set": getattr(s, "gain_in_set", None)} for s in chosen]


def covered_text(row: dict) -> str:
    """``"; covered by torch_compile (in the set it adds 0.0%)"`` for a suggestion row another suggested fix
    already covers, else ``""``."""
    by = row.get("covered_by")
    if not by:
        return ""
    g = row.get("gain_in_set")
    return f"; covered by {by}" + (f" (in the set it adds {g:.1%})" if isinstance(g, (int, float)) else "")


def memory_bound_ops(window: Optional[WindowMeasurement], limit: int = 5) -> List[dict]:
    """The window's top memory-bound ops as ``{"op", "share", "time_seconds"}``, largest share first."""
    if window is None:
        return []
    ops = sorted((o for o in (window.top_ops or []) if o.bound == "memory"), key=lambda o: o.share, reverse=True)
    return [{"op": o.op, "share": float(o.share), "time_seconds": float(o.time_seconds)} for o in ops[:limit]]
