"""The console progress line: printed per report when no exporter serves /metrics, throttled, never fatal."""

import logging
import subprocess
import sys
import textwrap

import pytest

from mfuwatch.agent import Agent, ConfigError
from mfuwatch.agent.live import reporter as agent_thread
from tests.helpers.integration_fixtures import install_fake_clock
from mfuwatch.agent.schema import StepMeasurement, WindowMeasurement

BASE = dict(nvml=False, alerts=False, profile_every="off", run="p", flops_per_step=2e12, peak_flops=1e13,
            report_every_steps=5)


def _run(steps, **cfg):
    """``steps`` steps of 0.25 s and 4096 tokens each on a fake clock; returns the closed agent."""
    a = Agent(config=dict(BASE, **cfg))
    now = install_fake_clock(a, start=True)
    for _ in range(steps):
        now.t += 0.25
        a.step(tokens=4096)
    a.close()
    return a


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "mfuwatch.progress"]


def test_exporter_off_prints_report_line_and_final_line(caplog):
    caplog.set_level(logging.INFO, logger="mfuwatch.progress")
    a = _run(7, exporter=False)
    lines = _lines(caplog)
    # report at step 5 (steps 2..5 timed: the first step has no start), then the final report at close (6..7).
    # MFU = 2e12 / 0.25 s / 1e13 = 80%; tokens/s = 4096 / 0.25 = 16384; step time 250 ms
    assert lines == ["mfuwatch: step 5 | MFU 80.0% | 16,384 tokens/s | step 250.0 ms",
                     "mfuwatch: step 7 | MFU 80.0% | 16,384 tokens/s | step 250.0 ms"]
    assert a.errors.get("progress") == 0


def test_lines_are_throttled_between_reports(caplog):
    caplog.set_level(logging.INFO, logger="mfuwatch.progress")
    _run(20, exporter=False)  # reports at 5, 10, 15, 20 within milliseconds: only the first is printed
    assert [line.split(" | ")[0] for line in _lines(caplog)] == ["mfuwatch: step 5"]


def test_exporter_on_is_quiet_unless_asked(caplog):
    caplog.set_level(logging.INFO, logger="mfuwatch.progress")
    _run(6, port=0, bind="127.0.0.1")
    assert _lines(caplog) == []
    _run(6, port=0, bind="127.0.0.1", progress=True)
    assert len(_lines(caplog)) == 2


def test_progress_false_silences_it(caplog):
    caplog.set_level(logging.INFO, logger="mfuwatch.progress")
    _run(7, exporter=False, progress=False)
    assert _lines(caplog) == []


def test_bad_progress_value_names_the_field():
    with pytest.raises(ConfigError, match=r"progress: expected 'auto'.*true or false, got 'yes'"):
        Agent(config=dict(BASE, exporter=False, progress="yes"))
    with pytest.raises(ConfigError, match="progress"):
        Agent(config=dict(BASE, exporter=False, progress=1))


def test_line_with_window_and_without_peak():
    m = StepMeasurement(step=40, steps=10, timestamp=0.0, step_time_seconds=1.5, tokens=8000,
                        tokens_per_second=533.3, model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0,
                        mfu=None, hfu=None)
    w = WindowMeasurement(step=30, timestamp=0.0, steps=3, wall_seconds=1.0, busy_seconds=0.9, breakdown={},
                          memory_bound_share=0.234)
    assert agent_thread.progress_line(m, w) == (
        "mfuwatch: step 40 | MFU n/a | 533 tokens/s | step 1.50 s | memory-bound 23% (window at step 30)")


def test_a_failing_line_is_counted_and_training_goes_on(monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("console gone")

    monkeypatch.setattr(agent_thread, "progress_line", boom)
    a = _run(12, exporter=False)
    assert a.errors.get("progress") >= 1
    assert a.latest.step == 12  # every report still made
    assert sum("progress failed" in r.getMessage() for r in caplog.records) == 1  # logged once


_SCRIPT = textwrap.dedent("""
    import logging, sys
    from mfuwatch.agent import Agent
    if sys.argv[1] == "quiet":
        logging.getLogger("mfuwatch").setLevel(logging.WARNING)
    a = Agent(config=dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="s",
                          flops_per_step=1e9, report_every_steps=2))
    for _ in range(3):
        a.step(tokens=10)
    a.close()
""")


@pytest.mark.parametrize("mode", ["plain", "quiet"])
def test_unconfigured_logging_still_shows_the_line(mode):
    # a fresh script configures no logging: Python's last-resort handler would drop INFO lines
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("mfuwatch: step ")]
    if mode == "plain":
        assert lines and lines[-1].startswith("mfuwatch: step 3 | MFU n/a | ")
    else:
        assert lines == []
