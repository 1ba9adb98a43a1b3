"""Notifications sent, received and duplicated per injected receiver fault (CPU only, ~1 min).

Each scenario drives a real :class:`mfuwatch.alerts.AlertEngine` on a fake clock against a
real HTTP receiver on 127.0.0.1 (``tests/helpers/receiver.py``) with the notifier's backoff
shortened to 10–100 ms, toggles two critical alerts (GpuMemoryPressure, GpuThrottling) through
NVML samples, and compares what the engine submitted with what the receiver got:

* ``transitions``: firing/resolved transitions the engine recorded (timeline records);
* ``submitted``: notifications (group states) the engine handed to the webhook worker;
* ``received``: requests the receiver answered 2xx; ``duplicates``: bodies received twice;
* ``superseded``/``dropped``/``failed``/``retries``: the worker's outcome counters;
* ``final state ok``: the receiver's last state of every alert equals the engine's.

    python benchmarks/fault_injection.py          # prints a markdown table
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.net import free_port  # noqa: E402
from helpers.receiver import AlertReceiver, Reply  # noqa: E402

from mfuwatch.agent.schema import GpuHealth, RunInfo  # noqa: E402
from mfuwatch.alerts import AlertEngine  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 1.7e9

    def __call__(self) -> float:
        return self.t


def engine_for(port: int, clock: Clock, events: list, **notifier) -> AlertEngine:
    import os

    os.environ["MFUWATCH_BENCH_URL"] = f"http://127.0.0.1:{port}/hook"
    fast = {"for": "0s", "cooldown": "0s", "severity": "critical"}
    cfg = {"notifiers": [{"type": "webhook", "url_env": "MFUWATCH_BENCH_URL", "backoff": "10ms",
                          "max_backoff": "100ms", **notifier}],
           "evaluation_interval": "1h",
           "rules": {"GpuMemoryPressure": fast, "GpuThrottling": {**fast, "reasons": ["hw_slowdown"]}}}
    info = RunInfo(run="bench", rank=0, world_size=1, host="h")
    e = AlertEngine.from_config(cfg, run_info=info, clock=clock, on_event=events.append).start()
    w = e.workers[0]
    w.submitted = 0
    orig = w.submit

    def counting(n):
        w.submitted += 1
        return orig(n)

    w.submit = counting
    return e


def drive(e: AlertEngine, clock: Clock, seconds: int, pause: float = 0.03) -> None:
    for s in range(seconds):
        mem = 99.0 if (s // 2) % 2 == 0 else 10.0
        e.observe_gpu(GpuHealth(timestamp=clock(), memory_used_bytes=mem, memory_total_bytes=100.0,
                                clock_event_reasons={"hw_slowdown": (s // 5) % 2 == 1}))
        e.evaluate()
        clock.t += 1.0
        time.sleep(pause)


def last_state(rx) -> dict:
    out = {}
    for r in rx.delivered:
        for a in r.json["alerts"]:
            out[a["labels"]["alertname"]] = a["status"]
    return out


def outcome(e, name):
    return int(e.registry.get_sample_value("mfuwatch_notifications_total",
                                           {"run": "bench", "rank": "0", "sink": "webhook", "outcome": name}) or 0)


def row(name, e, rx, events, truth) -> dict:
    bodies = [r.body for r in rx.delivered] if rx else []
    return {"fault": name, "transitions": len(events), "submitted": e.workers[0].submitted,
            "received": len(bodies), "duplicates": len(bodies) - len(set(bodies)),
            "superseded": outcome(e, "superseded"), "dropped": outcome(e, "dropped"),
            "failed": outcome(e, "failed"), "retries": outcome(e, "retry"),
            "final state ok": (last_state(rx) == truth) if rx else None}


def settle(rx, e, truth, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and (last_state(rx) != truth or e.workers[0].pending()):
        time.sleep(0.05)


def scenario_outage(seconds: int) -> dict:
    port, clock, events = free_port(), Clock(), []
    e = engine_for(port, clock, events)
    drive(e, clock, seconds)  # nobody listens
    with AlertReceiver(port=port) as rx:
        drive(e, clock, 4)
        e.close(timeout=10)
        time.sleep(0.2)
        truth = {n: "resolved" for n in ("GpuMemoryPressure", "GpuThrottling") if any(
            ev["alertname"] == n for ev in events)}
        return row(f"receiver down {seconds} s (alert clock), then up", e, rx, events, truth)


def scenario_script(name: str, replies, **notifier) -> dict:
    clock, events = Clock(), []
    with AlertReceiver() as rx:
        rx.script(*replies)
        e = engine_for(rx.port, clock, events, **notifier)
        drive(e, clock, 12, pause=0.1)
        e.close(timeout=15)
        time.sleep(0.2)
        truth = {n: "resolved" for n in ("GpuMemoryPressure", "GpuThrottling") if any(
            ev["alertname"] == n for ev in events)}
        return row(name, e, rx, events, truth)


def scenario_close_during_outage() -> dict:
    clock, events = Clock(), []
    e = engine_for(free_port(), clock, events)
    drive(e, clock, 6)
    t0 = time.monotonic()
    lost = e.close(timeout=1.0)
    r = row("receiver down through close(timeout=1s)", e, None, events, {})
    r["final state ok"] = f"close took {time.monotonic() - t0:.2f} s, reported {len(lost)} undelivered"
    return r


def main() -> None:
    rows = [
        scenario_outage(12),
        scenario_outage(30),
        scenario_script("HTTP 500, 502, 503 then 200", [Reply(500), Reply(502), Reply(503)]),
        scenario_script("HTTP 429 Retry-After: 1, then 200", [Reply(429, headers={"Retry-After": "1"})],
                        max_backoff="2s"),
        scenario_script("slow receiver (3 answers after 0.6 s, timeout 150 ms)",
                        [Reply(delay=0.6)] * 3, timeout="150ms"),
        scenario_close_during_outage(),
    ]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
