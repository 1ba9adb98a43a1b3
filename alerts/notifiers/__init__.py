"""Notifiers: where alert notifications go (console, Slack, an Alertmanager-format webhook, PagerDuty, Opsgenie,
Microsoft Teams, Discord, email).

Each notifier is one module; :func:`build_notifier` picks it by the config's ``type``.
They run on their own threads behind a bounded queue (:mod:`.base`); the ones that talk
to a server share timeouts, retries, backoff and ``Retry-After`` handling
(:func:`.http.retry_loop`); which alerts each one gets is decided by the config's
``routes`` (:mod:`mfuwatch.alerts.routing`).
"""

from __future__ import annotations

import importlib

from ..config import NotifierConfig
from .base import Notifier, NotifierWorker

__all__ = ["build_notifier", "Notifier", "NotifierWorker", "NOTIFIER_CLASSES"]

#: type -> (module, class) of its notifier.
NOTIFIER_CLASSES = {
    "console": ("console", "ConsoleNotifier"), "slack": ("slack", "SlackNotifier"),
    "webhook": ("webhook", "WebhookNotifier"), "pagerduty": ("pagerduty", "PagerDutyNotifier"),
    "opsgenie": ("opsgenie", "OpsgenieNotifier"), "teams": ("teams", "TeamsNotifier"),
    "discord": ("discord", "DiscordNotifier"), "email": ("mail", "EmailNotifier"),
}


def build_notifier(config: NotifierConfig) -> Notifier:
    """The notifier for ``config.type``. Reads its secrets now: raises ``SecretError`` if one is missing."""
    if config.type not in NOTIFIER_CLASSES:
        raise ValueError(f"notifier {config.name!r}: unknown type {config.type!r}")
    module, cls = NOTIFIER_CLASSES[config.type]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(config)
