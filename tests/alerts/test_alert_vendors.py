"""PagerDuty, Opsgenie, Microsoft Teams and Discord notifiers against local stand-ins that check each vendor's
documented format (tests/helpers/vendor_receivers.py): firing, resolved, grouped and oversized alerts; the
trigger/resolve pairing on one dedup_key or alias; auth headers; outages, 5xx and 429 for each; no secret in
logs, metrics or errors. Backoffs are 10-100 ms, so the file runs in a few seconds.
"""

from __future__ import annotations

import collections
import json
import logging
import time

import pytest
from helpers.alertmanager_proc import alertmanager, post_alerts
from helpers.net import free_port
from helpers.receiver import Reply
from helpers.vendor_receivers import DiscordReceiver, OpsgenieReceiver, PagerDutyReceiver, TeamsReceiver
from prometheus_client import generate_latest
from test_alert_secrets import PATH_SECRET, TOKEN, assert_clean
from test_alert_slack import APPLY, mb_alert

from mfuwatch.agent.schema import GpuHealth
from mfuwatch.alerts import AlertEngine
from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.model import AlertSnapshot, Notification, rfc3339
from mfuwatch.alerts.notifiers import build_notifier
from mfuwatch.alerts.notifiers.base import NotifierWorker

PD_KEY = "T0SECRETXXZzSecretTokenPart42abc"  # 32 characters, as a PagerDuty integration key
FAST = {"backoff": "10ms", "max_backoff": "100ms"}


def stall_alert(**over):
    labels = {"alertname": "TrainingStalled", "severity": "critical", "run": "run-a", "rank": "0", "host": "node7"}
    base = dict(name="TrainingStalled", status="firing", severity="critical", labels=labels,
                annotations={"summary": "No training step for 12m on run run-a rank 0",
                             "waiting_at": "all_reduce (torch/distributed/distributed_c10d.py:2501)",
                             "runbook_url": "https://example.org/runbooks/TrainingStalled.md"},
                starts_at=1_700_000_100.0, ends_at=None, value=720.0, threshold=600.0, op=">", unit="seconds",
                context={"hang": {"where": "all_reduce (torch/distributed/distributed_c10d.py:2501)",
                                  "frames": ["all_reduce (torch/distributed/distributed_c10d.py:2501)",
                                             "train_step (train.py:88)"]}})
    base.update(over)
    return AlertSnapshot(**base)


def resolved(a: AlertSnapshot, reason: str = "run ended") -> AlertSnapshot:
    return AlertSnapshot(**{**a.__dict__, "status": "resolved", "ends_at": a.starts_at + 750.0,
                            "annotations": {**a.annotations, "resolved_reason": reason}})


def group(*alerts) -> Notification:
    return Notification({"run": "run-a"}, tuple(alerts), external_url="http://127.0.0.1:9478/metrics")


def huge_alerts(n: int):
    """``n`` alerts with every string far over every vendor's limit; the apply line is normal."""
    long = "x" * 20_000
    sugg = [{"kernel": "rms_norm", "title": long, "apply": APPLY, "expected_gain": 0.123, "kind": "bundled",
             "ops": []}]
    return tuple(mb_alert(name=f"Alert{i}", annotations={"summary": "S" + long, "runbook_url": "https://e/" + long,
                                                          "description": long},
                          labels={"alertname": f"Alert{i}", "severity": "info", "run": "run-a", "rank": str(i),
                                  "host": "h" + long},
                          context={"top_ops": [], "suggestions": sugg}) for i in range(n))


def assert_fix_lines_whole(obj) -> None:
    """Every string of the payload that starts the apply line holds all of it (never half a line)."""
    def strings(o):
        if isinstance(o, str):
            yield o
        elif isinstance(o, dict):
            for v in o.values():
                yield from strings(v)
        elif isinstance(o, list):
            for v in o:
                yield from strings(v)
    for s in strings(obj):
        at = s.find("mfuwatch.kernels.patch(")
        while at >= 0:
            assert s[at:at + len(APPLY)] == APPLY, s[at:at + 80]
            at = s.find("mfuwatch.kernels.patch(", at + 1)


# -- one factory per vendor: (receiver, notifier spec) -------------------------------------------------------------

def pd_setup(monkeypatch, port):
    monkeypatch.setenv("MFUWATCH_TEST_PD_KEY", PD_KEY)
    rx = PagerDutyReceiver(PD_KEY, port=port)
    return rx, {"type": "pagerduty", "routing_key_env": "MFUWATCH_TEST_PD_KEY",
                "api_url": f"http://127.0.0.1:{rx.port}/v2/enqueue"}


def og_setup(monkeypatch, port):
    monkeypatch.setenv("MFUWATCH_TEST_OG_KEY", TOKEN)
    rx = OpsgenieReceiver(TOKEN, port=port)
    return rx, {"type": "opsgenie", "api_key_env": "MFUWATCH_TEST_OG_KEY", "api_url": f"http://127.0.0.1:{rx.port}"}


def teams_setup(monkeypatch, port):
    rx = TeamsReceiver(port=port)
    monkeypatch.setenv("MFUWATCH_TEST_TEAMS_URL", rx.url)
    return rx, {"type": "teams", "url_env": "MFUWATCH_TEST_TEAMS_URL"}


def discord_setup(monkeypatch, port):
    rx = DiscordReceiver(port=port)
    monkeypatch.setenv("MFUWATCH_TEST_DISCORD_URL", rx.url)
    return rx, {"type": "discord", "url_env": "MFUWATCH_TEST_DISCORD_URL"}


VENDORS = {"pagerduty": pd_setup, "opsgenie": og_setup, "teams": teams_setup, "discord": discord_setup}


def worker(spec, **over):
    cfg = parse_notifier({**spec, **FAST, **over}, "notifiers[0]", 100)
    counts = collections.Counter()
    notifier = build_notifier(cfg)
    return NotifierWorker(notifier, lambda s, o: counts.update([o])), notifier, counts


def run(spec, *notifications, timeout=10.0, **over):
    w, notifier, counts = worker(spec, **over)
    w.start()
    for n in notifications:
        w.submit(n)
    assert w.close(time.monotonic() + timeout)
    return notifier, counts


# -- PagerDuty ---------------------------------------------------------------------------------------------------

def test_pagerduty_trigger_and_resolve_pair_on_the_fingerprint(monkeypatch):
    rx, spec = pd_setup(monkeypatch, port=free_port())
    with rx:
        mb, stall = mb_alert(), stall_alert()
        run(spec, group(mb, stall), group(resolved(mb), resolved(stall)))
        assert rx.violations == []
        events = rx.events()
    assert [(e["event_action"], e["dedup_key"]) for e in events] == [
        ("trigger", mb.fingerprint), ("trigger", stall.fingerprint),
        ("resolve", mb.fingerprint), ("resolve", stall.fingerprint)]
    assert rx.open == {} and rx.unpaired_resolves == []  # every incident opened was closed, none closed blind
    t_mb, t_stall = events[0], events[1]
    assert t_mb["payload"]["severity"] == "info" and t_stall["payload"]["severity"] == "critical"
    assert t_stall["payload"]["source"] == "node7/run-a/rank0"
    # the summary names the run already: not repeated (it was "TrainingStalled on run run-a rank 0: ... run-a rank 0")
    assert t_stall["payload"]["summary"] == "TrainingStalled: No training step for 12m on run run-a rank 0"
    d = t_mb["payload"]["custom_details"]
    assert d["fix_kernel"] == "rms_norm" and d["fix_apply"] == APPLY and d["fix_expected_gain"] == "12.3% of step time"
    assert t_stall["payload"]["custom_details"]["waiting_at"].startswith("all_reduce")
    assert {link["text"]: link["href"] for link in t_mb["links"]} == {
        "Runbook": "https://example.org/runbooks/MemoryBoundDominant.md",
        "Grafana: run run-a": "http://localhost:3000/d/mfuwatch-training-mfu?var-run=run-a&var-rank=0"}
    assert t_mb["payload"]["timestamp"] == "2023-11-14T22:13:20.000Z"
    assert all(r.headers.get("Authorization") is None for r in rx.received)  # the key is in the body only


def test_pagerduty_oversized_group_and_severity_map(monkeypatch):
    rx, spec = pd_setup(monkeypatch, port=free_port())
    with rx:
        run({**spec, "severity_map": {"warning": "error"}}, group(*huge_alerts(30)),
            group(stall_alert(severity="warning", labels={**stall_alert().labels, "severity": "warning"})))
        assert rx.violations == []
        events = rx.events()
    assert len(events) == 31  # one event per alert, none dropped for size
    for e in events[:30]:
        s = e["payload"]["summary"]
        assert len(s) == 1024 and s.endswith("…")
        assert_fix_lines_whole(e)
        assert len(json.dumps(e).encode()) <= 512 * 1024
    assert events[30]["payload"]["severity"] == "error"


# -- Opsgenie ----------------------------------------------------------------------------------------------------

def test_opsgenie_create_and_close_by_alias_with_the_geniekey(monkeypatch):
    rx, spec = og_setup(monkeypatch, port=free_port())
    with rx:
        mb, stall = mb_alert(), stall_alert()
        run(spec, group(mb, stall), group(resolved(mb), resolved(stall, "preempted")))
        assert rx.violations == []
        got = [(r.path, r.json) for r in rx.delivered]
    assert [p for p, _ in got] == ["/v2/alerts", "/v2/alerts",
                                   f"/v2/alerts/{mb.fingerprint}/close?identifierType=alias",
                                   f"/v2/alerts/{stall.fingerprint}/close?identifierType=alias"]
    assert rx.open == {} and rx.unpaired_closes == []
    create_mb, create_stall = got[0][1], got[1][1]
    assert create_mb["alias"] == mb.fingerprint and create_mb["priority"] == "P5"
    assert create_stall["priority"] == "P1" and create_stall["source"] == "node7/run-a/rank0"
    assert create_mb["details"]["fix_apply"] == APPLY and create_mb["details"]["fix_kernel"] == "rms_norm"
    assert APPLY in create_mb["description"] and "mfuwatch" in create_mb["tags"]
    assert got[3][1]["note"] == "resolved after 12m 30s; preempted"


def test_opsgenie_limits_and_regions(monkeypatch):
    rx, spec = og_setup(monkeypatch, port=free_port())
    with rx:
        run(spec, group(*huge_alerts(3)))
        assert rx.violations == []
        bodies = [r.json for r in rx.delivered]
    assert len(bodies) == 3
    for b in bodies:
        assert len(b["message"]) == 130 and b["message"].endswith("…")
        assert sum(len(k) + len(v) for k, v in b["details"].items()) <= 8000
        assert b["details"]["fix_apply"] == APPLY  # the fix fields are the last to be left out
        assert len(b["description"]) <= 15000
        assert_fix_lines_whole(b)
    monkeypatch.setenv("MFUWATCH_TEST_OG_KEY", TOKEN)
    for region, base in (("eu", "https://api.eu.opsgenie.com"), ("us", "https://api.opsgenie.com")):
        n = build_notifier(parse_notifier({"type": "opsgenie", "api_key_env": "MFUWATCH_TEST_OG_KEY",
                                           "region": region}, "n", 10))
        assert n.requests_for(group(mb_alert()))[0][0] == base + "/v2/alerts"


# -- Teams -------------------------------------------------------------------------------------------------------

def card_texts(card):
    out = []

    def walk(items):
        for el in items:
            if el["type"] == "TextBlock":
                out.append(el["text"])
            elif el["type"] == "FactSet":
                out.extend(f"{f['title']}={f['value']}" for f in el["facts"])
            elif el["type"] == "Container":
                walk(el["items"])
            elif el["type"] == "ActionSet":
                out.extend(f"{a['title']}->{a['url']}" for a in el["actions"])
    walk(card["body"])
    return out


def test_teams_adaptive_card_firing_resolved_and_oversized(monkeypatch):
    rx = TeamsReceiver().start()
    monkeypatch.setenv("MFUWATCH_TEST_TEAMS_URL", rx.url)
    spec = {"type": "teams", "url_env": "MFUWATCH_TEST_TEAMS_URL"}
    try:
        run(spec, group(mb_alert(), stall_alert()), group(resolved(stall_alert())), group(*huge_alerts(40)))
        assert rx.violations == []
        firing, res, huge = rx.delivered
    finally:
        rx.stop()
    texts = card_texts(TeamsReceiver.card(firing))
    assert texts[0] == "[FIRING:2] 2 alerts · run run-a"
    assert f"rms_norm: {APPLY}  (expected gain 12.3% of step time)" in texts
    assert "Run=run-a" in texts and "Value=62% (threshold > 40%)" in texts
    assert "Runbook->https://example.org/runbooks/MemoryBoundDominant.md" in texts
    assert card_texts(TeamsReceiver.card(res))[:2] == ["[RESOLVED] TrainingStalled · run run-a",
                                                       "TrainingStalled (resolved)"]
    assert len(huge.body) <= 28 * 1024
    huge_texts = card_texts(TeamsReceiver.card(huge))
    assert "Alert0 (info)" in huge_texts  # the first alerts are shown, cut; the rest are named
    last = huge_texts[-1]
    assert last.startswith("…and ") and "more: Alert" in last
    assert_fix_lines_whole(huge.json)


# -- Discord -----------------------------------------------------------------------------------------------------

def test_discord_embeds_within_limits_and_overflow_named(monkeypatch):
    rx = DiscordReceiver().start()
    monkeypatch.setenv("MFUWATCH_TEST_DISCORD_URL", rx.url)
    spec = {"type": "discord", "url_env": "MFUWATCH_TEST_DISCORD_URL"}
    many = tuple(mb_alert(name=f"A{i}", labels={**mb_alert().labels, "alertname": f"A{i}"}) for i in range(12))
    try:
        run(spec, group(mb_alert(annotations={"summary": "@everyone look"}), stall_alert()), group(*many),
            group(*huge_alerts(5)))
        assert rx.violations == []
        first, twelve, huge = [r.json for r in rx.delivered]
    finally:
        rx.stop()
    assert first["content"] == "[FIRING:2] 2 alerts · run run-a" and first["allowed_mentions"] == {"parse": []}
    e = first["embeds"][0]
    assert e["title"] == "MemoryBoundDominant (info)" and f"`rms_norm: {APPLY}" in e["description"]
    assert {f["name"]: f["value"] for f in e["fields"]}["Host"] == "node7"
    assert len(twelve["embeds"]) == 10 and twelve["content"].endswith("…and 2 more: A10, A11")
    total = sum(len(x.get("title", "")) + len(x.get("description", "")) + len(x["footer"]["text"])
                + sum(len(f["name"]) + len(f["value"]) for f in x["fields"]) for x in huge["embeds"])
    assert total <= 6000 and 1 <= len(huge["embeds"]) < 5 and "more: " in huge["content"]
    assert_fix_lines_whole(huge)


def test_discord_429_waits_the_retry_after_of_its_body(monkeypatch):
    rx = DiscordReceiver().start()
    monkeypatch.setenv("MFUWATCH_TEST_DISCORD_URL", rx.url)
    rx.script(Reply(429, headers={"Content-Type": "application/json"},
                    body=json.dumps({"message": "You are being rate limited.", "retry_after": 0.3, "global": False})))
    try:
        w, notifier, counts = worker({"type": "discord", "url_env": "MFUWATCH_TEST_DISCORD_URL"}, max_backoff="5s")
        w.start()
        w.submit(group(mb_alert()))
        assert rx.wait_for_delivered(1, timeout=10)  # not closing meanwhile
        assert w.close(time.monotonic() + 5)
        first, second = rx.received
    finally:
        rx.stop()
    assert list(notifier.retry_delays) == [0.3]  # the body's float, not the 10 ms backoff
    assert (first.status, second.status) == (429, 204) and second.at - first.at >= 0.28
    assert counts["sent"] == 1 and counts["retry"] == 1


# -- every vendor: outage, 5xx, 429, 4xx ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(VENDORS))
def test_outage_then_recovery_delivers_once(kind, monkeypatch):
    port = free_port()
    rx, spec = VENDORS[kind](monkeypatch, port=port)
    w, _, counts = worker(spec)
    w.start()
    w.submit(group(mb_alert()))
    time.sleep(0.3)  # connection refused, retried with backoff
    with rx:
        assert rx.wait_for_delivered(1, timeout=10)
        assert w.close(time.monotonic() + 5)
    assert rx.violations == [] and len(rx.received) == 1
    assert counts["sent"] == 1 and counts["retry"] >= 1 and counts["failed"] == 0


@pytest.mark.parametrize("kind", sorted(VENDORS))
def test_5xx_and_429_are_retried_4xx_is_final(kind, monkeypatch):
    port = free_port()
    rx, spec = VENDORS[kind](monkeypatch, port=port)
    ok = rx.default.status
    rx.script(Reply(500), Reply(503), Reply(429), Reply(ok, body=""), Reply(400, body="bad"))
    with rx:
        _, counts = run(spec, group(mb_alert()), Notification({"run": "other"}, (stall_alert(),)))
        statuses = [r.status for r in rx.received]
    assert statuses == [500, 503, 429, ok, 400]  # first notification retried 3 times; the second rejected
    assert counts["retry"] == 3 and counts["sent"] == 1 and counts["failed"] == 1


@pytest.mark.parametrize("kind", sorted(VENDORS))
def test_no_secret_in_logs_metrics_or_errors(kind, monkeypatch, caplog, run_info, clock):
    caplog.set_level(logging.DEBUG)
    port = free_port()
    rx, spec = VENDORS[kind](monkeypatch, port=port)
    secret_url = None
    if kind in ("teams", "discord"):
        secret_url = f"http://127.0.0.1:{port}{rx.path}{PATH_SECRET}"
        rx.path = rx.path.split("?")[0] + PATH_SECRET
        monkeypatch.setenv(spec["url_env"], secret_url)
    rx.script(Reply(500), Reply(404))
    with rx:
        engine = AlertEngine.from_config({"notifiers": [{**spec, **FAST, "name": "vendor"}],
                                          "rules": {"GpuMemoryPressure": {"for": "0s"}}},
                                         run_info=run_info, clock=clock).start()
        engine.observe_gpu(GpuHealth(timestamp=0, memory_used_bytes=99.0, memory_total_bytes=100.0))
        engine.evaluate()
        assert rx.wait_for(2, timeout=10)
        engine.close(timeout=5)
    metrics = generate_latest(engine.registry).decode()
    secrets = [PD_KEY, TOKEN] + ([secret_url, rx.path] if secret_url else [])
    assert_clean(caplog.text + metrics, *secrets)
    assert any("HTTP 500" in r.getMessage() for r in caplog.records)  # the failures were logged, by status only
    monkeypatch.delenv({"pagerduty": "MFUWATCH_TEST_PD_KEY", "opsgenie": "MFUWATCH_TEST_OG_KEY"}.get(
        kind, spec.get("url_env", "")))
    with pytest.raises(ValueError) as info:
        build_notifier(parse_notifier(spec, "notifiers[0]", 10))
    assert "is not set" in str(info.value)
    assert_clean(str(info.value), *secrets)


def test_engine_routes_critical_to_pagerduty_and_close_resolves_it(monkeypatch, run_info, clock):
    pd, pd_spec = pd_setup(monkeypatch, port=free_port())
    dc = DiscordReceiver().start()
    monkeypatch.setenv("MFUWATCH_TEST_DISCORD_URL", dc.url)
    cfg = {"notifiers": [{**pd_spec, **FAST}, {"type": "discord", "url_env": "MFUWATCH_TEST_DISCORD_URL", **FAST}],
           "routes": [{"matchers": ['severity="critical"'], "notifiers": ["pagerduty"]},
                      {"notifiers": ["discord"]}],
           "rules": {"GpuMemoryPressure": {"for": "0s", "severity": "critical"},
                     "GpuThrottling": {"for": "0s", "severity": "warning", "reasons": ["hw_slowdown"]}}}
    with pd:
        try:
            engine = AlertEngine.from_config(cfg, run_info=run_info, clock=clock).start()
            engine.observe_gpu(GpuHealth(timestamp=clock(), memory_used_bytes=99.0, memory_total_bytes=100.0,
                                         clock_event_reasons={"hw_slowdown": True}))
            engine.evaluate()
            assert pd.wait_for_delivered(1, timeout=10) and dc.wait_for_delivered(1, timeout=10)
            assert engine.close(timeout=5) == []  # the run ends: both alerts resolve ("run ended")
            assert pd.wait_for_delivered(2, timeout=10) and dc.wait_for_delivered(2, timeout=10)
        finally:
            dc.stop()
    assert [(e["event_action"], e.get("payload", {}).get("class")) for e in pd.events()] == [
        ("trigger", "GpuMemoryPressure"), ("resolve", None)]
    assert pd.open == {} and pd.violations == [] and dc.violations == []
    titles = [[e["title"] for e in r.json["embeds"]] for r in dc.delivered]
    assert titles == [["GpuThrottling (warning)"], ["GpuThrottling (resolved)"]]
    assert "Ended: run ended" in dc.delivered[1].json["embeds"][0]["description"]


def _post(url, body, headers=None):
    import requests

    return requests.post(url, data=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})},
                         timeout=5).status_code


def test_the_stand_ins_reject_what_the_vendors_document_as_invalid():
    """Each stand-in answers 400 to a request that breaks its documented limits (so a pass above means
    something)."""
    with PagerDutyReceiver(PD_KEY) as pd, OpsgenieReceiver(TOKEN) as og, TeamsReceiver() as tm, \
            DiscordReceiver() as dc:
        assert _post(pd.url, {"routing_key": PD_KEY, "event_action": "trigger", "dedup_key": "k",
                              "payload": {"summary": "s" * 1025, "source": "x", "severity": "fatal"}}) == 400
        assert _post(pd.url, {"routing_key": PD_KEY, "event_action": "resolve", "dedup_key": "k" * 256}) == 400
        assert _post(og.base + "/v2/alerts", {"message": "m" * 131}, {"Authorization": "GenieKey " + TOKEN}) == 400
        assert _post(og.base + "/v2/alerts", {"message": "m"}, {"Authorization": "Bearer " + TOKEN}) == 400
        assert _post(og.base + "/v2/alerts/a/close", {}, {"Authorization": "GenieKey " + TOKEN}) == 400
        assert _post(tm.url, {"type": "message", "attachments": [{"contentType": "application/vnd.microsoft.card.thumbnail",
                                                                  "content": {}}]}) == 400
        assert _post(dc.url, {"content": "c" * 2001}) == 400
        assert _post(dc.url, {"embeds": [{"title": "t", "description": "d" * 4000}, {"description": "d" * 2001}]}) == 400
        # and accept minimal valid ones
        assert _post(pd.url, {"routing_key": PD_KEY, "event_action": "trigger", "dedup_key": "k",
                              "payload": {"summary": "s", "source": "x", "severity": "info"}}) == 202
        assert _post(dc.url, {"content": "hello"}) == 204
    assert len(pd.violations) >= 3 and len(og.violations) >= 3 and tm.violations and len(dc.violations) >= 2


@pytest.mark.parametrize("kind", sorted(VENDORS))
def test_a_notification_that_cannot_be_rendered_fails_alone(kind, monkeypatch, caplog):
    rx, spec = VENDORS[kind](monkeypatch, port=free_port())
    broken = mb_alert(context={"suggestions": [{"kernel": "rms_norm"}]})  # no apply line, no gain: a bug upstream
    with rx, caplog.at_level(logging.WARNING, logger="mfuwatch.alerts"):
        _, counts = run(spec, group(broken), Notification({"run": "other"}, (stall_alert(),)))
        assert len(rx.delivered) == 1 and rx.violations == []  # the next notification still went out
    assert counts["failed"] == 1 and counts["sent"] == 1
    assert any("could not render a notification (KeyError)" in r.getMessage() for r in caplog.records)


def test_the_stand_ins_accept_what_a_real_alertmanager_sends(alertmanager_bin, tmp_path):
    """Alertmanager's own PagerDuty, Opsgenie and Discord integrations pass the stand-ins' checks, firing and
    resolved: the checks describe the vendors' formats, not only this project's notifiers."""
    (tmp_path / "pd").write_text(PD_KEY)
    (tmp_path / "og").write_text(TOKEN)
    with PagerDutyReceiver(PD_KEY) as pd, OpsgenieReceiver(TOKEN) as og, DiscordReceiver() as dc:
        cfg = f"""
route: {{receiver: all, group_by: [run], group_wait: 0s, group_interval: 1s, repeat_interval: 1h}}
receivers:
  - name: all
    pagerduty_configs: [{{url: "{pd.url}", routing_key_file: "{tmp_path / 'pd'}", send_resolved: true}}]
    opsgenie_configs: [{{api_url: "{og.base}/", api_key_file: "{tmp_path / 'og'}", send_resolved: true}}]
    discord_configs: [{{webhook_url: "{dc.url}", send_resolved: true}}]
"""
        a = mb_alert()
        alert = {"labels": dict(a.labels), "annotations": dict(a.annotations), "startsAt": rfc3339(a.starts_at)}
        with alertmanager(alertmanager_bin, cfg, tmp_path) as base:
            post_alerts(base, [alert])
            assert pd.wait_for(1, 30) and og.wait_for(1, 30) and dc.wait_for(1, 30), "Alertmanager sent nothing"
            post_alerts(base, [{**alert, "endsAt": rfc3339(a.starts_at + 60)}])
            assert pd.wait_for(2, 30) and og.wait_for(2, 30) and dc.wait_for(2, 30), "no resolved notification"
        assert pd.violations == [] and og.violations == [] and dc.violations == []
    assert [e["event_action"] for e in pd.events()] == ["trigger", "resolve"] and pd.open == {}
    assert og.open == {} and og.unpaired_closes == []  # Alertmanager also closes by alias
