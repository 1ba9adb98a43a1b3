"""Step clock: the time of each optimizer step, without a host-device sync on the hot path.

On CUDA, the step hook records a ``torch.cuda.Event`` on the current stream at
each boundary (a few microseconds, no synchronisation). The agent's own thread
later asks each event ``query()`` — true once the GPU has passed it — and reads
``elapsed_time`` between consecutive completed boundaries: that is the step time
as the GPU saw it, idle gaps (input stalls) included. On the CPU the boundary is
``time.perf_counter()``.

Boundaries are kept in a bounded deque; if the reader falls far behind (the GPU
is hung), the oldest boundaries are merged rather than dropped, so tokens and
step counts are never lost, only the per-step resolution.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional


@dataclass
class Boundary:
    """One optimizer-step boundary as recorded by the hook."""

    step: int  # 1-based index of the optimizer step that just ended
    tokens: int  # tokens of that step (all micro-batches)
    wall: float  # time.time() at the boundary (host clock)
    marker: Any  # torch.cuda.Event on CUDA; perf_counter() float on CPU
    loss: Optional[float] = None
    gap: bool = False  # the time before this mark was not training: the next interval starts here


@dataclass
class Interval:
    """Completed steps between two boundaries, as measured by the device."""

    first_step: int
    last_step: int
    steps: int
    seconds: float  # device time from the boundary before first_step to the one after last_step
    tokens: int
    end_wall: float
    loss: Optional[float] = None


class StepClock:
    """Records boundaries on the training thread; resolves them into intervals on another.

    Args:
        device: a ``torch.device``; CUDA events are used when its type is ``cuda``.
        max_pending: bound on unresolved boundaries kept in memory.
        now: injectable perf_counter-like clock for tests (CPU mode only).
        wall: injectable ``time.time``-like clock for tests.
    """

    def __init__(
        self,
        device: Any,
        *,
        max_pending: int = 4096,
        now: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._device = device
        self._now = now
        self._wall = wall
        self._pending: Deque[Boundary] = collections.deque()
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._last: Optional[Boundary] = None  # last resolved boundary (start of next interval)
        self._merged_tokens = 0  # tokens of boundaries merged away under pressure
        self._base = 0  # optimizer steps done before this clock started (start(step=)): never this clock's

    def _marker(self) -> Any:
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self._device))
            return ev
        return self._now()

    def mark(self, step: int, tokens: int, loss: Optional[float] = None) -> float:
        """Record the boundary at the end of optimizer step ``step`` (training thread, no sync).

        Returns the boundary's wall time (``time.time()`` seconds), the step's end as the host saw it.
        """
        b = Boundary(step=step, tokens=tokens, wall=self._wall(), marker=self._marker(), loss=loss)
        with self._lock:
            if len(self._pending) >= self._max_pending:
                # merge the two oldest unresolved boundaries: keep the later marker, add tokens
                old = self._pending.popleft()
                self._merged_tokens += old.tokens
            self._pending.append(b)
        return b.wall

    def mark_gap(self, step: int) -> None:
        """Restart timing after optimizer step ``step``: the time since the previous boundary was not training.

        For evaluation or checkpointing between steps (training thread, no sync).
        """
        b = Boundary(step=step, tokens=0, wall=self._wall(), marker=self._marker(), gap=True)
        with self._lock:
            if len(self._pending) >= self._max_pending:
                old = self._pending.popleft()
                self._merged_tokens += old.tokens
            self._pending.append(b)

    def start(self, step: int = 0) -> None:
        """Record a starting boundary so the next step (``step + 1``) is timed too.

        ``step``: the optimizer steps already done before this clock started (``mfuwatch run`` attaches
        after the job's first one). They are not this clock's: its first interval is step ``step + 1``,
        and they are counted in no interval (the job's step 1 is not measured, nor counted in
        ``mfuwatch_steps_total``)."""
        with self._lock:
            if self._last is None and not self._pending:
                self._base = step  # the start mark closes no step of this clock: steps 1..step are not counted
                self._pending.append(Boundary(step=step, tokens=0, wall=self._wall(), marker=self._marker()))

    def _done(self, b: Boundary) -> bool:
        return b.marker.query() if self.cuda else True

    def _elapsed(self, a: Boundary, b: Boundary) -> float:
        if self.cuda:
            return a.marker.elapsed_time(b.marker) / 1e3  # ms -> s
        return b.marker - a.marker

    def poll(self) -> List[Interval]:
        """Resolve completed boundaries into intervals (one per step). Call off the training thread."""
        out: List[Interval] = []
        while True:
            with self._lock:
                if not self._pending:
                    break
                b = self._pending[0]
            if not self._done(b):
                break
            with self._lock:
                self._pending.popleft()
                extra, self._merged_tokens = self._merged_tokens, 0
            prev = self._last
            self._last = b
            if b.gap:
                done = prev.step if prev is not None else self._base
                if b.step > done:  # steps whose own boundaries were merged away: counted, untimed
                    out.append(Interval(done + 1, b.step, b.step - done, float("nan"), b.tokens + extra, b.wall))
                elif extra:
                    with self._lock:
                        self._merged_tokens += extra  # belongs to the next interval
                continue
            if prev is None:
                base = self._base
                if b.step > base:  # first boundary without a start mark (or the start merged away): untimed,
                    # and it covers every step since the clock began (steps base+1..b.step), merged ones included
                    out.append(Interval(base + 1, b.step, b.step - base, float("nan"), b.tokens + extra, b.wall,
                                        b.loss))
                continue
            out.append(
                Interval(
                    first_step=prev.step + 1,
                    last_step=b.step,
                    steps=b.step - prev.step,
                    seconds=self._elapsed(prev, b),
                    tokens=b.tokens + extra,
                    end_wall=b.wall,
                    loss=b.loss,
                )
            )
        return out

    @property
    def pending(self) -> int:
        """Boundaries recorded but not yet resolved."""
        with self._lock:
            return len(self._pending)
