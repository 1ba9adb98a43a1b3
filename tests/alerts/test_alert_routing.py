"""alerts/routing.py, ``mfuwatch alerts check`` / ``test-notify`` with routes, and the Alertmanager example receivers.

Routing is checked three ways: the first-match/continue walk on hand-written label sets; the
validation messages (the nearest valid name for a typo); and the two example configs
(docs/examples/alerts/routes.yaml in-process, grafana/alertmanager/receivers.yml for Alertmanager)
routing every built-in alert to the same receivers — Alertmanager's answer taken from
``amtool config routes test`` (Debian's prometheus-alertmanager), not from our code.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.vendor_receivers import DiscordReceiver, PagerDutyReceiver, TeamsReceiver
from test_alert_slack import mb_alert
from test_alert_vendors import PD_KEY, group, stall_alert

from mfuwatch.alerts import AlertConfigError, load_config
from mfuwatch.alerts.cli import main
from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.notifiers import build_notifier
from mfuwatch.alerts.routing import Route, parse_routes, route
from mfuwatch.alerts.matchers import parse_matcher

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "alerts" / "routes.yaml"
AM_RECEIVERS = REPO / "grafana" / "alertmanager" / "receivers.yml"
#: Alertmanager integration -> mfuwatch notifier type
AM_TYPES = {"pagerduty_configs": "pagerduty", "opsgenie_configs": "opsgenie", "slack_configs": "slack",
            "msteamsv2_configs": "teams", "discord_configs": "discord", "email_configs": "email"}
EXAMPLE_ENV = {"MFUWATCH_PAGERDUTY_ROUTING_KEY": PD_KEY, "MFUWATCH_OPSGENIE_API_KEY": "og-key-42",
               "MFUWATCH_SLACK_WEBHOOK_URL": "https://hooks.example/T/B/X",
               "MFUWATCH_TEAMS_WORKFLOW_URL": "https://wf.example/workflows/1?sig=S",
               "MFUWATCH_DISCORD_WEBHOOK_URL": "https://discord.example/api/webhooks/1/T",
               "MFUWATCH_SMTP_USERNAME": "u", "MFUWATCH_SMTP_PASSWORD": "p"}


def R(matchers, notifiers, cont=False):
    return Route(tuple(parse_matcher(m, "t") for m in matchers), tuple(notifiers), cont)


def test_first_match_wins_unless_continue():
    routes = (R(['severity="critical"'], ["pagerduty"], cont=True), R(['alertname=~"Mfu.*"'], ["slack"]),
              R([], ["email", "slack"]))
    assert route(routes, {"severity": "critical", "alertname": "TrainingStalled"}) == (("pagerduty", "email",
                                                                                        "slack"), (0, 2))
    assert route(routes, {"severity": "critical", "alertname": "MfuLow"}) == (("pagerduty", "slack"), (0, 1))
    assert route(routes, {"severity": "warning", "alertname": "MfuLow"}) == (("slack",), (1,))
    assert route(routes, {"severity": "info", "alertname": "MemoryBoundDominant"}) == (("email", "slack"), (2,))
    assert route(routes[:2], {"severity": "info", "alertname": "X"}) == ((), ())  # matched nothing


NOTIFIERS = [{"type": "console", "name": "pager"}, {"type": "console", "name": "chat", "stream": "stdout"}]


@pytest.mark.parametrize("routes, message", [
    ([{"notifiers": ["pagr"]}], "routes[0].notifiers: no notifier is called 'pagr' (did you mean 'pager'?)"),
    ([{"matchers": ['severty="critical"'], "notifiers": ["pager"]}],
     "routes[0].matchers[0]: no alert has a label 'severty' (did you mean 'severity'?)"),
    ([{"matchers": ['severity="critcal"'], "notifiers": ["pager"]}],
     "severity 'critcal' is not one of the configured values (did you mean 'critical'?)"),
    ([{"matchers": ['alertname="MfuLwo"'], "notifiers": ["pager"]}], "(did you mean 'MfuLow'?)"),
    ([{"matcher": ['severity="critical"'], "notifiers": ["pager"]}], "unknown key 'matcher' (did you mean 'matchers'?)"),
    ([{"receiver": "pager"}], "write notifiers: [pager]"),
    ([{"matchers": ["severity=critical"]}], "routes[0].notifiers: a route needs the notifiers"),
    ([{"matchers": ['severity=~"(crit"'], "notifiers": ["pager"]}], "bad regular expression"),
    ({"notifiers": ["pager"]}, "routes: expected a list"),
])
def test_route_mistakes_fail_at_load_with_the_nearest_name(routes, message):
    with pytest.raises(AlertConfigError) as info:
        load_config({"notifiers": NOTIFIERS, "routes": routes})
    assert message in str(info.value)


def test_no_routes_keeps_every_notifier_getting_every_alert_and_routes_filter(caplog):
    plain = load_config({"notifiers": NOTIFIERS})
    assert plain.routes == () and all(n.routes == () for n in plain.notifiers)
    n = group(mb_alert(), stall_alert())
    for cfg in plain.notifiers:
        assert build_notifier(cfg).accepts(n) == n  # today's behaviour: no routes, everything
    routed = load_config({"notifiers": NOTIFIERS, "routes": [{"matchers": ['severity="critical"'],
                                                              "notifiers": ["pager"]},
                                                             {"matchers": ['severity="warning"'],
                                                              "notifiers": ["chat"]}]})
    pager, chat = (build_notifier(c) for c in routed.notifiers)
    assert [a.name for a in pager.accepts(n).alerts] == ["TrainingStalled"]
    with caplog.at_level(logging.WARNING, logger="mfuwatch.alerts"):
        assert chat.accepts(n) is None and chat.accepts(n) is None
    unrouted = [r.getMessage() for r in caplog.records if "matches no route" in r.getMessage()]
    assert len(unrouted) == 1 and "MemoryBoundDominant" in unrouted[0]  # said once, not per notification
    assert load_config(routed.to_dict() | {"notifiers": NOTIFIERS}).routes == routed.routes  # dump round-trips


def test_check_lists_routes_and_warns_about_gaps(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "alerts.yaml"
    cfg.write_text(yaml.safe_dump({"notifiers": NOTIFIERS + [{"type": "console", "name": "spare"}],
                                   "routes": [{"matchers": ['severity="critical"'], "notifiers": ["pager"],
                                               "continue": True},
                                              {"matchers": ['severity!="info"'], "notifiers": ["chat"]}]}))
    assert main(["check", "--config", str(cfg)]) == 0
    out = capsys.readouterr()
    assert 'route[0] severity="critical" -> pager (continue)' in out.out
    assert 'route[1] severity!="info" -> chat' in out.out and "routes: 2; config OK" in out.out
    assert "the last route has matchers" in out.err and "notifier spare is named by no route" in out.err
    cfg.write_text(yaml.safe_dump({"notifiers": NOTIFIERS, "routes": [{"notifiers": ["pagerr"]}]}))
    assert main(["check", "--config", str(cfg)]) == 2
    assert "did you mean 'pager'?" in capsys.readouterr().err


def test_the_example_routes_config_checks(monkeypatch, capsys):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    for k, v in EXAMPLE_ENV.items():
        monkeypatch.setenv(k, v)
    assert main(["check", "--config", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "notifier pagerduty (pagerduty) routing key from $MFUWATCH_PAGERDUTY_ROUTING_KEY" in out
    assert "notifier email (email) smtp.example.org:587 starttls from mfuwatch@example.org to ml-oncall@example.org, " \
        "username from $MFUWATCH_SMTP_USERNAME, password from $MFUWATCH_SMTP_PASSWORD" in out
    assert PD_KEY not in out
    assert main(["show-config", "--config", str(EXAMPLE)]) == 0
    dump = yaml.safe_load(capsys.readouterr().out)
    assert dump["routes"] == yaml.safe_load(EXAMPLE.read_text())["routes"]
    assert {n["type"]: n.get("routing_key_env") or n.get("api_key_env") or n.get("url_env") or n.get("password_env")
            for n in dump["notifiers"]} == {
        "pagerduty": "MFUWATCH_PAGERDUTY_ROUTING_KEY", "opsgenie": "MFUWATCH_OPSGENIE_API_KEY",
        "slack": "MFUWATCH_SLACK_WEBHOOK_URL", "teams": "MFUWATCH_TEAMS_WORKFLOW_URL",
        "discord": "MFUWATCH_DISCORD_WEBHOOK_URL", "email": "MFUWATCH_SMTP_PASSWORD"}
    assert not any(v in yaml.safe_dump(dump) for v in EXAMPLE_ENV.values() if len(v) > 2)  # names, never values
    monkeypatch.delenv("MFUWATCH_OPSGENIE_API_KEY")
    assert main(["check", "--config", str(EXAMPLE)]) == 2  # a secret that cannot be read fails the check
    assert "MFUWATCH_OPSGENIE_API_KEY is not set" in capsys.readouterr().err


def test_test_notify_exercises_every_route(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.setenv("MFUWATCH_TEST_PD_KEY", PD_KEY)
    with PagerDutyReceiver(PD_KEY) as pd, DiscordReceiver() as dc, TeamsReceiver() as tm:
        monkeypatch.setenv("MFUWATCH_TEST_DISCORD_URL", dc.url)
        monkeypatch.setenv("MFUWATCH_TEST_TEAMS_URL", tm.url)
        fast = {"backoff": "10ms", "max_backoff": "100ms"}
        cfg = tmp_path / "alerts.yaml"
        cfg.write_text(yaml.safe_dump({
            "notifiers": [{"type": "pagerduty", "routing_key_env": "MFUWATCH_TEST_PD_KEY", "api_url": pd.url, **fast},
                          {"type": "discord", "url_env": "MFUWATCH_TEST_DISCORD_URL", **fast},
                          {"type": "teams", "url_env": "MFUWATCH_TEST_TEAMS_URL", **fast}],
            "routes": [{"matchers": ['severity="critical"'], "notifiers": ["pagerduty"], "continue": True},
                       {"matchers": ['severity=~"info|warning"'], "notifiers": ["discord"]},
                       {"notifiers": ["teams"]}]}))
        assert main(["test-notify", "--config", str(cfg), "--timeout", "10"]) == 0
        out = capsys.readouterr().out
        assert pd.violations == dc.violations == tm.violations == []
        pd_events = pd.events()
    # route[0]'s critical alert continues to teams; route[2]'s (critical too) also passes route[0]: pagerduty
    assert "pagerduty: 4 of 4 test notifications delivered" in out
    assert "discord: 2 of 2 test notifications delivered" in out and "teams: 4 of 4" in out
    # every firing test state is delivered before the resolved ones go
    assert [e["event_action"] for e in pd_events] == ["trigger"] * 2 + ["resolve"] * 2 and pd.open == {}
    assert {e["payload"]["severity"] for e in pd_events if "payload" in e} == {"critical"}
    # route[2] is reached by a critical test alert (route[0] continues; route[1] takes info and warning)
    assert re.search(r"route\[2\] \(catch-all\): test alert .*severity=critical.* -> pagerduty, teams", out), out
    assert re.search(r"route\[1\] severity=~\"info\|warning\": test alert .*severity=info.* -> discord", out), out


def test_test_notify_labels_satisfy_every_matcher_with_realistic_values(tmp_path, monkeypatch, capsys):
    """Finding: test-notify copied matcher text into labels (alertname=Gpu.*, severity=warning|info, so
    PagerDuty got severity info for a route meant for criticals). Each test alert must satisfy every matcher
    of its route, each label a configured value where one fits (else one built from the regex)."""
    from mfuwatch.alerts.cli import _test_cases
    from mfuwatch.alerts.matchers import all_match

    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.setenv("MFUWATCH_TEST_PD_KEY", PD_KEY)
    with PagerDutyReceiver(PD_KEY) as pd:
        cfg_path = tmp_path / "neg.yaml"
        cfg_path.write_text(yaml.safe_dump({
            "notifiers": [{"type": "pagerduty", "routing_key_env": "MFUWATCH_TEST_PD_KEY", "api_url": pd.url,
                           "backoff": "10ms", "max_backoff": "100ms"}, {"type": "console", "stream": "stdout"}],
            "routes": [{"matchers": ['severity!~"warning|info"', 'alertname=~"Gpu.*"'], "notifiers": ["pagerduty"]},
                       {"matchers": ['run=~"prod-.*"', 'severity=~"critical|warning"'], "notifiers": ["console"]},
                       {"matchers": ['alertname!="MfuLow"', 'alertname=~"Mfu.*"'], "notifiers": ["console"]},
                       {"notifiers": ["console"]}]}))
        cfg = load_config(cfg_path)
        cases = _test_cases(cfg, "mfuwatch-test", "h")
        assert all(labels is not None for _, labels in cases)
        for i, (r, (_, labels)) in enumerate(zip(cfg.routes, cases)):
            assert all_match(r.matchers, labels) and i in route(cfg.routes, labels)[1], (i, labels)
        rule_names = {r.name for r in cfg.rules}
        assert cases[0][1]["severity"] == "critical" and cases[0][1]["alertname"] in rule_names
        assert cases[0][1]["alertname"].startswith("Gpu")
        assert re.fullmatch("prod-.*", cases[1][1]["run"]) and cases[1][1]["run"] != "prod-.*"
        assert cases[2][1]["alertname"] != "MfuLow" and cases[2][1]["alertname"].startswith("Mfu")
        assert cases[3][1]["alertname"] != "MfuwatchTest"  # route[2] takes that name: the catch-all gets another
        assert main(["test-notify", "--config", str(cfg_path), "--timeout", "10"]) == 0
        events = pd.events()
    triggers = [e for e in events if e["event_action"] == "trigger"]
    assert len(triggers) == 1 and triggers[0]["payload"]["severity"] == "critical"
    assert triggers[0]["payload"]["class"] == cases[0][1]["alertname"]


def test_test_notify_says_not_tested_for_a_regex_it_cannot_satisfy(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "la.yaml"
    cfg.write_text(yaml.safe_dump({"notifiers": [{"type": "console", "stream": "stdout"}],
                                   "routes": [{"matchers": ['run=~"(?!x)y.*"'], "notifiers": ["console"]},
                                              {"notifiers": ["console"]}]}))
    assert main(["test-notify", "--config", str(cfg), "--timeout", "5"]) == 1
    assert "route[0] run=~\"(?!x)y.*\": no test alert reaches it" in capsys.readouterr().out


def test_check_warns_when_a_notifiers_own_severities_drop_what_a_route_sends(tmp_path, monkeypatch, capsys):
    """Finding: routes sent warnings to a pagerduty notifier with `severities: [critical]`, which dropped
    them silently; its `severity_map: {warning: error}` was dead configuration. check must say both, and
    what it says must be what delivery does (the notifier really refuses the warning)."""
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.setenv("MFUWATCH_TEST_PD_KEY", PD_KEY)
    monkeypatch.setenv("MFUWATCH_TEST_OG_KEY", "og-key-42")
    spec = {"notifiers": [{"type": "pagerduty", "routing_key_env": "MFUWATCH_TEST_PD_KEY",
                           "severities": ["critical"], "severity_map": {"warning": "error"}},
                          {"type": "opsgenie", "api_key_env": "MFUWATCH_TEST_OG_KEY",
                           "severity_map": {"warning": "P2", "info": "P5"}},
                          {"type": "console"}],
            "routes": [{"matchers": ['severity=~"critical|warning"'], "notifiers": ["pagerduty", "opsgenie"]},
                       {"notifiers": ["console"]}]}
    cfg_path = tmp_path / "mix.yaml"
    cfg_path.write_text(yaml.safe_dump(spec))
    assert main(["check", "--config", str(cfg_path)]) == 0
    err = capsys.readouterr().err
    assert "route[0] sends warning alerts to pagerduty, whose own `severities: [critical]` drops them" in err
    assert "notifier pagerduty: severity_map warning: error never applies" in err
    assert "notifier opsgenie: severity_map info: P5 never applies: no route sends it info alerts" in err
    assert "opsgenie: severity_map warning" not in err and "route[0] sends critical" not in err
    cfg = load_config(cfg_path)  # the warning describes delivery: the notifier does refuse the warning
    pd = build_notifier(cfg.notifiers[0])
    labels = {"alertname": "MfuLow", "severity": "warning", "run": "r", "rank": "0"}
    assert "pagerduty" in route(cfg.routes, labels)[0]
    assert pd.accepts(group(mb_alert(name="MfuLow", severity="warning", labels=labels))) is None
    pd.close()


# -- the Alertmanager example receivers --------------------------------------------------------------------------

def amtool_version(amtool):
    out = subprocess.run([amtool, "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"version (\d+)\.(\d+)", out.stdout + out.stderr)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


#: fields of receivers.yml newer than Debian 12's Alertmanager 0.25, with the version that added them
NEWER = {"msteamsv2_configs": (0, 28), "webhook_url_file": (0, 26)}


def checkable_config(amtool, tmp_path) -> Path:
    """receivers.yml as this amtool can read it: whole from 0.28 on; before that, without the receiver
    integrations it does not know yet — after checking that amtool's complaints name exactly those."""
    version = amtool_version(amtool)
    if version >= (0, 28):
        return AM_RECEIVERS
    out = subprocess.run([amtool, "check-config", str(AM_RECEIVERS)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    unknown = set(re.findall(r"field (\w+) not found", out.stdout + out.stderr))
    assert unknown and unknown <= {k for k, v in NEWER.items() if version < v}, out.stdout + out.stderr
    doc = yaml.safe_load(AM_RECEIVERS.read_text())
    for r in doc["receivers"]:
        r.pop("msteamsv2_configs", None)
        if version < (0, 26):
            r.pop("discord_configs", None)
    path = tmp_path / "receivers-as-readable.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_alertmanager_receivers_pass_amtool(amtool, tmp_path):
    path = checkable_config(amtool, tmp_path)
    out = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 receivers" in out.stdout and "1 inhibit rules" in out.stdout
    text = AM_RECEIVERS.read_text()
    assert not re.search(r"(routing_key|api_key|auth_password|webhook_url|api_url):\s*[^/\s]", text.replace(
        "api_url: https://api.eu.opsgenie.com/", "")), "a secret written into the example"


def test_both_paths_route_every_built_in_alert_to_the_same_places(amtool, tmp_path, monkeypatch):
    path = checkable_config(amtool, tmp_path)
    doc = yaml.safe_load(AM_RECEIVERS.read_text())
    integrations = {r["name"]: {AM_TYPES[k] for k in r if k in AM_TYPES} for r in doc["receivers"]}
    assert set().union(*integrations.values()) == set(AM_TYPES.values())  # every receiver type is configured
    for k, v in EXAMPLE_ENV.items():
        monkeypatch.setenv(k, v)
    ours = load_config(EXAMPLE)
    types = {n.name: n.type for n in ours.notifiers}
    assert sorted(types.values()) == sorted(AM_TYPES.values())
    for rule in ours.rules:
        labels = {"alertname": rule.name, "severity": rule.severity, "run": "r"}
        res = subprocess.run([amtool, "config", "routes", "test", f"--config.file={path}",
                              *(f"{k}={v}" for k, v in labels.items())], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        theirs = set().union(*(integrations[name] for name in res.stdout.strip().split(",")))
        mine = {types[n] for n in route(ours.routes, labels)[0]}
        assert mine == theirs, (rule.name, rule.severity)


def test_parse_routes_without_notifiers_configured_says_so():
    with pytest.raises(AlertConfigError, match="configured: none"):
        parse_routes([{"notifiers": ["slack"]}], [])
    assert parse_notifier({"type": "discord", "url_env": "X", "api_url": "http://127.0.0.1:1"}, "n", 1).api_url


def test_receivers_yml_names_every_alert_of_a_group_of_two(alertmanager_bin, tmp_path):
    """Finding: with `group_by: [run]` two critical alerts of one run are one group; templates built on
    .CommonLabels/.CommonAnnotations lost both names. A real Alertmanager renders receivers.yml (with the
    0.25 edits its header describes) and every vendor stand-in must see both alert names, and no empty
    code span for the alert without a fix."""
    from helpers.alertmanager_proc import alertmanager, post_alerts
    from helpers.receiver import AlertReceiver
    from helpers.vendor_receivers import OpsgenieReceiver

    from mfuwatch.alerts.model import rfc3339

    doc = yaml.safe_load(AM_RECEIVERS.read_text())
    doc["route"].update(group_wait="1s", group_interval="1s")
    with PagerDutyReceiver(PD_KEY) as pd, OpsgenieReceiver("og-key-42") as og, DiscordReceiver() as dc, \
            AlertReceiver() as slack:
        (tmp_path / "pd").write_text(PD_KEY)
        (tmp_path / "og").write_text("og-key-42")
        (tmp_path / "slack").write_text(slack.url)
        for r in doc["receivers"]:
            r.pop("msteamsv2_configs", None)  # 0.28; Debian's 0.25 cannot post to Teams Workflows
            r.pop("email_configs", None)
            for c in r.get("pagerduty_configs", []):
                c.update(routing_key_file=str(tmp_path / "pd"), url=pd.url)
            for c in r.get("opsgenie_configs", []):
                c.update(api_key_file=str(tmp_path / "og"), api_url=og.base + "/")
            for c in r.get("slack_configs", []):
                c["api_url_file"] = str(tmp_path / "slack")
            for c in r.get("discord_configs", []):
                del c["webhook_url_file"]  # 0.26
                c["webhook_url"] = dc.url
        stall = stall_alert()
        xid = {"labels": {"alertname": "GpuXidErrors", "severity": "critical", "run": "amrun", "rank": "0"},
               "annotations": {"summary": "Xid 79 on GPU 0", "runbook_url": "https://r/x"},
               "startsAt": rfc3339(stall.starts_at)}
        alerts = [{"labels": {**dict(stall.labels), "run": "amrun"}, "annotations": dict(stall.annotations),
                   "startsAt": rfc3339(stall.starts_at)}, xid]  # neither has a fix (suggested_apply)
        with alertmanager(alertmanager_bin, yaml.safe_dump(doc, sort_keys=False), tmp_path) as base:
            post_alerts(base, alerts)
            assert pd.wait_for(1, 30) and og.wait_for(1, 30) and dc.wait_for(1, 30) and \
                slack.wait_for_delivered(1, timeout=30), "Alertmanager sent nothing"
        assert pd.violations == [] and og.violations == [] and dc.violations == []
    names = ("TrainingStalled", "GpuXidErrors")
    (trigger,) = [e for e in pd.events() if e["event_action"] == "trigger"]
    assert all(n in trigger["payload"]["summary"] for n in names), trigger["payload"]["summary"]
    assert "Xid 79 on GPU 0" in trigger["payload"]["summary"]
    (create,) = list(og.open.values())
    assert all(n in create["message"] for n in names) and all(n in create["tags"] for n in names), create
    assert "run:amrun" in create["tags"]
    title = slack.delivered[0].json["attachments"][0]["title"]
    assert title == "[FIRING] TrainingStalled, GpuXidErrors · run amrun" or \
        title == "[FIRING] GpuXidErrors, TrainingStalled · run amrun", title
    discord = dc.received[0].json
    text = json.dumps(discord)
    assert all(n in text for n in names) and "``" not in text, discord


def test_alertmanager_yml_slack_title_names_every_alert_of_a_group(alertmanager_bin, tmp_path):
    """The shipped grafana/alertmanager/alertmanager.yml, run by a real Alertmanager: a run with two alerts
    gets one Slack message whose title names both (it was `[FIRING:2]  · run amrun`)."""
    from helpers.alertmanager_proc import alertmanager, post_alerts
    from helpers.receiver import AlertReceiver

    doc = yaml.safe_load((REPO / "grafana" / "alertmanager" / "alertmanager.yml").read_text())
    doc["route"].update(group_wait="1s", group_interval="1s")
    doc["route"]["routes"] = [r for r in doc["route"]["routes"] if r["receiver"] == "slack"]
    doc["receivers"] = [r for r in doc["receivers"] if r["name"] == "slack"]
    with AlertReceiver() as slack:
        (tmp_path / "slack").write_text(slack.url)
        doc["receivers"][0]["slack_configs"][0]["api_url_file"] = str(tmp_path / "slack")
        alerts = [{"labels": {"alertname": n, "severity": "warning", "run": "amrun", "rank": "0"},
                   "annotations": {"summary": f"{n} summary", "runbook_url": "https://r/" + n}}
                  for n in ("MfuLow", "InputStall")]
        with alertmanager(alertmanager_bin, yaml.safe_dump(doc, sort_keys=False), tmp_path) as base:
            post_alerts(base, alerts)
            assert slack.wait_for_delivered(1, timeout=30), "Alertmanager sent nothing"
    title = slack.delivered[0].json["attachments"][0]["title"]
    assert title in ("[FIRING:2] MfuLow, InputStall · run amrun", "[FIRING:2] InputStall, MfuLow · run amrun"), title


def test_docs_name_every_secret_file_the_alertmanager_examples_read():
    """Finding 6: the README created alertmanager-secrets/ without saying which files go there or that they
    must have no trailing newline. Every file the two example configs read is named in docs/alerts.md, next
    to a printf '%s' line that writes it."""
    docs = (REPO / "docs" / "alerts.md").read_text()
    section = docs[docs.index("**Secret files for Alertmanager.**"):]
    section = section[:section.index("Differences between the paths")]
    for name in ("alertmanager.yml", "receivers.yml"):
        text = (REPO / "grafana" / "alertmanager" / name).read_text()
        files = set(re.findall(r"_file: /etc/alertmanager/secrets/(\w+)", text))
        assert files, name
        for f in files:
            assert f"`{f}`" in section, (name, f)
            assert re.search(r"printf '%s' \"\$\w+\" +> \"\$d/" + f + '"', section), (name, f)
    assert "Secret files for Alertmanager" in (REPO / "README.md").read_text()


def test_the_opening_table_of_the_alert_docs_names_every_notifier_type():
    """Finding 16: docs/alerts.md's first table still said Slack, webhook and console only."""
    from mfuwatch.alerts.config import NOTIFIER_TYPES

    row = next(line for line in (REPO / "docs" / "alerts.md").read_text().splitlines()
               if line.startswith("| **in-process engine**"))
    spelled = {"pagerduty": "PagerDuty", "opsgenie": "Opsgenie", "teams": "Teams", "discord": "Discord",
               "email": "email", "slack": "Slack", "webhook": "webhook", "console": "console"}
    assert set(spelled) == set(NOTIFIER_TYPES)
    notifies = row.split("|")[4]
    assert all(spelled[t] in notifies for t in NOTIFIER_TYPES), notifies


def test_check_shows_where_each_notifier_sends_and_warns_about_urls_without_their_credential(
        tmp_path, monkeypatch, capsys):
    """Findings 10 and 11: `notifier email (email)` said nothing of host, TLS or recipients, api_url
    overrides were not shown, route[0] without matchers read `every other alert`; a Teams URL without
    sig= or a Discord URL without its token passed check, and the first page got 401/404."""
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.setenv("MFUWATCH_TEST_PD_KEY", PD_KEY)
    monkeypatch.setenv("MFUWATCH_TEST_TEAMS_URL", "https://prod.westus.logic.azure.com/workflows/x/triggers/"
                       "manual/paths/invoke?api-version=1")
    monkeypatch.setenv("MFUWATCH_TEST_DISCORD_URL", "https://discord.com/api/webhooks/123")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"notifiers": [
        {"type": "email", "smtp_host": "smtp.example.org", "tls": "tls", "from": "m@example.org",
         "to": ["a@example.org", "b@example.org"]},
        {"type": "pagerduty", "routing_key_env": "MFUWATCH_TEST_PD_KEY", "api_url": "https://u:pw@pd-proxy.internal/x"},
        {"type": "teams", "url_env": "MFUWATCH_TEST_TEAMS_URL"},
        {"type": "discord", "url_env": "MFUWATCH_TEST_DISCORD_URL"}],
        "routes": [{"notifiers": ["email", "pagerduty", "teams", "discord"]}]}))
    assert main(["check", "--config", str(cfg)]) == 0
    cap = capsys.readouterr()
    assert "notifier email (email) smtp.example.org:465 tls from m@example.org to a@example.org, " \
        "b@example.org" in cap.out
    assert "notifier pagerduty (pagerduty) api_url https://pd-proxy.internal/x, routing key from " \
        "$MFUWATCH_TEST_PD_KEY" in cap.out and "pw" not in cap.out
    assert "route[0] every alert -> email, pagerduty, teams, discord" in cap.out
    assert "notifier teams: the Workflows URL from env MFUWATCH_TEST_TEAMS_URL has no sig= parameter" in cap.err
    assert "notifier discord: the webhook URL from env MFUWATCH_TEST_DISCORD_URL does not end in " \
        "/api/webhooks/<id>/<token>" in cap.err
    assert "logic.azure.com" not in cap.out + cap.err and "discord.com" not in cap.out + cap.err
    monkeypatch.setenv("MFUWATCH_TEST_TEAMS_URL", EXAMPLE_ENV["MFUWATCH_TEAMS_WORKFLOW_URL"])
    monkeypatch.setenv("MFUWATCH_TEST_DISCORD_URL", EXAMPLE_ENV["MFUWATCH_DISCORD_WEBHOOK_URL"])
    assert main(["check", "--config", str(cfg)]) == 0
    assert "sig=" not in capsys.readouterr().err  # a whole URL: no warning
