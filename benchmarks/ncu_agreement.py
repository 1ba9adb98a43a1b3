"""Agreement of mfuwatch's kernel classification with a roofline built from Nsight Compute measurements.

One training step of the Llama-style workload (``_llama_workload.py``) is run twice, in two
child processes after the same warm-up: once under ``torch.profiler`` (the trace mfuwatch
classifies: FLOPs from recorded shapes, bytes from inputs + outputs), once under
``ncu --clock-control none`` restricted to the step's NVTX range, which measures per kernel its
duration and DRAM bytes (``dram__bytes_read.sum + dram__bytes_write.sum``) and its Speed-of-Light
throughputs. The two kernel sequences are aligned by kernel name (``difflib``), and for each
kernel both classifications are compared:

* **ncu roofline**: the same op FLOPs (split over an op's kernels by duration) over the bytes
  ncu measured, against the same machine balance: memory-bound iff
  ``FLOPs / measured DRAM bytes < peak FLOP/s / peak bandwidth``;
* **ncu SOL**: memory-bound iff the DRAM throughput (% of peak) ≥ the SM throughput (% of peak).

Agreement = ncu kernel time classified the same way / ncu kernel time of the compared kernels
(goal ≥ 90% for the roofline). Prints a table and the largest disagreements; writes
``$OUT/ncu_agreement.json``.

    python3 benchmarks/ncu_agreement.py                  # 4 layers as in the fixture, ~2-3 min
    python3 benchmarks/ncu_agreement.py --layers 2       # faster
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NVTX = "mfuwatch_ncu_step"
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed")


def worker(mode: str, layers: int, path: str) -> None:
    """Child: warm up, then run one step under torch.profiler (mode "trace") or inside an NVTX range ("ncu")."""
    import torch

    sys.path.insert(0, str(HERE))
    from _llama_workload import make_step

    step = make_step(layers=layers)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    if mode == "trace":
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
    else:
        torch.cuda.nvtx.range_push(NVTX)
        step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def base_name(name: str) -> str:
    """Kernel function name without ``void``, namespaces, template arguments and parameters."""
    name = name.strip().replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    out, depth = [], 0
    for ch in name:  # drop <...> (nested) template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    name = "".join(out).split("(")[0]
    return name.split("::")[-1].strip()


def our_kernels(trace_path: str):
    """[(base name, µs, bound, flops share, balance)] of the trace's kernels in start order."""
    from mfuwatch.agent.analysis.roofline import build_window
    from mfuwatch.agent.analysis.trace import GPU_CATEGORIES, TraceIndex, read_trace
    from mfuwatch.agent.device.peaks import resolve_peaks

    tf = read_trace(trace_path)
    p = resolve_peaks(name=tf.device_properties[0]["name"])  # the resolver the agent uses
    ix = TraceIndex.build(tf.events())
    w = build_window(ix, p, steps=1)
    per_op_time = {}
    for op, dur in zip(w.kr_op, w.kr_dur):
        per_op_time[op] = per_op_time.get(op, 0.0) + dur
    rows = []
    for k in sorted(range(ix.n_kernels), key=lambda k: ix.k_ts[k]):
        if ix.k_cat[k] != GPU_CATEGORIES["kernel"]:
            continue  # ncu profiles kernels only
        op, dur = w.kr_op[k], w.kr_dur[k]
        c = w.cost(op)
        flops = c.flops * dur / per_op_time[op] if c is not None and per_op_time.get(op) else 0.0
        balance = p.balance(c.dtype, c.matmul) if c is not None else p.balance(None, False)
        rows.append({"name": base_name(ix.names[ix.k_name[k]]), "us": dur, "bound": w.kr_bound[k],
                     "op": w.kr_label[k], "flops": flops, "our_bytes": (c.bytes * dur / per_op_time[op]) if c and
                     per_op_time.get(op) else 0.0, "balance": balance})
    return rows, p


def ncu_kernels(ncu: str, layers: int, timeout: float, out: Path):
    """Profile the step's kernels with ncu into a report, then read it back as CSV (one row per kernel)."""
    report = out / "ncu_step"
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--nvtx", "--nvtx-include", f"{NVTX}/",
           "--metrics", ",".join(METRICS), "-f", "-o", str(report),
           sys.executable, __file__, "--worker", "ncu", "--layers", str(layers)]
    print("running:", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(f"ncu failed ({res.returncode}):\n{res.stderr[-3000:]}\n{res.stdout[-2000:]}")
    res = subprocess.run([ncu, "--import", str(report) + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base",
                          "--print-kernel-base", "demangled"], capture_output=True, text=True, timeout=120, check=True)
    (out / "ncu_step.csv").write_text(res.stdout)
    return parse_ncu_csv(res.stdout)


def parse_ncu_csv(text: str):
    """Rows of ``ncu --csv --page raw --print-units base``: name, ns, DRAM bytes, DRAM % and SM % of peak."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"no CSV in ncu's output:\n{text[:2000]}")
    rows = []
    for r in csv.DictReader(io.StringIO(text[start:])):
        try:  # the first row after the header holds units
            num = {m: float(str(r[m]).replace(",", "")) for m in METRICS}
        except (KeyError, ValueError):
            continue
        rows.append({"name": base_name(r["Kernel Name"]), "ns": num[METRICS[0]],
                     "bytes": num[METRICS[1]] + num[METRICS[2]], "dram_pct": num[METRICS[3]], "sm_pct": num[METRICS[4]]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=("trace", "ncu"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--timeout", type=float, default=210.0, help="seconds allowed for the ncu run")
    ap.add_argument("--trace", help="reuse a profiler trace of the step instead of recording one")
    ap.add_argument("--ncu-csv", help="reuse a saved 'ncu --csv --page raw --print-units base' output")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.layers, a.path)
        return
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    trace = Path(a.trace) if a.trace else out / "ncu_step_trace.json"
    if not a.trace:
        subprocess.run([sys.executable, __file__, "--worker", "trace", "--layers", str(a.layers), "--path", str(trace)],
                       check=True, timeout=120)
    ours, spec = our_kernels(str(trace))
    theirs = parse_ncu_csv(Path(a.ncu_csv).read_text()) if a.ncu_csv else ncu_kernels(a.ncu, a.layers, a.timeout, out)
    result = compare(ours, theirs, spec)
    result["layers"] = a.layers
    with open(out / "ncu_agreement.json", "w") as f:
        json.dump(result, f)


def compare(ours, theirs, spec) -> dict:
    """Align the two kernel lists by name, compare classifications, print the table; returns the results."""
    sm = difflib.SequenceMatcher(a=[r["name"] for r in ours], b=[r["name"] for r in theirs], autojunk=False)
    pairs = [(ours[b.a + i], theirs[b.b + i]) for b in sm.get_matching_blocks() for i in range(b.size)]
    bw = spec.memory_bandwidth_bytes_per_second
    agree_rf = agree_sol = total = 0.0
    disagreements = {}
    for o, t in pairs:
        if o["bound"] not in ("compute", "memory"):
            continue
        roof = "memory" if (t["bytes"] > 0 and o["flops"] / t["bytes"] < o["balance"]) or o["flops"] == 0 else "compute"
        sol = "memory" if t["dram_pct"] >= t["sm_pct"] else "compute"
        total += t["ns"]
        agree_rf += t["ns"] * (roof == o["bound"])
        agree_sol += t["ns"] * (sol == o["bound"])
        if roof != o["bound"]:
            d = disagreements.setdefault((o["op"], o["bound"], roof), [0.0, 0, 0.0, 0.0])
            d[0] += t["ns"]
            d[1] += 1
            d[2] += o["our_bytes"]
            d[3] += t["bytes"]
    total = total or float("nan")
    print(f"{spec.name}: {len(ours)} kernels in the profiler trace, {len(theirs)} measured by ncu, "
          f"{len(pairs)} aligned by name; balance bf16 {spec.peak_flops['bf16'] / bw:.0f} FLOP/B, "
          f"fp32 {spec.peak_flops['fp32'] / bw:.1f} FLOP/B")
    print(f"{'agreement (share of ncu kernel time)':48s} {'value':>8s}")
    print(f"{'mfuwatch vs ncu roofline (measured DRAM bytes)':48s} {agree_rf / total:8.1%}   goal >= 90%")
    print(f"{'mfuwatch vs ncu Speed-of-Light (DRAM% >= SM%)':48s} {agree_sol / total:8.1%}")
    print(f"\n{'disagreeing op':36s} {'ours':>8s} {'ncu':>8s} {'kernels':>7s} {'time share':>10s} "
          f"{'our MB':>9s} {'ncu MB':>9s}")
    for (op, mine, roof), (ns, n, ob, nb) in sorted(disagreements.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"{op[:36]:36s} {mine:>8s} {roof:>8s} {n:7d} {ns / total:10.2%} {ob / 1e6:9.1f} {nb / 1e6:9.1f}")
    return {"gpu": spec.name, "kernels_trace": len(ours), "kernels_ncu": len(theirs), "aligned": len(pairs),
            "agreement_roofline": agree_rf / total, "agreement_sol": agree_sol / total,
            "disagreements": [{"op": k[0], "ours": k[1], "ncu": k[2], "ns": v[0], "kernels": v[1],
                               "our_bytes": v[2], "ncu_bytes": v[3]} for k, v in disagreements.items()],
            "pairs": [{"ours": o, "ncu": t} for o, t in pairs]}


if __name__ == "__main__":
    main()
