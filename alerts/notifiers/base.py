"""The notifier interface and the per-notifier queue + thread that keeps delivery off the training loop.

Every notifier (console, Slack, webhook, PagerDuty, Opsgenie, Teams, Discord, email) implements :meth:`Notifier.deliver`.
The engine never calls it directly: it hands notifications to a
:class:`NotifierWorker`, which owns a bounded queue and one daemon thread per
notifier, so a slow Slack does not hold back the webhook. ``submit`` never
blocks and never waits on the network.

Delivery follows Alertmanager's model (``notify/notify.go``: a group's state is
retried until delivered or replaced by a newer state of the same group):

* Notifications are delivered first in, first out. A failed attempt that a later
  attempt can fix (connection error, timeout, 408, 429, 5xx) is retried with
  capped exponential backoff for as long as it takes, unless the notifier sets
  ``max_retries``. While a state waits for its retry and a state of *another*
  group is queued, the waiting state is *parked* at the back of the queue until
  its retry time (keeping its retry count), so one failing group never holds the
  other groups' notifications back; order across groups may then change, order
  within a group never does.
* While a notification waits for its next retry, a newer notification of the
  same group (same ``group_key``) *supersedes* it: the old one is abandoned and
  the newest state of the group is delivered instead. Alerts that were resolved
  in the superseded state and are absent from the newer one are carried over into
  it, so a resolved message is never lost by superseding.
* When the queue is full, the oldest *superseded* state (one with a newer state
  of its group queued behind it) goes first, merged the same way. The latest state
  of a group is never dropped by an overflow; the queue may then hold more than
  ``queue_size`` entries, but never more than one per group beyond that bound
  (groups are bounded by the rules and ``group_by``).
* ``close(deadline)`` keeps delivering (and retrying) until the deadline, then
  stops; what it could not deliver is counted ``dropped``, logged once as
  "dropped at close" and listed in :attr:`NotifierWorker.undelivered`. While
  closing, a wait the server asked for (HTTP 429/503 ``Retry-After``, Discord's
  ``retry_after``) is honoured in full, or, when it would end past the deadline,
  the notification is given up at once (``dropped``) instead of being re-sent
  early; a backoff wait is shortened to a quarter of the time left (at least
  :data:`CLOSING_MIN_WAIT`), and at most :data:`CLOSING_MAX_RETRIES` retries of
  one notification start after closing began, so a failing receiver gets a
  bounded number of requests.

Outcomes, counted in ``mfuwatch_notifications_total{sink,outcome}``:

* ``sent`` — delivered (2xx, or written for the console);
* ``failed`` — rejected (4xx other than 408/429), or ``max_retries`` exhausted;
* ``superseded`` — replaced by a newer state of its group before it was delivered;
* ``dropped`` — not delivered: ``close()``'s deadline passed first, or submitted after close;
* ``retry`` — one more attempt after a retryable failure (counts attempts, not notifications).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, Deque, Dict, List, Optional, Tuple

from ..config import NotifierConfig
from ..model import Notification
from ..routing import routed_to

log = logging.getLogger("mfuwatch.alerts")

OUTCOMES = ("sent", "failed", "superseded", "dropped", "retry")
Counter = Callable[[str, str], None]  # (sink, outcome) -> None
#: While closing, a backoff wait (not one the server asked for) is cut to this share of the time left ...
CLOSING_SHARE = 0.25
#: ... but never below this many seconds (or the configured backoff, if shorter), so closing never hammers.
CLOSING_MIN_WAIT = 1.0
#: While closing, at most this many retries of one notification; then it is given up (``dropped``).
CLOSING_MAX_RETRIES = 5


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
        """The part of ``notification`` this notifier sends (``routes``, severity and ``send_resolved``
        filters), or None."""
        routes = self.config.routes
        keep = [a for a in notification.alerts if a.severity in self.config.severities
                and (a.status == "firing" or self.config.send_resolved)
                and (not routes or routed_to(routes, a.labels, self.name))]
        return notification.only(keep) if keep else None

    @abstractmethod
    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        """Deliver one notification; return ``"sent"``, ``"failed"`` or ``"dropped"``. Must not raise.

        ``wait(seconds, server_asked=False)`` sleeps before a retry and returns
        ``False`` when the notification should be given up (the worker is closing
        and the wait does not fit before its deadline, or a newer state of the group
        superseded it): return ``"dropped"`` then. ``server_asked`` says the server
        set the wait (Retry-After), so closing must not shorten it. The worker's
        ``wait`` also has ``plan(seconds, server_asked=False)``: the wait it will
        really do (``None``: it will give up), for the log line. ``on_retry()``
        counts one retry.
        """

    def rendered(self, render: Callable[[Notification], object], notification: Notification) -> Optional[object]:
        """``render(notification)``, or ``None`` (logged once) when it raises: a rendering bug fails one
        notification (the caller returns ``"failed"``), never the delivery thread."""
        try:
            return render(notification)
        except Exception as exc:  # noqa: BLE001
            self.warn_once("render", "mfuwatch alerts: %s could not render a notification (%s)", self.name,
                           type(exc).__name__)
            return None

    def warn_once(self, key: str, message: str, *args) -> None:
        """Log ``message`` at WARNING the first time for ``key``, at DEBUG afterwards. Never logs secrets."""
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, message, *args)

    def close(self) -> None:
        """Release resources (HTTP sessions). Called on the worker thread when it ends."""


def describe(notification: Notification) -> str:
    """One line naming a notification without secrets: ``firing {}:{run="demo"} [MfuLow, Xid]``."""
    names = ", ".join(f"{a.name}{'' if a.status == 'firing' else ' (resolved)'}" for a in notification.alerts)
    return f"{notification.status} {notification.group_key} [{names}]"


def merge_superseded(old: Notification, new: Notification) -> Notification:
    """``new`` plus the resolved alerts of ``old`` that ``new`` does not mention (by fingerprint)."""
    seen = {a.fingerprint for a in new.alerts}
    carried = tuple(a for a in old.alerts if a.status == "resolved" and a.fingerprint not in seen)
    if not carried:
        return new
    return Notification(new.group_labels, new.alerts + carried, new.external_url, new.truncated_alerts)


class NotifierWorker:
    """A bounded queue of notifications and a daemon thread delivering them to one :class:`Notifier`.

    ``count(sink, outcome)`` is called for every outcome (see :data:`OUTCOMES`).
    ``clock`` (``time.monotonic`` by default) and ``sleep`` can be replaced in tests.
    """

    def __init__(self, notifier: Notifier, count: Counter, queue_size: Optional[int] = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.notifier = notifier
        self._count = count
        self.maxsize = int(queue_size or notifier.config.queue_size)
        self._items: Deque[Notification] = collections.deque()
        self._cv = threading.Condition()
        self._current: Optional[Notification] = None
        #: id(state) -> (state, not before (clock), retries so far, closing retries so far): states parked at
        #: the back of the queue while they wait for a retry, so other groups are not held behind them.
        self._parked: Dict[int, Tuple[Notification, float, int, int]] = {}
        self._closing = threading.Event()
        self._deadline: Optional[float] = None  # clock() by which close() wants to be done
        self._now = clock
        self._sleep = sleep
        self._thread = threading.Thread(target=self._run, name=f"mfuwatch-notify-{notifier.name}", daemon=True)
        self._started = False
        #: One line per notification that close() could not deliver (see :func:`describe`).
        self.undelivered: List[str] = []

    @property
    def name(self) -> str:
        return self.notifier.name

    def start(self) -> None:
        """Start the delivery thread (idempotent)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, notification: Notification) -> bool:
        """Queue ``notification`` without blocking. Returns ``False`` (and counts ``dropped``) after close."""
        part = self.notifier.accepts(notification)
        if part is None:
            return True
        if self._closing.is_set():
            self._safe_count("dropped")
            self._note_undelivered(part)
            return False
        with self._cv:
            if len(self._items) >= self.maxsize:
                part = self._evict_superseded(part)
            self._items.append(part)
            self._cv.notify_all()
        return True

    def pending(self) -> int:
        """Notifications waiting in the queue (not counting one being delivered)."""
        with self._cv:
            return len(self._items)

    def begin_close(self, deadline: float) -> None:
        """Tell the thread to finish by ``deadline`` (this worker's clock) without waiting for it."""
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
        self._closing.set()
        with self._cv:
            self._cv.notify_all()

    def close(self, deadline: float) -> bool:
        """Deliver what is queued until ``deadline`` (this worker's clock), then stop. Never blocks past it.

        Returns ``True`` when the thread finished; what could not be delivered in
        time is counted as ``dropped`` (by the thread, when its current request
        returns) and listed in :attr:`undelivered`.
        """
        self.begin_close(deadline)
        if not self._started:
            self._drain_dropped()
            return True
        self._thread.join(timeout=max(0.0, deadline - self._now()))
        return not self._thread.is_alive()

    # -- queue policy (called with self._cv held) ----------------------------------------------
    def _evict_superseded(self, incoming: Notification) -> Notification:
        """Make room by merging away the oldest superseded state; returns ``incoming`` (possibly merged).

        A queued state is superseded when a newer state of its group is queued
        behind it, or when ``incoming`` belongs to its group. If every queued state
        is the latest of its group, nothing is dropped (the queue grows by one).
        """
        items = self._items
        for i, old in enumerate(items):
            nxt = next((j for j in range(i + 1, len(items)) if items[j].group_key == old.group_key), None)
            if nxt is not None:
                items[nxt] = merge_superseded(old, items[nxt])
                self._parked.pop(id(old), None)
                del items[i]
                self._safe_count("superseded")
                return incoming
            if old.group_key == incoming.group_key:
                self._parked.pop(id(old), None)
                del items[i]
                self._safe_count("superseded")
                return merge_superseded(old, incoming)
        self.notifier.warn_once("queue-full", "mfuwatch alerts: %s queue is full (%d) with the latest state of "
                                "every group; it grows by one instead of dropping a latest state",
                                self.name, self.maxsize)
        return incoming

    def _newer_in_queue(self, current: Notification) -> bool:
        with self._cv:
            return any(n.group_key == current.group_key for n in self._items)

    def _supersede(self, current: Notification) -> None:
        """Drop ``current`` and all but the newest queued state of its group, merging resolved alerts forward."""
        with self._cv:
            items = list(self._items)
            same = [i for i, n in enumerate(items) if n.group_key == current.group_key]
            if not same:  # nothing newer after all: keep it for another attempt
                self._items.appendleft(current)
                return
            merged = current
            for i in same[:-1]:
                merged = merge_superseded(merged, items[i])
            items[same[-1]] = merge_superseded(merged, items[same[-1]])
            for i in reversed(same[:-1]):
                self._parked.pop(id(items[i]), None)
                del items[i]
            self._items = collections.deque(items)
        for _ in range(len(same)):
            self._safe_count("superseded")

    # -- the delivery thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._items and not self._closing.is_set():
                        self._cv.wait(0.5)
                    if self._past_deadline() or (not self._items and self._closing.is_set()):
                        break
                    item, parked = self._next_ready()
                if item is None:  # every queued state is parked until its retry time
                    self._sleep(0.05)
                    continue
                if parked is not None and self._newer_in_queue(item):
                    self._supersede(item)  # a newer state of its group came while it was parked
                    continue
                self._deliver_one(item, parked)
            self._drain_dropped()
        finally:
            try:
                self.notifier.close()
            except Exception:  # noqa: BLE001
                pass

    def _parked_entry(self, n: Notification) -> Optional[Tuple[Notification, float, int, int]]:
        entry = self._parked.get(id(n))
        return entry if entry is not None and entry[0] is n else None

    def _next_ready(self) -> Tuple[Optional[Notification], Optional[Tuple[Notification, float, int, int]]]:
        """Pop the first queued state that may be tried now (not parked, or parked until a time now past);
        ``(None, None)`` when every state is parked. Called with ``self._cv`` held."""
        now = self._now()
        for i, n in enumerate(self._items):
            entry = self._parked_entry(n)
            if entry is None or entry[1] <= now:
                del self._items[i]
                self._parked.pop(id(n), None)
                return n, entry
        return None, None

    def _other_group_ready(self, item: Notification) -> bool:
        """Whether a state of another group is queued and may be tried now (then ``item`` parks)."""
        now = self._now()
        with self._cv:
            for n in self._items:
                if n.group_key != item.group_key:
                    entry = self._parked_entry(n)
                    if entry is None or entry[1] <= now:
                        return True
        return False

    def _deliver_one(self, item: Notification, parked: Optional[Tuple[Notification, float, int, int]] = None) -> None:
        """Deliver ``item`` (its retry state carried over when it comes back from being parked). A retry wait
        with another group's state ready parks ``item`` at the back of the queue until its retry time, so one
        failing group does not hold back the others (head-of-line blocking across groups)."""
        retries = [parked[2] if parked else 0]
        superseded = [False]

        def on_retry() -> None:
            retries[0] += 1
            self._safe_count("retry")

        worker = self

        class Wait:
            """The ``wait`` handed to :meth:`Notifier.deliver` (see there)."""

            closing_retries = parked[3] if parked else 0  # retries of this state that started after close began
            prior_retries = retries[0]  # retries before it was parked (retry_loop counts max_retries from here)
            deferred: Optional[float] = None  # parked: the clock time of its next try

            def plan(self, seconds: float, server_asked: bool = False) -> Optional[float]:
                return worker._plan(seconds, server_asked, self.closing_retries)

            def __call__(self, seconds: float, server_asked: bool = False) -> bool:
                ok = worker._wait(seconds, item, server_asked, self)
                if not ok and worker._newer_in_queue(item):
                    superseded[0] = True
                if (ok or self.deferred is not None) and worker._deadline is not None:
                    self.closing_retries += 1
                return ok

        waiter = Wait()
        try:
            outcome = self.notifier.deliver(item, waiter, on_retry)
        except Exception as exc:  # noqa: BLE001 - a notifier bug must not kill the thread
            self.notifier.warn_once("deliver-bug", "mfuwatch alerts: %s failed to deliver (%s)", self.name,
                                    type(exc).__name__)
            outcome = "failed"
        if superseded[0]:
            self._supersede(item)
            return
        if waiter.deferred is not None and outcome == "dropped":
            with self._cv:
                newer = any(n.group_key == item.group_key for n in self._items)
                if not newer:  # park it behind the others until its retry time
                    self._items.append(item)
                    self._parked[id(item)] = (item, waiter.deferred, retries[0], waiter.closing_retries)
                    self._cv.notify_all()
            if newer:
                self._supersede(item)
            return
        if outcome == "dropped":
            self._note_undelivered(item)
        if outcome == "sent" and retries[0]:
            log.info("mfuwatch alerts: %s delivered %s after %d retries", self.name, describe(item), retries[0])
        self._safe_count(outcome if outcome in OUTCOMES else "failed")

    def _plan(self, seconds: float, server_asked: bool, closing_retries: int) -> Optional[float]:
        """The wait before the next try as the worker will do it, or ``None`` to give the notification up.

        Not closing: ``seconds``. Closing: a server-asked wait in full if it ends before the deadline;
        a backoff wait cut to ``max(CLOSING_MIN_WAIT, CLOSING_SHARE * time left)`` (never longer than asked);
        ``None`` when the wait would end past the deadline or :data:`CLOSING_MAX_RETRIES` retries are spent.
        """
        seconds = max(0.0, seconds)
        if self._deadline is None:
            return seconds
        left = self._deadline - self._now()
        if closing_retries >= CLOSING_MAX_RETRIES:
            return None
        if not server_asked:
            seconds = min(seconds, max(CLOSING_MIN_WAIT, CLOSING_SHARE * left))
        return seconds if seconds < left else None

    def _wait(self, seconds: float, item: Notification, server_asked: bool = False, waiter=None) -> bool:
        """Sleep ``seconds`` before a retry; ``False`` if superseded meanwhile or, closing, if the wait does
        not fit before the deadline (see :meth:`_plan`; a wait begun before close is re-planned then)."""
        end = self._now() + max(0.0, seconds)
        replanned = self._deadline is not None
        while True:
            if self._newer_in_queue(item):
                return False
            if waiter is not None and self._other_group_ready(item):
                waiter.deferred = end  # park it: deliver the other groups first (see _deliver_one)
                return False
            now = self._now()
            if self._deadline is not None:
                if not replanned:  # close began during this wait: re-plan what is left of it
                    replanned = True
                    planned = self._plan(end - now, server_asked, waiter.closing_retries if waiter else 0)
                    if planned is None:
                        return False
                    if now + planned < end:
                        log.debug("mfuwatch alerts: %s closing: next try of %s in %.2fs", self.name,
                                  describe(item), planned)
                    end = min(end, now + planned)
                if now >= self._deadline or end > self._deadline:
                    return False
            left = end - now
            if left <= 0:
                return True
            self._sleep(min(left, 0.05))  # short slices: close() and newer states are noticed within 50 ms

    def _past_deadline(self) -> bool:
        return self._deadline is not None and self._now() >= self._deadline

    def _drain_dropped(self) -> None:
        with self._cv:
            items, self._items = list(self._items), collections.deque()
            self._parked.clear()
        for n in items:
            self._safe_count("dropped")
            self._note_undelivered(n)

    def _note_undelivered(self, n: Notification) -> None:
        line = describe(n)
        self.undelivered.append(line)
        self.notifier.warn_once("dropped-at-close", "mfuwatch alerts: %s dropped at close: %s (further ones are "
                                "listed in the close report)", self.name, line)

    def _safe_count(self, outcome: str) -> None:
        try:
            self._count(self.name, outcome)
        except Exception:  # noqa: BLE001 - metrics must not break delivery
            pass
