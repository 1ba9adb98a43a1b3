"""``mfuwatch demo`` as a user runs it: ``--steps 1`` succeeds, the timeline appends and records loss and
tokens per step, ``--quiet`` is quiet (no Kineto USDT lines), Ctrl-C exits 130 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mfuwatch.agent.demo import _parse, main

ARGS = ["--device", "cpu", "--port", "0", "--report", "", "--batch", "4", "--seq", "32", "--log-every", "1"]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_steps_1_succeeds_and_the_timeline_appends(tmp_path, monkeypatch):
    monkeypatch.setenv("MFUWATCH_CONFIG", "")
    tl = tmp_path / "t.jsonl"
    for _ in range(2):
        assert main(ARGS + ["--steps", "1", "--profile-every", "off", "--timeline", str(tl), "--quiet"]) == 0
    recs = _records(tl)
    # each run writes its run record(s) then steps: two runs appended means a run record after a step record
    kinds = [r["kind"] for r in recs]
    assert kinds.count("step") == 2 and kinds[0] == "run"
    first_step = kinds.index("step")
    assert "run" in kinds[first_step + 1:]  # the second run was appended, not written over the first


def test_quiet_run_records_loss_and_tokens_per_step(tmp_path):
    tl = tmp_path / "t.jsonl"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MFUWATCH_CONFIG": ""}
    cmd = [sys.executable, "-m", "mfuwatch.agent.cli", "demo", *ARGS, "--steps", "12", "--profile-every", "3 steps",
           "--timeline", str(tl), "--quiet"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "USDT" not in out.stderr and "profiler_start" not in out.stderr
    steps = [r for r in _records(tl) if r["kind"] == "step"]
    assert steps
    for r in steps:
        assert r["tokens_per_step"] == 4 * 32  # per step, like model_flops
        assert r["tokens"] == r["tokens_per_step"] * r["steps"]  # the interval's total
        assert isinstance(r["loss"], float) and r["loss"] > 0


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MFUWATCH_CONFIG": "", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "mfuwatch.agent.cli", "demo", *ARGS, "--steps", "100000", "--profile-every",
           "2 steps", "--timeline", str(tmp_path / "t.jsonl"), "--summary-json", str(tmp_path / "s.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)  # its own process group, like a terminal's foreground job
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while time.monotonic() < deadline and "step     6" not in seen:
            seen += proc.stdout.readline()
        assert "step     6" in seen, seen[-2000:]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to the whole foreground group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["interrupted"] is True
    assert summary["agent_errors"].get("profiler", 0) == 0  # the analysis child was not killed by the SIGINT


@pytest.mark.parametrize("value", ["meta", "tpu", "cuda:x", "cuda:-1", "CPU", "cpu:0", ""])
def test_an_unsupported_device_is_a_usage_error_naming_the_option(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--device", value, "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and "cpu, cuda or cuda:N" in err
    assert "Traceback" not in err and "Expected one of" not in err  # not torch's whole device list


def test_cuda_is_refused_when_torch_sees_no_cuda_device(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value in ("cuda", "cuda:0"):
        with pytest.raises(SystemExit) as exc:
            main(["--device", value, "--steps", "1"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --device" in err and "torch.cuda.is_available() is False" in err and "cpu" in err


def test_a_cuda_index_past_the_device_count_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _parse(["--device", "cuda:1"]).device == "cuda:1"
    assert _parse(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit) as exc:
        _parse(["--device", "cuda:2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and "cuda:0..cuda:1" in err
    assert _parse(["--device", "cpu"]).device == "cpu"


def test_without_quiet_the_profiler_windows_print_no_kineto_lines(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MFUWATCH_CONFIG": ""}
    env.pop("KINETO_LOG_LEVEL", None)
    cmd = [sys.executable, "-m", "mfuwatch.agent.cli", "demo", *ARGS, "--steps", "8", "--profile-every", "3 steps",
           "--timeline", str(tmp_path / "t.jsonl")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step     8" in out.stdout  # not quiet: the progress lines are there
    assert any(r["kind"] == "window" for r in _records(tmp_path / "t.jsonl"))  # a window was recorded
    both = out.stdout + out.stderr
    assert "USDT" not in both and "profiler_start" not in both and "profiler_stop" not in both


def test_kineto_log_level_is_set_unless_the_user_set_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MFUWATCH_CONFIG", "")
    run = ARGS + ["--steps", "1", "--profile-every", "off", "--timeline", ""]
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)  # restored at teardown
    assert main(run) == 0
    assert os.environ["KINETO_LOG_LEVEL"] == "6"  # above Kineto's levels: its info lines are off
    monkeypatch.setenv("KINETO_LOG_LEVEL", "0")
    assert main(run) == 0
    assert os.environ["KINETO_LOG_LEVEL"] == "0"  # the user's choice stands
