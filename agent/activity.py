"""GPU activity (NVML GPM) averaged over the same interval as a step report's MFU.

The NVML sampler delivers one :class:`~mfuwatch.agent.schema.GpuHealth` about once a second; its
``sm_active``/``tensor_active``/``dram_active`` are the hardware's averages since the previous sample
(``nvmlGpmMetricsGet`` over two ``nvmlGpmSampleGet`` snapshots). A step report's MFU is an average over
its own steps. Comparing the report's MFU with the *last second's* tensor activity pages during every
pause (issue 24: a 45 s ``phase("checkpoint")`` with the GPU idle read as "FLOPs over-counted"), so
:class:`ActivityAverager` keeps the recent samples and averages them, weighted by time, over exactly the
span of the report's timed steps: ``[end - seconds, end]``, with ``end`` the wall time of the last step's
end and ``seconds`` the steps' device time (agent/clock.py).

The bound MFU is compared with is ``tensor_active x SM clock / max SM clock`` (the peak FLOP/s assume the
max clock), averaged as a product, sample by sample, not as a product of averages.

No average (``None``) when: the samples cover less than half of the span (the sampler is off, slow, or
the wall clock was stepped between the two stamps); or an agent phase (eval, checkpoint) was open at any
time since the previous report (its idle time could fall inside the span: the step clock leaves phases
out of step time, so the span reaches back before them).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Deque, Optional, Tuple

from .schema import GpuHealth

#: Samples kept: 10 minutes at the default 1 Hz (a report covers at most ~10 s of steps, or one slow step).
MAX_SAMPLES = 600
#: The share of the span the samples must cover for an average to be given.
MIN_COVERAGE = 0.5


@dataclass(frozen=True)
class ActivityAverage:
    """Time-weighted GPM ratios (0..1) over one report's span; a field is ``None`` where no sample had it."""

    tensor_active: Optional[float]
    tensor_active_bound: Optional[float]  # tensor_active x SM clock / max SM clock
    sm_active: Optional[float]
    dram_active: Optional[float]


class ActivityAverager:
    """Recent GPM samples and their time-weighted average over a span. Thread-safe.

    ``add`` runs on the NVML sampler's thread, ``average`` on the agent thread.
    """

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._lock = threading.Lock()
        # (start, end, tensor, bound, sm, dram): each sample covers (previous sample's stamp, its stamp]
        self._samples: Deque[Tuple[float, float, Optional[float], Optional[float], Optional[float],
                                   Optional[float]]] = collections.deque(maxlen=max_samples)
        self._last_stamp: Optional[float] = None

    def add(self, g: GpuHealth) -> None:
        """Record one NVML sample (``g.timestamp`` unix seconds). Samples without GPM only move the stamp."""
        t = float(g.timestamp)
        with self._lock:
            prev, self._last_stamp = self._last_stamp, t
            if prev is None or t <= prev or g.tensor_active is None and g.sm_active is None \
                    and g.dram_active is None:
                return
            bound = None
            if g.tensor_active is not None and g.sm_clock_hertz and g.sm_clock_max_hertz:
                bound = float(g.tensor_active) * float(g.sm_clock_hertz) / float(g.sm_clock_max_hertz)
            self._samples.append((prev, t, g.tensor_active, bound, g.sm_active, g.dram_active))

    def average(self, start: float, end: float) -> Optional[ActivityAverage]:
        """The time-weighted average over ``[start, end]`` (unix seconds), or ``None`` (see the module doc)."""
        span = end - start
        if not span > 0:
            return None
        sums = [0.0, 0.0, 0.0, 0.0]
        weights = [0.0, 0.0, 0.0, 0.0]
        covered = 0.0
        with self._lock:
            samples = list(self._samples)
        for s0, s1, *values in reversed(samples):  # newest first: a report's span is the last few seconds
            if s1 <= start:
                break
            w = min(s1, end) - max(s0, start)
            if w <= 0:
                continue
            covered += w
            for i, v in enumerate(values):
                if v is not None:
                    sums[i] += float(v) * w
                    weights[i] += w
        if covered < MIN_COVERAGE * span:
            return None
        avg = [sums[i] / weights[i] if weights[i] >= MIN_COVERAGE * span else None for i in range(4)]
        return ActivityAverage(*avg)

    def for_report(self, end: float, seconds: float, since: Optional[float], phase_open: bool,
                   last_phase_end: float) -> Optional[ActivityAverage]:
        """The average over a report's timed steps ``[end - seconds, end]``; ``None`` when a phase was open
        since ``since`` (the previous report's end, unix seconds; ``None`` for the first report) or is open."""
        if phase_open or (last_phase_end and (since is None or last_phase_end > since)):
            return None
        return self.average(end - seconds, end)
