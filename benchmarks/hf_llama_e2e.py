"""End to end on a Hugging Face LlamaForCausalLM: eager, torch.compile, mfuwatch.kernels.patch and Liger-Kernel,
each configuration in its own process.

Run on a CUDA GPU from the repository root (project installed with
``pip install --no-deps --no-build-isolation -e .``; for the Liger rows its wheel,
``pip install --no-deps .whl/liger_kernel-*.whl``)::

    python3 benchmarks/hf_llama_e2e.py                       # 5 configurations x 2 vocabularies, ~6-8 min on an H200
    python3 benchmarks/hf_llama_e2e.py --vocab 32000 --configs eager,eager_patch --steps 20 --rounds 2
    OUT=/dir python3 benchmarks/hf_llama_e2e.py              # also writes $OUT/hf_llama_e2e.md and .json
    python3 benchmarks/hf_llama_e2e.py --tiny                # CPU, Triton interpreter, a tiny model: checks the script

The model is built from a config (no download): 8 layers, d=2048, 16 query / 4 KV heads, SwiGLU ff 5632,
vocabulary 32000 or 128256, SDPA attention; batch 4 x 2048 tokens under bf16 autocast, AdamW with
``fused=True``. Configurations:

=================  ==================================================================================
``eager``          the model as Hugging Face wrote it
``eager_patch``    ``mfuwatch.kernels.patch(model)`` (norms, SwiGLU, rotary, and whatever else it wires)
``eager_liger``    ``liger_kernel.transformers.apply_liger_kernel_to_llama`` (rope, RMSNorm, SwiGLU, fused
                   linear cross-entropy) before the model is built: it patches transformers' classes for the
                   whole process, which is why every configuration runs in a process of its own
``compile``        ``torch.compile(model)``
``compile_patch``  ``patch(model)``, then ``torch.compile``
``*_recompute``    the same with ``patch(model, lm_head_mode="recompute")`` (no logits in memory)
=================  ==================================================================================

``--model qwen3`` builds a ``Qwen3ForCausalLM`` of the same size instead (q/k RMSNorms, head_dim 128, tied
embeddings; ``apply_liger_kernel_to_qwen3`` for Liger).

Each child process seeds the same generator before building the model and drawing the batch, so every
configuration starts from the same weights and trains on the same tokens (the first loss is printed to show
it); it runs ``--warmup`` steps, then times ``--steps`` steps (``torch.cuda.synchronize`` around each) and
reports their median and min-max, and the peak memory allocated during the timed steps
(``torch.cuda.max_memory_allocated``, GiB). With ``--rounds`` > 1 the configurations run interleaved
round by round and the medians pool all timed steps. The parent prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hf_step import time_steps, train_step  # noqa: E402  (the step and timing shared with gain_truth)

CONFIGS = ("eager", "eager_patch", "eager_liger", "compile", "compile_patch", "eager_patch_recompute",
           "compile_patch_recompute")
MODELS = ("llama", "qwen3")

P = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
P.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round (default 10)")
P.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning; default 3)")
P.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all configurations (default 1)")
P.add_argument("--vocab", default="32000,128256", help="comma-separated vocabulary sizes (default 32000,128256)")
P.add_argument("--model", default="llama", choices=MODELS,
               help="llama (16/4 heads of 128) or qwen3 (q/k norms, head_dim 128, tied embeddings; "
                    "use --vocab 151936 for Qwen3's vocabulary)")
P.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
P.add_argument("--tiny", action="store_true", help="CPU, Triton interpreter, a 2-layer d=32 model (plumbing check)")
P.add_argument("--timeout", type=int, default=600, help="seconds allowed per child process (default 600)")
P.add_argument("--profile", action="store_true", help="also list each configuration's top 40 GPU kernels of one step")
P.add_argument("--memory-peak", action="store_true",
               help="also list what is alive at the forward's memory peak, by allocating line (allocator trace)")
P.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one configuration, print one JSON line


def parse_list(text: str, allowed=None, kind=str):
    items = [kind(x) for x in text.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise SystemExit(f"--configs: unknown {bad}; accepted: {','.join(allowed)}")
    return items


# ------------------------------------------------------------------ child: one configuration

def child(args) -> dict:
    config, vocab = args.child.split(":")
    vocab = int(vocab)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import transformers

    dev = "cpu" if args.tiny else "cuda"
    if config == "eager_liger":
        import liger_kernel.transformers as lt

        apply = lt.apply_liger_kernel_to_qwen3 if args.model == "qwen3" else lt.apply_liger_kernel_to_llama
        apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    if args.tiny:
        shape = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=64)
        batch, seq = 2, 16
    else:
        shape = dict(num_hidden_layers=8, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=5632)
        batch, seq = 4, 2048
    if args.model == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=True,
                                       head_dim=shape["hidden_size"] // shape["num_attention_heads"], **shape)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=seq, **shape)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = cls(cfg)
    model.train()
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen, device=dev)
    swapped = ""
    if "_patch" in config:
        import mfuwatch.kernels as mk

        report = mk.patch(model, lm_head_mode="recompute" if config.endswith("_recompute") else "chunked")
        swapped = ", ".join(f"{k} x{report.count(k)}" for k in dict.fromkeys(s.kernel for s in report.swapped))
    fwd = model
    if config.startswith("compile"):
        fwd = torch.compile(model, backend="aot_eager") if args.tiny else torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not args.tiny)
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=not args.tiny)

    step = train_step(fwd, ids, opt, autocast)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    first, warm_s, times = time_steps(step, sync, args.warmup, args.steps,
                                      after_warmup=torch.cuda.reset_peak_memory_stats if dev == "cuda" else None)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
    phases = {}
    if dev == "cuda":  # one more step, the peak of each phase apart: where the step's peak is
        sync()
        torch.cuda.reset_peak_memory_stats()
        with autocast:
            loss = fwd(input_ids=ids, labels=ids).loss
        sync()
        phases["forward"] = torch.cuda.max_memory_allocated() / 2**30
        phases["after_forward"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        sync()
        phases["backward"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        phases["optimizer"] = torch.cuda.max_memory_allocated() / 2**30
        del loss
    peak_rows = []
    if dev == "cuda" and args.memory_peak:  # one more forward with the allocator's history: what its peak holds
        from _memory_peak import peak_breakdown, record

        box = []

        def forward():
            with autocast:
                box.append(fwd(input_ids=ids, labels=ids).loss)

        base = torch.cuda.memory_allocated()
        above, rows = peak_breakdown(record(forward), top=14)
        box.clear()
        opt.zero_grad(set_to_none=True)
        peak_rows = [[above / 2**30, base / 2**30]] + [[b / 2**20, n, s] for b, n, s in rows]
    kernels = []
    if dev == "cuda" and args.profile:  # one more step under torch.profiler: the GPU kernels by device time
        from torch.profiler import ProfilerActivity, profile

        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        kernels = sorted(((e.key[:100], e.count, e.device_time_total / 1e3) for e in prof.key_averages()
                          if e.device_time_total > 0), key=lambda r: -r[2])
        kernels = [("total", 0, sum(r[2] for r in kernels))] + kernels[:40]
    return {"config": config, "vocab": vocab, "ms": times, "peak_gib": peak, "first_loss": first,
            "warmup_s": warm_s, "swapped": swapped, "phase_peaks_gib": phases, "kernels_ms": kernels,
            "forward_peak": peak_rows}


# ------------------------------------------------------------------ parent: spawn, collect, tabulate

def run_child(config: str, vocab: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{config}:{vocab}", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--model", args.model] + (["--tiny"] if args.tiny else [])
    cmd += (["--profile"] if args.profile else []) + (["--memory-peak"] if args.memory_peak else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"config": config, "vocab": vocab, "error": f"timed out after {args.timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            res["wall_s"] = time.perf_counter() - t0
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"config": config, "vocab": vocab, "error": f"exit {proc.returncode}: {tail[0][:300]}"}


def table(results, configs, vocabs, args) -> str:
    by = {}
    for r in results:
        by.setdefault((r["config"], r["vocab"]), []).append(r)
    head = "| configuration |" + "".join(f" V={v} ms/step (min-max) | peak GiB |" for v in vocabs)
    lines = [head, "|---|" + "---|---|" * len(vocabs)]
    for c in configs:
        row = f"| {c} |"
        for v in vocabs:
            runs = by.get((c, v), [])
            errs = [r["error"] for r in runs if "error" in r]
            ok = [r for r in runs if "error" not in r]
            if not ok:
                row += f" — ({errs[0] if errs else 'not run'}) | — |"
                continue
            ms = [t for r in ok for t in r["ms"]]
            peaks = [r["peak_gib"] for r in ok if r["peak_gib"] == r["peak_gib"]]  # nan (CPU) left out
            peak = "n/a" if not peaks else (f"{min(peaks):.1f}" if max(peaks) - min(peaks) < 0.05
                                            else f"{min(peaks):.1f}-{max(peaks):.1f}")
            row += f" {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | {peak} |"
        lines.append(row)
    phase_rows = sorted({f"V={r['vocab']} {r['config']}: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                      r["phase_peaks_gib"].items())
                         for r in results if r.get("phase_peaks_gib")})
    if phase_rows:
        lines += ["", "Peak GiB per phase of one more step (forward, allocated after it, backward, optimizer):", ""]
        lines += [f"- {p}" for p in phase_rows]
    for r in results:
        if r.get("kernels_ms"):
            lines += ["", f"GPU kernels of one step, V={r['vocab']} {r['config']} (ms, calls):", ""]
            lines += [f"    {ms:8.3f}  x{n:<4d} {k}" for k, n, ms in r["kernels_ms"]]
    for r in results:
        if r.get("forward_peak"):
            (above, base), rows = r["forward_peak"][0], r["forward_peak"][1:]
            lines += ["", f"Alive at the forward's peak, V={r['vocab']} {r['config']}: {base:.2f} GiB before the forward "
                      f"+ {above:.2f} GiB (MiB, blocks, allocating line):", ""]
            lines += [f"    {mib:9.1f}  x{n:<5d} {where}" for mib, n, where in rows]
    notes = sorted({f"{r['config']}: {r['swapped']}" for r in results if r.get("swapped")})
    losses = sorted({f"V={r['vocab']} {r['config']}: {r['first_loss']:.4f}" for r in results if "first_loss" in r})
    return "\n".join(lines + ["", "Swapped by patch: " + ("; ".join(notes) or "n/a"),
                              "First-step losses (same weights and batch): " + "; ".join(losses)])


def main() -> int:
    args = P.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    configs = parse_list(args.configs, CONFIGS)
    vocabs = parse_list(args.vocab, kind=int)
    if args.tiny and args.vocab == P.get_default("vocab"):
        vocabs = [256]
    results = []
    for rnd in range(args.rounds):
        for v in vocabs:
            for c in configs:
                r = run_child(c, v, args)
                results.append(r)
                status = r.get("error") or (f"median {statistics.median(r['ms']):.1f} ms, peak {r['peak_gib']:.1f} GiB, "
                                            f"first loss {r['first_loss']:.4f}, {r['wall_s']:.0f} s")
                print(f"round {rnd + 1} V={v} {c}: {status}", flush=True)
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu (interpreter)"
    text = (f"# Hugging Face {dict(llama='Llama', qwen3='Qwen3')[args.model]} end to end ({dev}, torch {torch.__version__})\n\n"
            f"{'tiny 2-layer d=32, batch 2 x 16, fp32' if args.tiny else '8 layers, d=2048, 16/4 heads, ff 5632, batch 4 x 2048, bf16 autocast, fused AdamW'}; "
            f"{args.steps} timed steps after {args.warmup} warm-up, {args.rounds} round(s), each configuration "
            f"in its own process.\n\n" + table(results, configs, vocabs, args))
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "hf_llama_e2e.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "hf_llama_e2e.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r and r["config"] != "eager_liger" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
