"""PagerDuty notifier: Events API v2, one ``trigger`` per firing alert and one ``resolve`` on the same ``dedup_key``.

Format, as PagerDuty documents it ("Send an Alert Event",
developer.pagerduty.com/docs/events-api-v2/trigger-events/, and the Events API v2
OpenAPI schema in github.com/PagerDuty/api-schema, reference/events-v2)::

    POST https://events.pagerduty.com/v2/enqueue        (api_url overrides it, e.g. an EU account's
                                                         https://events.eu.pagerduty.com/v2/enqueue)
    {"routing_key": "<integration key>", "event_action": "trigger", "dedup_key": "<fingerprint>",
     "payload": {"summary": "...", "source": "node7/demo/rank0", "severity": "critical",
                 "timestamp": "2025-06-01T18:00:00.000Z", "component": "mfuwatch", "group": "demo",
                 "class": "MemoryBoundDominant", "custom_details": {...}},
     "links": [{"href": "https://.../MemoryBoundDominant.md", "text": "Runbook"}, ...],
     "client": "mfuwatch", "client_url": "<dashboard>"}
    {"routing_key": "...", "event_action": "resolve", "dedup_key": "<fingerprint>"}

Limits: ``summary`` ≤ 1024 characters; ``dedup_key`` ≤ 255; ``severity`` one of
``critical``, ``error``, ``warning``, ``info`` (mfuwatch's critical/warning/info map
to the same names; ``severity_map`` may change that, e.g. ``{warning: error}``);
the whole event ≤ 512 KB. PagerDuty answers 202 when it accepted the event; 400
is a bad event (not retried); 429 (rate limit) and 5xx are retried with backoff, as
its "API Response Codes & Retry Logic" table asks.

``dedup_key`` is the alert's fingerprint (the Alertmanager fingerprint of its
labels, which hold run, rank and host), so a repeat of a firing alert updates the
same PagerDuty alert, and the resolve of the run's end (or of a preemption, which
the agent closes the same way) closes exactly the incident its trigger opened.
The routing key is the secret (``routing_key_env`` / ``routing_key_file``); it is
only ever in the request body, never in a log line or an error.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional

from ..model import AlertSnapshot, Notification, rfc3339
from ..secrets import Secret, resolve_secret
from .http import HttpNotifier
from .text import MAX_URL, cut, facts, fit_lines, fix_details, links, plain_lines, source

DEFAULT_URL = "https://events.pagerduty.com/v2/enqueue"
MAX_SUMMARY = 1024
MAX_DEDUP_KEY = 255
MAX_EVENT_BYTES = 512 * 1024
MAX_DETAIL = 8000  # one custom_details value (ours: the text of the alert); keeps events far below 512 KB
SEVERITY = {"critical": "critical", "warning": "warning", "info": "info"}
PD_SEVERITIES = ("critical", "error", "warning", "info")


def pd_summary(a: AlertSnapshot) -> str:
    """``MemoryBoundDominant on run demo rank 0: <summary>`` within 1024 characters; just
    ``TrainingStalled: <summary>`` when the summary already names the run (the built-in ones do)."""
    run = a.labels.get("run", "")
    summary = a.annotations.get("summary", "")
    if summary and run and f"run {run}" in summary:
        return cut(f"{a.name}: {summary}", MAX_SUMMARY)
    head = f"{a.name} on run {run} rank {a.labels.get('rank', '')}"
    return cut(f"{head}: {summary}" if summary else head, MAX_SUMMARY)


def custom_details(a: AlertSnapshot) -> Dict[str, Any]:
    """The alert's facts, fix (kernel, apply line, expected gain), stall frames and labels, as flat fields."""
    d: Dict[str, Any] = {k.lower().replace(" ", "_"): v for k, v in facts(a)}
    d.update(fix_details(a))
    for key in ("description", "waiting_at", "stack", "top_memory_bound_ops"):
        if a.annotations.get(key):
            d[key] = fit_lines(a.annotations[key].splitlines(), MAX_DETAIL)
    d["text"] = fit_lines(plain_lines(a), MAX_DETAIL)
    d["labels"] = dict(a.labels)
    return d


def trigger_event(a: AlertSnapshot, routing_key: str, severity_map: Dict[str, str],
                  external_url: str = "") -> Dict[str, Any]:
    """The ``trigger`` event of a firing alert (see the module docstring)."""
    event: Dict[str, Any] = {
        "routing_key": routing_key, "event_action": "trigger", "dedup_key": a.fingerprint[:MAX_DEDUP_KEY],
        "payload": {"summary": pd_summary(a), "source": source(a),
                    "severity": severity_map.get(a.severity, SEVERITY.get(a.severity, "error")),
                    "timestamp": rfc3339(a.starts_at) if a.starts_at else None,
                    "component": "mfuwatch", "group": a.labels.get("run", ""), "class": a.name,
                    "custom_details": custom_details(a)},
        "links": [{"href": url, "text": text} for text, url in links(a)],
        "client": "mfuwatch",
    }
    if event["payload"]["timestamp"] is None:
        del event["payload"]["timestamp"]
    client_url = a.dashboard_url or external_url
    if client_url and len(client_url) <= MAX_URL:
        event["client_url"] = client_url
    return shrink(event)


def resolve_event(a: AlertSnapshot, routing_key: str) -> Dict[str, Any]:
    """The ``resolve`` event of a resolved alert: the same ``dedup_key`` as its trigger."""
    return {"routing_key": routing_key, "event_action": "resolve", "dedup_key": a.fingerprint[:MAX_DEDUP_KEY]}


def shrink(event: Dict[str, Any]) -> Dict[str, Any]:
    """``event`` within 512 KB of JSON: the longest custom_details values go first, whole."""
    details = event["payload"]["custom_details"]
    while len(json.dumps(event, ensure_ascii=False).encode("utf-8")) > MAX_EVENT_BYTES and details:
        longest = max(details, key=lambda k: len(json.dumps(details[k], ensure_ascii=False)))
        details[longest] = "(left out: the event was over PagerDuty's 512 KB)"
        if all(isinstance(v, str) and v.startswith("(left out") for v in details.values()):
            break
    return event


class PagerDutyNotifier(HttpNotifier):
    """Sends one Events API v2 event per alert of a notification, in order (see the module docstring).

    Every event of a notification is delivered (and retried) before the next notification;
    a rejected event (400) does not stop the others. The outcome is ``failed`` if any event
    was rejected, ``dropped`` if the worker gave the notification up while retrying.
    """

    url_is_secret = False

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self._key: Secret = resolve_secret(config.routing_key_env, config.routing_key_file,
                                           f"notifier {config.name!r} routing_key")
        self._severity_map = dict(config.severity_map)

    def events(self, notification: Notification) -> List[Dict[str, Any]]:
        """The events of ``notification``: a trigger per firing alert, a resolve per resolved one."""
        key = self._key.reveal()
        return [trigger_event(a, key, self._severity_map, notification.external_url) if a.status == "firing"
                else resolve_event(a, key) for a in notification.alerts]

    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        events = self.rendered(self.events, notification)
        if events is None:
            return "failed"
        return post_each(self, events, wait, on_retry, self.config.api_url or DEFAULT_URL)


def post_each(notifier: HttpNotifier, bodies: List[Dict[str, Any]], wait: Callable[[float], bool],
              on_retry: Callable[[], None], url: Optional[str], headers: Optional[Dict[str, str]] = None,
              urls: Optional[List[str]] = None) -> str:
    """POST each body in order (``urls[i]`` or ``url``); ``dropped`` as soon as one is given up, else
    ``failed`` if any was rejected, else ``sent``. Shared by PagerDuty (an event per alert) and Opsgenie."""
    outcome = "sent"
    for i, body in enumerate(bodies):
        got = notifier.post_json(body, wait, on_retry, url=urls[i] if urls else url, headers=headers)
        if got == "dropped":
            return "dropped"
        if got != "sent":
            outcome = "failed"
    return outcome
