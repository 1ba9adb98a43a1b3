"""What the engine hands to notifiers: alert snapshots grouped into one notification.

An :class:`AlertSnapshot` is one alert at the moment a notification is built
(immutable, so a notifier thread can read it while the engine moves on); a
:class:`Notification` is one group of them (grouped by ``group_by`` labels,
``run`` by default), in the shape of an Alertmanager notification, so the
webhook body can follow Alertmanager's webhook format field for field.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

#: Alertmanager's "not ended" time in webhook payloads (Go's zero time.Time).
ZERO_TIME = "0001-01-01T00:00:00Z"

_FNV64_OFFSET = 14695981039346656037
_FNV64_PRIME = 1099511628211
_SEPARATOR = 0xFF


def fingerprint(labels: Mapping[str, str]) -> str:
    """The 16-hex-digit fingerprint of a label set, computed as Prometheus/Alertmanager do.

    FNV-1a 64 over the label names in sorted order, each name and value followed
    by the separator byte 0xff (``labelSetToFingerprint`` in prometheus/common
    ``model/signature.go``), so the same labels give the same fingerprint here
    and in Alertmanager.
    """
    h = _FNV64_OFFSET
    for name in sorted(labels):
        for chunk in (name.encode("utf-8"), bytes([_SEPARATOR]), str(labels[name]).encode("utf-8"),
                      bytes([_SEPARATOR])):
            for b in chunk:
                h ^= b
                h = (h * _FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def rfc3339(ts: Optional[float]) -> str:
    """Unix seconds as RFC 3339 UTC with milliseconds (``2025-06-01T18:00:00.250Z``); ``None`` → zero time."""
    if ts is None:
        return ZERO_TIME
    dt = _dt.datetime.fromtimestamp(ts, _dt.timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


@dataclass(frozen=True)
class AlertSnapshot:
    """One alert as notified.

    ``value`` is the expression's value at the last evaluation, ``threshold``/``op``
    the rule's comparison, ``unit`` the signal's unit (``ratio``/``seconds``/``count``).
    ``context`` carries structured extras for rich notifiers: ``top_ops`` (list of
    ``{"op","share","time_seconds"}``) and ``suggestions`` (list of
    ``{"kernel","title","apply","expected_gain","kind","ops"}``).
    """

    name: str
    status: str  # "firing" | "resolved"
    severity: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: float
    ends_at: Optional[float]
    value: Optional[float]
    threshold: float
    op: str
    unit: str
    for_seconds: float = 0.0
    generator_url: str = ""
    dashboard_url: str = ""
    context: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        """Alertmanager-compatible fingerprint of the labels."""
        return fingerprint(self.labels)

    def record(self, timestamp: float) -> Dict[str, Any]:
        """The timeline record of this transition (``{"kind": "alert", ...}``, see the agent contract)."""
        return {"kind": "alert", "alertname": self.name, "status": self.status, "severity": self.severity,
                "timestamp": timestamp, "summary": self.annotations.get("summary", ""),
                "labels": dict(self.labels), "annotations": dict(self.annotations)}


@dataclass(frozen=True)
class Notification:
    """One group of alerts to deliver: the new, repeated and just-resolved alerts of a group."""

    group_labels: Mapping[str, str]
    alerts: Tuple[AlertSnapshot, ...]
    external_url: str = ""
    truncated_alerts: int = 0

    @property
    def status(self) -> str:
        """``firing`` if any alert fires, else ``resolved`` (Alertmanager's group status)."""
        return "firing" if any(a.status == "firing" for a in self.alerts) else "resolved"

    @property
    def group_key(self) -> str:
        """Alertmanager-style group key, ``{}:{run="demo"}``."""
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(self.group_labels.items()))
        return "{}:{" + inner + "}"

    @property
    def common_labels(self) -> Dict[str, str]:
        """Labels with the same value in every alert of the group."""
        return _common([a.labels for a in self.alerts])

    @property
    def common_annotations(self) -> Dict[str, str]:
        """Annotations with the same value in every alert of the group."""
        return _common([a.annotations for a in self.alerts])

    def only(self, alerts: List[AlertSnapshot]) -> "Notification":
        """The same notification restricted to ``alerts`` (a notifier's severity / resolved filter)."""
        return Notification(self.group_labels, tuple(alerts), self.external_url, self.truncated_alerts)


def _common(maps: List[Mapping[str, str]]) -> Dict[str, str]:
    if not maps:
        return {}
    first = dict(maps[0])
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in maps[1:])}
