"""alerts/notifiers/base.py + http.py: queued delivery to a real HTTP receiver that fails in every way.

Receiver down, 5xx, 429 with Retry-After, slow (timeouts), 4xx; a full queue; close()
with work left. Delivery must be in order, exactly once after recovery, and every
outcome counted.
"""

from __future__ import annotations

import collections
import email.utils
import time

import pytest
from helpers.net import free_port
from helpers.receiver import AlertReceiver, Reply

from mfuwatch.alerts import AlertEngine
from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.model import AlertSnapshot, Notification
from mfuwatch.alerts.notifiers.base import NotifierWorker
from mfuwatch.alerts.notifiers.http import backoff_delay, parse_retry_after
from mfuwatch.alerts.notifiers.webhook import WebhookNotifier


def notification(i: int, *, run: str = "r", status: str = "firing", name: str = "MfuLow") -> Notification:
    labels = {"alertname": name, "severity": "warning", "run": run, "rank": "0"}
    alert = AlertSnapshot(name=name, status=status, severity="warning", labels=labels,
                          annotations={"summary": f"n{i}"}, starts_at=1.7e9 + i,
                          ends_at=1.7e9 + i + 1 if status == "resolved" else None, value=0.1,
                          threshold=0.25, op="<", unit="ratio")
    return Notification({"run": run}, (alert,))


def worker_for(url: str, monkeypatch, **spec):
    monkeypatch.setenv("MFUWATCH_TEST_DELIVERY_URL", url)
    cfg = parse_notifier({"type": "webhook", "url_env": "MFUWATCH_TEST_DELIVERY_URL", "backoff": "10ms",
                          "max_backoff": "100ms", **spec}, "notifiers[0]", 100)
    counts = collections.Counter()
    notifier = WebhookNotifier(cfg)
    worker = NotifierWorker(notifier, lambda sink, outcome: counts.update([(sink, outcome)]))
    return worker, notifier, counts


def summaries(rx):
    return [r.json["alerts"][0]["annotations"]["summary"] for r in rx.delivered]


def test_receiver_down_then_up_delivers_the_latest_state_of_the_group_once(monkeypatch):
    port = free_port()
    worker, _, counts = worker_for(f"http://127.0.0.1:{port}/hook", monkeypatch)
    worker.start()
    for i in range(5):
        assert worker.submit(notification(i))
    time.sleep(0.3)  # nobody listens: connection refused, retried with backoff, superseded by newer states
    with AlertReceiver(port=port) as rx:
        assert rx.wait_for_delivered(1, timeout=20)
        assert worker.close(time.monotonic() + 5)
        assert summaries(rx) == ["n4"]  # the group's newest state; the older ones were superseded
        assert len(rx.received) == 1  # refused connections never reached it; no duplicates
    assert counts[("webhook", "sent")] == 1 and counts[("webhook", "retry")] >= 1
    assert counts[("webhook", "superseded")] == 4
    assert counts[("webhook", "failed")] == 0 and counts[("webhook", "dropped")] == 0


def test_distinct_groups_are_each_delivered_once_after_an_outage(monkeypatch):
    port = free_port()
    worker, _, counts = worker_for(f"http://127.0.0.1:{port}/hook", monkeypatch)
    worker.start()
    for i in range(3):
        worker.submit(notification(i, run=f"r{i}"))
    time.sleep(0.3)
    with AlertReceiver(port=port) as rx:
        assert rx.wait_for_delivered(3, timeout=20)
        assert worker.close(time.monotonic() + 5)
        # no group supersedes another; their order may change: a group waiting for a retry is parked behind
        # the others (no head-of-line blocking across groups, see test_alert_closing)
        assert sorted(summaries(rx)) == ["n0", "n1", "n2"]
    assert counts[("webhook", "superseded")] == 0 and counts[("webhook", "sent")] == 3


def test_superseding_carries_a_resolved_alert_forward(monkeypatch):
    port = free_port()
    worker, _, counts = worker_for(f"http://127.0.0.1:{port}/hook", monkeypatch)
    worker.start()
    worker.submit(notification(0, status="resolved"))  # MfuLow resolved ...
    other = notification(1, name="GpuThrottling")  # ... then another alert of the same group fires
    worker.submit(other)
    time.sleep(0.3)
    with AlertReceiver(port=port) as rx:
        assert rx.wait_for_delivered(1, timeout=20)
        assert worker.close(time.monotonic() + 5)
        body = rx.delivered[-1].json
    got = sorted((a["labels"]["alertname"], a["status"]) for a in body["alerts"])
    assert got == [("GpuThrottling", "firing"), ("MfuLow", "resolved")]
    assert counts[("webhook", "superseded")] == 1


def test_5xx_then_200_delivers_once_after_recovery(receiver, monkeypatch):
    receiver.script(Reply(500), Reply(502), Reply(503))
    worker, _, counts = worker_for(receiver.url, monkeypatch)
    worker.start()
    for i in range(3):
        worker.submit(notification(i, run=f"r{i}"))  # three groups: none supersedes another
    assert receiver.wait_for_delivered(3, timeout=20)
    assert worker.close(time.monotonic() + 5)
    assert [r.status for r in receiver.received] == [500, 502, 503, 200, 200, 200]
    # each delivered once; the order of the retries is timing-dependent: the last group to fail waits for its
    # retry in place when no parked group is due yet (within 10 ms of their failures), else parks behind them
    assert sorted(summaries(receiver)) == ["n0", "n1", "n2"]
    # each group is tried before any is retried: a group waiting for its retry does not hold the others back
    assert [r.json["alerts"][0]["annotations"]["summary"] for r in receiver.received[:3]] == ["n0", "n1", "n2"]
    assert counts[("webhook", "sent")] == 3 and counts[("webhook", "retry")] == 3


def test_429_honours_retry_after(receiver, monkeypatch):
    receiver.script(Reply(429, headers={"Retry-After": "1"}))
    worker, notifier, counts = worker_for(receiver.url, monkeypatch, max_backoff="10s")
    worker.start()
    worker.submit(notification(0))
    assert receiver.wait_for_delivered(1, timeout=20)
    assert worker.close(time.monotonic() + 5)
    assert list(notifier.retry_delays) == [1.0]  # the header, not the 10 ms backoff
    first, second = receiver.received
    assert (first.status, second.status) == (429, 200)
    assert second.at - first.at >= 0.9
    assert counts[("webhook", "sent")] == 1 and counts[("webhook", "retry")] == 1


def test_slow_receiver_times_out_retries_then_fails(receiver, monkeypatch):
    receiver.default = Reply(delay=0.6)
    worker, _, counts = worker_for(receiver.url, monkeypatch, timeout="150ms", max_retries=1)
    worker.start()
    assert worker.submit(notification(0))  # queued at once; the request happens on the worker thread
    assert receiver.wait_for(2, timeout=20)
    assert worker.close(time.monotonic() + 5)
    assert counts[("webhook", "failed")] == 1 and counts[("webhook", "retry")] == 1
    assert counts[("webhook", "sent")] == 0


def test_client_errors_are_not_retried(receiver, monkeypatch):
    receiver.script(Reply(400, body="invalid_payload"))
    worker, _, counts = worker_for(receiver.url, monkeypatch)
    worker.start()
    worker.submit(notification(0))
    worker.submit(notification(1))
    assert receiver.wait_for_delivered(1, timeout=20)
    assert worker.close(time.monotonic() + 5)
    assert [r.status for r in receiver.received] == [400, 200]
    assert counts[("webhook", "failed")] == 1 and counts[("webhook", "sent")] == 1
    assert counts[("webhook", "retry")] == 0


def test_full_queue_drops_the_oldest_superseded_states_never_the_latest(receiver, monkeypatch):
    worker, _, counts = worker_for(receiver.url, monkeypatch, queue_size=3)
    # the thread is not running yet: 10 states of group r, one of group s in between
    accepted = [worker.submit(notification(i)) for i in range(4)]
    accepted.append(worker.submit(notification(100, run="s")))
    accepted += [worker.submit(notification(i)) for i in range(4, 10)]
    assert accepted == [True] * 11  # nothing refused: superseded states made room
    assert worker.pending() == 3
    worker.start()
    assert receiver.wait_for_delivered(3, timeout=20)
    assert worker.close(time.monotonic() + 5)
    got = summaries(receiver)
    assert got[-1] == "n9" and "n100" in got  # each group's latest state survived the overflow
    assert len(got) == 3 and counts[("webhook", "sent")] == 3
    assert counts[("webhook", "superseded")] == 8 and counts[("webhook", "dropped")] == 0


def test_close_flushes_the_queue_before_returning(receiver, monkeypatch):
    worker, _, counts = worker_for(receiver.url, monkeypatch)
    worker.start()
    for i in range(5):
        worker.submit(notification(i))
    assert worker.close(time.monotonic() + 10)
    assert summaries(receiver) == [f"n{i}" for i in range(5)] and counts[("webhook", "sent")] == 5


def test_close_does_not_wait_for_a_stuck_receiver(receiver, monkeypatch):
    receiver.default = Reply(delay=3.0)
    worker, _, counts = worker_for(receiver.url, monkeypatch, timeout="10s")
    worker.start()
    for i in range(3):
        worker.submit(notification(i))
    assert receiver.wait_for_arrivals(1, timeout=10)  # the first request is in flight
    finished = worker.close(time.monotonic() + 0.3)
    assert finished is False  # returned while the request was still in flight
    assert worker._thread.join(10) is None and not worker._thread.is_alive()
    # the in-flight one completes; the two still queued are past the deadline: dropped, counted
    assert counts[("webhook", "dropped")] == 2 and counts[("webhook", "sent")] == 1


def test_engine_close_with_receiver_down_counts_dropped(run_info, clock, monkeypatch):
    monkeypatch.setenv("MFUWATCH_TEST_DELIVERY_URL", f"http://127.0.0.1:{free_port()}/hook")
    engine = AlertEngine.from_config({"notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_DELIVERY_URL",
                                                     "backoff": "50ms", "max_retries": 1000}],
                                      "rules": {"GpuMemoryPressure": {"for": "0s"}}},
                                     run_info=run_info, clock=clock).start()
    from mfuwatch.agent.schema import GpuHealth

    engine.observe_gpu(GpuHealth(timestamp=0, memory_used_bytes=99.0, memory_total_bytes=100.0))
    engine.evaluate()
    engine.close(timeout=0.3)
    engine.workers[0]._thread.join(5)
    labels = {"run": "run-a", "rank": "0", "sink": "webhook"}
    assert engine.registry.get_sample_value("mfuwatch_notifications_total", {**labels, "outcome": "dropped"}) == 1
    assert engine.registry.get_sample_value("mfuwatch_notifications_total", {**labels, "outcome": "sent"}) == 0


def test_retry_after_http_date_and_backoff_bounds():
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 7, usegmt=True)
    assert parse_retry_after(date, now=now) == 7.0
    assert parse_retry_after("12") == 12.0 and parse_retry_after("soon") is None and parse_retry_after(None) is None
    import random

    rng = random.Random(0)
    for attempt, cap_b in ((0, 0.5), (1, 1.0), (3, 4.0), (10, 30.0)):
        for _ in range(50):
            d = backoff_delay(attempt, 0.5, 30.0, rng)
            assert cap_b / 2 <= d <= cap_b  # equal jitter in [b/2, b], b = min(cap, base * 2**attempt)


@pytest.mark.parametrize("status, retried", [(408, True), (429, True), (500, True), (599, True), (404, False),
                                             (410, False)])
def test_which_statuses_are_retried(status, retried):
    from mfuwatch.alerts.notifiers.http import RETRY_STATUS

    assert (status in RETRY_STATUS) is retried
