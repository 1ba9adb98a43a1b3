"""Exploration for run 5 (issue 4's open items), one device call; writes $OUT/explore_run5.md.

A. Where the eager forward+backward host time goes: the autograd engine runs a CUDA op's backward on
   its device thread. Per-call host time (64 x 2048 bf16) of backward bodies on the device thread,
   on the calling thread (``torch.autograd.set_multithreading_enabled(False)``) and called directly,
   plus a timeline (main thread -> backward entry -> exit -> main thread) of our rms_norm.
B. Backward launch settings with ``maxnreg`` (registers per thread) for layer_norm / add_rms_norm /
   rms_norm, GPU time by CUDA-graph replay, registers and spills of each compile.
C. The forwards where torch.compile was 2-3% ahead: the inductor kernel's source, and its time against
   ours under each forward setting.
D. After the changes these led to: every forward and backward candidate of the launchers (graph replay),
   and the tuner's pick (``python3 benchmarks/explore_run5.py D``).
E. The looped forward with the row width at run time or compiled in, against torch.compile (``... E``).

Run: ``python3 benchmarks/explore_run5.py [A B C D]`` (A-C: about 4 minutes on an H200).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

import mfuwatch.kernels as mk
from mfuwatch.kernels import _norm_launch as K
from mfuwatch.kernels._common import cdiv, pow2_at_least, row_bucket, tuned_settings
from mfuwatch.kernels._norm_triton import _norm_bwd_fused, _norm_fwd_fused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import host_speed_ns, per_call_us as _per_call_us  # noqa: E402  (the same loops as there)

BF16 = torch.bfloat16
OUT = os.environ.get("OUT", "/tmp/out")
LINES = []


def say(s=""):
    print(s, flush=True)
    LINES.append(str(s))


def per_call_us(fn):
    """Host µs per call: ``host_overhead.per_call_us`` (median of 5 repeats), 2,000 calls per repeat."""
    return _per_call_us(fn, n=2000)


# ----------------------------------------------------------------------------------------- part A

ROWS, N = 64, 2048
X = torch.randn(ROWS, N, device="cuda", dtype=BF16)
W = torch.randn(N, device="cuda", dtype=BF16)
DY = torch.randn_like(X)
_, _, _, RSTD = K.norm_fwd(X, W, None, None, N, 1e-6, 0.0, True, True)
THREADS = set()


def body_bwd():
    return K.norm_bwd(DY, X, W, False, None, RSTD, None, N, 0.0, True, True)[0]


def body_empty():
    for _ in range(5):
        torch.empty((ROWS, N), dtype=BF16, device="cuda")


def body_loop():
    s = 0
    for i in range(1000):
        s += i
    return s


SCRATCH = torch.ones(4, device="cuda", dtype=torch.float32)


def body_launch():
    K._SUM(1, (SCRATCH, SCRATCH[2:], SCRATCH[2:], 1, 1, 1), K._SUM_CONSTS[16], 4)


def make_fn(body):
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, dy):
            THREADS.add(threading.get_ident())
            body()
            return dy, None
    return Fn


XG = X.clone().requires_grad_()
WG = W.clone().requires_grad_()


def fwdbwd(f):
    def go():
        y = f(XG, WG)
        torch.autograd.backward([y], [DY])
        XG.grad = WG.grad = None
    return go


STAMPS = []


class Timeline(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        y, _, _, rstd = K.norm_fwd(x, w, None, None, N, 1e-6, 0.0, True, True)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        t1 = time.perf_counter_ns()
        x, w, rstd = ctx.saved_tensors
        dx, dw, _ = K.norm_bwd(dy, x, w, False, None, rstd, None, N, 0.0, True, True)
        STAMPS.append((t1, time.perf_counter_ns()))
        return dx, dw


def part_a():
    say("## A. Host time of forward+backward (64 x 2048 bf16), µs per call")
    say("")
    say(f"host speed: empty Python loop {host_speed_ns():.0f} ns/iteration")
    say("")
    cases = [
        ("floor: Function, empty backward", fwdbwd(make_fn(lambda: None).apply), None),
        ("Function, backward = K.norm_bwd", fwdbwd(make_fn(body_bwd).apply), body_bwd),
        ("Function, backward = 5 torch.empty", fwdbwd(make_fn(body_empty).apply), body_empty),
        ("Function, backward = 1000-iteration Python loop", fwdbwd(make_fn(body_loop).apply), body_loop),
        ("Function, backward = one direct Triton launch", fwdbwd(make_fn(body_launch).apply), body_launch),
        ("mk.rms_norm", fwdbwd(lambda a, b: mk.rms_norm(a, b)), None),
        ("native F.rms_norm", fwdbwd(lambda a, b: F.rms_norm(a, (N,), b, 1e-6)), None),
        ("mk.layer_norm (no bias)", fwdbwd(lambda a, b: mk.layer_norm(a, (N,), b)), None),
        ("native F.layer_norm (no bias)", fwdbwd(lambda a, b: F.layer_norm(a, (N,), b)), None),
    ]
    say("| case | device thread (default) | calling thread (multithreading off) | body alone, main thread |")
    say("|---|---:|---:|---:|")
    for name, go, body in cases:
        THREADS.clear()
        on = per_call_us(go)
        with torch.autograd.set_multithreading_enabled(False):
            off = per_call_us(go)
        alone = f"{per_call_us(body):.1f}" if body is not None else ""
        say(f"| {name} | {on:.1f} | {off:.1f} | {alone} |")
    say("")
    say(f"main thread {threading.get_ident()}; backward ran on threads {sorted(THREADS)}")
    for label, ctx in (("device thread", None), ("calling thread", False)):
        STAMPS.clear()
        marks = []

        def go():
            y = Timeline.apply(XG, WG)
            t0 = time.perf_counter_ns()
            torch.autograd.backward([y], [DY])
            marks.append((t0, time.perf_counter_ns()))
            XG.grad = WG.grad = None

        cm = torch.autograd.set_multithreading_enabled(False) if ctx is False else torch.enable_grad()
        with cm:
            for _ in range(2100):
                go()
        torch.cuda.synchronize()
        a = [(s[0] - m[0]) / 1e3 for m, s in zip(marks[100:], STAMPS[100:])]
        b = [(s[1] - s[0]) / 1e3 for s in STAMPS[100:]]
        c = [(m[1] - s[1]) / 1e3 for m, s in zip(marks[100:], STAMPS[100:])]
        say(f"timeline ({label}), medians µs: backward() call -> backward entry {statistics.median(a):.1f}; "
            f"body {statistics.median(b):.1f}; exit -> backward() returns {statistics.median(c):.1f}")
    say("")


# ----------------------------------------------------------------------------------------- part B

def regs(k):
    return getattr(k, "n_regs", "?"), getattr(k, "n_spills", "?")


def part_b():
    say("## B. Backward settings with maxnreg (GPU time, CUDA-graph replay, µs; row kernel + partial sums)")
    say("")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    ops = {
        "layer_norm": dict(IS_RMS=False, HAS_W=True, HAS_B=True, HAS_DRES=False, LLAMA_CAST=False),
        "add_rms_norm": dict(IS_RMS=True, HAS_W=True, HAS_B=False, HAS_DRES=True, LLAMA_CAST=True),
        "rms_norm": dict(IS_RMS=True, HAS_W=True, HAS_B=False, HAS_DRES=False, LLAMA_CAST=True),
    }
    say("| op | shape | per SM, warps, rows/step, maxnreg | µs | regs | spills | % of best | tuned default |")
    say("|---|---|---|---:|---:|---:|---:|---|")
    for op, flags in ops.items():
        for rows, n in SHAPES:
            bn = pow2_at_least(n)
            x = torch.randn(rows, n, device="cuda", dtype=BF16)
            dy = torch.randn_like(x)
            dres = torch.randn_like(x)
            w = torch.randn(n, device="cuda", dtype=BF16)
            mean = torch.randn(rows, device="cuda", dtype=torch.float32)
            rstd = torch.rand(rows, device="cuda", dtype=torch.float32) + 0.5
            dx = torch.empty_like(x)
            # the tuner's choice through the public path
            K.norm_bwd(dy, x, w, flags["HAS_B"], None if flags["IS_RMS"] else mean, rstd,
                       dres if flags["HAS_DRES"] else None, n, 0.0, flags["IS_RMS"], flags["LLAMA_CAST"])
            chosen = [v for k, v in tuned_settings().items() if k[0] == "norm_bwd" and k[2][0] == n
                      and k[2][3] == row_bucket(rows)
                      and k[2][2] == (flags["IS_RMS"], True, flags["HAS_B"], flags["HAS_DRES"], flags["LLAMA_CAST"], False)]
            if n == 4096 or n == 2048:
                cands = [(2, 16 if n == 4096 else 8, 1, None), (2, 16, 1, 64), (2, 16, 1, 80), (1, 16, 1, None),
                         (2, 8, 1, None), (4, 8, 1, None), (3, 8, 1, None), (4, 8, 1, 64), (2, 8, 2, None),
                         (2, 16, 2, None), (2, 16, 2, 64), (4, 4, 1, None), (8, 4, 1, 64)]
            else:
                cands = [(2, 32, 1, None), (1, 32, 1, None), (2, 16, 1, None), (1, 16, 1, None),
                         (2, 16, 1, 128), (2, 16, 1, 64), (2, 32, 2, None), (2, 16, 2, None), (2, 16, 2, 128)]
            res = []
            for per_sm, warps, rps, mr in cands:
                rpp = cdiv(rows, min(rows, per_sm * n_sm))
                grid = cdiv(rows, rpp)
                nparts = flags["HAS_W"] + flags["HAS_B"]
                part = torch.empty((nparts, grid, n), dtype=torch.float32, device="cuda")
                db_off = (nparts - 1) * grid * n if flags["HAS_B"] else 0
                args = (dy, x, w, mean, rstd, dres, dx, dx, part, n, n, n, n, rows, n, rpp, db_off, 0.0)
                kw = dict(flags, HAS_DX2=False, ROWS=rps, BLOCK_N=bn, num_warps=warps)
                if mr:
                    kw["maxnreg"] = mr
                o0 = torch.empty(n, dtype=BF16, device="cuda")
                o1 = torch.empty(n, dtype=BF16, device="cuda")
                sb = K.sum_block_n(nparts * n, n_sm)
                ncb = cdiv(n, sb)

                def run():
                    _norm_bwd_fused[(grid,)](*args, **kw)
                    K._SUM(ncb * nparts, (part, o0, o1, grid, n, ncb), K._SUM_CONSTS[sb], 4)
                try:
                    k = _norm_bwd_fused[(grid,)](*args, **kw)
                    torch.cuda.synchronize()
                    us = 1e3 * do_bench_cudagraph(run, rep=60)
                    res.append(((per_sm, warps, rps, mr), us, *regs(k)))
                except Exception as exc:  # noqa: BLE001
                    res.append(((per_sm, warps, rps, mr), float("inf"), f"{type(exc).__name__}", str(exc)[:60]))
            best = min(r[1] for r in res)
            for c, us, rg, sp in res:
                say(f"| {op} | {rows}x{n} | {c} | {us:.1f} | {rg} | {sp} | {100 * us / best:.0f}% | "
                    f"{chosen} |")
            del x, dy, dres, dx
    say("")


# ----------------------------------------------------------------------------------------- part C

def llama_rms(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms(x, r, w):
    h = x + r
    return llama_rms(h, w), h


def part_c():
    from torch._inductor.utils import run_and_get_code

    say("## C. Forwards behind torch.compile: inductor's kernel vs ours per setting (graph replay, µs)")
    say("")
    for name, rows, n in (("rms_norm", 8192, 8192), ("rms_norm", 16384, 8192), ("add_rms_norm", 4096, 2048),
                          ("rms_norm", 16384, 4096)):
        x = torch.randn(rows, n, device="cuda", dtype=BF16)
        r = torch.randn_like(x)
        w = torch.randn(n, device="cuda", dtype=BF16)
        fn = torch.compile(llama_rms if name == "rms_norm" else add_rms, dynamic=False)
        ins = (x, w) if name == "rms_norm" else (x, r, w)
        _, codes = run_and_get_code(fn, *ins)
        path = os.path.join(OUT, f"inductor_{name}_{rows}x{n}.py")
        with open(path, "w") as f:
            f.write("\n\n# ----\n\n".join(codes))
        ours = (lambda: mk.rms_norm(x, w, 1e-6)) if name == "rms_norm" else (lambda: mk.add_rms_norm(x, r, w, 1e-6))
        ours()
        t_c = [1e3 * do_bench_cudagraph(lambda: fn(*ins), rep=100) for _ in range(3)]
        t_o = [1e3 * do_bench_cudagraph(ours, rep=100) for _ in range(3)]
        say(f"{name} {rows}x{n}: compile {', '.join(f'{t:.1f}' for t in t_c)}; ours (tuned) "
            f"{', '.join(f'{t:.1f}' for t in t_o)}; inductor code in {os.path.basename(path)}")
        bn = pow2_at_least(n)
        y = torch.empty_like(x)
        s = torch.empty_like(x)
        rstd = torch.empty(rows, device="cuda", dtype=torch.float32)
        res_ = name == "add_rms_norm"
        args = (x, r, w, w, y, s, rstd, rstd, n, n, n, n, rows, n, 1e-6, 0.0)
        row_opts = [1, 2, 4] if n <= 4096 else [1, 2]
        out = []
        for rws in row_opts:
            for wp in (4, 8, 16, 32):
                tile = rws * bn
                if not 2 <= tile // (32 * wp) <= 32:
                    continue
                kw = dict(IS_RMS=True, HAS_W=True, HAS_B=False, HAS_RES=res_, LLAMA_CAST=True, ROWS=rws,
                          BLOCK_N=bn, num_warps=wp)
                try:
                    k = _norm_fwd_fused[(cdiv(rows, rws),)](*args, **kw)
                    us = 1e3 * do_bench_cudagraph(lambda: _norm_fwd_fused[(cdiv(rows, rws),)](*args, **kw), rep=60)
                    out.append(f"{rws}r/{wp}w {us:.1f} ({regs(k)[0]} regs)")
                except Exception as exc:  # noqa: BLE001
                    out.append(f"{rws}r/{wp}w {type(exc).__name__}")
        say("  ours by setting: " + "; ".join(out))
    say("")


#: (rows, hidden) of parts B and D: the issue's norm shapes
SHAPES = [(4096, 2048), (8192, 4096), (16384, 4096), (8192, 8192), (16384, 8192)]
#: (is_rms, has_bias, has_residual, llama_cast) of each norm op, as the benchmark calls them
OP_FLAGS = {"rms_norm": (True, False, False, True), "layer_norm": (False, True, False, False),
            "add_rms_norm": (True, False, True, True)}


def part_d():
    say("## D. Every launcher candidate (bf16, graph replay µs; the tuner's pick marked *)")
    say("")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    summary = ["| op | shape | pass | default | best (setting) | tuner's pick | pick µs |", "|---|---|---|---:|---|---|---:|"]
    for op, (is_rms, has_b, has_res, llama) in OP_FLAGS.items():
        for rows, n in SHAPES:
            bn = pow2_at_least(n)
            x = torch.randn(rows, n, device="cuda", dtype=BF16)
            r = torch.randn_like(x)
            dy = torch.randn_like(x)
            w = torch.randn(n, device="cuda", dtype=BF16)
            b = torch.randn(n, device="cuda", dtype=BF16)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y, s_, mean, rstd = K.norm_fwd(x, w, b if has_b else None, r if has_res else None, n, 1e-6, 0.0, is_rms,
                                           llama)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            K.norm_bwd(dy, s_ if has_res else x, w, has_b, mean, rstd, dy if has_res else None, n, 0.0, is_rms, llama)
            torch.cuda.synchronize()
            say(f"{op} {rows}x{n}: first call (compile + tuning) fwd {t1 - t0:.2f} s, bwd {time.perf_counter() - t1:.2f} s")
            picks = {k[0]: v for k, v in tuned_settings().items() if k[2][0] == n and k[2][-1] == row_bucket(rows)
                     and ((k[0] == "norm_fwd" and k[2][3] == (is_rms, True, has_b, has_res, llama))
                          or (k[0] == "norm_bwd" and k[2][2] == (is_rms, True, has_b, has_res, llama, False)))}
            flags = dict(IS_RMS=is_rms, HAS_W=True, HAS_B=has_b, HAS_RES=has_res, LLAMA_CAST=llama)
            s2 = s_ if s_ is not None else y
            fargs = (x, r, w, b, y, s2, mean if mean is not None else rstd, rstd, n, n, n, n, rows, n, 1e-6, 0.0)
            res = {"fwd": [], "bwd": []}
            for c in K._fwd_candidates(bn):
                if c[2]:
                    fn = lambda c=c: K._FWD_LOOPED(rows, fargs, dict(flags, BLOCK_N=c[2]), c[1])  # noqa: E731
                else:
                    fn = lambda c=c: K._FWD(cdiv(rows, c[0]), fargs, dict(flags, ROWS=c[0], BLOCK_N=bn), c[1])  # noqa: E731
                try:
                    fn()
                    res["fwd"].append((c, 1e3 * do_bench_cudagraph(fn, rep=50)))
                except Exception as exc:  # noqa: BLE001
                    res["fwd"].append((c, float("inf")))
                    say(f"{op} {rows}x{n} fwd {c}: {type(exc).__name__}: {str(exc)[:100]}")
            xs = s_ if has_res else x
            dx = torch.empty_like(x)
            for c in K._bwd_candidates(bn):
                bargs = (dy, xs, w, mean if mean is not None else rstd, rstd, dy, dx, n, n, n, n, rows, True, has_b,
                         is_rms, has_res, llama, 0.0, BF16, False, n_sm, c)
                fn = lambda bargs=bargs: K._bwd_launch(*bargs)  # noqa: E731
                try:
                    fn()
                    res["bwd"].append((c, 1e3 * do_bench_cudagraph(fn, rep=50)))
                except Exception as exc:  # noqa: BLE001
                    res["bwd"].append((c, float("inf")))
                    say(f"{op} {rows}x{n} bwd {c}: {type(exc).__name__}: {str(exc)[:100]}")
            for p_ in ("fwd", "bwd"):
                lst = res[p_]
                best = min(lst, key=lambda t: t[1])
                pick = picks.get("norm_" + p_)
                pick_us = next((t for c, t in lst if c == pick), float("nan"))
                summary.append(f"| {op} | {rows}x{n} | {p_} | {lst[0][1]:.1f} | {best[1]:.1f} {best[0]} | {pick} | "
                               f"{pick_us:.1f} |")
                say(f"{op} {rows}x{n} {p_}: " + "; ".join(f"{c} {t:.1f}" for c, t in lst))
            del x, r, dy, y, s_, dx
            torch.cuda.empty_cache()
    say("")
    for line in summary:
        say(line)
    say("")


def part_e():
    say("## E. Looped forward settings, row width runtime (N_FIXED=0) or compile-time; graph replay µs")
    say("")
    cases = [("rms_norm", 16384, 8192), ("rms_norm", 8192, 8192), ("add_rms_norm", 4096, 2048),
             ("add_rms_norm", 16384, 4096), ("layer_norm", 16384, 8192), ("rms_norm", 16384, 4096)]
    for op, rows, n in cases:
        is_rms, has_b, has_res, llama = OP_FLAGS[op]
        x = torch.randn(rows, n, device="cuda", dtype=BF16)
        r = torch.randn_like(x)
        w = torch.randn(n, device="cuda", dtype=BF16)
        b = torch.randn(n, device="cuda", dtype=BF16)
        if op == "rms_norm":
            comp = torch.compile(llama_rms, dynamic=False)
            cin = (x, w)
        elif op == "add_rms_norm":
            comp = torch.compile(add_rms, dynamic=False)
            cin = (x, r, w)
        else:
            comp = torch.compile(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), dynamic=False)
            cin = (x, w, b)
        comp(*cin)
        t_c = 1e3 * do_bench_cudagraph(lambda: comp(*cin), rep=100)
        pub = lambda: K.norm_fwd(x, w, b if has_b else None, r if has_res else None, n, 1e-6, 0.0, is_rms, llama)  # noqa: E731
        pub()
        t_p = 1e3 * do_bench_cudagraph(pub, rep=100)
        y = torch.empty_like(x)
        s_ = torch.empty_like(x)
        mean = torch.empty(rows, device="cuda", dtype=torch.float32)
        rstd = torch.empty(rows, device="cuda", dtype=torch.float32)
        fargs = (x, r, w, b, y, s_, mean, rstd, n, n, n, n, rows, n, 1e-6, 0.0)
        flags = dict(IS_RMS=is_rms, HAS_W=True, HAS_B=has_b, HAS_RES=has_res, LLAMA_CAST=llama)
        out = []
        for chunk in (1024, 2048, 4096):
            if chunk > n:
                continue
            for wp in (4, 8, 16):
                if chunk // (32 * wp) < 2:
                    continue
                for fixed in (0, n):
                    fn = lambda: K._FWD_LOOPED(rows, fargs, dict(flags, BLOCK_N=chunk, N_FIXED=fixed), wp)  # noqa: E731
                    try:
                        fn()
                        out.append(f"{chunk}/{wp}w/{'c' if fixed else 'r'} {1e3 * do_bench_cudagraph(fn, rep=50):.1f}")
                    except Exception as exc:  # noqa: BLE001
                        out.append(f"{chunk}/{wp}w/{fixed} {type(exc).__name__}")
        say(f"{op} {rows}x{n}: compile {t_c:.1f}; ours tuned {t_p:.1f}; looped: " + "; ".join(out))
        del y, s_
        torch.cuda.empty_cache()
    say("")


def main():
    say(f"# explore run 5 — {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
    say("")
    which = sys.argv[1:] or ["A", "B", "C"]
    for part in [{"A": part_a, "B": part_b, "C": part_c, "D": part_d, "E": part_e}[p] for p in which]:
        try:
            part()
        except Exception:  # noqa: BLE001
            say("```\n" + traceback.format_exc() + "```")
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, f"explore_run5{''.join(which)}.md"), "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
