"""``torchrun --nproc-per-node 2`` (CPU, gloo) sent SIGTERM mid-run, as Slurm or Kubernetes would: every rank's
agent closes on the signal the torchelastic agent forwards, so each rank's timeline records the signal and every
step it ran."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.net import free_port_pair, scrape
from test_torchrun import _value

from mfuwatch.agent.live.timeline import read_timeline



@pytest.mark.slow
def test_sigterm_to_torchrun_closes_every_rank(tmp_path):
    base = free_port_pair()
    timeline = tmp_path / "timeline.jsonl"
    env = dict(os.environ, MFUWATCH_RUN="torchrun-preempt", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "mfuwatch.agent.cli", "demo", "--device", "cpu", "--steps", "100000", "--batch", "2", "--seq", "32",
           "--port", str(base), "--profile-every", "off", "--report", "", "--log-every", "100000",
           "--timeline", str(timeline), "--summary-json", str(tmp_path / "s.json")]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        up = set()
        while time.monotonic() < deadline and proc.poll() is None and len(up) < 2:
            for r in (0, 1):
                s = scrape(f"http://127.0.0.1:{base + r}/metrics", down_ok=True)
                if s is not None and (_value(s, "mfuwatch_steps_total") or 0) >= 20:
                    up.add(r)
            time.sleep(0.2)
        assert up == {0, 1}, "both ranks should train before the signal"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0  # torchrun reports the workers' termination
    for r in (0, 1):
        records = list(read_timeline(tmp_path / f"timeline.rank{r}.jsonl"))
        sigs = [x for x in records if x["kind"] == "signal"]
        assert [x["signal"] for x in sigs] == ["SIGTERM"], out[-3000:]
        steps = [x for x in records if x["kind"] == "step"]
        assert steps and steps[-1]["step"] == sigs[0]["step"] == sum(x["steps"] for x in steps)
