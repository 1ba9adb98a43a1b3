"""The in-process alert engine: evaluate rules on a background thread, notify from rank 0.

Life of an alert (as in Prometheus): when a rule's expression crosses its
threshold the alert is *pending*; if it still crosses after ``for`` it *fires*;
when it stops crossing (or its data disappears) it is *resolved*. A pending alert
that clears before ``for`` (flapping) sends nothing. Every firing/resolved
transition goes to ``on_event`` (the agent's timeline) and to the gauge
``mfuwatch_alerts_firing``, on every rank.

Notifications (as in Alertmanager, from global rank 0 unless
``notify_from_all_ranks``): alerts are grouped by ``group_by`` labels (the run);
a group is notified when an alert joins it, when a notified alert resolves, and
again every ``repeat_interval`` while alerts fire. Alerts matched by a silence,
inhibited by another firing alert, or re-firing within their rule's ``cooldown``
after a resolved notification are held back (they still fire). Notifications are
queued to one thread per notifier; nothing here waits on the network.

Threads: an evaluation thread (every ``evaluation_interval``) and a stalled-loop
watchdog (every ``watchdog_interval``, the ``seconds_since_last_step`` rules only),
so a training loop blocked in a collective or the data loader still pages.

Usage (the agent does this)::

    engine = AlertEngine.from_config(cfg, run_info=run_info, registry=registry, on_event=timeline.write)
    engine.start()
    engine.observe_step(step); engine.observe_window(window); engine.observe_gpu(sample)
    engine.close(timeout=2.0)
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from prometheus_client import CollectorRegistry, Counter, Gauge

from mfuwatch.agent.schema import M, GpuHealth, RunInfo, StepMeasurement, WindowMeasurement

from .config import AlertConfig, load_config
from .model import AlertSnapshot, Notification
from .notifiers import build_notifier
from .notifiers.base import OUTCOMES, NotifierWorker
from .notifiers.console import format_number
from .rules import Rule
from .secrets import SecretError
from .signals import MeasurementStore, covered_text, hang_context, memory_bound_ops, suggestion_rows
from .stall import StallClock
from .templates import fmt_pct
from .validation import AlertConfigError, format_duration

log = logging.getLogger("mfuwatch.alerts")

WATCHDOG_SIGNALS = ("seconds_since_last_step",)


@dataclass
class _AlertState:
    rule: Rule
    labels: Dict[str, str]
    state: str = "inactive"  # inactive | pending | firing
    active_since: Optional[float] = None
    fired_at: Optional[float] = None
    resolved_at: Optional[float] = None
    value: Optional[float] = None
    annotations: Dict[str, str] = field(default_factory=dict)
    context: Dict[str, Any] = field(default_factory=dict)
    notified: bool = False  # this firing episode was notified
    resolved_pending: bool = False  # a resolved notification is owed
    resolved_notified_at: Optional[float] = None  # for the cool-down


@dataclass
class _GroupState:
    sent: frozenset = frozenset()  # alert names in the last notification, firing
    last_sent: Optional[float] = None


class AlertEngine:
    """Evaluates alert rules over the agent's measurements and sends notifications.

    Build it with :meth:`from_config`. Two clocks: ``monotonic`` (seconds, default
    ``time.monotonic``) times every duration — ``for``, cool-down, repeat, the
    stall and the look-back windows — so a stepped system clock neither pages nor
    hides a page; ``clock`` (unix seconds, default ``time.time``) only stamps
    records and notifications (``starts_at``/``ends_at``) and matches silences. A
    test that passes only ``clock`` gets it for both. ``stall_clock`` is the
    :class:`~mfuwatch.alerts.stall.StallClock` the agent's step hook feeds (a
    private one, fed by step reports, when ``None``). Metrics go to ``registry`` (a private one when ``None``):
    ``mfuwatch_alerts_firing{run,rank,alertname,severity}`` and
    ``mfuwatch_notifications_total{run,rank,sink,outcome}``.

    A firing stall alert (a ``seconds_since_last_step`` rule, ``TrainingStalled``)
    says where the training thread waits: from the hang report handed to
    :meth:`observe_hang`, else from ``stall_probe`` — an optional callable (the
    agent sets it) that returns the same mapping, taken when the alert fires, on
    the engine's watchdog thread. The innermost frames go into the annotations
    ``waiting_at`` and ``stack`` and the context ``hang`` (see
    :func:`~mfuwatch.alerts.signals.hang_context`), which the notifiers print.
    """

    def __init__(self, config: AlertConfig, *, run_info: RunInfo, registry: Optional[CollectorRegistry] = None,
                 on_event: Optional[Callable[[dict], None]] = None, clock: Optional[Callable[[], float]] = None,
                 on_error: Optional[Callable[[str, BaseException], None]] = None,
                 monotonic: Optional[Callable[[], float]] = None, stall_clock: Optional[StallClock] = None):
        self.config = config
        self._on_error = on_error
        self._err_lock = threading.Lock()
        self.run_info = run_info
        self._clock = clock or time.time  # wall: timestamps only
        self._mono = monotonic or clock or time.monotonic  # every duration
        self._on_event = on_event
        self.store = MeasurementStore(self._mono, stall_clock)
        self._lock = threading.RLock()
        self._errors = 0
        self._logged: set = set()
        self._stop = threading.Event()
        self._window_arrived = threading.Event()  # wakes the evaluation thread when a profiler window arrives
        self._threads: List[threading.Thread] = []
        self._closed = False
        rules = [r for r in config.rules if r.enabled and r.in_process]
        self._watch_rules = [r for r in rules if r.expr in WATCHDOG_SIGNALS]
        self._eval_rules = [r for r in rules if r.expr not in WATCHDOG_SIGNALS]
        base = {"run": run_info.run, "rank": str(run_info.rank)}
        if run_info.host:
            base["host"] = run_info.host
        self._states: Dict[str, _AlertState] = {
            r.name: _AlertState(r, {"alertname": r.name, "severity": r.severity, **base, **r.labels}) for r in rules}
        self._groups: Dict[Tuple[str, ...], _GroupState] = {}
        #: ``(sink, outcome) -> None``, called after each notification outcome is counted (on the notifier's
        #: thread): the agent re-renders its exposition so a scrape sees the count at once (a failing callback
        #: is counted as an ``on_notification`` error)
        self.on_notification: Optional[Callable[[str, str], None]] = None
        #: ``() -> mapping or None``: where the training thread waits now (see the class docstring)
        self.stall_probe: Optional[Callable[[], Optional[Mapping[str, Any]]]] = None
        self.registry = registry if registry is not None else CollectorRegistry()
        self._firing = Gauge(M.ALERTS_FIRING, "1 while the alert fires (in-process engine)",
                             ["run", "rank", "alertname", "severity"], registry=self.registry)
        self._notifications = Counter(M.NOTIFICATIONS_TOTAL, "Notifications by sink and outcome "
                                      "(sent, failed, dropped; retry counts attempts)",
                                      ["run", "rank", "sink", "outcome"], registry=self.registry)
        for r in rules:
            self._firing.labels(run_info.run, str(run_info.rank), r.name, r.severity).set(0)
        self.notifying = run_info.rank == 0 or config.notify_from_all_ranks
        self.workers: List[NotifierWorker] = []
        if self.notifying:
            for n in config.notifiers:
                try:
                    notifier = build_notifier(n)
                except SecretError as exc:
                    raise AlertConfigError(str(exc)) from None
                except ValueError as exc:
                    raise AlertConfigError(str(exc)) from None
                self.workers.append(NotifierWorker(notifier, self._count))
                for outcome in OUTCOMES:
                    self._notifications.labels(run_info.run, str(run_info.rank), n.name, outcome)

    @classmethod
    def from_config(cls, config: Union[dict, str, Path, AlertConfig, None], *, run_info: RunInfo,
                    registry: Optional[CollectorRegistry] = None, on_event: Optional[Callable[[dict], None]] = None,
                    clock: Optional[Callable[[], float]] = None,
                    on_error: Optional[Callable[[str, BaseException], None]] = None,
                    monotonic: Optional[Callable[[], float]] = None,
                    stall_clock: Optional[StallClock] = None) -> "AlertEngine":
        """Validate ``config`` (dict, YAML path, ``None`` = shipped defaults with a console notifier) and build.

        ``on_event(record)`` receives the timeline record of every firing/resolved
        transition; ``on_error("alerts", exc)`` (optional, e.g. the agent's
        ``ErrorCounter.count``) is told of every exception the engine swallows.
        Raises :class:`~mfuwatch.alerts.AlertConfigError` (a ``ValueError``) for an
        invalid config or a notifier secret that cannot be read.
        """
        cfg = config if isinstance(config, AlertConfig) else load_config(config)
        return cls(cfg, run_info=run_info, registry=registry, on_event=on_event, clock=clock, on_error=on_error,
                   monotonic=monotonic, stall_clock=stall_clock)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "AlertEngine":
        """Start the notifier threads, the evaluation thread and the stalled-loop watchdog (idempotent)."""
        if self._threads or self._closed:
            return self
        for w in self.workers:
            w.start()
        for name, interval, rules in (("mfuwatch-alerts-eval", self.config.evaluation_interval_seconds,
                                       self._eval_rules),
                                      ("mfuwatch-alerts-watchdog", self.config.watchdog_interval_seconds,
                                       self._watch_rules)):
            if rules:
                t = threading.Thread(target=self._loop, args=(interval, rules), name=name, daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def close(self, timeout: float = 2.0, reason: str = "run ended") -> List[str]:
        """End the run's alerts, deliver what is queued for at most ``timeout`` seconds, stop. Never hangs.

        Every alert still firing is resolved with the annotation
        ``resolved_reason: <reason>`` (``"run ended"``; ``"run preempted (SIGTERM)"`` when the agent
        closes on a signal: a timeline record and, where its firing was
        notified, a resolved notification), so incidents of a finished job close.
        Returns one line per notification that could not be delivered in time
        (also counted ``dropped`` and logged once per notifier); empty when all
        were delivered.
        """
        if self._closed:
            return []
        self._closed = True
        deadline = time.monotonic() + max(0.0, timeout)
        self._stop.set()
        self._window_arrived.set()
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        try:
            self._end_run(reason)
        except Exception as exc:  # noqa: BLE001 - closing must never raise into the training job
            self._error("close", exc)
        for w in self.workers:
            w.begin_close(deadline)
        for w in self.workers:
            w.close(deadline)
        lost = [f"{w.name}: {line}" for w in self.workers for line in w.undelivered]
        if lost:
            log.warning("mfuwatch alerts: %d notification(s) not delivered before close: %s", len(lost),
                        "; ".join(lost[:5]) + (" ..." if len(lost) > 5 else ""))
        return lost

    def _end_run(self, reason: str = "run ended") -> None:
        """Resolve every firing alert with ``resolved_reason: <reason>`` and dispatch the resolved messages."""
        now = self._mono()
        wall = self._wall(now)
        events: List[dict] = []
        with self._lock:
            for st in self._states.values():
                if st.state == "pending":
                    st.state, st.active_since = "inactive", None
                elif st.state == "firing":
                    st.state, st.resolved_at = "inactive", wall
                    st.resolved_pending = st.notified
                    self._resolved_text(st, st.value, reason=reason)  # why it ended, not the firing text
                    st.annotations = {**st.annotations, "resolved_reason": reason}
                    record = self._transition(st, "resolved", wall)
                    record["reason"] = reason
                    events.append(record)
            if self.notifying and self.workers:
                self._dispatch(now, wall)
        self._emit(events)

    def _emit(self, events: List[Dict[str, Any]]) -> None:
        """Hand each transition record to ``on_event`` (the timeline); a failing callback is counted, never
        raised: a broken timeline must not stop alerting or closing."""
        if self._on_event is None:
            return
        for record in events:
            try:
                self._on_event(record)
            except Exception as exc:  # noqa: BLE001
                self._error("on_event", exc)

    @property
    def errors(self) -> int:
        """How many exceptions the engine caught (observe_*, evaluation, callbacks)."""
        return self._errors

    # -- feeding (training thread, agent threads): O(1), never raise ---------------------------
    def observe_step(self, m: StepMeasurement) -> None:
        """Record a report interval (MFU, the step clock for the watchdog)."""
        try:
            self.store.observe_step(m)
        except Exception as exc:  # noqa: BLE001
            self._error("observe_step", exc)

    def observe_window(self, w: WindowMeasurement) -> None:
        """Record a profiler window (memory-bound share, idle share, top ops, suggestions)."""
        try:
            self.store.observe_window(w)
            self._window_arrived.set()  # evaluate now, not at the next interval: a short run still alerts in-run
        except Exception as exc:  # noqa: BLE001
            self._error("observe_window", exc)

    def observe_gpu(self, h: GpuHealth) -> None:
        """Record an NVML sample (throttle reasons, Xid/ECC counts, memory)."""
        try:
            self.store.observe_gpu(h)
        except Exception as exc:  # noqa: BLE001
            self._error("observe_gpu", exc)

    def observe_hang(self, report: Optional[Mapping[str, Any]]) -> None:
        """Record the hang watchdog's report of the current step (``None`` when that step ended).

        Keys: ``where``, ``stack`` (outermost first), ``last_collective``, ``step``, ``elapsed_seconds``
        (:func:`~mfuwatch.alerts.signals.hang_context`). A firing stall alert shows it from its next
        evaluation on.
        """
        try:
            self.store.observe_hang(report)
        except Exception as exc:  # noqa: BLE001
            self._error("observe_hang", exc)

    # -- evaluation ---------------------------------------------------------------------------
    def state(self, alertname: str) -> str:
        """``inactive``, ``pending`` or ``firing`` (``KeyError`` for a rule the engine does not evaluate)."""
        return self._states[alertname].state

    def _wall(self, now: float) -> float:
        """Unix time for a record stamped at monotonic ``now`` (``now`` itself for a one-clock test engine)."""
        return now if self._mono is self._clock else self._clock()

    def evaluate(self, now: Optional[float] = None, *, rules: Optional[List[Rule]] = None) -> None:
        """Evaluate ``rules`` (all in-process rules by default) at monotonic ``now`` (default the engine's
        monotonic clock) and queue due notifications; records are stamped with the wall clock."""
        now = self._mono() if now is None else now
        wall = self._wall(now)
        rules = (self._eval_rules + self._watch_rules) if rules is None else rules
        events: List[dict] = []
        with self._lock:
            window = self.store.latest_window()
            for rule in rules:
                st = self._states[rule.name]
                try:
                    value = self.store.value(rule.expr, rule.params(), now)
                except Exception as exc:  # noqa: BLE001 - one bad measurement must not stop the other rules
                    self._error(f"evaluate {rule.name}", exc)
                    continue
                if value is not None:
                    st.value = value
                if rule.crosses(value):
                    if st.state == "inactive":
                        st.state, st.active_since = "pending", now
                    if st.state == "pending" and now - st.active_since >= rule.for_seconds:
                        st.state, st.fired_at, st.notified = "firing", wall, False
                        st.context = {}  # a new episode: a stall's stack is taken again
                        self._render(st, window)
                        events.append(self._transition(st, "firing", wall))
                    elif st.state == "firing":
                        self._render(st, window)
                elif st.state == "pending":
                    st.state, st.active_since = "inactive", None
                elif st.state == "firing":
                    st.state, st.resolved_at = "inactive", wall
                    st.resolved_pending = st.notified
                    self._resolved_text(st, value)  # the resolving value, not the firing one
                    events.append(self._transition(st, "resolved", wall))
            if self.notifying and self.workers:
                self._dispatch(now, wall)
        self._emit(events)

    def _loop(self, interval: float, rules: List[Rule]) -> None:
        wake = self._window_arrived if rules is self._eval_rules else None
        while True:
            if wake is not None:
                wake.wait(interval)
                wake.clear()
            else:
                self._stop.wait(interval)
            if self._stop.is_set():
                return
            try:
                self.evaluate(rules=rules)
            except Exception as exc:  # noqa: BLE001
                self._error("evaluate", exc)

    def _transition(self, st: _AlertState, status: str, now: float) -> dict:
        self._firing.labels(self.run_info.run, str(self.run_info.rank), st.rule.name,
                            st.rule.severity).set(1 if status == "firing" else 0)
        return self._snapshot(st, status).record(now)

    def _resolved_text(self, st: _AlertState, value: Optional[float], reason: Optional[str] = None) -> None:
        """The annotations of a resolved alert (caller holds the lock): ``summary`` quotes the value that
        resolved it (``None``: its data ended), ``firing_summary`` keeps the last firing text. With
        ``reason`` (the run ended or was preempted while it fired) the summary says so and quotes
        ``value`` as the last one seen; ``resolved_value`` is then empty: no value resolved it."""
        try:
            rule, lab = st.rule, st.labels
            unit = rule.signal.unit
            where = f"run {lab.get('run', '')} rank {lab.get('rank', '')}"
            if reason is not None:
                now = reason + ("" if value is None else f", last value {format_number(value, unit)}")
            elif value is None:
                now = "no data any more (the series ended)"
            else:
                now = f"now {format_number(value, unit)}"
            value_text = "" if value is None or reason is not None else format_number(value, unit)
            fired = st.annotations.get("summary")
            st.value = value
            st.annotations = {**st.annotations,
                              "summary": f"Resolved: {rule.name} on {where}: {now}; it fires at {rule.op} "
                                         f"{format_number(rule.threshold, unit)}"
                                         + (f" for {format_duration(rule.for_seconds)}" if rule.for_seconds else ""),
                              "resolved_value": value_text}
            if fired:
                st.annotations["firing_summary"] = fired
        except Exception as exc:  # noqa: BLE001 - a resolved message must go out even without its text
            self._error("render", exc)

    def _render(self, st: _AlertState, window) -> None:
        """Refresh the annotations and context of a firing alert from its value and the latest window."""
        try:
            self._render_unsafe(st, window)
        except Exception as exc:  # noqa: BLE001 - a bad window must not stop the alert from firing
            self._error("render", exc)

    def _render_unsafe(self, st: _AlertState, window) -> None:
        rule = st.rule
        suggestions = suggestion_rows(window) if window is not None else []
        top = (suggestions[0]["kernel"], suggestions[0]["expected_gain"]) if suggestions else None
        static = rule.static()
        st.annotations = {k: t.render(value=st.value, labels=st.labels, static=static, suggestion=top)
                          for k, t in rule.annotations.items()}
        if rule.expr == "memory_bound_share":
            ops = memory_bound_ops(window)
            st.context = {"top_ops": ops, "suggestions": suggestions}
            if suggestions:
                s = suggestions[0]
                st.annotations.update(
                    suggested_kernel=s["kernel"], suggested_apply=s["apply"],
                    suggested_expected_gain="%.4g" % s["expected_gain"],
                    suggestions="\n".join(f"{x['kernel']} [{x['kind']}]: {x['apply']} (expected gain "
                                          f"{fmt_pct(x['expected_gain'])} of step time{covered_text(x)})"
                                          for x in suggestions))
                bundled = [x for x in suggestions if x["kind"] == "bundled"]
                if bundled:
                    st.annotations.update(bundled_kernel=bundled[0]["kernel"], bundled_apply=bundled[0]["apply"],
                                          bundled_expected_gain="%.4g" % bundled[0]["expected_gain"])
                    if bundled[0].get("covered_by"):
                        st.annotations["bundled_covered_by"] = str(bundled[0]["covered_by"])
            if ops:
                st.annotations["top_memory_bound_ops"] = ", ".join(f"{o['op']} {fmt_pct(o['share'])}" for o in ops)
        elif rule.expr in WATCHDOG_SIGNALS:
            self._stall_context(st)

    def _stall_context(self, st: _AlertState) -> None:
        """Where the training thread waits, into a stall alert's annotations and context (caller holds the lock).

        The hang watchdog's report wins; without one, ``stall_probe`` is asked once per firing episode.
        """
        hang = self.store.latest_hang() or st.context.get("hang")
        if hang is None and self.stall_probe is not None:
            try:
                raw = self.stall_probe()
                hang = hang_context(raw) if raw else None
            except Exception as exc:  # noqa: BLE001 - a failing probe must not stop the alert
                self._error("stall_probe", exc)
        if hang is None:
            return
        st.context = {**st.context, "hang": hang}
        where = hang["where"]
        if hang.get("last_collective"):
            where += f" (last collective: {hang['last_collective']})"
        st.annotations["waiting_at"] = where
        if hang["frames"]:
            st.annotations["stack"] = "\n".join(hang["frames"])

    # -- notification policy --------------------------------------------------------------------
    def _muted(self, st: _AlertState, wall: float, firing: List[Mapping[str, str]]) -> bool:
        if any(s.active(st.labels, wall) for s in self.config.silences):
            return True
        return any(i.inhibits(st.labels, firing) for i in self.config.inhibit_rules)

    def _dispatch(self, now: float, wall: float) -> None:
        """Queue due notifications: ``now`` (monotonic) times cool-down and repeat, ``wall`` matches silences."""
        firing = [st.labels for st in self._states.values() if st.state == "firing"]
        groups: Dict[Tuple[str, ...], List[_AlertState]] = {}
        for st in self._states.values():
            groups.setdefault(tuple(st.labels.get(k, "") for k in self.config.group_by), []).append(st)
        for key, members in groups.items():
            g = self._groups.setdefault(key, _GroupState())
            notifiable = [st for st in members if st.state == "firing" and not self._muted(st, wall, firing)
                          and not (st.resolved_notified_at is not None
                                   and now - st.resolved_notified_at < st.rule.cooldown_seconds)]
            resolved = [st for st in members if st.resolved_pending]
            names = frozenset(st.rule.name for st in notifiable)
            repeat_due = bool(notifiable) and g.last_sent is not None and \
                now - g.last_sent >= self.config.repeat_interval_seconds
            if not (names - g.sent or resolved or repeat_due):
                g.sent = g.sent & names  # muted alerts leave the group silently
                continue
            alerts = tuple([self._snapshot(st, "firing") for st in notifiable]
                           + [self._snapshot(st, "resolved") for st in resolved])
            notification = Notification(dict(zip(self.config.group_by, key)), alerts,
                                        external_url=self.run_info.exporter_url)
            for w in self.workers:
                w.submit(notification)
            g.sent, g.last_sent = names, now
            for st in notifiable:
                st.notified = True
            for st in resolved:
                st.resolved_pending, st.notified, st.resolved_notified_at = False, False, now

    def _snapshot(self, st: _AlertState, status: str) -> AlertSnapshot:
        rule = st.rule
        return AlertSnapshot(
            name=rule.name, status=status, severity=rule.severity, labels=dict(st.labels),
            annotations=dict(st.annotations), starts_at=st.fired_at or 0.0,
            ends_at=st.resolved_at if status == "resolved" else None, value=st.value, threshold=rule.threshold,
            op=rule.op, unit=rule.signal.unit, for_seconds=rule.for_seconds,
            generator_url=self.run_info.exporter_url, dashboard_url=self._dashboard_url(st),
            context=dict(st.context))

    def _dashboard_url(self, st: _AlertState) -> str:
        base = self.config.grafana_url.rstrip("/")
        if not base or not st.rule.dashboard:
            return ""
        start_ms = int(((st.fired_at or 0.0) - 3600.0) * 1000)
        query = urllib.parse.urlencode({"var-run": st.labels.get("run", ""), "var-rank": st.labels.get("rank", ""),
                                        "from": str(start_ms), "to": "now"})
        return f"{base}/d/{st.rule.dashboard}?{query}"

    # -- bookkeeping ----------------------------------------------------------------------------
    def _count(self, sink: str, outcome: str) -> None:
        self._notifications.labels(self.run_info.run, str(self.run_info.rank), sink, outcome).inc()
        cb = self.on_notification
        if cb is not None:
            try:
                cb(sink, outcome)
            except Exception as exc:  # noqa: BLE001 - a listener must not fail the delivery
                self._error("on_notification", exc)

    def _error(self, component: str, exc: BaseException) -> None:
        try:
            with self._err_lock:
                self._errors += 1
                first = component not in self._logged
                self._logged.add(component)
            if first:
                log.warning("mfuwatch alerts: %s failed (%s); training continues, further failures are only "
                            "counted", component, type(exc).__name__, exc_info=exc)
            if self._on_error is not None:
                self._on_error("alerts", exc)
        except Exception:  # noqa: BLE001 - error accounting must never raise
            pass
