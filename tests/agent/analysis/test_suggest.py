"""Suggestions: pattern matching, backward linking, expected gains (Amdahl) and ranking."""

from __future__ import annotations

import gzip
import json

import pytest

from mfuwatch.agent.device import peaks as peak_table
from mfuwatch.agent.analysis.analyze import analyze_events
from mfuwatch.agent.analysis.trace import read_trace
from mfuwatch.kernels import traffic
from tests.helpers.chrome_trace_builder import TraceBuilder
from tests.helpers.traces import TRACES

BF16, F32 = "c10::BFloat16", "float"
BW = 1e12  # calibrated bandwidth given to the analysis, bytes/s
PEAKS = {"peak_flops": {"fp32": 10e12, "bf16": 100e12}, "memory_bandwidth_bytes_per_second": 2e12,
         "measured_bandwidth_bytes_per_second": BW}
STEP = 1e-3  # step time the gains are fractions of, s


class Timeline:
    """Forward ops one after another on thread 1, each launching one kernel; backward nodes on thread 2."""

    def __init__(self) -> None:
        self.b = TraceBuilder()
        self.t = 0.0
        self.seq = 100

    def fwd(self, name, dims, types, kernel_us, *, concrete=None, with_backward_us=None, inner=None):
        self.seq += 1
        ext = self.b.op(name, self.t, 5.0, dims=dims, types=types, concrete=concrete, seq=self.seq)
        if inner:  # a composite op whose kernel comes from a nested op (e.g. linear -> mm)
            ext = self.b.op(inner[0], self.t + 1.0, 3.0, dims=inner[1], types=inner[2])
        self.b.kernel("k_" + name, self.t + 1.0, kernel_us, ext=ext)
        self.t += max(6.0, kernel_us + 2.0)
        if with_backward_us is not None:
            node = f"autograd::engine::evaluate_function: {name.split('::')[1].title()}Backward0"
            self.b.op(node, 10_000.0 + self.t, 5.0, tid=2, seq=self.seq)
            ext = self.b.op("aten::mul", 10_001.0 + self.t, 3.0, tid=2, dims=dims[:1] * 2, types=types[:1] * 2)
            self.b.kernel("k_bwd", 10_001.0 + self.t, with_backward_us, ext=ext)

    def analyze(self, **kw):
        return analyze_events(self.b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=STEP, **kw)


def _by_kernel(wm):
    return {s.kernel: s for s in wm.suggestions}


def _rms_norm_timeline(rows=1024, hidden=1024) -> Timeline:
    x = [rows, hidden]
    tl = Timeline()
    tl.fwd("aten::add", [x, x], [F32, F32], 10.0, with_backward_us=10.0)  # residual add: not part of the norm
    tl.fwd("aten::pow", [x, []], [F32, "Scalar"], 10.0, concrete=["", "2"], with_backward_us=10.0)
    tl.fwd("aten::mean", [x, [], [], []], [F32, "ScalarList", "Scalar", ""], 10.0,
           concrete=["", "[-1]", "True", ""], with_backward_us=10.0)
    tl.fwd("aten::add", [[rows, 1], []], [F32, "Scalar"], 10.0, with_backward_us=10.0)
    tl.fwd("aten::rsqrt", [[rows, 1]], [F32], 10.0, with_backward_us=10.0)
    tl.fwd("aten::mul", [x, [rows, 1]], [F32, F32], 10.0, with_backward_us=10.0)
    tl.fwd("aten::mul", [x, [hidden]], [F32, F32], 10.0, with_backward_us=10.0)
    tl.fwd("aten::mm", [[rows, hidden], [hidden, hidden]], [F32, F32], 500.0)  # compute-bound: ends the chain
    return tl


def test_rms_norm_written_out_matches_with_its_backward_and_exact_gain():
    wm = _rms_norm_timeline().analyze()
    s = _by_kernel(wm)["rms_norm"]
    assert s.kind == "bundled" and s.apply == 'mfuwatch.kernels.patch(model, kernels=["rms_norm"])'
    assert s.ops == ["aten::add", "aten::mean", "aten::mul", "aten::pow", "aten::rsqrt"]
    # pow, mean, add(eps), rsqrt, mul, mul(weight): 6 forward + 6 linked backward kernels of 10 µs;
    # the residual add before the norm is not claimed
    assert s.time_seconds == pytest.approx(120e-6)
    e, h = 1024 * 1024, 1024  # rows × hidden elements of 4 B: forward 2·E·4 + H·4, backward 3·E·4 + 2·H·4
    fused = (2 * e * 4 + h * 4) + (3 * e * 4 + 2 * h * 4)
    assert fused == traffic.minimal_bytes("rms_norm", 1024, 1024, 4) + traffic.minimal_bytes(
        "rms_norm", 1024, 1024, 4, backward=True)
    # 1 M elements: below the smallest size measured (4096 x 2048), where the drop-in reached 66% of the
    # bandwidth forward + backward (docs/gpu-runs/kernels-run8.md): the replacement takes fused / (0.66 BW)
    assert s.expected_gain == pytest.approx((120e-6 - fused / (0.66 * BW)) / STEP, rel=1e-12)


def test_torch_compile_covers_the_pointwise_chain_and_ranks_before_the_drop_in():
    wm = _rms_norm_timeline().analyze()
    kinds = [s.kind for s in wm.suggestions]
    assert kinds == sorted(kinds, key=lambda k: k != "existing")  # existing fixes first
    c = _by_kernel(wm)["torch_compile"]
    # the chain: residual add + the 6 norm ops (7 memory-bound pointwise ops), each with 10 µs backward
    assert c.time_seconds == pytest.approx(140e-6)
    anchor = 1024 * 1024 * 4  # the largest input among the chain's ops
    assert c.expected_gain == pytest.approx((140e-6 - 5 * anchor / BW) / STEP, rel=1e-12)
    assert wm.suggestions.index(c) < wm.suggestions.index(_by_kernel(wm)["rms_norm"])


def test_swiglu_skips_the_up_projection_between_silu_and_mul():
    tl = Timeline()
    g = [512, 2048]
    tl.fwd("aten::silu", [g], [BF16], 10.0, with_backward_us=10.0)
    tl.fwd("aten::linear", [[512, 64], [2048, 64]], [BF16, BF16], 50.0,
           inner=("aten::mm", [[512, 64], [64, 2048]], [BF16, BF16]))
    tl.fwd("aten::mul", [g, g], [BF16, BF16], 10.0, with_backward_us=10.0)
    s = _by_kernel(tl.analyze())["swiglu"]
    assert s.ops == ["aten::mul", "aten::silu"] and s.time_seconds == pytest.approx(40e-6)
    e = 512 * 2048  # bf16 gate/up: forward 3·E·2, backward 5·E·2
    assert s.expected_gain == pytest.approx((40e-6 - 16 * e / BW) / STEP, rel=1e-12)


def test_attention_written_out_suggests_sdpa_counting_the_matmuls_it_keeps():
    tl = Timeline()
    q, kt, a = [2, 4, 128, 64], [2, 4, 64, 128], [2, 4, 128, 128]
    tl.fwd("aten::matmul", [q, kt], [BF16, BF16], 100.0, inner=("aten::bmm", [[8, 128, 64], [8, 64, 128]], [BF16] * 2))
    tl.fwd("aten::mul", [a, []], [BF16, "Scalar"], 20.0)
    tl.fwd("aten::ones", [[], []], ["ScalarList", "Scalar"], 5.0)  # the mask, built in between: not claimed
    tl.fwd("aten::masked_fill", [a, [128, 128], []], [BF16, "bool", "Scalar"], 20.0)
    tl.fwd("aten::softmax", [a, [], []], [BF16, "Scalar", "Scalar"], 20.0)
    tl.fwd("aten::matmul", [a, q], [BF16, BF16], 100.0, inner=("aten::bmm", [[8, 128, 128], [8, 128, 64]], [BF16] * 2))
    s = _by_kernel(tl.analyze())["sdpa"]
    assert s.kind == "existing" and s.time_seconds == pytest.approx(260e-6)
    assert s.ops == ["aten::masked_fill", "aten::matmul", "aten::mul", "aten::softmax"]
    # flash attention forward reads q, k, v and writes o: 4 × q's 2·4·128·64 bf16 elements; its two matmuls
    # (2 × 2·8·128·64·128 FLOP at 100 TFLOP/s = 0.34 µs) take less than moving those bytes (0.52 µs)
    assert s.expected_gain == pytest.approx((260e-6 - 4 * 2 * 4 * 128 * 64 * 2 / BW) / STEP, rel=1e-12)


def _adamw_timeline(fused_op: bool = False) -> Timeline:
    tl = Timeline()
    tl.b.annotation("Optimizer.step#AdamW.step", 0.0, 500.0)
    tl.t = 10.0
    tl.fwd("aten::_foreach_lerp_", [[], [], []], ["TensorList", "TensorList", "Scalar"], 30.0)  # 2 lists + 1 written
    tl.fwd("aten::_foreach_addcmul_", [[], [], [], []], ["TensorList"] * 3 + ["Scalar"], 40.0)  # 3 + 1
    tl.fwd("aten::_foreach_addcdiv_", [[], [], [], []], ["TensorList"] * 3 + [""], 40.0)  # 3 + 1
    if fused_op:
        tl.fwd("aten::_fused_adamw_", [[]], ["TensorList"], 5.0)
    return tl


def test_fused_adamw_gain_from_the_lists_the_foreach_ops_move():
    s = _by_kernel(_adamw_timeline().analyze())["fused_adamw"]
    assert s.kind == "existing" and "fused=True" in s.apply
    assert s.time_seconds == pytest.approx(110e-6)
    # 11 lists moved in 110 µs; the fused step moves 7 lists (read p, g, m, v; write p, m, v) once per
    # addcdiv_ call: 70 µs at the same bandwidth
    assert s.expected_gain == pytest.approx((110e-6 - 70e-6) / STEP, rel=1e-9)


def test_fused_adamw_is_not_suggested_when_already_fused():
    assert "fused_adamw" not in _by_kernel(_adamw_timeline(fused_op=True).analyze())


def test_launch_bound_gain_is_the_short_gaps_between_kernels():
    b = TraceBuilder()
    for i in range(20):  # 20 kernels of 2 µs every 12 µs: 19 gaps of 10 µs
        ext = b.op("aten::add", i * 12.0, 1.0, dims=[[4], [4]])
        b.kernel("elementwise", i * 12.0 + 1.0, 2.0, ext=ext)
    ext = b.op("aten::add", 2000.0, 1.0, dims=[[4], [4]])  # then a 1.7 ms stall: not launch overhead
    b.kernel("elementwise", 2001.0, 2.0, ext=ext)
    wm = analyze_events(b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=STEP)
    s = _by_kernel(wm)["cuda_graphs"]
    assert s.time_seconds == pytest.approx(190e-6) and s.expected_gain == pytest.approx(0.19)


def test_fp32_matmuls_suggest_bf16_autocast():
    tl = Timeline()
    tl.fwd("aten::mm", [[1024, 1024], [1024, 1024]], [F32, F32], 1000.0)
    s = _by_kernel(tl.analyze())["bf16_autocast"]
    replacement = max(2 * 1024 ** 3 / 100e12, 3 * 1024 * 1024 * 4 / 2 / BW)  # bf16 tensor peak vs half the bytes
    assert s.expected_gain == pytest.approx((1000e-6 - replacement) / STEP, rel=1e-12)


def test_gains_below_the_threshold_are_dropped():
    tl = Timeline()
    tl.fwd("aten::silu", [[8, 8]], [BF16], 1.0)
    tl.fwd("aten::mul", [[8, 8], [8, 8]], [BF16, BF16], 1.0)
    assert "swiglu" not in _by_kernel(tl.analyze())  # 2 µs of a 1 ms step: 0.2% < 0.5%


# ------------------------------------------------------------------ the real H200 Llama trace
@pytest.fixture(scope="module")
def llama():
    tf = read_trace(str(TRACES / "llama_bf16_eager.json.gz"))
    return analyze_events(tf.events(), spec_or_peaks=peak_table.lookup(name="NVIDIA H200"))


def test_llama_suggests_rms_norm_swiglu_and_fused_adamw_with_positive_gains(llama):
    got = _by_kernel(llama)
    for k in ("rms_norm", "swiglu", "fused_adamw"):
        assert got[k].expected_gain > 0, k
    assert got["rms_norm"].kind == got["swiglu"].kind == "bundled" and got["fused_adamw"].kind == "existing"
    kinds = [s.kind for s in llama.suggestions]
    assert kinds == sorted(kinds, key=lambda k: k != "existing")
    for kind in ("existing", "bundled"):
        gains = [s.expected_gain for s in llama.suggestions if s.kind == kind]
        assert gains == sorted(gains, reverse=True)


def test_llama_fused_adamw_time_and_gain_derived_independently(llama):
    with gzip.open(TRACES / "llama_bf16_eager.json.gz") as f:
        events = json.load(f)["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "user_annotation" and e["name"] == "Optimizer.step#AdamW.step"]
    ops = {e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op"
           and any(a <= e["ts"] < b for a, b in steps) and e["tid"] == e["pid"]}
    kernel_us = sum(e["dur"] for e in events if e.get("cat") == "kernel" and e["args"].get("External id") in ops)
    launching = {e["args"]["External id"] for e in events if e.get("cat") == "kernel"}
    lists = sum(sum(t == "TensorList" for t in o["args"]["Input type"]) + 1 for x, o in ops.items() if x in launching)
    # torch's foreach AdamW step, per step: mul_(p) 2, lerp_(m, g) 3, mul_(v) 2, addcmul_(v, g, g) 4,
    # sqrt(v) 2, div_ 2, add_(eps) 2, addcdiv_(p, m, denom) 4 = 21 lists moved
    assert lists == 21 * 3
    s = _by_kernel(llama)["fused_adamw"]
    assert s.time_seconds == pytest.approx(kernel_us * 1e-6 / 3, rel=1e-12)
    replacement_us = kernel_us * 7 * 3 / lists  # 7 lists per step (one addcdiv_ call per step)
    assert s.expected_gain == pytest.approx((kernel_us - replacement_us) * 1e-6 / 3 / llama.step_time_seconds,
                                            rel=1e-9)
