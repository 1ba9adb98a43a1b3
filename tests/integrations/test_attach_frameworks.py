"""Frameworks nobody here wrote, under ``mfuwatch run``: an unmodified Hugging Face Trainer script, a
Lightning script and an Accelerate script (tiny Llama from a config, a few steps, CPU).

Each script writes the framework's own numbers; the attached agent's timeline must agree with them:
optimizer steps (the job's step 1 is not measured: the agent attaches at its end), tokens per step (batch
x sequence, x micro-batches under gradient accumulation), and for the Trainer, FLOPs: under
``flops_convention: 6n`` the agent's model FLOPs per step are the Trainer's ``total_flos`` per step, to
the FLOP (both are 6 x tokens x parameters without embeddings). Step time is bounded by the
framework's own wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfuwatch.agent.live.timeline import read_timeline

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "attach"
SEQ = 16


def _run(tmp_path, script, args, **cfg):
    tl = tmp_path / "tl.jsonl"
    conf = tmp_path / "agent.yaml"
    conf.write_text(yaml.safe_dump(dict(exporter=False, nvml=False, profile_every="off", alerts=False,
                                        report_every_steps=1, progress=False, timeline=str(tl), peak_flops=1e12,
                                        **cfg)))
    out = tmp_path / "framework.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    for k in ("MFUWATCH_CONFIG", "MFUWATCH_DISABLE", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "mfuwatch.agent.cli", "run", "--config", str(conf), "--",
           sys.executable, str(FIX / script), "--out", str(out), *args]
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "attaching failed" not in p.stderr, p.stderr[-3000:]
    recs = list(read_timeline(tl))
    steps = [r for r in recs if r["kind"] == "step"]
    run = [r for r in recs if r["kind"] == "run"][-1]
    return steps, run, json.loads(out.read_text())


@pytest.mark.slow
def test_hugging_face_trainer_under_mfuwatch_run(tmp_path):
    pytest.importorskip("transformers")
    steps, run, fw = _run(tmp_path, "hf_trainer.py", ["--steps", "6", "--batch", "4"], flops_convention="6n")
    assert fw["global_step"] == 6
    assert [s["step"] for s in steps] == [2, 3, 4, 5, 6]
    assert all(s["tokens"] == 4 * SEQ for s in steps)
    assert run["flops_convention"] == "6n" and run["flops_source"] == "analytic"
    per_step = fw["total_flos"] / fw["global_step"]  # the Trainer's own FLOPs: 6 x tokens x N per micro-batch
    assert all(s["model_flops"] == pytest.approx(per_step, rel=1e-9) for s in steps)
    assert sum(s["step_time_seconds"] for s in steps) < fw["train_runtime"]
    if "train_tokens_per_second" in fw:  # the Trainer's is over all steps, its first and its set-up included
        assert min(s["tokens_per_second"] for s in steps) > 0.5 * fw["train_tokens_per_second"]


@pytest.mark.slow
def test_lightning_under_mfuwatch_run_attaches_to_the_model_training_step_calls(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    steps, run, fw = _run(tmp_path, "lightning_train.py", ["--steps", "6", "--batch", "4", "--accumulate", "2"])
    assert fw["global_step"] == 6
    assert [s["step"] for s in steps] == [2, 3, 4, 5, 6]
    assert all(s["tokens"] == 2 * 4 * SEQ for s in steps)  # two micro-batches per optimizer step
    # the LightningModule is never called itself: the attached model is the Llama inside it (analytic FLOPs)
    assert run["flops_source"] == "analytic" and run["flops_inputs"]["layers"] == 2
    assert sum(s["step_time_seconds"] for s in steps) < fw["fit_seconds"]


@pytest.mark.slow
def test_accelerate_under_mfuwatch_run_with_gradient_accumulation(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    steps, run, fw = _run(tmp_path, "accelerate_train.py", ["--micro", "12", "--batch", "4", "--accumulate", "2"])
    assert fw["optimizer_steps"] == 6 and fw["micro_batches"] == 12
    assert [s["step"] for s in steps] == [2, 3, 4, 5, 6]
    assert all(s["tokens"] == 2 * 4 * SEQ for s in steps)
    assert run["flops_source"] == "analytic"
    assert sum(s["step_time_seconds"] for s in steps) < fw["loop_seconds"]
