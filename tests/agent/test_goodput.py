"""Goodput buckets against a scripted run: known input waits, a warm-up step, an eval phase, a torch.save checkpoint.

The goodput clock of the agent is replaced by a fake one advanced by the script, so every bucket has an
exact expected value; the torch.save checkpoint advances the fake clock from inside the pickler (the
object's ``__reduce__``), i.e. while the real ``torch.save`` runs through the agent's hook.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mfuwatch.agent import Agent
from mfuwatch.agent.goodput import BUCKETS, GoodputClock, phase_bucket, steps_to_redo
from mfuwatch.agent.timeline import read_timeline
from tests.helpers.fake_clock import FakeClock

BASE = dict(exporter=False, nvml=False, profile_every="off", alerts=False, report_every_steps=1,
            flops_per_step=1e9, peak_flops=1e15, goodput_warmup_steps=1, hang_watchdog=False)


class SlowToPickle:
    """Advances the fake clock by ``seconds`` when torch.save pickles it."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def __reduce__(self):
        self.clock.t += self.seconds
        return (int, (0,))


def _agent(tmp_path, **kw):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = Agent(model, opt, config=dict(BASE, timeline=str(tmp_path / "timeline.jsonl"), **kw))
    clock = FakeClock()
    agent.fleet.goodput._now = clock
    agent.fleet.goodput._t = 0.0
    return model, opt, agent, clock


def _step(model, opt, clock, compute):
    loss = model(torch.ones(2, 4)).sum()  # forward pre-hook: the step starts here
    clock.t += compute
    loss.backward()
    opt.step()  # step post-hook: the boundary
    opt.zero_grad()


def _buckets(agent, run):
    return {b: agent.registry.get_sample_value("mfuwatch_goodput_seconds_total",
                                               {"run": run, "rank": "0", "bucket": b}) for b in BUCKETS}


def test_scripted_run_fills_each_bucket_with_its_known_time(tmp_path):
    model, opt, agent, clock = _agent(tmp_path, run="gp")
    waits = [5.0, 0.5, 0.25, 2.0, 0.75, 0.5]  # before each step's forward; the first is start-up
    for i, w in enumerate(waits, 1):
        clock.t += w
        _step(model, opt, clock, compute=1.0)
        if i == 3:
            with agent.phase("eval"):
                clock.t += 4.0
        if i == 4:
            torch.save({"weights": SlowToPickle(clock, 3.0)}, tmp_path / "ckpt.pt")
    clock.t += 0.125  # tail before close
    got = _buckets(agent, "gp")
    ratio = agent.registry.get_sample_value("mfuwatch_goodput_ratio", {"run": "gp", "rank": "0"})
    agent.close()
    want = {"startup": 5.0, "warmup": 1.0, "productive": 5.0, "input_wait": 0.5 + 0.25 + 2.0 + 0.75 + 0.5,
            "eval": 4.0, "checkpoint_save": 3.0, "checkpoint_load": 0.0, "lost_progress": 0.0, "other": 0.0}
    assert got == pytest.approx(want)
    assert ratio == pytest.approx(5.0 / sum(want.values()))
    after = agent.fleet.goodput.snapshot()
    assert after["other"] == pytest.approx(0.125)  # close() counts the tail
    recs = list(read_timeline(tmp_path / "timeline.jsonl"))
    ckpts = [r for r in recs if r["kind"] == "checkpoint"]
    assert [(c["step"], c["source"]) for c in ckpts] == [(4, "torch.save")]
    assert [(p["name"], p["step"]) for p in recs if p["kind"] == "phase"] == [("eval", 3), ("torch.save", 4)]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False) == {"weights": 0}  # the hook changed nothing about the file


def test_eval_phase_stays_out_of_step_time(tmp_path):
    model, opt, agent, _ = _agent(tmp_path, run="gp-steptime")
    import time

    for i in range(4):
        _step(model, opt, FakeClock(), compute=0.0)
        if i == 1:
            with agent.phase("eval"):
                time.sleep(0.5)
    agent._tick(final=False)
    total = agent.registry.get_sample_value("mfuwatch_step_seconds_total", {"run": "gp-steptime", "rank": "0"})
    agent.close()
    assert total < 0.25  # four tiny steps; the 0.5 s eval is not in them


def test_restart_counts_the_steps_after_the_last_checkpoint_as_lost_progress(tmp_path):
    model, opt, agent, clock = _agent(tmp_path, run="gp-restart")
    for i in range(1, 7):
        _step(model, opt, clock, compute=1.0)
        if i == 4:
            with agent.phase("checkpoint"):
                clock.t += 1.0
    agent.close()
    # the job dies after step 6 and restarts from the step-4 checkpoint: steps 5 and 6 are re-done
    lost = steps_to_redo(read_timeline(tmp_path / "timeline.jsonl"))
    assert (lost["steps"], lost["last_step"], lost["checkpoint_step"]) == (2, 6, 4)
    model, opt, agent, clock = _agent(tmp_path, run="gp-restart")
    assert agent.fleet.goodput.redo_steps == 2
    for _ in range(5):
        _step(model, opt, clock, compute=1.0)
    got = _buckets(agent, "gp-restart")
    agent.close()
    assert (got["warmup"], got["lost_progress"], got["productive"]) == pytest.approx((1.0, 2.0, 2.0))
    attempts = [r for r in read_timeline(tmp_path / "timeline.jsonl") if r["kind"] == "attempt"]
    assert [a["lost_steps"] for a in attempts] == [0, 2]


def test_no_checkpoint_means_every_step_of_the_attempt_is_lost():
    recs = [{"kind": "attempt"}, {"kind": "step", "step": 10, "steps": 10, "step_time_seconds": 0.5},
            {"kind": "attempt"}, {"kind": "run"}, {"kind": "step", "step": 3, "steps": 3, "step_time_seconds": 2.0}]
    assert steps_to_redo(recs) == {"steps": 3.0, "seconds": 6.0, "last_step": 3.0, "checkpoint_step": 0.0}


def test_lost_seconds_count_only_the_steps_after_the_checkpoint():
    recs = [{"kind": "attempt"}, {"kind": "step", "step": 10, "steps": 10, "step_time_seconds": 0.5},
            {"kind": "run"}, {"kind": "checkpoint", "phase": "save", "step": 7},
            {"kind": "step", "step": 12, "steps": 2, "step_time_seconds": 1.0}]
    out = steps_to_redo(recs)
    assert out["steps"] == 5 and out["seconds"] == pytest.approx(3 * 0.5 + 2 * 1.0)


def test_unknown_phase_name_fails_at_the_call_naming_the_accepted_ones(tmp_path):
    _, _, agent, _ = _agent(tmp_path, run="gp-bad")
    with pytest.raises(ValueError, match="accepted: .*checkpoint.*eval"):
        agent.phase("evl")
    agent.close()
    assert phase_bucket("checkpoint_load") == "checkpoint_load"


def test_without_a_forward_hook_the_whole_step_is_step_time():
    clock = FakeClock()
    g = GoodputClock(warmup_steps=0, now=clock)
    for _ in range(3):
        clock.t += 2.0
        g.boundary(g._steps + 1)
    assert g.snapshot()["productive"] == pytest.approx(6.0)
    assert g.snapshot()["input_wait"] == 0.0


def test_a_compiling_step_is_warmup():
    clock = FakeClock()
    g = GoodputClock(warmup_steps=0, now=clock)
    g.forward_start()
    clock.t += 3.0
    assert g.boundary(1, compiled=True) == "warmup"
    g.forward_start()
    clock.t += 1.0
    assert g.boundary(2) == "productive"
    assert (g.snapshot()["warmup"], g.snapshot()["productive"]) == (3.0, 1.0)


def test_checkpoint_hooks_are_removed_at_close(tmp_path):
    original = torch.save
    _, _, agent, _ = _agent(tmp_path, run="gp-unhook")
    assert torch.save is not original and torch.save.__mfuwatch_original__ is original
    agent.close()
    assert torch.save is original


def test_a_failing_torch_save_raises_its_own_error_and_closes_the_phase(tmp_path):
    model, opt, agent, clock = _agent(tmp_path, run="gp-fail")
    _step(model, opt, clock, compute=1.0)
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.save({}, tmp_path / "no" / "such" / "dir" / "x.pt")
    assert agent.fleet.open_phase() is None
    agent.close()


def test_torch_distributed_checkpoint_save_and_load_are_timed(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")  # imported before the agent: hooked
    model, opt, agent, clock = _agent(tmp_path, run="gp-dcp")
    _step(model, opt, clock, compute=1.0)
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    agent.close()
    phases = [(p["name"], p["bucket"]) for p in read_timeline(tmp_path / "timeline.jsonl") if p["kind"] == "phase"]
    # DCP writes through torch.save internally: counted once, as the outer call
    assert phases == [("torch.distributed.checkpoint.save", "checkpoint_save"),
                      ("torch.distributed.checkpoint.load", "checkpoint_load")]
    ckpts = [r for r in read_timeline(tmp_path / "timeline.jsonl") if r["kind"] == "checkpoint"]
    assert [(c["step"], c["source"]) for c in ckpts] == [(1, "torch.distributed.checkpoint.save")]


def test_only_the_timelines_tail_is_read_at_start(tmp_path):
    from mfuwatch.agent.goodput import tail_records

    p = tmp_path / "t.jsonl"
    old = "".join('{"kind":"step","step":%d,"steps":1,"step_time_seconds":1.0}\n' % i for i in range(1, 2001))
    p.write_text(old + '{"kind":"attempt"}\n{"kind":"step","step":5,"steps":5,"step_time_seconds":2.0}\n{"kind":"st')
    recs = tail_records(p, max_bytes=300)  # a cut first line, the last attempt, a torn last line
    assert recs[-2:] == [{"kind": "attempt"}, {"kind": "step", "step": 5, "steps": 5, "step_time_seconds": 2.0}]
    assert len(recs) < 10
    assert steps_to_redo(recs)["steps"] == 5 and steps_to_redo(recs)["seconds"] == 10.0


def test_a_checkpoint_before_the_first_step_counts_as_checkpoint_time(tmp_path):
    """A restart saves or loads before its first step: the hooks must count it (the training thread is not
    known from a forward yet; the thread that built the agent stands for it)."""
    model, opt, agent, clock = _agent(tmp_path, run="gp-first")
    clock.t += 1.0  # set-up before the checkpoint: start-up
    torch.save({"weights": SlowToPickle(clock, 2.5)}, tmp_path / "ckpt.pt")  # 2.5 s inside the hooked save
    clock.t += 0.5
    _step(model, opt, clock, compute=1.0)
    agent.close()
    b = _buckets(agent, "gp-first")
    assert b["checkpoint_save"] == 2.5
    assert b["startup"] == 1.5  # 1.0 before the save + 0.5 after it, up to the first forward
