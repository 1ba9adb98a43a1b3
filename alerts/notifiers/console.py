"""Console notifier: one readable block per alert on stderr, stdout, or the ``mfuwatch.alerts`` logger.

The default notifier when nothing else is configured, and the one to read in a
terminal or a job log::

    [mfuwatch] FIRING MemoryBoundDominant (info) run=demo rank=0 host=node7
      Memory-bound kernels take 62.3% of GPU time on run demo rank 0
      value 62.3% (threshold > 40%)
      fix: rms_norm: mfuwatch.kernels.patch(model, kernels=["rms_norm"])  (expected gain 12.3% of step time)
      Runbook: https://…/MemoryBoundDominant.md
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


#: The most characters of a ``description`` annotation a message shows (whole lines, then "… N more line(s)").
MAX_DESCRIPTION = 2000


def fixes_of(a: AlertSnapshot) -> List[dict]:
    """The fixes a message names: the first suggestion, and the bundled drop-in when the first is not one;
    without suggestions, a hand-written ``suggested_apply`` annotation (with ``suggested_kernel`` and
    ``suggested_expected_gain`` when given) is the fix."""
    suggestions = list(a.context.get("suggestions") or [])
    shown = suggestions[:1]
    if shown and shown[0].get("kind") != "bundled":
        rest = [s for s in suggestions[1:] if s.get("kind") == "bundled"]
        shown += ([s for s in rest if not s.get("covered_by")] or rest)[:1]  # one no other fix covers, if any
    if not shown and a.annotations.get("suggested_apply"):
        shown = [{"kernel": a.annotations.get("suggested_kernel") or "fix", "apply": a.annotations["suggested_apply"],
                  "expected_gain": a.annotations.get("suggested_expected_gain")}]
    return shown


def gain_text(gain) -> str:
    """``  (expected gain 12.3% of step time)`` for a ratio, ``  (expected gain <as written>)`` for text."""
    if gain is None or gain == "":
        return ""
    if isinstance(gain, (int, float)):
        return f"  (expected gain {fmt_pct(gain)} of step time)"
    return f"  (expected gain {gain})"


def description_lines(a: AlertSnapshot, limit: int = MAX_DESCRIPTION) -> List[str]:
    """The ``description`` annotation as whole lines within ``limit`` characters (empty list when none)."""
    from .text import fit_lines

    text = a.annotations.get("description", "")
    return fit_lines(text.splitlines(), limit).splitlines() if text.strip() else []


def alert_lines(a: AlertSnapshot) -> List[str]:
    """The console lines of one alert."""
    lab = a.labels
    head = (f"[mfuwatch] {a.status.upper()} {a.name} ({a.severity}) run={lab.get('run', '')} "
            f"rank={lab.get('rank', '')} host={lab.get('host', '')}")
    lines = [head]
    if a.annotations.get("summary"):
        lines.append("  " + a.annotations["summary"])
    lines.extend("  " + x for x in description_lines(a))
    if a.value is not None:
        lines.append(f"  value {format_number(a.value, a.unit)} (threshold {a.op} {format_number(a.threshold, a.unit)})")
    hang = a.context.get("hang")
    if hang:  # a stall: where the training thread waits, innermost frame first
        lines.append("  waiting at: " + a.annotations.get("waiting_at", hang.get("where", "")))
        lines.extend("    " + f for f in hang.get("frames", [])[1:])
    for s in fixes_of(a):  # the first suggestion, and the bundled drop-in when there is one
        covered = f"  (covered by {s['covered_by']}, already suggested)" if s.get("covered_by") else ""
        lines.append(f"  fix: {s['kernel']}: {s['apply']}{gain_text(s.get('expected_gain'))}{covered}")
    if a.annotations.get("runbook_url"):
        lines.append("  Runbook: " + a.annotations["runbook_url"])
    return lines


def resolved_lines(a: AlertSnapshot) -> List[str]:
    """The console lines of a resolved alert: what ended and when, without the firing summary or fixes."""
    lab = a.labels
    head = (f"[mfuwatch] RESOLVED {a.name} ({a.severity}) run={lab.get('run', '')} rank={lab.get('rank', '')} "
            f"host={lab.get('host', '')}")
    parts = []
    if a.ends_at is not None and a.starts_at:
        parts.append(f"after {fmt_duration(max(0.0, a.ends_at - a.starts_at))}")
    reason = a.annotations.get("resolved_reason")
    if reason:
        parts.append(reason)
    elif a.value is not None:
        parts.append(f"last value {format_number(a.value, a.unit)}")
    return [head + (f"  ({'; '.join(parts)})" if parts else "")]


class ConsoleNotifier(Notifier):
    """Writes alerts as text to ``stream`` (``stderr``, ``stdout``) or logs them (``log``: WARNING/INFO).

    A terminal is not a pager: each alert is printed in full once when it fires and
    in one line when it resolves. A notification that only repeats alerts already
    printed (a group change, the ``repeat_interval`` reminder) prints one
    ``still firing`` line instead of the blocks again.
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        self._shown: set = set()  # fingerprints printed as firing and not resolved since

    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        lines: List[str] = []
        again = []
        for a in notification.alerts:
            if a.status == "resolved":
                lines += resolved_lines(a)
                self._shown.discard(a.fingerprint)
            elif a.fingerprint in self._shown:
                again.append(a.name)
            else:
                self._shown.add(a.fingerprint)
                lines += alert_lines(a)
        if again and not lines:
            run = notification.group_labels.get("run", "")
            lines.append(f"[mfuwatch] still firing: {', '.join(again)} (run={run})")
        if not lines:
            return "sent"
        text = "\n".join(lines)
        stream = self.config.stream
        if stream == "log":
            log.log(logging.WARNING if notification.status == "firing" else logging.INFO, "%s", text)
        else:
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(text + "\n")
            out.flush()
        return "sent"
