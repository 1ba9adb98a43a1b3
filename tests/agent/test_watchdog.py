"""The hang watchdog: threshold from the learned median with a floor; the stuck thread's own stack; no kill."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

from mfuwatch.agent import Agent
from mfuwatch.agent.timeline import read_timeline
from mfuwatch.agent.watchdog import HangWatchdog, last_nccl_collective
from tests.helpers.fake_clock import FakeClock


def wait_in_collective(event: threading.Event) -> None:  # the "training thread" blocks here
    event.wait(10)


def test_threshold_is_factor_times_median_with_a_floor():
    clock = FakeClock(100.0)
    w = HangWatchdog(factor=4.0, floor_seconds=1.0, min_steps=3, now=clock)
    assert w.threshold() is None
    for d in (0.1, 0.2, 0.3, 0.25):  # the first boundary only starts the clock
        w.boundary(int(clock.t))
        clock.t += d
    assert w.threshold() == pytest.approx(1.0)  # 4 x median(0.2, 0.3, 0.25) = 1.0 = the floor
    for _ in range(6):
        w.boundary(1)
        clock.t += 2.0
    assert w.threshold() == pytest.approx(8.0)  # median 2.0 now


def test_a_stuck_step_is_reported_once_with_the_training_threads_stack():
    clock = FakeClock(100.0)
    reports, recovered = [], []
    w = HangWatchdog(factor=3.0, floor_seconds=0.5, min_steps=3, now=clock, on_hang=reports.append,
                     on_recover=recovered.append)
    release = threading.Event()
    ready = threading.Event()

    def training():
        for step in range(1, 6):
            w.boundary(step)
            clock.t += 0.1
        ready.set()
        wait_in_collective(release)
        w.boundary(6)

    t = threading.Thread(target=training)
    t.start()
    assert ready.wait(5)
    time.sleep(0.05)
    assert w.check() is None  # 0.1 s into the step: below max(0.5, 3 x 0.1)
    clock.t += 0.6
    report = w.check()
    assert report is not None and reports == [report]
    assert report.step == 5 and report.threshold_seconds == pytest.approx(0.5)
    assert report.where.endswith(" in wait")  # innermost frame: threading.Event.wait / Condition.wait
    assert any("wait_in_collective" in f for f in report.stack)  # the training thread's frames, not ours
    assert w.check() is None  # once per stuck step
    release.set()
    t.join(5)
    assert recovered == [5] and t.is_alive() is False  # nothing was killed: the thread finished its loop


def test_paused_during_a_phase():
    clock = FakeClock(100.0)
    w = HangWatchdog(factor=2.0, floor_seconds=0.1, min_steps=1, now=clock)
    w.boundary(1)
    clock.t += 0.1
    w.boundary(2)
    w.pause()
    clock.t += 100
    assert w.check() is None
    w.resume()  # the step is timed from the phase's end
    assert w.check() is None
    clock.t += 0.3
    assert w.check() is not None


def test_bad_settings_fail_naming_the_field():
    with pytest.raises(ValueError, match="hang_factor"):
        HangWatchdog(factor=1.0)
    with pytest.raises(ValueError, match="hang_floor_seconds"):
        HangWatchdog(floor_seconds=0)


def test_flight_recorder_off_gives_no_collective(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    assert last_nccl_collective() is None


def stuck_in_data_loader(seconds: float) -> None:
    time.sleep(seconds)


def test_agent_records_the_hang_in_timeline_and_metrics(tmp_path):
    timeline = tmp_path / "tl.jsonl"
    agent = Agent(config=dict(exporter=True, port=0, nvml=False, profile_every="off", alerts=False,
                              timeline=str(timeline), flops_per_step=1e9, run="hang", hang_factor=3.0,
                              hang_floor_seconds=0.4))
    for _ in range(8):
        agent.step(tokens=10)
        time.sleep(0.01)
    seen = []

    def scrape_while_stuck():
        time.sleep(1.4)
        seen.append(urllib.request.urlopen(agent.exporter_url, timeout=5).read().decode())

    scraper = threading.Thread(target=scrape_while_stuck)
    scraper.start()
    stuck_in_data_loader(2.0)
    scraper.join()
    agent.step(tokens=10)
    agent.close()
    hangs = [r for r in read_timeline(timeline) if r["kind"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["step"] == 8
    assert "stuck_in_data_loader" in " ".join(hangs[0]["stack"])
    assert [r["step"] for r in read_timeline(timeline) if r["kind"] == "hang_resolved"] == [9]
    line = [ln for ln in seen[0].splitlines() if ln.startswith("mfuwatch_hang_info{")]
    assert len(line) == 1 and 'job="hang"' in line[0] and line[0].endswith(" 1.0")
    assert agent.registry.get_sample_value("mfuwatch_hangs_total", {"run": "hang", "rank": "0"}) == 1
    assert torch.is_tensor(torch.zeros(1))  # the process is alive and well


# -- the in-process TrainingStalled alert says where the training thread waits -------------------------------
def stuck_waiting_for_batch(seconds: float) -> None:  # the training thread's stall in the tests below
    time.sleep(seconds)


def _stall_agent(tmp_path, monkeypatch, rx, **extra):
    monkeypatch.setenv("MFUWATCH_TEST_HOOK", rx.url + "/webhook")
    monkeypatch.setenv("MFUWATCH_TEST_SLACK", rx.url + "/slack")
    alerts = {"evaluation_interval": "1h", "watchdog_interval": "100ms", "notifiers": [
        {"type": "webhook", "url_env": "MFUWATCH_TEST_HOOK", "backoff": "10ms", "send_resolved": False},
        {"type": "slack", "url_env": "MFUWATCH_TEST_SLACK", "backoff": "10ms", "send_resolved": False},
        {"type": "console", "stream": "log"}],
        "rules": {"TrainingStalled": {"threshold": 1.2, "for": "0s"}}}
    return Agent(config=dict(exporter=False, nvml=False, profile_every="off", alerts=alerts, run="stall",
                             timeline=str(tmp_path / "tl.jsonl"), flops_per_step=1e9, report_every_steps=1,
                             **extra))


def _stall_and_collect(agent, rx, caplog, seconds: float = 2.5):
    import logging

    caplog.set_level(logging.WARNING, logger="mfuwatch.alerts")
    for _ in range(8):
        agent.step(tokens=10)
        time.sleep(0.02)
    stuck_waiting_for_batch(seconds)  # blocks this (the training) thread; the alert fires meanwhile
    assert rx.wait_for_delivered(2, timeout=10), [d.path for d in rx.delivered]
    agent.step(tokens=10)
    agent.close()
    hook = next(d.json for d in rx.delivered if d.path.endswith("/webhook"))
    slack = next(d.json for d in rx.delivered if d.path.endswith("/slack"))
    console = "\n".join(r.getMessage() for r in caplog.records if "TrainingStalled" in r.getMessage())
    return hook["alerts"][0], slack, console


def test_training_stalled_names_the_frame_from_the_hang_watchdog(tmp_path, monkeypatch, caplog):
    from tests.helpers.receiver import AlertReceiver

    with AlertReceiver() as rx:
        # the watchdog judges the step stuck after 0.3 s, before the alert's 1.2 s
        agent = _stall_agent(tmp_path, monkeypatch, rx, hang_factor=3.0, hang_floor_seconds=0.3)
        alert, slack, console = _stall_and_collect(agent, rx, caplog)
    assert alert["labels"]["alertname"] == "TrainingStalled" and alert["status"] == "firing"
    where = alert["annotations"]["waiting_at"]
    assert where.endswith("in stuck_waiting_for_batch") and "test_watchdog.py:" in where, where
    frames = alert["annotations"]["stack"].splitlines()
    assert frames[0] == where and any(f.endswith("in _stall_and_collect") for f in frames[1:]), frames
    assert len(frames) <= 8
    text = json.dumps(slack["blocks"])
    assert "Training thread waits at" in text and "stuck_waiting_for_batch" in text
    assert "waiting at: " + where in console and "in _stall_and_collect" in console, console
    fired = [r for r in read_timeline(tmp_path / "tl.jsonl") if r["kind"] == "alert" and r["status"] == "firing"]
    assert fired and fired[0]["annotations"]["waiting_at"] == where
    assert [r["kind"] for r in read_timeline(tmp_path / "tl.jsonl")].count("hang") == 1


def test_training_stalled_takes_the_stack_itself_without_the_hang_watchdog(tmp_path, monkeypatch, caplog):
    from tests.helpers.receiver import AlertReceiver

    with AlertReceiver() as rx:
        agent = _stall_agent(tmp_path, monkeypatch, rx, hang_watchdog=False)
        alert, slack, console = _stall_and_collect(agent, rx, caplog)
    assert alert["annotations"]["waiting_at"].endswith("in stuck_waiting_for_batch"), alert["annotations"]
    assert "stuck_waiting_for_batch" in json.dumps(slack["blocks"])
    assert "stuck_waiting_for_batch" in console
    assert not [r for r in read_timeline(tmp_path / "tl.jsonl") if r["kind"] == "hang"]  # no watchdog ran
