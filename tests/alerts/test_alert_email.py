"""alerts/notifiers/mail.py against a real SMTP server on 127.0.0.1 (aiosmtpd), with a throwaway certificate.

The server is started by the test: STARTTLS required before AUTH on one port, implicit TLS on
another; the certificate is made at test time with openssl (Debian package ``openssl``) and
trusted through the notifier's ``ca_file``. Checked: one message per group, text + HTML parts,
the resolved message threaded (In-Reply-To / References), the login really used, 4xx retried,
5xx and an untrusted certificate final, an outage survived, and no secret in the logs.
"""

from __future__ import annotations

import collections
import email
import email.policy
import logging
import ssl
import subprocess
import time

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult
from helpers.debian_tools import ensure_binary
from helpers.net import free_port
from test_alert_secrets import TOKEN, assert_clean
from test_alert_slack import APPLY, mb_alert
from test_alert_vendors import group, resolved, stall_alert

from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.notifiers import build_notifier
from mfuwatch.alerts.notifiers.base import NotifierWorker
from mfuwatch.alerts.validation import AlertConfigError

USER = "mfuwatch-T0SECRETXX"
PASSWORD = TOKEN


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """``(cert.pem, key.pem)`` of a self-signed certificate for 127.0.0.1, made now, valid one day."""
    openssl = ensure_binary(["openssl"], "openssl")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"), "-out",
                    str(d / "cert.pem")], check=True, capture_output=True, timeout=60)
    return d / "cert.pem", d / "key.pem"


class Handler:
    """Keeps every message; answers ``replies`` (SMTP status lines) to the first DATA commands, then 250."""

    def __init__(self):
        self.messages = []
        self.replies = []
        self.logins = []
        self.tls_at_data = []
        self.refuse = None  # a Subject fragment answered with 554

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's naming
        if self.replies:
            return self.replies.pop(0)
        if self.refuse and self.refuse in envelope.content.decode("utf-8", "replace"):
            return "554 5.7.1 rejected"
        self.tls_at_data.append(session.ssl is not None)
        self.messages.append((envelope.mail_from, list(envelope.rcpt_tos),
                              email.message_from_bytes(envelope.content, policy=email.policy.default)))
        return "250 OK"

    def authenticate(self, server, session, envelope, mechanism, auth_data):
        self.logins.append((auth_data.login.decode(), auth_data.password.decode()))
        return AuthResult(success=(auth_data.login.decode(), auth_data.password.decode()) == (USER, PASSWORD),
                          handled=False)  # False: aiosmtpd answers 535 itself


def smtp_server(cert, *, implicit=False, port=None):
    crt, key = cert
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(crt), str(key))
    handler = Handler()
    # implicit TLS: the whole connection is TLS (aiosmtpd's auth_require_tls only knows STARTTLS)
    kw = {"ssl_context": ctx, "auth_require_tls": False} if implicit else \
        {"tls_context": ctx, "require_starttls": True, "auth_require_tls": True}
    ctl = Controller(handler, hostname="127.0.0.1", port=port or free_port(), authenticator=handler.authenticate,
                     auth_required=True, **kw)
    return ctl, handler


def mail_worker(monkeypatch, cert, port, password=PASSWORD, **over):
    monkeypatch.setenv("MFUWATCH_TEST_SMTP_USER", USER)
    monkeypatch.setenv("MFUWATCH_TEST_SMTP_PASSWORD", password)
    spec = {"type": "email", "smtp_host": "127.0.0.1", "smtp_port": port, "from": "mfuwatch@example.org",
            "to": ["oncall@example.org", "ml@example.org"], "username_env": "MFUWATCH_TEST_SMTP_USER",
            "password_env": "MFUWATCH_TEST_SMTP_PASSWORD", "ca_file": str(cert[0]), "backoff": "10ms",
            "max_backoff": "100ms", "timeout": "5s", **over}
    counts = collections.Counter()
    notifier = build_notifier(parse_notifier(spec, "notifiers[0]", 10))
    return NotifierWorker(notifier, lambda s, o: counts.update([o])), notifier, counts


def deliver(worker, *notifications, timeout=15.0):
    worker.start()
    for n in notifications:
        worker.submit(n)
    assert worker.close(time.monotonic() + timeout)


def parts(msg):
    return {p.get_content_type(): p.get_content() for p in msg.walk() if not p.is_multipart()}


def test_starttls_login_text_and_html_one_message_per_group_threaded(monkeypatch, cert):
    ctl, handler = smtp_server(cert)
    ctl.start()
    try:
        w, _, counts = mail_worker(monkeypatch, cert, ctl.port)
        mb, stall = mb_alert(annotations={**mb_alert().annotations, "summary": "<b>62%</b> & more"}), stall_alert()
        deliver(w, group(mb, stall), group(resolved(mb), resolved(stall)), group(stall_alert(starts_at=1.8e9)))
    finally:
        ctl.stop()
    assert counts["sent"] == 3 and counts["retry"] == 0
    assert handler.logins == [(USER, PASSWORD)] * 3 and handler.tls_at_data == [True] * 3  # AUTH after STARTTLS
    (frm, rcpt, first), (_, _, second), (_, _, third) = handler.messages
    assert frm == "mfuwatch@example.org" and rcpt == ["oncall@example.org", "ml@example.org"]
    assert first["Subject"] == "[FIRING:2] 2 alerts · run run-a" and first["To"] == "oncall@example.org, ml@example.org"
    assert first.get_content_type() == "multipart/alternative"
    p = parts(first)
    assert set(p) == {"text/plain", "text/html"}
    assert f"fix: rms_norm: {APPLY}  (expected gain 12.3% of step time)" in p["text/plain"]
    assert "waiting at: all_reduce" in p["text/plain"]
    assert "&lt;b&gt;62%&lt;/b&gt; &amp; more" in p["text/html"] and "<b>62%</b>" not in p["text/html"]
    assert '<a href="https://example.org/runbooks/TrainingStalled.md">Runbook</a>' in p["text/html"]
    assert "<pre>rms_norm: mfuwatch.kernels.patch(model, kernels=[&quot;rms_norm&quot;])" in p["text/html"]
    # the resolved message answers the firing one; the thread ends there, a later firing starts a new one
    assert second["Subject"] == "[RESOLVED] 2 alerts · run run-a"
    assert second["In-Reply-To"] == first["Message-ID"] and second["References"] == first["Message-ID"]
    assert "RESOLVED TrainingStalled (critical) run=run-a" in parts(second)["text/plain"]
    assert third["In-Reply-To"] is None and third["Message-ID"] not in (first["Message-ID"], second["Message-ID"])


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")  # the connection is TLS from the start
def test_implicit_tls(monkeypatch, cert):
    ctl, handler = smtp_server(cert, implicit=True)
    ctl.start()
    try:
        w, _, counts = mail_worker(monkeypatch, cert, ctl.port, tls="tls")
        deliver(w, group(mb_alert()))
    finally:
        ctl.stop()
    assert counts["sent"] == 1 and len(handler.messages) == 1 and handler.logins == [(USER, PASSWORD)]


def test_outage_then_4xx_are_retried_5xx_and_a_bad_login_are_final(monkeypatch, cert):
    port = free_port()
    w, notifier, counts = mail_worker(monkeypatch, cert, port)
    w.start()
    w.submit(group(mb_alert()))
    time.sleep(0.3)  # connection refused meanwhile: retried
    ctl, handler = smtp_server(cert, port=port)
    handler.replies = ["451 4.3.0 try again later"]
    handler.refuse = "run run-b"
    ctl.start()
    try:
        w.submit(_other_group())  # a second group: its message is refused with 554
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and counts["sent"] + counts["failed"] < 2:
            time.sleep(0.02)
        assert w.close(time.monotonic() + 5)
        w2, _, counts2 = mail_worker(monkeypatch, cert, port, password="wrong-password", max_retries=3)
        deliver(w2, group(mb_alert()))
    finally:
        ctl.stop()
    assert counts["sent"] == 1 and counts["failed"] == 1 and counts["retry"] >= 2  # refused..., 451
    assert len(handler.messages) == 1 and handler.messages[0][2]["Subject"].startswith("[FIRING] MemoryBoundDominant")
    assert counts2["failed"] == 1 and counts2["retry"] == 0  # 535: a wrong password is not retried
    assert handler.logins[-1] == (USER, "wrong-password")


def _other_group():
    from mfuwatch.alerts.model import Notification

    a = stall_alert(labels={**stall_alert().labels, "run": "run-b"})
    return Notification({"run": "run-b"}, (a,))


def test_an_untrusted_certificate_is_final_and_no_secret_is_logged(monkeypatch, cert, caplog):
    caplog.set_level(logging.DEBUG)
    ctl, handler = smtp_server(cert)
    ctl.start()
    try:
        w, _, counts = mail_worker(monkeypatch, cert, ctl.port, ca_file=None)  # the system CAs do not know it
        deliver(w, group(mb_alert()))
    finally:
        ctl.stop()
    assert counts["failed"] == 1 and counts["retry"] == 0 and handler.messages == []
    assert any("TLS with the SMTP server failed (SSLCertVerificationError)" in r.getMessage() for r in caplog.records)
    assert_clean(caplog.text, USER, PASSWORD)


def test_email_config_is_checked():
    base = {"type": "email", "smtp_host": "smtp.example.org", "from": "a@example.org", "to": ["b@example.org"]}
    for bad, message in (({"tls": "ssl"}, "tls: 'ssl' is not accepted"),
                         ({"to": []}, "at least one recipient"),
                         ({"from": "nobody"}, "expected an e-mail address"),
                         ({"password": "x"}, "secrets are not written in the config"),
                         ({"tls": "none", "username_env": "U", "password_env": "P"}, "in clear text"),
                         ({"password_env": "P"}, "both a username")):
        with pytest.raises(AlertConfigError, match=message):
            parse_notifier({**base, **bad}, "notifiers[0]", 10)


def test_a_run_name_with_cr_lf_is_one_line_in_headers_and_the_mail_is_sent(monkeypatch, cert):
    """Finding 17: test-notify --run $'evil\\r\\nBcc: attacker@example.org' made every e-mail fail to render
    (0 of 4 sent); now the headers hold it on one line, no Bcc appears, and the message is delivered."""
    from mfuwatch.alerts.model import Notification

    evil = "evil\r\nBcc: attacker@example.org\r\nX-Injected: 1"
    labels = {**stall_alert().labels, "run": evil}
    ctl, handler = smtp_server(cert)
    ctl.start()
    try:
        w, _, counts = mail_worker(monkeypatch, cert, ctl.port)
        deliver(w, Notification({"run": evil}, (stall_alert(labels=labels),)))
    finally:
        ctl.stop()
    assert counts["sent"] == 1 and counts["failed"] == 0
    ((_, rcpt, msg),) = handler.messages
    assert rcpt == ["oncall@example.org", "ml@example.org"]  # nobody added
    assert msg["Bcc"] is None and msg["X-Injected"] is None
    assert msg["Subject"] == "[FIRING] TrainingStalled · run evil Bcc: attacker@example.org X-Injected: 1"
    assert "\r" not in msg["X-Mfuwatch-Group"] and "\n" not in msg["X-Mfuwatch-Group"]


def test_test_notify_resolves_only_after_the_firing_test_was_delivered(monkeypatch, cert, tmp_path, capsys):
    """Finding 7: one 451 made test-notify report `email: 1 of 2 test notifications delivered` (exit 1): the
    resolved state, sent 10 ms behind, superseded the firing one being retried. Now the firing message is
    delivered (after its retry) before the resolved one goes, and both arrive in that order."""
    import yaml

    from mfuwatch.alerts.cli import main

    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.setenv("MFUWATCH_TEST_SMTP_USER", USER)
    monkeypatch.setenv("MFUWATCH_TEST_SMTP_PASSWORD", PASSWORD)
    ctl, handler = smtp_server(cert)
    handler.replies = ["451 4.3.0 try again later"]
    ctl.start()
    try:
        cfg = tmp_path / "em.yaml"
        cfg.write_text(yaml.safe_dump({"notifiers": [{
            "type": "email", "smtp_host": "127.0.0.1", "smtp_port": ctl.port, "from": "mfuwatch@example.org",
            "to": ["oncall@example.org"], "username_env": "MFUWATCH_TEST_SMTP_USER",
            "password_env": "MFUWATCH_TEST_SMTP_PASSWORD", "ca_file": str(cert[0]), "backoff": "10ms",
            "max_backoff": "100ms"}]}))
        assert main(["test-notify", "--config", str(cfg), "--timeout", "20"]) == 0
    finally:
        ctl.stop()
    assert "email: 2 of 2 test notifications delivered" in capsys.readouterr().out
    assert [m["Subject"].split("]")[0] for _, _, m in handler.messages] == ["[FIRING", "[RESOLVED"]
