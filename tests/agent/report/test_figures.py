"""Tests of the report's plotly figures (agent/report/figures.py): quantiles, breakdown scaling, empty inputs."""

from __future__ import annotations

import pytest

from mfuwatch.agent.report import figures as rf
from mfuwatch.agent.schema import CATEGORIES, GpuHealth, to_record


def test_weighted_quantile_is_the_inverted_cdf_over_steps():
    # Intervals of 0.1 s (1 step), 0.2 s (1 step), 0.3 s (8 steps): 10 steps in all.
    vals, w = [0.3, 0.1, 0.2], [8, 1, 1]
    assert rf.weighted_quantile(vals, w, 0.10) == 0.1  # cumulative 1/10
    assert rf.weighted_quantile(vals, w, 0.15) == 0.2  # needs 1.5 steps: reached at 2
    assert rf.weighted_quantile(vals, w, 0.50) == 0.3
    assert rf.weighted_quantile(vals, w, 0.99) == 0.3
    assert rf.weighted_quantile([], [], 0.5) is None
    assert rf.weighted_quantile([1.0], [0], 0.5) is None


def test_wall_time_shares_scale_busy_categories_by_one_minus_idle():
    shares = rf.wall_time_shares({"compute_bound": 0.5, "memory_bound": 0.3, "communication": 0.15,
                                  "other": 0.05, "idle": 0.2})
    assert shares == pytest.approx({"compute_bound": 0.4, "memory_bound": 0.24, "communication": 0.12,
                                    "other": 0.04, "idle": 0.2})
    assert sum(shares.values()) == pytest.approx(1.0)
    assert tuple(shares) == CATEGORIES
    assert rf.wall_time_shares({"memory_bound": 1.0}) == {"compute_bound": 0.0, "memory_bound": 1.0,
                                                          "communication": 0.0, "other": 0.0, "idle": 0.0}


def test_empty_inputs_give_a_figure_that_says_why():
    for fig, why in ((rf.mfu_figure([], []), "No step measurements"),
                     (rf.breakdown_figure([]), "No profiler window"),
                     (rf.memory_bound_figure([]), "No profiler window"),
                     (rf.step_time_figure([]), "No step measurements")):
        assert len(fig.data) == 0 and why in fig.layout.annotations[0].text
    step = {"step": 5, "steps": 5, "timestamp": 1.0e9, "step_time_seconds": 0.2, "model_flops_per_second": 1e9,
            "tokens_per_second": 10.0, "mfu": None}
    assert "peak FLOP/s of this device is unknown" in rf.mfu_figure([step], []).layout.annotations[0].text


def test_flops_figure_picks_a_unit_that_fits_a_cpu_run():
    steps = [{"step": i, "timestamp": 1.0e9 + i, "model_flops_per_second": v}
             for i, v in enumerate((2.0e10, 3.0e10))]
    fig = rf.flops_figure(steps, peak=None)
    assert fig.data[0].name == "model GFLOP/s" and list(fig.data[0].y) == pytest.approx([20.0, 30.0])
    assert fig.layout.yaxis.title.text == "GFLOP/s"


def test_gpu_figure_draws_only_the_fields_nvml_reported():
    gpus = [to_record("gpu", GpuHealth(timestamp=1.0e9 + i, utilization=0.5, power_watts=300.0 + i,
                                       memory_used_bytes=2 * 2**30)) for i in range(3)]
    fig = rf.gpu_figure(gpus)
    assert [t.name for t in fig.data] == ["utilization", "power", "used"]
    assert list(fig.data[2].y) == [2.0, 2.0, 2.0]  # GiB
    assert list(fig.data[1].y) == [300.0, 301.0, 302.0]


def test_step_time_figure_skips_intervals_without_a_time():
    # The timeline writes NaN as null: such an interval is left out of the line and of the quantiles.
    steps = [{"step": 10, "steps": 10, "timestamp": 1.0e9, "step_time_seconds": 0.5},
             {"step": 20, "steps": 10, "timestamp": 1.0e9 + 5, "step_time_seconds": None},
             {"step": 30, "steps": 30, "timestamp": 1.0e9 + 20, "step_time_seconds": 0.25}]
    fig = rf.step_time_figure(steps)
    assert list(fig.data[0].y) == [0.5, 0.25]
    p50 = next(t for t in fig.data if t.name == "p50 over the run")
    assert list(p50.y) == [0.25, 0.25]  # 30 of the 40 timed steps took 0.25 s


def test_mfu_figure_marks_each_firing_alert():
    steps = [{"step": i, "timestamp": 1.0e9 + 10 * i, "mfu": 0.3, "hfu": 0.4} for i in range(3)]
    alerts = [{"alertname": "MfuLow", "status": "firing", "timestamp": 1.0e9 + 12},
              {"alertname": "InputStall", "status": "firing", "timestamp": 1.0e9 + 12},
              {"alertname": "MfuLow", "status": "resolved", "timestamp": 1.0e9 + 19}]
    fig = rf.mfu_figure(steps, alerts)
    assert [a.text for a in fig.layout.annotations] == ["MfuLow", "InputStall"]
    assert len(fig.layout.shapes) == 2
    assert fig.layout.annotations[0].yshift != fig.layout.annotations[1].yshift  # labels do not overlap
