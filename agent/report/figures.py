"""The plotly figures of the ``mfuwatch report`` page, one per panel of the "Training MFU" dashboard.

Each function takes timeline records (dicts as written by ``schema.to_record``)
and returns a ``plotly.graph_objects.Figure``; an empty input gives a figure
that says what is missing instead of an empty axis. Times are drawn in UTC.
The time breakdown is scaled like the dashboard's stacked panel: the busy
categories are shares of GPU busy time, so each is multiplied by
``1 - idle`` and the stack, idle on top, adds up to the window's wall time.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Dict, List, Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..schema import BUSY_CATEGORIES, CATEGORIES

#: Same colours as the dashboard's breakdown panel overrides.
CATEGORY_COLORS = {"compute_bound": "#56a64b", "memory_bound": "#ff9830", "communication": "#3274d9",
                   "other": "#a352cc", "idle": "#b7b7b7"}
#: The legend sits at the bottom of the figure (``yref="container"``), not at a fraction of the plot
#: area's height below it: placed relative to the plot area, whose height depends on the margin the
#: legend itself pushes, it made Plotly re-lay out in a loop ("Too many auto-margin redraws").
_LAYOUT = dict(template="plotly_white", height=330, margin=dict(l=60, r=20, t=50, b=70),
               legend=dict(orientation="h", yref="container", y=0.0, yanchor="bottom"), hovermode="x unified")
_Rec = Dict[str, Any]


def utc(ts: float) -> _dt.datetime:
    """Unix seconds to an aware UTC datetime."""
    return _dt.datetime.fromtimestamp(float(ts), tz=_dt.timezone.utc)


def weighted_quantile(values: Sequence[float], weights: Sequence[float], q: float) -> Optional[float]:
    """The smallest value whose cumulative weight reaches ``q`` of the total (inverted CDF, no interpolation).

    Used for step-time quantiles: each report interval's mean step time weighted by
    the number of steps it covers. Returns ``None`` for no values or zero total weight.
    """
    pairs = sorted((float(v), float(w)) for v, w in zip(values, weights) if w > 0)
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return None
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= q * total:
            return v
    return pairs[-1][0]


def wall_time_shares(breakdown: Dict[str, float]) -> Dict[str, float]:
    """Breakdown of one window as shares of its wall time: busy categories × (1 - idle), then idle.

    ``breakdown`` maps :data:`CATEGORIES` to shares (busy ones of busy time, ``idle``
    of wall time); missing categories count as 0.
    """
    idle = float(breakdown.get("idle") or 0.0)
    out = {c: float(breakdown.get(c) or 0.0) * (1.0 - idle) for c in BUSY_CATEGORIES}
    out["idle"] = idle
    return out


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=why, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    fig.update_layout(title=title, xaxis=dict(visible=False), yaxis=dict(visible=False), **_LAYOUT)
    return fig


def _line(records: List[_Rec], key: str, name: str, scale: float = 1.0, mode: str = "lines+markers",
          **kw: Any) -> go.Scatter:
    pts = [(utc(r["timestamp"]), float(r[key]) * scale, r.get("step")) for r in records if r.get(key) is not None]
    hover = "%{y:.4g} (step %{customdata})" if any(p[2] is not None for p in pts) else "%{y:.4g}"
    return go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], customdata=[p[2] for p in pts], name=name,
                      mode=mode, hovertemplate=hover, **kw)


def mfu_figure(steps: List[_Rec], alerts: List[_Rec]) -> go.Figure:
    """MFU and HFU per report interval, with a dotted line and label at every alert that fired."""
    title = "MFU and HFU"
    if not any(s.get("mfu") is not None for s in steps):
        return _empty(title, "MFU not reported: the peak FLOP/s of this device is unknown"
                      if steps else "No step measurements in this timeline")
    fig = go.Figure([_line(steps, "mfu", "MFU"), _line(steps, "hfu", "HFU", line=dict(dash="dash"))])
    firing = [a for a in alerts if a.get("status") == "firing"]
    shapes, notes = [], []
    for i, a in enumerate(firing):
        t = utc(a["timestamp"])
        shapes.append(dict(type="line", xref="x", yref="paper", x0=t, x1=t, y0=0, y1=1,
                           line=dict(color="#cf222e", dash="dot", width=1)))
        # Alerts of one evaluation share a timestamp: stack their labels downwards.
        notes.append(dict(x=t, y=1, xref="x", yref="paper", text=str(a.get("alertname", "alert")),
                          showarrow=False, yanchor="top", xanchor="left", yshift=-14 * (i % 4),
                          font=dict(color="#cf222e", size=11)))
    # one layout update for all markers: plotly's add_shape/add_annotation copy the whole list each call,
    # quadratic in the alerts (a 1 GB timeline's 635 firing alerts took 110 s of the report's 140 s)
    fig.update_layout(title=title, yaxis=dict(tickformat=".1%", rangemode="tozero"), shapes=shapes,
                      annotations=notes, **_LAYOUT)
    return fig


def flops_figure(steps: List[_Rec], peak: Optional[float]) -> go.Figure:
    """Achieved model FLOP/s per GPU against the peak the MFU is computed with (scaled to T/G/MFLOP/s)."""
    title = "Model FLOP/s against peak"
    if not steps:
        return _empty(title, "No step measurements in this timeline")
    top = max([float(s.get("model_flops_per_second") or 0.0) for s in steps] + [peak or 0.0])
    scale, unit = next(((k, u) for k, u in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"),
                                            (1e6, "MFLOP/s")) if top >= k), (1.0, "FLOP/s"))
    fig = go.Figure([_line(steps, "model_flops_per_second", f"model {unit}", 1.0 / scale)])
    if peak:
        fig.add_trace(go.Scatter(x=[utc(steps[0]["timestamp"]), utc(steps[-1]["timestamp"])],
                                 y=[peak / scale, peak / scale], name="peak", mode="lines",
                                 line=dict(dash="dash", color="#57606a")))
    fig.update_layout(title=title, yaxis=dict(title=unit, rangemode="tozero"), **_LAYOUT)
    return fig


def tokens_figure(steps: List[_Rec]) -> go.Figure:
    """Training tokens per second per report interval."""
    title = "Tokens per second"
    if not steps:
        return _empty(title, "No step measurements in this timeline")
    fig = go.Figure([_line(steps, "tokens_per_second", "tokens/s")])
    fig.update_layout(title=title, yaxis=dict(title="tokens/s", rangemode="tozero"), **_LAYOUT)
    return fig


def step_time_figure(steps: List[_Rec], quantile: Optional[Any] = None) -> go.Figure:
    """Mean step time per report interval, with the p50/p90/p99 over the run (weighted by steps).

    ``quantile(q)``, when given, computes the run's quantiles (the report passes the exact ones of every
    step record, :meth:`mfuwatch.agent.report.load.Columns.quantile`, as ``steps`` may be downsampled).
    """
    title = "Step time"
    if not steps:
        return _empty(title, "No step measurements in this timeline")
    fig = go.Figure([_line(steps, "step_time_seconds", "mean step time per interval")])
    timed = [s for s in steps if s.get("step_time_seconds") is not None]
    vals = [float(s["step_time_seconds"]) for s in timed]
    weights = [float(s.get("steps") or 1) for s in timed]
    x = [utc(steps[0]["timestamp"]), utc(steps[-1]["timestamp"])]
    for q, dash in ((0.5, "dash"), (0.9, "dashdot"), (0.99, "dot")):
        v = quantile(q) if quantile is not None else weighted_quantile(vals, weights, q)
        if v is None:
            break
        fig.add_trace(go.Scatter(x=x, y=[v, v], mode="lines", name=f"p{round(q * 100)} over the run",
                                 line=dict(dash=dash, width=1)))
    fig.update_layout(title=title, yaxis=dict(title="seconds", rangemode="tozero"), **_LAYOUT)
    return fig


def breakdown_figure(windows: List[_Rec]) -> go.Figure:
    """Stacked time breakdown of every profiler window, as shares of the window's wall time."""
    title = "Time breakdown (share of profiler window wall time)"
    if not windows:
        return _empty(title, "No profiler window in this timeline")
    labels = [f"step {w['step']}" for w in windows]
    shares = [wall_time_shares(w.get("breakdown") or {}) for w in windows]
    fig = go.Figure([go.Bar(x=labels, y=[s[c] for s in shares], name=c, marker_color=CATEGORY_COLORS[c],
                            hovertemplate="%{y:.1%}") for c in CATEGORIES])
    fig.update_layout(title=title, barmode="stack", yaxis=dict(tickformat=".0%", range=[0, 1]), **_LAYOUT)
    return fig


def memory_bound_figure(windows: List[_Rec]) -> go.Figure:
    """Memory-bound share of GPU busy time per profiler window."""
    title = "Memory-bound share of GPU busy time"
    if not windows:
        return _empty(title, "No profiler window in this timeline")
    fig = go.Figure([_line(windows, "memory_bound_share", "memory-bound share",
                           line=dict(color=CATEGORY_COLORS["memory_bound"]))])
    fig.update_layout(title=title, yaxis=dict(tickformat=".0%", range=[0, 1]), **_LAYOUT)
    return fig


def gpu_figure(gpus: List[_Rec]) -> go.Figure:
    """NVML samples: utilization and GPM activity, power against limit, temperature, memory used."""
    fig = make_subplots(rows=2, cols=2, subplot_titles=("Utilization and activity", "Power against limit (W)",
                                                        "Temperature (°C)", "Device memory (GiB)"))
    panels = (
        (1, 1, (("utilization", "utilization", 1.0), ("tensor_active", "tensor active", 1.0),
                ("dram_active", "DRAM active", 1.0), ("sm_active", "SM active", 1.0))),
        (1, 2, (("power_watts", "power", 1.0), ("power_limit_watts", "limit", 1.0))),
        (2, 1, (("temperature_celsius", "temperature", 1.0),)),
        (2, 2, (("memory_used_bytes", "used", 2.0 ** -30), ("memory_total_bytes", "total", 2.0 ** -30))),
    )
    for row, col, series in panels:
        for key, name, scale in series:
            if any(g.get(key) is not None for g in gpus):
                fig.add_trace(_line(gpus, key, name, scale, mode="lines"), row=row, col=col)
    fig.update_yaxes(tickformat=".0%", range=[0, 1], row=1, col=1)
    layout = dict(_LAYOUT, height=600, hovermode="x")
    fig.update_layout(title="GPU health (NVML)", **layout)
    return fig
