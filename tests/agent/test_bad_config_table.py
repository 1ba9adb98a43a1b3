"""The bad-config table: every value that used to be accepted fails at start-up with one line naming the
field (and what is accepted); the two config files read durations with one grammar."""

from __future__ import annotations

import pytest

from mfuwatch.agent.config import ConfigError, load_config, parse_profile_every
from mfuwatch.agent.schema import RunInfo
from mfuwatch.alerts.config import load_config as load_alerts
from mfuwatch.alerts.engine import AlertEngine
from mfuwatch.alerts.validation import AlertConfigError, parse_duration

AGENT_BAD = [
    ({"profile_active_steps": 1e9}, "profile_active_steps", "1..50"),
    ({"profile_active_steps": 51}, "profile_active_steps", "1..50"),
    ({"profile_warmup_steps": 10_000}, "profile_warmup_steps", "0..50"),
    ({"top_k_ops": 100_000}, "top_k_ops", "1..100"),
    ({"port": 187020}, "port", "0..65535"),
    ({"port": 65535, "local_rank": 3}, "port", "65535"),
    ({"profile_every": "15 parsecs"}, "profile_every", "'300s'"),
    # fresh-user pass (issue 28): an infinite peak read as MFU 0 (MfuLow on a made-up value)
    ({"peak_flops": float("inf")}, "peak_flops", "positive finite number"),
    ({"peak_flops": "inf"}, "peak_flops", "positive finite number"),
    ({"peak_flops": float("nan")}, "peak_flops", "positive finite number"),
    ({"flops_per_step": float("inf")}, "flops_per_step", "positive finite number"),
    # another machine's address (TEST-NET-3, RFC 5737: never assigned here) failed later, on the exporter's
    # child, with a traceback that did not name bind
    ({"bind": "203.0.113.7"}, "bind", "not an address of this machine"),
    ({"preemption_timeout_seconds": 1e9}, "preemption_timeout_seconds", "(0, 60]"),
]

ALERTS_BAD = [
    ({"evaluation_interval": "1ms"}, "evaluation_interval", "at least 100ms"),
    ({"watchdog_interval": "1ms"}, "watchdog_interval", "at least 50ms"),
    ({"repeat_interval": 0}, "repeat_interval", "at least 1m"),
    ({"repeat_interval": "0s"}, "repeat_interval", "at least 1m"),
    ({"rules": {"GpuThrottling": {"reasons": ["hw_slowdonw"]}}}, "GpuThrottling.reasons", "hw_slowdown"),
    ({"grafana_url": "http://grafana.internal:187020"}, "grafana_url", "1..65535"),
    ({"runbook_base_url": "https://example.org:99999/runbooks"}, "runbook_base_url", "1..65535"),
    ({"runbook_base_url": "not a url"}, "runbook_base_url", "http(s) URL"),
    ({"notifiers": [{"type": "webhook", "url_env": "https://hooks.example/T/B/SECRET"}]}, "notifiers[0].url_env",
     "NAME of an environment variable"),
    ({"notifiers": [{"type": "webhook", "url_env": "X", "max_retries": -1}]}, "notifiers[0].max_retries", ">="),
]


@pytest.mark.parametrize("bad, field, hint", AGENT_BAD, ids=[r[1] + "-" + str(i) for i, r in enumerate(AGENT_BAD)])
def test_agent_bad_value_fails_naming_the_field(bad, field, hint):
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    assert msg.startswith(field) and hint in msg and "\n" not in msg


@pytest.mark.parametrize("bad, field, hint", ALERTS_BAD, ids=[r[1] + "-" + str(i) for i, r in enumerate(ALERTS_BAD)])
def test_alerts_bad_value_fails_naming_the_field(bad, field, hint):
    with pytest.raises(AlertConfigError) as info:
        load_alerts(bad)
    msg = str(info.value)
    assert field in msg and hint in msg and "SECRET" not in msg


def test_webhook_url_with_a_port_out_of_range_fails_at_start_without_echoing_it(monkeypatch):
    run_info = RunInfo(run="r", rank=0, world_size=1)
    monkeypatch.setenv("MFUWATCH_TEST_PORT_URL", "http://hooks.example:187020/T0/SECRETPATH")
    with pytest.raises(AlertConfigError) as info:
        AlertEngine.from_config({"notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_PORT_URL"}]},
                                run_info=run_info)
    msg = str(info.value)
    assert "1..65535" in msg and "MFUWATCH_TEST_PORT_URL" in msg and "SECRETPATH" not in msg


def test_garbage_tls_certificate_fails_at_start(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    key.write_text("not a key\n")
    with pytest.raises(ConfigError) as info:
        load_config({"tls_certfile": str(cert), "tls_keyfile": str(key)})
    assert str(info.value).startswith("tls_certfile / tls_keyfile: cannot load") and "PEM" in str(info.value)


@pytest.mark.parametrize("text, seconds", [("15 seconds", 15.0), ("15s", 15.0), ("5 minutes", 300.0),
                                           ("5 min", 300.0), ("5m", 300.0), ("1h30m", 5400.0),
                                           ("2 hours", 7200.0), ("250ms", 0.25), ("90", 90.0)])
def test_one_duration_grammar_for_both_config_files(text, seconds):
    assert parse_duration(text, "x") == pytest.approx(seconds)
    if seconds >= 1 and not text.isdigit():  # a bare number is steps in profile_every
        assert parse_profile_every(text).seconds == pytest.approx(seconds)
    assert load_alerts({"rules": {"MfuLow": {"for": text}}}).rules  # the alerts file takes it too
