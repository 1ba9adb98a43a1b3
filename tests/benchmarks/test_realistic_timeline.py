"""benchmarks/realistic_timeline.py writes the agent's record mix in the agent's own format: the report's
reader and the resume read accept every line, count every record the generator says it wrote, and the
figures they derive equal the generator's own float64 bookkeeping."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mfuwatch.agent.fleet.goodput import read_resume
from mfuwatch.agent.live.timeline import read_timeline
from mfuwatch.agent.report.load import load_timeline

ROOT = Path(__file__).resolve().parents[2] / "benchmarks"


def _gen():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("realistic_timeline", ROOT / "realistic_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_generated_mix_reads_back_with_the_counts_and_figures_it_wrote(tmp_path):
    path = tmp_path / "tl.jsonl"
    got = _gen().make(path, 0.004)  # 4 MB: every kind at least once
    kinds = [r["kind"] for r in read_timeline(path)]
    assert {k: kinds.count(k) for k in got["records"]} == got["records"]
    assert all(got["records"][k] > 0 for k in ("step", "gpu", "window", "phase", "checkpoint", "alert"))
    assert path.stat().st_size == got["bytes"]
    data = load_timeline(path)
    assert data.counts == {k: got["records"][k] for k in ("step", "window", "gpu", "alert")}
    assert data.steps[-1]["step"] == got["steps"]
    assert sum(s["steps"] for s in data.steps) == got["step_sum"]
    drawn = sum(s["mfu"] * s["steps"] for s in data.steps) / sum(s["steps"] for s in data.steps)
    assert drawn == pytest.approx(got["mfu_weighted_mean"], rel=1e-12)
    # the last attempt has checkpoints every 5,000 steps: the lost progress is the steps after the last one
    res = read_resume(path)
    assert res["ignored"] == 0 and res["last_step"] == got["steps"]
    assert res["checkpoint_step"] == got["steps"] // 5000 * 5000
    assert res["steps"] == got["steps"] - res["checkpoint_step"]
    line = json.loads(path.read_text().splitlines()[2])
    assert line["kind"] == "step" and "implausible" in line and "tensor_active" in line  # every StepMeasurement field
