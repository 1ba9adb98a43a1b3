"""MemoryBoundDominant: one noisy window does not page (a ``for`` of two windows), and a new window is
evaluated when it arrives (a short run alerts during the run, not only at close)."""

from __future__ import annotations

import time

from mfuwatch.agent.schema import WindowMeasurement
from mfuwatch.alerts import AlertEngine


def window(share: float, step: int = 1) -> WindowMeasurement:
    return WindowMeasurement(step=step, timestamp=0, steps=1, wall_seconds=1, busy_seconds=1,
                             breakdown={"idle": 0.0}, memory_bound_share=share)


def test_a_share_flapping_around_the_threshold_does_not_page(run_info, clock):
    events = []
    e = AlertEngine.from_config({"notifiers": [{"type": "console", "stream": "log"}]}, run_info=run_info,
                                clock=clock, on_event=events.append)
    for i in range(10):  # windows a minute apart: 45%, 35%, 45%, ... around the 40% threshold
        e.observe_window(window(0.45 if i % 2 == 0 else 0.35, i))
        e.evaluate()
        clock.advance(60)
    assert [ev for ev in events if ev["alertname"] == "MemoryBoundDominant"] == []
    # two windows in a row above it, five minutes apart (the default cadence): it fires
    e.observe_window(window(0.6, 20))
    e.evaluate()
    clock.advance(300)
    e.observe_window(window(0.6, 21))
    e.evaluate()
    assert e.state("MemoryBoundDominant") == "firing"
    e.close(timeout=1)


def test_a_new_window_is_evaluated_when_it_arrives(run_info):
    cfg = {"evaluation_interval": "1h", "notifiers": [{"type": "console", "stream": "log"}],
           "rules": {"MemoryBoundDominant": {"for": "0s"}}}
    e = AlertEngine.from_config(cfg, run_info=run_info).start()
    try:
        e.observe_window(window(0.9))
        deadline = time.monotonic() + 5
        while e.state("MemoryBoundDominant") != "firing" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.state("MemoryBoundDominant") == "firing"  # not an hour later
    finally:
        e.close(timeout=1)
