"""The agent's resume read on a hostile timeline tail (issue #28; CPU only): time, memory, what it ignores.

Each case is a timeline of the agent's record mix (benchmarks/realistic_timeline.py) of 64 MiB or
1 GB (plus the 60 MiB line), its last attempt ending with a 60 MiB line (a step record padded with one string), 400 step
records, a ``"step": Infinity`` record, a record claiming 10^15 steps, and 400 more step records. A
child process starts an :class:`~mfuwatch.agent.Agent` on it (no exporter, no NVML) and reports:

``start_s``      wall time of ``Agent(...)`` on the calling (training) thread
``steps_ms``     the slowest of the first 20 ``agent.step()`` calls while the read runs (ms)
``read_s``       the reader thread's time from ``Agent(...)`` to the result (wall, off the training thread)
``rss_mb``       the child's peak RSS, and ``base_mb`` the same child's RSS just before ``Agent(...)``
``none``         the baseline: the same start on an empty timeline (no previous attempt to read)
``ignored``      records the read ignored (the attempt record's ``lost_ignored``), and the
                 ``mfuwatch_agent_errors_total{component="resume"}`` count
``lost_steps``   the lost-progress figure (steps after the last checkpoint in view)

    python benchmarks/resume_read.py [--keep DIR] [--base BIG.jsonl] [--reps 3]

Prints a table; writes ``$OUT/resume_read.json`` (default ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realistic_timeline  # noqa: E402

CHILD = r"""
import json, resource, sys, threading, time
path = sys.argv[1]
from mfuwatch.agent import Agent
from mfuwatch.agent.fleet import goodput
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
a = Agent(config=dict(run="llama-70b-pretrain", exporter=False, nvml=False, profile_every="off", alerts=False,
                      flops_per_step=1e9, timeline=path, progress=False, goodput_warmup_steps=10**9))
start = time.perf_counter() - t0
worst = 0.0
for _ in range(20):
    s = time.perf_counter(); a.step(tokens=4); worst = max(worst, time.perf_counter() - s)
r = a.fleet._resume_reader
r.result(600)
read = time.perf_counter() - t0
a.close()
with open(path, "rb") as fh:
    fh.seek(max(0, fh.seek(0, 2) - 200000))
    att = [json.loads(l) for l in fh.read().splitlines()[1:] if b'"attempt"' in l][-1]
print(json.dumps({"start_s": round(start, 4), "steps_ms": round(worst * 1e3, 2), "read_s": round(read, 3),
                  "base_mb": round(base, 1), "ignored": att.get("lost_ignored"),
                  "errors_resume": a.errors.get("resume"), "lost_steps": att.get("lost_steps"),
                  "error": repr(r.error) if r.error else None}))
"""


def make_case(path: Path, gb: float, base: "Path | None" = None) -> None:
    if base is not None and base.stat().st_size >= gb * 1e9:  # a timeline of realistic_timeline.py, reused
        with open(base, "rb") as src, open(path, "wb") as dst:
            left = int(gb * 1e9)
            while left > 0:
                chunk = src.read(min(left, 64 << 20))
                dst.write(chunk)
                left -= len(chunk)
            dst.write(src.readline())  # to the end of the line
    else:
        realistic_timeline.make(path, gb)
    with open(path, "rb") as fh:  # continue the last attempt from its last step record
        fh.seek(-200000, os.SEEK_END)
        last = [json.loads(l) for l in fh.read().splitlines()[1:] if l.startswith(b'{"step"')][-1]
    step, ts = last["step"], last["timestamp"]
    with open(path, "a") as fh:
        def rec(**kw):
            base = {"step": step, "steps": 10, "timestamp": ts, "step_time_seconds": 0.5, "kind": "step"}
            base.update(kw)
            fh.write(json.dumps(base, separators=(",", ":")) + "\n")
        step += 10; ts += 5
        rec(step=step, timestamp=ts, pad="x" * (60 << 20))  # the 60 MiB line
        for _ in range(400):
            step += 10; ts += 5
            rec(step=step, timestamp=ts)
        rec(step=float("inf"), timestamp=ts + 1)  # json.dumps writes Infinity
        rec(step=10 ** 15, steps=10 ** 15, timestamp=ts + 2)
        for _ in range(400):
            step += 10; ts += 5
            rec(step=step, timestamp=ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", default=None, help="folder for the timelines (kept), else a temporary one")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", type=Path, default=None, help="a realistic_timeline.py file of >= 1 GB to reuse")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(a.keep or tmp)
        d.mkdir(parents=True, exist_ok=True)
        for label, gb in (("none", 0.0), ("64 MiB", 64 * 2 ** 20 / 1e9), ("1 GB", 1.0)):
            src = d / f"resume_{gb:.3f}.jsonl"
            if not gb:  # the baseline: a new timeline (no previous attempt)
                src.write_text("")
            elif not src.exists():
                make_case(src, gb, a.base)
            for rep in range(a.reps):
                work = d / "work.jsonl"
                os.system(f"cp {src} {work}")  # the agent appends its own attempt
                t = tempfile.TemporaryFile()
                proc = subprocess.Popen([sys.executable, "-c", CHILD, str(work)], stdout=subprocess.PIPE,
                                        stderr=t)
                _, status, ru = os.wait4(proc.pid, 0)
                got = json.loads(proc.stdout.read().decode() or "{}")
                got.update(case=label, rep=rep, size_mb=round(src.stat().st_size / 2 ** 20, 1),
                           rss_mb=round(ru.ru_maxrss / 1024, 1), child_cpu_s=round(ru.ru_utime + ru.ru_stime, 2),
                           exit=os.waitstatus_to_exitcode(status))
                t.seek(0)
                got["stderr"] = t.read().decode(errors="replace").strip()[-200:]
                rows.append(got)
                work.unlink()
    print(f"{'case':<8} {'MiB':>7} {'start s':>8} {'step ms':>8} {'read s':>7} {'base MB':>8} {'RSS MB':>7} "
          f"{'ignored':>8} {'errors':>7} {'lost':>6}")
    for r in rows:
        print(f"{r['case']:<8} {r['size_mb']:>7} {r.get('start_s')!s:>8} {r.get('steps_ms')!s:>8} "
              f"{r.get('read_s')!s:>7} {r.get('base_mb')!s:>8} {r['rss_mb']:>7} {r.get('ignored')!s:>8} "
              f"{r.get('errors_resume')!s:>7} {r.get('lost_steps')!s:>6}  {r['stderr'][-80:]}")
    (out / "resume_read.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
