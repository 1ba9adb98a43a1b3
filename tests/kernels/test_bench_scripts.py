"""The GPU benchmark scripts of the fused kernels run end to end on their CPU paths (plumbing only, no timing
claims): benchmarks/rotary.py --smoke and benchmarks/hf_llama_e2e.py --tiny."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(args, tmp_path, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_rotary_benchmark_smoke(tmp_path):
    out = run(["benchmarks/rotary.py", "--smoke", "--repeats", "1"], tmp_path)
    assert re.search(r"^\| mfuwatch \| [0-9.]+ \|", out, re.M) and re.search(r"^\| eager \| [0-9.]+ \|", out, re.M)
    assert "Failures" not in out  # the correctness checks of both providers passed
    assert (tmp_path / "rotary.json").exists()


@pytest.mark.slow
def test_hf_llama_e2e_tiny_runs_each_configuration_in_its_own_process(tmp_path):
    pytest.importorskip("transformers")
    out = run(["benchmarks/hf_llama_e2e.py", "--tiny", "--configs", "eager,eager_patch", "--steps", "1",
               "--warmup", "1"], tmp_path)
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (eager\w*) \| ([0-9.]+) \(", out, re.M)}
    assert set(rows) == {"eager", "eager_patch"} and all(v > 0 for v in rows.values()), out
    assert "eager_patch: swiglu x2, rms_norm x5, rotary x2" in out
    losses = set(re.findall(r"V=256 eager\w*: ([0-9.]+)", out.split("First-step losses")[1]))
    assert len(losses) == 1, out  # same weights and batch in both processes
    assert (tmp_path / "hf_llama_e2e.md").read_text().startswith("# Hugging Face Llama end to end")
