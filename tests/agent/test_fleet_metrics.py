"""Fleet metrics of one rank: the `job` label, the straggler score, and the series budget (counted over HTTP)."""

from __future__ import annotations

import collections
import time

import pytest

from mfuwatch.agent import Agent
from mfuwatch.agent.fleet.goodput import BUCKETS
from mfuwatch.agent.fleet.job import MAX_JOB_LENGTH, resolve_job
from mfuwatch.agent.device.nvml_device import CLOCK_EVENT_REASONS
from mfuwatch.agent.schema import CATEGORIES, GpuHealth, OpShare, Suggestion, WindowMeasurement
from mfuwatch.agent.fleet.straggler import StragglerScore
from tests.helpers.net import scrape


@pytest.mark.parametrize("env,want", [
    ({"MFUWATCH_JOB": "llama-70b", "SLURM_JOB_ID": "123"}, "llama-70b"),
    ({"SLURM_JOB_ID": "48213"}, "slurm-48213"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_NAME": "pretrain-v3"}, "pretrain-v3"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "pretrain-v3-7-x2qzt"}, "pretrain-v3"),  # indexed Job
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "pretrain-v3-b9xk4"}, "pretrain-v3"),
    ({"HOSTNAME": "pretrain-v3-b9xk4"}, "the-run"),  # not in Kubernetes: the pod pattern means nothing
    ({}, "the-run"),
    ({"MFUWATCH_JOB": "a b{c}\"d"}, "a-b-c-d"),  # label-unsafe characters replaced
])
def test_job_label_sources(env, want):
    assert resolve_job("the-run", "", env) == want


def test_job_setting_wins_and_length_is_bounded():
    assert resolve_job("r", "mine", {"MFUWATCH_JOB": "env"}) == "mine"
    assert len(resolve_job("r", "", {"MFUWATCH_JOB": "x" * 10_000})) == MAX_JOB_LENGTH


def test_straggler_score_against_its_own_best_steps():
    s = StragglerScore(history=64, recent=8, min_steps=16)
    for _ in range(40):
        s.observe(0.100)
    assert s.score() == pytest.approx(1.0)
    for _ in range(8):
        s.observe(0.130)  # 30% slower than its own best
    assert s.score() == pytest.approx(0.100 / 0.130)
    s.observe(float("nan"))
    assert s.score() == pytest.approx(0.100 / 0.130)


#: Series of one rank with everything on (NVML with GPM and ECC, a profiler window with top_k ops):
#: the budget documented in docs/fleet.md. Histograms/counters count their _created series too
#: (prometheus-client exposes them).
TOP_K = 8
SUGGESTIONS = 4


def budget(top_k: int, suggestions: int, reasons: int) -> int:
    """The documented per-rank budget, family by family."""
    return (
        1  # run_info
        + 6  # mfu, hfu, model_flops_per_second, tokens_per_second, last_step_duration, last_step_timestamp
        + 1  # stall_seconds (the agent's monotonic stall clock)
        + 4  # interval_{tensor_active,tensor_active_bound,sm_active,dram_active}: GPM over the report's steps
        + 1  # peak_flops_per_second
        + (22 + 1) + 3  # step_duration_seconds: 22 buckets + +Inf, _sum, _count, _created
        + 2 * 2  # steps_total, tokens_total (+ _created)
        + 4 * 2  # model_flops_total, hardware_flops_total, step_seconds_total, hangs_total (+ _created)
        + len(BUCKETS)  # goodput_seconds_total{bucket}
        + 1 + 1  # goodput_ratio, straggler_score_ratio
        + 1  # hang_info (only while a step is stuck; counted as present)
        + 1 + 1  # phase_in_progress, last_phase_end_timestamp_seconds (0 before the first phase)
        + 2 * 2  # implausible_ratio_total{ratio="mfu"|"hfu"} (+ _created): at 0 from the start
        + len(CATEGORIES) + 1 + top_k + 2 * suggestions + 2  # window: breakdown, memory-bound, ops, gains and
        # their order, 2 gauges
        + 11 + 1 + reasons + 1 + 2  # NVML gauges, energy counter, clock reasons, xid, ecc{type}
        + 6 + 1  # exporter_requests_total{code} of 200, 400, 401, 404, 405, 431; exporter_server_cpu_seconds_total
        # (exporter_dropped_connections_total{reason}: none in a healthy run)
    )


def test_series_per_rank_stay_within_the_documented_budget():
    agent = Agent(config=dict(exporter=True, port=0, nvml=False, profile_every="off", alerts=False,
                              flops_per_step=1e9, peak_flops=1e12, run="budget", report_every_steps=1,
                              top_k_ops=TOP_K))
    for _ in range(40):
        agent.step(tokens=64)
        time.sleep(0.002)
    ops = [OpShare(op=f"aten::op{i}", bound="memory", share=0.1, time_seconds=0.01) for i in range(TOP_K)]
    sugg = [Suggestion(kernel=f"k{i}", title="t", apply="a", ops=["x"], time_seconds=0.01, expected_gain=0.1)
            for i in range(SUGGESTIONS)]
    agent.exporter.collector.update(
        window=WindowMeasurement(step=1, timestamp=time.time(), steps=3, wall_seconds=1, busy_seconds=0.5,
                                 breakdown={c: 0.2 for c in CATEGORIES}, memory_bound_share=0.3, top_ops=ops,
                                 suggestions=sugg),
        gpu=GpuHealth(timestamp=time.time(), utilization=0.9, memory_bandwidth_utilization=0.5, sm_clock_hertz=1e9,
                      power_watts=500, power_limit_watts=700, temperature_celsius=60, memory_used_bytes=1,
                      memory_total_bytes=2, energy_joules=5, sm_active=0.9, tensor_active=0.5, dram_active=0.4,
                      clock_event_reasons={r[0]: False for r in CLOCK_EVENT_REASONS},
                      ecc_errors={"corrected": 0, "uncorrected": 0}))
    from mfuwatch.agent.fleet.watchdog import HangReport

    agent.fleet.current_hang = HangReport(step=1, elapsed_seconds=1, threshold_seconds=1, median_step_seconds=1,
                                          where="train.py:10 in loop")
    deadline = time.time() + 10
    while agent.latest is None and time.time() < deadline:
        time.sleep(0.05)
    import dataclasses

    # GPM over the report's steps, as the agent thread attaches it with NVML on (no NVML here)
    agent.exporter.collector.update(step=dataclasses.replace(agent.latest, tensor_active=0.5, tensor_active_bound=0.4,
                                                             sm_active=0.9, dram_active=0.4))
    samples = scrape(agent.exporter_url)
    agent.close()
    labels = {series: dict(series[1]) for series in samples}  # (name, sorted labels) -> labels
    assert all(lab.get("job") == "budget" and lab.get("run") == "budget" and lab.get("rank") == "0"
               for lab in labels.values()), [k for k, lab in labels.items() if "job" not in lab][:3]
    assert len(samples) == budget(TOP_K, SUGGESTIONS, len(CLOCK_EVENT_REASONS))
    # no unbounded label: every label beyond run/rank/job takes values from a bounded set
    values = collections.defaultdict(set)
    for (name, _lab), lab in labels.items():
        for k, v in lab.items():
            if k not in ("run", "rank", "job"):
                values[(name, k)].add(v)
    bounds = {"category": len(CATEGORIES), "op": TOP_K, "bound": 4, "kernel": SUGGESTIONS, "bucket": len(BUCKETS),
              "reason": len(CLOCK_EVENT_REASONS), "type": 2, "le": 23, "frame": 1, "collective": 1,
              "ratio": 2,  # implausible_ratio_total: mfu, hfu
              "code": 6}  # exporter_requests_total: the server's 6 statuses
    for (name, label), vals in values.items():
        if name == "mfuwatch_run_info":
            continue  # one series whatever its labels hold
        assert label in bounds, f"{name}{{{label}}} has no documented bound"
        assert len(vals) <= bounds[label], (name, label, vals)


@pytest.mark.parametrize("key,value,needle", [
    ("hang_factor", 1.0, "hang_factor: expected a finite number > 1"),
    ("hang_floor_seconds", 0, "hang_floor_seconds: expected a finite number > 0"),
    ("goodput_warmup_steps", -1, "goodput_warmup_steps: expected an integer >= 0"),
    ("hang_watchdog", "yes", "hang_watchdog: expected true or false"),
    ("job", 7, "job: expected a string"),
    ("otlp_endpoint", "collector:4318", "otlp_endpoint: expected an http(s):// URL"),
])
def test_bad_fleet_settings_fail_at_start_naming_the_field(key, value, needle):
    from mfuwatch.agent.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config({key: value, "exporter": False})
