"""Delivery through a receiver outage and at close: no page lost, none left open, none duplicated.

The engine runs on a fake clock (30 s of alert time pass while the receiver is
down) and the notifier's backoff is shortened to 10–100 ms, so the test takes a
few seconds of wall time. The receiver is a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import json
import time

from helpers.net import free_port
from helpers.receiver import AlertReceiver

from mfuwatch.agent.schema import GpuHealth
from mfuwatch.alerts import AlertEngine


def _engine(port, run_info, clock, monkeypatch, events):
    monkeypatch.setenv("MFUWATCH_TEST_OUTAGE_URL", f"http://127.0.0.1:{port}/hook")
    fast = {"for": "0s", "cooldown": "0s", "severity": "critical"}
    cfg = {"notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_OUTAGE_URL", "backoff": "10ms",
                          "max_backoff": "100ms"}],
           "evaluation_interval": "1h",  # the test evaluates by hand, on its clock
           "rules": {"GpuMemoryPressure": fast, "GpuThrottling": {**fast, "reasons": ["hw_slowdown"]}}}
    return AlertEngine.from_config(cfg, run_info=run_info, clock=clock, on_event=events.append).start()


def _last_state(rx):
    """alertname -> status in the newest delivered body that mentions it."""
    last = {}
    for r in rx.delivered:
        for a in r.json["alerts"]:
            last[a["labels"]["alertname"]] = a["status"]
    return last


def test_thirty_second_outage_loses_no_page(run_info, clock, monkeypatch):
    port = free_port()
    events = []
    engine = _engine(port, run_info, clock, monkeypatch, events)
    fired = set()
    for second in range(30):  # 30 s of alert time with nobody listening
        mem = 99.0 if (second // 2) % 2 == 0 else 10.0
        throttled = (second // 5) % 2 == 1
        engine.observe_gpu(GpuHealth(timestamp=clock(), memory_used_bytes=mem, memory_total_bytes=100.0,
                                     clock_event_reasons={"hw_slowdown": throttled}))
        engine.evaluate()
        fired |= {n for n in ("GpuMemoryPressure", "GpuThrottling") if engine.state(n) == "firing"}
        clock.advance(1.0)
        time.sleep(0.03)
    transitions = len(events)
    assert transitions >= 18 and fired == {"GpuMemoryPressure", "GpuThrottling"}
    truth = {n: ("firing" if engine.state(n) == "firing" else "resolved") for n in fired}
    with AlertReceiver(port=port) as rx:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (_last_state(rx) != truth or engine.workers[0].pending()):
            time.sleep(0.05)
        assert _last_state(rx) == truth  # the receiver ends on the run's real state
        assert set(_last_state(rx)) == fired  # every alert that fired during the outage reached it
        lost = engine.close(timeout=5.0)
        assert lost == []
        time.sleep(0.2)
        bodies = [r.body for r in rx.delivered]
        final = _last_state(rx)
    assert final == {n: "resolved" for n in fired}  # close() resolved what was still firing ("run ended")
    assert len(bodies) == len(set(bodies))  # no duplicate deliveries
    end = rx.delivered[-1].json
    if truth != final:  # something was still firing at close: the last message says why it ended
        assert any(a["annotations"].get("resolved_reason") == "run ended" for a in end["alerts"])
    labels = {"run": "run-a", "rank": "0", "sink": "webhook"}
    get = engine.registry.get_sample_value
    assert get("mfuwatch_notifications_total", {**labels, "outcome": "dropped"}) == 0
    assert get("mfuwatch_notifications_total", {**labels, "outcome": "failed"}) == 0
    assert get("mfuwatch_notifications_total", {**labels, "outcome": "superseded"}) >= 1


def test_close_resolves_firing_alerts_with_run_ended(receiver, run_info, clock, monkeypatch):
    events = []
    engine = _engine(receiver.port, run_info, clock, monkeypatch, events)
    engine.observe_gpu(GpuHealth(timestamp=clock(), memory_used_bytes=99.0, memory_total_bytes=100.0))
    engine.evaluate()
    assert receiver.wait_for_delivered(1, timeout=10)
    assert receiver.delivered[0].json["status"] == "firing"
    assert engine.close(timeout=5.0) == []
    assert receiver.wait_for_delivered(2, timeout=10)
    last = receiver.delivered[-1].json
    assert last["status"] == "resolved"
    (alert,) = last["alerts"]
    assert alert["labels"]["alertname"] == "GpuMemoryPressure"
    assert alert["annotations"]["resolved_reason"] == "run ended"
    assert alert["endsAt"] != "0001-01-01T00:00:00Z"
    resolved = [e for e in events if e["status"] == "resolved"]
    assert len(resolved) == 1 and resolved[0]["reason"] == "run ended"  # the timeline closes it too
    assert json.dumps(events)  # records stay JSON-ready


def test_close_reports_what_it_could_not_deliver(run_info, clock, monkeypatch, caplog):
    engine = _engine(free_port(), run_info, clock, monkeypatch, [])  # receiver never comes up
    engine.observe_gpu(GpuHealth(timestamp=clock(), memory_used_bytes=99.0, memory_total_bytes=100.0))
    engine.evaluate()
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="mfuwatch.alerts"):
        lost = engine.close(timeout=0.5)
    assert time.monotonic() - t0 < 10.0  # bounded (a hang would be the retry loop: minutes), loose for a loaded CI
    engine.workers[0]._thread.join(5)
    # the firing state was superseded by close's resolved state, which could not be delivered
    assert len(lost) == 1 and "GpuMemoryPressure (resolved)" in lost[0] and lost[0].startswith("webhook: resolved")
    assert any("dropped at close" in r.getMessage() for r in caplog.records)
    assert "127.0.0.1" not in caplog.text  # the URL is a secret


def test_a_delivery_after_failures_is_concluded_in_the_log(receiver, run_info, clock, monkeypatch, caplog):
    from helpers.receiver import Reply

    receiver.script(Reply(503), Reply(503))
    engine = _engine(receiver.port, run_info, clock, monkeypatch, [])
    with caplog.at_level("INFO", logger="mfuwatch.alerts"):
        engine.observe_gpu(GpuHealth(timestamp=clock(), memory_used_bytes=99.0, memory_total_bytes=100.0))
        engine.evaluate()
        assert receiver.wait_for_delivered(1, timeout=10)
        engine.close(timeout=5)
    done = [r.getMessage() for r in caplog.records if "delivered" in r.getMessage()]
    assert any("after 2 retries" in m and "GpuMemoryPressure" in m for m in done), done
