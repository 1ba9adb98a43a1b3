"""``watch()`` on a Hugging Face Llama run eagerly and through ``torch.compile`` wrappers: the same records.

Each configuration runs in its own process (``--config NAME`` is the child; without it the parent runs every
configuration and prints a table). The model is built from a config (no download): LlamaForCausalLM,
``--layers`` layers, d = ``--dim``, bf16 autocast, batch ``--batch`` x ``--seq``, AdamW (fused on CUDA).
Configurations: ``eager``; ``compile_before`` (``torch.compile(model)`` made before ``watch()``);
``compile_after`` (made after step 3); ``fullgraph_before`` (``fullgraph=True``; HF Llama may not compile
whole: then the child reports the compile error, which the agent must not have caused: ``--no-agent``
reruns it without the agent). Printed per configuration: tokens per step, model FLOPs per step and
``flops_source`` of the last report, MFU, the median step time, and whether the agent's log said it moved
its hooks to the wrapper.

Run: ``python benchmarks/compiled_wrapper.py --device cuda`` (CPU: ``--device cpu --layers 2 --dim 128
--seq 64``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = ("eager", "compile_before", "compile_after", "fullgraph_before")


def child(a) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import mfuwatch.agent as A

    logs = []

    class Grab(logging.Handler):
        def emit(self, rec):
            logs.append(rec.getMessage())

    logging.getLogger("mfuwatch").addHandler(Grab())
    logging.getLogger("mfuwatch").setLevel(logging.INFO)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=a.dim, intermediate_size=a.dim * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=max(1, a.dim // 128),
                      num_key_value_heads=max(1, a.dim // 512), max_position_embeddings=a.seq)
    model = LlamaForCausalLM(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    ids = torch.randint(0, 32000, (a.batch, a.seq), device=dev)
    run = model
    full = a.config == "fullgraph_before"
    if a.config in ("compile_before", "fullgraph_before"):
        run = torch.compile(model, fullgraph=full)
    tl = os.path.join(tempfile.mkdtemp(), "tl.jsonl")
    agent = None
    if not a.no_agent:
        agent = A.watch(model, opt, report_every_steps=a.steps // 3, exporter=False, nvml=False,
                        profile_every="off", alerts=False, timeline=tl)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)
    times, err = [], None
    try:
        for i in range(a.steps):
            if a.config == "compile_after" and i == 3:
                run = torch.compile(model)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with autocast:
                loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the parent prints it
        err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        if agent is not None:
            agent.close()
    reports = []
    if os.path.exists(tl):
        reports = [r for r in map(json.loads, open(tl).read().splitlines()) if "model_flops" in r]
    last = reports[-1] if reports else {}
    steps = last.get("steps") or (a.steps // 3)
    return {"config": a.config, "error": err, "reports": len(reports),
            "tokens_per_step": (last.get("tokens") or 0) / max(1, steps) if last else None,
            "model_flops_per_step": (last.get("model_flops") or 0) if last else None,
            "flops_source": last.get("flops_source"), "mfu": last.get("mfu"),
            "step_ms": statistics.median(times[-10:]) if len(times) >= 10 else None,
            "moved_to_wrapper": any("now run around the torch.compile wrapper" in m for m in logs),
            "torch": torch.__version__}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--config", choices=CONFIGS)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--no-agent", action="store_true")
    p.add_argument("--timeout", type=int, default=240)
    a = p.parse_args()
    if a.config:
        print("RESULT " + json.dumps(child(a)))
        return 0
    rows = []
    base = [sys.executable, __file__, "--device", a.device, "--layers", str(a.layers), "--dim", str(a.dim),
            "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]
    for name in a.configs.split(","):
        for no_agent in ((False, True) if name == "fullgraph_before" else (False,)):
            cmd = base + ["--config", name] + (["--no-agent"] if no_agent else [])
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout).stdout
                line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
                r = json.loads(line[7:]) if line else {"config": name, "error": "no result"}
            except subprocess.TimeoutExpired:
                r = {"config": name, "error": f"timeout {a.timeout} s"}
            r["agent"] = not no_agent
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("\n| config | agent | tokens/step | model FLOPs/step | flops_source | MFU | step ms | hooks moved | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = r.get("mfu")
        print(f"| {r['config']} | {r.get('agent')} | {r.get('tokens_per_step')} | {r.get('model_flops_per_step')} | "
              f"{r.get('flops_source')} | {'' if mfu is None else f'{mfu:.4f}'} | "
              f"{'' if r.get('step_ms') is None else round(r['step_ms'], 2)} | {r.get('moved_to_wrapper')} | "
              f"{r.get('error') or ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
