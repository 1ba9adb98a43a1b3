"""Cross-entropy and linear + cross-entropy of mfuwatch.kernels against eager PyTorch, torch.compile and Liger-Kernel.

Run on a CUDA GPU from the repository root, with the project installed and, for the Liger rows,
Liger-Kernel's wheel (``pip install --no-deps .whl/liger_kernel-*.whl``)::

    python3 benchmarks/cross_entropy.py            # the issue-17 shapes, about 2 minutes on an H200
    OUT=/dir python3 benchmarks/cross_entropy.py   # also writes $OUT/cross_entropy.md
    python3 benchmarks/cross_entropy.py --smoke    # CPU, Triton interpreter, tiny shapes: checks the script only

It (1) measures device-copy bandwidth (``dst.copy_(src)``, 1 GiB, bytes read + written, median of
CUDA-event timings); (2) checks both ops at full size against PyTorch on fp32 logits formed from the
same bf16 inputs (relative L2 error of the loss and every gradient), plus a softcapped z-loss case at
the 262144-class vocabulary; (3) times cross-entropy forward+backward at 8192 x 128256 bf16 for every
provider (``triton.testing.do_bench``, median) and reports it against the floor of 4 bytes per logit
(read the logits once, write the gradient once) at the measured bandwidth; (4) times linear +
cross-entropy forward+backward at 8192 x 4096 x 128256 bf16 and reports its peak memory above the
inputs and their gradients (``torch.cuda.max_memory_allocated``). Liger's cross-entropy writes its
gradient into the logits in place; ours and the others do not. Each provider runs in this one process:
none of them patches anything globally (Liger is used through its loss modules, not its patch).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

P = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
P.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes (plumbing check)")
ARGS = P.parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mfuwatch.kernels as mk  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
BF16 = torch.bfloat16
N, H, V, V_BIG = (64, 32, 1000, 4099) if ARGS.smoke else (8192, 4096, 128256, 262144)
GIB = 2 ** 30
ROWS = []  # (section, provider, ms, extra) for the table


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench(fn, grad_to_none=()):
    """Median milliseconds of ``fn`` (triton's do_bench on the GPU; one timed call in the smoke run)."""
    if ARGS.smoke:
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=list(grad_to_none), return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    if ARGS.smoke:
        return 1e10
    src = torch.empty(GIB // 2, dtype=BF16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3)


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- providers

def liger():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss

        return LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001 - not installed, or fails to import here: its rows say so
        print(f"Liger-Kernel unavailable: {type(exc).__name__}: {exc}")
        return None, None


def eager_ce(x, t):
    return F.cross_entropy(x.float(), t)


def eager_lce(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def ce_providers():
    out = {"mfuwatch": lambda x, t: mk.cross_entropy(x, t), "eager": eager_ce}
    if not ARGS.smoke:
        out["torch.compile"] = torch.compile(eager_ce)
        cls, _ = liger()
        if cls is not None:
            m = cls()
            out["Liger"] = lambda x, t: m(x, t)
    return out


def lce_bf16_accumulation(h, w, t):
    """Ours with dW accumulated over the chunks in bf16 (ACCUMULATE_FP32 off)."""
    import importlib

    mod = importlib.import_module("mfuwatch.kernels.linear_cross_entropy")

    mod.ACCUMULATE_FP32 = False
    try:
        return mk.linear_cross_entropy(h, w, t)
    finally:
        mod.ACCUMULATE_FP32 = True


def lce_providers():
    out = {"mfuwatch": lambda h, w, t: mk.linear_cross_entropy(h, w, t),
           "mfuwatch, dW accumulated in bf16": lce_bf16_accumulation, "eager": eager_lce}
    if not ARGS.smoke:
        out["torch.compile"] = torch.compile(eager_lce)
        _, cls = liger()
        if cls is not None:
            m = cls()
            out["Liger"] = lambda h, w, t: m(w, h, t)
    return out


# ---------------------------------------------------------------- checks

def check() -> bool:
    ok = True
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(N, V, device=DEV, generator=g) * 2).to(BF16).requires_grad_()
    t = torch.randint(0, V, (N,), device=DEV, generator=g)
    t[::7] = -100
    loss = mk.cross_entropy(x, t)
    (gx,) = torch.autograd.grad(loss, x)
    xr = x.detach().float().requires_grad_()
    lr = F.cross_entropy(xr, t)
    (gr,) = torch.autograd.grad(lr, xr)
    errs = {"ce loss": rel(loss, lr), "ce dlogits": rel(gx, gr)}
    # softcap + z-loss + smoothing at the largest vocabulary, fewer rows
    n2 = max(N // 8, 4)
    x2 = (torch.randn(n2, V_BIG, device=DEV, generator=g) * 8).to(BF16).requires_grad_()
    t2 = torch.randint(0, V_BIG, (n2,), device=DEV, generator=g)
    loss2 = mk.cross_entropy(x2, t2, softcap=30.0, z_loss=1e-4, label_smoothing=0.1)
    (g2,) = torch.autograd.grad(loss2, x2)
    xr2 = x2.detach().float().requires_grad_()
    z = 30.0 * torch.tanh(xr2 / 30.0)
    lr2 = F.cross_entropy(z, t2, label_smoothing=0.1) + 1e-4 * (torch.logsumexp(z, -1) ** 2).mean()
    (gr2,) = torch.autograd.grad(lr2, xr2)
    errs.update({"ce softcap+z V=262144 loss": rel(loss2, lr2), "ce softcap+z V=262144 dlogits": rel(g2, gr2)})
    del x2, xr2, z, g2, gr2
    h = torch.randn(N, H, device=DEV, generator=g).to(BF16).requires_grad_()
    w = (torch.randn(V, H, device=DEV, generator=g) / math.sqrt(H)).to(BF16).requires_grad_()
    loss3 = mk.linear_cross_entropy(h, w, t)
    gh, gw = torch.autograd.grad(loss3, (h, w))
    hr, wr = h.detach().requires_grad_(), w.detach().requires_grad_()
    lr3 = F.cross_entropy((hr @ wr.t()).float(), t)
    ghr, gwr = torch.autograd.grad(lr3, (hr, wr))
    errs.update({"lce loss": rel(loss3, lr3), "lce dhidden": rel(gh, ghr), "lce dweight": rel(gw, gwr)})
    (gw16,) = torch.autograd.grad(lce_bf16_accumulation(h, w, t), (w,))
    errs["lce dweight, bf16 accumulation"] = rel(gw16, gwr)
    print("\ncorrectness (relative L2 error against PyTorch on fp32 logits from the same bf16 inputs):")
    for k, e in errs.items():
        good = math.isfinite(e) and e < 2e-2
        ok &= good
        print(f"  {k:34s} {e:.2e} {'ok' if good else 'FAIL'}")
    return ok


# ---------------------------------------------------------------- timings

def time_ce(bw: float) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    t = torch.randint(0, V, (N,), device=DEV, generator=g)
    floor_ms = 4 * N * V / bw * 1e3
    for name, f in ce_providers().items():
        x = (torch.randn(N, V, device=DEV, generator=g)).to(BF16).requires_grad_()
        try:
            ms = bench(lambda: f(x, t).backward(), grad_to_none=[x])
            ROWS.append(("ce", name, ms, f"{floor_ms / ms:.2f}"))
        except Exception as exc:  # noqa: BLE001 - one failing provider must not hide the others
            ROWS.append(("ce", name, float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
        del x
        sync()
    ROWS.append(("ce", "floor (4 B/logit at copy bandwidth)", floor_ms, "1.00"))


def time_lce() -> None:
    g = torch.Generator(device=DEV).manual_seed(2)
    t = torch.randint(0, V, (N,), device=DEV, generator=g)
    h = torch.randn(N, H, device=DEV, generator=g).to(BF16).requires_grad_()
    w = (torch.randn(V, H, device=DEV, generator=g) / math.sqrt(H)).to(BF16).requires_grad_()
    grads_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    for name, f in lce_providers().items():
        try:
            def step():
                f(h, w, t).backward()

            ms = bench(step, grad_to_none=[h, w])
            extra = float("nan")
            if DEV == "cuda":
                h.grad = w.grad = None
                sync()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                sync()
                extra = (torch.cuda.max_memory_allocated() - base - grads_bytes) / GIB
            h.grad = w.grad = None
            ROWS.append(("lce", name, ms, f"{extra:.2f}"))
        except Exception as exc:  # noqa: BLE001 - one failing provider must not hide the others
            h.grad = w.grad = None
            ROWS.append(("lce", name, float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
        sync()
    gemm_ms = float("nan")
    if DEV == "cuda":
        a, b = h.detach(), w.detach()
        gemm_ms = bench(lambda: a @ b.t())
    ROWS.append(("lce", "3 x the logits GEMM alone", 3 * gemm_ms, ""))


def table(bw: float) -> str:
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s (1 GiB dst.copy_(src), read + write); torch {torch.__version__}",
             "", f"Cross-entropy forward+backward, {N} x {V} bf16 logits (mean over targets):", "",
             "| provider | ms | floor / time |", "|---|---|---|"]
    lines += [f"| {p} | {ms:.3f} | {x} |" for s, p, ms, x in ROWS if s == "ce"]
    lines += ["", f"Linear + cross-entropy forward+backward, hidden {N} x {H}, weight {V} x {H} bf16:", "",
              "| provider | ms | peak GiB above inputs + grads |", "|---|---|---|"]
    lines += [f"| {p} | {ms:.2f} | {x} |" for s, p, ms, x in ROWS if s == "lce"]
    ours = {s: ms for s, p, ms, _ in ROWS if p == "mfuwatch"}
    comp = {s: ms for s, p, ms, _ in ROWS if p == "torch.compile"}
    mem = next((x for s, p, _, x in ROWS if s == "lce" and p == "mfuwatch"), "nan")
    lines += ["", "Goals (issue 17):",
              f"- CE fwd+bwd <= 1.5 ms: {ours.get('ce', float('nan')):.3f} ms",
              f"- linear CE no slower than torch.compile: {ours.get('lce', float('nan')):.2f} ms vs "
              f"{comp.get('lce', float('nan')):.2f} ms; <= 1.6 GiB extra: {mem} GiB"]
    return "\n".join(lines)


def main() -> int:
    if DEV == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --smoke for a CPU plumbing check)")
        return 2
    print(f"device: {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu (interpreter)'}")
    bw = copy_bandwidth()
    ok = check()
    time_ce(bw)
    time_lce()
    from mfuwatch.kernels._common import tuned_settings

    text = table(bw) + "\n\nlaunch settings chosen (kernel, device, key) -> (BLOCK, num_warps): " + "; ".join(
        f"{k[0]} {k[2]} -> {v}" for k, v in tuned_settings().items() if k[0].startswith("ce_"))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cross_entropy.md"), "w") as fh:
            fh.write(text + "\n")
    print()
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
