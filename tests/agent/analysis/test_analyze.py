"""``mfuwatch analyze``: tables and --json on the H200 traces; clear errors and exit status on bad input."""

from __future__ import annotations

import gzip
import json

import pytest

from mfuwatch.agent.analysis.analyze import main
from mfuwatch.agent.schema import BUSY_CATEGORIES, window_from_record
from tests.helpers.chrome_trace_builder import TraceBuilder
from tests.helpers.traces import TRACES

LLAMA = str(TRACES / "llama_bf16_eager.json.gz")


def test_json_output_uses_the_trace_device_for_peaks(capsys):
    assert main([LLAMA, "--json", "--top-k", "5"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["kind"] == "window" and rec["analysis"]["gpu"] == "NVIDIA H200"
    assert rec["analysis"]["memory_bandwidth_bytes_per_second"] == 4.8e12  # H200 SXM datasheet
    wm = window_from_record(rec)
    assert wm.steps == 3 and len(wm.top_ops) == 5
    assert sum(wm.breakdown[c] for c in BUSY_CATEGORIES) == pytest.approx(1.0)
    assert {"rms_norm", "swiglu", "fused_adamw"} <= {s.kernel for s in wm.suggestions}


def test_step_time_flag_sets_the_amdahl_denominator(capsys):
    assert main([LLAMA, "--json", "--step-time", "0.02669"]) == 0
    a = window_from_record(json.loads(capsys.readouterr().out))
    assert main([LLAMA, "--json"]) == 0
    b = window_from_record(json.loads(capsys.readouterr().out))
    assert a.step_time_seconds == 0.02669 and b.step_time_seconds == pytest.approx(b.wall_seconds / 3)
    ga, gb = ({s.kernel: s.expected_gain for s in w.suggestions} for w in (a, b))
    assert ga["fused_adamw"] == pytest.approx(gb["fused_adamw"] * b.step_time_seconds / 0.02669)


def test_table_output(capsys, tmp_path):
    out = tmp_path / "report.txt"
    assert main([str(TRACES / "gpt_bf16_input_stall.json.gz"), "--output", str(out)]) == 0
    text = out.read_text()
    for word in ("Time breakdown", "memory_bound", "idle", "Top ops", "aten::mm", "Suggestions", "cuda_graphs"):
        assert word in text, word


def test_flags_override_the_peak_table(capsys):
    # a GPU a million times faster at arithmetic: the balance rises to ~2e5 FLOP/B and every op,
    # matmuls (~1e3 FLOP/B) included, falls below it
    assert main([LLAMA, "--json", "--peak-flops", "fp32=1e18", "--peak-flops", "bf16=1e18",
                 "--bandwidth", "4.8e12"]) == 0
    wm = window_from_record(json.loads(capsys.readouterr().out))
    assert wm.breakdown["compute_bound"] == 0.0 and wm.breakdown["memory_bound"] == 1.0


def _cut(tmp_path) -> str:
    with gzip.open(LLAMA) as f:
        raw = f.read()
    path = tmp_path / "truncated.json"
    path.write_bytes(raw[: len(raw) // 2])
    return str(path)


@pytest.mark.parametrize("make, message", [
    (_cut, "truncated"),
    (lambda p: (p / "notes.json").write_text('{"notes": ["not", "a", "trace"]}') and str(p / "notes.json"),
     "not a chrome trace"),
    (lambda p: (p / "x.txt").write_text("hello") and str(p / "x.txt"), "not a JSON chrome trace"),
])
def test_bad_files_fail_clearly_with_status_1(tmp_path, capsys, make, message):
    assert main([make(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mfuwatch analyze: error:") and message in err


def _cpu_only_trace(tmp_path) -> str:
    b = TraceBuilder()
    b.op("aten::addmm", 0.0, 50.0, dims=[[64], [32, 64], [64, 64], [], []],
         types=["float"] * 3 + ["Scalar"] * 2, concrete=["", "", "", "1", "1"])
    b.op("aten::relu", 60.0, 10.0, dims=[[32, 64]])
    return b.write(str(tmp_path / "cpu.json"), device_name=None)


def test_trace_without_gpu_activity_fails_unless_analysed_as_cpu(tmp_path, capsys):
    path = _cpu_only_trace(tmp_path)
    assert main([path, "--peak-flops", "fp32=1e11", "--bandwidth", "1e10"]) == 1
    assert "no GPU activity" in capsys.readouterr().err
    assert main([path, "--json", "--device", "cpu", "--peak-flops", "fp32=1e11", "--bandwidth", "1e10"]) == 0
    wm = window_from_record(json.loads(capsys.readouterr().out))
    # addmm: 2·32·64·64 FLOP over (64 + 32·64 + 64·64 + 32·64)·4 B = 8.7 FLOP/B < balance 10: memory-bound
    assert wm.breakdown["memory_bound"] == 1.0 and wm.busy_seconds == pytest.approx(60e-6)


def test_unknown_gpu_without_flags_names_the_flags(tmp_path, capsys):
    b = TraceBuilder()
    ext = b.op("aten::mul", 0.0, 5.0, dims=[[4], [4]])
    b.kernel("elementwise", 1.0, 2.0, ext=ext)
    path = b.write(str(tmp_path / "t.json"), device_name="Imaginary GPU 9000")
    assert main([path]) == 1
    err = capsys.readouterr().err
    assert "Imaginary GPU 9000" in err and "--peak-flops" in err and "--bandwidth" in err
    assert main([path, "--peak-flops", "fp32=1e12", "--bandwidth", "1e12"]) == 0


def test_cpu_trace_without_flags_gives_the_real_reason_not_the_gpu_name(tmp_path, capsys):
    # a CPU run's trace: no deviceProperties and no kernels; the missing GPU name is a symptom, not the reason
    path = _cpu_only_trace(tmp_path)
    assert main([path]) == 1
    err = capsys.readouterr().err
    assert "no GPU activity (no kernel, memcpy or memset events in the window)" in err
    assert "without ProfilerActivity.CUDA, on a CPU run" in err and "--device cpu" in err
    assert "GPU name" not in err, err


def test_kernels_without_device_properties_still_ask_for_the_peaks(tmp_path, capsys):
    b = TraceBuilder()
    ext = b.op("aten::mul", 0.0, 5.0, dims=[[4], [4]])
    b.kernel("elementwise", 1.0, 2.0, ext=ext)
    path = b.write(str(tmp_path / "t.json"), device_name=None)
    assert main([path]) == 1
    err = capsys.readouterr().err
    assert "no GPU name in the trace" in err and "--peak-flops" in err and "no GPU activity" not in err


def test_malformed_peak_flops_flag(capsys):
    assert main([LLAMA, "--peak-flops", "bf17=1e12", "--bandwidth", "1e12"]) == 1
    assert "--peak-flops" in capsys.readouterr().err


def test_every_apply_line_is_printed_whole_on_one_line(capsys):
    # fresh-user pass (issue 24): the apply column wrapped at 120 columns, so the line copied from the table was
    # "optimizer =" / "torch.optim.AdamW(model.parameters(), lr=lr," / "fused=True)": not Python one can paste
    assert main([LLAMA, "--json"]) == 0
    wm = window_from_record(json.loads(capsys.readouterr().out))
    assert main([LLAMA]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(wm.suggestions) >= 3
    apply = {s.kernel: [ln.split(None, 1)[1] for ln in lines if ln.startswith(f"  {s.kernel} ")]
             for s in wm.suggestions}
    for s in wm.suggestions:
        assert len(apply[s.kernel]) == 1 and apply[s.kernel][0].startswith(s.apply), (s.kernel, apply[s.kernel])
    # both compile lines assign `model`: pasting both would compile the compiled model; the second says so
    assert apply["torch_compile"] == ["model = torch.compile(model)"]
    assert apply["cuda_graphs"] == ['model = torch.compile(model, mode="reduce-overhead")  '
                                    '# instead of the torch_compile line']
    assert apply["fused_adamw"] == [s.apply for s in wm.suggestions if s.kernel == "fused_adamw"]
    combined = [ln for ln in lines if ln.startswith("Combined gain of the set")]
    assert len(combined) == 1 and combined[0].endswith("not the sum of the parts)")
    assert f"{wm.combined_gain:.1%} of step time" in combined[0]
