"""Secrets for notifiers: webhook URLs and tokens read from the environment or a file, never shown.

Slack incoming-webhook URLs are bearer credentials (anyone holding one can post to
the channel), so mfuwatch treats every notifier URL and token as a secret:

* the alert config names *where* a secret is (``url_env: MFUWATCH_SLACK_WEBHOOK_URL``
  or ``url_file: /run/secrets/slack``), never the value, so dumping the config is safe;
* a resolved value is held in a :class:`Secret`, whose ``str``/``repr`` are ``<redacted>``;
* every resolved value is registered with :func:`redact`, and a logging filter on the
  HTTP libraries' loggers (``urllib3`` logs request paths at debug level) replaces
  registered values in their records;
* notifiers log and raise with exception *type names* only, never ``str(exc)``,
  because ``requests`` puts the full URL into its exception messages.

Example::

    url = resolve_secret(env="MFUWATCH_SLACK_WEBHOOK_URL", file=None, field="notifiers[0].url")
    requests.post(url.reveal(), json=body, timeout=5)
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Optional, Set

REDACTED = "<redacted>"

_known: Set[str] = set()
_known_lock = threading.Lock()
_filter_installed = False

#: Loggers of the HTTP stack that may print a request URL (urllib3 logs
#: ``"POST /services/T000/B000/XXXX HTTP/1.1" 200`` at debug level).
_HTTP_LOGGERS = ("urllib3.connectionpool", "urllib3.util.retry", "requests", "urllib3")


class SecretError(ValueError):
    """A secret could not be read. The message names the variable or file, never the value."""


class Secret:
    """A string that does not print itself. Call :meth:`reveal` at the single place that needs it."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str) -> None:
        self._value = value
        self.source = source  # e.g. "env MFUWATCH_SLACK_WEBHOOK_URL" (safe to show)

    def reveal(self) -> str:
        """The secret value itself (for the HTTP request only)."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret({self.source}: {REDACTED})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def resolve_secret(env: Optional[str], file: Optional[str], field: str) -> Secret:
    """Read a secret from environment variable ``env`` or from ``file`` (first line, stripped).

    Exactly one of ``env``/``file`` must be given. Raises :class:`SecretError`
    naming ``field`` and the variable or path when it is missing or empty.
    """
    if bool(env) == bool(file):
        raise SecretError(f"{field}: give exactly one of the environment variable (…_env) or the file (…_file)")
    if env:
        value = os.environ.get(env, "").strip()
        if not value:
            raise SecretError(f"{field}: environment variable {env} is not set or empty")
        source = f"env {env}"
    else:
        path = Path(os.path.expanduser(str(file)))
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise SecretError(f"{field}: cannot read secret file {path} ({type(exc).__name__})") from None
        value = lines[0].strip() if lines else ""
        if not value:
            raise SecretError(f"{field}: secret file {path} is empty")
        source = f"file {path}"
    register(value)
    return Secret(value, source)


def register(value: str) -> None:
    """Add ``value`` to the strings :func:`redact` removes, and install the HTTP log filter once."""
    global _filter_installed
    if not value:
        return
    with _known_lock:
        _known.update(url_variants(value))
        if not _filter_installed:
            for name in _HTTP_LOGGERS:
                logging.getLogger(name).addFilter(_RedactingFilter())
            _filter_installed = True


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by ``<redacted>``.

    A URL secret is registered in every spelling the HTTP stack may log
    (:func:`url_variants`): its path without the fragment, percent-encoded or decoded,
    its host name. So a redacted log line may also hide a harmless host name.
    """
    with _known_lock:
        known = sorted(_known, key=len, reverse=True)
    for value in known:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def url_variants(value: str) -> Set[str]:
    """Every spelling of URL ``value`` that the HTTP stack may log: ``value`` itself, the URL as ``requests``
    prepares it (``%7E`` → ``~``, a space → ``%20``, IDNA host), its path and query without the
    ``#fragment`` (urllib3 logs only that), their percent-decoded forms, the host name and ``host:port``
    (urllib3's "Starting new connection" line; the secret may be in the host), and userinfo."""
    import urllib.parse

    out = {value}
    if "://" not in value:
        return out
    forms = [value]
    try:
        from requests.models import PreparedRequest

        p = PreparedRequest()
        p.prepare_url(value, None)
        forms.append(p.url)
    except Exception:  # noqa: BLE001 - requests refuses it: the request will fail the same way
        pass
    for form in forms:
        out.add(form)
        try:
            u = urllib.parse.urlsplit(form)
        except ValueError:
            continue
        path_query = u.path + (("?" + u.query) if u.query else "")
        for piece in (path_query, u.path, u.query, u.fragment, u.hostname or "", u.netloc.rsplit("@", 1)[-1],
                      u.username or "", u.password or ""):
            if len(piece) > 1:
                out.add(piece)
                out.add(urllib.parse.unquote(piece))
                out.add(urllib.parse.quote(urllib.parse.unquote(piece), safe="/?=&:@"))
    return {v for v in out if len(v) > 1 and v != "/"}


class _RedactingFilter(logging.Filter):
    """Rewrites a log record's message with secrets removed (attached to the HTTP libraries' loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
            cleaned = redact(message)
            if cleaned != message:
                record.msg = cleaned
                record.args = None
        except Exception:  # noqa: BLE001 - a log filter must never break logging
            pass
        return True
