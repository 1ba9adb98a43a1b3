"""Time and peak memory of ``mfuwatch analyze`` on a trace of at least 500 MB (CPU only, no GPU needed).

Generates a big chrome trace by repeating the real H200 Llama trace
(``tests/fixtures/traces/llama_bf16_eager.json.gz``) back to back with shifted
timestamps, External ids, correlation ids, sequence numbers and flow ids, written one
event at a time (the generator itself stays small), then runs
``python -m mfuwatch.agent.analysis.analyze BIG --json`` in a child process and reads the child's
wall time and peak RSS (``os.wait4``). Also measures the baseline of the same child
importing torch's FLOP formulas and doing nothing else, since that import alone is a
large part of the peak.

    python benchmarks/big_trace.py                    # 600 MB, results in $OUT (default ./out)
    python benchmarks/big_trace.py --mb 1100 --gzip   # also a .json.gz copy of the same trace

Prints a table; writes ``$OUT/big_trace_results.json`` (the trace itself is deleted unless ``--keep``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "traces" / "llama_bf16_eager.json.gz"


def generate(path: Path, target_mb: float) -> dict:
    """Write a trace of at least ``target_mb`` MB; returns what was written."""
    with gzip.open(FIXTURE) as f:
        doc = json.load(f)
    events = doc.pop("traceEvents")
    session = next(e for e in events if e.get("cat") == "Trace")
    body = [e for e in events if e.get("cat") != "Trace" and e.get("ph") != "M"]
    meta = [e for e in events if e.get("ph") == "M"]
    span = session["dur"] + 1000.0
    max_ext = max(e.get("args", {}).get("External id", 0) for e in body) + 1
    max_corr = max(e.get("args", {}).get("correlation", 0) for e in body) + 1
    max_seq = max((e.get("args", {}).get("Sequence number") or 0) for e in body) + 1
    max_flow = max(e.get("id", 0) for e in body) + 1
    one = sum(len(json.dumps(e)) + 2 for e in body)
    copies = int(target_mb * 1e6 // one) + 1
    with open(path, "w", encoding="utf-8") as out:
        head = {k: v for k, v in doc.items() if k != "traceName"}
        out.write(json.dumps(head)[:-1] + ', "traceEvents": [\n')
        for e in meta:
            out.write(json.dumps(e) + ",\n")
        whole = dict(session, dur=span * copies)
        out.write(json.dumps(whole))
        n = len(meta) + 1
        for c in range(copies):
            for e in body:
                e2 = dict(e, ts=e["ts"] + c * span)
                a = e.get("args")
                if a:
                    a2 = dict(a)
                    if "External id" in a2:
                        a2["External id"] += c * max_ext
                    if "correlation" in a2:
                        a2["correlation"] += c * max_corr
                    if a2.get("Sequence number") is not None:
                        a2["Sequence number"] += c * max_seq
                    e2["args"] = a2
                if "id" in e2:
                    e2["id"] += c * max_flow
                out.write(",\n" + json.dumps(e2))
                n += 1
        out.write('\n], "traceName": "big"}\n')
    return {"copies": copies, "events": n, "bytes": path.stat().st_size, "steps": 3 * copies}


def run_child(args: list) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode()[-2000:]
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed ({status}): {err}")
    return {"wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024}  # ru_maxrss is KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=600.0, help="trace size to generate, MB (default 600)")
    ap.add_argument("--gzip", action="store_true", help="also time the same trace gzipped")
    ap.add_argument("--keep", action="store_true", help="keep the generated trace")
    ap.add_argument("--fixture", default=None, help="the trace to repeat (default: the shared H200 Llama trace)")
    a = ap.parse_args()
    if a.fixture:
        globals()["FIXTURE"] = Path(a.fixture)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "big_trace.json"
    t0 = time.perf_counter()
    info = generate(path, a.mb)
    info["generate_seconds"] = time.perf_counter() - t0
    result_json = out / "big_trace.analysis.json"
    rows = [("import torch.utils.flop_counter only", run_child(["-c", "import torch.utils.flop_counter"]), None),
            ("the same without triton (as analyze)", run_child(["-c", (
                "from mfuwatch.agent.analysis import opcost; opcost.import_formulas_without_triton(); "
                "opcost._torch_formulas()")]), None)]
    rows.append(("analyze big_trace.json", run_child(["-m", "mfuwatch.agent.analysis.analyze", str(path), "--json",
                                                      "--output", str(result_json)]), info["bytes"]))
    if a.gzip:
        gz = out / "big_trace.json.gz"
        with open(path, "rb") as f, gzip.open(gz, "wb", compresslevel=1) as g:
            while chunk := f.read(1 << 24):
                g.write(chunk)
        rows.append(("analyze big_trace.json.gz", run_child(["-m", "mfuwatch.agent.analysis.analyze", str(gz), "--json",
                                                             "--output", str(result_json)]), gz.stat().st_size))
        if not a.keep:
            gz.unlink()
    rec = json.loads(result_json.read_text())
    assert rec["steps"] == info["steps"], (rec["steps"], info["steps"])
    print(f"trace: {info['bytes'] / 1e6:.0f} MB, {info['events']:,} events, {info['copies']} copies of the H200 "
          f"Llama trace, {info['steps']} steps (generated in {info['generate_seconds']:.0f} s)")
    print(f"{'run':40s} {'file MB':>8s} {'wall s':>8s} {'CPU s':>8s} {'peak RSS MB':>12s} {'MB/s':>8s}")
    for name, r, size in rows:
        mbs = f"{size / 1e6 / r['wall_seconds']:.1f}" if size else ""
        print(f"{name:40s} {(size or 0) / 1e6:8.0f} {r['wall_seconds']:8.1f} {r['cpu_seconds']:8.1f} "
              f"{r['peak_rss_mb']:12.0f} {mbs:>8s}")
    print(f"memory-bound share {rec['memory_bound_share']:.3f}, idle {rec['breakdown']['idle']:.3f}, "
          f"suggestions: {', '.join(s['kernel'] for s in rec['suggestions'])}")
    with open(out / "big_trace_results.json", "w") as f:
        json.dump({"trace": info, "runs": [{"run": n, "file_bytes": s, **r} for n, r, s in rows],
                   "memory_bound_share": rec["memory_bound_share"]}, f, indent=1)
    if not a.keep:
        path.unlink()
    result_json.unlink()


if __name__ == "__main__":
    main()
