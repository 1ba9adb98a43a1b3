"""The counted FLOP path on a Mamba + attention + MoE hybrid (transformers' Jamba from a small config).

    python benchmarks/hybrid_counted_flops.py [--device cuda]

For each experts implementation (eager, grouped_mm, batched_mm), trains 2 steps through the agent
(FlopCounterMode over one real step: the counted path) and prints its model and hardware FLOPs per step
against the independent count of tests/agent/test_hybrid_flops.py (torch's own formulas over the eager
experts, the depthwise convolution's backward taken as twice its forward). On the GPU it runs the
installed transformers (5.17 there) in bf16. Prints a markdown table.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.agent.test_hybrid_flops import _build, _counted, _reference  # noqa: E402  (one reference, in the test)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    import transformers

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).to(args.device)
    ref = _reference(_build("jamba", "eager").to(args.device, dtype), x)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.device} {dtype}; "
          f"independent count {ref:,} FLOPs per step\n")
    print("| experts implementation | flops_source | model FLOPs / count | hardware FLOPs / count |")
    print("|---|---|---|---|")
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            a = _counted(_build("jamba", impl).to(args.device, dtype), x)
            m = a.latest
            print(f"| {impl} | {a.run_info.flops_source} | {m.model_flops / ref:.4f} | {m.hardware_flops / ref:.4f} |")
        except Exception as exc:  # noqa: BLE001 - an implementation this transformers lacks
            print(f"| {impl} | - | {type(exc).__name__}: {str(exc)[:80]} | |")


if __name__ == "__main__":
    main()
