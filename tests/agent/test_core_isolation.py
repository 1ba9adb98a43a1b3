"""Agent containment: each part of the tick under its own guard, start-up that cleans up after itself.

A full disk under the timeline, a broken exporter and a collector that raises at
scrape time are each counted under their component while steps are still counted
and alerts still fed; ``close()`` never raises into the training job; a failed
start-up leaves no port, thread or hook behind and raises ``ConfigError``.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
import urllib.request

import pytest
import torch

from mfuwatch.agent import Agent, ConfigError, watch
from mfuwatch.agent.live.timeline import read_timeline
from tests.helpers.net import free_port

BASE = dict(exporter=False, nvml=False, profile_every="off", run="iso", report_every_steps=10)
CONSOLE_LOG = {"notifiers": [{"type": "console", "stream": "log"}]}


class FullDisk:
    """A text file object on a disk that fills after ``room`` bytes: then every write/flush/close is ENOSPC."""

    def __init__(self, fh, room: int) -> None:
        self.fh, self.room = fh, room

    def write(self, text: str) -> int:
        if self.room < len(text):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(text)
        return self.fh.write(text)

    def flush(self) -> None:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()
        raise OSError(errno.ENOSPC, "No space left on device")


def _steps_total(agent):
    return agent.registry.get_sample_value("mfuwatch_steps_total", {"run": "iso", "rank": "0"})


def _run_steps(agent, n):
    for i in range(n):
        agent.step(tokens=8)
        if i % 50 == 0:
            time.sleep(0.01)  # let the agent thread poll in between, as a real loop would


def test_disk_full_under_the_timeline_keeps_counting_and_alerting(tmp_path):
    path = tmp_path / "tl.jsonl"
    a = Agent(config=dict(BASE, timeline=str(path), alerts=CONSOLE_LOG))
    a.timeline._fh = FullDisk(a.timeline._fh, room=2048)  # the disk fills after ~2 KB
    _run_steps(a, 600)
    time.sleep(0.5)
    seen_by_alerts = a.alerts.store.step
    a.close()  # must not raise, though the file's close() does
    assert _steps_total(a) == 600  # every step counted
    assert a.errors.get("timeline") >= 1  # the disk failure was counted
    assert seen_by_alerts is not None and seen_by_alerts.step >= 500  # the alert engine kept getting steps
    assert a.alerts.state("TrainingStalled") == "inactive"
    assert list(read_timeline(path))[0]["kind"] == "run"  # what fit on the disk is readable


def test_exporter_failure_does_not_stop_step_counting_or_alerts(tmp_path, monkeypatch):
    path = tmp_path / "tl.jsonl"
    a = Agent(config=dict(BASE, timeline=str(path), alerts=CONSOLE_LOG))

    def broken(*args, **kwargs):
        raise RuntimeError("exporter bug")

    monkeypatch.setattr(a.exporter, "observe_steps", broken)
    monkeypatch.setattr(a.exporter.collector, "update", broken)
    _run_steps(a, 600)
    a.close()
    steps = sum(r["steps"] for r in read_timeline(path) if r["kind"] == "step")
    assert steps == 600
    assert a.errors.get("exporter") >= 1
    assert a.alerts.store.step is not None and a.alerts.store.step.step == 600


def test_close_never_raises_even_when_every_part_fails(monkeypatch):
    a = Agent(config=dict(BASE, alerts=CONSOLE_LOG))
    for obj in (a.exporter, a.alerts, a.timeline):
        monkeypatch.setattr(obj, "close", lambda *args, **kw: (_ for _ in ()).throw(OSError(errno.EIO, "boom")))
    a.step(tokens=1)
    a.close()  # no exception
    assert a.errors.get("close") + a.errors.get("timeline") >= 3


def _port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _agent_threads():
    return {t.name for t in threading.enumerate() if t.name.startswith("mfuwatch") or "serve_forever" in t.name}


@pytest.mark.parametrize("bad", [
    {"timeline": "/proc/mfuwatch-no-such-dir/t.jsonl"},  # cannot be created, not even as root
    {"alerts": {"rules": {"MfuLow": {"threshhold": 0.2}}}},  # an alert config error after the exporter started
])
def test_failed_start_up_cleans_up_and_raises_config_error(bad):
    port = free_port()
    before = _agent_threads()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        watch(model, opt, **{**BASE, "exporter": True, "port": port, "alerts": False, **bad})
    assert ("timeline" in str(info.value)) or ("alerts" in str(info.value))
    time.sleep(0.1)
    assert _port_is_free(port)  # the exporter's port was released
    assert _agent_threads() <= before  # no exporter, alert or agent thread left running
    assert not model._forward_pre_hooks and not opt._optimizer_step_post_hooks  # no hook left behind


def test_failing_collector_is_counted_and_metrics_still_answer():
    a = Agent(config=dict(BASE, exporter=True, port=0, alerts=False))

    class Broken:
        def describe(self):
            return []

        def collect(self):
            raise RuntimeError("collector bug")

    a.registry.register(Broken())
    renders = a.exporter.renders  # the server child's start-up render came before Broken
    try:
        a.step(tokens=3)
        for _ in range(3):
            time.sleep(a.config.exporter_render_interval_seconds)  # each scrape renders anew
            with urllib.request.urlopen(a.exporter_url, timeout=10) as resp:
                assert resp.status == 200
                body = resp.read().decode()
        assert "mfuwatch_steps_total" in body and "Traceback" not in body
        # one per render of the exposition (scrapes within exporter_render_interval_seconds share one)
        assert a.errors.get("collector") == a.exporter.renders - renders == 3
        assert 'mfuwatch_agent_errors_total{component="collector"' in body or \
            'component="collector"' in body
    finally:
        a.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """An 8 KB tmpfs (needs root, as in CI); skipped where mounting is not allowed."""
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?); the ENOSPC file object test covers the path")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_full_tmpfs_under_the_timeline(tiny_tmpfs):
    a = Agent(config=dict(BASE, timeline=str(tiny_tmpfs / "tl.jsonl"), alerts=CONSOLE_LOG))
    _run_steps(a, 600)
    time.sleep(0.5)
    a.close()
    assert _steps_total(a) == 600
    assert a.errors.get("timeline") >= 1
    assert a.alerts.store.step is not None and a.alerts.store.step.step == 600
