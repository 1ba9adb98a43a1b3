"""Roofline classification and the window breakdown: a synthetic trace checked exactly, the H200 traces
checked against an independent derivation from their kernels' ops."""

from __future__ import annotations

import gzip
import json

import pytest

from mfuwatch.agent.device import peaks as peak_table
from mfuwatch.agent.analysis.analyze import analyze_events
from mfuwatch.agent.analysis.roofline import kernel_name_bound, op_name_bound
from mfuwatch.agent.analysis.trace import TraceError, read_trace
from mfuwatch.agent.device.peaks import Peaks
from mfuwatch.agent.schema import BUSY_CATEGORIES, to_record, window_from_record
from tests.helpers.chrome_trace_builder import TraceBuilder
from tests.helpers.traces import TRACES

BF16 = "c10::BFloat16"
# a made-up GPU with round numbers: CUDA-core balance 10 FLOP/B, bf16 tensor-core balance 100 FLOP/B
TOY = {"peak_flops": {"fp32": 10e12, "bf16": 100e12}, "memory_bandwidth_bytes_per_second": 1e12}


def _synthetic() -> TraceBuilder:
    b = TraceBuilder()
    b.session(0.0, 100.0)
    small = b.op("aten::mm", 1.0, 1.0, dims=[[256, 256], [256, 256]], types=[BF16, BF16])  # AI 85.3 < 100
    big = b.op("aten::mm", 2.0, 1.0, dims=[[1024, 1024], [1024, 1024]], types=[BF16, BF16])  # AI 341 >= 100
    fp32 = b.op("aten::mm", 3.0, 1.0, dims=[[256, 256], [256, 256]], types=["float", "float"])  # AI 42.7 >= 10
    add = b.op("aten::add", 4.0, 1.0, dims=[[1 << 20], [1 << 20]])
    b.kernel("gemm_small", 0.0, 10.0, ext=small)
    b.kernel("gemm_big", 5.0, 10.0, ext=big, stream=8)  # overlaps the first on another stream
    b.kernel("vectorized_elementwise_kernel", 20.0, 10.0, ext=add, via_runtime=True)
    b.kernel("ncclDevKernel_AllReduce_Sum_bf16", 40.0, 1.0)
    b.kernel("triton_poi_fused_add_mul_0", 50.0, 10.0)
    b.kernel("some_mystery_kernel", 55.0, 3.0, stream=9)  # inside the triton kernel's interval
    b.kernel("Memcpy HtoD (Pinned -> Device)", 70.0, 2.0, cat="gpu_memcpy")
    b.kernel("Memset (Device)", 90.0, 5.0, cat="gpu_memset")
    b.kernel("gemm_fp32", 98.0, 6.0, ext=fp32)  # runs past the end of the session: clipped for idle
    return b


def test_synthetic_breakdown_idle_union_and_top_ops_exactly():
    wm = analyze_events(_synthetic().events, spec_or_peaks=TOY, top_k=20)
    # union of [0,15) [20,30) [40,41) [50,60) [70,72) [90,95) [98,100) inside the 100 µs session = 45 µs
    assert wm.wall_seconds == pytest.approx(100e-6, abs=1e-12)
    assert wm.busy_seconds == pytest.approx(45e-6, abs=1e-12)
    assert wm.breakdown["idle"] == pytest.approx(0.55, abs=1e-9)
    # summed durations: memory 10 (small mm) + 10 (add) + 10 (triton_poi) + 5 (memset) = 35;
    # compute 10 (big mm) + 6 (fp32 mm on CUDA cores); communication 1; other 3 (mystery) + 2 (HtoD)
    total = 57.0
    assert wm.breakdown["memory_bound"] == pytest.approx(35 / total)
    assert wm.breakdown["compute_bound"] == pytest.approx(16 / total)
    assert wm.breakdown["communication"] == pytest.approx(1 / total)
    assert wm.breakdown["other"] == pytest.approx(5 / total)
    assert sum(wm.breakdown[c] for c in BUSY_CATEGORIES) == pytest.approx(1.0)
    assert wm.memory_bound_share == wm.breakdown["memory_bound"]
    assert wm.steps == 1 and wm.kernels_per_step == 9
    assert wm.mean_kernel_seconds == pytest.approx(total / 9 * 1e-6)
    ops = {(o.op, o.bound): o for o in wm.top_ops}
    mm_mem = ops[("aten::mm", "memory")]
    assert mm_mem.flops == 2 * 256 ** 3 and mm_mem.bytes == 3 * 256 * 256 * 2
    assert mm_mem.arithmetic_intensity == pytest.approx(2 * 256 ** 3 / (3 * 256 * 256 * 2))
    assert ops[("aten::mm", "compute")].kernels == 2 and ops[("aten::mm", "compute")].time_seconds == pytest.approx(16e-6)
    assert ops[("triton_poi_fused_add_mul", "memory")].kernels == 1
    assert wm.top_ops[0].time_seconds >= wm.top_ops[-1].time_seconds


def test_top_k_bounds_the_op_list_and_record_round_trips():
    wm = analyze_events(_synthetic().events, spec_or_peaks=TOY, top_k=3)
    assert len(wm.top_ops) == 3
    back = window_from_record(json.loads(json.dumps(to_record("window", wm))))
    assert back == wm


def test_steps_come_from_profiler_step_annotations():
    b = _synthetic()
    for i, t in enumerate((0.0, 40.0)):
        b.annotation(f"ProfilerStep#{i + 5}", t, 40.0)
    wm = analyze_events(b.events, spec_or_peaks=TOY, steps=None)
    assert wm.steps == 2 and wm.kernels_per_step == 4.5
    assert wm.wall_seconds == pytest.approx(104e-6)  # first step start .. the last kernel's end
    assert analyze_events(b.events, spec_or_peaks=TOY, steps=3).steps == 3


def test_no_gpu_activity_and_empty_streams_fail_clearly():
    b = TraceBuilder()
    b.op("aten::mul", 0.0, 5.0, dims=[[4], [4]])
    with pytest.raises(TraceError, match="no GPU activity"):
        analyze_events(b.events, spec_or_peaks=TOY)
    with pytest.raises(TraceError, match="no events"):
        analyze_events([], spec_or_peaks=TOY)
    wm = analyze_events(b.events, spec_or_peaks=TOY, device_type="cpu")  # the op itself is the "kernel"
    assert wm.kernels_per_step == 1 and wm.breakdown["memory_bound"] == 1.0


def test_name_rules():
    assert kernel_name_bound("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert kernel_name_bound("triton_red_fused_sum_3") == "memory"
    assert kernel_name_bound("triton_tem_fused_mm_1") == "compute"
    assert kernel_name_bound("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "compute"
    assert kernel_name_bound("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "compute"
    assert kernel_name_bound("void at::native::multi_tensor_apply_kernel<...>") == "memory"
    assert kernel_name_bound("frobnicate") == "other"
    assert op_name_bound("aten::mm") == "compute" and op_name_bound("aten::_foreach_mul_") == "memory"
    assert op_name_bound("c10d::allreduce_") == "communication" and op_name_bound("aten::view") == "other"


def test_peaks_from_the_gpu_table_and_validation():
    spec = peak_table.lookup(name="NVIDIA H200")
    p = Peaks.from_any(spec)
    assert p.balance("bf16", True) == pytest.approx(spec.peak_flops["bf16"] / spec.memory_bandwidth_bytes_per_second)
    assert p.balance("bf16", False) == pytest.approx(spec.peak_flops["fp32"] / spec.memory_bandwidth_bytes_per_second)
    assert p.flops_for("fp32", True) == spec.peak_flops["fp32"]  # fp32 matmul without TF32: CUDA cores
    assert Peaks.from_any({**TOY, "fp32_matmul": "tf32"}).flops_for("fp32", True) == 10e12  # no tf32 key
    with pytest.raises(ValueError, match="memory_bandwidth_bytes_per_second"):
        Peaks.from_any({"peak_flops": {"fp32": 1.0}})
    with pytest.raises(ValueError, match="peak_flops"):
        Peaks.from_any({"peak_flops": {}, "memory_bandwidth_bytes_per_second": 1.0})


# ------------------------------------------------------------------ the real H200 traces
H200_BF16_BALANCE = 989.4e12 / 4.8e12  # dense bf16 tensor-core FLOP/s over HBM3e bandwidth (datasheet)


def _load(name: str) -> dict:
    with gzip.open(TRACES / name) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def llama():
    tf = read_trace(str(TRACES / "llama_bf16_eager.json.gz"))
    return analyze_events(tf.events(), spec_or_peaks=peak_table.lookup(name="NVIDIA H200"))


def test_llama_breakdown_sums_to_one(llama):
    assert sum(llama.breakdown[c] for c in BUSY_CATEGORIES) == pytest.approx(1.0, abs=1e-12)
    assert 0.0 <= llama.breakdown["idle"] < 1.0 and llama.steps == 3


def test_llama_memory_bound_share_is_in_the_independently_derived_range(llama):
    """Classify each kernel from its launching op by hand: mm by 2mkn / ((mk+kn+mn)·2 B) against the
    bf16 balance, cuDNN attention by its intensity s/2 (forward, 4·b·h·s²·d FLOPs over q, k, v, o),
    every other aten op (pointwise, reductions, copies, foreach) as memory-bound (≤ a few FLOPs per
    element, far below any balance). Memsets/memcpys are the ambiguous part of the range."""
    doc = _load("llama_bf16_eager.json.gz")
    ops = {e["args"]["External id"]: e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"}
    memory = compute = ambiguous = 0.0
    for e in doc["traceEvents"]:
        if e.get("cat") not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        if e["cat"] != "kernel":
            ambiguous += e["dur"]
            continue
        op = ops[e["args"]["External id"]]
        if op["name"] == "aten::mm":
            (m, k), (_, n) = op["args"]["Input Dims"][:2]
            ai = 2 * m * k * n / ((m * k + k * n + m * n) * 2)
            compute_bound = ai >= H200_BF16_BALANCE
        elif "attention" in op["name"]:
            s = op["args"]["Input Dims"][0][2]
            compute_bound = s / 2 >= H200_BF16_BALANCE
        else:
            compute_bound = False
        if compute_bound:
            compute += e["dur"]
        else:
            memory += e["dur"]
    total = memory + compute + ambiguous
    low, high = memory / total, (memory + ambiguous) / total
    assert low <= llama.memory_bound_share <= high
    assert 0.5 < low  # eager bf16 Llama with foreach AdamW: most kernel time is memory-bound


def test_stall_trace_idle_is_well_above_half_and_matches_an_independent_union():
    doc = _load("gpt_bf16_input_stall.json.gz")
    trace = next(e for e in doc["traceEvents"] if e.get("cat") == "Trace")
    start, end = trace["ts"], trace["ts"] + trace["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"]
                   if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    union, cur = 0.0, None
    for s, t in spans:
        s, t = max(s, start), min(t, end)
        if cur is None or s > cur[1]:
            if cur:
                union += cur[1] - cur[0]
            cur = [s, t]
        else:
            cur[1] = max(cur[1], t)
    union += cur[1] - cur[0]
    expected_idle = (end - start - union) / (end - start)
    tf = read_trace(str(TRACES / "gpt_bf16_input_stall.json.gz"))
    wm = analyze_events(tf.events(), spec_or_peaks=peak_table.lookup(name="NVIDIA H200"))
    assert wm.breakdown["idle"] == pytest.approx(expected_idle, abs=1e-9)
    assert wm.breakdown["idle"] > 0.75  # 50 ms host sleep per 62 ms step
    assert sum(wm.breakdown[c] for c in BUSY_CATEGORIES) == pytest.approx(1.0, abs=1e-12)


def test_cpu_window_uses_op_self_time_and_the_union_of_top_level_ops():
    b = TraceBuilder()
    x, w, bias = [256, 256], [256, 256], [256]
    b.op("aten::linear", 0.0, 30.0, dims=[x, w, bias])
    b.op("aten::t", 1.0, 1.0, dims=[w])
    b.op("aten::addmm", 3.0, 20.0, dims=[bias, x, w, [], []], types=["float"] * 3 + ["Scalar"] * 2,
         concrete=["", "", "", "1", "1"])  # 2·256³ FLOP / (256 + 3·256²)·4 B = 42.6 FLOP/B >= 10
    b.op("aten::relu", 40.0, 10.0, dims=[x])
    wm = analyze_events(b.events, spec_or_peaks=TOY, device_type="cpu", top_k=10)
    # kernels: linear's own 9 µs (30 − 1 − 20), t 1, addmm 20, relu 10 = 40 µs
    assert wm.kernels_per_step == 4 and wm.mean_kernel_seconds == pytest.approx(10e-6)
    assert wm.breakdown["compute_bound"] == pytest.approx(20 / 40)  # addmm
    assert wm.breakdown["memory_bound"] == pytest.approx(10 / 40)  # relu
    assert wm.breakdown["other"] == pytest.approx(10 / 40)  # linear's own dispatch time (9) and the view t (1)
    assert wm.busy_seconds == pytest.approx(40e-6) and wm.breakdown["idle"] == pytest.approx(10 / 50)


def test_kernels_under_a_non_aten_op_are_labelled_by_kernel_name():
    b = TraceBuilder()
    ext = b.op("CompiledFunction", 0.0, 50.0)  # torch.compile's autograd function, no shapes
    b.kernel("triton_poi_fused_add_mul_0", 10.0, 5.0, ext=ext)
    b.kernel("triton_tem_fused_mm_1", 20.0, 15.0, ext=ext)
    wm = analyze_events(b.events, spec_or_peaks=TOY)
    assert {(o.op, o.bound) for o in wm.top_ops} == {("triton_poi_fused_add_mul", "memory"),
                                                     ("triton_tem_fused_mm", "compute")}
