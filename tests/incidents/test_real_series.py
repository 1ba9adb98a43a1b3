"""The shipped Prometheus rules over series a real agent served (tests/incidents/real_series.py).

``recorded/checkpoint_h200_run3.jsonl.gz``: the agent's /metrics scraped every second on an H200 while an HF
Llama trained 15 s, sat 45 s in ``agent.phase("checkpoint")`` with the GPU idle, and trained 10 s more
(``benchmarks/checkpoint_replay.py``, docs/gpu-runs/gain_truth-run3.md). Issue 24's incident: the MFU gauge
keeps its last value through the phase while the GPU does nothing; with ``MfuAboveTensorActivity``'s ``for``
at 20 s neither path may page. A synthetic exposition that does over-count shows the evaluation can fire.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.debian_tools import ensure_binary
from tests.incidents import real_series as RS

RECORDED = Path(__file__).resolve().parent / "recorded" / "checkpoint_h200_run3.jsonl.gz"
RULES = {"MfuAboveTensorActivity": {"for": "20s"}}


@pytest.fixture(scope="module")
def promtool():
    return ensure_binary(("promtool",), "prometheus")


def _points(ser, prefix):
    (key,) = [k for k in ser if k.startswith(prefix + "{")]
    return ser[key]


def test_the_recorded_h200_checkpoint_holds_the_incidents_precondition():
    scrapes = RS.load(str(RECORDED))
    ser, points = RS.series(scrapes)
    assert points >= 70 and len(scrapes) >= 70
    phase = _points(ser, "mfuwatch_phase_in_progress")
    in_phase = [i for i, v in enumerate(phase) if v == "1.0"]
    assert len(in_phase) >= 40  # the 45 s phase, seen at 1 s scrapes
    mfu = _points(ser, "mfuwatch_mfu_ratio")
    assert all(mfu[i] is not None and float(mfu[i]) > 0.2 for i in in_phase)  # the MFU gauge stays up in the phase
    # the in-process engine fired nothing (its mfuwatch_alerts_firing gauges, every rule, every scrape)
    firing = [k for k, v in ser.items() if k.startswith("mfuwatch_alerts_firing{") and any(x not in (None, "0.0")
                                                                                             for x in v)]
    assert firing == []


def test_the_shipped_rules_do_not_page_on_the_recorded_h200_checkpoint(promtool):
    got = RS.evaluate(RS.load(str(RECORDED)), promtool, RULES)
    assert got["sentinel"] == 1.0 and got["evaluations"] >= 14
    assert got["firing"] == {}


def _exposition(mfu: float, tensor: float) -> str:
    lab = '{job="train",rank="0",run="r"}'
    return "\n".join([
        '# TYPE mfuwatch_run_info gauge', f'mfuwatch_run_info{lab[:-1]},gpu="H200 \\"SXM\\""}} 1.0',
        '# TYPE mfuwatch_mfu_ratio gauge', f"mfuwatch_mfu_ratio{lab} {mfu}",
        '# TYPE mfuwatch_interval_tensor_active_bound_ratio gauge',
        f"mfuwatch_interval_tensor_active_bound_ratio{lab} {tensor}",
        '# TYPE mfuwatch_stall_seconds gauge', f"mfuwatch_stall_seconds{lab} 0.5",
        '# TYPE mfuwatch_last_step_duration_seconds gauge', f"mfuwatch_last_step_duration_seconds{lab} 0.5", ""])


def test_an_over_counted_mfu_in_real_exposition_format_does_fire(promtool):
    # 60 scrapes a second apart: MFU 0.50 against a tensor-active bound of 0.30 (0.20 over the 0.05 margin)
    # from the start; with for: 20s the alert fires at the first 5 s evaluation at least 20 s after it is
    # first pending (pending at 0 s: firing from 20 s on)
    scrapes = [(1000.0 + i, _exposition(0.50, 0.30)) for i in range(60)]
    got = RS.evaluate(scrapes, promtool, RULES)
    times = got["firing"][("MfuAboveTensorActivity", "0")]
    assert times[0] == 20.0 and times[-1] == 55.0
    # the same series 0.04 over: inside the margin, nothing fires
    assert RS.evaluate([(1000.0 + i, _exposition(0.34, 0.30)) for i in range(60)], promtool, RULES)["firing"] == {}
