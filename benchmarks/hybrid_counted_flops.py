"""The counted FLOP path on a Mamba + attention + MoE hybrid (transformers' Jamba from a small config).

    python benchmarks/hybrid_counted_flops.py [--device cuda]

For each experts implementation the installed transformers offers (eager, grouped_mm, batched_mm), trains
3 steps through the agent (FlopCounterMode over one real step: the counted path) and prints its model and
hardware FLOPs per step against an independent count: FlopCounterMode with torch's own formulas over the
eager experts, its depthwise-convolution backward replaced by twice the forward convolution's FLOPs
(torch's weight-gradient formula ignores the groups). Prints a markdown table.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def jamba(impl, device, dtype):
    import transformers

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
              expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2,
              mamba_expand=2)
    if impl is not None:
        kw["experts_implementation"] = impl
    cfg = transformers.JambaConfig(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(cfg).to(device=device, dtype=dtype)


def truth(model, x):
    """torch's formulas, eager experts; conv backward = 2 x the forward conv (input and weight gradients)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        model(input_ids=x, labels=x).loss.backward()
    model.zero_grad()
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    return sum(counts.values()) - counts.get("aten.convolution_backward", 0) + 2 * counts.get("aten.convolution", 0)


def through_agent(model, x):
    from mfuwatch.agent import Agent

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, exporter=False, nvml=False, alerts=False, profile_every="off", report_every_steps=3,
              peak_flops=1e12, progress=False)
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    a.close()
    return a.run_info.flops_source, a.latest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    import transformers

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    x = torch.randint(0, 64, (2, 8), device=args.device)
    ref = truth(jamba("eager", args.device, dtype), x)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.device} {dtype}; "
          f"independent count {ref:,} FLOPs per step\n")
    print("| experts implementation | flops_source | model FLOPs / count | hardware FLOPs / count |")
    print("|---|---|---|---|")
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            src, m = through_agent(jamba(impl, args.device, dtype), x)
            print(f"| {impl} | {src} | {m.model_flops / ref:.4f} | {m.hardware_flops / ref:.4f} |")
        except Exception as exc:  # noqa: BLE001 - an implementation this transformers lacks
            print(f"| {impl} | - | {type(exc).__name__}: {str(exc)[:80]} | |")


if __name__ == "__main__":
    main()
