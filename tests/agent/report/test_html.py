"""Tests of ``mfuwatch report`` (agent/report.py): a synthetic timeline built from the schema dataclasses,
the values the page must show (derived here by hand), the command line, and a real render in headless
Chromium (no console messages, every chart drawn, a screenshot that is not blank, kept under
test-artifacts/)."""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

import pytest

from mfuwatch.agent.report import html as report
from mfuwatch.agent.schema import GpuHealth, OpShare, RunInfo, StepMeasurement, Suggestion, WindowMeasurement, \
    to_record

ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts"

PEAK = 989e12  # H200 SXM dense bf16 FLOP/s (NVIDIA H200 datasheet)
PARAMS = 1.24e9
TOKENS_PER_STEP = 8 * 2048
MODEL_FLOPS = 6 * PARAMS * TOKENS_PER_STEP  # 6·N·T (PaLM appendix B), no recomputation
HW_FLOPS = 8 * PARAMS * TOKENS_PER_STEP  # + one recomputed forward (2·N·T)
STEP_TIMES = [0.42, 0.40, 0.41, 0.55, 0.40, 0.39]  # one report interval of 10 steps each
T0 = 1_750_000_000.0

LN_APPLY = 'model = mfuwatch.kernels.patch(model, ["layer_norm"])'
ADAMW_APPLY = "torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)"
BREAKDOWN = {"compute_bound": 0.52, "memory_bound": 0.38, "communication": 0.06, "other": 0.04, "idle": 0.10}


def _steps():
    out, t = [], T0
    for i, st in enumerate(STEP_TIMES):
        t += 10 * st
        out.append(StepMeasurement(
            step=10 * (i + 1), steps=10, timestamp=t, step_time_seconds=st, tokens=10 * TOKENS_PER_STEP,
            tokens_per_second=TOKENS_PER_STEP / st, model_flops=MODEL_FLOPS, hardware_flops=HW_FLOPS,
            model_flops_per_second=MODEL_FLOPS / st, mfu=MODEL_FLOPS / st / PEAK, hfu=HW_FLOPS / st / PEAK,
            loss=3.2 - 0.1 * i))
    return out


def _window(step: int, ts: float) -> WindowMeasurement:
    return WindowMeasurement(
        step=step, timestamp=ts, steps=3, wall_seconds=1.30, busy_seconds=1.17, breakdown=dict(BREAKDOWN),
        memory_bound_share=0.38,
        top_ops=[
            OpShare(op="aten::mm", bound="compute", share=0.47, time_seconds=0.55, kernels=432, flops=3.6e14,
                    bytes=1.1e12, arithmetic_intensity=327.0),
            OpShare(op="aten::native_layer_norm", bound="memory", share=0.21, time_seconds=0.246, kernels=150,
                    flops=4.0e10, bytes=9.6e11, arithmetic_intensity=0.04),
            OpShare(op="aten::_foreach_add_", bound="memory", share=0.09, time_seconds=0.105, kernels=900,
                    flops=1.2e9, bytes=3.0e10, arithmetic_intensity=0.04),
        ],
        suggestions=[
            Suggestion(kernel="fused_adamw", title="Fused AdamW", apply=ADAMW_APPLY, ops=["aten::_foreach_add_"],
                       time_seconds=0.035, expected_gain=0.061, kind="existing"),
            Suggestion(kernel="layer_norm", title="mfuwatch fused LayerNorm (Triton)", apply=LN_APPLY,
                       ops=["aten::native_layer_norm"], time_seconds=0.082, expected_gain=0.143, kind="bundled"),
        ],
        kernels_per_step=1100.0, mean_kernel_seconds=3.5e-4, step_time_seconds=0.41)


def _run_info(**kw) -> RunInfo:
    base = dict(run="synthetic-llama-1b", rank=0, world_size=8, host="gpu-node-07", device="cuda:0",
                gpu_name="NVIDIA H200", dtype="bf16", peak_flops_per_second=PEAK,
                peak_source="NVIDIA H200 datasheet, dense bf16", flops_source="analytic")
    base.update(kw)
    return RunInfo(**base)


def write_timeline(path: Path, run_info: RunInfo = None, with_steps: bool = True) -> Path:
    recs = [to_record("run", run_info or _run_info())]
    if with_steps:
        steps = _steps()
        for s in steps:
            recs.append(to_record("step", s))
            recs.append(to_record("gpu", GpuHealth(
                timestamp=s.timestamp, utilization=0.98, sm_clock_hertz=1.98e9, power_watts=640.0 + s.step,
                power_limit_watts=700.0, temperature_celsius=60.0, memory_used_bytes=96 * 2**30,
                memory_total_bytes=141 * 2**30, tensor_active=0.41, dram_active=0.33)))
        recs.append(to_record("window", _window(30, steps[2].timestamp + 0.5)))
        recs.append(to_record("window", _window(60, steps[5].timestamp + 0.5)))
        recs.append({"kind": "alert", "alertname": "MfuwatchMemoryBoundDominant", "status": "firing",
                     "severity": "warning", "timestamp": steps[3].timestamp,
                     "summary": "38% of GPU busy time is memory-bound; top op aten::native_layer_norm",
                     "labels": {"run": "synthetic-llama-1b", "rank": "0"},
                     "annotations": {"description": f"apply with: {LN_APPLY}"}})
        recs.append({"kind": "alert", "alertname": "MfuwatchMemoryBoundDominant", "status": "resolved",
                     "severity": "warning", "timestamp": steps[5].timestamp, "summary": "resolved",
                     "labels": {}, "annotations": {}})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def plotly_figures(page: str) -> dict:
    """{figure title: trace list} of every ``Plotly.newPlot(id, data, layout, ...)`` call in the page."""
    dec, figs = json.JSONDecoder(), {}
    for m in re.finditer(r'Plotly\.newPlot\(\s*"[^"]+",\s*', page):
        data, end = dec.raw_decode(page, m.end())
        layout, _ = dec.raw_decode(page, re.compile(r",\s*").match(page, end).end())
        figs[layout["title"]["text"]] = data
    return figs


def _trace(fig, name):
    return next(t for t in fig if t.get("name") == name)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("report")
    out = report.write_report(write_timeline(d / "t.jsonl"), d / "sub" / "report.html")
    assert out == (d / "sub" / "report.html").resolve() and out.is_file()
    return out.read_text(encoding="utf-8")


def test_report_shows_ops_suggestions_and_alerts(page):
    for apply in (LN_APPLY, ADAMW_APPLY):
        assert f"<code>{html.escape(apply)}</code>" in page
    for op in ("aten::mm", "aten::native_layer_norm", "aten::_foreach_add_"):
        assert f"<code>{op}</code>" in page
    # the agent's ranking is kept: the existing fix (fused AdamW) before the bundled kernel, whose gain is larger
    assert page.index(html.escape(ADAMW_APPLY)) < page.index(html.escape(LN_APPLY))
    assert "<td>14.3%</td>" in page and "<td>6.1%</td>" in page
    assert '<tr class="firing"><td>' in page and "MfuwatchMemoryBoundDominant" in page
    assert "gpu-node-07" in page and "NVIDIA H200 datasheet, dense bf16" in page


def test_report_summary_cards_hold_the_run_medians(page):
    # Six intervals of 10 steps: the step-weighted median is the 3rd smallest MFU, i.e. the interval with the
    # 4th smallest step time (0.39, 0.40, 0.40, 0.41): 6·N·T / 0.41 s / 989 TFLOP/s = 30.1%.
    mfu = sorted(MODEL_FLOPS / st / PEAK for st in STEP_TIMES)[2]  # the 3rd smallest of the six intervals' MFU
    assert f'<div class="value">{100 * mfu:.1f}%</div>' in page and '<div class="value">30.1%</div>' in page
    assert f'<div class="value">{100 * HW_FLOPS / 0.41 / PEAK:.1f}%</div>' in page  # HFU 40.1%
    # Median step time: 3rd smallest of the six = 0.40 s.
    assert '<div class="value">400.0 ms</div>' in page
    assert '<div class="value">38.0%</div>' in page  # memory-bound share of the latest window


def test_report_charts_carry_the_timeline_values(page):
    figs = plotly_figures(page)
    steps = _steps()
    assert _trace(figs["MFU and HFU"], "MFU")["y"] == [s.mfu for s in steps]
    assert _trace(figs["MFU and HFU"], "HFU")["y"] == [s.hfu for s in steps]
    flops = figs["Model FLOP/s against peak"]
    assert _trace(flops, "peak")["y"] == [pytest.approx(989.0)] * 2  # scaled to TFLOP/s
    assert _trace(flops, "model TFLOP/s")["y"] == pytest.approx([MODEL_FLOPS / st / 1e12 for st in STEP_TIMES])
    breakdown = figs["Time breakdown (share of profiler window wall time)"]
    # Busy shares are of busy time: × (1 - idle 0.10) makes them shares of wall time.
    assert _trace(breakdown, "memory_bound")["y"] == pytest.approx([0.38 * 0.9, 0.38 * 0.9])
    assert _trace(breakdown, "idle")["y"] == pytest.approx([0.10, 0.10])
    assert sum(t["y"][0] for t in breakdown) == pytest.approx(1.0)
    assert len(figs) == 7  # six Training MFU panels + GPU health


def test_report_is_self_contained(page):
    assert not re.search(r"<script[^>]*\ssrc=", page, re.I)
    assert not re.search(r"<link[^>]*\shref=", page, re.I)
    assert not re.search(r"<(img|iframe)[^>]*\ssrc=[\"']?https?:", page, re.I)
    assert page.count("<script type=\"text/javascript\">") >= 1 and "Plotly.newPlot" in page


def test_report_without_steps_says_what_is_missing(tmp_path):
    out = report.write_report(write_timeline(tmp_path / "t.jsonl", with_steps=False), tmp_path / "r.html")
    page = out.read_text(encoding="utf-8")
    assert "No step measurements in this timeline" in page
    assert "No profiler window in this timeline" in page
    assert "No alert fired during this run." in page
    assert '<div class="value">n/a</div>' in page


def test_load_timeline_keeps_the_last_run_of_an_appended_file(tmp_path):
    first = write_timeline(tmp_path / "a.jsonl", _run_info(run="first"))
    second = write_timeline(tmp_path / "b.jsonl", _run_info(run="second"), with_steps=False)
    both = tmp_path / "both.jsonl"
    both.write_text(first.read_text() + second.read_text() + '{"kind": "step", "step"', encoding="utf-8")
    data = report.load_timeline(both)  # the torn last line (a killed job) is skipped
    assert data.run["run"] == "second" and data.steps == [] and data.windows == [] and data.alerts == []
    data = report.load_timeline(first)
    assert data.run["run"] == "first" and len(data.steps) == 6 and len(data.windows) == 2
    assert len(data.gpus) == 6 and len(data.alerts) == 2


def test_a_run_record_with_the_same_labels_fills_in_facts_and_keeps_the_records(tmp_path):
    early = to_record("run", _run_info(dtype="", peak_flops_per_second=None, peak_source=""))
    path = write_timeline(tmp_path / "t.jsonl")
    path.write_text(json.dumps(early) + "\n" + path.read_text(), encoding="utf-8")
    with path.open("a") as fh:  # a restarted job appends its run record again, then more steps
        fh.write(json.dumps(to_record("run", _run_info(host=""))) + "\n")
        fh.write(json.dumps(to_record("step", _steps()[0])) + "\n")
    data = report.load_timeline(path)
    assert len(data.steps) == 7 and len(data.windows) == 2
    assert data.run["dtype"] == "bf16" and data.run["peak_flops_per_second"] == PEAK
    assert data.run["host"] == "gpu-node-07"  # an empty field does not erase a known one


def test_without_plotly_the_report_command_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    timeline = write_timeline(tmp_path / "t.jsonl")
    monkeypatch.setitem(sys.modules, "plotly", None)  # what an install without the report extra sees
    assert report.main([str(timeline), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mfuwatch report: the HTML report needs plotly, which is not installed: "
                   "pip install 'mfuwatch[report]'"]
    assert not (tmp_path / "r.html").exists()


def test_peak_falls_back_to_the_one_implied_by_the_steps(tmp_path):
    path = write_timeline(tmp_path / "t.jsonl", _run_info(peak_flops_per_second=None, peak_source=""))
    assert report.peak_flops(report.load_timeline(path)) == pytest.approx(PEAK)
    path = write_timeline(tmp_path / "u.jsonl", _run_info(peak_flops_per_second=None), with_steps=False)
    assert report.peak_flops(report.load_timeline(path)) is None


def test_cli_writes_the_report_and_prints_its_path(tmp_path, capsys):
    timeline = write_timeline(tmp_path / "t.jsonl")
    assert report.main([str(timeline)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {(tmp_path / 't.html').resolve()}"
    assert report.main([str(timeline), "-o", str(tmp_path / "x" / "r.html")]) == 0
    assert (tmp_path / "x" / "r.html").stat().st_size > 1_000_000  # plotly.js is embedded
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"  # bad lines are skipped, counted, and said once; the rest is reported
    bad.write_text('{"kind": "run", "run": "r"}\nnot json\n{"kind": "step"}\n', encoding="utf-8")
    assert report.main([str(bad), "-o", str(tmp_path / "bad.html")]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["mfuwatch report: 2 line(s) of bad.jsonl skipped (1 not JSON at line 2; "
                                "1 step not a whole number in 0..1e12 at line 3)"]
    assert out.strip() == f"report: {(tmp_path / 'bad.html').resolve()}"
    note = re.search(r'<p class="note">(.*?)</p>', (tmp_path / "bad.html").read_text(encoding="utf-8")).group(1)
    assert note == ("<b>Note:</b> 2 line(s) of bad.jsonl skipped (1 not JSON at line 2; 1 step not a whole "
                    "number in 0..1e12 at line 3). They are left out of every chart and figure; the report "
                    "shows the rest.")
    page = (tmp_path / "x" / "r.html").read_text(encoding="utf-8")
    assert '<p class="note">' not in page  # a clean timeline has no note
    assert report.main([str(tmp_path / "missing.jsonl")]) == 2


def test_a_file_with_only_bad_lines_fails_in_one_line(tmp_path, capsys):
    p = tmp_path / "junk.jsonl"
    p.write_text('garbage\n{"kind": "step", "step": Infinity, "timestamp": 1.7e9}\n[1]\n', encoding="utf-8")
    assert report.main([str(p), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"mfuwatch report: {p}: no mfuwatch timeline records (kinds run, step, window, gpu, alert); "
                   "3 line(s) of junk.jsonl skipped (1 not JSON at line 1; 1 step not a whole number in 0..1e12 "
                   "at line 2; 1 not a JSON object at line 3); is this the agent's `timeline:` file?"]
    assert not (tmp_path / "r.html").exists()


def _cpu_job(path: Path, run: str, steps: int) -> None:
    """A small CPU training job watched by the agent, writing its timeline to ``path``."""
    import torch

    from mfuwatch.agent import Agent
    from mfuwatch.agent.demo import DemoLM, DemoShape

    s = DemoShape(vocab=32, d_model=16, n_layers=1, n_heads=2, d_ff=24, seq=6, batch=2)
    torch.manual_seed(0)
    model = DemoLM(s)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = Agent(model, opt, config=dict(exporter=False, nvml=False, alerts=False, profile_every="off", run=run,
                                      report_every_steps=2, timeline=str(path), progress=False, peak_flops=1e11))
    x = torch.randint(0, 32, (2, 6))
    for _ in range(steps):
        model(x).float().mean().backward()
        opt.step()
        opt.zero_grad()
    a.close()


def test_a_job_killed_mid_write_then_restarted_gives_a_report_of_the_restart(tmp_path, capsys):
    # Issue #28: SIGKILL cut the last line; the restarted job's run record went onto the cut line and the
    # report refused the whole file ("killed.jsonl:N: not a JSON line", status 2).
    first = tmp_path / "tl.jsonl"
    _cpu_job(first, "first", 20)
    killed = tmp_path / "killed.jsonl"
    cut = first.read_bytes()[:-40]  # head -c -40
    killed.write_bytes(cut)
    cut_line = cut.count(b"\n") + 1
    _cpu_job(killed, "second", 20)
    lines = killed.read_bytes().split(b"\n")
    assert lines[cut_line - 1] == cut.split(b"\n")[-1]  # the cut line, alone on its line
    later = [json.loads(x) for x in lines[cut_line:] if x]
    assert later[0]["kind"] == "run" and later[0]["run"] == "second"
    want = [r["step"] for r in later if r["kind"] == "step"]
    out = tmp_path / "k.html"
    assert report.main([str(killed), "-o", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"mfuwatch report: 1 line(s) of killed.jsonl skipped (1 not JSON at line {cut_line})"]
    data = report.load_timeline(killed)
    assert data.run["run"] == "second" and [s["step"] for s in data.steps] == want and want[-1] == 20
    assert sum(s["steps"] for s in data.steps) == 20  # every step of the restarted job, once
    assert f"1 not JSON at line {cut_line}" in out.read_text(encoding="utf-8")


def test_report_renders_in_headless_chromium(tmp_path):
    from PIL import Image  # dev dependency: Pillow

    from tests.helpers.headless_chromium import open_page

    out = report.write_report(write_timeline(tmp_path / "t.jsonl"), tmp_path / "report.html")
    res = open_page(out, ARTIFACTS / "report.png")
    assert res.console == [], res.console
    assert res.dom.count('class="plot-container plotly"') == 7  # every chart was drawn by plotly.js
    assert "aten::native_layer_norm" in res.dom
    with Image.open(res.screenshot) as im:
        rgb = im.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 24)
        non_white = sum(n for n, c in colors if c != (255, 255, 255))
        assert rgb.size == (1400, 2400)
    assert len(colors) > 200, f"only {len(colors)} distinct colours: the page looks blank"
    assert non_white > 0.05 * 1400 * 2400


def test_console_check_catches_page_errors(tmp_path):
    # The check above must be able to fail: a page that logs and throws shows up in ``console``.
    from tests.helpers.headless_chromium import open_page

    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><p>x</p><script>console.error('mfuwatch-probe');"
                   "fetch('http://example.invalid/x');throw new Error('probe-uncaught');</script></body></html>")
    res = open_page(bad, tmp_path / "bad.png", size=(400, 300))
    text = "\n".join(res.console)
    assert "mfuwatch-probe" in text and "Uncaught Error: probe-uncaught" in text


def test_a_file_without_timeline_records_is_an_error(tmp_path):
    from mfuwatch.agent.report.html import main

    p = tmp_path / "not-a-timeline.jsonl"
    p.write_text('{"a": 1}\n')
    assert main([str(p), "-o", str(tmp_path / "r.html")]) == 2
    assert not (tmp_path / "r.html").exists()


def test_alert_and_run_fields_of_any_json_type_render(tmp_path):
    # The fresh-user fuzz of issue #28 (every field of each record kind set to Infinity, NaN, null, "x", {}, [1],
    # -1, 1e308, true): an alert's text fields and annotations, and the run's peak, crashed the page.
    path = write_timeline(tmp_path / "t.jsonl", _run_info(peak_flops_per_second="x"))
    with path.open("a") as fh:
        fh.write(json.dumps({"kind": "alert", "alertname": 5, "status": None, "severity": [1], "summary": {},
                             "annotations": "x", "timestamp": T0}) + "\n")
    data = report.load_timeline(path)
    assert report.peak_flops(data) == pytest.approx(PEAK)  # not the run's "x": the one the steps imply
    page = report.render_html(data, "t.jsonl")
    row = re.search(r"<tr><td>2025-06-15 15:06:40 UTC</td>(.*?)</tr>", page).group(1)
    assert row == "<td>5</td><td></td><td>[1]</td><td>{}</td><td></td>"
