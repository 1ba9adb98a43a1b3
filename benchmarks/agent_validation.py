"""GPU validation of the agent core (issue 2): MFU accuracy, agent overhead, FLOP-counter path, GPM cross-check.

Run on a CUDA machine (the project installed with ``pip install --no-deps --no-build-isolation -e .``):

    python3 benchmarks/agent_validation.py [--quick]

1. MFU reported by the agent for a Llama-style ~270 M-parameter bf16 model (d=2048, 4 layers, V=32000) against MFU computed
   independently: analytic FLOPs (6 N + 12 L d T per token, PaLM appendix B) over synchronized wall time.
2. Agent overhead: step time with and without the agent (NVML at 1 Hz, exporter on, profiler off),
   paired blocks interleaved in one run, at three batch sizes (step times ~20-200 ms).
3. The FlopCounterMode path (no model shape given) against the analytic count, and HFU under
   activation checkpointing (expected HFU/MFU ~ 4/3).
4. NVML GPM tensor-active ratio beside MFU (hardware cross-check).

Prints markdown tables and writes them to $OUT/agent_validation.md when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mfuwatch.agent import Agent
from mfuwatch.agent.flops.model import analytic_flops_per_token, count_matmul_params
from mfuwatch.agent.llama import LlamaLM, LlamaShape

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, NVIDIA H200 datasheet


def make(B, T, ckpt=False, L=24, d=1024, ff=2816):
    torch.manual_seed(0)
    m = LlamaLM(LlamaShape(vocab=32000, d_model=d, n_layers=L, n_heads=16, d_ff=ff), checkpoint=ckpt).cuda()
    m.V, m.L, m.d = 32000, L, d
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, m.V, (B, T), device="cuda")
    tgt = torch.randint(0, m.V, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(idx).float().view(-1, m.V), tgt.view(-1))  # loss outside the model's forward
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return m, opt, step


def timed(step, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def out(lines, name):
    text = "\n".join(lines)
    print(text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "a") as f:
            f.write(text + "\n\n")


def mfu_accuracy(T, batches, seconds):
    lines = ["## 1. Agent MFU vs independent MFU (analytic FLOPs / synchronized wall time, peak 989.4 TFLOP/s)", "",
             "Same steps for both: the agent reports one interval covering every timed step "
             "(report_every_steps = steps); the independent MFU divides the analytic FLOPs by the wall time "
             "between two synchronizations around those steps. GPM ratios are NVML's last 1 s sample, read while "
             "the steps still run.", "",
             "| model | batch x seq | steps | step time (ms) | independent MFU | agent MFU | rel. diff | GPM tensor active | GPM DRAM | GPM SM |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for B in batches:
        m, opt, step = make(B, T, L=4, d=2048, ff=5632)
        for _ in range(3):
            step()
        per_step = timed(step, 3)
        steps = max(10, int(seconds / per_step))
        n = count_matmul_params(m)
        flops = analytic_flops_per_token(n, m.L, m.d, T) * B * T
        agent = Agent(m, opt, run="validate", port=0, nvml_interval_seconds=1.0, profile_every="off",
                      alerts=False, model_shape={"n_layers": m.L, "d_model": m.d}, report_every_steps=steps)
        gpu = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step()
            if i == steps - 3 and agent.nvml is not None:
                gpu = agent.nvml.latest  # sampled while the GPU is busy
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
        agent.close()
        mm = agent.latest
        indep = flops / wall / PEAK_BF16
        f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {n / 1e6:.0f} M matmul params, L={m.L} d={m.d} | {B}x{T} | {mm.steps if mm else 0} | "
                     f"{wall * 1e3:.2f} | {indep:.4f} | {f(mm.mfu if mm else None)} | "
                     f"{(mm.mfu / indep - 1) * 100 if (mm and mm.mfu) else float('nan'):+.2f}% | "
                     f"{f(gpu.tensor_active if gpu else None)} | {f(gpu.dram_active if gpu else None)} | "
                     f"{f(gpu.sm_active if gpu else None)} |")
        print(f"  peak source: {agent.run_info.peak_source[:60]}..., dtype {agent.run_info.dtype}, "
              f"agent errors {agent.errors.snapshot()}", flush=True)
        del m, opt, step, agent
        torch.cuda.empty_cache()
    out(lines, "agent_validation.md")


def overhead(T, batches, pairs, steps):
    lines = ["## 2. Agent overhead: step time without / with the agent (NVML 1 Hz, exporter on, profiler off)", "",
             f"{pairs} pairs of {steps}-step blocks, order alternating; overhead = median over pairs of "
             "(with / without - 1).", "",
             "| batch x seq | without (ms, median) | with (ms, median) | overhead (median of pairs) | "
             "pair spread (IQR) |", "|---|---|---|---|---|"]
    for B in batches:
        m, opt, step = make(B, T, L=4, d=2048, ff=5632)
        for _ in range(5):
            step()
        a_times, b_times, ratios = [], [], []
        for i in range(pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            res = {}
            for with_agent in order:
                if with_agent:
                    agent = Agent(m, opt, run="overhead", port=0, profile_every="off", alerts=False,
                                  model_shape={"n_layers": m.L, "d_model": m.d})
                    step()  # the first step after attaching carries the dtype detection
                    res[True] = timed(step, steps)
                    agent.close()
                else:
                    step()
                    res[False] = timed(step, steps)
            a_times.append(res[False])
            b_times.append(res[True])
            ratios.append(res[True] / res[False] - 1)
        q = statistics.quantiles(ratios, n=4)
        lines.append(f"| {B}x{T} | {statistics.median(a_times) * 1e3:.3f} | {statistics.median(b_times) * 1e3:.3f} | "
                     f"{statistics.median(ratios) * 100:+.2f}% | {q[0] * 100:+.2f}% .. {q[2] * 100:+.2f}% |")
        del m, opt, step
        torch.cuda.empty_cache()
    out(lines, "agent_validation.md")


def flop_counter_path(T, B):
    lines = ["## 3. FlopCounterMode path (no model shape) vs analytic; HFU under activation checkpointing", "",
             "| model | analytic model FLOPs/step | agent model FLOPs/step | ratio | agent HFU/MFU |", "|---|---|---|---|---|"]
    for ckpt in (False, True):
        m, opt, step = make(B, T, ckpt=ckpt, L=8)
        analytic = analytic_flops_per_token(count_matmul_params(m), m.L, m.d, T) * B * T
        agent = Agent(m, opt, run="fc", port=0, profile_every="off", alerts=False, nvml=False, peak_flops=PEAK_BF16,
                      report_every_steps=3)
        for _ in range(8):
            step()
        torch.cuda.synchronize()
        agent.close()
        mm = agent.latest
        lines.append(f"| L=8 {'checkpointed' if ckpt else 'plain'} | {analytic:.4e} | {mm.model_flops:.4e} | "
                     f"{mm.model_flops / analytic:.4f} | {mm.hfu / mm.mfu:.3f} |")
        del m, opt, step, agent
        torch.cuda.empty_cache()
    out(lines, "agent_validation.md")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# agent validation on {torch.cuda.get_device_name()} (torch {torch.__version__})\n", flush=True)
    T = 1024
    mfu_accuracy(T, [8] if a.quick else [4, 8, 32], seconds=3.0)
    overhead(T, [4] if a.quick else [4, 8, 32], pairs=6 if a.quick else 12, steps=20)
    flop_counter_path(T, 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
