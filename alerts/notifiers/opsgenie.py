"""Opsgenie notifier: Alert API v2, create an alert per firing alert (``alias`` = its fingerprint), close it by alias.

Format, as Opsgenie documents it (Alert API, docs.opsgenie.com/docs/alert-api:
"Create Alert" and "Close Alert"; field limits from the same page and "Alerts and
Alert Fields", docs.opsgenie.com/docs/alerts-and-alert-fields)::

    POST https://api.opsgenie.com/v2/alerts             (EU accounts: https://api.eu.opsgenie.com; region: eu)
    Authorization: GenieKey <api key of an API integration>
    {"message": "...", "alias": "<fingerprint>", "description": "...", "priority": "P1",
     "tags": ["mfuwatch", "MemoryBoundDominant", "severity:info", "run:demo"], "entity": "run demo",
     "source": "node7/demo/rank0", "details": {"fix_kernel": "rms_norm", "fix_apply": "...", ...}}

    POST https://api.opsgenie.com/v2/alerts/<fingerprint>/close?identifierType=alias
    {"source": "mfuwatch", "note": "resolved after 12m 30s (run ended)"}

Limits: ``message`` ≤ 130 characters; ``alias`` ≤ 512; ``description`` ≤ 15000;
``tags`` ≤ 20 of ≤ 50 characters; ``details`` ≤ 8000 characters in all (keys and
values); ``entity`` ≤ 512; ``source`` ≤ 100; ``note`` ≤ 25000. ``priority`` is P1–P5:
critical → P1, warning → P3, info → P5 unless ``severity_map`` says otherwise.
Opsgenie answers 202 (the request is processed asynchronously); 429 and 5xx are
retried with backoff, other 4xx are final. ``api_url`` replaces the region's base
URL (a proxy, a test server). The API key is the secret (``api_key_env`` /
``api_key_file``), sent only in the ``Authorization`` header.
"""

from __future__ import annotations

import urllib.parse
from typing import Any, Callable, Dict, List, Tuple

from ..model import AlertSnapshot, Notification
from ..secrets import Secret, resolve_secret
from ..templates import fmt_duration
from .http import HttpNotifier
from .pagerduty import post_each
from .text import cut, facts, fit_lines, fix_details, links, plain_with_links, source

BASE_URLS = {"us": "https://api.opsgenie.com", "eu": "https://api.eu.opsgenie.com"}
MAX_MESSAGE = 130
MAX_ALIAS = 512
MAX_DESCRIPTION = 15000
MAX_TAGS = 20
MAX_TAG = 50
MAX_DETAILS_TOTAL = 8000
MAX_ENTITY = 512
MAX_SOURCE = 100
MAX_NOTE = 25000
PRIORITY = {"critical": "P1", "warning": "P3", "info": "P5"}


def og_message(a: AlertSnapshot) -> str:
    """``[mfuwatch] MfuLow run demo rank 0: <summary>`` within 130 characters."""
    head = f"{a.name} run {a.labels.get('run', '')} rank {a.labels.get('rank', '')}"
    summary = a.annotations.get("summary", "")
    return cut(f"{head}: {summary}" if summary else head, MAX_MESSAGE)


def og_details(a: AlertSnapshot) -> Dict[str, str]:
    """Facts, the fix and links as string pairs, within 8000 characters in all; what does not fit is left
    out whole (fix fields first in, so they are the last to go)."""
    items: List[Tuple[str, str]] = list(fix_details(a).items())
    items += [(k.lower().replace(" ", "_"), str(v)) for k, v in facts(a)]
    items += [(label.split(":")[0].lower(), url) for label, url in links(a)]
    for key in ("waiting_at", "top_memory_bound_ops"):
        if a.annotations.get(key):
            items.append((key, str(a.annotations[key])))
    out: Dict[str, str] = {}
    used = 0
    for k, v in items:
        if used + len(k) + len(v) <= MAX_DETAILS_TOTAL:
            out[k] = v
            used += len(k) + len(v)
    return out


def og_tags(a: AlertSnapshot) -> List[str]:
    """Up to 20 tags of at most 50 characters: mfuwatch, the alert name, severity, run."""
    tags = ["mfuwatch", a.name, f"severity:{a.severity}", f"run:{a.labels.get('run', '')}"]
    return [cut(t, MAX_TAG) for t in dict.fromkeys(tags)][:MAX_TAGS]


def create_body(a: AlertSnapshot, priority_map: Dict[str, str]) -> Dict[str, Any]:
    """The "Create Alert" body of a firing alert."""
    lines = plain_with_links(a)
    return {"message": og_message(a), "alias": a.fingerprint[:MAX_ALIAS],
            "description": fit_lines(lines, MAX_DESCRIPTION),
            "priority": priority_map.get(a.severity, PRIORITY.get(a.severity, "P3")),
            "tags": og_tags(a), "entity": cut(f"run {a.labels.get('run', '')}", MAX_ENTITY),
            "source": cut(source(a), MAX_SOURCE), "details": og_details(a)}


def close_body(a: AlertSnapshot) -> Dict[str, Any]:
    """The "Close Alert" body of a resolved alert: how long it fired and why it ended."""
    parts = []
    if a.ends_at is not None and a.starts_at:
        parts.append(f"after {fmt_duration(max(0.0, a.ends_at - a.starts_at))}")
    if a.annotations.get("resolved_reason"):
        parts.append(a.annotations["resolved_reason"])
    return {"source": "mfuwatch", "note": cut("resolved" + (f" {'; '.join(parts)}" if parts else ""), MAX_NOTE)}


class OpsgenieNotifier(HttpNotifier):
    """Creates and closes Opsgenie alerts, one request per alert of a notification, in order."""

    url_is_secret = False

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self._key: Secret = resolve_secret(config.api_key_env, config.api_key_file,
                                           f"notifier {config.name!r} api_key")
        self._base = (config.api_url or BASE_URLS[config.region]).rstrip("/")
        self._priority = dict(config.severity_map)

    def requests_for(self, notification: Notification) -> List[Tuple[str, Dict[str, Any]]]:
        """``(url, body)`` per alert: create for a firing one, close by alias for a resolved one."""
        out = []
        for a in notification.alerts:
            if a.status == "firing":
                out.append((f"{self._base}/v2/alerts", create_body(a, self._priority)))
            else:
                alias = urllib.parse.quote(a.fingerprint[:MAX_ALIAS], safe="")
                out.append((f"{self._base}/v2/alerts/{alias}/close?identifierType=alias", close_body(a)))
        return out

    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        reqs = self.rendered(self.requests_for, notification)
        if reqs is None:
            return "failed"
        return post_each(self, [b for _, b in reqs], wait, on_retry, None,
                         headers={"Authorization": "GenieKey " + self._key.reveal()}, urls=[u for u, _ in reqs])
