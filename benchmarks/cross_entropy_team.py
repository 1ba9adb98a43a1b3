"""Launch settings of the fused cross-entropy forward (which also writes the gradient) at 8192 x 128256 bf16:
the persistent team kernel (each logit read once) against the one-program-per-row kernel (two reads).

Run on a CUDA GPU from the repository root with the project installed::

    OUT=/dir python3 benchmarks/cross_entropy_team.py            # check + sweep, about 2 minutes on an H200
    python3 benchmarks/cross_entropy_team.py --ncu SETTING        # one small launch to profile under ncu

It (1) measures device-copy bandwidth (1 GiB ``dst.copy_(src)``, bytes read + written); (2) checks every setting
against float64 on 64 rows at V = 128256 and V = 32003 (bf16, fp16 and fp32 logits; plain and with softcap 30,
label smoothing 0.1 and z-loss 1e-4; a few ignored rows), relative L2 errors of the loss rows and the gradient,
outputs poisoned with NaN first; (3) times ``ce_fwd(..., grad_scale, dx, setting=...)`` (one launch writing the
loss rows, the lse and the gradient) for every setting with ``triton.testing.do_bench`` (median), in two
interleaved rounds, and reports bytes per logit at the measured copy bandwidth against 4 (read the bf16 logits
once, write the bf16 gradient once); (4) prints the registers and spills of each compiled team kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import mfuwatch.kernels._cross_entropy_triton as K
from _ce_common import parse, ref, rel, run  # noqa: F401 - parse is used by --ncu

P = argparse.ArgumentParser()
P.add_argument("--ncu", default=None, help="settings 'BLOCK,warps,kind,pps,flags' separated by ';' (a leading c: "
               "softcap 30), one launch each at --rows rows")
P.add_argument("--rows", type=int, default=8192)
ARGS = P.parse_args()

N, V = ARGS.rows, 128256
DEV = "cuda"

#: (BLOCK, num_warps, kind, programs per SM, flags). "team" (segments held in registers) flags: 1 keep
#: exp(z - max) in registers, 2 prefetch the next row; "team2" (segments streamed twice, the second read from L2)
#: flags: blocks per segment * 10 + pipeline depth. Call 1 (cross_entropy-run6.md) swept "team" alone;
#: flags + 1000: "team2" publishing through 64-bit flag words instead of a counter. Call 2 swept "team2" without.
PLAIN = [(2048, 4, "rev", 0, 4), (2048, 4, "team2", 8, 83),
         (2048, 4, "team2", 8, 1083), (2048, 4, "team2", 6, 1083), (2048, 4, "team2", 8, 1084),
         (1024, 2, "team2", 16, 1083), (2048, 4, "team2", 10, 1083), (2048, 4, "team2", 8, 1043),
         (2048, 2, "team2", 16, 1043), (4096, 8, "team2", 4, 1043), (8192, 4, "team", 4, 1)]
SOFTCAP = [(2048, 4, "row", 0, 1), (4096, 4, "team", 4, 1), (2048, 4, "team2", 8, 1083),
           (2048, 4, "team2", 8, 1043)]


def check(settings, cap):
    out = []
    g = torch.Generator(device=DEV).manual_seed(5)
    for v, dt in ((V, torch.bfloat16), (32003, torch.float16), (32003, torch.float32)):
        if v != V:
            settings = [s for s in settings if s[2].startswith("team")][:2]
        if True:
            x = (torch.randn(64, v, device=DEV, generator=g) * 4).to(dt)
            t = torch.randint(0, v, (64,), device=DEV, generator=g)
            t[::7] = -100
            t[3] = v - 1
            r_rows, r_dx = ref(x, t, 0.1, 1e-4, cap)
            for s in settings:
                dx = torch.full_like(x, float("nan"))
                loss, _, dx = run(x, t, s, 0.1, 1e-4, cap, dx)
                out.append((v, str(dt).split(".")[1], s, rel(loss, r_rows), rel(dx.float(), r_dx)))
    return out


def regs():
    lines = []
    try:
        for name, fn in (("team", K._ce_team_kernel), ("team2", K._ce_team_l2_kernel)):
            for cache in fn.device_caches.values():
                for k in cache[0].values():
                    lines.append(f"{name} kernel (in compile order): {k.n_regs} registers, {k.n_spills} spills, "
                                 f"{k.metadata.shared} B shared, {k.metadata.num_warps} warps")
    except Exception as e:  # a Triton without these attributes: the report is only informative
        lines.append(f"(registers unavailable: {e!r})")
    return lines


def providers(x, t, best):
    """cross_entropy fwd+bwd through the public API (the best setting of the sweep first among the tuner's
    candidates) against eager PyTorch on fp32 logits, torch.compile and Liger-Kernel, two interleaved rounds."""
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
    except Exception as e:  # the wheel missing: the row says so
        out.append(f"(Liger unavailable: {e!r})")
    saved = K.WRITE_SETTINGS
    res = {k: [] for k in fns}
    for _ in range(2):
        for k, f in fns.items():
            K.WRITE_SETTINGS = (best[k[1]],) + tuple(s for s in saved if s != best[k[1]])
            C._TUNED.clear()
            try:
                res[k].append(triton.testing.do_bench(f, warmup=25, rep=150, grad_to_none=[xg, xl],
                                                      return_mode="median"))
            except Exception as e:
                res[k].append(float("nan"))
                print("failed", k, repr(e)[:300])
    K.WRITE_SETTINGS = saved
    for p in ("mfuwatch", "eager fp32", "torch.compile", "Liger 0.8.5"):
        cells = []
        for cap in (0.0, 30.0):
            r = res.get((p, cap))
            cells.append(f"{r[0]:.3f} / {r[1]:.3f}" if r else "-")
        out.append(f"| {p} | {cells[0]} | {cells[1]} |")
    out.append(f"(mfuwatch with the sweep's best settings: {best})")
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
    src = torch.empty(2 ** 29, dtype=torch.float16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    bw = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    lines = [f"device copy: {bw:.0f} GB/s (1 GiB read + 1 GiB written, median {ms:.3f} ms)", ""]
    lines.append("correctness (rel. L2 error vs float64; smoothing 0.1, z-loss 1e-4, every 7th row ignored)")
    lines.append("| V | dtype | softcap | setting | loss rows | dlogits |")
    lines.append("|---|---|---|---|---|---|")
    for cap, ss in ((0.0, PLAIN), (30.0, SOFTCAP)):
        for v, dt, s, el, eg in check(ss, cap):
            lines.append(f"| {v} | {dt} | {cap or '-'} | {s} | {el:.1e} | {eg:.1e} |")
    print("\n".join(lines), flush=True)
    g = torch.Generator(device=DEV).manual_seed(11)
    x = (torch.randn(N, V, device=DEV, generator=g) * 4).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=DEV, generator=g)
    dx = torch.empty_like(x)
    floor_ms = 4 * N * V / bw / 1e6
    lines2 = ["", f"ce_fwd writing the gradient, {N} x {V} bf16, do_bench medians (ms), two interleaved rounds; "
                  f"floor {floor_ms:.3f} ms = 4 B/logit at {bw:.0f} GB/s",
              "| softcap | setting | round 1 | round 2 | B/logit at copy bw | % of copy bw at 4 B/logit |",
              "|---|---|---|---|---|---|"]
    best = {}
    for cap, ss in ((0.0, PLAIN), (30.0, SOFTCAP)):
        res = {s: [] for s in ss}
        for _ in range(2):
            for s in ss:
                try:
                    res[s].append(triton.testing.do_bench(lambda: run(x, t, s, 0.0, 0.0, cap, dx), warmup=25,
                                                          rep=150, return_mode="median"))
                except Exception as e:
                    res[s].append(float("nan"))
                    print("failed", s, repr(e)[:300])
        best[cap] = min(ss, key=lambda s: statistics.median(res[s]))
        for s in ss:
            a, b = res[s]
            m = statistics.median([a, b])
            lines2.append(f"| {cap or '-'} | {s} | {a:.3f} | {b:.3f} | {m * bw * 1e6 / (N * V):.2f} | "
                          f"{100 * floor_ms / m:.0f} |")
        print("\n".join(lines2[-len(ss):]), flush=True)
    lines += lines2 + [""] + regs() + [""] + providers(x, t, best)
    text = "\n".join(lines)

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "team_sweep.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
