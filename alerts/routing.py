"""Routing: which notifiers get an alert, by Alertmanager-style matchers on its labels.

The ``routes:`` list of the alert config reads like the child routes of an
Alertmanager route (prometheus.io/docs/alerting/latest/configuration/#route)::

    routes:
      - matchers: ['severity="critical"']   # pages
        notifiers: [pagerduty]
        continue: true                       # ... and goes on to the next routes
      - notifiers: [slack]                   # no matchers: every alert that got this far

An alert walks the routes in order; the first route whose matchers all match it
takes it, and the walk stops there unless that route says ``continue: true``.
The alert goes to the union of the notifiers of the routes that took it. An
alert that no route takes goes nowhere: that is logged once per alert name
(``mfuwatch alerts check`` warns when the last route is not a catch-all). Without
``routes`` every notifier gets every alert (filtered by its ``severities``), as
before routes existed.

Validation (at start-up and by ``mfuwatch alerts check``) names the route and
suggests the nearest valid name for an unknown notifier, label name, severity or
alert name (``severty`` → ``severity``, ``pagerdty`` → ``pagerduty``), because a
matcher that can never match silently routes nothing.
"""

from __future__ import annotations

import difflib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

from .matchers import Matcher, all_match, parse_matchers
from .rules import SEVERITIES
from .validation import AlertConfigError, as_bool, as_str_list, check_keys, require_mapping

log = logging.getLogger("mfuwatch.alerts")

ROUTE_KEYS = ("matchers", "notifiers", "continue")
#: Labels every alert carries (the rules may add their own ``labels``).
BASE_LABELS = ("alertname", "severity", "run", "rank", "host")

_unrouted_lock = threading.Lock()
_unrouted_logged: set = set()


@dataclass(frozen=True)
class Route:
    """One entry of ``routes``: alerts matching every matcher go to ``notifiers``; ``continue_`` goes on."""

    matchers: Tuple[Matcher, ...]
    notifiers: Tuple[str, ...]
    continue_: bool = False

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether this route takes an alert with ``labels`` (no matchers: every alert)."""
        return all_match(self.matchers, labels)

    def to_dict(self) -> dict:
        d: dict = {"notifiers": list(self.notifiers)}
        if self.matchers:
            d = {"matchers": [str(m) for m in self.matchers], **d}
        if self.continue_:
            d["continue"] = True
        return d


def route(routes: Sequence[Route], labels: Mapping[str, str]) -> Tuple[Tuple[str, ...], Tuple[int, ...]]:
    """``(notifier names, indices of the routes that took it)`` for an alert with ``labels``.

    First match wins unless the matching route has ``continue``; names keep first-seen order.
    """
    names: List[str] = []
    taken: List[int] = []
    for i, r in enumerate(routes):
        if r.matches(labels):
            taken.append(i)
            names.extend(n for n in r.notifiers if n not in names)
            if not r.continue_:
                break
    return tuple(names), tuple(taken)


def routed_to(routes: Sequence[Route], labels: Mapping[str, str], notifier: str) -> bool:
    """Whether ``notifier`` gets an alert with ``labels``; ``True`` for every notifier when there are no routes.

    An alert that no route takes is logged once per alert name (it is not notified anywhere).
    """
    if not routes:
        return True
    names, _ = route(routes, labels)
    if not names:
        key = labels.get("alertname", "")
        with _unrouted_lock:
            first = key not in _unrouted_logged
            _unrouted_logged.add(key)
        if first:
            log.warning("mfuwatch alerts: alert %s (%s) matches no route and is not notified; add a last route "
                        "without matchers to catch the rest", key,
                        ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k in ("severity", "run")))
    return notifier in names


def _near(value: str, choices: Iterable[str]) -> str:
    near = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _check_matcher(m: Matcher, where: str, label_names: Sequence[str], rule_names: Sequence[str]) -> None:
    """A matcher on an unknown label, or ``=`` on a value no alert has, can never match: say so."""
    if m.name not in label_names:
        raise AlertConfigError(f"{where}: no alert has a label {m.name!r}{_near(m.name, label_names)}; alerts carry "
                               f"{', '.join(label_names)}")
    known = {"severity": SEVERITIES, "alertname": rule_names}.get(m.name)
    if known is None or m.op not in ("=", "!="):
        return
    if m.value not in known:
        raise AlertConfigError(f"{where}: {m.name} {m.value!r} is not one of the configured values"
                               f"{_near(m.value, known)}; accepted: {', '.join(known)}")


def parse_routes(items: Any, notifier_names: Sequence[str], rules: Sequence[Any] = ()) -> Tuple[Route, ...]:
    """Validate the ``routes:`` list against the notifier names and the rules' alert names and labels.

    Raises :class:`AlertConfigError` naming ``routes[i]`` and the nearest valid name.
    """
    if items is None:
        return ()
    if not isinstance(items, list):
        raise AlertConfigError("routes: expected a list such as [{matchers: ['severity=\"critical\"'], "
                               "notifiers: [pagerduty]}, {notifiers: [slack]}]")
    label_names = list(BASE_LABELS)
    for r in rules:
        label_names.extend(k for k in getattr(r, "labels", {}) if k not in label_names)
    rule_names = [r.name for r in rules]
    out = []
    for i, item in enumerate(items):
        w = f"routes[{i}]"
        item = require_mapping(item, w)
        if "receiver" in item and "notifiers" not in item:
            raise AlertConfigError(f"{w}.receiver: mfuwatch routes name a list of notifiers: write "
                                   f"notifiers: [{item['receiver']}] (Alertmanager's receiver is one name)")
        check_keys(item, ROUTE_KEYS, w)
        if "notifiers" not in item:
            raise AlertConfigError(f"{w}.notifiers: a route needs the notifiers it sends to, e.g. [pagerduty]; "
                                   f"configured: {', '.join(notifier_names) or 'none'}")
        names = as_str_list(item["notifiers"], f"{w}.notifiers")
        if not names:
            raise AlertConfigError(f"{w}.notifiers: a route needs at least one notifier")
        for n in names:
            if n not in notifier_names:
                raise AlertConfigError(f"{w}.notifiers: no notifier is called {n!r}{_near(n, notifier_names)}; "
                                       f"configured: {', '.join(notifier_names) or 'none'}")
        matchers: Tuple[Matcher, ...] = ()
        if item.get("matchers") not in (None, []):
            matchers = parse_matchers(item["matchers"], f"{w}.matchers")
            for j, m in enumerate(matchers):
                _check_matcher(m, f"{w}.matchers[{j}]", label_names, rule_names)
        out.append(Route(matchers, names, as_bool(item.get("continue", False), f"{w}.continue")))
    return tuple(out)


def route_warnings(routes: Sequence[Route], notifier_names: Sequence[str]) -> List[str]:
    """What ``mfuwatch alerts check`` should point out: no catch-all last route, notifiers no route names."""
    if not routes:
        return []
    out = []
    if routes[-1].matchers:
        out.append("the last route has matchers: alerts that match no route are not notified (add "
                   "`- notifiers: [...]` without matchers last)")
    used = {n for r in routes for n in r.notifiers}
    for n in notifier_names:
        if n not in used:
            out.append(f"notifier {n} is named by no route: it receives no alert")
    return out


def sample_labels(r: Route, base: Mapping[str, str], values: Mapping[str, Sequence[str]]) -> Optional[dict]:
    """Labels that satisfy every matcher of route ``r`` (for ``test-notify``), starting from ``base``;
    candidates for a label come from ``values`` (severities, alert names) and the matchers' own values.
    ``None`` when no candidate satisfies a matcher (a regular expression too general to invert)."""
    labels = dict(base)
    for m in r.matchers:
        if m.matches(labels):
            continue
        candidates = [m.value] + [v.strip() for v in m.value.split("|")] + list(values.get(m.name, ())) \
            + [f"not-{m.value}", "mfuwatch-test"]
        for c in candidates:
            trial = {**labels, m.name: c}
            if m.matches(trial) and all_match([x for x in r.matchers if x.name == m.name], trial):
                labels = trial
                break
        else:
            return None
    return labels if all_match(r.matchers, labels) else None
