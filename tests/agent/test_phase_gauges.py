"""The phase series the Prometheus ``TrainingStalled`` rules read, from a real agent on the CPU.

``mfuwatch_phase_in_progress`` must be 1 exactly while an ``agent.phase()`` block (or
``begin_phase``/``end_phase``) is open, and ``mfuwatch_last_phase_end_timestamp_seconds`` the unix time
the last block ended (0 before the first). A failure while setting them is counted under
``phase`` and never reaches the training loop; the rest of the phase (its goodput bucket, its timeline
record) still happens.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from mfuwatch.agent import Agent
from mfuwatch.agent.fleet.accounting import FleetAccounting
from mfuwatch.agent.schema import M
from mfuwatch.agent.live.timeline import read_timeline

BASE = dict(exporter=False, nvml=False, profile_every="off", alerts=False, report_every_steps=1,
            flops_per_step=1e9, peak_flops=1e15, hang_watchdog=False, auto_checkpoint_phases=False)


def _agent(tmp_path, run):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = Agent(model, opt, config=dict(BASE, run=run, timeline=str(tmp_path / "timeline.jsonl")))
    return model, opt, agent


def _step(model, opt):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _phase_series(agent, run):
    labels = {"run": run, "rank": "0"}
    return (agent.registry.get_sample_value(M.PHASE_IN_PROGRESS, labels),
            agent.registry.get_sample_value(M.LAST_PHASE_END_TIMESTAMP_SECONDS, labels))


def test_phase_gauges_move_at_phase_begin_and_end(tmp_path):
    model, opt, agent = _agent(tmp_path, "pg")
    try:
        _step(model, opt)
        assert _phase_series(agent, "pg") == (0.0, 0.0)  # no phase yet: end time 0
        with agent.phase("eval"):
            assert _phase_series(agent, "pg") == (1.0, 0.0)
            time.sleep(0.01)
            before = time.time()
        after = time.time()
        in_phase, ended = _phase_series(agent, "pg")
        assert in_phase == 0.0 and before <= ended <= after
        _step(model, opt)
        assert _phase_series(agent, "pg") == (0.0, ended)  # a step does not move the phase end
        # without a with block, nested: the flag stays up until the outer phase closes
        agent.begin_phase("checkpoint")
        agent.begin_phase("eval")
        agent.end_phase("eval")
        inner_end = _phase_series(agent, "pg")
        assert inner_end[0] == 1.0 and inner_end[1] > ended
        before = time.time()
        agent.end_phase("checkpoint")
        in_phase, outer_end = _phase_series(agent, "pg")
        assert in_phase == 0.0 and before <= outer_end <= time.time()
        agent.end_phase("checkpoint")  # nothing open: nothing moves
        assert _phase_series(agent, "pg") == (0.0, outer_end)
        assert agent.errors.get("phase") == 0
    finally:
        agent.close()


def test_a_failing_phase_gauge_update_is_counted_and_does_not_raise(tmp_path, monkeypatch, caplog):
    model, opt, agent = _agent(tmp_path, "pg-fail")

    def refuse(self, value):
        raise RuntimeError("gauge store failed")

    # the flag's store raises (a data descriptor wins over the instance attribute set in __init__)
    monkeypatch.setattr(FleetAccounting, "phase_in_progress", property(lambda self: False, refuse),
                        raising=False)
    try:
        _step(model, opt)
        with caplog.at_level(logging.WARNING, logger="mfuwatch"):
            with agent.phase("eval"):  # enter and exit each fail once in the gauge update
                time.sleep(0.02)
            _step(model, opt)
        assert agent.errors.get("phase") == 2
        assert sum("phase failed" in r.getMessage() for r in caplog.records) == 1  # logged once
        # the rest of the phase still happened: its goodput time and its timeline record
        eval_seconds = agent.registry.get_sample_value(M.GOODPUT_SECONDS_TOTAL,
                                                       {"run": "pg-fail", "rank": "0", "bucket": "eval"})
        assert eval_seconds >= 0.02
        assert agent.fleet.open_phase() is None
    finally:
        agent.close()
    assert [r["name"] for r in read_timeline(tmp_path / "timeline.jsonl") if r["kind"] == "phase"] == ["eval"]
