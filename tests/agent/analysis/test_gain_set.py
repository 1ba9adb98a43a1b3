"""Suggestions that account for each other: host-bound gaps for CUDA graphs, what torch.compile covers, the
drop-ins' measured bandwidth fraction, the HF loss's logits upcast, and the combined gain (Amdahl over
disjoint time). Every expected number is derived by hand from the synthetic trace."""

from __future__ import annotations

import pytest

from mfuwatch.agent.analysis.analyze import analyze_events
from mfuwatch.agent.analysis.gain_model import Claim, combine, replacement_efficiency
from mfuwatch.kernels import traffic
from tests.helpers.chrome_trace_builder import TraceBuilder

BF16 = "c10::BFloat16"
BW = 1e12
PEAKS = {"peak_flops": {"fp32": 10e12, "bf16": 100e12}, "memory_bandwidth_bytes_per_second": 2e12,
         "measured_bandwidth_bytes_per_second": BW}
STEP = 1e-3


def _by_kernel(wm):
    return {s.kernel: s for s in wm.suggestions}


def _gappy(n_pointwise: int, starved: range):
    """20 kernels of 2 µs every 12 µs (idle gaps of 10 µs); kernel i's launch returns 6 µs into the gap before
    it when i is in ``starved`` (the GPU waited for the host), else 1 µs before the previous kernel ended
    (queued: the gap is the device's own). The first ``n_pointwise`` are tiny bf16 adds, the rest bf16 mm."""
    b = TraceBuilder()
    for i in range(20):
        if i < n_pointwise:
            ext = b.op("aten::add", 12.0 * i, 1.0, dims=[[4], [4]], types=[BF16, BF16])
        else:
            ext = b.op("aten::mm", 12.0 * i, 1.0, dims=[[4, 4], [4, 4]], types=[BF16, BF16])
        prev_end = 12.0 * (i - 1) + 3.0
        b.kernel("k", 12.0 * i + 1.0, 2.0, ext=ext, launch_end=prev_end + (6.0 if i in starved else -1.0))
    return analyze_events(b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=STEP)


def test_cuda_graphs_gain_only_the_gaps_where_the_gpu_waited_for_the_launch():
    wm = _gappy(0, range(1, 11))  # 10 of the 19 gaps starved by 6 µs; 9 were queued: nothing to recover
    g = _by_kernel(wm)["cuda_graphs"]
    assert g.time_seconds == pytest.approx(60e-6) and g.expected_gain == pytest.approx(0.06)
    assert g.gain_in_set == pytest.approx(0.06) and g.covered_by is None
    assert wm.combined_gain == pytest.approx(0.06)


def test_a_fusing_fix_removes_the_host_bound_gaps_next_to_its_kernels():
    # 10 adds (a pointwise chain torch.compile fuses) then 10 mm; all 19 gaps starved by 6 µs: 114 µs
    wm = _gappy(10, range(1, 20))
    got = _by_kernel(wm)
    g, c = got["cuda_graphs"], got["torch_compile"]
    assert g.expected_gain == pytest.approx(0.114)
    # the chain: 10 kernels of 2 µs; fused it reads one 4-element bf16 input and writes one output (2 passes)
    assert c.expected_gain == pytest.approx((20e-6 - 2 * 4 * 2 / BW) / STEP)
    # ranked by gain, graphs come first and own all the gaps; compile's gain (its op time) is untouched by
    # the gaps it would also have removed
    assert [s.kernel for s in wm.suggestions][:2] == ["cuda_graphs", "torch_compile"]
    assert g.gain_in_set == pytest.approx(0.114) and c.gain_in_set == pytest.approx(c.expected_gain)
    assert wm.combined_gain == pytest.approx(0.114 + c.expected_gain)


def test_combine_is_amdahl_over_disjoint_time_and_names_what_covers_what():
    claims = [Claim("a", 0.20, {("op", 1): 10.0, ("op", 2): 10.0}),
              Claim("b", 0.10, {("op", 2): 10.0, ("op", 3): 30.0}),  # a quarter of its time is a's already
              Claim("c", 0.04, {("op", 1): 10.0}),  # all of it is a's
              Claim("d", 0.03, {("gap", 7): 5.0}, also={}),
              Claim("e", 0.02, {("gap", 7): 5.0})]  # d's
    in_set, covered, combined = combine(claims, min_gain=0.005)
    assert in_set == {"a": 0.20, "b": pytest.approx(0.075), "c": 0.0, "d": 0.03, "e": 0.0}
    assert covered == {"c": "a", "e": "d"}
    assert combined == pytest.approx(0.20 + 0.075 + 0.03)  # not 0.39, the sum of the parts
    # keys a claim removes besides its gain ("also") are owned for later claims but not in its own fraction
    in_set, covered, _ = combine([Claim("compile", 0.02, {("op", 1): 20.0}, also={("gap", 5): 60.0}),
                                  Claim("graphs", 0.10, {("gap", 5): 60.0, ("gap", 6): 60.0})], 0.005)
    assert in_set == {"compile": 0.02, "graphs": pytest.approx(0.05)} and covered == {}


def test_drop_in_bandwidth_fraction_interpolates_the_measured_table():
    # docs/gpu-runs/kernels-run8.md, CUDA-graph replay, fwd+bwd: 66% at 4096 x 2048, 88% at 8192 x 4096
    assert replacement_efficiency("rms_norm", 4096 * 2048) == 0.66
    mid = 8192 * 2048  # 2x the first size, half way (in log) to the second, 4x it
    assert replacement_efficiency("rms_norm", mid) == pytest.approx(0.66 + 0.5 * (0.88 - 0.66))
    assert replacement_efficiency("rms_norm", 10) == 0.66 and replacement_efficiency("rms_norm", 1 << 40) == 0.93
    assert replacement_efficiency("rotary", 1 << 24) == 1.0  # not measured: taken at the bandwidth


class _Fwd:
    """Forward ops one after another on thread 1, each launching one kernel; a backward on thread 2."""

    def __init__(self):
        self.b, self.t, self.seq = TraceBuilder(), 0.0, 100

    def op(self, name, dims, types, us, *, concrete=None, bwd_us=None, kernel_op=None):
        self.seq += 1
        ext = self.b.op(name, self.t, 5.0, dims=dims, types=types, concrete=concrete, seq=self.seq)
        if kernel_op:  # the kernel comes from a nested op (aten::to -> aten::_to_copy -> copy_)
            ext = self.b.op(kernel_op, self.t + 1.0, 3.0, dims=dims, types=types)
        self.b.kernel("k_" + name, self.t + 1.0, us, ext=ext)
        if bwd_us is not None:
            self.b.op("autograd::engine::evaluate_function: XBackward0", 50_000.0 + self.t, 5.0, tid=2, seq=self.seq)
            e2 = self.b.op("aten::copy_", 50_001.0 + self.t, 3.0, tid=2, dims=dims[:1] * 2, types=types[:1] * 2)
            self.b.kernel("k_bwd", 50_001.0 + self.t, bwd_us, ext=e2)
        self.t += max(6.0, us + 2.0)


def test_cross_entropy_claims_the_logits_upcast_before_hugging_faces_loss():
    # ForCausalLMLoss: logits.float() (aten::to launching a copy), pad and contiguous on the labels, then
    # cross_entropy_loss: the upcast and its backward are part of what the fused loss removes
    rows, vocab = 512, 32000
    f = _Fwd()
    f.op("aten::to", [[rows, vocab], [], [], [], []], [BF16, "Scalar", "Scalar", "Scalar", "Scalar"], 100.0,
         bwd_us=100.0, kernel_op="aten::copy_")
    f.op("aten::constant_pad_nd", [[rows], []], ["long int", "ScalarList"], 2.0)
    f.op("aten::clone", [[rows]], ["long int"], 2.0)
    f.op("aten::cross_entropy_loss", [[rows, vocab], [rows]], ["float", "long int"], 300.0, bwd_us=200.0)
    step = 10e-3  # long enough that the gains (this one and compile's over the same ops) sum below 1: not scaled
    wm = analyze_events(f.b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=step)
    s = _by_kernel(wm)["cross_entropy"]
    assert s.ops == ["aten::cross_entropy_loss", "aten::to"]
    assert s.time_seconds == pytest.approx(700e-6)  # 100 + 100 (upcast) + 300 + 200 (loss), not the labels' 4
    e = rows * vocab  # anchor: the bf16 logits; forward reads them, backward reads them and writes dlogits
    fused = traffic.minimal_bytes("cross_entropy", rows, vocab, 2) + traffic.minimal_bytes(
        "cross_entropy", rows, vocab, 2, backward=True)
    assert fused == 3 * e * 2
    assert s.expected_gain == pytest.approx((700e-6 - fused / BW) / step, rel=1e-12)
    # torch.compile fuses the same ops (upcast and loss): in the set the drop-in is covered
    assert s.covered_by == "torch_compile" and s.gain_in_set == 0.0
    assert wm.combined_gain == pytest.approx(_by_kernel(wm)["torch_compile"].expected_gain)


def test_real_h200_llama_trace_host_bound_gaps_and_the_set():
    import gzip
    import json

    from mfuwatch.agent.device import peaks as peak_table
    from mfuwatch.agent.analysis.trace import read_trace
    from tests.helpers.traces import TRACES

    path = TRACES / "llama_bf16_eager.json.gz"
    wm = analyze_events(read_trace(str(path)).events(), spec_or_peaks=peak_table.lookup(name="NVIDIA H200"))
    # independently, from the raw events: gaps < 200 µs between the union of GPU activities and the next one,
    # counted from the gap's start to when the next one's launch call returned, when that is later
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    launch_end = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                  and "correlation" in (e.get("args") or {})}
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    reach, waited = gpu[0]["ts"] + gpu[0]["dur"], 0.0
    for e in gpu[1:]:
        gap = e["ts"] - reach
        le = launch_end.get(e["args"]["correlation"])
        if 0 < gap < 200 and le is not None and le > reach:
            waited += min(gap, le - reach)
        reach = max(reach, e["ts"] + e["dur"])
    got = _by_kernel(wm)
    assert wm.steps == 3
    assert got["cuda_graphs"].time_seconds == pytest.approx(waited * 1e-6 / 3, rel=1e-9)
    members = [s for s in wm.suggestions if s.covered_by is None]
    assert [s.kernel for s in members] == ["fused_adamw", "torch_compile", "cuda_graphs"]
    assert {s.kernel for s in wm.suggestions if s.covered_by == "torch_compile"} == {"rms_norm", "cross_entropy",
                                                                                     "swiglu"}
    assert wm.combined_gain == pytest.approx(sum(s.gain_in_set for s in members), rel=1e-12)
    # this small model (28.8 ms steps) stays host-bound after compile: the compiled regions' launches (at the
    # eager cost per launch, the bound) outlast their GPU time by more than the eager gaps, so graphs keep
    # their gain in the set, capped at what the eager window shows starving
    assert got["cuda_graphs"].gain_in_set == pytest.approx(got["cuda_graphs"].expected_gain, rel=1e-12)
    assert wm.combined_gain <= sum(s.expected_gain for s in members)


def test_graphs_after_compile_recover_only_the_launch_time_the_gpu_work_does_not_cover():
    from mfuwatch.agent.analysis.gain_model import RegionLaunches, graphs_after_compile

    fwd = RegionLaunches(launches=100, host_us=2000.0, kernels_after=30, gpu_us_after=400.0)  # 20 µs a launch
    bwd = RegionLaunches(launches=50, host_us=500.0, kernels_after=20, gpu_us_after=1000.0)  # 10 µs a launch
    # the most expensive region's cost per launch bounds both: fwd 30 x 20 = 600 µs of launches against 400 µs
    # of GPU work starves 200 µs; bwd 20 x 20 = 400 µs is covered by its 1000 µs: the host runs ahead
    assert graphs_after_compile([fwd, bwd]) == pytest.approx(200.0)
    assert graphs_after_compile([fwd, bwd], host_us_per_launch=5.0) == 0.0  # 150 µs < 400 µs
    assert graphs_after_compile([RegionLaunches(0, 0.0, 0, 0.0)]) == 0.0


def _compiled_forward(optimizer_gaps: bool = False):
    """One step: 10 bf16 adds of 30 µs (a chain torch.compile fuses) then 5 bf16 mm of 30 µs, a kernel every
    40 µs from t=100, each launch returning 1 µs before its kernel starts (the GPU waited 9 µs for each of the
    14 launches after the first). With ``optimizer_gaps`` an ``Optimizer.step`` annotation follows with 3
    more mm kernels launched the same way (3 more 9 µs gaps)."""
    b = TraceBuilder()
    t = 100.0
    n = 18 if optimizer_gaps else 15
    if optimizer_gaps:
        b.annotation("Optimizer.step#AdamW.step", 100.0 + 40 * 15 - 5, 40 * 3 + 10)
    for i in range(n):
        name = "aten::add" if i < 10 else "aten::mm"
        dims = [[4], [4]] if i < 10 else [[4, 4], [4, 4]]
        ext = b.op(name, t - 3.0, 1.0, dims=dims, types=[BF16, BF16])
        b.kernel("k", t, 30.0, ext=ext, launch_end=t - 1.0)
        t += 40.0
    return analyze_events(b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=STEP)


def test_cuda_graphs_on_top_of_compile_gain_the_compiled_launches_excess_over_gpu_time():
    wm = _compiled_forward()
    got = _by_kernel(wm)
    c, g = got["torch_compile"], got["cuda_graphs"]
    # alone: 14 gaps of 9 µs (each launch returned 9 µs after the previous kernel ended)
    assert g.expected_gain == pytest.approx(14 * 9e-6 / STEP)
    # compile: the 10 adds (300 µs) fused into one kernel reading one 4-element bf16 input and writing one
    chain = 2 * 4 * 2 / BW
    assert c.expected_gain == pytest.approx((300e-6 - chain) / STEP)
    assert [s.kernel for s in wm.suggestions][:2] == ["torch_compile", "cuda_graphs"]
    # after compile: 6 kernels (5 mm kept + 1 fused) at the eager host cost per launch, (14 x 40 µs between the
    # first and last launch) / 15 launches, against 5 x 30 µs + the fused kernel's time on the GPU
    per_launch = 14 * 40.0 / 15
    residual_us = 6 * per_launch - (5 * 30.0 + chain * 1e6)
    assert g.gain_in_set == pytest.approx(residual_us * 1e-6 / STEP, rel=1e-9) and g.covered_by is None
    assert wm.combined_gain == pytest.approx(c.expected_gain + g.gain_in_set, rel=1e-12)


def test_cuda_graphs_never_count_the_optimizer_steps_gaps():
    # reduce-overhead captures the compiled model only: the 3 gaps under Optimizer.step stay
    g = _by_kernel(_compiled_forward(optimizer_gaps=True))["cuda_graphs"]
    assert g.expected_gain == pytest.approx(14 * 9e-6 / STEP)
