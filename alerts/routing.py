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


def _route_severities(r: Route) -> Tuple[str, ...]:
    """The severities an alert taken by route ``r`` can have (its ``severity`` matchers, checked on each)."""
    ms = [m for m in r.matchers if m.name == "severity"]
    return tuple(s for s in SEVERITIES if all_match(ms, {"severity": s}))


def severity_warnings(routes: Sequence[Route], notifiers: Sequence[Any]) -> List[str]:
    """What ``check`` says about a notifier's own ``severities`` and ``severity_map`` (``notifiers``: the
    :class:`~.config.NotifierConfig` list): a route that sends a notifier a severity its ``severities`` drops
    (silently: routing and the notifier's filter both apply), and a ``severity_map`` entry that can never
    apply (its severity is dropped by ``severities``, or no route sends that severity to the notifier)."""
    out = []
    for n in notifiers:
        own = tuple(getattr(n, "severities", SEVERITIES))
        reaching: List[str] = []
        for i, r in enumerate(routes):
            if n.name not in r.notifiers:
                continue
            sev = _route_severities(r)
            reaching.extend(x for x in sev if x not in reaching)
            dropped = [x for x in sev if x not in own]
            if dropped:
                out.append(f"route[{i}] sends {', '.join(dropped)} alerts to {n.name}, whose own `severities: "
                           f"[{', '.join(own)}]` drops them (nothing is logged when that happens): remove "
                           f"`severities` from {n.name} and let the routes choose, or add "
                           f"'severity=~\"{'|'.join(x for x in sev if x in own)}\"' to the route")
        if not routes:
            reaching = list(SEVERITIES)
        for sev, value in getattr(n, "severity_map", ()):
            if sev not in own:
                out.append(f"notifier {n.name}: severity_map {sev}: {value} never applies: its `severities: "
                           f"[{', '.join(own)}]` drops {sev} alerts")
            elif sev not in reaching:
                out.append(f"notifier {n.name}: severity_map {sev}: {value} never applies: no route sends it "
                           f"{sev} alerts")
    return out


def regex_example(pattern: str) -> Optional[str]:
    """A short string that ``re.fullmatch(pattern, ...)`` accepts, built from the parsed pattern (first branch,
    each repeat at least once, ``.`` as ``x``, a class as its first member), or ``None`` when the pattern has
    parts this does not invert (look-arounds, back-references, negated classes) or the result does not match
    after all (always checked with the compiled regex)."""
    import re

    try:
        from re import _parser as sre  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as sre  # type: ignore[no-redef]

    category = {sre.CATEGORY_DIGIT: "0", sre.CATEGORY_WORD: "a", sre.CATEGORY_SPACE: " ",
                sre.CATEGORY_NOT_DIGIT: "a", sre.CATEGORY_NOT_WORD: "-", sre.CATEGORY_NOT_SPACE: "a"}

    def build(items) -> str:
        out = []
        for op, av in items:
            if op is sre.LITERAL:
                out.append(chr(av))
            elif op is sre.ANY:
                out.append("x")
            elif op is sre.AT:
                continue
            elif op is sre.IN:
                first = av[0]
                if first[0] is sre.NEGATE:
                    raise ValueError(pattern)
                if first[0] is sre.LITERAL:
                    out.append(chr(first[1]))
                elif first[0] is sre.RANGE:
                    out.append(chr(first[1][0]))
                elif first[0] is sre.CATEGORY and first[1] in category:
                    out.append(category[first[1]])
                else:
                    raise ValueError(pattern)
            elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", object())):
                lo, hi, sub = av
                out.append(build(sub) * max(lo, min(1, hi)))
            elif op is sre.BRANCH:
                out.append(build(av[1][0]))
            elif op is sre.SUBPATTERN:
                out.append(build(av[-1]))
            elif op is getattr(sre, "ATOMIC_GROUP", object()):
                out.append(build(av))
            else:
                raise ValueError(pattern)
        return "".join(out)

    try:
        text = build(sre.parse(pattern))
    except (ValueError, TypeError, IndexError, re.error):
        return None
    return text if re.fullmatch(pattern, text) is not None else None


def _candidates(m: Matcher, known: Sequence[str]) -> List[str]:
    """Values to try for matcher ``m``'s label, most realistic first: the configured values (severities, alert
    names), then (``=``/``=~``) the matcher's literal alternatives and a string built from its regex."""
    import re

    out = list(known)
    if m.op == "=":
        out.append(m.value)
    elif m.op == "=~":
        out.extend(a for a in m.value.split("|") if a and re.escape(a) == a)  # plain alternatives only
        example = regex_example(m.value)
        if example is not None:
            out.append(example)
    else:  # a negative matcher: any value it does not exclude
        out.extend(["mfuwatch-test", f"not-{m.value}"])
    return out


def sample_labels(r: Route, base: Mapping[str, str], values: Mapping[str, Sequence[str]]) -> Optional[dict]:
    """Labels that satisfy every matcher of route ``r`` (for ``test-notify``), starting from ``base``.

    For a label whose ``base`` value some matcher refuses, the candidates are, in order: the configured
    values in ``values`` (severities, alert names), the matcher's literal alternatives (``critical|warning``)
    and a string built from its regular expression (``prod-.*`` -> ``prod-x``); the first that satisfies
    *every* matcher on that label (positive and negative, each checked with its compiled regex) is taken.
    ``None`` when no candidate does (a regular expression this cannot invert): the caller says "not tested".
    """
    labels = dict(base)
    for name in dict.fromkeys(m.name for m in r.matchers):
        same = [m for m in r.matchers if m.name == name]
        if all_match(same, labels):
            continue
        tried: List[str] = []
        for m in same:
            tried.extend(c for c in _candidates(m, values.get(name, ())) if c not in tried)
        for c in tried:
            if all_match(same, {**labels, name: c}):
                labels[name] = c
                break
        else:
            return None
    return labels if all_match(r.matchers, labels) else None
