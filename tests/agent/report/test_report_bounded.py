"""``mfuwatch report`` streams the timeline (issue #28): memory grows by a few float64 per step record, not by a
parsed dict per record; the charts get at most a few thousand points (merged with step weights, nothing
dropped); the medians stay exact; lines that cannot be used (oversized, not JSON, implausible step numbers or
timestamps) are skipped and counted with their line numbers, and the rest is reported."""

from __future__ import annotations

import json
import random
import tracemalloc

import numpy as np
import pytest

from mfuwatch.agent.report import load as load_mod
from mfuwatch.agent.report.html import _summary, load_timeline


def _write(path, n_steps, n_gpu=0, n_alerts=0, seed=0):
    rng = random.Random(seed)
    rows = []
    with open(path, "w") as fh:
        fh.write(json.dumps({"kind": "run", "run": "big", "rank": 0, "peak_flops_per_second": 1e15}) + "\n")
        step = 0
        for i in range(n_steps):
            k = rng.choice([10, 10, 10, 3])
            step += k
            st = rng.lognormvariate(-3.0, 0.3)
            rec = {"kind": "step", "step": step, "steps": k, "timestamp": 1.7e9 + i, "step_time_seconds": st,
                   "tokens": 512 * k, "tokens_per_second": 512 / st, "model_flops_per_second": 1e12 / st,
                   "mfu": 1e12 / st / 1e15, "hfu": None, "loss": 2.0, "tokens_per_step": 512.0,
                   "pad": "x" * 200}
            rows.append((st, k))
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if n_gpu and i % max(1, n_steps // n_gpu) == 0:
                fh.write(json.dumps({"kind": "gpu", "timestamp": 1.7e9 + i, "utilization": 0.9,
                                     "power_watts": 500.0 + i % 7}) + "\n")
            if n_alerts and i < n_alerts:
                fh.write(json.dumps({"kind": "alert", "timestamp": 1.7e9 + i, "alertname": "X",
                                     "status": "firing"}) + "\n")
    return rows, step


def _weighted_median(rows):
    vals = np.array([v for v, _ in rows], dtype=np.float64)
    w = np.array([k for _, k in rows], dtype=np.float64)
    o = np.argsort(vals, kind="stable")
    cum = np.cumsum(w[o])
    return float(vals[o][np.searchsorted(cum, 0.5 * cum[-1])])


def test_downsampled_charts_keep_every_step_and_exact_medians(tmp_path):
    path = tmp_path / "tl.jsonl"
    rows, last = _write(path, 20000, n_gpu=10000)
    data = load_timeline(path)
    assert data.counts["step"] == 20000
    assert len(data.steps) <= load_mod.MAX_POINTS and data.merged["step"] > 1
    assert sum(s["steps"] for s in data.steps) == sum(k for _, k in rows)  # merged, not dropped
    assert data.steps[-1]["step"] == last
    assert len(data.gpus) <= load_mod.MAX_POINTS and data.counts["gpu"] == 10000
    # the drawn mean of a merged point is the step-weighted mean of what it stands for
    total_time = sum(v * k for v, k in rows)
    drawn_time = sum(s["step_time_seconds"] * s["steps"] for s in data.steps)
    assert drawn_time == pytest.approx(total_time, rel=1e-9)
    assert data.step_columns.quantile("step_time_seconds", 0.5) == _weighted_median(rows)
    assert "Step time (median)" in _summary(data)


def test_memory_grows_by_columns_not_by_records(tmp_path, monkeypatch):
    monkeypatch.setattr(load_mod, "MAX_POINTS", 500)  # both sizes past the first merges
    peaks = {}
    for n in (5000, 25000):
        path = tmp_path / f"tl{n}.jsonl"
        _write(path, n)
        tracemalloc.start()
        data = load_timeline(path)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(data.steps) <= 500 and data.counts["step"] == n
    # 20k more records: 64 bytes each in the columns (+ array over-allocation), not ~1 KB each as dicts
    assert peaks[25000] - peaks[5000] < 20000 * 200, peaks


def test_alerts_past_the_cap_are_counted_and_lines_too_long_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(load_mod, "MAX_ALERTS", 50)
    path = tmp_path / "tl.jsonl"
    _write(path, 100, n_alerts=80)  # run + 100 steps + 80 alerts: 181 lines
    data = load_timeline(path)
    assert len(data.alerts) == 50 and data.alerts_not_listed == 30 and data.counts["alert"] == 80
    assert data.skipped == {}
    monkeypatch.setattr(load_mod, "MAX_LINE_BYTES", 1000)
    with open(path, "a") as fh:  # line 182: 5 KB, read past in chunks of 1000 bytes; 183 and 184 are whole
        fh.write(json.dumps({"kind": "step", "step": 10**6, "timestamp": 1.8e9, "pad": "y" * 5000}) + "\n")
        fh.write(json.dumps({"kind": "run", "run": "big", "rank": 0, "dtype": "bf16"}) + "\n")
        fh.write(json.dumps({"kind": "step", "step": 10**6 + 1, "steps": 1, "timestamp": 1.8e9,
                             "step_time_seconds": 0.5}) + "\n")
    data = load_timeline(path)
    assert data.skipped == {load_mod.TOO_LONG: [1, [182]]}
    assert data.counts["step"] == 101 and data.steps[-1]["step"] == 10**6 + 1 and data.run["dtype"] == "bf16"
    assert data.skipped_summary("tl.jsonl") == "1 line(s) of tl.jsonl skipped (1 longer than 16 MiB at line 182)"


def test_torn_last_line_is_skipped_and_a_bad_middle_line_is_counted(tmp_path):
    path = tmp_path / "tl.jsonl"
    _, last = _write(path, 10)  # lines 1-11
    with open(path, "a") as fh:
        fh.write('{"kind": "step", "st')  # line 12, torn: no newline after it
    data = load_timeline(path)
    assert data.counts["step"] == 10 and data.skipped == {}  # a torn last line is not counted
    with open(path, "a") as fh:
        fh.write("\n" + json.dumps({"kind": "step", "step": last + 1, "timestamp": 1.8e9}) + "\n")
    data = load_timeline(path)
    assert data.skipped == {load_mod.NOT_JSON: [1, [12]]}
    assert data.counts["step"] == 11 and data.steps[-1]["step"] == last + 1


def _steps_file(path, bad, good=(10, 20, 30, 40)):
    """A run record, then the good step records with ``bad`` (line text) inserted after the first:
    returns the line number of each bad line."""
    lines = [json.dumps({"kind": "run", "run": "r", "rank": 0})]
    rec = lambda s, ts: json.dumps({"kind": "step", "step": s, "steps": 10, "timestamp": ts,  # noqa: E731
                                    "step_time_seconds": 0.1, "mfu": 0.25})
    lines.append(rec(good[0], 1.7e9))
    where = []
    for b in bad:
        lines.append(b)
        where.append(len(lines))
    lines += [rec(s, 1.7e9 + i) for i, s in enumerate(good[1:], 1)]
    path.write_text("\n".join(lines) + "\n")
    return where


_BASE = '{"kind": "step", "steps": 1, "timestamp": 1.7e9, "step_time_seconds": 0.1, "mfu": 0.9, '


@pytest.mark.parametrize("step", ["Infinity", "-Infinity", "NaN", "1e300", "-5", '"abc"', "2.5", "1000000000000000",
                                  "1000000000001", "null", "true", "[3]"])
def test_a_step_record_with_an_implausible_step_is_skipped_and_counted(tmp_path, step):
    # Issue #28: "step": Infinity crashed the report (OverflowError in Columns.points); the others were drawn
    # as if valid. Resume's rule: a whole number in 0..10^12.
    path = tmp_path / "tl.jsonl"
    (line,) = _steps_file(path, [_BASE + f'"step": {step}}}'])
    data = load_timeline(path)
    assert line == 3 and data.skipped == {load_mod.BAD_STEP: [1, [3]]}
    assert [s["step"] for s in data.steps] == [10, 20, 30, 40] and data.counts["step"] == 4
    assert data.step_columns.quantile("mfu", 0.5) == 0.25  # the bad record's 0.9 is not in the median
    assert data.skipped_summary("tl.jsonl") == \
        "1 line(s) of tl.jsonl skipped (1 step not a whole number in 0..1e12 at line 3)"


def test_a_whole_float_step_and_the_bounds_are_kept(tmp_path):
    path = tmp_path / "tl.jsonl"
    # step 0 without "steps" (a record that covers no step); with steps 1 it claims more steps than ran
    _steps_file(path, ['{"kind": "step", "step": 0, "timestamp": 1.7e9}', _BASE + '"step": 15.0}',
                       _BASE + '"step": 1000000000000}', _BASE + '"step": 0}'])
    data = load_timeline(path)
    assert data.skipped == {load_mod.BAD_STEPS: [1, [6]]}
    assert [s["step"] for s in data.steps] == [10, 0, 15, 10**12, 20, 30, 40]


def test_every_kind_of_bad_line_is_counted_with_its_line_numbers(tmp_path):
    path = tmp_path / "tl.jsonl"
    bad = ["garbage", '[1, 2]', _BASE + '"step": Infinity}', "3", _BASE + '"step": 12, "steps": 13}',
           _BASE + '"step": 12, "steps": 0}', '{"kind": "step", "step": 12, "timestamp": Infinity}',
           '{"kind": "gpu", "utilization": 0.5}', '{"kind": "window", "step": -1, "timestamp": 1.7e9}',
           '{"kind": "alert", "alertname": "X", "status": "firing", "timestamp": 1e300}',
           b'{"kind": "step", "step": 1, "x": "\xff"}'.decode("latin-1"), "{}{}"]
    where = _steps_file(path, bad)
    assert where == list(range(3, 15))
    # "\xff" written as UTF-8 is valid: make line 13 invalid UTF-8 (a byte-level cut) by hand
    raw = path.read_bytes().split(b"\n")
    raw[12] = b'{"kind": "step", "step": 1, "x": "\xff"}'
    path.write_bytes(b"\n".join(raw))
    data = load_timeline(path)
    L = load_mod
    assert data.skipped == {L.NOT_JSON: [3, [3, 13, 14]], L.NOT_OBJECT: [2, [4, 6]], L.BAD_STEP: [2, [5, 11]],
                            L.BAD_STEPS: [2, [7, 8]], L.BAD_TIME: [3, [9, 10, 12]]}
    assert [s["step"] for s in data.steps] == [10, 20, 30, 40] and data.gpus == [] and data.windows == []
    assert data.alerts == [] and data.counts == {"step": 4, "window": 0, "gpu": 0, "alert": 0}
    assert data.skipped_summary("tl.jsonl") == (
        "12 line(s) of tl.jsonl skipped (3 not JSON at lines 3, 13, 14; 2 not a JSON object at lines 4, 6; "
        "2 step not a whole number in 0..1e12 at lines 5, 11; 2 steps not a whole number in 1..step at lines "
        "7, 8; 3 timestamp not a time in 1970..9999 at lines 9, 10, 12)")


def test_past_five_line_numbers_a_reason_is_counted_and_the_skips_span_every_run(tmp_path):
    path = tmp_path / "tl.jsonl"
    where = _steps_file(path, ["x"] * 7)
    with open(path, "a") as fh:  # a new run after the bad lines: they are still counted (file-wide)
        fh.write(json.dumps({"kind": "run", "run": "second", "rank": 0}) + "\nnope\n")
        fh.write(json.dumps({"kind": "step", "step": 5, "steps": 5, "timestamp": 1.8e9}) + "\n")
    data = load_timeline(path)
    assert where == list(range(3, 10))
    assert data.run["run"] == "second" and [s["step"] for s in data.steps] == [5]
    assert data.skipped == {load_mod.NOT_JSON: [8, [3, 4, 5, 6, 7]]}
    assert data.skipped_summary("tl.jsonl") == \
        "8 line(s) of tl.jsonl skipped (8 not JSON at lines 3, 4, 5, 6, 7, ...)"


def test_the_plausible_step_bound_is_resumes():
    from mfuwatch.agent.fleet import goodput

    assert load_mod.MAX_PLAUSIBLE_STEP == goodput.MAX_PLAUSIBLE_STEP == 10**12


def test_a_report_of_the_agents_record_mix_marks_every_firing_alert_and_keeps_the_medians(tmp_path):
    # The record mix of a long run (attempt, phase, checkpoint, a second run record with the same labels,
    # alerts firing and resolving) with known figures: 60 step records of 10 steps at 0.1 s, 40 at 0.3 s
    # -> weighted median step time 0.1 s, MFU = 1e12 / st / 1e15 -> median 1.0%; 30 firing alerts, each
    # followed by its resolve. The figure marks the firing ones (not the resolves), in file order, labels
    # stacked by yshift -14 * (i % 4) (alerts of one evaluation share a time) -- the markers are set in one
    # layout update, not added one by one (which copied the list each time: quadratic in the alerts).
    from mfuwatch.agent.report import figures as figs
    from mfuwatch.agent.report.html import render_html

    path = tmp_path / "tl.jsonl"
    t0 = 1.7e9
    recs = [{"kind": "run", "run": "mix", "rank": 0, "peak_flops_per_second": 1e15},
            {"kind": "attempt", "pid": 1, "host": "h", "timestamp": t0, "lost_steps": 0.0}]
    fired = []
    for i in range(100):
        st = 0.1 if i % 5 < 3 else 0.3
        ts = t0 + i
        recs.append({"kind": "step", "step": 10 * (i + 1), "steps": 10, "timestamp": ts, "step_time_seconds": st,
                     "tokens": 40960, "tokens_per_second": 4096 / st, "model_flops_per_second": 1e12 / st,
                     "mfu": 1e12 / st / 1e15, "hfu": None, "implausible": {}})
        if i % 10 == 0:
            recs.append({"kind": "phase", "name": "eval", "bucket": "eval", "step": 10 * (i + 1), "seconds": 2.0,
                         "timestamp": ts})
            recs.append({"kind": "checkpoint", "phase": "save", "step": 10 * (i + 1), "seconds": 1.0,
                         "source": "x", "timestamp": ts})
        if i % 10 in (3, 4, 5):
            name = f"Rule{i}"
            fired.append((name, ts))
            recs.append({"kind": "alert", "alertname": name, "status": "firing", "severity": "warning",
                         "timestamp": ts, "labels": {"alertname": name}, "annotations": {}})
            recs.append({"kind": "alert", "alertname": name, "status": "resolved", "severity": "warning",
                         "timestamp": ts + 0.5, "labels": {"alertname": name}, "annotations": {}})
        if i == 50:
            recs.append({"kind": "run", "run": "mix", "rank": 0, "dtype": "bfloat16"})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = load_timeline(path)
    assert data.counts == {"step": 100, "window": 0, "gpu": 0, "alert": 60}
    assert data.run["dtype"] == "bfloat16" and data.run["peak_flops_per_second"] == 1e15
    assert data.step_columns.quantile("step_time_seconds", 0.5) == 0.1
    assert data.step_columns.quantile("mfu", 0.5) == pytest.approx(1e12 / 0.1 / 1e15)  # 0.0033 on 40%, 0.01 on 60%
    fig = figs.mfu_figure(data.steps, data.alerts)
    assert len(fired) == 30
    assert [a.text for a in fig.layout.annotations] == [n for n, _ in fired]
    assert [a.yshift for a in fig.layout.annotations] == [-14 * (i % 4) for i in range(30)]
    xs = [figs.utc(t) for _, t in fired]
    assert [s.x0 for s in fig.layout.shapes] == xs and [s.x1 for s in fig.layout.shapes] == xs
    assert all(s.type == "line" and s.yref == "paper" and (s.y0, s.y1) == (0, 1) for s in fig.layout.shapes)
    page = render_html(data)
    assert "Step time (median)</div><div class=\"value\">100.0 ms" in page
    assert "MFU (median)</div><div class=\"value\">1.0%" in page
