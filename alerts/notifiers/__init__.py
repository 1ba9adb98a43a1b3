"""Notifiers: where alert notifications go (Slack, an Alertmanager-format webhook, the console).

Each notifier is one module; :func:`build_notifier` picks it by the config's ``type``.
They run on their own threads behind a bounded queue (:mod:`.base`); the HTTP ones
share timeouts, retries, backoff and ``Retry-After`` handling (:mod:`.http`).
"""

from __future__ import annotations

from ..config import NotifierConfig
from .base import Notifier, NotifierWorker

__all__ = ["build_notifier", "Notifier", "NotifierWorker"]


def build_notifier(config: NotifierConfig) -> Notifier:
    """The notifier for ``config.type``. Reads its secrets now: raises ``SecretError`` if one is missing."""
    if config.type == "console":
        from .console import ConsoleNotifier

        return ConsoleNotifier(config)
    if config.type == "slack":
        from .slack import SlackNotifier

        return SlackNotifier(config)
    if config.type == "webhook":
        from .webhook import WebhookNotifier

        return WebhookNotifier(config)
    raise ValueError(f"notifier {config.name!r}: unknown type {config.type!r}")
