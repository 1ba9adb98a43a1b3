"""Hang watchdog: a step that takes far longer than usual records what the training thread is doing.

The training thread only stamps ``time.perf_counter()`` at each step boundary
(:meth:`HangWatchdog.boundary`). A daemon thread wakes every
``check_interval_seconds``; when the current step has run longer than

    threshold = max(floor_seconds, factor × median of the last ``history`` step times)

(learned, so a 40 s step of a big model does not trip a floor meant for 100 ms
steps) it takes, once per stuck step, a :class:`HangReport`: the training
thread's Python stack from ``sys._current_frames()`` (no signal, no pause of
the thread), the innermost frame as "where it waits", and — when torch's NCCL
flight recorder is on (``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0) — the last
collective it recorded. Nothing is killed or interrupted. The report goes to
``on_hang`` (the agent writes it to the timeline and exports
``mfuwatch_hang_info{frame=…}``); when the step finally ends ``on_recover`` is
called. The watchdog is paused during ``agent.phase(...)`` (evaluation and
checkpoints are long on purpose) and before ``min_steps`` steps are known.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional


@dataclass
class HangReport:
    """What a stuck training thread was doing. Durations in seconds; ``timestamp`` is unix time."""

    step: int  # the last completed optimizer step; the stuck one is step + 1
    elapsed_seconds: float  # how long the current step has run when the report was taken
    threshold_seconds: float
    median_step_seconds: float
    where: str  # innermost frame: "path:line in function"
    stack: List[str] = field(default_factory=list)  # outermost first, "path:line in function" each
    last_collective: Optional[str] = None  # from the NCCL flight recorder, e.g. "nccl:all_reduce seq 812 started"
    timestamp: float = 0.0


def thread_stack(thread_id: int, limit: int = 30) -> List[str]:
    """The Python stack of thread ``thread_id`` as ``"path:line in function"`` strings, outermost first.

    Returns ``[]`` when the thread no longer exists.
    """
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return []
    return [f"{fs.filename}:{fs.lineno} in {fs.name}" for fs in traceback.extract_stack(frame, limit=limit)]


def last_nccl_collective() -> Optional[str]:
    """The last entry of torch's NCCL flight recorder, or ``None`` when it is off or unavailable.

    The recorder is on when ``TORCH_FR_BUFFER_SIZE`` (torch >= 2.13) or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0 and a NCCL process
    group exists; its dump (``torch._C._distributed_c10d._dump_nccl_trace``, a pickled
    dict with an ``entries`` list) is read only when a hang is found.
    """
    try:  # torch >= 2.13 names it TORCH_FR_BUFFER_SIZE (the old name still works there, with a warning)
        size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
        if int(size) <= 0:
            return None
    except ValueError:
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    import pickle

    dump = getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None:
        return None
    entries = pickle.loads(dump()).get("entries") or []
    if not entries:
        return None
    e = entries[-1]
    name = e.get("profiling_name") or e.get("frames", [{}])[0].get("name", "collective")
    return f"{name} seq {e.get('collective_seq_id', e.get('seq_id', '?'))} {e.get('state', '')}".strip()


def _user_frame(stack: List[str]) -> str:
    """The innermost frame outside this package's watchdog/threading machinery (the stack is the training thread's)."""
    return stack[-1] if stack else "unknown"


class HangWatchdog:
    """Finds a step that runs ``factor`` × longer than the recent median (with a floor) and reports it.

    Args:
        factor: the multiple of the median step time that counts as a hang (> 1).
        floor_seconds: the smallest threshold, whatever the median (seconds, > 0).
        history: recent step times kept for the median.
        min_steps: step times needed before the watchdog judges.
        check_interval_seconds: how often the thread looks.
        on_hang: called with a :class:`HangReport` once per stuck step (on the watchdog thread).
        on_recover: called with the step number when a reported step ends (on the training thread).
        on_error: called as ``on_error(component, exc)`` when taking a report fails.
        now: ``time.perf_counter``-like clock (tests).

    Raises:
        ValueError: ``factor`` <= 1 or ``floor_seconds`` <= 0.
    """

    def __init__(self, *, factor: float = 5.0, floor_seconds: float = 60.0, history: int = 64, min_steps: int = 3,
                 check_interval_seconds: float = 1.0, on_hang: Optional[Callable[[HangReport], None]] = None,
                 on_recover: Optional[Callable[[int], None]] = None,
                 on_error: Optional[Callable[[str, BaseException], None]] = None,
                 now: Callable[[], float] = time.perf_counter) -> None:
        if not factor > 1:
            raise ValueError(f"hang_factor: expected a number > 1, got {factor!r}")
        if not floor_seconds > 0:
            raise ValueError(f"hang_floor_seconds: expected a number of seconds > 0, got {floor_seconds!r}")
        self.factor = float(factor)
        self.floor_seconds = float(floor_seconds)
        self.min_steps = int(min_steps)
        self.check_interval_seconds = float(check_interval_seconds)
        self._durations: Deque[float] = collections.deque(maxlen=int(history))
        self._now = now
        self._mark: Optional[float] = None  # start of the current step (perf_counter)
        self._step = 0
        self._paused = 0
        self._reported_step: Optional[int] = None
        self._thread_id: Optional[int] = None
        self.on_hang, self.on_recover, self.on_error = on_hang, on_recover, on_error
        self.reports: Deque[HangReport] = collections.deque(maxlen=16)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- training thread ------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """Optimizer step ``step`` ended (training thread): learn its duration, start timing the next."""
        t = self._now()
        if self._thread_id is None:
            self._thread_id = threading.get_ident()
        if self._mark is not None:
            self._durations.append(t - self._mark)
        self._mark, self._step = t, step
        if self._reported_step is not None:
            done, self._reported_step = self._reported_step, None
            if self.on_recover is not None:
                self.on_recover(done)

    def pause(self) -> None:
        """Stop judging (a phase began). Pauses nest."""
        self._paused += 1

    def resume(self) -> None:
        """Judge again (a phase ended); the next step is timed from now."""
        self._paused = max(0, self._paused - 1)
        if not self._paused and self._mark is not None:
            self._mark = self._now()

    # -- watchdog thread ----------------------------------------------------------------------
    def threshold(self) -> Optional[float]:
        """The current hang threshold in seconds, ``None`` until ``min_steps`` step times are known."""
        d = list(self._durations)
        if len(d) < self.min_steps:
            return None
        return max(self.floor_seconds, self.factor * statistics.median(d))

    def check(self) -> Optional[HangReport]:
        """Look once; returns (and hands to ``on_hang``) a new report when the current step is stuck."""
        mark, step = self._mark, self._step
        if self._paused or mark is None or self._reported_step == step:
            return None
        limit = self.threshold()
        if limit is None:
            return None
        elapsed = self._now() - mark
        if elapsed <= limit:
            return None
        stack = thread_stack(self._thread_id) if self._thread_id is not None else []
        collective = None
        try:
            collective = last_nccl_collective()
        except Exception as exc:  # noqa: BLE001 - the flight recorder is optional
            if self.on_error is not None:
                self.on_error("watchdog", exc)
        report = HangReport(step=step, elapsed_seconds=elapsed, threshold_seconds=limit,
                            median_step_seconds=statistics.median(list(self._durations)),
                            where=_user_frame(stack), stack=stack, last_collective=collective, timestamp=time.time())
        self._reported_step = step
        self.reports.append(report)
        if self.on_hang is not None:
            self.on_hang(report)
        return report

    def start(self) -> "HangWatchdog":
        """Start the daemon thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mfuwatch-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.check_interval_seconds):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the watchdog must never die or raise
                if self.on_error is not None:
                    self.on_error("watchdog", exc)

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
