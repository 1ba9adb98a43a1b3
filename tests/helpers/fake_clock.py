"""A clock that moves only when the test moves it: stands in for ``time.perf_counter``, ``time.monotonic``
or ``time.time`` wherever a part takes a ``now`` callable."""

from __future__ import annotations


class FakeClock:
    """``clock()`` returns :attr:`t` (seconds, from ``start``); ``clock.advance(s)`` or ``clock.t += s`` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` forward; returns the new time."""
        self.t += seconds
        return self.t
