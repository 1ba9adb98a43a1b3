"""Local stand-ins for PagerDuty, Opsgenie, Microsoft Teams (Workflows) and Discord that check the documented format.

Each is an :class:`~helpers.receiver.AlertReceiver` on 127.0.0.1 with a ``check`` that
lists every way a request breaks the vendor's published format and limits, written
here from the vendors' documentation and independently of the notifiers:

* PagerDuty Events API v2 (developer.pagerduty.com/docs/events-api-v2/trigger-events/):
  ``routing_key`` (32 characters for a real integration key), ``event_action`` in
  trigger/acknowledge/resolve, ``dedup_key`` ≤ 255; a trigger needs ``payload`` with
  ``summary`` (≤ 1024), ``source``, ``severity`` in critical/error/warning/info; the
  event ≤ 512 KB. The stand-in also keeps the open alerts by ``dedup_key``, so a test
  can check that every trigger was resolved and no resolve came without a trigger.
* Opsgenie Alert API v2 (docs.opsgenie.com/docs/alert-api): ``Authorization: GenieKey
  <key>``; create at ``/v2/alerts`` with ``message`` (required, ≤ 130), ``alias`` ≤ 512,
  ``description`` ≤ 15000, ≤ 20 ``tags`` of ≤ 50, ``details`` ≤ 8000 characters in all,
  ``entity`` ≤ 512, ``source`` ≤ 100, ``priority`` in P1..P5; close at
  ``/v2/alerts/<alias>/close?identifierType=alias`` (``note`` ≤ 25000). Open aliases kept.
* Teams Workflows (learn.microsoft.com/microsoftteams/platform/webhooks-and-connectors/how-to/add-incoming-webhook):
  ``{"type": "message", "attachments": [{"contentType": "application/vnd.microsoft.card.adaptive",
  "content": {"type": "AdaptiveCard", "version", "body": [...]}}]}``, at most 28 KB;
  body elements of known Adaptive Card types.
* Discord Execute Webhook (discord.com/developers/docs/resources/webhook#execute-webhook,
  .../resources/message#embed-object-embed-limits): ``content`` ≤ 2000 or at least one
  embed; ≤ 10 embeds; title ≤ 256, description ≤ 4096, ≤ 25 fields of name ≤ 256 and
  value ≤ 1024, footer ≤ 2048, all embeds ≤ 6000 characters.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any, Dict, List

from helpers.receiver import AlertReceiver, Received

PD_ACTIONS = ("trigger", "acknowledge", "resolve")
PD_SEVERITIES = ("critical", "error", "warning", "info")
CARD_TYPES = {"TextBlock", "FactSet", "Container", "ActionSet", "ColumnSet", "Image", "RichTextBlock"}


def _body(rec: Received, problems: List[str]) -> Any:
    if "application/json" not in rec.headers.get("Content-Type", ""):
        problems.append(f"Content-Type {rec.headers.get('Content-Type')!r} is not JSON")
    try:
        return json.loads(rec.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        problems.append("body is not UTF-8 JSON")
        return None


def _max(problems: List[str], obj: Dict[str, Any], key: str, limit: int, where: str = "") -> None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or len(value) > limit):
        problems.append(f"{where}{key}: {len(value) if isinstance(value, str) else type(value).__name__} > {limit}")


class PagerDutyReceiver(AlertReceiver):
    """PagerDuty Events API v2 stand-in at ``/v2/enqueue``; :attr:`open` maps dedup_key -> last trigger."""

    def __init__(self, routing_key: str, **kw: Any) -> None:
        super().__init__(path="/v2/enqueue", check=self._check, **kw)
        self.routing_key = routing_key
        self.open: Dict[str, dict] = {}
        self.unpaired_resolves: List[str] = []
        self.default.status = 202

    def _check(self, rec: Received) -> List[str]:
        bad: List[str] = []
        if rec.path != "/v2/enqueue":
            bad.append("path is not /v2/enqueue")
        ev = _body(rec, bad)
        if not isinstance(ev, dict):
            return bad or ["event is not an object"]
        if len(rec.body) > 512 * 1024:
            bad.append(f"event of {len(rec.body)} bytes > 512 KB")
        if ev.get("routing_key") != self.routing_key:
            bad.append("wrong routing_key")
        if ev.get("event_action") not in PD_ACTIONS:
            bad.append(f"event_action {ev.get('event_action')!r}")
        key = ev.get("dedup_key")
        if not isinstance(key, str) or not 1 <= len(key) <= 255:
            bad.append("dedup_key missing or > 255")
        if ev.get("event_action") == "trigger":
            p = ev.get("payload")
            if not isinstance(p, dict):
                bad.append("trigger without payload")
            else:
                for k in ("summary", "source", "severity"):
                    if not isinstance(p.get(k), str) or not p[k]:
                        bad.append(f"payload.{k} missing")
                _max(bad, p, "summary", 1024, "payload.")
                if p.get("severity") not in PD_SEVERITIES:
                    bad.append(f"payload.severity {p.get('severity')!r}")
                if "custom_details" in p and not isinstance(p["custom_details"], dict):
                    bad.append("payload.custom_details is not an object")
            for link in ev.get("links", []):
                if not isinstance(link, dict) or not isinstance(link.get("href"), str):
                    bad.append("a link without href")
        if not bad:
            with self._lock:
                if ev["event_action"] == "trigger":
                    self.open[key] = ev
                elif ev["event_action"] == "resolve":
                    if key not in self.open:
                        self.unpaired_resolves.append(key)
                    self.open.pop(key, None)
        return bad

    def events(self) -> List[dict]:
        """The accepted events (2xx), in order."""
        return [r.json for r in self.delivered]


class OpsgenieReceiver(AlertReceiver):
    """Opsgenie Alert API v2 stand-in (base URL :attr:`base`); :attr:`open` maps alias -> create body."""

    def __init__(self, api_key: str, **kw: Any) -> None:
        super().__init__(path="", check=self._check, **kw)
        self.api_key = api_key
        self.open: Dict[str, dict] = {}
        self.unpaired_closes: List[str] = []
        self.default.status = 202

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _check(self, rec: Received) -> List[str]:
        bad: List[str] = []
        if rec.headers.get("Authorization") != f"GenieKey {self.api_key}":
            bad.append("Authorization is not 'GenieKey <key>'")
        body = _body(rec, bad)
        if not isinstance(body, dict):
            return bad or ["body is not an object"]
        url = urllib.parse.urlsplit(rec.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/v2/alerts":
            if not isinstance(body.get("message"), str) or not body["message"]:
                bad.append("message missing")
            for k, n in (("message", 130), ("alias", 512), ("description", 15000), ("entity", 512),
                         ("source", 100), ("note", 25000)):
                _max(bad, body, k, n)
            tags = body.get("tags", [])
            if len(tags) > 20 or any(not isinstance(t, str) or len(t) > 50 for t in tags):
                bad.append("tags: more than 20, or one over 50 characters")
            details = body.get("details", {})
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in details.items()):
                bad.append("details: not string to string")
            elif sum(len(k) + len(v) for k, v in details.items()) > 8000:
                bad.append("details > 8000 characters")
            if body.get("priority", "P3") not in ("P1", "P2", "P3", "P4", "P5"):
                bad.append(f"priority {body.get('priority')!r}")
            if not bad and body.get("alias"):
                with self._lock:
                    self.open[body["alias"]] = body
        elif url.path.startswith("/v2/alerts/") and url.path.endswith("/close"):
            if query.get("identifierType") != ["alias"]:
                bad.append("close without identifierType=alias")
            _max(bad, body, "note", 25000)
            _max(bad, body, "source", 100)
            alias = urllib.parse.unquote(url.path[len("/v2/alerts/"):-len("/close")])
            if not bad:
                with self._lock:
                    if alias not in self.open:
                        self.unpaired_closes.append(alias)
                    self.open.pop(alias, None)
        else:
            bad.append(f"unknown endpoint {url.path}")
        return bad


class TeamsReceiver(AlertReceiver):
    """A Teams Workflows webhook stand-in: one Adaptive Card attachment, message ≤ 28 KB."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(path="/workflows/SECRETWF42/triggers/manual/paths/invoke?api-version=1&sig=SIGSECRET42",
                         check=self._check, **kw)
        self.default.status = 202

    @staticmethod
    def card(rec: Received) -> dict:
        return rec.json["attachments"][0]["content"]

    def _check(self, rec: Received) -> List[str]:
        bad: List[str] = []
        msg = _body(rec, bad)
        if len(rec.body) > 28 * 1024:
            bad.append(f"message of {len(rec.body)} bytes > 28 KB")
        if not isinstance(msg, dict) or msg.get("type") != "message":
            return bad + ["not a message"]
        att = msg.get("attachments")
        if not isinstance(att, list) or len(att) != 1:
            return bad + ["not exactly one attachment"]
        if att[0].get("contentType") != "application/vnd.microsoft.card.adaptive":
            bad.append(f"contentType {att[0].get('contentType')!r}")
        card = att[0].get("content") or {}
        if card.get("type") != "AdaptiveCard" or not isinstance(card.get("version"), str):
            bad.append("content is not an AdaptiveCard with a version")
        if not isinstance(card.get("body"), list) or not card["body"]:
            bad.append("card without body")

        def walk(elements: List[dict], where: str) -> None:
            for i, el in enumerate(elements):
                t = el.get("type")
                if t not in CARD_TYPES:
                    bad.append(f"{where}[{i}]: element type {t!r}")
                if t == "TextBlock" and not isinstance(el.get("text"), str):
                    bad.append(f"{where}[{i}]: TextBlock without text")
                if t == "FactSet" and not all(isinstance(f.get("title"), str) and isinstance(f.get("value"), str)
                                              for f in el.get("facts", [])):
                    bad.append(f"{where}[{i}]: a fact without title/value")
                if t == "ActionSet" and not all(a.get("type") == "Action.OpenUrl" and a.get("url")
                                                for a in el.get("actions", [])):
                    bad.append(f"{where}[{i}]: an action that is not Action.OpenUrl with a url")
                if t == "Container":
                    walk(el.get("items", []), f"{where}[{i}].items")

        walk(card.get("body") or [], "body")
        return bad


class DiscordReceiver(AlertReceiver):
    """A Discord channel-webhook stand-in checking Execute Webhook's fields and the embed limits."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(path="/api/webhooks/123456/DISCORDTOKENSECRET42", check=self._check, **kw)
        self.default.status = 204
        self.default.body = ""

    def _check(self, rec: Received) -> List[str]:
        bad: List[str] = []
        msg = _body(rec, bad)
        if not isinstance(msg, dict):
            return bad + ["not an object"]
        content, embeds = msg.get("content", ""), msg.get("embeds", [])
        if not content and not embeds:
            bad.append("neither content nor embeds")
        _max(bad, msg, "content", 2000)
        if len(embeds) > 10:
            bad.append(f"{len(embeds)} embeds > 10")
        total = 0
        for i, e in enumerate(embeds):
            w = f"embeds[{i}]."
            for k, n in (("title", 256), ("description", 4096)):
                _max(bad, e, k, n, w)
            fields = e.get("fields", [])
            if len(fields) > 25:
                bad.append(f"{w}fields: {len(fields)} > 25")
            for j, f in enumerate(fields):
                _max(bad, f, "name", 256, f"{w}fields[{j}].")
                _max(bad, f, "value", 1024, f"{w}fields[{j}].")
                if not f.get("name") or not f.get("value"):
                    bad.append(f"{w}fields[{j}]: empty name or value")
            _max(bad, e.get("footer", {}), "text", 2048, f"{w}footer.")
            total += len(e.get("title", "")) + len(e.get("description", "")) + len(e.get("footer", {}).get("text", ""))
            total += sum(len(f.get("name", "")) + len(f.get("value", "")) for f in fields)
        if total > 6000:
            bad.append(f"embeds: {total} characters > 6000")
        return bad
