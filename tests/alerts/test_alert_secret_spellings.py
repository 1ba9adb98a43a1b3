"""A webhook URL never reaches the logs in any spelling: #fragment, %7E, a space, a secret in the host name;
and a URL pasted into ``url_env`` by mistake is not echoed back."""

from __future__ import annotations

import logging

import pytest
from helpers.net import free_port

from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.notifiers.webhook import WebhookNotifier
from mfuwatch.alerts.validation import AlertConfigError


def _post_once(url, monkeypatch):
    monkeypatch.setenv("MFUWATCH_TEST_SPELLING_URL", url)
    cfg = parse_notifier({"type": "webhook", "url_env": "MFUWATCH_TEST_SPELLING_URL", "timeout": "2s"},
                         "notifiers[0]", 10)
    n = WebhookNotifier(cfg)
    try:
        return n.post_json({"x": 1}, lambda s: False, lambda: None)  # one attempt, no retry
    finally:
        n.close()


@pytest.mark.parametrize("suffix, secrets", [
    ("/hook/SECRETPATH42#SECRETFRAG42", ["SECRETPATH42", "SECRETFRAG42"]),
    ("/hook/A%7EB-SECRET42", ["A%7EB-SECRET42", "A~B-SECRET42", "B-SECRET42"]),
    ("/hook/with space SECRET42", ["with space SECRET42", "with%20space%20SECRET42", "SECRET42"]),
    ("/hook?token=SECRETQUERY42", ["SECRETQUERY42"]),
])
def test_urllib3_debug_lines_never_show_the_url(receiver, monkeypatch, caplog, suffix, secrets):
    caplog.set_level(logging.DEBUG)
    outcome = _post_once(f"http://127.0.0.1:{receiver.port}{suffix}", monkeypatch)
    assert outcome == "sent"
    assert any(r.name.startswith("urllib3") and "POST" in r.getMessage() for r in caplog.records)
    for s in secrets:
        assert s not in caplog.text


def test_a_secret_in_the_host_name_is_not_logged(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    _post_once(f"http://s3cr3thost42.invalid:{free_port()}/hook", monkeypatch)  # cannot resolve: one attempt
    assert any(r.name.startswith("urllib3") for r in caplog.records)  # urllib3 did log the connection
    assert "s3cr3thost42" not in caplog.text


def test_a_url_pasted_into_url_env_is_not_echoed():
    with pytest.raises(AlertConfigError) as info:
        parse_notifier({"type": "slack", "url_env": "https://hooks.slack.com/services/T0/B0/PASTED42"},
                       "notifiers[0]", 10)
    msg = str(info.value)
    assert "notifiers[0].url_env" in msg and "NAME of an environment variable" in msg
    assert "PASTED42" not in msg and "hooks.slack.com" not in msg
