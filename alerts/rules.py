"""Alert rules: the schema of one rule, its validation, and the merge of user rules onto the built-ins.

A rule (YAML, under ``rules:`` keyed by its alert name)::

    MfuLow:
      expr: mfu                 # a signal from mfuwatch.alerts.signals.SIGNALS
      op: "<"                   # <, <=, >, >=
      threshold: 0.25
      for: 10m                  # pending this long before firing (0s: fire at once)
      severity: warning         # critical | warning | info
      cooldown: 30m             # after a resolved notification, hold a re-fire this long
      labels: {team: ml-infra}  # extra labels (routing keys for Alertmanager)
      annotations: {summary: "...", description: "...", runbook_url: "..."}
      window: 1h                # signals that look back (increase, baseline, step-time mean)
      offset: 10m               # mfu_vs_baseline: the baseline ends this long ago
      reasons: [hw_slowdown]    # gpu_throttle_reasons: the NVML clock-event reasons that count
      dashboard: mfuwatch-training-mfu   # Grafana dashboard uid for the link
      enabled: true

A built-in rule is overridden key by key (``labels`` and ``annotations`` merge); a
new name defines a custom rule and then needs ``expr``, ``op`` and ``threshold``.
"""

from __future__ import annotations

import difflib
import operator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Dict, Mapping, Optional, Tuple

import yaml

from .signals import DEFAULT_THROTTLE_REASONS, SIGNALS, THROTTLE_REASONS, Signal
from .templates import Template
from .validation import (LABEL_NAME_RE, AlertConfigError, as_bool, as_number, as_str_list, as_str_map, check_keys,
                         format_duration, parse_duration, require_mapping)

SEVERITIES = ("critical", "warning", "info")
OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
RULE_KEYS = ("expr", "op", "threshold", "for", "severity", "cooldown", "labels", "annotations", "window", "offset",
             "reasons", "dashboard", "enabled")
#: Labels the engine sets itself; a rule may not override them.
RESERVED_LABELS = ("alertname", "severity", "run", "rank", "host")

_DEFAULT_WINDOW = 600.0


@dataclass(frozen=True)
class Rule:
    """One validated alert rule. Durations in seconds; ``annotations`` hold parsed templates."""

    name: str
    expr: str
    op: str
    threshold: float
    for_seconds: float
    severity: str
    cooldown_seconds: float
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, Template] = field(default_factory=dict)
    window_seconds: Optional[float] = None
    offset_seconds: Optional[float] = None
    reasons: Tuple[str, ...] = ()
    dashboard: str = ""
    enabled: bool = True
    builtin: bool = False

    @property
    def signal(self) -> Signal:
        """The :class:`~mfuwatch.alerts.signals.Signal` named by ``expr``."""
        return SIGNALS[self.expr]

    @property
    def in_process(self) -> bool:
        """Whether the in-process engine evaluates this rule (false for Prometheus-only signals)."""
        return self.signal.in_process

    def params(self) -> Dict[str, Any]:
        """The signal parameters (``window``/``offset`` in seconds, ``reasons``)."""
        return {"window": self.window_seconds, "offset": self.offset_seconds, "reasons": self.reasons}

    def static(self) -> Dict[str, Any]:
        """The template values fixed by the rule (threshold, durations, words)."""
        return {"threshold": self.threshold, "for": self.for_seconds, "window": self.window_seconds,
                "offset": self.offset_seconds, "cooldown": self.cooldown_seconds, "op": self.op,
                "alertname": self.name, "severity": self.severity}

    def crosses(self, value: Optional[float]) -> bool:
        """``value op threshold`` (``False`` for ``None``: no data never fires)."""
        return value is not None and OPS[self.op](value, self.threshold)

    def to_dict(self) -> Dict[str, Any]:
        """The rule as YAML-ready data (durations as Prometheus strings)."""
        d: Dict[str, Any] = {"expr": self.expr, "op": self.op, "threshold": self.threshold,
                             "for": format_duration(self.for_seconds), "severity": self.severity,
                             "cooldown": format_duration(self.cooldown_seconds)}
        if self.window_seconds is not None:
            d["window"] = format_duration(self.window_seconds)
        if self.offset_seconds is not None:
            d["offset"] = format_duration(self.offset_seconds)
        if self.reasons:
            d["reasons"] = list(self.reasons)
        d["labels"] = dict(self.labels)
        d["annotations"] = {k: t.text for k, t in self.annotations.items()}
        d["dashboard"] = self.dashboard
        d["enabled"] = self.enabled
        return d


def load_default_document() -> Dict[str, Any]:
    """The shipped defaults (``mfuwatch/alerts/data/default_rules.yaml``) as a plain dict."""
    text = resources.files("mfuwatch.alerts").joinpath("data/default_rules.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def merge_rules(defaults: Mapping[str, Any], user: Mapping[str, Any], *, use_defaults: bool,
                runbook_base_url: str) -> Tuple[Rule, ...]:
    """Validate and merge ``user`` rule overrides onto ``defaults``; returns the enabled and disabled rules.

    Raises :class:`AlertConfigError` naming ``rules.<name>.<key>``.
    """
    user = require_mapping(user, "rules")
    base = {name: dict(spec) for name, spec in (defaults.items() if use_defaults else ())}
    for name, spec in user.items():
        where = f"rules.{name}"
        if not isinstance(name, str) or not LABEL_NAME_RE.match(name):
            raise AlertConfigError(f"rules: {name!r} is not a valid alert name (letters, digits, '_')")
        spec = require_mapping(spec, where)
        check_keys(spec, RULE_KEYS, where)
        if name in base:
            merged = dict(base[name])
            for k, v in spec.items():
                if k in ("labels", "annotations") and isinstance(v, Mapping):
                    merged[k] = {**(merged.get(k) or {}), **v}
                else:
                    merged[k] = v
            base[name] = merged
        else:
            missing = [k for k in ("expr", "op", "threshold") if k not in spec]
            if missing:
                near = difflib.get_close_matches(name, list(defaults), n=1, cutoff=0.6)
                hint = f"; did you mean the built-in rule {near[0]!r}?" if near else ""
                raise AlertConfigError(f"{where}: not a built-in rule, and a custom rule needs "
                                       f"{', '.join(missing)}{hint}")
            base[name] = dict(spec)
    builtin = set(defaults) if use_defaults else set()
    return tuple(parse_rule(name, spec, builtin=name in builtin, runbook_base_url=runbook_base_url,
                            runbook=runbook_for(name, spec.get("expr"), defaults))
                 for name, spec in base.items())


#: The alert names with a runbook in docs/runbooks (``<name>.md``): the built-in rules and the fleet alerts.
#: tests/alerts/test_alert_runbooks.py checks this set against the folder.
RUNBOOKS = frozenset({
    "GoodputLow", "GpuEccErrors", "GpuMemoryPressure", "GpuThrottling", "GpuXidErrors", "InputBoundRank",
    "InputStall", "MemoryBoundDominant", "MfuAboveTensorActivity", "MfuFarBelowTensorActivity", "MfuImplausible",
    "MfuLow", "MfuRegression", "StragglerRank", "TrainingStalled"})


def runbook_for(name: str, expr: Any, defaults: Mapping[str, Any]) -> Optional[str]:
    """The runbook an alert links to: its own (``name`` in :data:`RUNBOOKS`), else that of the first built-in
    rule reading the same expression (a custom ``mfu < 0.3`` rule links MfuLow's), else None (no link: a
    custom rule gives its own ``annotations.runbook_url``)."""
    if name in RUNBOOKS:
        return name
    for other, spec in defaults.items():
        if other in RUNBOOKS and isinstance(spec, Mapping) and expr is not None and spec.get("expr") == expr:
            return other
    return None


def parse_rule(name: str, spec: Mapping[str, Any], *, builtin: bool, runbook_base_url: str,
               runbook: Optional[str] = None) -> Rule:
    """Validate one merged rule spec into a :class:`Rule`."""
    where = f"rules.{name}"
    check_keys(spec, RULE_KEYS, where)
    expr = spec.get("expr")
    if expr not in SIGNALS:
        near = difflib.get_close_matches(str(expr), list(SIGNALS), n=1, cutoff=0.5)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise AlertConfigError(f"{where}.expr: {expr!r} is not a known expression{hint}; accepted: "
                               f"{', '.join(SIGNALS)}")
    signal = SIGNALS[expr]
    op = spec.get("op")
    if op not in OPS:
        raise AlertConfigError(f"{where}.op: {op!r} is not accepted; accepted: {', '.join(OPS)}")
    severity = spec.get("severity", "warning")
    if severity not in SEVERITIES:
        raise AlertConfigError(f"{where}.severity: {severity!r} is not accepted; accepted: {', '.join(SEVERITIES)}")
    labels = as_str_map(spec.get("labels"), f"{where}.labels")
    for k in labels:
        if k in RESERVED_LABELS:
            raise AlertConfigError(f"{where}.labels.{k}: this label is set by mfuwatch; reserved: "
                                   f"{', '.join(RESERVED_LABELS)} (use the rule's 'severity' key for severity)")
    texts = as_str_map(spec.get("annotations"), f"{where}.annotations")
    if runbook is not None:  # only to a runbook that exists (runbook_for)
        texts.setdefault("runbook_url", f"{runbook_base_url.rstrip('/')}/{runbook}.md")
    annotations = {k: Template(v, f"{where}.annotations.{k}") for k, v in texts.items()}
    for_seconds = parse_duration(spec.get("for", 0), f"{where}.for")
    window = offset = None
    if "window" in signal.params:
        window = parse_duration(spec.get("window", _DEFAULT_WINDOW), f"{where}.window")
        if window <= 0:
            raise AlertConfigError(f"{where}.window: must be > 0")
    elif "window" in spec:
        raise AlertConfigError(f"{where}.window: expression {expr!r} takes no window")
    if "offset" in signal.params:
        offset = parse_duration(spec.get("offset", 0), f"{where}.offset")
    elif "offset" in spec:
        raise AlertConfigError(f"{where}.offset: expression {expr!r} takes no offset")
    reasons: Tuple[str, ...] = ()
    if "reasons" in signal.params:
        reasons = as_str_list(spec.get("reasons", list(DEFAULT_THROTTLE_REASONS)), f"{where}.reasons",
                              choices=THROTTLE_REASONS)
        if not reasons:
            raise AlertConfigError(f"{where}.reasons: list at least one NVML clock-event reason")
    elif "reasons" in spec:
        raise AlertConfigError(f"{where}.reasons: expression {expr!r} takes no reasons")
    dashboard = spec.get("dashboard", signal.dashboard)
    if not isinstance(dashboard, str):
        raise AlertConfigError(f"{where}.dashboard: expected a Grafana dashboard uid, got {dashboard!r}")
    return Rule(
        name=name, expr=expr, op=op, threshold=as_number(spec.get("threshold"), f"{where}.threshold"),
        for_seconds=for_seconds, severity=severity,
        cooldown_seconds=parse_duration(spec.get("cooldown", 0), f"{where}.cooldown"),
        labels=labels, annotations=annotations, window_seconds=window, offset_seconds=offset, reasons=reasons,
        dashboard=dashboard, enabled=as_bool(spec.get("enabled", True), f"{where}.enabled"), builtin=builtin,
    )
