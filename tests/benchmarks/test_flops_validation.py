"""benchmarks/flops_validation.py runs end to end on tiny models on the CPU (the H200 run uses the same path)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def test_tiny_cpu_run_prints_the_tables_and_passes():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "flops_validation.py"), "--tiny", "--cpu"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    for model in ("Llama GQA", "Mixtral-style MoE", "Llama + LoRA"):
        row = next(r for r in rows if r.startswith(f"| {model} |"))
        assert row.split("|")[5].strip() == "1.0000"  # agent FLOPs / FlopCounterMode FLOPs, exact on these shapes
    assert "skipped_other_profiler=" in out.stdout and "both bugs gone: yes" in out.stdout
