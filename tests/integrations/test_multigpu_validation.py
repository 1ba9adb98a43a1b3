"""``benchmarks/multigpu_validation.py`` under ``torchrun --nproc-per-node 2`` on gloo (CPU, tiny Llama).

The parts that are cheap on 2 cores: per-rank FLOPs of DDP, FSDP2 and FSDP2 + TP 2 against FlopCounterMode
(ranks get different batch sizes, so a count that ignores the rank's own work fails), the hang watchdog
naming the stopped rank while the other waits in a collective, and the goodput buckets against times taken
outside the agent. Reads the JSON each part writes under $OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_multigpu_validation_parts_on_gloo(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "multigpu_validation.py"), "--tiny", "--cpu", "--parts", "mfu,hang,goodput",
           "--work", str(tmp_path / "work"), "--hang-floor", "1.5"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail

    mfu = json.loads((out / "multigpu_mfu.json").read_text())
    assert {(r["scheme"], r["rank"]) for r in mfu} == {(s, r) for s in ("ddp", "fsdp", "fsdp_tp") for r in (0, 1)}
    for r in mfu:
        assert r.get("error") is None, r
        assert abs(r["agent_flops"] / r["truth_flops"] - 1) <= 0.02, r
    by = {(r["scheme"], r["rank"]): r for r in mfu}
    # rank 1 trains 3 sequences, rank 0 two (DDP, FSDP): the truth itself must differ by the batch
    for s in ("ddp", "fsdp"):
        assert by[(s, 1)]["truth_flops"] > 1.4 * by[(s, 0)]["truth_flops"]
    # TP 2 with one data-parallel group: both ranks do the same, less than the whole model's work
    assert by[("fsdp_tp", 0)]["truth_flops"] == by[("fsdp_tp", 1)]["truth_flops"] < by[("fsdp", 0)]["truth_flops"]

    hang = {r["rank"]: r for r in json.loads((out / "multigpu_hang.json").read_text())}
    assert hang[1]["stopped"] and hang[1]["hang_reports"] == 1 and not hang[1]["waits_in_collective"]
    assert hang[0]["hang_reports"] == 1 and hang[0]["waits_in_collective"], hang[0]
    assert "all_reduce" in hang[0]["where"]
    assert all(r["resolved"] for r in hang.values())

    for r in json.loads((out / "multigpu_goodput.json").read_text()):
        a, m = r["agent"], r["measured"]
        for b in ("eval", "checkpoint_save", "checkpoint_load"):
            assert a[b] == pytest.approx(m[b], rel=0.05, abs=0.005), (b, r)
        assert r["redo_steps"] == 4
        assert a["lost_progress"] > 0
        assert sum(a.values()) == pytest.approx(r["wall"], rel=0.05)
