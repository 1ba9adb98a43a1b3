"""Streaming read of an agent timeline for ``mfuwatch report``: bounded memory whatever the file's size.

A long run's timeline reaches gigabytes (a step record every ``report_every_steps`` steps, a GPU
record every 10 s). The report needs, per kind:

* the run's facts (``run`` records), the latest profiler window in full, every alert (up to
  :data:`MAX_ALERTS`; past it the count of the others is kept and shown);
* every step, GPU and window record's numbers, one float64 per record and field in
  :class:`Columns` (64 bytes a step record, against ~1 KB for the parsed dict): the run-wide
  medians and quantiles are exact;
* what the charts draw: at most :data:`MAX_POINTS` points per kind, built from the columns at the
  end. Past that, consecutive records are grouped into one point (:meth:`Columns.points`: means
  weighted by the steps each record covers; GPU samples: plain means; a window point shows its
  group's last breakdown), so a chart of a month-long run has the shape of the whole run in a few
  thousand points. :attr:`TimelineData.merged` says how many records one drawn point stands for.

Lines are read one at a time, each at most :data:`MAX_LINE_BYTES`. A line that cannot be used is
skipped and counted in :attr:`TimelineData.skipped` (the reason, how many, the first line numbers),
as resume does (:func:`mfuwatch.agent.fleet.goodput.iter_tail_records`), and the rest is reported:
a line that is not JSON (a job killed mid-write leaves a cut line, which the restarted job's
records follow on the next line), JSON that is not an object, a line longer than
:data:`MAX_LINE_BYTES` (read past in bounded chunks), a ``step`` or ``window`` record whose ``step``
is not a whole number in ``0..``:data:`MAX_PLAUSIBLE_STEP`, a ``step`` record whose ``steps`` is
given but not a whole number in ``1..step``, and a record drawn on a time axis (``step``,
``window``, ``gpu``, ``alert``) whose ``timestamp`` is not unix seconds in
``0..``:data:`MAX_TIMESTAMP`. A torn last line (no newline after it: the job is still writing, or was
killed) is skipped without counting.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

#: points per chart series at most (consecutive records are grouped into one point past it)
MAX_POINTS = 4000
#: alert records listed at most (the others are counted)
MAX_ALERTS = 10000
#: longest timeline line accepted; the agent's longest records (a window with its top ops) are a few KB
MAX_LINE_BYTES = 16 << 20
#: largest step number believed; the bound resume uses (``mfuwatch.agent.fleet.goodput.MAX_PLAUSIBLE_STEP``,
#: not imported: ``report`` reads only the timeline and ``schema``)
MAX_PLAUSIBLE_STEP = 10**12
#: line numbers kept per skip reason (the others are counted)
MAX_SKIPPED_LINES = 5
#: step-record fields kept exactly for the run-wide medians and quantiles
STEP_FIELDS = ("mfu", "hfu", "model_flops_per_second", "tokens_per_second", "step_time_seconds")
#: GPU-record fields the health chart draws
GPU_FIELDS = ("utilization", "tensor_active", "dram_active", "sm_active", "power_watts", "power_limit_watts",
              "temperature_celsius", "memory_used_bytes", "memory_total_bytes")


_NAN = float("nan")


def _num(x: Any, default: float) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return default
    return float(x)


class Columns:
    """One float64 array per field of a record kind, a record per row (NaN: missing), and a weight per row.

    Args:
        fields: fields averaged into a drawn point (weighted by the rows' weights).
        last: fields a drawn point takes from its last row (``timestamp``, ``step``).
        weight: the field holding a row's weight (``steps`` for step records), or ``None`` (weight 1).
    """

    def __init__(self, fields: Sequence[str], last: Sequence[str] = ("timestamp",), weight: Optional[str] = None):
        self.fields, self.last, self.weight = tuple(fields), tuple(last), weight
        self.weights = array("d")
        self.values: Dict[str, array] = {k: array("d") for k in self.fields + self.last}
        self._appends = tuple((k, col.append) for k, col in self.values.items())

    def add(self, rec: Dict[str, Any]) -> None:
        get = rec.get
        if self.weight:
            w = get(self.weight)
            self.weights.append(w if type(w) is float else _num(w, 1.0))
        else:
            self.weights.append(1.0)
        for k, append in self._appends:
            v = get(k)
            append(v if type(v) is float else _num(v, _NAN))  # the hot path: a float as written

    def __len__(self) -> int:
        return len(self.weights)

    def quantile(self, key: str, q: float) -> Optional[float]:
        """The weighted quantile ``q`` of field ``key`` over every row (inverted CDF, as
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

    def points(self, kind: str, max_points: int) -> Tuple[List[Dict[str, Any]], int]:
        """At most ``max_points`` drawn records, each standing for ``group`` consecutive rows (the last
        group may be shorter): weighted means of :attr:`fields` over the rows where they are present,
        :attr:`last` fields of the group's last row, the weight field summed. Returns ``(records, group)``."""
        import numpy as np

        n = len(self)
        if n == 0:
            return [], 1
        group = max(1, -(-n // max_points))
        starts = np.arange(0, n, group)
        w = np.frombuffer(self.weights, dtype=np.float64)
        cols: Dict[str, Any] = {}
        for k in self.fields:
            v = np.frombuffer(self.values[k], dtype=np.float64)
            ok = np.isfinite(v)
            wv = np.where(ok, w, 0.0)
            num = np.add.reduceat(np.where(ok, v * w, 0.0), starts)
            den = np.add.reduceat(wv, starts)
            with np.errstate(invalid="ignore", divide="ignore"):
                cols[k] = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
        ends = np.minimum(starts + group, n) - 1
        for k in self.last:
            cols[k] = np.frombuffer(self.values[k], dtype=np.float64)[ends]
        wsum = np.add.reduceat(w, starts)
        out = []
        for i in range(starts.size):
            rec: Dict[str, Any] = {"kind": kind}
            for k, c in cols.items():
                x = float(c[i])
                rec[k] = x if x == x else None
            if self.weight:
                rec[self.weight] = float(wsum[i])
            if rec.get("step") is not None:
                rec["step"] = int(rec["step"])
            out.append(rec)
        return out, group


def merge_steps(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """One drawn point for two adjacent step records (what :meth:`Columns.points` does for a group of two)."""
    c = Columns(STEP_FIELDS, last=("timestamp", "step"), weight="steps")
    c.add(a)
    c.add(b)
    return c.points("step", 1)[0][0]


_INF = float("inf")


def _whole(x: Any) -> Optional[int]:
    """``x`` as an int when it is a finite whole number (an int, or a float such as 10.0), else ``None``."""
    if type(x) is int:
        return x
    if type(x) is float and x == x and x not in (_INF, -_INF) and x == int(x):
        return int(x)
    return None


#: skip reasons, as the message words them
NOT_JSON = "not JSON"
NOT_OBJECT = "not a JSON object"
TOO_LONG = f"longer than {MAX_LINE_BYTES >> 20} MiB"
BAD_STEP = f"step not a whole number in 0..{MAX_PLAUSIBLE_STEP:.0e}".replace("e+", "e")
BAD_STEPS = "steps not a whole number in 1..step"
#: latest timestamp a chart can place (9999-12-31 23:59:59 UTC, ``datetime``'s last second)
MAX_TIMESTAMP = 253402300799.0
BAD_TIME = "timestamp not a time in 1970..9999"
#: the kinds drawn on a time axis (their ``timestamp`` must be one)
TIMED_KINDS = ("step", "window", "gpu", "alert")


def bad_record(rec: Dict[str, Any]) -> Optional[str]:
    """Why a record cannot be drawn, or ``None``: a ``step``/``window`` record's step numbers
    (:func:`bad_step`), or the ``timestamp`` of a kind in :data:`TIMED_KINDS` that is not a number of
    unix seconds in ``0..MAX_TIMESTAMP`` (:data:`BAD_TIME`; missing included)."""
    kind = rec.get("kind")
    if kind not in TIMED_KINDS:
        return None
    if kind in ("step", "window"):
        reason = bad_step(rec)
        if reason is not None:
            return reason
    t = rec.get("timestamp")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_TIMESTAMP:  # NaN fails too
        return BAD_TIME
    return None


def bad_step(rec: Dict[str, Any]) -> Optional[str]:
    """Why a ``step``/``window`` record cannot be drawn (:data:`BAD_STEP`, :data:`BAD_STEPS`), or ``None``.

    ``step`` must be a whole number (an int, or a float such as ``10.0``) in ``0..MAX_PLAUSIBLE_STEP``;
    a step record's ``steps``, when given (not null), a whole number in ``1..step`` (resume's rule,
    :func:`mfuwatch.agent.fleet.goodput.steps_to_redo`).
    """
    s = _whole(rec.get("step"))
    if s is None or not 0 <= s <= MAX_PLAUSIBLE_STEP:
        return BAD_STEP
    if rec.get("kind") == "step":
        n = rec.get("steps")
        if n is not None:
            n = _whole(n)
            if n is None or not 1 <= n <= s:
                return BAD_STEPS
    return None


@dataclass
class TimelineData:
    """The records of one run, grouped by kind, in file order (timestamps ascending), bounded in size.

    ``steps``/``windows``/``gpus`` are what the charts draw (at most :data:`MAX_POINTS` each, grouped
    past that); ``step_columns`` has every step record's values for exact medians; ``last_window`` is
    the latest window record in full; ``alerts`` the first :data:`MAX_ALERTS` alert records and
    ``alerts_not_listed`` the count of the others; ``merged[kind]`` how many records one drawn point
    stands for (1: none merged); ``counts[kind]`` the records read; ``skipped`` the lines of the whole
    file (every run in it) left out: ``{reason: [count, first line numbers (at most
    MAX_SKIPPED_LINES)]}``, in the order the reasons were first met (:meth:`skipped_summary`).
    """

    run: Dict[str, Any] = field(default_factory=dict)
    steps: List[Dict[str, Any]] = field(default_factory=list)
    windows: List[Dict[str, Any]] = field(default_factory=list)
    gpus: List[Dict[str, Any]] = field(default_factory=list)
    alerts: List[Dict[str, Any]] = field(default_factory=list)
    step_columns: Columns = field(default_factory=lambda: Columns(STEP_FIELDS, ("timestamp", "step"), "steps"))
    gpu_columns: Columns = field(default_factory=lambda: Columns(GPU_FIELDS))
    window_columns: Columns = field(default_factory=lambda: Columns(("memory_bound_share",), ("timestamp", "step")))
    window_breakdowns: List[Dict[str, float]] = field(default_factory=list)
    last_window: Dict[str, Any] = field(default_factory=dict)
    alerts_not_listed: int = 0
    merged: Dict[str, int] = field(default_factory=lambda: {"step": 1, "window": 1, "gpu": 1})
    counts: Dict[str, int] = field(default_factory=lambda: {"step": 0, "window": 0, "gpu": 0, "alert": 0})
    skipped: Dict[str, List[Any]] = field(default_factory=dict)

    def skip(self, reason: str, lineno: int) -> None:
        """Count line ``lineno`` (1-based) as skipped for ``reason``."""
        entry = self.skipped.setdefault(reason, [0, []])
        entry[0] += 1
        if len(entry[1]) < MAX_SKIPPED_LINES:
            entry[1].append(lineno)

    def skipped_summary(self, name: str) -> Optional[str]:
        """One line saying which lines of the file ``name`` were skipped, or ``None`` when none was:
        ``2 line(s) of t.jsonl skipped (1 not JSON at line 28; 1 step not a whole number in 0..1e12 at
        line 40)``; past :data:`MAX_SKIPPED_LINES` of one reason the line numbers end with ``...``."""
        if not self.skipped:
            return None
        parts = []
        for reason, (count, lines) in self.skipped.items():
            where = ", ".join(map(str, lines)) + (", ..." if count > len(lines) else "")
            parts.append(f"{count:,} {reason} at line{'s' if count > 1 else ''} {where}")
        total = sum(c for c, _ in self.skipped.values())
        return f"{total:,} line(s) of {name} skipped ({'; '.join(parts)})"


def _finish(data: TimelineData) -> TimelineData:
    data.steps, data.merged["step"] = data.step_columns.points("step", MAX_POINTS)
    data.gpus, data.merged["gpu"] = data.gpu_columns.points("gpu", MAX_POINTS)
    data.gpus = [{k: v for k, v in g.items() if v is not None} for g in data.gpus]
    windows, group = data.window_columns.points("window", MAX_POINTS)
    data.merged["window"] = group
    for i, w in enumerate(windows):  # a grouped window point shows the breakdown of the group's last window
        bd = data.window_breakdowns[min(len(data.window_breakdowns) - 1, (i + 1) * group - 1)]
        w["breakdown"] = bd
    data.windows = windows
    data.window_breakdowns = []
    return data


def load_timeline(path: Union[str, Path]) -> TimelineData:
    """Group the records of the last run in ``path`` by kind, streaming; unknown kinds are skipped.

    A ``run`` record with another ``run``/``rank`` than the current one starts over (a
    new run appended to the file); one with the same labels (a restarted job, or facts
    learnt later such as the peak) only fills in the run's facts. Lines that cannot be used
    (see the module docstring) are skipped and counted in :attr:`TimelineData.skipped`.

    Raises:
        OSError: if the file cannot be read.
    """
    data = TimelineData()
    skipped = data.skipped  # file-wide: kept when a new run starts over
    scan = json.JSONDecoder().scan_once
    with open(path, "rb") as fh:
        lineno = 0
        while True:
            line = fh.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            lineno += 1
            if len(line) > MAX_LINE_BYTES:
                while line and not line.endswith(b"\n"):  # read past the rest of it, a chunk at a time
                    line = fh.readline(MAX_LINE_BYTES)
                data.skip(TOO_LONG, lineno)
                continue
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8").strip()
                rec, end = scan(text, 0)  # json's C scanner without json.loads' wrappers: the hot path
                if end != len(text):
                    raise ValueError(f"extra data after the record at column {end + 1}")
            except (ValueError, StopIteration):  # UnicodeDecodeError included; StopIteration: no value
                if line.endswith(b"\n"):  # else the last line, torn: a job killed, or still writing it
                    data.skip(NOT_JSON, lineno)
                continue
            if type(rec) is not dict:
                data.skip(NOT_OBJECT, lineno)
                continue
            if rec.get("kind") == "step":  # most records: inline
                s, n, t = rec.get("step"), rec.get("steps"), rec.get("timestamp")
                if not (type(s) is int and 0 <= s <= MAX_PLAUSIBLE_STEP and (n is None or type(n) is int and
                        1 <= n <= s) and type(t) is float and 0.0 <= t <= MAX_TIMESTAMP):  # fast; else in full
                    reason = bad_record(rec)
                    if reason is not None:
                        data.skip(reason, lineno)
                        continue
                data.counts["step"] += 1
                data.step_columns.add(rec)
            else:
                reason = bad_record(rec)
                if reason is not None:
                    data.skip(reason, lineno)
                    continue
                data = _absorb(data, rec)
                data.skipped = skipped
    return _finish(data)


def _absorb(data: TimelineData, rec: Dict[str, Any]) -> TimelineData:
    kind = rec.get("kind")
    if kind == "step":
        data.counts["step"] += 1
        data.step_columns.add(rec)
    elif kind == "gpu":
        data.counts["gpu"] += 1
        data.gpu_columns.add(rec)
    elif kind == "run":
        same = data.run and (rec.get("run"), rec.get("rank")) == (data.run.get("run"), data.run.get("rank"))
        if same:
            data.run.update({k: v for k, v in rec.items() if v not in (None, "", {}, [])})
            return data
        return TimelineData(run=rec)
    elif kind == "window":
        data.counts["window"] += 1
        data.last_window = rec
        data.window_columns.add(rec)
        bd = rec.get("breakdown")
        data.window_breakdowns.append(bd if isinstance(bd, dict) else {})
    elif kind == "alert":
        data.counts["alert"] += 1
        if len(data.alerts) < MAX_ALERTS:
            data.alerts.append(rec)
        else:
            data.alerts_not_listed += 1
    return data
