"""Rotary embedding forward + backward: mfuwatch.kernels.apply_rotary against Hugging Face's eager
``apply_rotary_pos_emb``, its ``torch.compile``, Liger-Kernel's rope, and the byte floor.

Run on a CUDA GPU from the repository root (project installed with
``pip install --no-deps --no-build-isolation -e .``; for the Liger column its wheel,
``pip install --no-deps .whl/liger_kernel-*.whl``)::

    python3 benchmarks/rotary.py               # Llama-3-8B shapes, about a minute on an H200
    OUT=/dir python3 benchmarks/rotary.py      # also writes $OUT/rotary.md and $OUT/rotary.json
    python3 benchmarks/rotary.py --smoke       # CPU, Triton interpreter, tiny shapes: checks the script only

Shapes (Llama-3-8B): 16384 tokens as batch 4 x 4096, 32 query and 8 KV heads, head_dim 128, bf16;
q and k as the attention module makes them (``(B, T, H, D)`` projections viewed as ``(B, H, T, D)``),
cos/sin ``(1, T, 128)`` as its rotary module returns them. The upstream gradients are laid out as the outputs
(``--grad-layout out``, how SDPA's backward returns the gradients of q_embed and k_embed) or contiguous. Each provider is checked against float32
math of the same inputs (forward and both gradients), then timed forward + backward
(``triton.testing.do_bench``, median; ``--repeats`` interleaved rounds, the median reported). The floor is
the bytes a fused rotary must move, forward and backward (read q, k and write q_embed, k_embed; read the
two gradients and write dq, dk; cos and sin once each way), at the device-copy bandwidth (1 GiB
``copy_``, read + write). Goal (issue 17): mfuwatch within 1.3x of that floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

P = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
P.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes (plumbing check)")
P.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds per provider (default 3)")
P.add_argument("--batch", type=int, default=4)
P.add_argument("--seq", type=int, default=4096)
P.add_argument("--sweep", action="store_true", help="also time mfuwatch's kernel per tile size and warp count")
P.add_argument("--profile", action="store_true", help="also list each provider's GPU kernels (torch.profiler)")
P.add_argument("--grad-layout", choices=("out", "contiguous"), default="out",
               help="layout of the upstream gradients: 'out' (default) as the outputs q_embed/k_embed are laid out, "
                    "which is how SDPA's backward returns them; 'contiguous' (B, H, T, D) contiguous")
ARGS = P.parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import mfuwatch.kernels as mk  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
DT = torch.float32 if ARGS.smoke else torch.bfloat16
B, T, HQ, HK, D = (1, 8, 4, 2, 16) if ARGS.smoke else (ARGS.batch, ARGS.seq, 32, 8, 128)
GOAL = 1.3


def rotate_half(x):
    """Hugging Face's rotate_half, written out here for when transformers is missing."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_rotary():
    """Hugging Face Llama's apply_rotary_pos_emb (the eager baseline), or the same math written out."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        return apply_rotary_pos_emb
    except Exception:  # noqa: BLE001 - no transformers: the same formula
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return apply_rotary_pos_emb


def providers():
    hf = hf_rotary()
    out = {"mfuwatch": lambda q, k, c, s: mk.apply_rotary(q, k, c, s), "eager": hf}
    if not ARGS.smoke:
        out["compile"] = torch.compile(hf)
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        if not ARGS.smoke:
            out["liger"] = liger_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001 - Liger not installed: its column is n/a
        print(f"liger_kernel unavailable: {type(exc).__name__}: {exc}", flush=True)
    return out


def inputs(gen):
    q_proj = torch.randn(B, T, HQ, D, generator=gen, device=DEV).to(DT).requires_grad_()
    k_proj = torch.randn(B, T, HK, D, generator=gen, device=DEV).to(DT).requires_grad_()
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV, dtype=torch.float32) / D))  # Llama-3 theta
    f = torch.arange(T, device=DEV, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((f, f), dim=-1)[None]
    if ARGS.grad_layout == "out":  # (B, T, H, D) memory viewed as (B, H, T, D), like q_embed and k_embed
        gq = torch.randn(B, T, HQ, D, generator=gen, device=DEV).to(DT).transpose(1, 2)
        gk = torch.randn(B, T, HK, D, generator=gen, device=DEV).to(DT).transpose(1, 2)
    else:
        gq = torch.randn(B, HQ, T, D, generator=gen, device=DEV).to(DT)
        gk = torch.randn(B, HK, T, D, generator=gen, device=DEV).to(DT)
    return q_proj, k_proj, emb.cos().to(DT), emb.sin().to(DT), gq, gk


def fwd_bwd(fn, q_proj, k_proj, cos, sin, gq, gk):
    qe, ke = fn(q_proj.transpose(1, 2), k_proj.transpose(1, 2), cos, sin)  # (B, H, T, D) views
    torch.autograd.backward([qe, ke], [gq, gk])
    return qe, ke


def check(name, fn, ins, failures):
    q_proj, k_proj, cos, sin, gq, gk = ins
    ref = [t.detach().float().requires_grad_() for t in (q_proj, k_proj)]
    rq, rk = hf_rotary()(ref[0].transpose(1, 2), ref[1].transpose(1, 2), cos.float(), sin.float())
    torch.autograd.backward([rq, rk], [gq.float(), gk.float()])
    for t in (q_proj, k_proj):
        t.grad = None
    qe, ke = fwd_bwd(fn, *ins)
    for what, a, r in (("q_embed", qe, rq), ("k_embed", ke, rk), ("dq", q_proj.grad, ref[0].grad),
                       ("dk", k_proj.grad, ref[1].grad)):
        a, r = a.detach().float(), r.detach().float()
        err = float((a - r).abs().max()) / (1.0 + float(r.abs().max()))
        if not err <= (1e-5 if DT == torch.float32 else 1.6e-2):
            failures.append(f"{name} {what}: relative error {err:.2e}")


def bench(fn, leaves):
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, grad_to_none=leaves, return_mode="median")


def device_ms(fn, leaves):
    """GPU milliseconds per call with the host's launch gaps taken out (calls queued behind a GPU wait, then
    back to back: mfuwatch.kernels._tuning.gpu_ms), gradients reset to None before each call."""
    if DEV == "cpu":
        return float("nan")
    from mfuwatch.kernels._tuning import gpu_ms

    def call():
        for t in leaves:
            t.grad = None
        fn()

    return gpu_ms(call, target_ms=20.0)


def host_ms(fn, leaves, n=50):
    """Host milliseconds to enqueue one call (the GPU kept busy behind a long wait, so nothing blocks)."""
    if DEV == "cpu":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU wait: the calls below only enqueue
    t0 = time.perf_counter()
    for _ in range(n):
        for t in leaves:
            t.grad = None
        fn()
    dt = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return dt


def sweep(ins, floor_ms):
    """mfuwatch's kernel per (tile elements, warps): device time of forward + backward."""
    import mfuwatch.kernels._rotary_triton as R

    lines = ["", "mfuwatch kernel sweep (device ms of forward + backward, host gaps taken out):", "",
             "| tile | warps | device ms | x floor |", "|---|---|---|---|"]
    keep = (R._TILE, R._WARPS)
    for tile in (512, 1024, 2048, 4096, 8192):
        for warps in (1, 2, 4, 8, 16):
            R._TILE, R._WARPS = tile, warps
            try:
                ms = device_ms(lambda: fwd_bwd(lambda q, k, c, s: mk.apply_rotary(q, k, c, s), *ins), ins[:2])
                lines.append(f"| {tile} | {warps} | {ms:.3f} | {ms / floor_ms:.2f} |")
            except Exception as exc:  # noqa: BLE001
                lines.append(f"| {tile} | {warps} | {type(exc).__name__} | |")
    R._TILE, R._WARPS = keep
    return lines


def profile(provs, ins):
    """Each provider's GPU kernels over 5 forward + backward calls: name, calls and device microseconds per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    lines = ["", "GPU kernels per forward + backward (torch.profiler, 5 calls):", ""]
    for name, fn in provs.items():
        fwd_bwd(fn, *ins)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                for t in ins[:2]:
                    t.grad = None
                fwd_bwd(fn, *ins)
            torch.cuda.synchronize()
        rows = [(e.key, e.count / 5, e.device_time_total / 5) for e in p.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[2])
        lines += [f"{name}: total {sum(r[2] for r in rows):.1f} us"]
        lines += [f"  {us:8.1f} us  x{n:g}  {k[:110]}" for k, n, us in rows[:8]]
    return lines


def copy_bandwidth():
    if DEV == "cpu":
        return float("nan")
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = statistics.median(bench(lambda: dst.copy_(src), None) for _ in range(3))
    return 2 * src.numel() * 2 / (ms * 1e-3)


def floor_bytes():
    """Minimal bytes of forward + backward: q, k read and written each way, cos/sin (1, T, D) read each way."""
    e = DT.itemsize if hasattr(DT, "itemsize") else torch.finfo(DT).bits // 8
    heads = B * (HQ + HK) * T * D
    return 2 * (2 * heads * e + 2 * T * D * e)


def main() -> int:
    gen = torch.Generator(device=DEV).manual_seed(0)
    ins = inputs(gen)
    provs = providers()
    failures = []
    for name, fn in provs.items():
        try:
            check(name, fn, ins, failures)
        except Exception as exc:  # noqa: BLE001 - a provider that fails is reported, the others still run
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    bw = copy_bandwidth()
    nbytes = floor_bytes()
    floor_ms = nbytes / bw * 1e3
    times = {n: [] for n in provs}
    dev_times = {n: [] for n in provs}
    hosts = {}
    for _ in range(ARGS.repeats):
        for name, fn in provs.items():
            try:
                times[name].append(bench(lambda fn=fn: fwd_bwd(fn, *ins), [ins[0], ins[1]]))
                dev_times[name].append(device_ms(lambda fn=fn: fwd_bwd(fn, *ins), [ins[0], ins[1]]))
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{name} timing: {type(exc).__name__}: {exc}")
    for name, fn in provs.items():
        try:
            hosts[name] = host_ms(lambda fn=fn: fwd_bwd(fn, *ins), [ins[0], ins[1]])
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name} host timing: {type(exc).__name__}: {exc}")
    dev_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    lines = [f"# Rotary embedding, forward + backward ({dev_name}, torch {torch.__version__})", "",
             f"q ({B}, {HQ}, {T}, {D}), k ({B}, {HK}, {T}, {D}) transposed projections, cos/sin (1, {T}, {D}), "
             f"{str(DT).replace('torch.', '')}; upstream gradients laid out {ARGS.grad_layout!r}; device-copy bandwidth {bw / 1e12:.2f} TB/s; byte floor "
             f"{nbytes / 2**20:.0f} MiB = {floor_ms:.3f} ms.", "",
             "| provider | do_bench ms (median) | rounds min-max | x floor | device ms (median) | x floor "
             "| host ms per call |", "|---|---|---|---|---|---|---|"]
    result = {}
    for name, ts in times.items():
        if not ts:
            lines.append(f"| {name} | n/a | | | | | |")
            continue
        med = statistics.median(ts)
        dv = statistics.median(dev_times[name]) if dev_times[name] else float("nan")
        result[name] = {"ms": med, "min": min(ts), "max": max(ts), "x_floor": med / floor_ms,
                        "device_ms": dv, "device_x_floor": dv / floor_ms, "host_ms": hosts.get(name, float("nan"))}
        lines.append(f"| {name} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} | {med / floor_ms:.2f} | {dv:.3f} | "
                     f"{dv / floor_ms:.2f} | {hosts.get(name, float('nan')):.3f} |")
    lines += ["", "do_bench: triton.testing.do_bench (L2 cleared before each call, host enqueue time included when "
              "the GPU finishes first); device: calls queued behind a GPU wait and run back to back "
              "(kernels._tuning.gpu_ms), as in a training step where the host runs ahead; host: time to enqueue "
              "one forward + backward."]
    if "mfuwatch" in result and DEV == "cuda":
        x = result["mfuwatch"]["device_x_floor"]
        x2 = result["mfuwatch"]["x_floor"]
        lines += ["", f"Goal: mfuwatch within {GOAL}x of the floor: device time {x:.2f}x, "
                  f"{'met' if x <= GOAL else 'MISSED'}; do_bench time {x2:.2f}x, {'met' if x2 <= GOAL else 'MISSED'}."]
    if ARGS.sweep and DEV == "cuda":
        lines += sweep(ins, floor_ms)
    if ARGS.profile and DEV == "cuda":
        lines += profile(provs, ins)
    if failures:
        lines += ["", "Failures:"] + [f"- {f}" for f in failures]
    text = "\n".join(lines)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "rotary.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "rotary.json"), "w") as f:
            json.dump({"device": dev_name, "copy_bandwidth_bytes_per_second": bw, "floor_bytes": nbytes,
                       "floor_ms": floor_ms, "providers": result, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
