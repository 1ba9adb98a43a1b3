"""``torchrun --nproc-per-node 2`` (CPU, gloo) sent SIGTERM mid-run, as Slurm or Kubernetes would: every rank's
agent closes on the signal the torchelastic agent forwards, so each rank's timeline records the signal and every
step it ran, the alert rank 0 notified is resolved as preempted, and each rank still ends by the signal, as it
would without the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.net import free_port_pair, scrape
from helpers.receiver import AlertReceiver
from helpers.torchrun_config import write_observed_config
from test_torchrun import _value

from mfuwatch.agent.live.timeline import read_timeline

RECORD_EXIT = str(Path(__file__).resolve().parents[1] / "helpers" / "record_exit.py")


def _alerts(rx, status):
    return [a for r in rx.delivered for a in r.json.get("alerts", []) if a.get("status") == status]


@pytest.mark.slow
def test_sigterm_to_torchrun_closes_every_rank(tmp_path):
    base = free_port_pair()
    timeline = tmp_path / "timeline.jsonl"
    config = tmp_path / "agent.yaml"
    write_observed_config(config, "critical", cooldown="30m")
    with AlertReceiver() as rx:
        env = dict(os.environ, MFUWATCH_RUN="torchrun-preempt", MFUWATCH_TEST_WEBHOOK_URL=rx.url,
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        # each worker is record_exit.py, which runs the demo and writes its exit status to exit.{rank}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", RECORD_EXIT, str(tmp_path),
               "-m", "mfuwatch.agent.cli", "demo", "--device", "cpu", "--steps", "100000", "--batch", "2", "--seq", "32",
               "--port", str(base), "--profile-every", "off", "--report", "", "--log-every", "100000",
               "--config", str(config), "--timeline", str(timeline), "--summary-json", str(tmp_path / "s.json")]
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            deadline = time.monotonic() + 120
            up = set()
            while time.monotonic() < deadline and proc.poll() is None and (len(up) < 2 or not _alerts(rx, "firing")):
                for r in (0, 1):
                    s = scrape(f"http://127.0.0.1:{base + r}/metrics", down_ok=True)
                    if s is not None and (_value(s, "mfuwatch_steps_total") or 0) >= 20:
                        up.add(r)
                time.sleep(0.2)
            assert up == {0, 1}, "both ranks should train before the signal"
            assert _alerts(rx, "firing"), "rank 0 should have notified the firing alert before the signal"
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        # rank 0 is the only notifier (notify_from_all_ranks is false): one firing alert, resolved as preempted
        firing, resolved = _alerts(rx, "firing"), _alerts(rx, "resolved")
    assert [a["labels"]["alertname"] for a in firing] == ["TrainingObserved"], out[-3000:]
    assert [a["labels"]["alertname"] for a in resolved] == ["TrainingObserved"], out[-3000:]
    assert resolved[0]["annotations"]["resolved_reason"] == "run preempted (SIGTERM)"
    assert proc.returncode != 0  # torchrun reports the workers' termination
    for r in (0, 1):
        # the agent closes, puts the default disposition back and re-raises: the rank dies by SIGTERM, as it
        # would without the agent (neither the demo nor torch installs a SIGTERM handler in a worker)
        assert (tmp_path / f"exit.{r}").read_text().strip() == str(-signal.SIGTERM), out[-3000:]
        records = list(read_timeline(tmp_path / f"timeline.rank{r}.jsonl"))
        sigs = [x for x in records if x["kind"] == "signal"]
        assert [x["signal"] for x in sigs] == ["SIGTERM"], out[-3000:]
        steps = [x for x in records if x["kind"] == "step"]
        assert steps and steps[-1]["step"] == sigs[0]["step"] == sum(x["steps"] for x in steps)
