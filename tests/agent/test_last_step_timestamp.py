"""``mfuwatch_last_step_timestamp_seconds`` moves at each optimizer step, not at each agent report.

The step hook stores the boundary's own wall-clock stamp (the one the step clock takes anyway); the
gauge serves it. The checks bracket each ``optimizer.step()`` with ``time.time()`` taken here, in the
test, while the agent's report interval is far away, so no report can have moved the gauge.
"""

from __future__ import annotations

import time

import torch

from mfuwatch.agent import Agent
from mfuwatch.agent.schema import M

BASE = dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="ts", peak_flops=1e12,
            flops_per_step=1e6, report_every_steps=10_000)


def _gauge(a: Agent):
    return a.registry.get_sample_value(M.LAST_STEP_TIMESTAMP_SECONDS, {"run": "ts", "rank": "0"})


def _step(model, opt):
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    before = time.time()
    opt.step()  # the optimizer's step post-hook is the agent's step boundary
    after = time.time()
    opt.zero_grad()
    return before, after


def test_gauge_holds_each_steps_end_before_any_report():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = Agent(model, opt, config=BASE)
    try:
        assert _gauge(a) is None  # no step yet: no value rather than a made-up one
        b1, e1 = _step(model, opt)
        v1 = _gauge(a)
        assert v1 is not None and b1 <= v1 <= e1, (b1, v1, e1)
        time.sleep(0.3)
        b2, e2 = _step(model, opt)
        v2 = _gauge(a)
        assert b2 <= v2 <= e2, (b2, v2, e2)
        assert v2 - v1 >= 0.3  # the second step's own time, not the first's
        assert a.latest is None  # no report yet: the gauge moved with the steps alone
    finally:
        a.close()


def test_a_report_does_not_move_the_gauge_back():
    """A report's timestamp is its last step's end: equal to the hook's value, never newer."""
    a = Agent(config=dict(BASE, report_every_steps=2))
    try:
        stamps = []
        for _ in range(4):
            before = time.time()
            a.step(tokens=16)
            stamps.append((before, time.time()))
        deadline = time.time() + 5.0
        while a.latest is None or a.latest.step < 4:
            assert time.time() < deadline, "no report in 5 s"
            time.sleep(0.05)
        v = _gauge(a)
        assert stamps[-1][0] <= v <= stamps[-1][1]
        assert a.latest.timestamp == v  # the report carries the same boundary stamp
    finally:
        a.close()
