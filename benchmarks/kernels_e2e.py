"""End to end: the Llama-style training step of the fixture traces, before and after ``mfuwatch.kernels.patch``.

Run on a CUDA GPU from the repository root (project installed with
``pip install --no-deps --no-build-isolation -e .``)::

    python3 benchmarks/kernels_e2e.py                 # eager and torch.compile, about 3-4 minutes on an H200
    python3 benchmarks/kernels_e2e.py --no-compile    # eager only
    OUT=/dir python3 benchmarks/kernels_e2e.py        # also writes $OUT/kernels_e2e.md (+ .json)

The model is the ``llama_bf16_eager`` workload of ``tests/fixtures/traces/make_traces.py``
(V=32000, d=2048, 4 layers, 16 heads, SwiGLU ff=5632, RMSNorm written out in PyTorch,
SDPA attention, bf16 autocast, batch 4 x 1024, AdamW foreach), written again here because
only the repository travels to the GPU machine. Two differences, both needed for
``patch`` to see the modules and neither changing the math: the gated MLP is its own
module (``gate_proj``/``up_proj``/``down_proj`` and an ``act_fn``, as in Hugging Face's
``LlamaMLP``; the fixture writes it inline in the block), and the RMSNorm's weight is
named ``weight`` with its epsilon in ``eps`` (the fixture: ``w``).

For each of eager / ``torch.compile``, before and after
``patch(model, kernels=["rms_norm", "swiglu"])`` it reports: the loss on a fixed batch
(the patch must not change it), the median step time (forward, backward, AdamW; 10 steps
with a synchronize each, after warm-up), MFU (analytic model FLOPs of the fixture's README
/ step time / the GPU's dense bf16 peak from ``mfuwatch.agent.device.peaks``, the definition of
docs/architecture.md), the FLOPs ``FlopCounterMode`` counts for one step (eager; it must stay the
same up to the fused ops' few elementwise FLOPs) and, from a 3-step profiler window
classified by ``mfuwatch.agent.analysis.analyze.analyze_events``, the memory-bound share, the top
ops and the agent's suggestions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import mfuwatch.kernels as mk
from mfuwatch.agent.llama import LlamaLM, LlamaShape

V, D, L, HEADS, FF, B, T = 32000, 2048, 4, 16, 5632, 4, 1024


def analytic_flops() -> float:
    """6 x matmul parameters x tokens + 12 L d T x tokens (PaLM appendix B; the fixtures' README)."""
    per_layer = 3 * D * D + D * D + 3 * D * FF
    return 6 * (L * per_layer + D * V) * B * T + 12 * L * D * T * B * T


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiler window (memory-bound share)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (median reported)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU")
        return 2
    dev = "cuda"
    torch.manual_seed(0)
    model = LlamaLM(LlamaShape(vocab=V, d_model=D, n_layers=L, n_heads=HEADS, d_ff=FF)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator(device=dev).manual_seed(1)
    idx = torch.randint(0, V, (B, T), device=dev, generator=gen)
    tgt = torch.randint(0, V, (B, T), device=dev, generator=gen)
    fixed = (torch.randint(0, V, (B, T), device=dev, generator=gen), torch.randint(0, V, (B, T), device=dev, generator=gen))
    name = torch.cuda.get_device_name()
    peak, peak_src = _peak(name)
    flops = analytic_flops()

    def make_step(fwd):
        def step():
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = fwd(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def fixed_loss(fwd):
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
            return float(fwd(*fixed))  # host-device sync, outside the timed steps

    rows = []

    def run(label, fwd, count_flops):
        t0 = time.time()
        step = make_step(fwd)
        for _ in range(5):  # warm-up: compilation, Triton JIT and autotuning happen here
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.steps):
            t1 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t1)
        st = sorted(times)[len(times) // 2]
        row = {"variant": label, "loss_fixed_batch": fixed_loss(fwd), "step_s": st,
               "mfu": flops / st / peak if peak else None, "flop_counter": None, "memory_bound_share": None,
               "top_ops": [], "suggestions": []}
        if count_flops:
            row["flop_counter"] = _count_flops(model, idx, tgt, dev)
        if not args.no_profile:
            row.update(_profile(step, name, st))
        row["wall_s"] = time.time() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)

    run("eager, unpatched", model, True)
    if not args.no_compile:
        run("torch.compile, unpatched", torch.compile(model), False)
        torch._dynamo.reset()
    report = mk.patch(model, kernels=["rms_norm", "swiglu"])
    print(report, flush=True)
    run("eager, patched", model, True)
    if not args.no_compile:
        run("torch.compile, patched", torch.compile(model), False)

    lines = [f"## End to end: Llama-style step (fixture `llama_bf16_eager`) on {name}", "",
             f"torch {torch.__version__}; batch {B} × {T} tokens; analytic model FLOPs/step {flops:.4g}; "
             f"peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s bf16 dense ({peak_src}); "
             f"`patch` swapped {report.count('rms_norm')} RMSNorm and {report.count('swiglu')} MLP modules; "
             "command: `python3 benchmarks/kernels_e2e.py`", "",
             "| variant | step time (ms) | MFU | memory-bound share | loss (fixed batch) | FlopCounterMode FLOPs/step | "
             "top ops (share of GPU busy time) | suggestions |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        mbs = f"{r['memory_bound_share']:.1%}" if r["memory_bound_share"] is not None else "n/a"
        fc = f"{r['flop_counter']:.6g}" if r["flop_counter"] else "—"
        lines.append(f"| {r['variant']} | {r['step_s'] * 1e3:.2f} | {mfu} | {mbs} | {r['loss_fixed_batch']:.5f} | {fc} | "
                     f"{'; '.join(r['top_ops']) or 'n/a'} | {', '.join(r['suggestions']) or '—'} |")
    text = "\n".join(lines)
    print("\n" + text)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "kernels_e2e.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "kernels_e2e.json"), "w") as f:
            json.dump({"device": name, "rows": rows, "patch_report": str(report)}, f, indent=1)
    return 0


def _peak(name):
    """Dense bf16 peak FLOP/s of this GPU from the agent's peak table, and where it came from."""
    try:
        from mfuwatch.agent.device.peaks import lookup

        spec = lookup(name=name)
        if spec is not None:
            return spec.peak_flops["bf16"], spec.source
    except Exception as exc:  # noqa: BLE001
        print(f"peak table unavailable: {type(exc).__name__}: {exc}")
    return None, "unknown GPU: MFU not reported"


def _count_flops(model, idx, tgt, dev):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def _profile(step, name, step_s):
    """Memory-bound share, top ops and suggestions of a 3-step profiler window (mfuwatch.agent)."""
    from torch.profiler import ProfilerActivity, profile

    res = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_flops=True) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        try:
            from mfuwatch.agent.device.peaks import lookup
            from mfuwatch.agent.analysis.analyze import analyze_events
            from mfuwatch.agent.analysis.trace import read_trace

            wm = analyze_events(read_trace(path).events(), spec_or_peaks=lookup(name=name), steps=3,
                                step_time_seconds=step_s)
            res["memory_bound_share"] = wm.memory_bound_share
            res["top_ops"] = [f"{o.op} {o.share:.0%} ({o.bound})" for o in wm.top_ops[:4]]
            res["suggestions"] = [f"{s.kernel} (+{s.expected_gain:.1%})" for s in wm.suggestions[:4]]
        except Exception as exc:  # noqa: BLE001 - the agent's analysis is optional here
            print(f"profile analysis failed: {type(exc).__name__}: {exc}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
