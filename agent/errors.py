"""Failure containment: count every exception inside the agent, log it once, keep the job going.

The agent must never crash, stall or slow the training job. Every component wraps
its work in :meth:`ErrorCounter.guard` (or calls :meth:`ErrorCounter.count`); the
counter feeds ``mfuwatch_agent_errors_total{component}`` and logs the first
failure of each component with its traceback, later ones at debug level only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Dict, Iterator, List

log = logging.getLogger("mfuwatch")


class ErrorCounter:
    """Thread-safe per-component exception counter with log-once semantics.

    ``listeners`` are called as ``listener(component)`` after each count (the
    exporter uses one to increment its Prometheus counter); a failing listener
    is ignored.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {}
        self.listeners: List[Callable[[str], None]] = []

    def count(self, component: str, exc: BaseException, *, quiet: bool = False) -> None:
        """Record one failure of ``component``. Never raises.

        ``quiet``: count without logging, for a caller that logs its own line (a data problem handled
        as designed, not a failure: the resume read's ignored records)."""
        try:
            with self._lock:
                n = self._counts.get(component, 0) + 1
                self._counts[component] = n
            if quiet:
                pass
            elif n == 1:
                log.warning(
                    "mfuwatch: %s failed (%s: %s); training continues, further %s errors are only counted "
                    "in mfuwatch_agent_errors_total",
                    component, type(exc).__name__, exc, component, exc_info=exc,
                )
            else:
                log.debug("mfuwatch: %s failed again: %r", component, exc)
            for listener in list(self.listeners):
                try:
                    listener(component)
                except Exception:  # noqa: BLE001 - a broken listener must not break the agent
                    pass
        except Exception:  # noqa: BLE001 - counting itself must never raise
            pass

    @contextlib.contextmanager
    def guard(self, component: str) -> Iterator[None]:
        """Context manager that swallows and counts any ``Exception`` raised inside it."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            self.count(component, exc)

    def get(self, component: str) -> int:
        """Number of failures counted for ``component`` so far."""
        with self._lock:
            return self._counts.get(component, 0)

    def snapshot(self) -> Dict[str, int]:
        """A copy of all counts, ``{component: count}``."""
        with self._lock:
            return dict(self._counts)
