"""Email notifier: one message per notification (a group) over SMTP with the standard library's ``smtplib``.

* Transport: ``tls: starttls`` (the default; port 587, RFC 3207 STARTTLS after
  EHLO), ``tls: tls`` (implicit TLS, port 465, RFC 8314) or ``tls: none`` (port 25;
  refused with a password unless the server is this host). Certificates are
  verified (``ssl.create_default_context``; ``ca_file`` adds a private CA).
  ``username_env``/``password_env`` (or ``_file``) log in (``SMTP.login``) after TLS.
* Message (``email.message.EmailMessage``, RFC 5322 / MIME): ``multipart/alternative``
  with a plain-text part (the console's lines) and an HTML part (per alert: the
  summary, a table of run/rank/host/value, the fix with its apply line in ``<pre>``, the
  runbook and dashboard links); every value is HTML-escaped.
* Threading (RFC 5322 §3.6.4): the first message of a group's episode gets a new
  ``Message-ID``; every later message of that group (a new alert, a reminder, the
  resolved message) carries ``In-Reply-To`` (the previous message) and ``References``
  (the thread so far), so a mail client shows the firing and its resolution as one
  conversation. A message in which the whole group is resolved ends the thread.
* Delivery: connection errors, timeouts and SMTP 4xx replies (transient, RFC 5321
  §4.2.1) are retried with the shared capped backoff (:func:`~.http.retry_loop`);
  5xx replies (a refused recipient, a failed login) and TLS verification errors are
  final (``failed``). Logs name the exception type or the reply code, never the
  server's text, the username or the password.
"""

from __future__ import annotations

import collections
import html
import random
import smtplib
import ssl
import time
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from typing import Callable, Deque, Dict, List, Optional

from ..model import AlertSnapshot, Notification
from ..secrets import Secret, resolve_secret
from .base import Notifier
from .http import Attempt, retry_loop
from .text import cut, description_lines, facts, one_line, fix_line, links, plain_with_links, shown_fixes, source, title

DEFAULT_PORTS = {"starttls": 587, "tls": 465, "none": 25}
MAX_SUBJECT = 200
MAX_THREAD_REFERENCES = 20  # References keeps the first and the latest ids of a long thread


def text_body(notification: Notification) -> str:
    """The plain-text part: the title, then the console's lines of each alert and its links."""
    out = [title(notification), ""]
    for a in notification.alerts:
        out += plain_with_links(a)
        out.append("")
    return "\n".join(out)


def _alert_html(a: AlertSnapshot) -> str:
    e = html.escape
    state = "resolved" if a.status == "resolved" else a.severity
    parts = [f"<h3>{e(a.name)} ({e(state)})</h3>"]
    if a.annotations.get("summary"):
        parts.append(f"<p>{e(a.annotations['summary'])}</p>")
    if a.status == "firing" and description_lines(a):
        parts.append(f"<p style=\"white-space: pre-wrap\">{e(chr(10).join(description_lines(a)))}</p>")
    rows = "".join(f"<tr><th align='left'>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in
                   facts(a) + [("Source", source(a))])
    parts.append(f"<table>{rows}</table>")
    if a.status == "firing":
        if a.annotations.get("waiting_at"):
            parts.append(f"<p>Training thread waits at <code>{e(a.annotations['waiting_at'])}</code></p>")
        for s in shown_fixes(a):
            parts.append(f"<p><b>Suggested fix</b></p><pre>{e(fix_line(s))}</pre>")
    elif a.annotations.get("resolved_reason"):
        parts.append(f"<p>Ended: {e(a.annotations['resolved_reason'])}</p>")
    ls = " · ".join(f"<a href=\"{e(url, quote=True)}\">{e(label)}</a>" for label, url in links(a))
    if ls:
        parts.append(f"<p>{ls}</p>")
    return "\n".join(parts)


def html_body(notification: Notification) -> str:
    """The HTML part: the title and one section per alert (every value escaped)."""
    sections = "\n<hr>\n".join(_alert_html(a) for a in notification.alerts)
    return (f"<!DOCTYPE html>\n<html><body>\n<h2>{html.escape(title(notification))}</h2>\n{sections}\n"
            "</body></html>\n")


class EmailNotifier(Notifier):
    """Sends one e-mail per notification (see the module docstring). Secrets are read at construction."""

    def __init__(self, config, *, rng: Optional[random.Random] = None) -> None:
        super().__init__(config)
        where = f"notifier {config.name!r}"
        self._username: Optional[Secret] = None
        self._password: Optional[Secret] = None
        if config.username_env or config.username_file:
            self._username = resolve_secret(config.username_env, config.username_file, f"{where} username")
            self._password = resolve_secret(config.password_env, config.password_file, f"{where} password")
        self._port = config.smtp_port or DEFAULT_PORTS[config.tls]
        self._rng = rng or random.Random()
        self._threads: Dict[str, List[str]] = {}  # group key -> Message-IDs of the thread so far
        self._domain = config.sender.rsplit("@", 1)[-1]
        #: The waits chosen before each retry, newest last (seconds; for logs and tests).
        self.retry_delays: Deque[float] = collections.deque(maxlen=256)

    def message(self, notification: Notification) -> EmailMessage:
        """The message for ``notification``, threaded after the previous one of its group."""
        cfg = self.config
        msg = EmailMessage()
        msg["From"] = cfg.sender
        msg["To"] = ", ".join(cfg.to)
        msg["Subject"] = cut(title(notification), MAX_SUBJECT)
        msg["Date"] = formatdate(time.time(), usegmt=True)
        msg["Message-ID"] = make_msgid("mfuwatch", domain=self._domain)
        thread = self._threads.get(notification.group_key, [])
        if thread:
            refs = thread if len(thread) <= MAX_THREAD_REFERENCES else thread[:1] + thread[-(MAX_THREAD_REFERENCES - 1):]
            msg["In-Reply-To"] = thread[-1]
            msg["References"] = " ".join(refs)
        msg["X-Mfuwatch-Group"] = one_line(notification.group_key)  # a run name may hold CR/LF
        msg.set_content(text_body(notification))
        msg.add_alternative(html_body(notification), subtype="html")
        return msg

    def deliver(self, notification: Notification, wait: Callable[[float], bool], on_retry: Callable[[], None]) -> str:
        msg = self.rendered(self.message, notification)
        if msg is None:
            return "failed"
        outcome = retry_loop(self, lambda: self._send(msg), wait, on_retry, self._rng, self.retry_delays)
        if outcome == "sent":
            key = notification.group_key
            if notification.status == "resolved":
                self._threads.pop(key, None)  # the episode is over: the next firing starts a new thread
            else:
                self._threads.setdefault(key, []).append(msg["Message-ID"])
        return outcome

    def _connect(self) -> smtplib.SMTP:
        cfg = self.config
        ctx = ssl.create_default_context(cafile=cfg.ca_file) if cfg.tls != "none" else None
        if cfg.tls == "tls":
            smtp: smtplib.SMTP = smtplib.SMTP_SSL(cfg.smtp_host, self._port, timeout=cfg.timeout_seconds, context=ctx)
        else:
            smtp = smtplib.SMTP(cfg.smtp_host, self._port, timeout=cfg.timeout_seconds)
        try:
            smtp.ehlo()
            if cfg.tls == "starttls":
                smtp.starttls(context=ctx)
                smtp.ehlo()
            if self._username is not None and self._password is not None:
                self._login(smtp, self._username.reveal(), self._password.reveal())
        except BaseException:
            smtp.close()
            raise
        return smtp

    @staticmethod
    def _login(smtp: smtplib.SMTP, user: str, password: str) -> None:
        """AUTH PLAIN when offered (RFC 4616; inside TLS), else ``SMTP.login``'s choice. One mechanism only:
        ``login`` tries each offered one after a rejection, and servers lock accounts after failed logins."""
        if "plain" in smtp.esmtp_features.get("auth", "").lower().split():
            smtp.user, smtp.password = user, password
            smtp.auth("PLAIN", smtp.auth_plain)
        else:
            smtp.login(user, password)

    def _send(self, msg: EmailMessage) -> Attempt:
        """One SMTP session: connect, TLS, login, send. ``(outcome or None to retry, reason, None)``."""
        try:
            smtp = self._connect()
            try:
                smtp.send_message(msg, from_addr=self.config.sender, to_addrs=list(self.config.to))
            finally:
                try:
                    smtp.quit()
                except (smtplib.SMTPException, OSError):
                    smtp.close()
            return "sent", "", None
        except smtplib.SMTPRecipientsRefused as exc:
            codes = sorted({code for code, _ in exc.recipients.values()})
            return self._by_code(max(codes) if codes else 550, "recipients refused")
        except smtplib.SMTPResponseException as exc:  # sender refused, auth failed, data refused, ...
            return self._by_code(exc.smtp_code, type(exc).__name__)
        except smtplib.SMTPNotSupportedError as exc:  # e.g. the server offers no STARTTLS
            self.warn_once("smtp-unsupported", "mfuwatch alerts: %s: the SMTP server does not support what the "
                           "config asks (%s; tls: %s); not retried", self.name, type(exc).__name__, self.config.tls)
            return "failed", type(exc).__name__, None
        except ssl.SSLError as exc:  # certificate verification, protocol mismatch: a configuration problem
            self.warn_once("smtp-tls", "mfuwatch alerts: %s: TLS with the SMTP server failed (%s); not retried",
                           self.name, type(exc).__name__)
            return "failed", type(exc).__name__, None
        except (smtplib.SMTPException, OSError) as exc:  # refused, reset, timed out, disconnected: transient
            return None, type(exc).__name__, None

    def _by_code(self, code: int, what: str) -> Attempt:
        if 400 <= code < 500:
            return None, f"SMTP {code}", None
        self.warn_once(f"smtp-{code}", "mfuwatch alerts: %s: the SMTP server answered %d (%s); not retried",
                       self.name, code, what)
        return "failed", f"SMTP {code}", None
