"""In-process straggler score: how a rank's recent steps compare with its own best recent steps.

    score = (10th percentile of the last ``history`` step times) / (median of the last ``recent`` step times)

1.0 means the rank runs as fast as its best recent steps; 0.77 means its
current steps take 1.3× its best. It needs no other rank, so it is there
before any Prometheus query and tells "this rank got slower" (a throttling
GPU, a noisy neighbour, a slow disk) apart from "this rank was always the slow
one" (the cross-rank ratio ``rank / min over ranks`` of the recording rules,
``docs/fleet.md``). Step times are the device-timed intervals of the step
clock, fed on the agent's thread; exported as ``mfuwatch_straggler_score_ratio``.
"""

from __future__ import annotations

import collections
import statistics
from typing import Deque, Optional


class StragglerScore:
    """Rolling 0–1 score of recent step time against the rank's own best recent steps.

    Args:
        history: step times kept for the "best" reference (a low percentile).
        recent: the latest step times whose median is "now".
        best_quantile: the percentile of the history taken as the best steps (0..1).
        min_steps: observations needed before a score is given.

    Raises:
        ValueError: non-positive sizes, ``recent`` > ``history``, or a quantile outside (0, 1).
    """

    def __init__(self, history: int = 256, recent: int = 8, best_quantile: float = 0.1, min_steps: int = 16) -> None:
        if history < 1 or recent < 1 or recent > history:
            raise ValueError(f"straggler score: expected 1 <= recent <= history, got recent={recent} history={history}")
        if not 0 < best_quantile < 1:
            raise ValueError(f"straggler score: best_quantile must be in (0, 1), got {best_quantile}")
        self._times: Deque[float] = collections.deque(maxlen=history)
        self.recent = recent
        self.best_quantile = best_quantile
        self.min_steps = max(min_steps, recent)

    def observe(self, step_seconds: float, steps: int = 1) -> None:
        """Add ``steps`` optimizer steps of mean duration ``step_seconds`` (NaN or <= 0 is ignored)."""
        if not step_seconds > 0:  # also false for NaN
            return
        for _ in range(min(int(steps), self._times.maxlen or 1)):
            self._times.append(float(step_seconds))

    def score(self) -> Optional[float]:
        """The current score in (0, 1], or ``None`` before ``min_steps`` step times."""
        t = list(self._times)
        if len(t) < self.min_steps:
            return None
        ordered = sorted(t)
        best = ordered[min(len(ordered) - 1, int(self.best_quantile * len(ordered)))]
        now = statistics.median(t[-self.recent:])
        return min(1.0, best / now) if now > 0 else None
