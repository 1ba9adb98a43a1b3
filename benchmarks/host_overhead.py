"""Where the host time of a fused-norm call goes: per-call CPU cost of each layer, and GPU kernel times.

Run on a CUDA GPU from the repository root, with the project installed::

    python3 benchmarks/host_overhead.py            # about 1 minute on an H200
    OUT=/dir python3 benchmarks/host_overhead.py   # also writes $OUT/host_overhead.md

Part 1 times, per call, the host (CPU) cost of each layer of an ``rms_norm``
call at a shape whose GPU work is tiny (64 x 2048 bf16), so that the CPU is the
bottleneck: wall time of 3,000 back-to-back calls over 3,000, after a
synchronize, median of 5 repeats. Layers: a bare ``torch.empty``, torch's
native ``F.rms_norm``, a raw Triton launch of our kernel, our launcher, our
functional op, and forward+backward. Part 2 lists the top Python functions by
own time (``cProfile``) for our forward+backward. Part 3 gives the GPU kernel
times (``torch.profiler``, CUDA activity) of our forward and backward at LLM
shapes against native, as a fraction of the device-copy bandwidth, i.e. what
the kernels reach once the host is out of the way.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mfuwatch.kernels as mk
from mfuwatch.kernels import _norm_launch as K
from mfuwatch.kernels._norm_triton import _norm_fwd_fused
from mfuwatch.kernels.traffic import minimal_bytes

BF16 = torch.bfloat16
LINES = []


def say(s=""):
    print(s, flush=True)
    LINES.append(s)


def per_call_us(fn, n=3000, repeats=5):
    """Median over ``repeats`` of the wall time of ``n`` back-to-back calls / n, in microseconds."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


class _Nothing(torch.autograd.Function):
    """The cost floor of any Python ``autograd.Function``: forward allocates its output, backward returns dy."""

    @staticmethod
    def forward(ctx, x, w):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def host_speed_ns() -> float:
    """Nanoseconds per iteration of an empty Python loop: the host's Python speed, to compare machines."""
    t0 = time.perf_counter()
    for _ in range(10 ** 6):
        pass
    return 1e3 * (time.perf_counter() - t0)


def part1():
    say("## Host time per call (64 x 2048 bf16; GPU work ~2 us per kernel)")
    say("")
    say(f"host speed: empty Python loop {host_speed_ns():.0f} ns/iteration")
    say("")
    rows, n = 64, 2048
    x = torch.randn(rows, n, device="cuda", dtype=BF16)
    w = torch.randn(n, device="cuda", dtype=BF16)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device="cuda", dtype=torch.float32)
    args = (x, x, w, x, y, y, rstd, rstd, n, n, n, n, rows, n, 1e-6, 0.0)
    flags = dict(IS_RMS=True, HAS_W=True, HAS_B=False, HAS_RES=False, LLAMA_CAST=True, ROWS=1, BLOCK_N=2048,
                 num_warps=4)

    def raw():
        _norm_fwd_fused[(rows,)](*args, **flags)

    ck = _norm_fwd_fused[(rows,)](*args, **flags)
    consts = (True, True, False, False, True, 1, 2048)

    def direct():  # the compiled kernel's launcher, as JITFunction.run calls it after its cache lookup
        ck.run(rows, 1, 1, torch._C._cuda_getCurrentRawStream(0), ck.function, ck.packed_metadata, None, None,
               None, *args, *consts)

    pargs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)

    def direct_ptr():  # the same, tensors passed as data pointers (as _launch.Launcher does)
        ck.run(rows, 1, 1, torch._C._cuda_getCurrentRawStream(0), ck.function, ck.packed_metadata, None, None,
               None, *pargs, *consts)

    direct_ok = "n/a"
    try:
        y.zero_()
        direct()
        torch.cuda.synchronize()
        y2 = y.clone()
        y.zero_()
        raw()
        torch.cuda.synchronize()
        direct_ok = bool(torch.equal(y, y2))
    except Exception as exc:  # noqa: BLE001
        direct_ok = f"{type(exc).__name__}: {exc}"[:200]
        direct = None

    bg = torch.randn(n, device="cuda", dtype=BF16, requires_grad=True)
    rg = torch.randn(rows, n, device="cuda", dtype=BF16, requires_grad=True)

    def fwdbwd(f):
        def go():
            out = f(xg, wg)
            outs = list(out) if isinstance(out, tuple) else [out]
            torch.autograd.backward(outs, [dy] * len(outs))
            xg.grad = wg.grad = bg.grad = rg.grad = None
        return go

    def native_add(a, b):
        h = a + rg
        return F.rms_norm(h, (n,), b, 1e-6), h

    cases = [
        ("torch.empty(64x2048 bf16)", lambda: torch.empty((rows, n), dtype=BF16, device="cuda")),
        ("native F.rms_norm fwd, no grad", lambda: F.rms_norm(x, (n,), w, 1e-6)),
        ("raw Triton launch of our fwd kernel", raw),
        ("compiled-kernel launcher, direct", direct),
        ("compiled-kernel launcher, direct, data pointers", direct_ptr if direct else None),
        ("our launcher K.norm_fwd", lambda: K.norm_fwd(x, w, None, None, n, 1e-6, 0.0, True, True)),
        ("mk.rms_norm fwd, no grad", lambda: mk.rms_norm(x, w)),
        ("native F.rms_norm fwd, leaves need grad", lambda: F.rms_norm(xg, (n,), wg, 1e-6)),
        ("mk.rms_norm fwd, leaves need grad", lambda: mk.rms_norm(xg, wg)),
        ("native F.rms_norm fwd+bwd", fwdbwd(lambda a, b: F.rms_norm(a, (n,), b, 1e-6))),
        ("mk.rms_norm fwd+bwd", fwdbwd(mk.rms_norm)),
        ("floor: an autograd.Function doing nothing (one empty_like), fwd+bwd", fwdbwd(_Nothing.apply)),
        ("native F.layer_norm fwd+bwd", fwdbwd(lambda a, b: F.layer_norm(a, (n,), b, bg))),
        ("mk.layer_norm fwd+bwd", fwdbwd(lambda a, b: mk.layer_norm(a, (n,), b, bg))),
        ("native add + F.rms_norm fwd+bwd", fwdbwd(native_add)),
        ("mk.add_rms_norm fwd+bwd", fwdbwd(lambda a, b: mk.add_rms_norm(a, rg, b))),
        ("our backward launcher K.norm_bwd", lambda: K.norm_bwd(dy, x, w, False, None, rstd, None, n, 0.0, True, True)),
    ]
    say(f"direct launcher output equals the JIT launch: {direct_ok}")
    say("")
    say("| layer | host µs per call |")
    say("|---|---:|")
    for name, fn in cases:
        if fn is None:
            say(f"| {name} | failed |")
            continue
        say(f"| {name} | {per_call_us(fn):.1f} |")
    say("")
    return fwdbwd(mk.rms_norm)


def part2(go):
    say("## cProfile of 500 mk.rms_norm forward+backward calls (own time)")
    say("")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        go()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    say("```")
    for line in s.getvalue().splitlines()[4:]:
        if line.strip():
            say(line[:160])
    say("```")
    say("")


def kernel_times(fn, reps=20):
    """{kernel name: mean µs per call} from the profiler's CUDA activity over ``reps`` calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] = tot.get(e.name, 0.0) + e.device_time / reps
    return tot


def copy_bw():
    src = torch.empty(1 << 29, dtype=BF16, device="cuda").normal_()
    dst = torch.empty_like(src)
    from triton.testing import do_bench
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=60, return_mode="median")
    return 4 * src.numel() / (ms * 1e-3)


def part3():
    bw = copy_bw()
    say(f"## GPU kernel time per call (torch.profiler), bf16; copy bandwidth {bw / 1e12:.2f} TB/s")
    say("")
    say("| op | shape | provider | fwd kernels µs | bwd kernels µs | fwd %copy | fwd+bwd %copy | kernels (fwd+bwd) |")
    say("|---|---|---|---:|---:|---:|---:|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        for rows, n in ((4096, 2048), (8192, 4096), (8192, 8192), (16384, 4096), (16384, 8192)):
            x = torch.randn(rows, n, device="cuda", dtype=BF16, generator=gen).requires_grad_()
            w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(BF16).requires_grad_()
            b = (0.1 * torch.randn(n, device="cuda", generator=gen)).to(BF16).requires_grad_()
            r = torch.randn(rows, n, device="cuda", dtype=BF16, generator=gen).requires_grad_()
            dy = torch.randn(rows, n, device="cuda", dtype=BF16, generator=gen)
            if op == "rms_norm":
                provs = {"mfuwatch": lambda: (mk.rms_norm(x, w),),
                         "native": lambda: (F.rms_norm(x, (n,), w, 1e-6),)}
            elif op == "layer_norm":
                provs = {"mfuwatch": lambda: (mk.layer_norm(x, (n,), w, b),),
                         "native": lambda: (F.layer_norm(x, (n,), w, b),)}
            else:
                def nat():
                    h = x + r
                    return F.rms_norm(h, (n,), w, 1e-6), h
                provs = {"mfuwatch": lambda: mk.add_rms_norm(x, r, w), "native": nat}
            fo = minimal_bytes(op, rows, n, 2, backward=False)
            fb = fo + minimal_bytes(op, rows, n, 2, backward=True)
            for name, f in provs.items():
                kf = kernel_times(f)
                outs = f()

                def bwd():  # grads set to None first: no accumulation kernel in the timing
                    for t in (x, w, b, r):
                        t.grad = None
                    torch.autograd.backward(list(outs), [dy] * len(outs), retain_graph=True)
                kb = kernel_times(bwd)
                tf, tb = sum(kf.values()), sum(kb.values())
                names = "; ".join(f"{k[:40]} {v:.0f}" for k, v in sorted({**kf, **kb}.items(), key=lambda kv: -kv[1])[:4])
                say(f"| {op} | {rows}x{n} | {name} | {tf:.1f} | {tb:.1f} | {fo / (tf * 1e-6) / bw:.0%} | "
                    f"{fb / ((tf + tb) * 1e-6) / bw:.0%} | {names} |")
                for t in (x, w, b, r):
                    t.grad = None
            del x, r, dy
            torch.cuda.empty_cache()
    say("")


def part4():
    """Every backward launch setting at three shapes: GPU time of the row kernel plus the partial-sum kernel."""
    from triton.testing import do_bench

    from mfuwatch.kernels._launch import pow2_at_least, sm_count
    say("## Backward settings (rms_norm, bf16): do_bench median µs of the two backward launches")
    say("")
    say("| shape | (programs/SM, warps, rows per step, maxnreg) | µs | % of copy |")
    say("|---|---|---:|---:|")
    bw = copy_bw()
    for rows, n in ((8192, 4096), (16384, 4096), (16384, 8192)):
        x = torch.randn(rows, n, device="cuda", dtype=BF16)
        dy = torch.randn_like(x)
        w = torch.randn(n, device="cuda", dtype=BF16)
        rstd = torch.rand(rows, device="cuda") + 0.5
        dx = torch.empty_like(x)
        n_sm = sm_count(x.device)
        by = minimal_bytes("rms_norm", rows, n, 2, backward=True)
        for c in K._bwd_candidates(pow2_at_least(n)):
            args = (dy, x, w, rstd, rstd, dy, dx, n, n, n, n, rows, True, False, True, False, True, 0.0,
                    torch.bfloat16, False, n_sm, c)
            try:
                us = 1e3 * do_bench(lambda: K._bwd_launch(*args), warmup=5, rep=30, return_mode="median")
                say(f"| {rows}x{n} | {c} | {us:.1f} | {by / (us * 1e-6) / bw:.0%} |")
            except Exception as exc:  # noqa: BLE001
                say(f"| {rows}x{n} | {c} | failed: {type(exc).__name__} | |")
    say("")


def part5():
    """CPU timeline of one rms_norm forward+backward (64 x 2048 bf16): where the host time goes."""
    from torch.profiler import ProfilerActivity, profile

    say("## CPU timeline of one mk.rms_norm forward+backward (torch.profiler, CPU + CUDA runtime events)")
    say("")
    n = 2048
    x = torch.randn(64, n, device="cuda", dtype=BF16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(64, n, device="cuda", dtype=BF16)
    for _ in range(20):
        mk.rms_norm(x, w).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            with torch.profiler.record_function("ITER"):
                x.grad = w.grad = None
                mk.rms_norm(x, w).backward(dy)
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    iters = sorted((e for e in evs if e.name == "ITER"), key=lambda e: e.time_range.start)
    it = iters[-1]
    t0, t1 = it.time_range.start, it.time_range.end
    inside = sorted((e for e in evs if t0 <= e.time_range.start <= t1 and e.name != "ITER"),
                    key=lambda e: e.time_range.start)
    say(f"iteration: {t1 - t0:.0f} µs of host time")
    say("")
    say("| start µs | duration µs | thread | event |")
    say("|---:|---:|---:|---|")
    for e in inside[:60]:
        say(f"| {e.time_range.start - t0:.1f} | {e.time_range.end - e.time_range.start:.1f} | {e.thread} | {e.name[:70]} |")
    say("")


def main():
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import triton
    say(f"# Host overhead of the fused norms — {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"Triton {triton.__version__}, {os.cpu_count()} CPUs")
    say("")
    go = part1()
    part2(go)
    part3()
    part4()
    part5()
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "host_overhead.md"), "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
