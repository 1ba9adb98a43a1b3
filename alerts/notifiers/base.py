"""The notifier interface and the queue + thread that keeps delivery off the training loop.

Every notifier (Slack, webhook, console) implements :meth:`Notifier.deliver`.
The engine never calls it directly: it hands notifications to a
:class:`NotifierWorker`, which owns a bounded queue and one daemon thread per
notifier. ``submit`` never blocks: when the queue is full the notification is
dropped and counted, so a dead receiver can cost memory only up to
``queue_size`` notifications and never time on the training thread. One thread
per notifier delivers in order (first in, first out), so a slow Slack does not
hold back the webhook and a retried notification is never overtaken.

Outcomes, counted in ``mfuwatch_notifications_total{sink,outcome}``:

* ``sent`` — delivered (2xx, or written for the console);
* ``failed`` — rejected (4xx other than 408/429) or still failing after the retries;
* ``dropped`` — never attempted to the end: the queue was full, or ``close()``'s
  deadline passed first;
* ``retry`` — one more attempt after a connection error, a timeout, 408, 429 or 5xx
  (counts attempts, not notifications).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, Optional

from ..config import NotifierConfig
from ..model import Notification

log = logging.getLogger("mfuwatch.alerts")

OUTCOMES = ("sent", "failed", "dropped", "retry")
Counter = Callable[[str, str], None]  # (sink, outcome) -> None


class Notifier(ABC):
    """One destination. Subclasses implement :meth:`deliver`; it runs on the worker thread only."""

    def __init__(self, config: NotifierConfig) -> None:
        self.config = config
        self._warned: set = set()

    @property
    def name(self) -> str:
        """The sink label (the notifier's ``name``; never its URL)."""
        return self.config.name

    def accepts(self, notification: Notification) -> Optional[Notification]:
        """The part of ``notification`` this notifier sends (severity and ``send_resolved`` filters), or None."""
        keep = [a for a in notification.alerts if a.severity in self.config.severities
                and (a.status == "firing" or self.config.send_resolved)]
        return notification.only(keep) if keep else None

    @abstractmethod
    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        """Deliver one notification; return ``"sent"``, ``"failed"`` or ``"dropped"``. Must not raise.

        ``wait(seconds)`` sleeps before a retry and returns ``False`` when the
        worker is closing and the deadline would pass (give up: ``"dropped"``);
        ``on_retry()`` counts one retry.
        """

    def warn_once(self, key: str, message: str, *args) -> None:
        """Log ``message`` at WARNING the first time for ``key``, at DEBUG afterwards. Never logs secrets."""
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, message, *args)

    def close(self) -> None:
        """Release resources (HTTP sessions). Called on the worker thread when it ends."""


class NotifierWorker:
    """A bounded FIFO queue and a daemon thread delivering to one :class:`Notifier`.

    ``count(sink, outcome)`` is called for every outcome (see :data:`OUTCOMES`).
    """

    def __init__(self, notifier: Notifier, count: Counter, queue_size: Optional[int] = None) -> None:
        self.notifier = notifier
        self._count = count
        self._queue: "queue.Queue[Notification]" = queue.Queue(maxsize=queue_size or notifier.config.queue_size)
        self._closing = threading.Event()
        self._deadline: Optional[float] = None  # time.monotonic() by which close() wants to be done
        self._thread = threading.Thread(target=self._run, name=f"mfuwatch-notify-{notifier.name}", daemon=True)
        self._started = False

    @property
    def name(self) -> str:
        return self.notifier.name

    def start(self) -> None:
        """Start the delivery thread (idempotent)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, notification: Notification) -> bool:
        """Queue ``notification`` without blocking. Returns ``False`` (and counts ``dropped``) when full or closed."""
        part = self.notifier.accepts(notification)
        if part is None:
            return True
        if self._closing.is_set():
            self._safe_count("dropped")
            return False
        try:
            self._queue.put_nowait(part)
            return True
        except queue.Full:
            self._safe_count("dropped")
            self.notifier.warn_once("queue-full", "mfuwatch alerts: %s queue is full (%d); notifications are "
                                    "dropped and counted", self.name, self._queue.maxsize)
            return False

    def pending(self) -> int:
        """Notifications waiting in the queue (not counting one being delivered)."""
        return self._queue.qsize()

    def begin_close(self, deadline: float) -> None:
        """Tell the thread to finish by ``deadline`` (``time.monotonic()``) without waiting for it."""
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
        self._closing.set()

    def close(self, deadline: float) -> bool:
        """Deliver what is queued until ``deadline`` (``time.monotonic()``), then stop. Never blocks past it.

        Returns ``True`` when the thread finished; what could not be delivered in
        time is counted as ``dropped`` (by the thread, when its current request returns).
        """
        self.begin_close(deadline)
        if not self._started:
            self._drain_dropped()
            return True
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    # -- the delivery thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._past_deadline():
                    self._drain_dropped()
                    return
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._closing.is_set():
                        return
                    continue
                try:
                    outcome = self.notifier.deliver(item, self._wait, lambda: self._safe_count("retry"))
                except Exception as exc:  # noqa: BLE001 - a notifier bug must not kill the thread
                    self.notifier.warn_once("deliver-bug", "mfuwatch alerts: %s failed to deliver (%s)", self.name,
                                            type(exc).__name__)
                    outcome = "failed"
                self._safe_count(outcome if outcome in OUTCOMES else "failed")
        finally:
            try:
                self.notifier.close()
            except Exception:  # noqa: BLE001
                pass

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` before a retry; ``False`` if closing and the deadline comes first."""
        end = time.monotonic() + max(0.0, seconds)
        while True:
            if self._deadline is not None and end > self._deadline:
                return False
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))  # short slices, so close() is noticed within 50 ms

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _drain_dropped(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._safe_count("dropped")

    def _safe_count(self, outcome: str) -> None:
        try:
            self._count(self.name, outcome)
        except Exception:  # noqa: BLE001 - metrics must not break delivery
            pass
