"""The lean one-program-per-row cross-entropy kernel ("fast": unmasked full blocks, constexpr-specialised label
smoothing and z-loss, the target column fixed by one scalar store, ex2/rcp as single MUFU instructions, optionally
the reciprocal on the FMA pipe) against the earlier ones, at 8192 x 128256 bf16.

Run on a CUDA GPU from the repository root with the project installed::

    OUT=/dir python3 benchmarks/cross_entropy_fast.py --parts check,sweep,providers,lce
    python3 benchmarks/cross_entropy_fast.py --ncu SETTINGS      # one launch per setting, to profile under ncu

Parts: ``check``: every setting of the sweep against float64 on 64 rows at V = 128256 bf16 and V = 32003 fp16 and
fp32 (plain and softcap 30; smoothing 0 and z-loss 0, the specialised path, and smoothing 0.1 with z-loss 1e-4;
every 7th row ignored, the last class a target), relative L2 errors of the loss rows and the gradient, outputs
poisoned with NaN first. ``sweep``: ``ce_fwd(..., grad_scale, dx, setting=...)`` timed per setting with
``triton.testing.do_bench`` (median), two interleaved rounds, plus each compiled fast kernel's registers, spills
and SASS instruction mix when Triton gives its SASS. ``providers``: ``cross_entropy(x, t[, softcap=30]).backward()``
with the sweep's best settings first among the tuner's candidates against torch.compile, Liger-Kernel and eager
fp32, two interleaved rounds. ``lce``: ``linear_cross_entropy`` fwd+bwd at 8192 x 4096 x 128256 bf16 (default
mode), two rounds, and its peak memory above the inputs and gradients.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import statistics

import torch

import mfuwatch.kernels._cross_entropy_triton as K
from _ce_common import parse, ref, rel, run  # noqa: F401 - parse is used by --ncu

P = argparse.ArgumentParser()
P.add_argument("--ncu", default=None, help="settings 'BLOCK,warps,kind,pps,stages' separated by ';' (a leading c: "
               "softcap 30), one launch each at --rows rows")
P.add_argument("--rows", type=int, default=8192)
P.add_argument("--parts", default="check,sweep,providers")
ARGS = P.parse_args()

N, V = ARGS.rows, 128256
DEV = "cuda"

#: (BLOCK, num_warps, kind, programs per SM, stages); "fast" stages: depth + 10 * newton flags (1 forward, 2
#: gradient pass) + 100 (no inline PTX: tl.exp2 and divisions, an ablation)
PLAIN = [(2048, 4, "rev", 0, 4), (2048, 4, "fast", 0, 4), (2048, 4, "fast", 0, 104), (4096, 4, "fast", 0, 4),
         (4096, 8, "fast", 0, 4), (2048, 4, "fast", 0, 3), (8192, 8, "fast", 0, 4), (1024, 2, "fast", 0, 4),
         (2048, 4, "fast", 2, 6), (2048, 4, "fast", 3, 4), (4096, 8, "fast", 2, 4), (8192, 16, "fast", 0, 3),
         (16384, 16, "fast", 0, 2), (16384, 32, "fast", 0, 3), (8192, 8, "fast", 0, 3)]
SOFTCAP = [(2048, 4, "row", 0, 1), (4096, 4, "team", 4, 1), (2048, 4, "fast", 0, 4), (2048, 4, "fast", 0, 104),
           (2048, 4, "fast", 0, 14), (4096, 4, "fast", 0, 14), (2048, 4, "fast", 0, 24), (2048, 4, "fast", 0, 34),
           (4096, 4, "fast", 0, 34), (4096, 8, "fast", 0, 34)]
if os.environ.get("CE_PLAIN"):  # a later call's own lists: "B,w,kind,pps,st;..."
    PLAIN = [tuple(int(a) if i != 2 else a for i, a in enumerate(s.split(","))) for s in
             os.environ["CE_PLAIN"].split(";")]
if os.environ.get("CE_SOFTCAP"):
    SOFTCAP = [tuple(int(a) if i != 2 else a for i, a in enumerate(s.split(","))) for s in
               os.environ["CE_SOFTCAP"].split(";")]


def check():
    lines = ["correctness (rel. L2 error vs float64; every 7th row ignored, class V-1 a target)",
             "| V | dtype | softcap | smoothing, z-loss | setting | loss rows | dlogits |", "|---|---|---|---|---|---|---|"]
    g = torch.Generator(device=DEV).manual_seed(5)
    bad = 0
    for cap, ss in ((0.0, PLAIN), (30.0, SOFTCAP)):
        for v, dt in ((V, torch.bfloat16), (32003, torch.float16), (32003, torch.float32)):
            x = (torch.randn(64, v, device=DEV, generator=g) * 4).to(dt)
            t = torch.randint(0, v, (64,), device=DEV, generator=g)
            t[::7] = -100
            t[3] = v - 1
            fast = [s for s in ss if s[2] == "fast"]
            for eps, zl in ((0.0, 0.0), (0.1, 1e-4)):
                r_rows, r_dx = ref(x, t, eps, zl, cap)
                for s in (ss if v == V and eps == 0 else fast[:3] if v == V else fast[:2]):
                    dx = torch.full_like(x, float("nan"))
                    loss, _, dx = run(x, t, s, eps, zl, cap, dx)
                    el, eg = rel(loss, r_rows), rel(dx.float(), r_dx)
                    lim = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-5}[dt]
                    if not (el < 1e-6 and eg < lim):
                        bad += 1
                    lines.append(f"| {v} | {str(dt).split('.')[1]} | {cap or '-'} | {eps}, {zl} | {s} | {el:.1e} | "
                                 f"{eg:.1e} |")
    lines.append(f"settings outside (loss 1e-6, dlogits 4e-3 bf16 / 5e-4 fp16 / 1e-5 fp32): {bad}")
    print("\n".join(lines), flush=True)
    return lines


def kernel_report():
    lines = []
    for name, fn in (("fast", K._ce_fast_kernel), ("rev/row", K._ce_fwd_kernel)):
        try:
            for cache in fn.device_caches.values():
                for key, k in cache[0].items():
                    mix = ""
                    try:
                        sass = k.asm.get("sass") if hasattr(k.asm, "get") else k.asm["sass"]
                    except Exception:
                        sass = None
                    if sass:
                        ops = collections.Counter(m.group(1).split(".")[0] for m in
                                                  re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?P\w+\s+)?([A-Z0-9_.]+)", sass))
                        mix = f"; {sum(ops.values())} SASS instrs, MUFU {ops['MUFU']}, " + " ".join(
                            f"{o}:{n}" for o, n in ops.most_common(12))
                    ptx = k.asm.get("ptx", "") if hasattr(k.asm, "get") else ""
                    pt = (f"; PTX ex2 {ptx.count('ex2.approx')}, rcp {ptx.count('rcp.approx')}, "
                          f"div {ptx.count('div.')}" if ptx else "")
                    lines.append(f"{name}: {k.n_regs} registers, {k.n_spills} spills, {k.metadata.num_warps} warps"
                                 f"{pt}{mix}")
        except Exception as e:
            lines.append(f"({name}: report unavailable: {e!r})")
    return lines


class Clock:
    """Median SM clock (MHz) and board power (W) sampled every 5 ms by NVML in a thread while a timing runs
    (nvidia-ml-py; ``None`` without it): whether a variant runs slower because the GPU clocks down."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            self.nv = None

    def __call__(self, fn):
        import threading
        import time

        if self.nv is None:
            return fn(), None
        samples, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                samples.append((self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM),
                                self.nv.nvmlDeviceGetPowerUsage(self.h) / 1000))
                time.sleep(0.005)

        th = threading.Thread(target=poll, daemon=True)
        th.start()
        try:
            out = fn()
        finally:
            stop.set()
            th.join()
        if not samples:
            return out, None
        return out, (statistics.median(c for c, _ in samples), statistics.median(p for _, p in samples))


def sweep(x, t, bw):
    import triton.testing

    floor_ms = 4 * N * V / bw / 1e6
    lines = ["", f"ce_fwd writing the gradient, {N} x {V} bf16, do_bench medians (ms), two interleaved rounds; "
                 f"floor {floor_ms:.3f} ms = 4 B/logit at {bw:.0f} GB/s; smoothing 0, z-loss 0",
             "| softcap | setting | round 1 | round 2 | % of floor | SM MHz, W (round 2) |", "|---|---|---|---|---|---|"]
    dx = torch.empty_like(x)
    best = {}
    clock = Clock()
    for cap, ss in ((0.0, PLAIN), (30.0, SOFTCAP)):
        res = {s: [] for s in ss}
        clk = {}
        for _ in range(2):
            for s in ss:
                try:
                    ms, clk[s] = clock(lambda: triton.testing.do_bench(lambda: run(x, t, s, 0.0, 0.0, cap, dx),
                                                                       warmup=25, rep=120, return_mode="median"))
                    res[s].append(ms)
                except Exception as e:
                    res[s].append(float("nan"))
                    print("failed", s, repr(e)[:300])
        ok = [s for s in ss if all(map(math.isfinite, res[s]))]
        best[cap] = min(ok, key=lambda s: statistics.median(res[s]))
        for s in ss:
            a, b = res[s]
            c = clk.get(s)
            lines.append(f"| {cap or '-'} | {s} | {a:.3f} | {b:.3f} | {100 * floor_ms / statistics.median([a, b]):.0f} | "
                         f"{'%.0f, %.0f' % c if c else '-'} |")
        print("\n".join(lines[-len(ss):]), flush=True)
    lines.append(f"best: {best}")
    return lines + [""] + kernel_report(), best


def providers(x, t, best):
    import torch.nn.functional as F
    import triton.testing

    import mfuwatch.kernels as mk
    import mfuwatch.kernels._tuning as C

    xg = x.clone().requires_grad_()
    xl = xg
    out = ["", f"cross-entropy fwd+bwd {N} x {V} bf16 (loss.backward(), do_bench median ms, rounds 1 / 2)",
           "| provider | softcap - | softcap 30 |", "|---|---|---|"]
    fns = {}
    for cap in (0.0, 30.0):
        c = cap or None
        fns[("mfuwatch", cap)] = lambda c=c: mk.cross_entropy(xg, t, softcap=c).backward()
        fns[("eager fp32", cap)] = lambda c=c: F.cross_entropy(
            (c * torch.tanh(xg.float() / c)) if c else xg.float(), t).backward()
        comp = torch.compile(lambda a, b, c=c: F.cross_entropy((c * torch.tanh(a.float() / c)) if c else a.float(), b))
        fns[("torch.compile", cap)] = lambda comp=comp: comp(xg, t).backward()
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        lg = LigerCrossEntropyLoss()
        xl = x.clone().requires_grad_()  # Liger writes its gradient into the logits
        fns[("Liger 0.8.5", 0.0)] = lambda: lg(xl, t).backward()
        lgc = LigerCrossEntropyLoss(softcap=30.0)
        fns[("Liger 0.8.5", 30.0)] = lambda: lgc(xl, t).backward()
    except Exception as e:
        out.append(f"(Liger unavailable or without softcap: {e!r})")
    saved = K.WRITE_SETTINGS
    res = {k: [] for k in fns}
    chosen = {}
    for _ in range(2):
        for k, f in fns.items():
            K.WRITE_SETTINGS = (best[k[1]],) + tuple(s for s in saved if s != best[k[1]])
            C._TUNED.clear()
            try:
                res[k].append(triton.testing.do_bench(f, warmup=25, rep=120, grad_to_none=[xg, xl],
                                                      return_mode="median"))
            except Exception as e:
                res[k].append(float("nan"))
                print("failed", k, repr(e)[:300])
            if k[0] == "mfuwatch":
                chosen.update({kk[2][2]: v for kk, v in C.tuned_settings().items() if kk[0] == "ce_fwd"})
    K.WRITE_SETTINGS = saved
    for p in ("mfuwatch", "torch.compile", "Liger 0.8.5", "eager fp32"):
        cells = []
        for cap in (0.0, 30.0):
            r = res.get((p, cap))
            cells.append(f"{r[0]:.3f} / {r[1]:.3f}" if r else "-")
        out.append(f"| {p} | {cells[0]} | {cells[1]} |")
    out.append(f"(mfuwatch with the sweep's best settings first among the tuner's candidates, autotune "
               f"{'on' if C.AUTOTUNE else 'off'}: {best}; chosen: "
               f"{chosen} (keyed by softcap > 0))")
    print("\n".join(out), flush=True)
    return out


def lce():
    """linear_cross_entropy fwd+bwd (default mode: chunks of logits, each chunk's gradient written in place by
    the fused forward, which takes the first write candidate unless a non-aliasing launch was tuned): the new
    default candidate against the previous one ("rev"), two interleaved rounds, and the peak memory above the
    inputs and the gradients."""
    import triton.testing

    import mfuwatch.kernels as mk
    import mfuwatch.kernels._tuning as C

    Hd = 4096
    g = torch.Generator(device=DEV).manual_seed(2)
    t = torch.randint(0, V, (N,), device=DEV, generator=g)
    h = torch.randn(N, Hd, device=DEV, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, Hd, device=DEV, generator=g) / math.sqrt(Hd)).to(torch.bfloat16).requires_grad_()

    def step():
        mk.linear_cross_entropy(h, w, t).backward()

    saved = K.WRITE_SETTINGS
    variants = {f"{saved[0]} (new default)": saved,
                "(2048, 4, 'rev', 0, 4) (previous default)": ((2048, 4, "rev", 0, 4),) + saved}
    res = {k: [] for k in variants}
    peak = {}
    for _ in range(2):
        for name, ws in variants.items():
            K.WRITE_SETTINGS = ws
            C._TUNED.clear()
            step()
            h.grad = w.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak[name] = torch.cuda.max_memory_allocated() - base - (h.numel() + w.numel()) * 2
            res[name].append(triton.testing.do_bench(step, warmup=25, rep=400, grad_to_none=[h, w],
                                                     return_mode="median"))
    K.WRITE_SETTINGS = saved
    out = ["", f"linear_cross_entropy fwd+bwd {N} x {Hd} x {V} bf16 (default mode), do_bench medians, two "
               "interleaved rounds; peak GiB above inputs and gradients",
           "| CE launch setting | round 1 ms | round 2 ms | peak GiB |", "|---|---|---|---|"]
    for name in variants:
        out.append(f"| {name} | {res[name][0]:.2f} | {res[name][1]:.2f} | {peak[name] / 2 ** 30:.2f} |")
    print("\n".join(out), flush=True)
    return out


def main():
    import triton.testing

    if ARGS.ncu:
        x = (torch.randn(N, V, device=DEV) * 4).to(torch.bfloat16)
        t = torch.randint(0, V, (N,), device=DEV)
        for item in ARGS.ncu.split(";"):
            cap, s = (30.0, parse(item[1:])) if item.startswith("c") else (0.0, parse(item))
            run(x, t, s, cap=cap)
        torch.cuda.synchronize()
        return
    parts = ARGS.parts.split(",")
    src = torch.empty(2 ** 29, dtype=torch.float16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    bw = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    lines = [f"device copy: {bw:.0f} GB/s (1 GiB read + 1 GiB written, median {ms:.3f} ms)", ""]
    print(lines[0], flush=True)
    if "check" in parts:
        lines += check()
    g = torch.Generator(device=DEV).manual_seed(11)
    x = (torch.randn(N, V, device=DEV, generator=g) * 4).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=DEV, generator=g)
    best = {0.0: K.WRITE_SETTINGS[0], 30.0: K.WRITE_SETTINGS[0]}  # without a sweep: the library's default
    if "sweep" in parts:
        more, best = sweep(x, t, bw)
        lines += more
    if "providers" in parts:
        lines += providers(x, t, best)
    del x
    torch.cuda.empty_cache()
    if "lce" in parts:
        lines += lce()
    text = "\n".join(lines)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ce_fast.md"), "w") as f:
            f.write(text + "\n")
    print("\n".join(lines[-12:]))


if __name__ == "__main__":
    main()
