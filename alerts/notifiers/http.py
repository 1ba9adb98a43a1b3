"""HTTP delivery shared by the HTTP notifiers (Slack, webhook, PagerDuty, Opsgenie, Teams, Discord): timeouts,
retries, backoff, Retry-After.

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
group superseded it, or, closing, the next wait does not fit before close()'s deadline:
``wait.plan`` returns None or ``wait`` returns False; see :mod:`.base`) or,
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
from typing import Any, Callable, Deque, Dict, Optional, Tuple

import requests

from ..config import NotifierConfig
from ..model import Notification
from ..secrets import Secret, redact, resolve_secret
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


def connection_problem(exc: BaseException) -> str:
    """What a ``requests`` connection error or timeout was, without its message (which holds the URL):
    ``ConnectionError: DNS lookup failed``, ``...: connection refused``, ``ConnectTimeout``, ``ReadTimeout``,
    ``SSLError``; the bare exception type when the cause is none of these."""
    import socket
    import ssl

    name = type(exc).__name__
    if isinstance(exc, (requests.ConnectTimeout, requests.ReadTimeout)):
        return name
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, socket.gaierror) or type(e).__name__ == "NameResolutionError":
            return f"{name}: DNS lookup failed"
        if isinstance(e, ConnectionRefusedError):
            return f"{name}: connection refused"
        if isinstance(e, ConnectionResetError):
            return f"{name}: connection reset"
        if isinstance(e, ssl.SSLError):
            return f"{name}: TLS error"
        if isinstance(e, OSError) and getattr(e, "errno", None) in (101, 113):  # ENETUNREACH, EHOSTUNREACH
            return f"{name}: network unreachable"
        for nxt in (getattr(e, "reason", None), e.__cause__, e.__context__, *getattr(e, "args", ())):
            if isinstance(nxt, BaseException):
                todo.append(nxt)
    return name


Attempt = Tuple[Optional[str], str, Optional[float]]  # (final outcome or None to retry, reason, retry-after s)


def retry_loop(notifier: Notifier, attempt: Callable[[], Attempt], wait: Callable[[float], bool],
               on_retry: Callable[[], None], rng: random.Random, delays: Deque[float]) -> str:
    """Call ``attempt()`` until it returns a final outcome, waiting between tries; the one retry policy of
    every notifier that talks to a server (HTTP here, SMTP in :mod:`.email`).

    ``attempt()`` returns ``(outcome, reason, retry_after)``: ``outcome`` ``"sent"``/``"failed"`` ends the
    loop; ``None`` means retry, after ``retry_after`` seconds when the server asked for it (capped at
    ``max_backoff``), else after :func:`backoff_delay`. Gives up (``"failed"``) after ``max_retries`` when
    the notifier sets it; returns ``"dropped"`` when ``wait`` says the worker gave the notification up.
    ``reason`` (a status code or an exception *type*) is the only thing logged: never a URL or a secret.
    """
    cfg = notifier.config
    tries = int(getattr(wait, "prior_retries", 0))  # a state that was parked keeps its count
    while True:
        outcome, reason, retry_after = attempt()
        if outcome is not None:
            return outcome
        if cfg.max_retries is not None and tries >= cfg.max_retries:
            notifier.warn_once("gave-up", "mfuwatch alerts: %s still failing after %d retries (%s); notification "
                               "counted as failed", notifier.name, cfg.max_retries, reason)
            return "failed"
        server_asked = retry_after is not None
        if server_asked:
            delay = min(retry_after, cfg.max_backoff_seconds)
        else:
            delay = backoff_delay(tries, cfg.backoff_seconds, cfg.max_backoff_seconds, rng)
        plan = getattr(wait, "plan", None)
        planned = plan(delay, server_asked) if plan is not None else delay
        if planned is None:  # closing: the wait does not fit before the deadline, or the closing retries are spent
            notifier.warn_once(f"closing-{reason}", "mfuwatch alerts: %s delivery failed (%s) while closing; "
                               "the next try (%s %.2fs) would not fit in the close timeout; given up (counted "
                               "dropped)", notifier.name, reason,
                               "the server asked to wait" if server_asked else "after", delay)
            return "dropped"
        delays.append(planned)
        tries += 1
        on_retry()
        notifier.warn_once(f"retry-{reason}", "mfuwatch alerts: %s delivery failed (%s); retry %d (of %s) in "
                           "%.2fs%s", notifier.name, reason, tries,
                           "unlimited" if cfg.max_retries is None else cfg.max_retries, planned,
                           "; retried until delivered, superseded or closed" if cfg.max_retries is None
                           else f"; counted failed after {cfg.max_retries} retries")
        if not (wait(planned, server_asked) if plan is not None else wait(planned)):
            return "dropped"


def vendor_message(resp: requests.Response, limit: int = 200) -> str:
    """The error text a vendor put in a non-2xx answer (JSON ``message``/``error``/``errors``, else the body),
    on one line, at most ``limit`` characters, with every registered secret redacted; ``""`` if none."""
    try:
        text = resp.text or ""
    except Exception:  # noqa: BLE001 - an undecodable body says nothing
        return ""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        parts = [str(doc[k]) for k in ("message", "error", "errors", "status") if doc.get(k)]
        text = "; ".join(parts) if parts else text
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return redact(text)


class HttpNotifier(Notifier):
    """Base for notifiers that POST JSON. Resolves the URL (and token) secrets at construction.

    Subclasses whose endpoint is not a secret (PagerDuty, Opsgenie: their key is) set
    ``url_is_secret = False`` and pass ``url=`` to :meth:`post_json`. Raises
    :class:`~mfuwatch.alerts.secrets.SecretError` (a ``ValueError``) when the
    environment variable or file is missing; the message never holds the value.
    """

    content_type = "application/json"
    url_is_secret = True

    def __init__(self, config: NotifierConfig, *, rng: Optional[random.Random] = None) -> None:
        super().__init__(config)
        where = f"notifier {config.name!r}"
        self._url: Optional[Secret] = None
        if self.url_is_secret:
            self._url = resolve_secret(config.url_env, config.url_file, f"{where} url")
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
        body = self.rendered(self.render, notification)
        return "failed" if body is None else self.post_json(body, wait, on_retry)

    def endpoint(self, override: Optional[str] = None) -> str:
        """The URL to POST to: ``override``, else the secret URL; with the config's ``api_url`` set, its scheme,
        host and port replace the secret URL's (a proxy or a test server), keeping the secret path and query."""
        if override is not None:
            return override
        assert self._url is not None
        url = self._url.reveal()
        if self.config.api_url:
            import urllib.parse

            base, secret = urllib.parse.urlsplit(self.config.api_url), urllib.parse.urlsplit(url)
            prefix = base.path.rstrip("/")
            url = urllib.parse.urlunsplit((base.scheme, base.netloc, prefix + secret.path, secret.query, ""))
        return url

    def host_label(self, target: str) -> str:
        """How log lines name the server: its host[:port] when that is not secret (PagerDuty, Opsgenie, or an
        ``api_url`` override), else ``the <type> URL`` (a webhook URL is the secret, host included)."""
        import urllib.parse

        if self.url_is_secret and not self.config.api_url:
            return f"the {self.config.type} URL"
        try:
            parts = urllib.parse.urlsplit(target)
            return redact(parts.hostname + (f":{parts.port}" if parts.port else "")) if parts.hostname else "?"
        except ValueError:
            return "?"

    def retry_after(self, resp: requests.Response) -> Optional[float]:
        """Seconds the server asks to wait before the next try (``Retry-After``); Discord overrides it."""
        return parse_retry_after(resp.headers.get("Retry-After"))

    def post_json(self, body: Any, wait: Callable[[float], bool], on_retry: Callable[[], None], *,
                  url: Optional[str] = None, headers: Optional[Dict[str, str]] = None) -> str:
        """POST ``body`` with retries; returns ``"sent"``, ``"failed"`` or ``"dropped"`` (closing).

        ``url`` replaces :meth:`endpoint`; ``headers`` are added to the defaults (the bearer token when set).
        """
        cfg = self.config
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        hdrs = {"Content-Type": self.content_type, "User-Agent": "mfuwatch-alerts"}
        if self._token is not None:
            hdrs["Authorization"] = "Bearer " + self._token.reveal()
        hdrs.update(headers or {})
        target = self.endpoint(url)
        host = self.host_label(target)

        def attempt() -> Attempt:
            try:
                if self._session is None:
                    self._session = requests.Session()
                resp = self._session.post(target, data=data, headers=hdrs,
                                          timeout=(cfg.timeout_seconds, cfg.timeout_seconds), allow_redirects=False)
                status = resp.status_code
                try:
                    after = self.retry_after(resp) if status in RETRY_STATUS else None
                    said = vendor_message(resp) if not 200 <= status < 300 else ""
                finally:
                    resp.close()
                if 200 <= status < 300:
                    return "sent", "", None
                if status not in RETRY_STATUS:
                    self.warn_once(f"status-{status}", "mfuwatch alerts: %s: %s answered HTTP %d%s; not retried",
                                   self.name, host, status, f" ({said})" if said else "")
                    return "failed", f"HTTP {status}", None
                return None, f"HTTP {status} from {host}" + (f" ({said})" if said else ""), after
            except (requests.ConnectionError, requests.Timeout) as exc:
                return None, f"{connection_problem(exc)}, to {host}", None
            except requests.RequestException as exc:
                self.warn_once(type(exc).__name__, "mfuwatch alerts: %s request to %s failed (%s); not retried",
                               self.name, host, type(exc).__name__)
                return "failed", type(exc).__name__, None

        return retry_loop(self, attempt, wait, on_retry, self._rng, self.retry_delays)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
