"""alerts/config.py, rules.py, validation.py, matchers.py: schema, defaults, merge, and error messages."""

from __future__ import annotations

import datetime as dt

import pytest
import yaml

from mfuwatch.alerts import AlertConfigError, AlertEngine, load_config
from mfuwatch.alerts.matchers import parse_matcher
from mfuwatch.alerts.validation import format_duration, parse_duration

BUILTINS = {"MfuLow", "MfuRegression", "MemoryBoundDominant", "TrainingStalled", "GpuThrottling", "GpuXidErrors",
            "GpuEccErrors", "GpuMemoryPressure", "InputStall", "StragglerRank", "MfuAboveTensorActivity",
            "MfuFarBelowTensorActivity", "MfuImplausible"}


def test_defaults_have_every_builtin_rule_and_a_console_notifier():
    cfg = load_config(None)
    assert {r.name for r in cfg.rules} == BUILTINS
    assert [n.type for n in cfg.notifiers] == ["console"]
    stalled = cfg.rule("TrainingStalled")
    assert (stalled.expr, stalled.op, stalled.threshold, stalled.severity) == ("seconds_since_last_step", ">", 300.0,
                                                                              "critical")
    assert cfg.rule("MfuRegression").window_seconds == 3600.0 and cfg.rule("MfuRegression").offset_seconds == 600.0
    assert not cfg.rule("StragglerRank").in_process and cfg.rule("MfuLow").in_process
    # every rule links its runbook, docs/runbooks/<alertname>.md
    for r in cfg.rules:
        assert r.annotations["runbook_url"].text.endswith(f"/{r.name}.md")


def test_user_overrides_merge_key_by_key():
    cfg = load_config({"rules": {"MfuLow": {"threshold": 0.3, "labels": {"team": "ml"},
                                            "annotations": {"summary": "low {value:pct}"}}},
                       "repeat_interval": "1h"})
    r = cfg.rule("MfuLow")
    assert r.threshold == 0.3 and r.for_seconds == 600.0 and r.labels == {"team": "ml"}
    assert r.annotations["summary"].text == "low {value:pct}"
    assert "description" in r.annotations  # merged, not replaced
    assert cfg.repeat_interval_seconds == 3600.0
    assert cfg.rule("MfuRegression").threshold == 0.8


def test_custom_rule_and_disabling_and_no_defaults():
    cfg = load_config({"rules": {"IdleHigh": {"expr": "idle_share", "op": ">=", "threshold": 0.5, "for": "30s"},
                                 "MfuLow": {"enabled": False}}})
    custom = cfg.rule("IdleHigh")
    assert (custom.expr, custom.op, custom.for_seconds, custom.builtin) == ("idle_share", ">=", 30.0, False)
    assert cfg.rule("MfuLow").enabled is False
    only = load_config({"use_default_rules": False,
                        "rules": {"X": {"expr": "mfu", "op": "<", "threshold": 0.1}}})
    assert [r.name for r in only.rules] == ["X"]


def test_agent_config_file_with_alerts_key(tmp_path):
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump({"run": "x", "port": 0, "alerts": {"rules": {"MfuLow": {"threshold": 0.4}}}}))
    assert load_config(p).rule("MfuLow").threshold == 0.4
    p2 = tmp_path / "alerts.yaml"
    p2.write_text(yaml.safe_dump({"evaluation_interval": "2s"}))
    assert load_config(str(p2)).evaluation_interval_seconds == 2.0


@pytest.mark.parametrize("doc, needles", [
    ({"evaluation_intervl": "5s"}, ["evaluation_intervl", "did you mean 'evaluation_interval'"]),
    ({"rules": {"MfuLow": {"threshhold": 0.1}}}, ["rules.MfuLow", "'threshhold'", "did you mean 'threshold'"]),
    ({"rules": {"MfuLow": {"severity": "page"}}}, ["rules.MfuLow.severity", "critical, warning, info"]),
    ({"rules": {"MfuLow": {"op": "=="}}}, ["rules.MfuLow.op", "<, <=, >, >="]),
    ({"rules": {"MfuLow": {"for": "ten minutes"}}}, ["rules.MfuLow.for", "'30s', '5m'"]),
    ({"rules": {"MfuLo": {"threshold": 0.2}}}, ["rules.MfuLo", "did you mean the built-in rule 'MfuLow'"]),
    ({"rules": {"X": {"expr": "idle_shares", "op": "<", "threshold": 1}}}, ["rules.X.expr", "did you mean 'idle_share'"]),
    ({"rules": {"MfuLow": {"labels": {"severity": "x"}}}}, ["rules.MfuLow.labels.severity", "reserved"]),
    ({"rules": {"MfuLow": {"annotations": {"summary": "{valu}"}}}}, ["rules.MfuLow.annotations.summary", "{valu}"]),
    ({"rules": {"MfuLow": {"window": "5m"}}}, ["rules.MfuLow.window", "takes no window"]),
    ({"notifiers": [{"type": "slak", "url_env": "X"}]}, ["notifiers[0].type", "console, slack, webhook"]),
    ({"notifiers": [{"type": "slack", "url": "https://hooks.slack.com/services/T/B/C"}]},
     ["notifiers[0].url", "url_env", "url_file"]),
    ({"notifiers": [{"type": "webhook"}]}, ["notifiers[0]", "url_env"]),
    ({"notifiers": [{"type": "webhook", "url_env": "A", "severities": ["critcal"]}]},
     ["notifiers[0].severities", "did you mean 'critical'"]),
    ({"silences": [{"matchers": ['alertname="MfuLow"']}]}, ["silences[0].until"]),
    ({"silences": [{"matchers": ["alertname~MfuLow"], "until": "2030-01-01T00:00:00Z"}]},
     ["silences[0].matchers[0]", "=, !=, =~, !~"]),
    ({"inhibit_rules": [{"source_matchers": ['alertname="A"'], "target_matchers": ['alertname="B"'],
                         "equl": ["run"]}]}, ["inhibit_rules[0]", "did you mean 'equal'"]),
])
def test_errors_name_the_field_and_the_fix(doc, needles):
    with pytest.raises(AlertConfigError) as info:
        load_config(doc)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_missing_secret_fails_fast_without_the_value(monkeypatch, run_info):
    monkeypatch.delenv("MFUWATCH_TEST_MISSING_URL", raising=False)
    with pytest.raises(AlertConfigError, match="MFUWATCH_TEST_MISSING_URL is not set"):
        AlertEngine.from_config({"notifiers": [{"type": "slack", "url_env": "MFUWATCH_TEST_MISSING_URL"}]},
                                run_info=run_info)
    monkeypatch.setenv("MFUWATCH_TEST_MISSING_URL", "ftp://secret-host/abc")
    with pytest.raises(AlertConfigError) as info:
        AlertEngine.from_config({"notifiers": [{"type": "slack", "url_env": "MFUWATCH_TEST_MISSING_URL"}]},
                                run_info=run_info)
    assert "secret-host" not in str(info.value) and "not an http(s) URL" in str(info.value)


def test_non_zero_rank_needs_no_secret(run_info, monkeypatch):
    monkeypatch.delenv("MFUWATCH_TEST_MISSING_URL", raising=False)
    run_info.rank = 3
    engine = AlertEngine.from_config({"notifiers": [{"type": "slack", "url_env": "MFUWATCH_TEST_MISSING_URL"}]},
                                     run_info=run_info)
    assert engine.workers == [] and not engine.notifying


@pytest.mark.parametrize("text, seconds", [("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25),
                                           ("2d", 172800.0), (42, 42.0), ("1.5", 1.5), ("0s", 0.0)])
def test_durations(text, seconds):
    assert parse_duration(text, "x") == seconds


@pytest.mark.parametrize("seconds, text", [(300, "5m"), (5400, "1h30m"), (0.25, "250ms"), (0, "0s"),
                                           (90061, "1d1h1m1s"), (604800, "1w")])
def test_format_duration_is_prometheus_syntax(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text, "x") == seconds


def test_silence_until_accepts_yaml_datetimes_and_strings():
    doc = yaml.safe_load("silences:\n  - matchers: ['rank=\"3\"']\n    until: 2030-01-02T03:04:05Z\n")
    cfg = load_config(doc)
    expected = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc).timestamp()
    assert cfg.silences[0].until == expected
    cfg2 = load_config({"silences": [{"matchers": {"rank": "3"}, "until": "2030-01-02T03:04:05+00:00"}]})
    assert cfg2.silences[0].until == expected


@pytest.mark.parametrize("text, labels, expected", [
    ('alertname="MfuLow"', {"alertname": "MfuLow"}, True),
    ('alertname!="MfuLow"', {"alertname": "MfuLow"}, False),
    ('alertname=~"Mfu.*"', {"alertname": "MfuRegression"}, True),
    ('alertname=~"Mfu"', {"alertname": "MfuRegression"}, False),  # anchored, as in Alertmanager
    ('rank!~"0|1"', {"rank": "3"}, True),
    ('team=""', {"alertname": "x"}, True),  # a missing label is the empty string
    ('summary="say \\"hi\\""', {"summary": 'say "hi"'}, True),
])
def test_matchers(text, labels, expected):
    assert parse_matcher(text, "m").matches(labels) is expected


def test_config_dump_round_trips_through_load():
    cfg = load_config({"rules": {"MfuLow": {"threshold": 0.3}},
                       "silences": [{"matchers": ['rank="1"'], "until": "2030-01-01T00:00:00Z"}]})
    again = load_config(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


def test_an_unknown_notifier_key_lists_only_that_types_keys():
    """Finding 8: `routing_keyenv` on a pagerduty notifier listed every type's keys (smtp_host, stream, ...)."""
    from mfuwatch.alerts.config import TYPE_KEYS, _COMMON_KEYS, parse_notifier

    with pytest.raises(AlertConfigError) as err:
        parse_notifier({"type": "pagerduty", "routing_keyenv": "X"}, "notifiers[0]", 1)
    msg = str(err.value)
    assert "did you mean 'routing_key_env'?" in msg
    listed = set(msg.split("accepted keys: ")[1].split(", "))
    assert listed == set(_COMMON_KEYS + TYPE_KEYS["pagerduty"])
    assert not {"smtp_host", "stream", "api_key_env", "url_env"} & listed
