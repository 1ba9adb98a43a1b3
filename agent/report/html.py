"""``mfuwatch report``: one self-contained HTML page drawn from an agent's local timeline.

The page carries the panels of the "Training MFU" Grafana dashboard, read from
the JSONL timeline the agent writes (record kinds ``run``, ``step``,
``window``, ``gpu``, ``alert``; see :mod:`mfuwatch.agent.live.timeline`) instead of
Prometheus: MFU and HFU over time, model FLOP/s against peak, tokens/s, step
time, the time breakdown of every profiler window, the memory-bound share, the
top ops and the suggested remedies of the latest window (with the line that
applies each), GPU health when NVML was sampled, and the alerts that fired.
plotly.js is embedded once, so the file opens with no network.

Run::

    mfuwatch report mfuwatch-demo/timeline.jsonl -o report.html

The timeline file is opened for appending, so several runs can share one file;
the report shows the last run (the records after the last ``run`` record).
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .load import TimelineData, load_timeline  # noqa: F401  (streaming, bounded memory: agent/report/load.py)


def peak_flops(data: TimelineData) -> Optional[float]:
    """Peak FLOP/s of one device: from the run record, else implied by a step (model FLOP/s / MFU).

    The agent may learn the peak after the ``run`` record is written (the training
    dtype is known at the first forward), so the steps are the fallback.
    """
    peak = data.run.get("peak_flops_per_second")
    if isinstance(peak, (int, float)) and not isinstance(peak, bool) and 0 < peak < float("inf"):
        return float(peak)
    for s in reversed(data.steps):
        if s.get("mfu"):
            return float(s["model_flops_per_second"]) / float(s["mfu"])
    return None


def _fmt(value: Optional[float], kind: str) -> str:
    if value is None:
        return "n/a"
    if kind == "pct":
        return f"{100.0 * value:.1f}%"
    if kind == "s":
        return f"{value * 1e3:.1f} ms" if value < 1.0 else f"{value:.3f} s"
    if kind == "flops":
        for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {unit}"
        return f"{value:.0f} FLOP/s"
    if kind == "rate":
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], row_classes: Sequence[str] = ()) -> str:
    """An HTML table; cells are HTML already (callers escape text with :func:`html.escape`)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if i < len(row_classes) and row_classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _summary(data: TimelineData) -> str:
    def median(key: str) -> Optional[float]:  # over every step record, weighted by the steps each covers
        return data.step_columns.quantile(key, 0.5)

    last_window = data.last_window
    cards = [
        ("MFU (median)", _fmt(median("mfu"), "pct")),
        ("HFU (median)", _fmt(median("hfu"), "pct")),
        ("Model FLOP/s (median)", _fmt(median("model_flops_per_second"), "flops")),
        ("Tokens/s (median)", _fmt(median("tokens_per_second"), "rate")),
        ("Step time (median)", _fmt(median("step_time_seconds"), "s")),
        ("Memory-bound share (latest window)", _fmt(last_window.get("memory_bound_share"), "pct")),
    ]
    return "".join(f'<div class="card"><div class="label">{html.escape(k)}</div>'
                   f'<div class="value">{html.escape(v)}</div></div>' for k, v in cards)


def _run_facts(data: TimelineData) -> str:
    r = data.run
    peak = peak_flops(data)
    last = data.steps[-1]["step"] if data.steps else None
    facts = [
        ("Run", r.get("run", "unknown")), ("Rank", f"{r.get('rank', '?')} of {r.get('world_size', '?')}"),
        ("Host", r.get("host") or "n/a"), ("Device", r.get("gpu_name") or r.get("device") or "n/a"),
        ("Training dtype", r.get("dtype") or "n/a"),
        ("Peak FLOP/s", f"{_fmt(peak, 'flops')} ({r.get('peak_source') or 'source unknown'})" if peak else
         "unknown: MFU is not reported"),
        ("FLOP count from", r.get("flops_source") or "n/a"),
        ("Steps measured", f"up to step {last}" if last is not None else "none"),
        ("Profiler windows", str(data.counts["window"])), ("Alerts", str(data.counts["alert"])),
    ]
    drawn = [f"{data.counts[k]:,} {k} records drawn as {len(series):,} points (each the mean of up to "
             f"{data.merged[k]} consecutive records)" for k, series in (("step", data.steps), ("gpu", data.gpus),
                                                                         ("window", data.windows))
             if data.merged[k] > 1]
    if drawn:
        facts.append(("Charts", "; ".join(drawn)))
    return _table(["Fact", "Value"], [[html.escape(k), html.escape(str(v))] for k, v in facts])


def _ops_table(window: Dict[str, Any]) -> str:
    ops = window.get("top_ops") or []
    if not ops:
        return '<p class="empty">The latest profiler window recorded no ops.</p>'
    rows, classes = [], []
    for op in ops:
        ai = op.get("arithmetic_intensity")
        rows.append([f"<code>{html.escape(op['op'])}</code>", html.escape(op.get("bound", "")),
                     _fmt(op.get("share"), "pct"), _fmt(op.get("time_seconds"), "s"),
                     str(op.get("kernels", "")), "n/a" if ai is None else f"{ai:.1f}"])
        classes.append("memory" if op.get("bound") == "memory" else "")
    return _table(["Op", "Bound", "Share of GPU busy time", "GPU time in window", "Kernels",
                   "Arithmetic intensity (FLOP/B)"], rows, classes)


def _suggestions_table(window: Dict[str, Any]) -> str:
    # keep the agent's ranking: existing torch fixes before bundled kernels, each by expected gain
    sugg = list(window.get("suggestions") or [])
    if not sugg:
        return '<p class="empty">No remedies suggested in the latest profiler window.</p>'
    rows = [[html.escape(s.get("title", s.get("kernel", ""))), html.escape(s.get("kind", "")),
             f"<code>{html.escape(s.get('apply', ''))}</code>",
             ", ".join(f"<code>{html.escape(o)}</code>" for o in s.get("ops", [])),
             _fmt(s.get("time_seconds"), "s"), _fmt(s.get("expected_gain"), "pct")] for s in sugg]
    return _table(["Remedy", "Kind", "Apply with", "Replaces", "Op time per step", "Expected gain"], rows)


def _alerts_table(alerts: List[Dict[str, Any]]) -> str:
    from .figures import utc

    if not alerts:
        return '<p class="empty">No alert fired during this run.</p>'
    def text(x: Any) -> str:  # a record's field as escaped text, whatever JSON value it holds
        return "" if x is None else html.escape(str(x))

    rows, classes = [], []
    for a in alerts:
        ann = a.get("annotations")
        ann = ann if isinstance(ann, dict) else {}
        detail = ann.get("description") or ann.get("suggestion") or ""
        rows.append([html.escape(utc(a.get("timestamp", 0.0)).strftime("%Y-%m-%d %H:%M:%S UTC")),
                     text(a.get("alertname")), text(a.get("status")), text(a.get("severity")),
                     text(a.get("summary")), text(detail)])
        classes.append("firing" if a.get("status") == "firing" else "")
    return _table(["Time", "Alert", "Status", "Severity", "Summary", "Details"], rows, classes)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1f2328;background:#fff}
h1{margin:0 0 4px}h2{margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.sub{color:#57606a;margin-bottom:16px}.cards{display:flex;flex-wrap:wrap;gap:12px}
.card{border:1px solid #d0d7de;border-radius:6px;padding:10px 14px;min-width:150px}
.card .label{color:#57606a;font-size:13px}.card .value{font-size:24px;font-weight:600}
table{border-collapse:collapse;margin:8px 0;font-size:14px}th,td{border:1px solid #d0d7de;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f6f8fa}tr.memory td{background:#fff4e5}
tr.firing td{background:#ffebe9}code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px}
.empty{color:#57606a;font-style:italic}
.note{background:#fff8c5;border:1px solid #d4a72c;border-radius:6px;padding:8px 12px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:8px}
@media (max-width:1000px){.grid{grid-template-columns:1fr}}
"""


def _skipped_note(data: TimelineData, name: str) -> str:
    summary = data.skipped_summary(name)
    if summary is None:
        return ""
    return (f'<p class="note"><b>Note:</b> {html.escape(summary)}. They are left out of every chart and figure; '
            "the report shows the rest.</p>")


def render_html(data: TimelineData, name: str = "the timeline") -> str:
    """The whole page as one string, plotly.js included (about 4.5 MB); ``name`` (the timeline file's name)
    appears in the note on the lines skipped, shown at the top when :attr:`TimelineData.skipped` has any."""
    import plotly.offline

    from . import figures as figs

    def div(fig) -> str:
        return fig.to_html(full_html=False, include_plotlyjs=False,
                           config={"displaylogo": False, "responsive": True})

    peak = peak_flops(data)
    window = data.last_window
    charts = [figs.mfu_figure(data.steps, data.alerts), figs.flops_figure(data.steps, peak),
              figs.tokens_figure(data.steps),
              figs.step_time_figure(data.steps, lambda q: data.step_columns.quantile("step_time_seconds", q)),
              figs.breakdown_figure(data.windows), figs.memory_bound_figure(data.windows)]
    gpu = figs.gpu_figure(data.gpus) if data.gpus else None
    run = html.escape(str(data.run.get("run", "unknown run")))
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>mfuwatch report: {run}</title><style>{_CSS}</style>",
        f"<script type=\"text/javascript\">{plotly.offline.get_plotlyjs()}</script></head><body>",
        f"<h1>mfuwatch report: {run}</h1>",
        "<div class=\"sub\">MFU = model FLOPs per step / step time / peak FLOP/s of one GPU for the training "
        "dtype (PaLM, Chowdhery et al. 2022, appendix B). HFU counts the FLOPs actually executed, "
        "recomputation included.</div>",
        _skipped_note(data, name),
        f"<div class=\"cards\">{_summary(data)}</div>",
        "<h2>Over time</h2>",
        "<div class=\"grid\">" + "".join(f"<div>{div(f)}</div>" for f in charts) + "</div>",
        "<h2>Top ops of the latest profiler window</h2>", _ops_table(window),
        "<h2>Suggested remedies</h2>", _suggestions_table(window),
        "<h2>Alerts</h2>", _alerts_table(data.alerts),
        (f'<p class="empty">{data.alerts_not_listed:,} later alert records are not listed.</p>'
         if data.alerts_not_listed else ""),
        "<h2>GPU health</h2>", div(gpu) if gpu is not None else
        '<p class="empty">No NVML samples in this timeline (no NVIDIA GPU, or NVML unavailable).</p>',
        "<h2>Run</h2>", _run_facts(data),
        "</body></html>",
    ]
    return "\n".join(parts)


def write_report(timeline_path: Union[str, Path], out_path: Union[str, Path],
                 warn: Optional[Callable[[str], None]] = None) -> Path:
    """Read ``timeline_path`` (JSONL) and write the HTML report to ``out_path``; return its absolute path.

    Lines that cannot be used (not JSON, not an object, too long, an implausible step number or
    timestamp: :mod:`.load`) are skipped; ``warn`` (when given) is then called once with the one-line summary
    (:meth:`TimelineData.skipped_summary`), which the page also shows.

    Raises:
        OSError: if the timeline cannot be read or the report cannot be written.
        ValueError: if the timeline holds no usable timeline record at all (the message says which
            lines were skipped, if any).
    """
    data = load_timeline(timeline_path)
    name = Path(timeline_path).name
    summary = data.skipped_summary(name)
    if not (data.run or data.steps or data.windows or data.gpus or data.alerts):
        raise ValueError(f"{timeline_path}: no mfuwatch timeline records (kinds run, step, window, gpu, alert)"
                         + (f"; {summary}" if summary else "") + "; is this the agent's `timeline:` file?")
    if summary and warn is not None:
        warn(summary)
    out = Path(out_path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data, name), encoding="utf-8")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """``mfuwatch report TIMELINE.jsonl [-o report.html]``. Returns 0 (lines skipped: one line on stderr says
    which), or 2 when the timeline cannot be read, holds no usable record, or plotly (the ``report`` extra)
    is not installed."""
    parser = argparse.ArgumentParser(prog="mfuwatch report",
                                     description="Write a self-contained HTML report from an mfuwatch timeline.")
    parser.add_argument("timeline", type=Path, help="the agent's JSONL timeline (timeline: in the agent config)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="HTML file to write (default: the timeline's path with .html)")
    args = parser.parse_args(argv)
    from . import missing_dependency

    missing = missing_dependency()
    if missing:
        print(f"mfuwatch report: {missing}", file=sys.stderr)
        return 2
    out = args.output or args.timeline.with_suffix(".html")
    try:
        path = write_report(args.timeline, out, warn=lambda msg: print(f"mfuwatch report: {msg}", file=sys.stderr))
    except (OSError, ValueError) as exc:
        print(f"mfuwatch report: {exc}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
