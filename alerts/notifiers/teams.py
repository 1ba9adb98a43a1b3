"""Microsoft Teams notifier: an Adaptive Card posted to a Workflows webhook ("When a Teams webhook request is received").

Microsoft retired the Office 365 connector webhooks; a Workflows webhook accepts
only Adaptive Cards ("Workflows support Adaptive Cards only", Microsoft Learn, "Create and
send messages", learn.microsoft.com/microsoftteams/platform/webhooks-and-connectors/how-to/connectors-using),
wrapped in a message with one attachment ("Send Adaptive Cards using an Incoming Webhook"
and the 28 KB message limit, learn.microsoft.com/microsoftteams/platform/webhooks-and-connectors/how-to/add-incoming-webhook;
card schema: adaptivecards.io/explorer)::

    POST <the workflow's HTTP URL>                        (url_env / url_file: the URL, with its sig=, is the secret)
    {"type": "message",
     "attachments": [{"contentType": "application/vnd.microsoft.card.adaptive", "contentUrl": null,
                      "content": {"$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                                  "type": "AdaptiveCard", "version": "1.4", "msteams": {"width": "Full"},
                                  "body": [TextBlock title, per alert a Container of TextBlocks + FactSet],
                                  "actions": [Action.OpenUrl runbook / dashboard, ...]}}]}

Limit: the message is at most 28 KB; alerts that do not fit are named in a last
TextBlock. Each text is cut by whole lines (:func:`~.text.fit_lines`), so a fix's
apply line is whole or absent. The workflow answers 202; 429 (more than four
requests a second) and 5xx are retried with backoff. ``api_url`` replaces the
scheme and host of the secret URL (a proxy or a test server), keeping its path and
query.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

from ..model import AlertSnapshot, Notification
from .http import HttpNotifier
from .text import cut, description_lines, facts, fit_lines, fix_line, links, shown_fixes, source, title

CARD_CONTENT_TYPE = "application/vnd.microsoft.card.adaptive"
CARD_SCHEMA = "http://adaptivecards.io/schemas/adaptive-card.json"
CARD_VERSION = "1.4"
MAX_MESSAGE_BYTES = 28 * 1024
MAX_TEXT = 3000  # one TextBlock: keeps a single alert well inside the 28 KB message
MAX_FACT = 500
MAX_ACTIONS = 6
_COLOR = {"critical": "Attention", "warning": "Warning", "info": "Accent", "resolved": "Good"}


def _text(text: str, **style: Any) -> Dict[str, Any]:
    return {"type": "TextBlock", "text": text, "wrap": True, **style}


def alert_container(a: AlertSnapshot) -> Dict[str, Any]:
    """One alert: name and state, summary, facts, where a stall waits, the fixes (monospace), the links."""
    state = "resolved" if a.status == "resolved" else a.severity
    items: List[Dict[str, Any]] = [_text(cut(f"{a.name} ({state})", MAX_TEXT), weight="Bolder",
                                         color=_COLOR.get(state, "Default"))]
    if a.annotations.get("summary"):
        items.append(_text(fit_lines(a.annotations["summary"].splitlines(), MAX_TEXT)))
    if a.status == "firing" and description_lines(a, MAX_TEXT):
        items.append(_text("\n\n".join(description_lines(a, MAX_TEXT)), isSubtle=True))
    fs = [{"title": cut(k, MAX_FACT), "value": cut(str(v) or "-", MAX_FACT)} for k, v in facts(a)]
    fs.append({"title": "Source", "value": cut(source(a), MAX_FACT)})
    items.append({"type": "FactSet", "facts": fs})
    if a.status == "firing":
        if a.annotations.get("waiting_at"):
            items.append(_text(cut("Training thread waits at " + a.annotations["waiting_at"], MAX_TEXT)))
        fixes = [fix_line(s) for s in shown_fixes(a)]
        if fixes:
            items.append(_text("Suggested fix", weight="Bolder", spacing="Small"))
            items.append(_text(fit_lines(fixes, MAX_TEXT), fontType="Monospace"))
    elif a.annotations.get("resolved_reason"):
        items.append(_text(cut("Ended: " + a.annotations["resolved_reason"], MAX_TEXT), isSubtle=True))
    acts = [{"type": "Action.OpenUrl", "title": cut(label, 100), "url": url} for label, url in links(a)]
    if acts:
        items.append({"type": "ActionSet", "actions": acts[:MAX_ACTIONS]})
    return {"type": "Container", "separator": True, "spacing": "Medium", "items": items}


def card_message(body: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The Workflows webhook message holding one Adaptive Card with ``body``."""
    card = {"$schema": CARD_SCHEMA, "type": "AdaptiveCard", "version": CARD_VERSION, "msteams": {"width": "Full"},
            "body": body}
    return {"type": "message", "attachments": [{"contentType": CARD_CONTENT_TYPE, "contentUrl": None,
                                                "content": card}]}


def size(message: Dict[str, Any]) -> int:
    """Bytes of ``message`` as sent (UTF-8 JSON)."""
    return len(json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def teams_message(notification: Notification) -> Dict[str, Any]:
    """The message for ``notification`` within 28 KB (see the module docstring)."""
    body: List[Dict[str, Any]] = [_text(cut(title(notification), MAX_TEXT), size="Large", weight="Bolder",
                                        color="Good" if notification.status == "resolved" else "Default")]
    shown = 0
    budget = MAX_MESSAGE_BYTES - 600  # room for the "and N more" block
    for a in notification.alerts:
        trial = body + [alert_container(a)]
        if size(card_message(trial)) > budget:
            break
        body = trial
        shown += 1
    rest = notification.alerts[shown:]
    if rest:
        names = [f"{a.name}{'' if a.status == 'firing' else ' (resolved)'}" for a in rest]
        more = _text(cut(f"…and {len(rest)} more: " + ", ".join(names), 400), isSubtle=True)
        body.append(more)
    return card_message(body)


class TeamsNotifier(HttpNotifier):
    """POSTs :func:`teams_message` to the Workflows webhook URL from ``url_env``/``url_file``."""

    def render(self, notification: Notification) -> Dict[str, Any]:
        return teams_message(notification)

    def url_warnings(self) -> List[str]:
        """``check``'s warning when the Workflows URL lacks its ``sig=`` credential (the URL is never shown):
        Microsoft answers such a POST 401."""
        import urllib.parse

        assert self._url is not None
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self._url.reveal()).query)
        if "sig" not in query:
            return [f"notifier {self.name}: the Workflows URL from {self._url.source} has no sig= parameter (its "
                    "credential); Teams will answer 401: copy the whole URL the workflow shows"]
        return []
