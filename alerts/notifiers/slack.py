"""Slack notifier: a Block Kit message to an incoming webhook.

One message per notification (a group of alerts of one run)::

    header   [FIRING] MemoryBoundDominant · run demo
    section  *MemoryBoundDominant* (info) — summary
    section  fields: Run, Rank, Host, Value (threshold), Since
    section  top memory-bound ops and their share (a small monospace table)
    section  suggested fix: kernel, title, the exact line that applies it, expected gain
    section  (a stall) where the training thread waits: its innermost frames
    context  Runbook · Grafana dashboard filtered to the run
    divider

Slack's Block Kit limits (api.slack.com/reference/block-kit/blocks): at most 50
blocks per message; header text ≤ 150 characters (plain text); section text ≤ 3000;
section ``fields`` ≤ 10 items of ≤ 2000 characters; context ≤ 10 elements. Every
string is cut to its limit and alerts past the block budget are summarised in one
line, so a large group still posts. Text is escaped for mrkdwn (``&``, ``<``, ``>``).
"""

from __future__ import annotations

from typing import Any, Dict, List

from ..model import AlertSnapshot, Notification
from ..templates import fmt_pct
from .console import description_lines, fixes_of, format_number, gain_text
from .http import HttpNotifier

MAX_BLOCKS = 50
MAX_HEADER = 150
MAX_SECTION_TEXT = 3000
MAX_FIELDS = 10
MAX_FIELD_TEXT = 2000
MAX_CONTEXT_ELEMENTS = 10
MAX_FALLBACK_TEXT = 3000
_EMOJI = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}


def cut(text: str, limit: int) -> str:
    """``text`` shortened to at most ``limit`` characters, ending in an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def esc(text: str) -> str:
    """Escape the three characters Slack's mrkdwn treats as control characters."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _md(text: str, limit: int = MAX_SECTION_TEXT) -> Dict[str, str]:
    return {"type": "mrkdwn", "text": cut(text, limit)}


def _link(url: str, label: str) -> str:
    return f"<{esc(url).replace('|', '%7C')}|{esc(label)}>"


def alert_blocks(a: AlertSnapshot) -> List[Dict[str, Any]]:
    """The blocks of one alert (at most 6: a stall's frames come instead of the ops and fix sections)."""
    lab = a.labels
    state = "resolved" if a.status == "resolved" else a.severity
    emoji = ":white_check_mark:" if a.status == "resolved" else _EMOJI.get(a.severity, "")
    title = f"{emoji} *{esc(a.name)}* ({esc(state)})"
    summary = a.annotations.get("summary", "")
    head = f"{title}\n{esc(summary)}"
    described = description_lines(a, MAX_SECTION_TEXT - len(head) - 200) if a.status == "firing" else []
    if described:
        head += "\n" + esc("\n".join(described))
    blocks: List[Dict[str, Any]] = [{"type": "section", "text": _md(head)}]
    fields = [f"*Run*\n`{esc(lab.get('run', ''))}`", f"*Rank*\n{esc(lab.get('rank', ''))}",
              f"*Host*\n{esc(lab.get('host', '') or 'n/a')}"]
    if a.value is not None:
        fields.append(f"*Value*\n{esc(format_number(a.value, a.unit))} "
                      f"(threshold {esc(a.op)} {esc(format_number(a.threshold, a.unit))})")
    fields.append(f"*{'Resolved' if a.status == 'resolved' else 'Firing since'}*\n"
                  f"{_utc(a.ends_at if a.status == 'resolved' and a.ends_at else a.starts_at)}")
    blocks.append({"type": "section", "fields": [_md(f, MAX_FIELD_TEXT) for f in fields[:MAX_FIELDS]]})
    hang = a.context.get("hang")
    if hang and a.status == "firing":  # a stall: where the training thread waits, innermost frame first
        text = f"*Training thread waits at* `{esc(a.annotations.get('waiting_at', hang.get('where', '')))}`"
        if hang.get("frames"):
            text += "\n```" + esc("\n".join(hang["frames"])) + "```"
        blocks.append({"type": "section", "text": _md(text)})
    ops = a.context.get("top_ops") or []
    if ops and a.status == "firing":
        width = min(48, max(len(o["op"]) for o in ops))
        rows = [f"{'op'.ljust(width)}  share"] + [f"{cut(o['op'], width).ljust(width)}  {fmt_pct(o['share'])}"
                                                  for o in ops[:8]]
        blocks.append({"type": "section", "text": _md("*Top memory-bound ops* (share of GPU busy time)\n```"
                                                      + esc("\n".join(rows)) + "```")})
    suggestions = a.context.get("suggestions") or []
    if suggestions and a.status == "firing":
        s = suggestions[0]
        text = (f"*Suggested fix:* `{esc(s['kernel'])}` — {esc(s.get('title', ''))} ({esc(s.get('kind', ''))})\n"
                f"```{esc(s['apply'])}```\nExpected gain: *{fmt_pct(s['expected_gain'])}* of step time")
        bundled = [o for o in suggestions[1:] if o.get("kind") == "bundled"]
        if s.get("kind") != "bundled" and bundled:
            b = bundled[0]
            text += (f"\n*Bundled drop-in:* `{esc(b['kernel'])}` — {esc(b.get('title', ''))}\n"
                     f"```{esc(b['apply'])}```\nExpected gain: *{fmt_pct(b['expected_gain'])}* of step time")
        others = [f"`{esc(o['kernel'])}` ({fmt_pct(o['expected_gain'])})" for o in suggestions[1:]
                  if not (bundled and o is bundled[0] and s.get("kind") != "bundled")]
        if others:
            text += "\nAlso: " + ", ".join(others)
        blocks.append({"type": "section", "text": _md(text)})
    elif a.status == "firing" and fixes_of(a):  # a hand-written suggested_apply annotation
        s = fixes_of(a)[0]
        blocks.append({"type": "section", "text": _md(f"*Suggested fix:* `{esc(s['kernel'])}`\n```{esc(s['apply'])}```"
                                                      + esc(gain_text(s.get("expected_gain"))))})
    links = []
    if a.annotations.get("runbook_url"):
        links.append(_md(_link(a.annotations["runbook_url"], "Runbook"), MAX_FIELD_TEXT))
    if a.dashboard_url:
        links.append(_md(_link(a.dashboard_url, f"Grafana: run {lab.get('run', '')}"), MAX_FIELD_TEXT))
    if links:
        blocks.append({"type": "context", "elements": links[:MAX_CONTEXT_ELEMENTS]})
    blocks.append({"type": "divider"})
    return blocks


def slack_message(notification: Notification) -> Dict[str, Any]:
    """The Block Kit message (``text`` fallback + ``blocks``) for ``notification``, within Slack's limits."""
    alerts = notification.alerts
    firing = [a for a in alerts if a.status == "firing"]
    run = notification.group_labels.get("run") or (alerts[0].labels.get("run", "") if alerts else "")
    status = notification.status.upper()
    if len(alerts) == 1:
        head = f"[{status}] {alerts[0].name} · run {run}"
    else:
        head = f"[{status}{':' + str(len(firing)) if firing else ''}] {len(alerts)} alerts · run {run}"
    head = " ".join(head.split())  # a run name with CR/LF stays one line
    blocks: List[Dict[str, Any]] = [{"type": "header", "text": {"type": "plain_text", "text": cut(head, MAX_HEADER),
                                                                "emoji": True}}]
    shown = 0
    for a in alerts:
        more = alert_blocks(a)
        if len(blocks) + len(more) > MAX_BLOCKS - 1:  # keep one block for the overflow line
            break
        blocks.extend(more)
        shown += 1
    if shown < len(alerts):
        rest = ", ".join(a.name for a in alerts[shown:])
        blocks.append({"type": "section", "text": _md(f"…and {len(alerts) - shown} more: {esc(rest)}")})
    fallback = "; ".join(f"[{a.status.upper()}] {a.name}: {esc(a.annotations.get('summary', ''))}" for a in alerts)
    return {"text": cut(fallback, MAX_FALLBACK_TEXT), "blocks": blocks}


def _utc(ts: float) -> str:
    import datetime as _dt

    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class SlackNotifier(HttpNotifier):
    """POSTs :func:`slack_message` to the incoming-webhook URL from ``url_env``/``url_file``."""

    def render(self, notification: Notification) -> Dict[str, Any]:
        return slack_message(notification)
