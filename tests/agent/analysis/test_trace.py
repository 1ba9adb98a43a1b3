"""The streaming trace reader: header, events, kernel→op links, op nesting, steps, wall span, bad files."""

from __future__ import annotations

import gzip
import json

import pytest

from mfuwatch.agent.analysis.trace import TraceError, TraceIndex, read_trace
from tests.helpers.chrome_trace_builder import TraceBuilder
from tests.helpers.traces import TRACES


def _small() -> TraceBuilder:
    b = TraceBuilder()
    b.annotation("ProfilerStep#7", 0.0, 100.0)
    lin = b.op("aten::linear", 10.0, 30.0, dims=[[8, 16], [32, 16], [32]])
    b.op("aten::t", 11.0, 1.0, dims=[[32, 16]])
    mm = b.op("aten::addmm", 13.0, 20.0, dims=[[32], [8, 16], [16, 32]], seq=41)
    b.annotation("Optimizer.step#AdamW.step", 50.0, 40.0)
    add = b.op("aten::add_", 55.0, 10.0, dims=[[32], [32]])
    b.kernel("sm90_gemm", 40.0, 12.0, ext=mm)
    b.kernel("vectorized_elementwise_kernel", 70.0, 5.0, ext=add, via_runtime=True)
    b.kernel("ncclDevKernel_AllReduce", 80.0, 30.0)  # no launching op
    b.op("autograd::engine::evaluate_function: AddmmBackward0", 20.0, 5.0, tid=2, seq=41)
    assert lin
    return b


def test_header_and_events_stream_from_json_and_gzip(tmp_path):
    b = _small()
    for gz in (False, True):
        path = b.write(str(tmp_path / ("t.json.gz" if gz else "t.json")), gz=gz)
        tf = read_trace(path)
        assert tf.device_properties == [{"id": 0, "name": "NVIDIA H200", "numSms": 132}]
        assert tf.metadata["schemaVersion"] == 1
        events = list(tf.events())
        assert len(events) == len(b.events)
        assert events[0]["name"] == "ProfilerStep#7"


def test_kernels_link_to_their_op_by_external_id_or_runtime_correlation(tmp_path):
    index = TraceIndex.build(_small().events)
    ops = [index.op_label(i) if i >= 0 else None for i in index.k_op]
    # gemm: External id on the kernel; elementwise: only through the cudaLaunchKernel correlation; nccl: none
    assert ops == ["aten::addmm", "aten::add_", None]
    assert index.n_kernels == 3


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def test_an_external_id_links_to_its_last_cpu_op_else_its_first_annotation_and_the_last_launch_wins():
    events = [
        _x("user_annotation", "ann", 0.0, 100.0, **{"External id": 10}),  # op 0
        _x("cpu_op", "aten::a", 1.0, 1.0, **{"External id": 10}),  # op 1
        _x("cpu_op", "aten::b", 3.0, 1.0, **{"External id": 10}),  # op 2: the last cpu_op of id 10
        _x("user_annotation", "only_ann", 5.0, 1.0, **{"External id": 11}),  # op 3: the first op of id 11
        _x("user_annotation", "only_ann2", 7.0, 1.0, **{"External id": 11}),  # op 4
        _x("cpu_op", "aten::c", 9.0, 1.0, **{"External id": 12}),  # op 5
        _x("cpu_op", "aten::d", 11.0, 1.0),  # op 6: no External id
        # two launches claim correlation 501: the later one (External id 12, ending at 20) counts
        _x("cuda_runtime", "cudaLaunchKernel", 10.0, 2.0, **{"External id": 99, "correlation": 501}),
        _x("cuda_runtime", "cudaLaunchKernel", 18.0, 2.0, **{"External id": 12, "correlation": 501}),
        _x("cuda_runtime", "cudaLaunchKernel", 21.0, 1.5, correlation=502),  # no External id: only its end
        _x("kernel", "k0", 30.0, 1.0, **{"External id": 10, "correlation": 500}),
        _x("kernel", "k1", 31.0, 1.0, **{"External id": 11, "correlation": 503}),
        _x("kernel", "k2", 32.0, 1.0, correlation=501),  # its External id comes from the launch: 12
        _x("kernel", "k3", 33.0, 1.0, **{"External id": 13, "correlation": 502}),  # no op has id 13
        _x("kernel", "k4", 34.0, 1.0, correlation=777),  # no id, no launch
    ]
    index = TraceIndex.build(events)
    assert list(index.k_op) == [2, 3, 5, -1, -1]
    assert list(index.k_ext) == [10, 11, 12, 13, -1]
    le = list(index.k_launch_end)
    assert all(x != x for x in le[:2])  # correlations 500 and 503: no launch, NaN
    assert le[2] == 20.0 and le[3] == 22.5  # the later launch of 501; 502's launch
    assert le[4] != le[4]


def test_ops_nest_per_thread_with_top_level_and_region():
    index = TraceIndex.build(_small().events)
    names = [index.op_label(i) for i in range(len(index.op_ts))]
    i_lin, i_t, i_mm, i_add = (names.index(n) for n in ("aten::linear", "aten::t", "aten::addmm", "aten::add_"))
    assert index.op_top[i_t] == i_lin and index.op_top[i_mm] == i_lin and index.op_top[i_lin] == i_lin
    # self time: linear 30 µs minus t (1) and addmm (20); addmm has no child
    assert index.op_self[i_lin] == pytest.approx(9.0) and index.op_self[i_mm] == 20.0
    # the optimizer annotation is the add_'s region; the ProfilerStep annotation is nobody's region
    assert index.names[index.op_region[i_add]] == "Optimizer.step#AdamW.step"
    assert index.op_region[i_lin] == -1
    i_bwd = names.index("autograd::engine::evaluate_function: AddmmBackward0")
    assert index.op_top[i_bwd] == i_bwd and index.op_seq[i_bwd] == 41 == index.op_seq[i_mm]


def test_wall_span_uses_profiler_steps_and_the_last_kernel():
    index = TraceIndex.build(_small().events)
    assert index.steps == [(0.0, 100.0)]
    assert index.wall_span_us() == (0.0, 110.0)  # the nccl kernel ends at 110 µs, after the step


def test_wall_span_without_steps_is_the_profiler_session_else_the_envelope():
    b = TraceBuilder()
    k = b.op("aten::mul", 10.0, 5.0, dims=[[4], [4]])
    b.kernel("elementwise", 20.0, 2.0, ext=k)
    assert TraceIndex.build(b.events).wall_span_us() == (10.0, 22.0)
    b.session(0.0, 50.0)
    assert TraceIndex.build(b.events).wall_span_us() == (0.0, 50.0)


def test_bare_json_array_format(tmp_path):
    path = tmp_path / "array.json"
    path.write_text(json.dumps(_small().events))
    tf = read_trace(str(path))
    assert tf.array_format and tf.metadata == {}
    assert TraceIndex.build(tf.events()).n_kernels == 3
    assert len(list(tf.events())) == len(_small().events)


def test_truncated_json_fails_clearly_when_streamed(tmp_path):
    data = json.dumps(_small().document()).encode()
    path = tmp_path / "cut.json"
    path.write_bytes(data[: len(data) * 2 // 3])
    tf = read_trace(str(path))  # the header is intact
    with pytest.raises(TraceError, match="truncated"):
        list(tf.events())


def test_truncated_gzip_fails_clearly(tmp_path):
    raw = (TRACES / "llama_bf16_eager.json.gz").read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceError, match="truncated"):
        list(read_trace(str(path)).events())


@pytest.mark.parametrize("content, match", [
    (b"this is not json\n", "not a JSON chrome trace"),
    (b'{"name": "a config file", "values": [1, 2, 3]}', "without a 'traceEvents' list"),
    (b"\x89PNG\r\n\x1a\n....", "not a JSON chrome trace"),
])
def test_non_trace_files_fail_clearly(tmp_path, content, match):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=match):
        read_trace(str(path))


def test_missing_file_fails_clearly(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(str(tmp_path / "nope.json"))


def test_real_h200_trace_links_every_kernel_to_an_op():
    tf = read_trace(str(TRACES / "llama_bf16_eager.json.gz"))
    assert tf.device_properties[0]["name"] == "NVIDIA H200"
    index = TraceIndex.build(tf.events())
    # independent count with the json module
    with gzip.open(TRACES / "llama_bf16_eager.json.gz") as f:
        doc = json.load(f)
    gpu = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert index.n_kernels == len(gpu) == 1818
    assert all(i >= 0 for i in index.k_op)
