"""Discord notifier: a message with one embed per alert to a channel webhook; 429 waits ``retry_after``.

Format, as Discord documents it (Webhook Resource, "Execute Webhook",
discord.com/developers/docs/resources/webhook#execute-webhook; embed limits:
Message Resource, "Embed Limits", discord.com/developers/docs/resources/message#embed-object-embed-limits;
rate limits: discord.com/developers/docs/topics/rate-limits)::

    POST https://discord.com/api/webhooks/<id>/<token>       (url_env / url_file: the URL is the secret)
    {"username": "mfuwatch", "content": "[FIRING] MemoryBoundDominant · run demo",
     "allowed_mentions": {"parse": []},
     "embeds": [{"title": "MemoryBoundDominant (info)", "description": "summary\\n**Fix** ...",
                 "color": 15158332, "url": "<dashboard>", "timestamp": "2025-06-01T18:00:00.000Z",
                 "fields": [{"name": "Run", "value": "demo", "inline": true}, ...],
                 "footer": {"text": "node7/demo/rank0"}}]}

Limits: ``content`` ≤ 2000 characters; ≤ 10 embeds; embed ``title`` ≤ 256,
``description`` ≤ 4096, ≤ 25 ``fields`` with ``name`` ≤ 256 and ``value`` ≤ 1024,
``footer.text`` ≤ 2048, and all embeds of a message together ≤ 6000 characters
(title, description, field names and values, footer). Alerts past 10 embeds or past
6000 characters are named in ``content`` instead. Text is cut by whole lines
(:func:`~.text.fit_lines`), so a fix's apply line is whole or absent.
``allowed_mentions`` with an empty ``parse`` keeps an ``@everyone`` in a summary inert.

A 429 answer carries ``{"retry_after": <seconds, a float>, "global": bool}`` in its
JSON body (and a ``Retry-After`` header): the next try waits that long (capped at
``max_backoff``). ``api_url`` replaces the scheme and host of the secret URL (a
proxy or a test server), keeping its path.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import requests

from ..model import AlertSnapshot, Notification, rfc3339
from .http import HttpNotifier
from .text import description_lines as description_text
from .text import MAX_URL, cut, facts, fit_lines, fix_line, links, shown_fixes, source, title

MAX_CONTENT = 2000
MAX_EMBEDS = 10
MAX_TITLE = 256
MAX_DESCRIPTION = 4096
MAX_FIELDS = 25
MAX_FIELD_NAME = 256
MAX_FIELD_VALUE = 1024
MAX_FOOTER = 2048
MAX_EMBED_TOTAL = 6000
COLOR = {"critical": 0xE74C3C, "warning": 0xF1C40F, "info": 0x3498DB, "resolved": 0x2ECC71}


def embed_size(e: Dict[str, Any]) -> int:
    """Characters that count against Discord's 6000 per message: title, description, fields, footer."""
    return (len(e.get("title", "")) + len(e.get("description", "")) + len(e.get("footer", {}).get("text", ""))
            + sum(len(f["name"]) + len(f["value"]) for f in e.get("fields", [])))


def description_lines(a: AlertSnapshot) -> List[str]:
    """The summary, where a stall waits, the fixes (one whole line each) and the links, as Discord markdown."""
    lines = [a.annotations.get("summary", "")] if a.annotations.get("summary") else []
    if a.status == "resolved":
        if a.annotations.get("resolved_reason"):
            lines.append(f"Ended: {a.annotations['resolved_reason']}")
        return lines
    if a.annotations.get("waiting_at"):
        lines.append(f"**Training thread waits at** `{a.annotations['waiting_at']}`")
    lines += [f"**Fix:** `{fix_line(s)}`" for s in shown_fixes(a)]
    lines += [f"[{label}]({url})" for label, url in links(a)]
    return lines + description_text(a)  # last: a long description never pushes the fix out


def alert_embed(a: AlertSnapshot, budget: int = MAX_EMBED_TOTAL) -> Dict[str, Any]:
    """One alert's embed within the per-field limits and ``budget`` characters in all."""
    state = "resolved" if a.status == "resolved" else a.severity
    e: Dict[str, Any] = {"title": cut(f"{a.name} ({state})", MAX_TITLE), "color": COLOR.get(state, COLOR["info"]),
                         "fields": [{"name": cut(k, MAX_FIELD_NAME), "value": cut(str(v) or "-", MAX_FIELD_VALUE),
                                     "inline": True} for k, v in facts(a)][:MAX_FIELDS],
                         "footer": {"text": cut(source(a), MAX_FOOTER)}}
    ts = a.ends_at if a.status == "resolved" and a.ends_at else a.starts_at
    if ts:
        e["timestamp"] = rfc3339(ts)
    if a.dashboard_url and len(a.dashboard_url) <= MAX_URL:
        e["url"] = a.dashboard_url
    room = min(MAX_DESCRIPTION, budget - embed_size(e))
    e["description"] = fit_lines(description_lines(a), max(0, room)) if room > 0 else ""
    if not e["description"]:
        del e["description"]
    return e


def discord_message(notification: Notification) -> Dict[str, Any]:
    """The webhook body for ``notification`` within Discord's limits (see the module docstring)."""
    embeds: List[Dict[str, Any]] = []
    left = MAX_EMBED_TOTAL
    for a in notification.alerts:
        if len(embeds) >= MAX_EMBEDS:
            break
        e = alert_embed(a, left)
        if embed_size(e) > left:
            break
        embeds.append(e)
        left -= embed_size(e)
    lines = [title(notification)]
    rest = notification.alerts[len(embeds):]
    if rest:
        lines.append(f"…and {len(rest)} more: " + ", ".join(
            f"{a.name}{'' if a.status == 'firing' else ' (resolved)'}" for a in rest))
    return {"username": "mfuwatch", "content": fit_lines(lines, MAX_CONTENT), "embeds": embeds,
            "allowed_mentions": {"parse": []}}


class DiscordNotifier(HttpNotifier):
    """POSTs :func:`discord_message` to the webhook URL from ``url_env``/``url_file``."""

    def render(self, notification: Notification) -> Dict[str, Any]:
        return discord_message(notification)

    def url_warnings(self) -> List[str]:
        """``check``'s warning when the webhook URL is not ``…/api/webhooks/<id>/<token>`` (the token is the
        credential; the URL is never shown): Discord answers such a POST 401 or 404."""
        import re
        import urllib.parse

        assert self._url is not None
        path = urllib.parse.urlsplit(self._url.reveal()).path
        if not re.search(r"/api(/v\d+)?/webhooks/\d+/[^/]+/?$", path):
            return [f"notifier {self.name}: the webhook URL from {self._url.source} does not end in "
                    "/api/webhooks/<id>/<token> (the token is its credential); Discord will answer 401 or 404"]
        return []

    def retry_after(self, resp: requests.Response) -> Optional[float]:
        """A 429's ``retry_after`` (seconds, may be fractional) from the JSON body, else ``Retry-After``."""
        if resp.status_code == 429:
            try:
                value = float(resp.json()["retry_after"])
                if value >= 0:
                    return value
            except (ValueError, KeyError, TypeError):
                pass
        return super().retry_after(resp)
