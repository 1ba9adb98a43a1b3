"""Plain text shared by the vendor notifiers: cutting to a limit by whole lines, the fix lines, links, times.

Vendors cap their fields (PagerDuty's summary 1024 characters, Opsgenie's message
130, Discord's content 2000 ...). :func:`fit_lines` keeps whole lines while they
fit and says how many it left out, so the line that applies a fix
(``mfuwatch.kernels.patch(model, kernels=["rms_norm"])``) is either all there or
not there: a half line that no longer parses is worse than none. Only a first
line longer than the whole limit (a summary) is cut inside, with an ellipsis.
Lengths are counted in Python characters (code points), as the vendors count
characters; the JSON encoder escapes the text, so a cut never breaks the JSON.
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any, Dict, List, Mapping, Sequence

from ..model import AlertSnapshot, Notification
from ..templates import fmt_pct
from .console import alert_lines, description_lines, fixes_of, format_number, gain_text, resolved_lines

ELLIPSIS = "…"


def cut(text: str, limit: int) -> str:
    """``text`` shortened to at most ``limit`` characters, ending in an ellipsis when cut."""
    text = str(text)
    return text if len(text) <= limit else text[: max(0, limit - 1)] + ELLIPSIS


def fit_lines(lines: Sequence[str], limit: int, more: str = "… {n} more line(s)") -> str:
    """Whole ``lines`` joined by newlines within ``limit`` characters; when not all fit, as many as fit and
    then a ``more`` line naming how many were left out. Only when not even the first line fits is it cut
    inside (with an ellipsis)."""
    lines = [str(x) for x in lines]
    text = "\n".join(lines)
    if len(text) <= limit:
        return text
    n = len(lines)
    k, used = 0, -1  # used: length of "\n".join(lines[:k])
    while k < n and used + 1 + len(lines[k]) + 1 + len(more.format(n=n - k - 1)) <= limit:
        used += 1 + len(lines[k])
        k += 1
    if k:
        return "\n".join(lines[:k] + [more.format(n=n - k)])
    marker = more.format(n=n - 1)
    room = limit - len(marker) - 1
    if n > 1 and room >= 8:
        return cut(lines[0], room) + "\n" + marker
    return cut(lines[0], limit)


_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]+")


def one_line(text: str) -> str:
    """``text`` with every control character (CR, LF, tab, ...) and line separator replaced by one space, for
    a title, an e-mail header or a ``source``: a run named ``"a\r\nBcc: x"`` stays one harmless line."""
    return _CONTROL.sub(" ", str(text))


def utc(ts: float) -> str:
    """Unix seconds as ``2025-06-01 18:00:00 UTC``."""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def title(notification: Notification) -> str:
    """``[FIRING] MemoryBoundDominant · run demo`` or ``[FIRING:2] 3 alerts · run demo``."""
    alerts = notification.alerts
    run = notification.group_labels.get("run") or (alerts[0].labels.get("run", "") if alerts else "")
    status = notification.status.upper()
    if len(alerts) == 1:
        return one_line(f"[{status}] {alerts[0].name} · run {run}")
    firing = sum(1 for a in alerts if a.status == "firing")
    count = f":{firing}" if firing else ""
    return one_line(f"[{status}{count}] {len(alerts)} alerts · run {run}")


def source(a: AlertSnapshot) -> str:
    """Where the alert comes from: ``host/run/rank`` (``node7/demo/rank0``)."""
    lab = a.labels
    return one_line(f"{lab.get('host') or 'unknown-host'}/{lab.get('run', '')}/rank{lab.get('rank', '')}")


def shown_fixes(a: AlertSnapshot) -> List[Mapping[str, Any]]:
    """The suggestions a message names: the first, and the bundled drop-in when the first is not one (else a
    hand-written ``suggested_apply`` annotation; see :func:`~.console.fixes_of`)."""
    return fixes_of(a)


def fix_line(s: Mapping[str, Any]) -> str:
    """One fix, whole: ``rms_norm: mfuwatch.kernels.patch(...)  (expected gain 12.3% of step time)``."""
    covered = f"  (covered by {s['covered_by']}, already suggested)" if s.get("covered_by") else ""
    return f"{s['kernel']}: {s['apply']}{gain_text(s.get('expected_gain'))}{covered}"


def fix_details(a: AlertSnapshot) -> Dict[str, str]:
    """The fix as flat string fields (PagerDuty ``custom_details``, Opsgenie ``details``): kernel, the line
    that applies it, its expected gain; the bundled drop-in too when the first fix is not one."""
    out: Dict[str, str] = {}
    for i, s in enumerate(shown_fixes(a)):
        p = "fix" if i == 0 else "bundled_fix"
        out[f"{p}_kernel"] = str(s["kernel"])
        out[f"{p}_apply"] = str(s["apply"])
        gain = s.get("expected_gain")
        if gain is not None:
            out[f"{p}_expected_gain"] = (f"{fmt_pct(gain)} of step time" if isinstance(gain, (int, float))
                                         else str(gain))
    return out


def facts(a: AlertSnapshot) -> List[tuple]:
    """``(name, value)`` pairs: run, rank, host, value against the threshold, since / resolved at."""
    lab = a.labels
    out = [("Run", lab.get("run", "")), ("Rank", lab.get("rank", "")), ("Host", lab.get("host", "") or "n/a")]
    if a.value is not None:
        out.append(("Value", f"{format_number(a.value, a.unit)} (threshold {a.op} "
                             f"{format_number(a.threshold, a.unit)})"))
    if a.status == "resolved" and a.ends_at:
        out.append(("Resolved", utc(a.ends_at)))
    elif a.starts_at:
        out.append(("Firing since", utc(a.starts_at)))
    return out


#: A URL longer than this is left out of links (a cut URL leads nowhere; browsers and vendors stop near 2 KB).
MAX_URL = 2048


def links(a: AlertSnapshot) -> List[tuple]:
    """``(label, url)`` of the runbook and the Grafana dashboard filtered to the run (when known and at most
    :data:`MAX_URL` characters long)."""
    out = []
    if a.annotations.get("runbook_url"):
        out.append(("Runbook", a.annotations["runbook_url"]))
    if a.dashboard_url:
        out.append((f"Grafana: run {a.labels.get('run', '')}", a.dashboard_url))
    return [(label, url) for label, url in out if len(url) <= MAX_URL]


def plain_lines(a: AlertSnapshot) -> List[str]:
    """The console's lines of one alert (firing: summary, value, where it waits, fixes, runbook; resolved: one)."""
    return resolved_lines(a) if a.status == "resolved" else alert_lines(a)


def plain_with_links(a: AlertSnapshot, indent: str = "  ") -> List[str]:
    """:func:`plain_lines` and then the links they do not already hold (the dashboard; the runbook is there)."""
    lines = plain_lines(a)
    text = "\n".join(lines)
    return lines + [f"{indent}{label}: {url}" for label, url in links(a) if url not in text]
