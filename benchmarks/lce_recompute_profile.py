"""Where linear CE's ``mode="recompute"`` spends its time: the GPU kernels of one forward + backward, by kernel.

Run on a CUDA GPU from the repository root, with the project installed::

    python3 benchmarks/lce_recompute_profile.py            # 8192 x 4096 x 128256 bf16, about a minute on an H200
    OUT=/dir python3 benchmarks/lce_recompute_profile.py   # also writes $OUT/lce_recompute_profile.md

It prints (1) ``torch.profiler``'s GPU time per kernel name over three forward + backward steps of each mode
(per step: calls, ms, µs per call); (2) the same GEMMs alone, back to back over every tile (``torch.mm`` into
the tile, the fp32-output ``addmm`` into the dh accumulator, dW's ``mm`` / ``addmm_``), CUDA-event medians;
(3) where the GPU waits in each mode: the host's enqueue time, the kernels' busy time against the step's span,
and the longest gaps between kernels; (4) the whole step in both modes and per launch setting of the tile
kernels (``BLOCK`` columns per block, ``WARPS``; two interleaved rounds), with the tile kernels' own GPU time.
"""

from __future__ import annotations

import collections
import math
import os
import sys

import torch

import mfuwatch.kernels as mk
from mfuwatch.kernels import _lce_recompute as R

if not torch.cuda.is_available():
    sys.exit("needs a CUDA GPU")

N, H, V = 8192, 4096, 128256
BF16 = torch.bfloat16
DEV = "cuda"


def bench(fn, reps: int = 5) -> float:
    """Median ms of ``fn`` over ``reps`` CUDA-event timings after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def short(name: str) -> str:
    """A kernel's name without template arguments, at most 70 characters."""
    return name.split("<")[0].split("(")[0][:70]


def kernel_table(step, title: str, steps: int = 3) -> list:
    """torch.profiler's GPU time per kernel name over ``steps`` calls of ``step``, per step, as markdown rows."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = short(e.name)
            per[k][0] += 1
            per[k][1] += e.device_time_total
    total = sum(v[1] for v in per.values()) / steps / 1e3
    out = [f"## GPU kernels per forward + backward, {title} (torch.profiler, {steps} steps)", "",
           "| kernel | calls | ms | µs per call |", "|---|---|---|---|"]
    for k, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        out.append(f"| `{k}` | {n // steps} | {us / steps / 1e3:.3f} | {us / n:.1f} |")
    return out + [f"| all kernels | | {total:.3f} | |", ""]


def tile_kernel_ms(step) -> float:
    """GPU ms per step of the two tile kernels (torch.profiler over two steps)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        step()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and "_tile_" in e.name)
    return us / 2e3


def gaps(step, title: str) -> list:
    """Where the GPU waits during one step: the host's time to enqueue the step (no sync), the step's wall time,
    its kernels' summed time against their span (CUDA activity only, so that the profiler slows the host little),
    and the longest idle gaps between consecutive kernels with their neighbours."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ks = sorted(((e.time_range.start, e.time_range.end, short(e.name)) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    busy = sum(b - a for a, b, _ in ks)
    span = ks[-1][1] - ks[0][0]
    holes = sorted(((ks[i + 1][0] - ks[i][1], ks[i][2], ks[i + 1][2]) for i in range(len(ks) - 1)), reverse=True)
    small = sum(g for g, _, _ in holes if 0 < g <= 20)
    big = sum(g for g, _, _ in holes if g > 20)
    out = [f"## Where the GPU waits (one step, {title})", "",
           f"host enqueue time of the step (no sync) {1e3 * (t1 - t0):.2f} ms; wall time with the sync "
           f"{1e3 * (t2 - t0):.2f} ms; under the profiler: first kernel start to last kernel end "
           f"{span / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms, gaps of at most 20 µs {small / 1e3:.2f} ms, "
           f"longer gaps {big / 1e3:.2f} ms, {len(ks)} kernels", "",
           "| gap µs | after | before |", "|---|---|---|"]
    out += [f"| {g:.1f} | `{a}` | `{b}` |" for g, a, b in holes[:15]]
    return out + [""]


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(6)
    t = torch.randint(0, V, (N,), device=DEV, generator=g)
    h = torch.randn(N, H, device=DEV, generator=g).to(BF16).requires_grad_()
    w = (torch.randn(V, H, device=DEV, generator=g) / math.sqrt(H)).to(BF16).requires_grad_()

    def step(mode="recompute"):
        h.grad = w.grad = None
        mk.linear_cross_entropy(h, w, t, mode=mode).backward()

    r, c = R.tile_shape(N, V, H, 2, True, True, 2, False, False)
    out = [f"# linear CE mode='recompute': {N} x {H} x {V} bf16, tile {r} x {c}", "",
           f"torch {torch.__version__}; {torch.cuda.get_device_name()}", ""]
    step()
    step()
    torch.cuda.synchronize()
    out += kernel_table(step, "mode='recompute'")
    out += kernel_table(lambda: step("chunked"), "mode='chunked' (the default), for comparison")

    # the GEMMs alone, over every tile, as the mode issues them
    hb, wb = h.detach(), w.detach()
    tile = torch.empty(r, c, dtype=BF16, device=DEV)
    acc = torch.zeros(r, H, dtype=torch.float32, device=DEV)
    dw = torch.empty(V, H, dtype=BF16, device=DEV)
    tiles = [(r0, min(N, r0 + r), c0, min(V, c0 + c)) for r0 in range(0, N, r) for c0 in range(0, V, c)]

    def form():
        for r0, r1, c0, c1 in tiles:
            torch.mm(hb[r0:r1], wb[c0:c1].t(), out=tile[:r1 - r0, :c1 - c0])

    def dh_acc():
        for r0, r1, c0, c1 in tiles:
            R.add_product_(acc[:r1 - r0], tile[:r1 - r0, :c1 - c0], wb[c0:c1])

    def dh_bf16():
        a = torch.empty(r, H, dtype=BF16, device=DEV)
        for r0, r1, c0, c1 in tiles:
            a[:r1 - r0].addmm_(tile[:r1 - r0, :c1 - c0], wb[c0:c1])

    acc_t = torch.zeros(H, r, dtype=torch.float32, device=DEV)

    def dh_acc_t():  # the same sums with the accumulator transposed: dh^T += W_c^T @ tile^T
        for r0, r1, c0, c1 in tiles:
            R.add_product_(acc_t[:, :r1 - r0], wb[c0:c1].t(), tile[:r1 - r0, :c1 - c0].t())

    def dw_gemm():
        for r0, r1, c0, c1 in tiles:
            d = dw[c0:c1]
            if r0 == 0:
                torch.mm(tile[:r1 - r0, :c1 - c0].t(), hb[r0:r1], out=d)
            else:
                d.addmm_(tile[:r1 - r0, :c1 - c0].t(), hb[r0:r1])

    def full_gemm():
        hb @ wb.t()

    tflop = 2 * N * H * V / 1e12
    out += ["## The GEMMs alone, every tile back to back (CUDA-event medians)", "",
            "| GEMMs | ms | TFLOP/s |", "|---|---|---|"]
    for name, fn in (("form the tiles (mm, bf16 out)", form), ("dh += tile @ W_c (fp32 out, accumulate)", dh_acc),
                     ("dh += tile @ W_c (bf16 accumulate, for comparison)", dh_bf16),
                     ("dh^T += W_c^T @ tile^T (fp32 out, accumulate)", dh_acc_t),
                     ("dW_c (+)= tile^T @ h_r", dw_gemm), ("one whole logits GEMM h @ W^T", full_gemm)):
        ms = bench(fn)
        out.append(f"| {name} | {ms:.2f} | {tflop / ms * 1e3:.0f} |")
    del tile, acc, acc_t, dw
    torch.cuda.empty_cache()
    out.append("")

    out += gaps(step, "mode='recompute'")
    out += gaps(lambda: step("chunked"), "mode='chunked'")

    out += ["## The whole forward + backward per launch setting of the tile kernels", "",
            "Step: CUDA-event medians, two interleaved rounds; tile kernels: their GPU time per step "
            "(torch.profiler, 2 steps).", "",
            "| configuration | step ms (round 1, round 2) | tile kernels ms |", "|---|---|---|"]
    base = (R.BLOCK, R.WARPS)
    settings = [base] + [s for s in ((4096, 8), (2048, 4), (4096, 4), (1024, 2)) if s != base]
    times = {s: [] for s in settings}
    chunked = []
    for _ in range(2):
        chunked.append(bench(lambda: step("chunked")))
        for st in settings:
            R.BLOCK, R.WARPS = st
            times[st].append(bench(step))
    out.append(f"| chunked (the default mode) | {chunked[0]:.2f}, {chunked[1]:.2f} | |")
    for st in settings:
        R.BLOCK, R.WARPS = st
        label = " (default)" if st == base else ""
        out.append(f"| recompute, BLOCK {st[0]}, {st[1]} warps{label} | {times[st][0]:.2f}, {times[st][1]:.2f} | "
                   f"{tile_kernel_ms(step):.3f} |")
    R.BLOCK, R.WARPS = base
    text = "\n".join(out) + "\n"
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "lce_recompute_profile.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
