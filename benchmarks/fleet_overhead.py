"""What the fleet accounting (hang watchdog, goodput buckets, FLOP/step-time counters, straggler score) costs a
training loop: paired, interleaved runs with it on and off, on a small real training loop.

Run from the repository root with the project installed::

    python3 benchmarks/fleet_overhead.py                 # CUDA GPU, about 2-3 minutes on an H200
    python3 benchmarks/fleet_overhead.py --cpu --tiny    # a few seconds: proves the script works
    OUT=/dir python3 benchmarks/fleet_overhead.py        # also writes $OUT/fleet_overhead.md

Both variants run the same agent (exporter, NVML, profiler windows and alerts off, so only the fleet
part differs); "off" removes ``agent.fleet`` right after start (its watchdog thread stopped, checkpoint
hooks removed), which is what the agent's hooks test before calling it. Each repeat builds a fresh model,
optimizer and agent per variant, in alternating order, runs warm-up steps, then times ``--steps``
optimizer steps (wall time, one device synchronize at the end). The table gives the paired relative
difference (on - off) / off per repeat, its median and mean, and — as a noise-free bound — the
training-thread cost of the fleet hooks per step measured in a tight loop, over the step time.
Goal: < 0.1% of step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from mfuwatch.agent import Agent

LINES = []


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)


def make_model(d: int, layers: int, device: torch.device) -> nn.Module:
    """``layers`` blocks of Linear(d, 4d) - GELU - Linear(4d, d) with a residual: 16 d^2 FLOPs per token and block."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    return nn.Sequential(*[Block() for _ in range(layers)]).to(device)


def run_variant(fleet_on: bool, args, device: torch.device) -> float:
    """Mean wall seconds per optimizer step over ``args.steps`` steps, after ``args.warmup`` steps."""
    torch.manual_seed(0)
    model = make_model(args.d, args.layers, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(args.batch, args.d, device=device)
    flops = 6 * sum(p.numel() for p in model.parameters()) * args.batch
    agent = Agent(model, opt, config=dict(exporter=False, nvml=False, profile_every="off", alerts=False,
                                          flops_per_step=float(flops), tokens_per_step=args.batch,
                                          peak_flops=1e15, run="fleet-overhead"))
    if not fleet_on and agent.fleet is not None:
        agent.fleet.close()
        agent.fleet = None
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with amp:
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t0) / args.steps
    agent.close()
    return dt


def hook_cost_us(n: int = 20000) -> float:
    """Training-thread cost of the fleet hooks per step (forward start + boundary), in microseconds."""
    agent = Agent(config=dict(exporter=False, nvml=False, profile_every="off", alerts=False, flops_per_step=1e9,
                              peak_flops=1e15, run="fleet-hook-cost"))
    fleet = agent.fleet
    for i in range(1000):
        fleet._in_step = False
        fleet.forward_start()
        fleet.boundary(i + 1)
    t0 = time.perf_counter()
    for i in range(n):
        fleet._in_step = False
        fleet.forward_start()
        fleet.boundary(i + 1001)
    dt = (time.perf_counter() - t0) / n * 1e6
    agent.close()
    return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (default: the first CUDA GPU)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and few steps (a smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="paired repeats (default: fit ~150 s)")
    p.add_argument("--steps", type=int, default=None)
    a = p.parse_args()
    device = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: OpenMP threads spinning against other processes drown the signal
    if a.tiny:
        a.d, a.layers, a.batch, a.warmup = 64, 2, 32, 5
        a.steps, a.repeats = a.steps or 50, a.repeats or 3
    else:
        a.d, a.layers, a.batch, a.warmup = 2048, 8, 8192, 20
    if a.steps is None or a.repeats is None:  # size the run to ~150 s from one probe
        a.steps = a.steps or 50
        probe = run_variant(True, a, device)
        a.steps = max(50, int(10.0 / probe))  # ~10 s per timed variant
        a.repeats = a.repeats or max(3, int(150.0 / (2 * (a.steps + a.warmup) * probe + 2.0)))
    say(f"# fleet accounting overhead ({device.type}{', tiny' if a.tiny else ''}; torch {torch.__version__})")
    say()
    say(f"model: {a.layers} x MLP block d={a.d}, batch {a.batch}, AdamW foreach; {a.steps} timed steps after "
        f"{a.warmup} warm-up, {a.repeats} paired repeats (order alternates)")
    say()
    rows = []
    for r in range(a.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {v: run_variant(v, a, device) for v in order}
        rows.append((got[True], got[False]))
    say("| repeat | on (ms/step) | off (ms/step) | (on - off) / off |")
    say("|---:|---:|---:|---:|")
    rel = []
    for i, (on, off) in enumerate(rows):
        rel.append((on - off) / off)
        say(f"| {i} | {on * 1e3:.3f} | {off * 1e3:.3f} | {rel[-1] * 100:+.3f}% |")
    step = statistics.median(off for _, off in rows)
    hook = hook_cost_us()
    say()
    say(f"median paired difference: {statistics.median(rel) * 100:+.3f}%  (mean {statistics.mean(rel) * 100:+.3f}%, "
        f"spread {min(rel) * 100:+.3f}% .. {max(rel) * 100:+.3f}%)")
    say(f"fleet hooks on the training thread: {hook:.2f} us per step = {hook / (step * 1e6) * 100:.4f}% of the "
        f"{step * 1e3:.2f} ms step (goal < 0.1%)")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "fleet_overhead.md"), "w") as fh:
            fh.write("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
