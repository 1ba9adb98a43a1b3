"""The stall clock: seconds without progress, on a monotonic clock, shared by both alert paths.

Progress is an optimizer step ending (:meth:`StallClock.step`, the agent's step hook, on the training
thread) or an agent phase ending (:meth:`StallClock.resume`); while a phase (eval, checkpoint) is open
there is no value. The in-process ``TrainingStalled`` rule reads :meth:`StallClock.seconds`; the agent's
exporter serves the same number as ``mfuwatch_stall_seconds`` at scrape time, so the Prometheus rule
compares the very value the engine compares, and neither moves when the system clock is stepped
(``time.time()`` jumps with NTP or a manual ``date``; ``time.monotonic()`` does not).

Reports (:meth:`StallClock.report`) count as progress only where no step hook feeds the clock (an engine
fed by hand): a report arrives after its steps ended, and a late catch-up report of older steps must not
restart the clock of a stall that is still going on.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class StallClock:
    """Seconds since the last step or phase end, ``None`` before the first step and while a phase is open.

    Args:
        now: a ``time.monotonic``-like clock (seconds; tests pass a fake one).

    Thread-safe: ``step`` is one attribute store (training thread); pause/resume take a small lock.
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self.last_progress: Optional[float] = None  # monotonic seconds of the last step or phase end
        self.fed_by_steps = False  # a step hook feeds the clock: reports no longer count as progress
        self.paused = 0  # open phases

    def step(self, t: Optional[float] = None) -> None:
        """An optimizer step ended at ``t`` (monotonic seconds, default now)."""
        t = self._now() if t is None else float(t)
        self.fed_by_steps = True
        last = self.last_progress
        self.last_progress = t if last is None or t > last else last

    def report(self, t: Optional[float] = None) -> None:
        """A step report arrived at ``t``: progress only for a clock no step hook feeds (see the module doc)."""
        if self.fed_by_steps:
            return
        t = self._now() if t is None else float(t)
        last = self.last_progress
        self.last_progress = t if last is None or t > last else last

    def pause(self) -> None:
        """A phase began: no value until every open phase has ended."""
        with self._lock:
            self.paused += 1

    def resume(self) -> None:
        """A phase ended: the clock restarts now (only once the last open phase ends)."""
        t = self._now()
        with self._lock:
            self.paused = max(0, self.paused - 1)
            if not self.paused and self.last_progress is not None:
                self.last_progress = max(self.last_progress, t)

    def seconds(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds without progress at ``now`` (monotonic, default the clock's now); ``None`` before the first
        step and while a phase is open."""
        if self.paused or self.last_progress is None:
            return None
        now = self._now() if now is None else float(now)
        return max(0.0, now - self.last_progress)
