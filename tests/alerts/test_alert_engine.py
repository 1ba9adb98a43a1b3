"""alerts/engine.py: pending → firing → resolved, flapping, repeat, cool-down, inhibition, silences, ranks.

The policy tests drive the engine with a fake clock and call ``evaluate()`` directly,
capturing what it hands to the notifier queues; the watchdog test uses real threads,
a real clock and a real HTTP receiver while the "training loop" is blocked.
"""

from __future__ import annotations

import logging
import threading

import pytest
from prometheus_client import CollectorRegistry

from mfuwatch.agent.schema import GpuHealth, StepMeasurement, WindowMeasurement
from mfuwatch.alerts import AlertEngine
from tests.helpers.capture_notifier import Capture


def step(mfu=0.5, i=1):
    return StepMeasurement(step=i, steps=1, timestamp=0.0, step_time_seconds=1.0, tokens=1, tokens_per_second=1.0,
                           model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0, mfu=mfu)


def engine_with(cfg, run_info, clock, **kw):
    events = []
    registry = CollectorRegistry()
    e = AlertEngine.from_config(cfg, run_info=run_info, registry=registry, on_event=events.append, clock=clock, **kw)
    cap = Capture()
    e.workers = [cap]
    return e, cap, events, registry


ONLY_MFU = {"use_default_rules": False, "inhibit_rules": [],
            "rules": {"MfuLow": {"expr": "mfu", "op": "<", "threshold": 0.25, "for": "10m", "cooldown": "30m",
                                 "severity": "warning", "annotations": {
                "summary": "MFU is {value:pct} on run {labels.run} rank {labels.rank}, below {threshold:pct} for {for}"}}}}


def test_pending_then_firing_after_for_and_flapping_sends_nothing(run_info, clock):
    e, cap, events, _ = engine_with(ONLY_MFU, run_info, clock)
    e.observe_step(step(0.1))
    e.evaluate()
    assert e.state("MfuLow") == "pending"
    clock.advance(300)
    e.evaluate()
    e.observe_step(step(0.5))  # clears before `for` (10 min) has passed
    clock.advance(60)
    e.evaluate()
    assert e.state("MfuLow") == "inactive"
    e.observe_step(step(0.1))
    e.evaluate()  # pending again: the `for` clock restarts here
    clock.advance(540)
    e.evaluate()
    assert e.state("MfuLow") == "pending" and cap.sent == [] and events == []
    clock.advance(60)  # 600 s since the second crossing
    e.evaluate()
    assert e.state("MfuLow") == "firing"
    assert cap.alerts() == [("MfuLow", "firing")]
    a = cap.sent[0].alerts[0]
    assert a.value == 0.1 and a.threshold == 0.25 and a.starts_at == clock()
    assert a.annotations["summary"] == "MFU is 10% on run run-a rank 0, below 25% for 10m"


def test_resolved_notification_and_timeline_records(run_info, clock):
    e, cap, events, registry = engine_with(ONLY_MFU, run_info, clock)
    labels = {"run": "run-a", "rank": "0", "alertname": "MfuLow", "severity": "warning"}
    assert registry.get_sample_value("mfuwatch_alerts_firing", labels) == 0.0
    e.observe_step(step(0.1))
    e.evaluate()
    clock.advance(600)
    e.evaluate()
    fired_at = clock()
    assert registry.get_sample_value("mfuwatch_alerts_firing", labels) == 1.0
    clock.advance(120)
    e.observe_step(step(0.3))
    e.evaluate()
    assert registry.get_sample_value("mfuwatch_alerts_firing", labels) == 0.0
    assert cap.alerts() == [("MfuLow", "firing"), ("MfuLow", "resolved")]
    resolved = cap.sent[1].alerts[0]
    assert resolved.starts_at == fired_at and resolved.ends_at == clock() and cap.sent[1].status == "resolved"
    assert [ev["status"] for ev in events] == ["firing", "resolved"]
    assert set(events[0]) == {"kind", "alertname", "status", "severity", "timestamp", "summary", "labels",
                              "annotations"}
    assert events[0]["kind"] == "alert" and events[0]["timestamp"] == fired_at
    assert events[0]["labels"] == {"alertname": "MfuLow", "severity": "warning", "run": "run-a", "rank": "0",
                                   "host": "node7"}


def test_repeat_interval(run_info, clock):
    cfg = {**ONLY_MFU, "repeat_interval": "1h"}
    cfg["rules"] = {"MfuLow": {**ONLY_MFU["rules"]["MfuLow"], "for": "0s"}}
    e, cap, _, _ = engine_with(cfg, run_info, clock)
    e.observe_step(step(0.1))
    e.evaluate()
    for minutes, expected in ((30, 1), (29, 1), (1, 2), (59, 2), (1, 3)):
        clock.advance(60 * minutes)
        e.evaluate()
        assert len(cap.sent) == expected, minutes
    assert all(n.alerts[0].status == "firing" for n in cap.sent)


def test_cooldown_holds_a_refire_after_resolved(run_info, clock):
    cfg = dict(ONLY_MFU)
    cfg["rules"] = {"MfuLow": {**ONLY_MFU["rules"]["MfuLow"], "for": "0s", "cooldown": "30m"}}
    e, cap, events, _ = engine_with(cfg, run_info, clock)
    e.observe_step(step(0.1))
    e.evaluate()
    clock.advance(60)
    e.observe_step(step(0.5))
    e.evaluate()
    assert cap.alerts() == [("MfuLow", "firing"), ("MfuLow", "resolved")]
    clock.advance(300)
    e.observe_step(step(0.1))
    e.evaluate()  # fires again 5 min after the resolved notification: held
    assert e.state("MfuLow") == "firing" and len(cap.sent) == 2
    assert [ev["status"] for ev in events] == ["firing", "resolved", "firing"]  # the timeline still sees it
    clock.advance(60 * 24)
    e.evaluate()
    assert len(cap.sent) == 2
    clock.advance(60 * 1)  # 30 min after the resolved notification
    e.evaluate()
    assert cap.alerts()[2:] == [("MfuLow", "firing")]


def test_stalled_run_inhibits_low_mfu(run_info, clock):
    e, cap, _, _ = engine_with({"rules": {"MfuLow": {"for": "0s"}}}, run_info, clock)  # default inhibit rules
    e.observe_step(step(0.1))
    e.evaluate()
    assert cap.alerts() == [("MfuLow", "firing")]
    clock.advance(301)  # no step for > 300 s
    e.evaluate()
    assert e.state("TrainingStalled") == "firing" and e.state("MfuLow") == "firing"
    # the new notification carries the stall and leaves MfuLow out (inhibited)
    assert [a.name for a in cap.sent[1].alerts] == ["TrainingStalled"]
    e.observe_step(step(0.1))  # the loop moves again, MFU still low
    e.evaluate()
    assert [(a.name, a.status) for a in cap.sent[2].alerts] == [("MfuLow", "firing"), ("TrainingStalled", "resolved")]


def test_stalled_only_inhibits_when_source_fires(run_info, clock):
    cfg = {"rules": {"MfuLow": {"for": "0s"}, "TrainingStalled": {"threshold": 100}}}
    e, cap, _, _ = engine_with(cfg, run_info, clock)
    e.observe_step(step(0.1))
    clock.advance(50)
    e.evaluate()
    assert cap.alerts() == [("MfuLow", "firing")]


def test_silence_by_matchers_until_a_time(run_info, clock):
    until = clock() + 3600
    cfg = {"rules": {"MfuLow": {"for": "0s"}, "MemoryBoundDominant": {"threshold": 0.4, "for": "0s"}},
           "silences": [{"matchers": ['alertname="MfuLow"', 'run=~"run-.*"'], "until": until, "comment": "known"}]}
    e, cap, _, _ = engine_with(cfg, run_info, clock)
    e.observe_step(step(0.1))
    e.observe_window(WindowMeasurement(step=1, timestamp=0, steps=1, wall_seconds=1, busy_seconds=1,
                                       breakdown={"idle": 0.0}, memory_bound_share=0.7))
    e.evaluate()
    assert e.state("MfuLow") == "firing"
    assert cap.alerts() == [("MemoryBoundDominant", "firing")]  # MfuLow silenced
    clock.advance(1800)
    e.observe_step(step(0.1))
    e.evaluate()
    assert len(cap.sent) == 1
    clock.advance(1800)  # the silence ends
    e.observe_step(step(0.1))
    e.evaluate()
    assert sorted(a.name for a in cap.sent[1].alerts) == ["MemoryBoundDominant", "MfuLow"]


def test_alerts_of_one_run_are_grouped_into_one_notification(run_info, clock):
    e, cap, _, _ = engine_with({"rules": {"MfuLow": {"for": "0s"}, "GpuMemoryPressure": {"for": "0s"}}},
                               run_info, clock)
    e.observe_step(step(0.1))
    e.observe_gpu(GpuHealth(timestamp=0, memory_used_bytes=99.0, memory_total_bytes=100.0))
    e.evaluate()
    assert len(cap.sent) == 1
    n = cap.sent[0]
    assert sorted(a.name for a in n.alerts) == ["GpuMemoryPressure", "MfuLow"]
    assert n.group_labels == {"run": "run-a"} and n.group_key == '{}:{run="run-a"}'


@pytest.mark.parametrize("rank, all_ranks, notifies", [(0, False, True), (3, False, False), (3, True, True)])
def test_notifications_only_from_rank_zero_by_default(run_info, clock, rank, all_ranks, notifies):
    run_info.rank = rank
    events = []
    e = AlertEngine.from_config({"notify_from_all_ranks": all_ranks, "rules": {"MfuLow": {"for": "0s"}}},
                                run_info=run_info, on_event=events.append, clock=clock)
    assert e.notifying is notifies and (len(e.workers) == 1) is notifies  # the default console notifier
    cap = Capture()
    if notifies:
        e.workers = [cap]
    e.observe_step(step(0.1))
    e.evaluate()
    assert [ev["alertname"] for ev in events] == ["MfuLow"]  # every rank records the transition
    assert events[0]["labels"]["rank"] == str(rank)
    assert (len(cap.sent) == 1) is notifies


def test_observe_never_raises_and_counts_errors(run_info, clock, caplog):
    e, _, _, _ = engine_with(ONLY_MFU, run_info, clock)
    caplog.set_level(logging.WARNING, logger="mfuwatch.alerts")
    e.observe_gpu(object())  # not a GpuHealth
    e.observe_gpu(None)
    e.observe_step(step("not a number"))
    e.evaluate()  # a bad MFU value is not a crash either
    assert e.errors == 3 and e.state("MfuLow") == "inactive"
    assert sum("observe_gpu failed" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_swallowed_errors_reach_on_error(run_info, clock):
    seen = []
    e = AlertEngine.from_config(None, run_info=run_info, clock=clock,
                                on_error=lambda component, exc: seen.append((component, type(exc).__name__)))
    e.observe_window("not a window")  # stored as is; evaluating it fails
    e.evaluate()
    e.observe_gpu(42)
    assert ("alerts", "AttributeError") in seen and len(seen) == e.errors >= 2


def test_broken_on_event_does_not_stop_alerting(run_info, clock):
    def boom(record):
        raise RuntimeError("disk full")

    e = AlertEngine.from_config({"rules": {"MfuLow": {"for": "0s"}}}, run_info=run_info, on_event=boom, clock=clock)
    cap = Capture()
    e.workers = [cap]
    e.observe_step(step(0.1))
    e.evaluate()
    assert cap.alerts() == [("MfuLow", "firing")] and e.errors == 1


def test_watchdog_fires_while_the_loop_is_blocked(run_info, receiver, monkeypatch):
    monkeypatch.setenv("MFUWATCH_TEST_HOOK", receiver.url)
    cfg = {"evaluation_interval": "1h", "watchdog_interval": "50ms", "notifiers": [
        {"type": "webhook", "url_env": "MFUWATCH_TEST_HOOK", "backoff": "10ms"}],
        "rules": {"TrainingStalled": {"threshold": 0.3}}}
    engine = AlertEngine.from_config(cfg, run_info=run_info).start()
    blocked, release = threading.Event(), threading.Event()

    def training_loop():
        engine.observe_step(step(0.5, 1))
        blocked.set()
        release.wait(30)  # a hung collective / data loader
        engine.observe_step(step(0.5, 2))

    t = threading.Thread(target=training_loop, daemon=True)
    t.start()
    try:
        assert blocked.wait(5)
        assert receiver.wait_for_delivered(1, timeout=15), "no TrainingStalled notification while blocked"
        assert t.is_alive()  # the loop is still blocked: the watchdog thread did this
        body = receiver.delivered[0].json
        assert body["status"] == "firing" and body["alerts"][0]["labels"]["alertname"] == "TrainingStalled"
        release.set()
        t.join(5)
        assert receiver.wait_for_delivered(2, timeout=15)
        assert receiver.delivered[1].json["alerts"][0]["status"] == "resolved"
    finally:
        release.set()
        engine.close(timeout=2.0)
    assert engine.registry.get_sample_value(
        "mfuwatch_notifications_total", {"run": "run-a", "rank": "0", "sink": "webhook", "outcome": "sent"}) == 2.0
