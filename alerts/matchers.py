"""Label matchers, silences and inhibition rules, in Alertmanager's syntax.

A matcher is a string ``name op "value"`` with ``op`` one of ``=``, ``!=``, ``=~``,
``!~`` (regular expressions are fully anchored, as in Alertmanager), e.g.
``alertname=~"MfuLow|MfuRegression"``. The same strings work in the in-process
config and in an Alertmanager ``inhibit_rules`` / ``amtool silence add``, so the
two paths read alike.

* A **silence** mutes notifications for alerts that match all its matchers until
  its end time (``until``); the alert still fires (gauge, timeline).
* An **inhibition rule** mutes *target* alerts while a firing *source* alert has
  the same values for the ``equal`` labels (a stalled run does not also page for
  low MFU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Tuple

from .validation import LABEL_NAME_RE, AlertConfigError, as_str_list, check_keys, parse_timestamp, require_mapping

_MATCHER = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(?:"((?:[^"\\]|\\.)*)"|([^"\s]*))\s*$')


@dataclass(frozen=True)
class Matcher:
    """One label matcher. ``matches(labels)`` treats a missing label as the empty string (Alertmanager)."""

    name: str
    op: str
    value: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` satisfy this matcher."""
        actual = labels.get(self.name, "")
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        hit = re.fullmatch(self.value, actual) is not None
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        escaped = self.value.replace("\\", "\\\\").replace('"', '\\"')
        return f'{self.name}{self.op}"{escaped}"'


def parse_matcher(text: Any, where: str) -> Matcher:
    """Parse ``name="value"`` (or ``!=``, ``=~``, ``!~``); raises :class:`AlertConfigError` naming ``where``."""
    if not isinstance(text, str):
        raise AlertConfigError(f'{where}: expected a matcher string such as \'alertname="MfuLow"\', got {text!r}')
    m = _MATCHER.match(text)
    if not m:
        raise AlertConfigError(f"{where}: cannot read matcher {text!r}; write name=\"value\" with one of "
                               "=, !=, =~, !~")
    value = m.group(3) if m.group(3) is not None else m.group(4)
    value = re.sub(r"\\(.)", r"\1", value)
    op = m.group(2)
    if op in ("=~", "!~"):
        try:
            re.compile(value)
        except re.error as exc:
            raise AlertConfigError(f"{where}: bad regular expression {value!r} ({exc})") from None
    return Matcher(m.group(1), op, value)


def parse_matchers(items: Any, where: str) -> Tuple[Matcher, ...]:
    """A list of matcher strings, or a ``{label: value}`` mapping meaning equality matchers."""
    if isinstance(items, Mapping):
        return tuple(Matcher(str(k), "=", str(v)) for k, v in items.items())
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, (list, tuple)) or not items:
        raise AlertConfigError(f"{where}: expected a non-empty list of matchers such as ['alertname=\"MfuLow\"']")
    return tuple(parse_matcher(t, f"{where}[{i}]") for i, t in enumerate(items))


def all_match(matchers: Iterable[Matcher], labels: Mapping[str, str]) -> bool:
    """Whether every matcher matches ``labels``."""
    return all(m.matches(labels) for m in matchers)


@dataclass(frozen=True)
class Silence:
    """Mutes notifications of matching alerts until ``until`` (unix seconds)."""

    matchers: Tuple[Matcher, ...]
    until: float
    comment: str = ""

    def active(self, labels: Mapping[str, str], now: float) -> bool:
        """Whether this silence mutes an alert with ``labels`` at time ``now``."""
        return now < self.until and all_match(self.matchers, labels)

    def to_dict(self) -> dict:
        import datetime as _dt

        until = _dt.datetime.fromtimestamp(self.until, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"matchers": [str(m) for m in self.matchers], "until": until, "comment": self.comment}


@dataclass(frozen=True)
class InhibitRule:
    """While an alert matching ``source`` fires, alerts matching ``target`` with equal ``equal`` labels are muted."""

    source: Tuple[Matcher, ...]
    target: Tuple[Matcher, ...]
    equal: Tuple[str, ...]

    def inhibits(self, target_labels: Mapping[str, str], firing: Sequence[Mapping[str, str]]) -> bool:
        """Whether some firing alert (other than the target itself) inhibits ``target_labels``."""
        if not all_match(self.target, target_labels):
            return False
        for src in firing:
            if src is target_labels or dict(src) == dict(target_labels):
                continue
            if all_match(self.source, src) and all(src.get(k, "") == target_labels.get(k, "") for k in self.equal):
                return True
        return False

    def to_dict(self) -> dict:
        return {"source_matchers": [str(m) for m in self.source], "target_matchers": [str(m) for m in self.target],
                "equal": list(self.equal)}


def _entries(items: Any, where: str, keys: Sequence[str]) -> Iterable[Tuple[str, Mapping[str, Any]]]:
    """Yield ``(location, mapping)`` for each entry of a config list, checking its type and keys."""
    if items is None:
        return
    if not isinstance(items, list):
        raise AlertConfigError(f"{where}: expected a list")
    for i, item in enumerate(items):
        w = f"{where}[{i}]"
        item = require_mapping(item, w)
        check_keys(item, keys, w)
        yield w, item


def parse_silences(items: Any, where: str = "silences") -> Tuple[Silence, ...]:
    """Validate the ``silences:`` list (``matchers``, ``until``, optional ``comment``)."""
    out = []
    for w, item in _entries(items, where, ("matchers", "until", "comment")):
        if "until" not in item:
            raise AlertConfigError(f"{w}.until: a silence needs an end time, e.g. '2025-06-01T18:00:00Z'")
        out.append(Silence(parse_matchers(item.get("matchers"), f"{w}.matchers"),
                           parse_timestamp(item["until"], f"{w}.until"), str(item.get("comment", ""))))
    return tuple(out)


def parse_inhibit_rules(items: Any, where: str = "inhibit_rules") -> Tuple[InhibitRule, ...]:
    """Validate the ``inhibit_rules:`` list (``source_matchers``, ``target_matchers``, ``equal``)."""
    out = []
    for w, item in _entries(items, where, ("source_matchers", "target_matchers", "equal")):
        equal = as_str_list(item.get("equal", []), f"{w}.equal")
        for name in equal:
            if not LABEL_NAME_RE.match(name):
                raise AlertConfigError(f"{w}.equal: {name!r} is not a label name")
        out.append(InhibitRule(parse_matchers(item.get("source_matchers"), f"{w}.source_matchers"),
                               parse_matchers(item.get("target_matchers"), f"{w}.target_matchers"), equal))
    return tuple(out)
