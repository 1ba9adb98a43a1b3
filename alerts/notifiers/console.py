"""Console notifier: one readable block per alert on stderr, stdout, or the ``mfuwatch.alerts`` logger.

The default notifier when nothing else is configured, and the one to read in a
terminal or a job log::

    [mfuwatch] FIRING MemoryBoundDominant (info) run=demo rank=0 host=node7
      Memory-bound kernels take 62.3% of GPU time on run demo rank 0
      value 62.3% (threshold > 40%)
      fix: rms_norm: mfuwatch.kernels.patch(model, kernels=["rms_norm"])  (expected gain 12.3% of step time)
      runbook: https://…/MemoryBoundDominant.md
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, List

from ..model import AlertSnapshot, Notification
from ..templates import fmt_duration, fmt_g, fmt_pct
from .base import Notifier

log = logging.getLogger("mfuwatch.alerts")


def format_number(value: float, unit: str) -> str:
    """A value in its signal's unit: ratios as percent, seconds as a duration, counts as numbers."""
    if unit == "ratio":
        return fmt_pct(value)
    if unit == "seconds":
        return fmt_duration(value)
    return fmt_g(value)


def alert_lines(a: AlertSnapshot) -> List[str]:
    """The console lines of one alert."""
    lab = a.labels
    head = (f"[mfuwatch] {a.status.upper()} {a.name} ({a.severity}) run={lab.get('run', '')} "
            f"rank={lab.get('rank', '')} host={lab.get('host', '')}")
    lines = [head]
    if a.annotations.get("summary"):
        lines.append("  " + a.annotations["summary"])
    if a.value is not None:
        lines.append(f"  value {format_number(a.value, a.unit)} (threshold {a.op} {format_number(a.threshold, a.unit)})")
    suggestions = list(a.context.get("suggestions") or [])
    shown = suggestions[:1]
    if shown and shown[0].get("kind") != "bundled":  # also name the bundled drop-in when there is one
        shown += [s for s in suggestions[1:] if s.get("kind") == "bundled"][:1]
    for s in shown:
        lines.append(f"  fix: {s['kernel']}: {s['apply']}  (expected gain {fmt_pct(s['expected_gain'])} of step time)")
    if a.annotations.get("runbook_url"):
        lines.append("  runbook: " + a.annotations["runbook_url"])
    return lines


class ConsoleNotifier(Notifier):
    """Writes alerts as text to ``stream`` (``stderr``, ``stdout``) or logs them (``log``: WARNING/INFO)."""

    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        text = "\n".join(line for a in notification.alerts for line in alert_lines(a))
        stream = self.config.stream
        if stream == "log":
            log.log(logging.WARNING if notification.status == "firing" else logging.INFO, "%s", text)
        else:
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(text + "\n")
            out.flush()
        return "sent"
