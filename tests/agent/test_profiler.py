"""The live profiler sampler on the CPU: a real window from a tiny training loop, analysed in a child
process, exported as metrics; skipping when another profiler runs; closing; the slowdown guard."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from mfuwatch.agent.live.exporter import Exporter
from mfuwatch.agent.live.profiler import ProfilerSampler
from mfuwatch.agent.schema import BUSY_CATEGORIES, M, RunInfo


class RMSNorm(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def _loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), RMSNorm(256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


class Sink:
    def __init__(self) -> None:
        self.windows, self.errors = [], []
        self.done = threading.Event()

    def window(self, w) -> None:
        self.windows.append(w)
        self.done.set()

    def error(self, component, exc) -> None:
        self.errors.append((component, exc))
        self.done.set()


def test_live_cpu_window_produces_a_measurement_and_metrics():
    sink = Sink()
    sampler = ProfilerSampler(every_steps=5, warmup_steps=1, active_steps=3, device=torch.device("cpu"),
                              peaks=None, top_k=6, on_window=sink.window, on_error=sink.error)
    step = _loop()
    at = {}
    try:
        for i in range(1, 12):
            step()
            at[i] = time.perf_counter()
            sampler.on_step(i, 0.01)  # the outside step time: not what the window's gains are fractions of
        assert sink.done.wait(120), "no window within 120 s"
    finally:
        sampler.close()
    assert sink.errors == []
    (w,) = sink.windows
    assert w.steps == 3 and w.step == 9  # started at step 5: 1 warm-up + 3 recorded steps, ends at step 9
    # the window's own step time: its 3 active steps run from boundary 6 (end of warm-up) to boundary 9
    assert w.step_time_seconds == pytest.approx((at[9] - at[6]) / 3, rel=0.05)
    assert sum(w.breakdown[c] for c in BUSY_CATEGORIES) == pytest.approx(1.0)
    assert 0.0 <= w.breakdown["idle"] < 1.0 and w.wall_seconds > 0 and w.kernels_per_step > 0
    names = {o.op for o in w.top_ops}
    assert len(w.top_ops) <= 6 and names
    assert dict(sampler.windows) == {"ok": 1}
    ex = Exporter(RunInfo(run="t"))
    ex.collector.update(window=w)
    labels = {"run": "t", "rank": "0"}
    assert ex.registry.get_sample_value(M.MEMORY_BOUND_SHARE, labels) == w.memory_bound_share
    for cat in BUSY_CATEGORIES + ("idle",):
        assert ex.registry.get_sample_value(M.GPU_TIME_SHARE, {**labels, "category": cat}) == w.breakdown[cat]
    top = w.top_ops[0]
    assert ex.registry.get_sample_value(M.OP_GPU_TIME_SHARE, {**labels, "op": top.op, "bound": top.bound}) == top.share


def test_window_is_skipped_and_said_once_when_another_profiler_runs(caplog):
    sink, outcomes = Sink(), []
    sampler = ProfilerSampler(every_steps=2, device="cpu", peaks={"peak_flops": {"fp32": 1e11},
                              "memory_bandwidth_bytes_per_second": 1e10}, on_window=sink.window, on_error=sink.error,
                              on_outcome=outcomes.append)
    caplog.set_level(logging.WARNING, logger="mfuwatch")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        for i in range(1, 7):
            sampler.on_step(i)
        assert sampler._prof is None  # never started a second profiler
    sampler.close()
    assert sampler.windows["skipped_other_profiler"] == 3  # due at steps 2, 4, 6
    assert outcomes == ["skipped_other_profiler"] * 3
    assert sum("another torch profiler is active" in r.message for r in caplog.records) == 1
    assert sink.errors == [] and sink.windows == []


def _cpu_sampler(sink, **cadence) -> ProfilerSampler:
    """A CPU sampler with a 1e11 FLOP/s, 1e10 B/s machine, reporting to ``sink``."""
    peaks = {"peak_flops": {"fp32": 1e11}, "memory_bandwidth_bytes_per_second": 1e10}
    return ProfilerSampler(device="cpu", peaks=peaks, on_window=sink.window, on_error=sink.error, **cadence)


def test_close_terminates_a_running_analysis():
    sink = Sink()
    sampler = _cpu_sampler(sink, every_steps=1, warmup_steps=0, active_steps=1)
    step = _loop()
    step()
    sampler.on_step(1)  # starts recording
    step()
    sampler.on_step(2)  # stops, exports, spawns the child analysis
    child = sampler._child
    assert child is not None
    sampler.close()  # waits up to 0.8 s for the analysis (which imports torch), then terminates it
    assert child.poll() is not None  # finished or terminated, not left running
    assert sink.errors == [] and len(sink.windows) <= 1  # a terminated analysis is dropped silently


def test_lasting_slowdown_after_a_window_is_reported_once_and_stops_windows():
    sink = Sink()
    sampler = ProfilerSampler(every_steps=10, device="cpu", peaks={"peak_flops": {"fp32": 1e11},
                              "memory_bandwidth_bytes_per_second": 1e10}, on_window=sink.window, on_error=sink.error)
    sampler._before = 0.010
    sampler._intervals.extend([0.0105] * 16)  # +5%: within noise
    sampler._check_slowdown()
    assert not sampler.disabled and sink.errors == []
    sampler._intervals.extend([0.012] * 16)  # +20% over 16 steps: could be noise, checked again later
    sampler._check_slowdown()
    assert not sampler.disabled and sampler._watch_at is not None and sink.errors == []
    sampler._intervals.extend([0.012] * 16)  # still +20% 16 steps later
    sampler._check_slowdown()
    assert sampler.disabled and sampler.lasting_slowdown == pytest.approx(0.2)
    assert len(sink.errors) == 1 and "slower" in str(sink.errors[0][1])


@pytest.mark.parametrize("kw, match", [
    ({}, "profile_every"),
    ({"every_steps": 0}, "profile_every"),
    ({"every_seconds": -1.0}, "profile_every"),
    ({"every_steps": 5, "active_steps": 0}, "profile_active_steps"),
])
def test_bad_cadence_fails_fast_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        ProfilerSampler(device="cpu", on_window=print, on_error=print, **kw)


def test_profiled_steps_are_the_steps_a_window_is_timed_in():
    sink = Sink()
    sampler = _cpu_sampler(sink, every_steps=3, warmup_steps=1, active_steps=2)
    step = _loop()
    try:
        for i in range(1, 13):
            step()
            sampler.on_step(i)
            if i == 3:
                assert list(sampler.profiled_steps) == [[4, None]]  # recording from the next step on
    finally:
        sampler.close()
    assert sink.errors == []
    # started at boundary 3: warm-up step 4, recorded steps 5-6, and step 7, which carries the trace export;
    # the next window is due 3 steps after the first ended (boundary 9)
    assert list(sampler.profiled_steps) == [[4, 7], [10, 13]]
    assert [sampler.profiled(a, b) for a, b in ((1, 3), (3, 4), (7, 8), (8, 9), (9, 10), (14, 20))] == [
        False, True, True, False, True, False]
