"""Streaming read of an agent timeline for ``mfuwatch report``: bounded memory whatever the file's size.

A long run's timeline reaches gigabytes (a step record every ``report_every_steps`` steps, a GPU
record every 10 s). The report needs, per kind:

* the run's facts (``run`` records), the latest profiler window in full, every alert (up to
  :data:`MAX_ALERTS`; past it the count of the others is kept and shown);
* exact run-wide medians and quantiles of the step series: one float64 per record and field
  in :class:`StepColumns` (48 bytes a step record, against ~1 KB for the parsed dict);
* what the charts draw: at most :data:`MAX_POINTS` points per kind. Past that, adjacent records
  are merged pairwise (:func:`merge_steps`: means weighted by the steps each covers; GPU samples:
  plain means; windows: every other one kept), so a chart of a month-long run has the shape of the
  whole run in a few thousand points. :attr:`TimelineData.merged` says how many records each
  drawn point stands for.

Lines are read one at a time, each at most :data:`MAX_LINE_BYTES`; a longer or malformed line
(other than a torn last line, which a killed job leaves) is an error naming its line number.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

#: points per chart series at most (each merge halves the list when it reaches twice this)
MAX_POINTS = 4000
#: alert records listed at most (the others are counted)
MAX_ALERTS = 10000
#: longest timeline line accepted; the agent's longest records (a window with its top ops) are a few KB
MAX_LINE_BYTES = 16 << 20
#: step-record fields kept exactly for the run-wide medians and quantiles
STEP_FIELDS = ("mfu", "hfu", "model_flops_per_second", "tokens_per_second", "step_time_seconds")
#: numeric step fields averaged (weighted by ``steps``) when two drawn points merge
_STEP_MEAN = STEP_FIELDS + ("tokens_per_step", "loss")


class StepColumns:
    """Every step record's value of each :data:`STEP_FIELDS` field and its weight (``steps``), as float64 arrays.

    A missing value is stored as NaN and left out of its field's quantiles.
    """

    def __init__(self) -> None:
        self.weights = array("d")
        self.values: Dict[str, array] = {k: array("d") for k in STEP_FIELDS}

    def add(self, rec: Dict[str, Any]) -> None:
        self.weights.append(_num(rec.get("steps"), 1.0))
        for k, col in self.values.items():
            col.append(_num(rec.get(k), float("nan")))

    def __len__(self) -> int:
        return len(self.weights)

    def quantile(self, key: str, q: float) -> Optional[float]:
        """The weighted quantile ``q`` of field ``key`` (inverted CDF, as
        :func:`mfuwatch.agent.report.figures.weighted_quantile`), or ``None`` without values."""
        import numpy as np

        v = np.frombuffer(self.values[key], dtype=np.float64)
        w = np.frombuffer(self.weights, dtype=np.float64)
        keep = np.isfinite(v) & (w > 0)
        v, w = v[keep], w[keep]
        if v.size == 0:
            return None
        order = np.argsort(v, kind="stable")
        cum = np.cumsum(w[order])
        i = int(np.searchsorted(cum, q * cum[-1], side="left"))
        return float(v[order][min(i, v.size - 1)])


def _num(x: Any, default: float) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return default
    return float(x)


@dataclass
class TimelineData:
    """The records of one run, grouped by kind, in file order (timestamps ascending), bounded in size.

    ``steps``/``windows``/``gpus`` are what the charts draw (downsampled past :data:`MAX_POINTS`);
    ``step_columns`` has every step record's values for exact medians; ``last_window`` is the latest
    window record in full; ``alerts`` the first :data:`MAX_ALERTS` alert records and
    ``alerts_not_listed`` the count of the others; ``merged[kind]`` how many records one drawn point
    stands for (1: none merged); ``counts[kind]`` the records read.
    """

    run: Dict[str, Any] = field(default_factory=dict)
    steps: List[Dict[str, Any]] = field(default_factory=list)
    windows: List[Dict[str, Any]] = field(default_factory=list)
    gpus: List[Dict[str, Any]] = field(default_factory=list)
    alerts: List[Dict[str, Any]] = field(default_factory=list)
    step_columns: StepColumns = field(default_factory=StepColumns)
    last_window: Dict[str, Any] = field(default_factory=dict)
    alerts_not_listed: int = 0
    merged: Dict[str, int] = field(default_factory=lambda: {"step": 1, "window": 1, "gpu": 1})
    counts: Dict[str, int] = field(default_factory=lambda: {"step": 0, "window": 0, "gpu": 0, "alert": 0})
    # pending halves of a merge: a record waiting for its partner at the current stride
    _carry: Dict[str, Any] = field(default_factory=dict, repr=False)


def merge_steps(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """One drawn point for two adjacent step records: ``b``'s step and timestamp, summed ``steps`` and
    ``tokens``, and the other numeric fields averaged with the steps each covers as weights."""
    wa, wb = _num(a.get("steps"), 1.0), _num(b.get("steps"), 1.0)
    out = dict(b)
    out["steps"] = wa + wb
    out["tokens"] = _num(a.get("tokens"), 0.0) + _num(b.get("tokens"), 0.0)
    for k in _STEP_MEAN:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and wa + wb > 0:
            out[k] = (va * wa + vb * wb) / (wa + wb)
        elif va is not None and vb is None:
            out[k] = va
    return out


def _merge_gpu(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(b)
    for k, vb in b.items():
        va = a.get(k)
        if k != "timestamp" and isinstance(va, (int, float)) and isinstance(vb, (int, float)) and \
                not isinstance(vb, bool):
            out[k] = (va + vb) / 2.0
    return out


_WINDOW_KEEP = ("kind", "step", "timestamp", "breakdown", "memory_bound_share")


def _add_point(data: TimelineData, kind: str, rec: Dict[str, Any]) -> None:
    """Append a drawn point, merging ``merged[kind]`` consecutive records into one (see the module docstring)."""
    series = {"step": data.steps, "window": data.windows, "gpu": data.gpus}[kind]
    stride = data.merged[kind]
    if stride > 1:  # combine `stride` consecutive records into one point
        acc = data._carry.get(kind)
        if acc is None:
            data._carry[kind] = (rec, 1)
            return
        prev, n = acc
        rec = _merge(kind, prev, rec)
        n += 1
        if n < stride:
            data._carry[kind] = (rec, n)
            return
        data._carry.pop(kind, None)
    series.append(rec)
    if len(series) >= 2 * MAX_POINTS:
        series[:] = [_merge(kind, series[i], series[i + 1]) for i in range(0, len(series) - 1, 2)]
        data.merged[kind] = stride * 2


def _merge(kind: str, a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    if kind == "step":
        return merge_steps(a, b)
    if kind == "gpu":
        return _merge_gpu(a, b)
    return b  # windows: the later one stands for both


def _finish(data: TimelineData) -> TimelineData:
    for kind, series in (("step", data.steps), ("window", data.windows), ("gpu", data.gpus)):
        acc = data._carry.pop(kind, None)
        if acc is not None:
            series.append(acc[0])  # the last, partial group: drawn too (the run's end is never dropped)
    return data


def load_timeline(path: Union[str, Path]) -> TimelineData:
    """Group the records of the last run in ``path`` by kind, streaming; unknown kinds are skipped.

    A ``run`` record with another ``run``/``rank`` than the current one starts over (a
    new run appended to the file); one with the same labels (a restarted job, or facts
    learnt later such as the peak) only fills in the run's facts.

    Raises:
        OSError: if the file cannot be read.
        ValueError: a line other than the last is not JSON, or a line is longer than
            :data:`MAX_LINE_BYTES` (naming the line number).
    """
    data = TimelineData()
    pending_error: Optional[str] = None
    with open(path, "rb") as fh:
        lineno = 0
        while True:
            line = fh.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            lineno += 1
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES >> 20} MiB; the agent's "
                                 "records are a few KB: not an mfuwatch timeline")
            if not line.strip():
                continue
            if pending_error is not None:
                raise ValueError(pending_error)
            try:
                rec = json.loads(line)
            except ValueError as exc:  # UnicodeDecodeError included
                pending_error = f"{path}:{lineno}: not a JSON line: {exc}"
                continue
            if not isinstance(rec, dict):
                continue
            data = _absorb(data, rec)
    return _finish(data)


def _absorb(data: TimelineData, rec: Dict[str, Any]) -> TimelineData:
    kind = rec.get("kind")
    if kind == "run":
        same = data.run and (rec.get("run"), rec.get("rank")) == (data.run.get("run"), data.run.get("rank"))
        if same:
            data.run.update({k: v for k, v in rec.items() if v not in (None, "", {}, [])})
            return data
        return TimelineData(run=rec)
    if kind == "step":
        data.counts["step"] += 1
        data.step_columns.add(rec)
        _add_point(data, "step", rec)
    elif kind == "window":
        data.counts["window"] += 1
        data.last_window = rec
        _add_point(data, "window", {k: rec[k] for k in _WINDOW_KEEP if k in rec})
    elif kind == "gpu":
        data.counts["gpu"] += 1
        _add_point(data, "gpu", rec)
    elif kind == "alert":
        data.counts["alert"] += 1
        if len(data.alerts) < MAX_ALERTS:
            data.alerts.append(rec)
        else:
            data.alerts_not_listed += 1
    return data
