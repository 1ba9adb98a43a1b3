"""Where ``mfuwatch analyze``'s peak memory goes: the peak RSS of each stage of the analysis (CPU only, Linux).

Runs ``mfuwatch.agent.analysis.analyze.main`` in this process with its stages wrapped: before each stage
the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``, value 5), after it ``VmHWM`` and ``VmRSS``
are read from ``/proc/self/status``. So each row is the highest RSS reached *during* that stage, and the
process's peak is the largest of them. Nested stages (inside ``suggest_set``) are indented; the mark is
reset again after each, and an outer row's peak is the larger of its own and its inner rows'. The parse
(``TraceIndex.add`` per event) is not wrapped: RSS only grows during it, so its peak is the first row's
"RSS before". Wrapping costs nothing measurable (no tracemalloc: RSS is what the goal is about).

    python benchmarks/big_trace.py --mb 1024 --keep          # makes $OUT/big_trace.json (1.04 GB)
    python benchmarks/analyze_memory.py out/big_trace.json   # then any analyze arguments: --json, --steps ...

Prints the table on stderr; the analysis's own output goes to stdout as ``analyze`` prints it.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import List, Tuple


def _status() -> Tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                got[key] = int(value.split()[0]) / 1024
    return got["VmRSS"], got["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Documentation/filesystems/proc.rst)


ROWS: List[Tuple[int, str, float, float, float, float]] = []  # depth, stage, RSS before, after, peak, seconds
_depth = [0]


def wrap(owner, name: str) -> None:
    """Replace ``owner.name`` by a wrapper that records one row per call."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        before = _status()[0]
        t0 = time.perf_counter()
        _reset_peak()
        _depth[0] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            _depth[0] -= 1
            rss, peak = _status()
            ROWS.append((_depth[0], name, before, rss, peak, time.perf_counter() - t0))
            _reset_peak()

    setattr(owner, name, timed)


def main() -> int:
    from mfuwatch.agent.analysis import analyze, gain_model, roofline, suggest, trace

    for owner, name in ((trace.TraceIndex, "_link_kernels"), (trace.TraceIndex, "_nest_ops"),
                        (roofline, "build_window"), (suggest, "suggest_set"), (roofline, "measure"),
                        (suggest, "_Context"), (roofline.Window, "bandwidth"), (gain_model, "host_bound_gaps"),
                        (suggest, "_launch_regions"), (suggest, "_region"), (suggest, "_sequences"),
                        (suggest, "_pointwise_chains"), (suggest, "_relayout"), (suggest, "_claim"),
                        (gain_model, "combine"), (suggest, "_regions_after_compile")):
        wrap(owner, name)
    for name in ("build_window", "suggest_set", "measure"):  # analyze imported them by name
        setattr(analyze, name, getattr(roofline if name != "suggest_set" else suggest, name))
    start_rss = _status()[0]
    t0 = time.perf_counter()
    rc = analyze.main(sys.argv[1:])
    wall = time.perf_counter() - t0
    for j, (depth, name, before, after, peak, secs) in enumerate(ROWS):  # outer rows: the inner rows' peaks too
        k = j - 1
        while k >= 0 and ROWS[k][0] > depth:
            peak = max(peak, ROWS[k][4])
            k -= 1
        ROWS[j] = (depth, name, before, after, peak, secs)
    rows = []
    for depth, name, before, after, peak, secs in ROWS:  # merge repeated calls of one inner stage in a row
        if rows and rows[-1][1] == name and rows[-1][0] == depth and depth > 0:
            d, n, b, a, p, s, calls = rows[-1]
            rows[-1] = (d, n, b, after, max(p, peak), s + secs, calls + 1)
        else:
            rows.append((depth, name, before, after, peak, secs, 1))
    err = sys.stderr
    print(f"start (imports) {start_rss:.0f} MiB; analyze {wall:.1f} s, status {rc}; the parse (TraceIndex.add per "
          "event) runs before the first row", file=err)
    if not rows:
        return rc
    print(f"{'stage':34s} {'calls':>5s} {'RSS before':>11s} {'after':>7s} {'peak':>7s} {'s':>6s}", file=err)
    for depth, name, before, after, peak, secs, calls in rows:
        print(f"{'  ' * depth + name:34s} {calls:5d} {before:11.0f} {after:7.0f} {peak:7.0f} {secs:6.1f}", file=err)
    peak = max(max(r[4] for r in rows), rows[0][2])
    print(f"peak of the process: {peak:.0f} MiB (the largest stage peak, or the parse's end)", file=err)
    return rc


if __name__ == "__main__":
    sys.exit(main())
