"""Retrying while closing (alerts/notifiers/base.py ``_plan`` + http.py ``retry_loop``): a rate-limited or
failing receiver gets a bounded number of requests, each server-asked wait is honoured in full (or the
notification is given up and counted ``dropped``), and the log names the wait really done.

The worker runs on a fake clock whose ``sleep`` advances it, so a 30 s close budget takes milliseconds of
wall time; the receiver is a real HTTP server on 127.0.0.1 and each request is a real POST.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading

from helpers.receiver import AlertReceiver, Reply
from test_alert_delivery import notification

from mfuwatch.alerts.config import parse_notifier
from mfuwatch.alerts.notifiers import build_notifier
from mfuwatch.alerts.notifiers.base import CLOSING_MAX_RETRIES, CLOSING_MIN_WAIT, NotifierWorker

BUDGET = 30.0  # seconds of (fake) close budget, as test-notify's default --timeout


class FakeClock:
    """``now()`` and ``sleep(s)`` (advances the clock); thread-safe; records when each sleep ended."""

    def __init__(self) -> None:
        self.t = 1000.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self.t

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.t += max(0.0, seconds)


def closing_run(rx: AlertReceiver, monkeypatch, spec: dict, replies, *, arrival_times: list):
    """Submit one notification, close with BUDGET fake seconds, every answer from ``replies``; returns
    (counts, notifier, worker). ``arrival_times`` gets the fake clock at each request."""
    monkeypatch.setenv("MFUWATCH_TEST_CLOSING_URL", rx.url)
    cfg = parse_notifier({"url_env": "MFUWATCH_TEST_CLOSING_URL", "max_backoff": "60s", **spec}, "notifiers[0]", 100)
    notifier = build_notifier(cfg)
    clock = FakeClock()
    rx.script(*replies)
    rx.default = replies[-1]
    counts = collections.Counter()
    worker = NotifierWorker(notifier, lambda s, o: counts.update([o]), clock=clock.now, sleep=clock.sleep)

    import requests

    real_post = requests.Session.post

    def timed_post(self, *a, **kw):  # the fake time at which each request leaves
        arrival_times.append(clock.now())
        return real_post(self, *a, **kw)

    monkeypatch.setattr(requests.Session, "post", timed_post)
    worker.submit(notification(0))
    worker.start()
    worker.begin_close(clock.now() + BUDGET)
    worker._thread.join(20)
    assert not worker._thread.is_alive()
    return counts, notifier, worker


def gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


def test_closing_honours_retry_after_and_never_hammers(monkeypatch, caplog):
    """Finding 1: Slack answering 429 + Retry-After: 3 got a request every 250 ms for the whole close."""
    times: list = []
    with AlertReceiver() as rx, caplog.at_level(logging.DEBUG, logger="mfuwatch.alerts"):
        counts, notifier, worker = closing_run(rx, monkeypatch, {"type": "slack"},
                                               [Reply(429, headers={"Retry-After": "3"})], arrival_times=times)
    assert all(g >= 3.0 for g in gaps(times)), gaps(times)  # the server's wait, every time
    assert times[-1] - times[0] < BUDGET
    assert 2 <= len(times) <= CLOSING_MAX_RETRIES + 1 and len(rx.received) == len(times)
    assert set(notifier.retry_delays) == {3.0}
    assert counts["dropped"] == 1 and counts["sent"] == 0 and counts["retry"] == len(times) - 1
    assert worker.undelivered and worker.undelivered[0].startswith("firing")
    retry_lines = [r.getMessage() for r in caplog.records if "retry 1 " in r.getMessage()]
    assert retry_lines and "in 3.00s" in retry_lines[0]


def test_closing_gives_up_when_retry_after_is_longer_than_the_budget_left(monkeypatch, caplog):
    times: list = []
    with AlertReceiver() as rx, caplog.at_level(logging.WARNING, logger="mfuwatch.alerts"):
        counts, notifier, _ = closing_run(rx, monkeypatch, {"type": "slack"},
                                          [Reply(429, headers={"Retry-After": "45"})], arrival_times=times)
    assert len(rx.received) == 1  # one request, then given up: no re-send before the 45 s are over
    assert counts["dropped"] == 1 and counts["retry"] == 0
    assert any("would not fit in the close timeout" in r.getMessage() and "45.00s" in r.getMessage()
               for r in caplog.records), caplog.text


def test_closing_honours_discords_retry_after_body(monkeypatch):
    times: list = []
    body = json.dumps({"message": "You are being rate limited.", "retry_after": 2.5, "global": False})
    with AlertReceiver() as rx:
        counts, notifier, _ = closing_run(
            rx, monkeypatch, {"type": "discord"},
            [Reply(429, headers={"Content-Type": "application/json"}, body=body)] * 2 + [Reply(204, body="")],
            arrival_times=times)
    assert gaps(times) == [2.5, 2.5] and list(notifier.retry_delays) == [2.5, 2.5]
    assert counts["sent"] == 1 and counts["retry"] == 2 and counts["dropped"] == 0


def test_closing_backoff_is_bounded_and_the_log_says_the_real_wait(monkeypatch, caplog):
    """A 500 with a long configured backoff while closing: waits shortened to a quarter of the budget left
    (at least CLOSING_MIN_WAIT), at most CLOSING_MAX_RETRIES retries, and the log names the wait done."""
    times: list = []
    with AlertReceiver() as rx, caplog.at_level(logging.WARNING, logger="mfuwatch.alerts"):
        counts, notifier, _ = closing_run(rx, monkeypatch, {"type": "slack", "backoff": "20s"},
                                          [Reply(500)], arrival_times=times)
    g = gaps(times)
    assert len(times) <= CLOSING_MAX_RETRIES + 1 and all(x >= CLOSING_MIN_WAIT for x in g), g
    assert g[0] <= BUDGET / 4 + 1e-9  # a quarter of what was left, not the 10-20 s backoff
    assert g == list(notifier.retry_delays)[:len(g)]
    assert counts["dropped"] == 1 and counts["sent"] == 0
    (line,) = [r.getMessage() for r in caplog.records if "retry 1 (of unlimited)" in r.getMessage()]
    said = float(re.search(r"in ([0-9.]+)s", line).group(1))
    assert abs(said - g[0]) < 0.01, (line, g)  # the log names the wait really done


def test_a_group_waiting_for_its_retry_does_not_hold_back_other_groups(monkeypatch):
    """Finding 5: test-notify's route[1] and route[2] states waited 30 s behind a rate-limited route[0] state.
    Now a state waiting for a retry is parked behind the queue: the others go first, then it is retried
    after the wait the server asked for."""
    times: list = []
    with AlertReceiver() as rx:
        monkeypatch.setenv("MFUWATCH_TEST_CLOSING_URL", rx.url)
        cfg = parse_notifier({"type": "slack", "url_env": "MFUWATCH_TEST_CLOSING_URL", "max_backoff": "60s"},
                             "notifiers[0]", 100)
        notifier = build_notifier(cfg)
        clock = FakeClock()
        rx.script(Reply(429, headers={"Retry-After": "20"}))  # then 200 ok
        counts = collections.Counter()
        worker = NotifierWorker(notifier, lambda s, o: counts.update([o]), clock=clock.now, sleep=clock.sleep)

        import requests

        real_post = requests.Session.post

        def timed_post(self, *a, **kw):
            times.append(clock.now())
            return real_post(self, *a, **kw)

        monkeypatch.setattr(requests.Session, "post", timed_post)
        for i in range(3):
            worker.submit(notification(i, run=f"r{i}"))  # three groups
        worker.start()
        worker.begin_close(clock.now() + BUDGET)
        worker._thread.join(20)
        assert not worker._thread.is_alive()
    assert [r.status for r in rx.received] == [429, 200, 200, 200]
    assert times[1] - times[0] < 1.0 and times[2] - times[0] < 1.0  # r1 and r2 went at once, not after 20 s
    assert times[3] - times[0] >= 20.0  # r0's retry waited what the server asked
    assert "run r0" in rx.received[3].body.decode() and "run r1" not in rx.received[3].body.decode()
    assert counts["sent"] == 3 and counts["dropped"] == 0 and counts["retry"] == 1


def test_failure_logs_say_what_failed_where_and_what_happens_next(monkeypatch, caplog):
    """Finding 9: every failure read `slack delivery failed (ConnectionError)`; a 401 lost the vendor's
    message; with max_retries: 2 the line still promised `retried until delivered`."""
    import time

    from helpers.net import free_port

    monkeypatch.setenv("MFUWATCH_TEST_CLOSING_URL", f"http://127.0.0.1:{free_port()}/hook")  # nobody listens
    monkeypatch.setenv("MFUWATCH_TEST_OG_KEY", "og-key-42")
    cfg = parse_notifier({"type": "slack", "url_env": "MFUWATCH_TEST_CLOSING_URL", "backoff": "10ms",
                          "max_backoff": "10ms", "max_retries": 2}, "notifiers[0]", 100)
    counts = collections.Counter()
    with caplog.at_level(logging.WARNING, logger="mfuwatch.alerts"):
        worker = NotifierWorker(build_notifier(cfg), lambda s, o: counts.update([o]))
        worker.submit(notification(0))
        worker.start()
        assert worker.close(time.monotonic() + 10)
        with AlertReceiver(path="") as og:  # Opsgenie's documented 401 answer
            og.script(Reply(401, headers={"Content-Type": "application/json"},
                            body='{"message":"Key format is not valid!","took":0.0,"requestId":"r-1"}'))
            og_cfg = parse_notifier({"type": "opsgenie", "api_key_env": "MFUWATCH_TEST_OG_KEY",
                                     "api_url": f"http://localhost:{og.port}"}, "notifiers[1]", 100)
            w2 = NotifierWorker(build_notifier(og_cfg), lambda s, o: counts.update([o]))
            w2.submit(notification(1))
            w2.start()
            assert w2.close(time.monotonic() + 10)
            port = og.port
    lines = [r.getMessage() for r in caplog.records]
    retry = next(m for m in lines if "slack delivery failed" in m)
    assert "(ConnectionError: connection refused, to the slack URL)" in retry, retry
    assert "counted failed after 2 retries" in retry and "until delivered" not in retry
    rejected = next(m for m in lines if "opsgenie" in m and "HTTP 401" in m)
    assert f"localhost:{port} answered HTTP 401 (Key format is not valid!); not retried" in rejected, rejected
    assert counts["failed"] == 2
    assert "og-key-42" not in caplog.text and "/hook" not in caplog.text
