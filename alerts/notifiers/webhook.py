"""Generic webhook notifier: the JSON body of Alertmanager's webhook receiver, version 4.

Receivers written for Alertmanager (``webhook_configs``) accept these bodies
unchanged. The fields, as Alertmanager documents its webhook payload
(prometheus.io/docs/alerting/latest/configuration/#webhook_config)::

    {"version": "4", "groupKey": "{}:{run=\"demo\"}", "truncatedAlerts": 0,
     "status": "firing" | "resolved", "receiver": "<notifier name>",
     "groupLabels": {...}, "commonLabels": {...}, "commonAnnotations": {...},
     "externalURL": "<the agent's exporter URL>",
     "alerts": [{"status", "labels", "annotations", "startsAt", "endsAt",
                 "generatorURL", "fingerprint"}, ...]}

Times are RFC 3339 UTC; a firing alert's ``endsAt`` is Go's zero time
``0001-01-01T00:00:00Z`` as Alertmanager sends it. ``fingerprint`` is computed the
way Alertmanager computes it (FNV-1a 64 over the sorted labels), so receivers that
deduplicate on it work. An optional bearer token (``token_env``/``token_file``) is
sent as ``Authorization: Bearer …``.
"""

from __future__ import annotations

from typing import Any, Dict

from ..model import Notification, rfc3339
from .http import HttpNotifier

WEBHOOK_VERSION = "4"


def webhook_body(notification: Notification, receiver: str) -> Dict[str, Any]:
    """The Alertmanager-format (version 4) body of ``notification`` for receiver name ``receiver``."""
    return {
        "version": WEBHOOK_VERSION,
        "groupKey": notification.group_key,
        "truncatedAlerts": int(notification.truncated_alerts),
        "status": notification.status,
        "receiver": receiver,
        "groupLabels": dict(notification.group_labels),
        "commonLabels": notification.common_labels,
        "commonAnnotations": notification.common_annotations,
        "externalURL": notification.external_url,
        "alerts": [
            {
                "status": a.status,
                "labels": dict(a.labels),
                "annotations": dict(a.annotations),
                "startsAt": rfc3339(a.starts_at),
                "endsAt": rfc3339(a.ends_at if a.status == "resolved" else None),
                "generatorURL": a.generator_url,
                "fingerprint": a.fingerprint,
            }
            for a in notification.alerts
        ],
    }


class WebhookNotifier(HttpNotifier):
    """POSTs :func:`webhook_body` to the URL from ``url_env``/``url_file``."""

    def render(self, notification: Notification) -> Dict[str, Any]:
        return webhook_body(notification, self.name)
