"""Time and peak memory of mfuwatch's readers on hostile or huge inputs (issue #28; CPU only).

Cases (each generated here, then read by a child process whose wall time and peak RSS come from
``os.wait4``):

``analyze_string``   ``mfuwatch analyze`` on a ``.json.gz`` (~260 KB) holding one 256 MiB JSON string
``analyze_bomb``     ``mfuwatch analyze`` on a gzip bomb: 4 GiB of whitespace inside ``{"traceEvents": [ ]}``
``report_1gb``       ``mfuwatch report`` on a 1 GB timeline with the agent's record mix
                     (benchmarks/realistic_timeline.py: steps, GPU samples, windows, phases, checkpoints,
                     alerts, restarts); ``--simple`` for the older step/GPU/window-only generator
``resume_1gb``       the agent's resume read (``goodput.read_resume``) of the same 1 GB timeline

    python benchmarks/big_inputs.py                  # all cases, files under $TMPDIR, deleted after
    python benchmarks/big_inputs.py --only report_1gb --gb 1.0

Each child's CPU time (user + sys, ``os.wait4``) is printed too: on a shared machine it varies far less
than the wall time.

Prints a table; writes ``$OUT/big_inputs.json`` (default ./out).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _gz(path: Path, head: bytes, fill: bytes, n: int, tail: bytes) -> None:
    with gzip.open(path, "wb", compresslevel=6) as fh:
        fh.write(head)
        block = fill * ((4 << 20) // len(fill))
        for _ in range(n // len(block)):
            fh.write(block)
        fh.write(tail)


def make_timeline(path: Path, gb: float) -> int:
    """A timeline of about ``gb`` GB: a run record, step records (10 steps each), a GPU record per 5 step
    records, a window record per 2000; returns the step records written."""
    target = int(gb * 1e9)
    window = json.dumps({"kind": "window", "step": 0, "timestamp": 0, "breakdown": {
        "compute_bound": 0.6, "memory_bound": 0.3, "communication": 0.0, "other": 0.1, "idle": 0.05},
        "memory_bound_share": 0.3, "top_ops": [{"op": f"aten::op{i}", "bound": "memory", "share": 0.05,
                                                "time_seconds": 0.001, "kernels": 3} for i in range(8)],
        "suggestions": []}, separators=(",", ":"))
    step_fmt = ('{"kind":"step","step":%d,"steps":10,"timestamp":%.3f,"step_time_seconds":%.6f,"tokens":40960,'
                '"tokens_per_second":%.1f,"model_flops":1.2e14,"hardware_flops":1.6e14,"model_flops_per_second":'
                '%.6g,"mfu":%.6f,"hfu":%.6f,"loss":2.31,"tokens_per_step":4096.0}\n')
    gpu_fmt = ('{"kind":"gpu","timestamp":%.3f,"utilization":0.97,"memory_bandwidth_utilization":0.41,'
               '"sm_clock_hertz":1.98e9,"power_watts":%.1f,"power_limit_watts":700.0,"temperature_celsius":61,'
               '"memory_used_bytes":7.1e10,"memory_total_bytes":1.4e11}\n')
    n = 0
    written = 0
    with open(path, "w") as fh:
        fh.write(json.dumps({"kind": "run", "run": "big", "rank": 0, "peak_flops_per_second": 9.89e14}) + "\n")
        buf = []
        while written < target:
            n += 1
            st = 0.1 + 0.01 * ((n * 7919) % 13) / 13
            line = step_fmt % (10 * n, 1.7e9 + n, st, 40960 / st, 1.2e14 / st, 1.2e14 / st / 9.89e14,
                               1.6e14 / st / 9.89e14)
            buf.append(line)
            written += len(line)
            if n % 5 == 0:
                line = gpu_fmt % (1.7e9 + n, 500 + n % 50)
                buf.append(line)
                written += len(line)
            if n % 2000 == 0:
                line = window.replace('"step":0,"timestamp":0', f'"step":{10 * n},"timestamp":{1.7e9 + n}') + "\n"
                buf.append(line)
                written += len(line)
            if len(buf) > 10000:
                fh.write("".join(buf))
                buf = []
        fh.write("".join(buf))
    return n


def run_child(cmd, cwd=None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read().decode(errors="replace"), proc.stderr.read().decode(errors="replace")
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "exit": os.waitstatus_to_exitcode(status), "stderr": err.strip()[-300:], "stdout": out.strip()[-300:]}


RESUME = ("import sys, time; from mfuwatch.agent.fleet.goodput import read_resume; t=time.perf_counter(); "
          "r=read_resume(sys.argv[1]); print(r, round(time.perf_counter()-t, 3))")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--gb", type=float, default=1.0, help="timeline size for report_1gb/resume_1gb")
    ap.add_argument("--simple", action="store_true", help="the step/GPU/window-only timeline generator")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    py = sys.executable
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        if not only or "analyze_string" in only:
            p = d / "string.json.gz"
            _gz(p, b'{"traceEvents": [{"ph": "X", "name": "', b"a", 256 << 20, b'"}]}')
            r = run_child([py, "-m", "mfuwatch.agent.cli", "analyze", str(p)])
            results["analyze_string"] = dict(r, input=f"{p.stat().st_size / 1e3:.0f} KB gz, one 256 MiB string")
            p.unlink()
        if not only or "analyze_bomb" in only:
            p = d / "bomb.json.gz"
            _gz(p, b'{"traceEvents": [', b" ", 4 << 30, b"]}")
            r = run_child([py, "-m", "mfuwatch.agent.cli", "analyze", str(p)])
            results["analyze_bomb"] = dict(r, input=f"{p.stat().st_size / 1e6:.1f} MB gz, 4 GiB of whitespace")
            p.unlink()
        if not only or only & {"report_1gb", "resume_1gb"}:
            p = d / "timeline.jsonl"
            t0 = time.perf_counter()
            if args.simple:
                n = make_timeline(p, args.gb)
            else:
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                import realistic_timeline

                n = realistic_timeline.make(p, args.gb)["records"]["step"]
            size = p.stat().st_size
            print(f"generated {size / 1e9:.2f} GB timeline ({n} step records) in {time.perf_counter() - t0:.0f} s",
                  flush=True)
            if not only or "report_1gb" in only:
                r = run_child([py, "-m", "mfuwatch.agent.cli", "report", str(p), "-o", str(d / "r.html")])
                html_mb = (d / "r.html").stat().st_size / 1e6 if (d / "r.html").exists() else 0
                results["report_1gb"] = dict(r, input=f"{size / 1e9:.2f} GB timeline, {n} step records",
                                             html_mb=round(html_mb, 1))
            if not only or "resume_1gb" in only:
                r = run_child([py, "-c", RESUME, str(p)])
                results["resume_1gb"] = dict(r, input=f"{size / 1e9:.2f} GB timeline")
    print(f"{'case':<16} {'input':<44} {'wall s':>8} {'CPU s':>7} {'peak RSS MB':>12} {'exit':>5}  message")
    for k, r in results.items():
        msg = (r["stderr"] or r["stdout"]).splitlines()[-1:] or [""]
        print(f"{k:<16} {r['input']:<44} {r['wall_s']:>8} {r['cpu_s']:>7} {r['peak_rss_mb']:>12} {r['exit']:>5}  "
              f"{msg[0][:120]}")
    (out / "big_inputs.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
