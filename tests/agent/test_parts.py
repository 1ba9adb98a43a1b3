"""The Agent's parts built alone, without an Agent: each gets narrow callables and owns its state."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import CollectorRegistry

from mfuwatch.agent.errors import ErrorCounter
from mfuwatch.agent.fleet.accounting import FleetAccounting, FleetSettings
from mfuwatch.agent.live.clock import Interval
from mfuwatch.agent.live.hooks import HookWiring, TrainingHooks
from mfuwatch.agent.live.reporter import Reporter, ReportWiring
from mfuwatch.agent.live.timeline import Timeline, read_timeline
from mfuwatch.agent.schema import RunInfo


class _Calls:
    """Records every call made through one of its attributes: ``calls.mark(1, 2)`` -> ``("mark", 1, 2)``."""

    def __init__(self, returns=None):
        self.log, self.returns = [], dict(returns or {})

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.log.append((name, *args, *kwargs.values()))
            return self.returns.get(name)
        return record

    def named(self, name):
        return [c[1:] for c in self.log if c[0] == name]


class _NoFlops:
    def on_forward_start(self, *a):
        pass

    def on_forward_end(self):
        pass

    def on_step_end(self, tokens):
        pass


def _hooks(calls, **kw):
    w = HookWiring(mark=calls.mark, clock_start=calls.clock_start, clock_gap=calls.clock_gap, on_dtype=calls.on_dtype,
                   forward_start=calls.forward_start, boundary=calls.boundary, on_step=calls.on_step,
                   last_step_wall=calls.last_step_wall)
    return TrainingHooks(device=torch.device("cpu"), flop_model=_NoFlops(), errors=ErrorCounter(), wiring=w, **kw)


def test_training_hooks_alone_count_tokens_mark_boundaries_and_report_each_new_dtype():
    calls = _Calls(returns={"mark": 1234.5})
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = _hooks(calls, has_optimizer=True)
    h.install(model, opt)
    x = torch.randint(0, 8, (3, 5))  # token ids (B=3, T=5): 15 tokens, seq_len 5
    emb = torch.nn.Embedding(8, 8)
    model(emb(x).detach()).sum().backward()  # float (B, T, C) input: B*T = 15 tokens
    opt.step()
    assert calls.named("forward_start") == [()] and calls.named("clock_start") == [()]
    assert calls.named("mark") == [(1, 15, None)] and calls.named("last_step_wall") == [(1234.5,)]
    assert calls.named("boundary") == [(1,)] and calls.named("on_step") == [(1,)]
    assert h.step == 1 and h.seq_len == 5 and calls.named("on_dtype") == [("fp32",)]
    model(torch.randn(2, 8)).sum().backward()  # same dtype: not reported again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8)).float().sum().backward()
    assert calls.named("on_dtype") == [("fp32",), ("bf16",)] and h.dtype_key == "bf16"
    h.explicit_step(tokens=9)  # the optimizer's hook marks steps: ignored
    assert h.step == 1
    with torch.no_grad():
        model.eval()
        model(torch.randn(2, 8))  # not training: no forward_start, no tokens
    assert len(calls.named("forward_start")) == 3
    h.close()
    model.train()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert h.step == 1 and len(calls.named("mark")) == 1  # hooks removed


def test_training_hooks_with_a_configured_dtype_never_detect_one():
    calls = _Calls()
    model = torch.nn.Linear(4, 4)
    h = _hooks(calls, dtype="bf16", tokens_per_step=32)
    h.install(model, None)
    model(torch.randn(2, 4)).sum().backward()
    h.explicit_step(loss=torch.tensor(2.5))
    assert calls.named("on_dtype") == [] and h.dtype_key == "bf16"
    assert calls.named("mark")[0][:2] == (1, 32) and float(calls.named("mark")[0][2]) == 2.5


class _Exporter:
    def __init__(self):
        self.steps, self.updates = [], []
        self.collector = self

    def observe_steps(self, steps, tokens, seconds):
        self.steps.append((steps, tokens, seconds))

    def update(self, **kw):
        self.updates.append(kw)


def test_reporter_alone_turns_intervals_into_one_measurement(tmp_path):
    intervals = [Interval(1, 1, 1, 0.5, 100, 1000.5), Interval(2, 2, 1, 0.25, 100, 1000.75, loss=1.5)]
    polls = [intervals, []]
    calls = _Calls()
    flops = lambda tokens_per_step: (1e9, 1.5e9)  # noqa: E731
    wiring = ReportWiring(poll=lambda: polls.pop(0) if polls else [], pending=lambda: 0, flops_per_step=flops,
                          peak=lambda: 1e10, dtype_known=lambda: True, progress_on=lambda: False,
                          on_interval=calls.on_interval, observe_step=calls.observe_step)
    exporter = _Exporter()
    timeline = Timeline(tmp_path / "t.jsonl")
    r = Reporter(run_info=RunInfo(run="alone", rank=0), timeline=timeline, exporter=exporter, errors=ErrorCounter(),
                 report_every_steps=2, wiring=wiring)
    r.tick(final=False)
    m = r.latest
    step_time = (0.5 + 0.25) / 2
    assert (m.step, m.steps, m.tokens, m.loss) == (2, 2, 200, 1.5)
    assert m.step_time_seconds == pytest.approx(step_time) and m.tokens_per_second == pytest.approx(100 / step_time)
    assert m.mfu == pytest.approx(1e9 / step_time / 1e10) and m.hfu == pytest.approx(1.5e9 / step_time / 1e10)
    assert exporter.steps == [(1, 100, 0.5), (1, 100, 0.25)] and exporter.updates == [{"step": m}]
    assert calls.named("observe_step") == [(m,)]
    assert calls.named("on_interval") == [(1, 0.5, 100, flops), (1, 0.25, 100, flops)]
    r.tick(final=True)
    timeline.close()
    steps = [rec for rec in read_timeline(tmp_path / "t.jsonl") if rec["kind"] == "step"]
    assert len(steps) == 1 and steps[0]["step"] == 2 and math.isclose(steps[0]["mfu"], m.mfu)


def _fleet(records, calls, step=7, registry=None):
    return FleetAccounting(FleetSettings(run="alone", rank=3, hang_watchdog=False, auto_checkpoint_phases=False),
                           registry=registry or CollectorRegistry(), errors=ErrorCounter(), write=records.append,
                           mark_gap=calls.mark_gap, current_step=lambda: step, on_phase=calls.on_phase,
                           on_hang=calls.on_hang)


def test_fleet_accounting_alone_reports_phases_through_its_callables():
    records, calls = [], _Calls()
    fleet = _fleet(records, calls)
    fleet.enter("eval")  # before any step: nothing is being timed, no gap to mark
    fleet.exit("eval")
    fleet.forward_start()
    fleet.boundary(1)
    with fleet.phase("checkpoint"):
        assert fleet.phase_in_progress
    assert calls.named("on_phase") == [(True,), (False,), (True,), (False,)]
    assert calls.named("mark_gap") == [()]  # the phase after a step: the next step is timed from its end
    phases = [(r["name"], r["bucket"], r["step"]) for r in records if r["kind"] == "phase"]
    assert phases == [("eval", "eval", 7), ("checkpoint", "checkpoint_save", 7)]
    assert [r["kind"] for r in records].count("checkpoint") == 1
    assert fleet.stall_context() is not None and fleet.stall_context()["step"] == 7
    assert calls.named("on_hang") == []
    fleet.close()


def test_fleet_counters_from_intervals_without_an_agent():
    records, calls, registry = [], _Calls(), CollectorRegistry()
    fleet = _fleet(records, calls, registry=registry)
    fleet.on_interval(2, 0.5, 64, lambda tokens_per_step: (1e9, 1.2e9))
    fleet.on_interval(1, float("nan"), 32, lambda tokens_per_step: (1e9, None))  # an untimed step
    labels = {"run": "alone", "rank": "3"}
    # the untimed step's FLOPs stay out too: job MFU is FLOPs over the step time that did them (issue 24)
    assert registry.get_sample_value("mfuwatch_model_flops_total", labels) == 2e9
    assert registry.get_sample_value("mfuwatch_hardware_flops_total", labels) == pytest.approx(2 * 1.2e9)
    assert registry.get_sample_value("mfuwatch_step_seconds_total", labels) == 0.5  # the untimed step adds none
    fleet.close()


def test_the_mfu_peak_part_alone_writes_the_run_facts_it_owns():
    from mfuwatch.agent.device.peak_choice import MfuPeak, PeakSettings

    info, calls = RunInfo(run="alone", rank=0), _Calls()
    measured = []
    p = MfuPeak(PeakSettings(user_peak=None, calibrate=True, device_type="cpu"), device=torch.device("cpu"),
                run_info=info, measure=lambda key: measured.append(key) or {"bf16": 3.0e11, "fp32": 1.0e11}[key],
                on_change=calls.changed, errors=ErrorCounter())
    p.choose(None)  # the dtype is not known yet: nothing measured, nothing written
    assert measured == [] and p.value is None and info.peak_flops_per_second is None and calls.log == []
    p.choose("bf16")
    assert (p.value, info.peak_flops_per_second, info.peak_source, info.dtype) == (
        3.0e11, 3.0e11, "calibrated (bf16 matmul)", "bf16")
    p.choose("fp32")
    assert measured == ["bf16", "fp32"] and info.peak_flops_per_second == 1.0e11 and len(calls.named("changed")) == 2
