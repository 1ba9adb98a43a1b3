"""Soak: 50,000 steps through the whole agent (exporter, timeline, alerts) on a fast fake clock; memory,
threads and file descriptors stay flat. Prints the growth table docs/reliability.md quotes."""

from __future__ import annotations

import gc
import os
import threading
import time
import urllib.request

from mfuwatch.agent import Agent
from tests.helpers.integration_fixtures import install_fake_clock


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> set:
    """(fd, what it points at) for every open descriptor: a leaked socket or file is a new pair, even when it
    reuses the number of one closed meanwhile."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


def _threads() -> set:
    return {(t.ident, t.name) for t in threading.enumerate()}


def test_soak_50k_steps_flat_memory_threads_and_fds(tmp_path):
    cfg = dict(exporter=True, port=0, nvml=False, profile_every="off", run="soak", report_every_steps=10,
               flops_per_step=1e9, peak_flops=1e12, timeline=str(tmp_path / "soak.jsonl"),
               alerts={"notifiers": [{"type": "console", "stream": "log"}], "evaluation_interval": "100ms",
                       "rules": {"MfuLow": {"for": "0s", "cooldown": "0s"}}})
    a = Agent(config=cfg)
    now = install_fake_clock(a, start=True)
    samples = []
    try:
        for i in range(1, 50_001):
            now.t += 0.01  # 10 ms per step on the fake clock: MFU 0.1, below MfuLow's 0.25 (it fires)
            a.step(tokens=64)
            if i % 500 == 0:
                time.sleep(0.002)  # let the agent thread keep up, as a real step would
            if i in (5_000, 50_000):
                time.sleep(0.3)
                urllib.request.urlopen(a.exporter_url, timeout=10).read()  # scraped, as Prometheus would
                time.sleep(0.5)  # the server's request thread and socket end after the answer
                gc.collect()
                samples.append((i, _rss_mb(), _threads(), _fds()))
        assert a.alerts.state("MfuLow") == "firing"
    finally:
        a.close()
    (s0, rss0, thr0, fd0), (s1, rss1, thr1, fd1) = samples
    print(f"\nsoak: steps {s0} -> {s1}: RSS {rss0:.1f} -> {rss1:.1f} MB ({rss1 - rss0:+.1f}), "
          f"threads {len(thr0)} -> {len(thr1)}, fds {len(fd0)} -> {len(fd1)}")
    assert a.registry.get_sample_value("mfuwatch_steps_total", {"run": "soak", "rank": "0"}) == 50_000
    # nothing new after 45,000 more steps; one that ended meanwhile (a thread or descriptor an earlier test in
    # this process left behind: CI saw 13 -> 12 threads, 19 -> 18 fds) is no growth
    assert thr1 - thr0 == set() and fd1 - fd0 == set(), (thr1 - thr0, fd1 - fd0)
    assert rss1 - rss0 < 8.0  # 45,000 more steps, 4,500 more measurements: no per-step growth
