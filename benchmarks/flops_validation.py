"""Agent MFU against the truth on one GPU: a Hugging Face Llama (GQA 16/4), a Mixtral-style MoE, a LoRA fine-tune.

    python benchmarks/flops_validation.py            # one GPU, about 1.5 minutes on an H200
    python benchmarks/flops_validation.py --tiny --cpu   # the same path on tiny models, CPU (CI runs this)

For each model: truth = FlopCounterMode FLOPs of one real training step of the same
weights with eager attention (and experts as a per-expert loop where transformers
allows it) / synchronized wall time per step / the peak FLOP/s the agent uses. The agent
runs as a user would attach it (SDPA attention, default experts). Beside each: the
mean NVML GPM tensor-active ratio. Then the two H200 bugs: the NVML thread's first
sample during ``Agent.__init__`` (no ``_last_gpu_write`` log line) and profiler-window
outcomes other than ``ok`` in ``mfuwatch_profile_windows_total`` (a window is provoked
while the user's own profiler runs). Prints markdown tables (docs/validation.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional

# this folder holds a kernels.py that would shadow the `kernels` package transformers looks for
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from mfuwatch.agent import Agent
from mfuwatch.agent.flops import op_flops  # noqa: E402


class LoRALinear(nn.Module):
    """``base(x) + B(A(x)) * alpha / r`` with the base frozen (Hu et al. 2021); for machines without peft."""

    def __init__(self, base: nn.Linear, r: int = 16, alpha: float = 32.0) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / r
        base.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scale


def add_lora(model: nn.Module, targets=("q_proj", "v_proj"), r: int = 16) -> nn.Module:
    """Freeze every weight and wrap the ``targets`` projections with :class:`LoRALinear`."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name, mod in list(model.named_modules()):
        for t in targets:
            child = getattr(mod, t, None)
            if isinstance(child, nn.Linear):
                setattr(mod, t, LoRALinear(child, r))
    return model


def shapes(tiny: bool) -> Dict[str, Any]:
    if tiny:
        return dict(hidden=64, heads=4, kv=1, head_dim=16, ff=96, layers=2, vocab=128, seq=32, batch=2,
                    moe_hidden=64, moe_ff=48, experts=4, top_k=2, steps=4, r=4)
    return dict(hidden=2048, heads=16, kv=4, head_dim=128, ff=5632, layers=8, vocab=32000, seq=1024, batch=4,
                moe_hidden=1024, moe_ff=1408, experts=8, top_k=2, steps=30, r=16)


def build(kind: str, s: Dict[str, Any], attn: str, device: torch.device, dtype: torch.dtype,
          eager_experts: bool) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "moe":
        cfg = transformers.MixtralConfig(vocab_size=s["vocab"], hidden_size=s["moe_hidden"],
                                         intermediate_size=s["moe_ff"], num_hidden_layers=s["layers"],
                                         num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                                         num_local_experts=s["experts"], num_experts_per_tok=s["top_k"],
                                         max_position_embeddings=max(s["seq"], 64))
    else:
        cfg = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ff"],
                                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                       num_key_value_heads=s["kv"], head_dim=s["head_dim"],
                                       max_position_embeddings=max(s["seq"], 64))
    kw: Dict[str, Any] = {"attn_implementation": attn}
    if eager_experts and kind == "moe":
        kw["experts_implementation"] = "eager"
    with torch.device(device):  # initialise on the device: seconds instead of a CPU init of 0.5 B weights
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, **kw)
        except (TypeError, ValueError):  # a transformers without experts_implementation
            kw.pop("experts_implementation", None)
            model = transformers.AutoModelForCausalLM.from_config(cfg, **kw)
    model = model.to(dtype=dtype)
    if kind == "lora":
        add_lora(model, r=s["r"])
    return model


def batch(s: Dict[str, Any], device: torch.device) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def truth_flops(model: nn.Module, inputs: Dict[str, torch.Tensor]) -> int:
    """FLOPs of one real forward + backward, every matmul counted (eager attention: plain bmm)."""
    with FlopCounterMode(display=False, custom_mapping=op_flops.flop_counter_mapping()) as fc:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agent_totals(agent: Agent, steps: int) -> tuple:
    """``(model FLOPs, step seconds)`` the agent has counted (its monotonic counters) once it has read
    the events of ``steps`` optimizer steps (it reads them lazily on its own thread; at most 5 s)."""
    names = ("mfuwatch_model_flops_total", "mfuwatch_step_seconds_total", "mfuwatch_steps_total")
    deadline = time.perf_counter() + 5.0
    while True:
        totals = dict.fromkeys(names, 0.0)
        for family in agent.registry.collect():
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        if totals["mfuwatch_steps_total"] >= steps or time.perf_counter() > deadline:
            return totals[names[0]], totals[names[1]]
        time.sleep(0.01)


def run_case(kind: str, s: Dict[str, Any], device: torch.device, dtype: torch.dtype, peak: Optional[float],
             min_seconds: float) -> Dict[str, Any]:
    inputs = batch(s, device)
    ref = build(kind, s, "eager", device, dtype, eager_experts=True)
    flops_true = truth_flops(ref, inputs)
    model = build(kind, s, "sdpa", device, dtype, eager_experts=False)
    model.load_state_dict(ref.state_dict(), strict=False)
    del ref
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    cfg: Dict[str, Any] = dict(exporter=False, alerts=False, profile_every="off", run=f"validate-{kind}",
                               report_every_steps=max(2, s["steps"] // 3))
    if peak is not None:
        cfg["peak_flops"] = peak
    tensor_active: List[float] = []
    agent = Agent(model, opt, config=cfg)
    try:
        def one_step() -> None:
            model(**inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):  # warm-up; the agent's FLOP count happens in the first steps
            one_step()
        sync(device)
        # Both clocks cover the same span: the agent's counters from here (its intervals run from one
        # step boundary to the next, so the short wait for its thread falls inside the first timed
        # interval, which the wall clock covers too) to the end of the last timed step.
        steps, t0 = 0, time.perf_counter()
        flops0, seconds0 = agent_totals(agent, 3)
        while steps < s["steps"] or time.perf_counter() - t0 < min_seconds:
            one_step()
            steps += 1
            if agent.nvml is not None and agent.nvml.latest is not None and agent.nvml.latest.tensor_active is not None:
                tensor_active.append(agent.nvml.latest.tensor_active)
        sync(device)
        wall = (time.perf_counter() - t0) / steps
        flops1, seconds1 = agent_totals(agent, 3 + steps)
    finally:
        agent.close()
    m = agent.latest
    peak_used = agent.run_info.peak_flops_per_second or peak
    mfu_true = flops_true / wall / peak_used if peak_used else None
    # agent MFU over the same steps as the truth: its counted model FLOPs over its measured step time
    # (what the job-MFU recording rule computes from the same counters); the last report alone covers
    # only a few steps
    agent_mfu = ((flops1 - flops0) / (seconds1 - seconds0) / peak_used
                 if peak_used and seconds1 > seconds0 else (m.mfu if m else None))
    return {
        "model": {"llama": "Llama GQA", "moe": "Mixtral-style MoE", "lora": "Llama + LoRA"}[kind],
        "source": agent.run_info.flops_source, "agent_flops": m.model_flops if m else None,
        "true_flops": flops_true, "agent_mfu": agent_mfu, "true_mfu": mfu_true,
        "tensor_active": (sum(tensor_active[-5:]) / len(tensor_active[-5:])) if tensor_active else None,
        "step_s": wall, "breakdown": agent.flops_breakdown(print_it=False),
    }


def check_bugs(s: Dict[str, Any], device: torch.device, dtype: torch.dtype, peak: Optional[float]) -> Dict[str, Any]:
    """The NVML first-sample race and the window outcomes, on a short Llama run."""
    records: List[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = Grab(level=logging.DEBUG)
    lg = logging.getLogger("mfuwatch")
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.DEBUG)
    try:
        small = dict(s, layers=2, steps=6)
        model = build("llama", small, "sdpa", device, dtype, eager_experts=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        cfg: Dict[str, Any] = dict(exporter=False, alerts=False, run="validate-bugs", profile_every="2 steps",
                                   profile_warmup_steps=0, profile_active_steps=1)
        if peak is not None:
            cfg["peak_flops"] = peak
        inputs = batch(small, device)
        agent = Agent(model, opt, config=cfg)
        acts = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts):  # the user's own profiler: the agent's windows must skip
            for _ in range(6):
                model(**inputs).loss.backward()
                opt.step()
                opt.zero_grad()
        time.sleep(1.5 if device.type == "cuda" else 0.0)  # a few NVML samples
        agent.close()
        windows = {o: agent.registry.get_sample_value("mfuwatch_profile_windows_total",
                                                      {"run": "validate-bugs", "rank": "0", "outcome": o}) or 0
                   for o in ("ok", "skipped_other_profiler", "error", "too_large")}
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    race = sum("_last_gpu_write" in r.getMessage() for r in records)
    return {"last_gpu_write_lines": race, "nvml": agent.nvml is not None, "windows": windows}


def pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x * 100:.2f}%"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny models (seconds, for CI)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (fp32, a nominal peak of 1e11 FLOP/s)")
    ap.add_argument("--cases", default="llama,moe,lora", help="comma-separated: llama, moe, lora")
    ap.add_argument("--min-seconds", type=float, default=None, help="time each case at least this long")
    args = ap.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("needs transformers (pip install 'mfuwatch[hf]')", file=sys.stderr)
        return 1
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: pass --cpu", file=sys.stderr)
        return 1
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.cpu else torch.bfloat16
    peak = 1e11 if args.cpu else None  # on the GPU the agent's own peak (datasheet table) is the denominator
    s = shapes(args.tiny)
    min_s = args.min_seconds if args.min_seconds is not None else (0.0 if args.cpu else 8.0)
    rows = [run_case(k, s, device, dtype, peak, min_s) for k in args.cases.split(",") if k]
    dev = "CPU" if args.cpu else torch.cuda.get_device_name(device)
    print(f"## FLOP model validation ({dev}, torch {torch.__version__}, transformers {transformers.__version__})\n")
    print("| model | flops_source | agent model FLOPs/step | truth FLOPs/step | FLOPs ratio | agent MFU | "
          "truth MFU | MFU ratio | tensor active | step time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        fr = r["agent_flops"] / r["true_flops"] if r["agent_flops"] and r["true_flops"] else None
        mr = r["agent_mfu"] / r["true_mfu"] if r["agent_mfu"] and r["true_mfu"] else None
        ok &= fr is not None and abs(fr - 1) <= 0.02
        print(f"| {r['model']} | {r['source']} | {r['agent_flops'] or 0:.4g} | {r['true_flops']:.4g} | "
              f"{'n/a' if fr is None else f'{fr:.4f}'} | {pct(r['agent_mfu'])} | {pct(r['true_mfu'])} | "
              f"{'n/a' if mr is None else f'{mr:.3f}'} | {pct(r['tensor_active'])} | {r['step_s'] * 1e3:.1f} ms |")
    bugs = check_bugs(s, device, dtype, peak)
    print("\n| check | result |\n|---|---|")
    print(f"| `_last_gpu_write` log lines (NVML first sample during start-up) | {bugs['last_gpu_write_lines']}"
          f"{'' if bugs['nvml'] else ' (no NVML on this device)'} |")
    w = bugs["windows"]
    print(f"| mfuwatch_profile_windows_total by outcome (user profiler open) | "
          + ", ".join(f"{k}={int(v)}" for k, v in w.items()) + " |")
    ok &= bugs["last_gpu_write_lines"] == 0 and w["skipped_other_profiler"] > 0
    print(f"\nFLOPs within 2% and both bugs gone: {'yes' if ok else 'NO'}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
