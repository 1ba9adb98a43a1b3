"""The main job: `mfuwatch demo` trains for real, its loss falls, and it reports MFU against a calibrated peak."""

import json
import subprocess
import sys

import pytest

from mfuwatch.agent.demo import load_stdlib_text
from mfuwatch.agent.live.timeline import read_timeline


def test_stdlib_text_is_real_python_source():
    data = load_stdlib_text(max_bytes=1 << 20)
    text = bytes(data[:200_000].tolist()).decode("utf-8", errors="replace")
    assert data.numel() == 1 << 20
    assert "def " in text and "import " in text


def test_demo_without_plotly_stops_before_training_with_the_install_line(tmp_path, capsys, monkeypatch):
    from mfuwatch.agent.demo import main

    monkeypatch.setitem(sys.modules, "plotly", None)  # an install without the report extra
    assert main(["--steps", "1", "--timeline", str(tmp_path / "t.jsonl"), "--report", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'mfuwatch[report]'" in err[0] and "--report ''" in err[0]
    assert not (tmp_path / "t.jsonl").exists()  # nothing ran


@pytest.mark.slow
def test_demo_20_steps_loss_falls(tmp_path):
    summary = tmp_path / "summary.json"
    timeline = tmp_path / "timeline.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "mfuwatch.agent.cli", "demo", "--steps", "20", "--port", "0", "--log-every", "5",
         "--profile-every", "off", "--timeline", str(timeline), "--report", "", "--summary-json", str(summary)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == 20
    assert s["final_loss"] < s["initial_loss"] - 0.5  # from ~ln(256)=5.5 down past 5.0 in 20 steps
    assert s["exporter_url"].startswith("http://127.0.0.1:")
    assert s["peak_source"].startswith("calibrated")
    # MFU against a calibrated CPU matmul peak: positive and of order one (the calibration is a best-of-5
    # 1024^3 matmul, so a loaded CI machine can make it read low; the arithmetic itself is tested exactly
    # in test_core.py)
    assert s["peak_flops_per_second"] > 1e8
    assert 0.01 < s["mean_mfu"] < 3
    assert s["flops_source"] == "analytic"
    assert "exporter: http://127.0.0.1:" in proc.stdout
    records = list(read_timeline(timeline))
    assert records[0]["kind"] == "run"
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and steps[-1]["step"] == 20
    assert sum(r["tokens"] for r in steps) == 20 * 16 * 128  # every step's tokens, none dropped
