"""HTTP delivery shared by the Slack and webhook notifiers: timeouts, retries, backoff, Retry-After.

:class:`HttpNotifier.post_json` sends one JSON body with ``requests`` and retries
what a later attempt can fix:

* connection errors and timeouts (``requests.ConnectionError``, ``requests.Timeout``);
* HTTP 408, 429 and 5xx. For 429 and 503 the ``Retry-After`` header (seconds or
  an HTTP date, RFC 9110 §10.2.3) sets the wait, capped at ``max_backoff``;
* otherwise the wait is exponential with "equal jitter": with
  ``b = min(max_backoff, backoff * 2**attempt)`` it is uniform in ``[b/2, b]``
  (AWS Architecture Blog, "Exponential Backoff And Jitter", 2015), so many ranks
  or jobs failing together do not retry in lockstep.

Retries go on until the worker gives up the notification (a newer state of its
group superseded it, or close()'s deadline passed: ``wait`` returns False) or,
when the notifier sets ``max_retries``, after that many. Other 4xx answers are final (``failed``): the request itself is wrong. Log lines
and errors name the sink and the exception *type* or status code only; the URL
(the secret) never leaves :class:`~mfuwatch.alerts.secrets.Secret`.
"""

from __future__ import annotations

import collections
import email.utils
import json
import random
import time
from typing import Any, Callable, Deque, Dict, Optional

import requests

from ..config import NotifierConfig
from ..model import Notification
from ..secrets import Secret, resolve_secret
from ..validation import check_url
from .base import Notifier

RETRY_STATUS = frozenset({408, 429} | set(range(500, 600)))


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date; ``None`` if absent/bad."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Equal-jitter exponential backoff: uniform in ``[b/2, b]`` with ``b = min(cap, base * 2**attempt)``."""
    b = min(cap, base * (2.0 ** attempt))
    return b / 2.0 + rng.uniform(0.0, b / 2.0)


class HttpNotifier(Notifier):
    """Base for notifiers that POST JSON. Resolves the URL (and token) secrets at construction.

    Raises :class:`~mfuwatch.alerts.secrets.SecretError` (a ``ValueError``) when the
    environment variable or file is missing; the message never holds the value.
    """

    content_type = "application/json"

    def __init__(self, config: NotifierConfig, *, rng: Optional[random.Random] = None) -> None:
        super().__init__(config)
        where = f"notifier {config.name!r}"
        self._url: Secret = resolve_secret(config.url_env, config.url_file, f"{where} url")
        if not self._url.reveal().startswith(("http://", "https://")):
            raise ValueError(f"{where}: the URL from {self._url.source} is not an http(s) URL")
        check_url(self._url.reveal(), f"{where} (from {self._url.source})", echo=False)  # e.g. port 187020
        self._token: Optional[Secret] = None
        if config.token_env or config.token_file:
            self._token = resolve_secret(config.token_env, config.token_file, f"{where} token")
        self._rng = rng or random.Random()
        self._session: Optional[requests.Session] = None
        #: The waits chosen before each retry, newest last (seconds; for logs and tests).
        self.retry_delays: Deque[float] = collections.deque(maxlen=256)

    def render(self, notification: Notification) -> Dict[str, Any]:
        """The JSON body for ``notification`` (implemented by each notifier)."""
        raise NotImplementedError

    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        try:
            body = self.render(notification)
        except Exception as exc:  # noqa: BLE001 - a rendering bug is a failed notification, not a crash
            self.warn_once("render", "mfuwatch alerts: %s could not render a notification (%s)", self.name,
                           type(exc).__name__)
            return "failed"
        return self.post_json(body, wait, on_retry)

    def post_json(self, body: Dict[str, Any], wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        """POST ``body`` with retries; returns ``"sent"``, ``"failed"`` or ``"dropped"`` (closing)."""
        cfg = self.config
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        headers = {"Content-Type": self.content_type, "User-Agent": "mfuwatch-alerts"}
        if self._token is not None:
            headers["Authorization"] = "Bearer " + self._token.reveal()
        attempt = 0
        while True:
            retry_after: Optional[float] = None
            try:
                if self._session is None:
                    self._session = requests.Session()
                resp = self._session.post(self._url.reveal(), data=data, headers=headers,
                                          timeout=(cfg.timeout_seconds, cfg.timeout_seconds), allow_redirects=False)
                status = resp.status_code
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
                resp.close()
                if 200 <= status < 300:
                    return "sent"
                if status not in RETRY_STATUS:
                    self.warn_once(f"status-{status}", "mfuwatch alerts: %s answered HTTP %d; not retried",
                                   self.name, status)
                    return "failed"
                reason = f"HTTP {status}"
            except (requests.ConnectionError, requests.Timeout) as exc:
                reason = type(exc).__name__
            except requests.RequestException as exc:
                self.warn_once(type(exc).__name__, "mfuwatch alerts: %s request failed (%s); not retried",
                               self.name, type(exc).__name__)
                return "failed"
            if cfg.max_retries is not None and attempt >= cfg.max_retries:
                self.warn_once("gave-up", "mfuwatch alerts: %s still failing after %d retries (%s); notification "
                               "counted as failed", self.name, cfg.max_retries, reason)
                return "failed"
            if retry_after is not None:
                delay = min(retry_after, cfg.max_backoff_seconds)
            else:
                delay = backoff_delay(attempt, cfg.backoff_seconds, cfg.max_backoff_seconds, self._rng)
            self.retry_delays.append(delay)
            attempt += 1
            on_retry()
            self.warn_once(f"retry-{reason}", "mfuwatch alerts: %s delivery failed (%s); retry %d (of %s) in %.2fs; "
                           "retried until delivered, superseded or closed", self.name, reason, attempt,
                           "unlimited" if cfg.max_retries is None else cfg.max_retries, delay)
            if not wait(delay):
                return "dropped"

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
