"""What vanishes from the step when the ``rotary`` drop-in is applied: per-kernel counts and GPU time, base vs drop-in.

Issue 24 (gains that come true): on Qwen3 the rotary drop-in saves more than the time of the ops it replaces
(docs/gpu-runs/gain_truth-run3.md). This benchmark shows where the rest comes from. For each model, two processes
(``base``: the model as written; ``rotary``: after exactly the suggestion's line
``mfuwatch.kernels.patch(model, kernels=["rotary"])``), built by ``gain_truth.build`` from the same weights and
batch, each: ``--warmup`` steps, ``--steps`` synchronized timed steps (median ms/step), then a profiler window of
``--active`` steps (CPU + CUDA, ``record_shapes=True``, as the agent's sampler records one) whose trace is kept.
The processes start together (imports and model builds overlap) and take a file lock before building the model,
so one is on the GPU at a time (run 1 took it after the first step: Llama's base window overlapped another
process's first step, docs/gpu-runs/rotary_gain-run1.md).

Each kernel is attributed to the autograd node (``autograd::engine::evaluate_function: X``) or forward top-level
op that launched it. The parent prints, per kernel name (shortened: the kernel template and its functor, with
``[strided]`` for an ``OffsetCalculator`` index or a legacy ``elementwise_kernel<128, N>``) and per launching
node, the count and GPU µs per step in each process and the difference (base − rotary), largest first.

    python3 benchmarks/rotary_gain.py --models qwen3,llama        # H200, ~90 s with imports
    python3 benchmarks/rotary_gain.py --table DIR                 # re-print the tables from DIR/<model>_<config>.json.gz
    python3 benchmarks/rotary_gain.py --cpu --tiny --models qwen3  # CPU plumbing check (no drop-in: CUDA only)

With ``$OUT`` set it writes ``$OUT/rotary_gain.md`` and the traces ``$OUT/<model>_<config>.json.gz``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

P = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
P.add_argument("--models", default="qwen3", help="comma-separated: qwen3, llama (default qwen3)")
P.add_argument("--warmup", type=int, default=3)
P.add_argument("--steps", type=int, default=5, help="timed steps before the profiler window (default 5)")
P.add_argument("--active", type=int, default=3, help="profiled steps (after 1 profiler warm-up step; default 3)")
P.add_argument("--timeout", type=int, default=150, help="seconds per child (default 150)")
P.add_argument("--cpu", action="store_true")
P.add_argument("--tiny", action="store_true")
P.add_argument("--table", metavar="DIR", help="no processes: print the tables from DIR's saved traces")
P.add_argument("--child", help=argparse.SUPPRESS)  # MODEL:CONFIG


def short(name: str) -> str:
    """A kernel name without its argument list: template, functor, and ``[strided]`` for an indexed layout."""
    if not name.startswith("void "):
        return name.split("(")[0][:70]
    m = re.match(r"void (?:at::native::)?(?:\(anonymous namespace\)::)?([\w:]+(?:<\d+(?:, \d+)*>)?)", name)
    s = m.group(1) if m else name[5:60]
    strided = bool(re.search(r"(?<!Trivial)OffsetCalculator<", name)) or bool(
        re.match(r"void at::native::elementwise_kernel<128, \d+", name))
    fm = re.search(r"(\w*Functor\w*|\w+_kernel_cuda\w*|direct_copy_kernel_cuda|func_wrapper_t<[\w:]+|MeanOps|"
                   r"sum_functor|CatArrInputTensorMetadata)", name)
    if fm:
        s += " " + fm.group(1)[:48]
    return s + (" [strided]" if strided else "")


def aggregate(path: str, steps: int) -> Dict[str, Dict[Tuple[str, str], List[float]]]:
    """``{"kernel": {(short name, ""): [count, µs]}, "node": {(launching node, short name): [count, µs]}}`` per
    step, from a chrome trace (kernels, memcpys, memsets), each attributed to its launching op's outermost op
    (an autograd node in the backward) by the ``External id`` its runtime call shares with the op."""
    import bisect

    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        ev = json.load(f)["traceEvents"]
    ops = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    by_ext = {}
    for e in ops:
        by_ext.setdefault(e["args"].get("External id"), e)
    corr_ext = {e["args"]["correlation"]: e["args"].get("External id") for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    tops: Dict[object, List[dict]] = collections.defaultdict(list)  # per thread: top-level ops, by start
    for e in ops:
        lst = tops[e["tid"]]
        if not lst or e["ts"] >= lst[-1]["ts"] + lst[-1]["dur"]:
            lst.append(e)
    starts = {t: [e["ts"] for e in lst] for t, lst in tops.items()}

    def top_of(op) -> str:
        lst = tops[op["tid"]]
        i = bisect.bisect_right(starts[op["tid"]], op["ts"]) - 1
        t = lst[i] if i >= 0 else op
        return t["name"].replace("autograd::engine::evaluate_function: ", "bwd:")

    out = {"kernel": collections.defaultdict(lambda: [0.0, 0.0]), "node": collections.defaultdict(lambda: [0.0, 0.0])}
    for e in ev:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        k = short(e["name"])
        ext = e["args"].get("External id") or corr_ext.get(e["args"].get("correlation"))
        op = by_ext.get(ext)
        node = top_of(op) if op is not None else "(no op)"
        out["kernel"][(k, "")][0] += 1 / steps
        out["kernel"][(k, "")][1] += e["dur"] / steps
        out["node"][(node, k)][0] += 1 / steps
        out["node"][(node, k)][1] += e["dur"] / steps
    return out


def child(args) -> dict:
    model_name, config = args.child.split(":")
    dev = "cpu" if args.cpu else "cuda"
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from _hf_step import time_steps, train_step
    from gain_truth import build

    lock = os.environ.get("ROTARY_GAIN_LOCK")
    if lock:  # all GPU work under the lock (the build's init kernels too): only the imports overlap
        import fcntl

        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the process exits
    model, ids = build(model_name, args.tiny, dev)
    swapped = ""
    if config == "rotary":
        import mfuwatch
        from mfuwatch.kernels import remedies as reg

        line = next(r.apply for r in reg.REMEDIES if r.kernel == "rotary")
        scope = {"mfuwatch": mfuwatch, "model": model}
        exec(compile("report = " + line, "<suggestion>", "exec"), scope)  # the suggestion's own line
        swapped = f"rotary x{scope['report'].count('rotary')}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda")
    step = train_step(model, ids, opt, autocast)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    first, _, times = time_steps(step, sync, args.warmup, args.steps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    raw = os.path.join(tempfile.mkdtemp(prefix="rotary_gain_"), "trace.json")
    with profile(activities=acts, record_shapes=True, schedule=schedule(wait=0, warmup=1, active=args.active, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(raw)) as prof:
        for _ in range(1 + args.active):
            step()
            sync()
            prof.step()
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="rotary_gain_out_")
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, f"{model_name}_{config}.json.gz")
    with open(raw, "rb") as src, gzip.open(dst, "wb") as g:
        g.write(src.read())
    return {"model": model_name, "config": config, "median_ms": statistics.median(times), "ms": times,
            "first_loss": first, "swapped": swapped, "trace": dst}


def table(recs: Dict[Tuple[str, str], dict], models: List[str], active: int) -> str:
    lines = []
    for m in models:
        b, r = recs.get((m, "base")), recs.get((m, "rotary"))
        if not b or not r or "error" in b or "error" in r:
            lines.append(f"## {m}: failed: {(b or {}).get('error')} {(r or {}).get('error')}\n")
            continue
        ab, ar = aggregate(b["trace"], active), aggregate(r["trace"], active)
        lines += [f"## {m}: base {b['median_ms']:.1f} ms/step, rotary {r['median_ms']:.1f} ms/step "
                  f"(saved {b['median_ms'] - r['median_ms']:.1f} ms = "
                  f"{(b['median_ms'] - r['median_ms']) / b['median_ms']:.1%}); {r['swapped']}; "
                  f"first losses {b['first_loss']:.4f} / {r['first_loss']:.4f}", ""]
        for what, title in (("kernel", "per kernel name"), ("node", "per launching node (autograd node or forward op)")):
            keys = set(ab[what]) | set(ar[what])
            tb = sum(v[1] for v in ab[what].values())
            tr = sum(v[1] for v in ar[what].values())
            rows = sorted(keys, key=lambda k: -abs(ab[what].get(k, [0, 0])[1] - ar[what].get(k, [0, 0])[1]))
            lines += [f"### {title}, per step (GPU µs summed over activities; total base {tb / 1e3:.2f} ms, "
                      f"rotary {tr / 1e3:.2f} ms, difference {(tb - tr) / 1e3:.2f} ms)", "",
                      ("| kernel | " if what == "kernel" else "| node | kernel | ") +
                      "base n | base µs | rotary n | rotary µs | Δn | Δµs (base − rotary) |",
                      "|---|" + ("" if what == "kernel" else "---|") + "---|---|---|---|---|---|"]
            shown = 0.0
            for k in rows:
                nb, ub = ab[what].get(k, [0, 0])
                nr, ur = ar[what].get(k, [0, 0])
                if abs(ub - ur) < 20 and abs(nb - nr) < 0.5:
                    continue
                shown += ub - ur
                label = k[0] if what == "kernel" else f"{k[0]} | {k[1]}"
                lines.append(f"| {label} | {nb:.0f} | {ub:.0f} | {nr:.0f} | {ur:.0f} | {nb - nr:+.0f} | {ub - ur:+.0f} |")
            lines += ["", f"rows shown sum to {shown / 1e3:.2f} ms; rows with |Δµs| < 20 and |Δn| < 0.5 left out", ""]
    return "\n".join(lines)


def main() -> int:
    args = P.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    models = [m for m in args.models.split(",") if m]
    recs: Dict[Tuple[str, str], dict] = {}
    if args.table:
        for m in models:
            for c in ("base", "rotary"):
                recs[(m, c)] = {"trace": os.path.join(args.table, f"{m}_{c}.json.gz"), "median_ms": float("nan"),
                                "first_loss": float("nan"), "swapped": ""}
        print(table(recs, models, args.active))
        return 0
    lock = os.path.join(tempfile.mkdtemp(prefix="rotary_gain_lock_"), "gpu.lock")
    procs = []
    for m in models:
        for c in ("base", "rotary"):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{m}:{c}", "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--active", str(args.active)] + (["--cpu"] if args.cpu else []) + (
                ["--tiny"] if args.tiny else [])
            procs.append(((m, c), subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                   env=dict(os.environ, ROTARY_GAIN_LOCK=lock))))
            time.sleep(0.5)  # start order = lock order (roughly)
    for key, p in procs:
        try:
            out, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        line = next((x for x in reversed(out.splitlines()) if x.startswith("{")), None)
        recs[key] = json.loads(line) if line else {"error": (err or "no output").strip().splitlines()[-3:]}
        print(key, {k: v for k, v in recs[key].items() if k not in ("ms",)}, flush=True)
    import torch

    dev = "cpu" if args.cpu else torch.cuda.get_device_name()
    text = (f"# Rotary drop-in: what vanishes ({dev}, torch {torch.__version__})\n\n"
            f"{args.warmup} warm-up, {args.steps} timed steps (median), then a profiler window of {args.active} "
            f"steps per process; each configuration in its own process.\n\n" + table(recs, models, args.active))
    print(text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rotary_gain.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
