"""GPM activity averaged over a report's own steps, and the stall clock the exporter serves (issue 24).

:class:`~mfuwatch.agent.activity.ActivityAverager` against hand-computed time-weighted averages; then a
real agent on the CPU, fed NVML samples by hand (there is no GPU): each report carries the average over
its steps, none for a report whose interval held a phase, and ``mfuwatch_stall_seconds`` is served from
the step hook's monotonic clock and absent while a phase is open.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from mfuwatch.agent import Agent
from mfuwatch.agent.activity import ActivityAverager
from mfuwatch.agent.schema import M, GpuHealth


def _g(t, tensor, clock=1.0, max_clock=2.0, sm=None, dram=None):
    return GpuHealth(timestamp=t, tensor_active=tensor, sm_clock_hertz=clock, sm_clock_max_hertz=max_clock,
                     sm_active=sm, dram_active=dram)


def test_the_average_is_weighted_by_the_time_each_sample_covers():
    a = ActivityAverager()
    a.add(_g(100.0, 0.0))  # the first sample only opens the stamps
    a.add(_g(101.0, 0.8, clock=2.0, sm=0.9, dram=0.4))  # covers (100, 101]
    a.add(_g(103.0, 0.2, clock=1.0, sm=0.5, dram=0.2))  # covers (101, 103]
    avg = a.average(100.5, 103.0)  # 0.5 s of the first, 2 s of the second
    assert avg.tensor_active == pytest.approx((0.5 * 0.8 + 2 * 0.2) / 2.5)
    # the bound is averaged sample by sample: tensor x clock / max clock = 0.8 and 0.1
    assert avg.tensor_active_bound == pytest.approx((0.5 * 0.8 + 2 * 0.1) / 2.5)
    assert avg.sm_active == pytest.approx((0.5 * 0.9 + 2 * 0.5) / 2.5)
    assert avg.dram_active == pytest.approx((0.5 * 0.4 + 2 * 0.2) / 2.5)
    assert a.average(102.0, 110.0) is None  # samples cover 1 s of 8: not an average of the span
    assert a.average(103.0, 103.0) is None


def test_no_average_for_a_report_with_a_phase_in_it():
    a = ActivityAverager()
    for t in range(20):
        a.add(_g(float(t), 0.5))
    assert a.for_report(19.0, 5.0, since=10.0, phase_open=False, last_phase_end=0.0).tensor_active == 0.5
    assert a.for_report(19.0, 5.0, since=10.0, phase_open=False, last_phase_end=12.0) is None  # ended since
    assert a.for_report(19.0, 5.0, since=10.0, phase_open=True, last_phase_end=0.0) is None
    assert a.for_report(19.0, 5.0, since=15.0, phase_open=False, last_phase_end=12.0).tensor_active == 0.5


BASE = dict(exporter=False, nvml=False, profile_every="off", alerts=False, report_every_steps=4,
            flops_per_step=1e9, peak_flops=1e15, hang_watchdog=False, auto_checkpoint_phases=False)


def _train(agent, model, opt, seconds, tensor, steps=None):
    end = time.monotonic() + seconds
    done = 0
    while time.monotonic() < end if steps is None else done < steps:
        done += 1
        agent.reporter.on_gpu_sample(_g(time.time(), tensor, clock=1.5e9, max_clock=2e9))
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)


def _wait_report(agent, after):
    deadline = time.time() + 10
    while time.time() < deadline:
        m = agent.latest
        if m is not None and m.step > after:
            return m
        time.sleep(0.02)
    raise AssertionError("no report")


def test_reports_carry_the_gpm_average_of_their_steps_and_the_exporter_the_stall_clock():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = Agent(model, opt, config=dict(BASE, run="ia"))
    labels = {"run": "ia", "rank": "0"}
    try:
        _train(agent, model, opt, 0.5, 0.6)
        m = _wait_report(agent, 4)
        assert m.tensor_active == pytest.approx(0.6) and m.tensor_active_bound == pytest.approx(0.6 * 0.75)
        assert agent.registry.get_sample_value(M.INTERVAL_TENSOR_ACTIVE_BOUND, labels) == pytest.approx(0.45)
        stall = agent.registry.get_sample_value(M.STALL_SECONDS, labels)
        assert stall is not None and 0.0 <= stall < 5.0
        with agent.phase("eval"):
            for _ in range(3):  # the GPU idles through the eval
                agent.reporter.on_gpu_sample(_g(time.time(), 0.0, clock=1.5e9, max_clock=2e9))
                time.sleep(0.05)
            assert agent.registry.get_sample_value(M.STALL_SECONDS, labels) is None  # no stall during a phase
        step_before = agent.latest.step
        _train(agent, model, opt, 0, 0.6, steps=4)  # one report's worth
        m = _wait_report(agent, step_before)
        assert m.tensor_active is None and m.tensor_active_bound is None  # the eval fell in this interval
        assert agent.registry.get_sample_value(M.INTERVAL_TENSOR_ACTIVE_BOUND, labels) is None
        step_before = m.step
        _train(agent, model, opt, 0.3, 0.6)
        m = _wait_report(agent, step_before)
        assert m.tensor_active_bound == pytest.approx(0.45)  # the next one compares again
    finally:
        agent.close()
