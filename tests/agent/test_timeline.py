"""Timeline: JSONL records round-trip; NaN becomes null; a torn last line is tolerated."""

import math

import pytest

from mfuwatch.agent.schema import StepMeasurement, to_record
from mfuwatch.agent.timeline import Timeline, read_timeline


def test_round_trip_and_nan(tmp_path):
    p = tmp_path / "t.jsonl"
    tl = Timeline(p)
    m = StepMeasurement(step=10, steps=10, timestamp=1.5, step_time_seconds=0.2, tokens=100, tokens_per_second=500.0,
                        model_flops=1e9, hardware_flops=1e9, model_flops_per_second=5e9, mfu=None, loss=math.nan)
    tl.write(to_record("step", m))
    tl.close()
    (r,) = list(read_timeline(p))
    assert r["kind"] == "step" and r["tokens"] == 100 and r["mfu"] is None and r["loss"] is None


def test_torn_last_line_skipped_but_middle_garbage_fails(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"kind":"run"}\n{"kind":"st')
    assert [r["kind"] for r in read_timeline(p)] == ["run"]
    p.write_text('{"kind":"run"}\nnot json\n{"kind":"step"}\n')
    with pytest.raises(ValueError, match=":2:"):
        list(read_timeline(p))


def test_none_path_is_noop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tl = Timeline(None)
    tl.write({"kind": "step"})
    tl.close()
    assert tl.path is None and list(tmp_path.iterdir()) == []  # nothing written anywhere
