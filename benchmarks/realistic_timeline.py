"""A long run's timeline with the record mix the agent writes, for the ``report``/resume benchmarks (#28).

Every record is built from the agent's own dataclasses (:mod:`mfuwatch.agent.schema`) or record
builders (``alerts.model``'s alert record, the fleet's ``attempt``/``phase``/``checkpoint`` shapes),
serialized the way :class:`mfuwatch.agent.live.timeline.Timeline` writes them. The mix is that of a
run with 0.5 s optimizer steps and the default settings: a ``step`` record per 10 steps (5 s, GPM
activity fields filled as on an H100/H200), a ``gpu`` record every 10 s (the reporter's cap), a
profiler ``window`` every 300 s (10 top ops, 3 suggestions), an evaluation ``phase`` every 1,000 steps,
a checkpoint save (``phase`` + ``checkpoint``) every 5,000 steps, an alert firing then resolving every
20,000 steps, and a restart (``run`` + ``attempt``) every 2 million steps.

    python benchmarks/realistic_timeline.py OUT.jsonl --gb 1.0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from mfuwatch.agent.live.timeline import _clean
from mfuwatch.agent.schema import GpuHealth, OpShare, StepMeasurement, Suggestion, WindowMeasurement, to_record

STEP_SECONDS = 0.5
PEAK = 9.89e14


def _dump(rec) -> str:
    return json.dumps(_clean(rec), separators=(",", ":"), default=str) + "\n"


def _window(step: int, ts: float) -> dict:
    ops = [OpShare(op=f"aten::op_{i}", bound=("compute", "memory", "communication", "other")[i % 4],
                   share=0.3 / (i + 1), time_seconds=0.01 / (i + 1), kernels=12 * (i + 1), flops=1e12 / (i + 1),
                   bytes=4e9 / (i + 1), arithmetic_intensity=250.0 / (i + 1)) for i in range(10)]
    sugg = [Suggestion(kernel=k, title=f"Use {k}", apply=f"mfuwatch.kernels.apply('{k}')", ops=["aten::op_1"],
                       time_seconds=0.002, expected_gain=0.03, kind="bundled", gain_in_set=0.02)
            for k in ("rms_norm", "fused_adamw", "torch_compile")]
    w = WindowMeasurement(step=step, timestamp=ts, steps=5, wall_seconds=2.6, busy_seconds=2.4,
                          breakdown={"compute_bound": 0.55, "memory_bound": 0.3, "communication": 0.1, "other": 0.05,
                                     "idle": 0.08},
                          memory_bound_share=0.3, top_ops=ops, suggestions=sugg, kernels_per_step=1840.0,
                          mean_kernel_seconds=2.6e-4, step_time_seconds=0.52, combined_gain=0.05)
    return to_record("window", w)


def make(path: Path, gb: float, t0: float = 1.75e9) -> dict:
    """Write about ``gb`` GB to ``path``; returns what was written: ``records`` per kind, ``steps`` (the
    last step), ``step_sum`` (sum of the step records' ``steps``), ``mfu_weighted_mean`` (the step-weighted
    mean MFU over every step record, float64) and ``bytes``."""
    target = int(gb * 1e9)
    counts = {k: 0 for k in ("run", "attempt", "step", "gpu", "window", "phase", "checkpoint", "alert")}
    written = 0
    step = 0
    mfu_w = 0.0
    step_sum = 0
    buf = []
    restart_every = 2_000_000
    with open(path, "w") as fh:
        def out(rec):
            nonlocal written
            line = _dump(rec)
            buf.append(line)
            written += len(line)
            counts[rec["kind"]] += 1

        while written < target:
            ts = t0 + step * STEP_SECONDS
            if step % restart_every == 0:
                out({"kind": "run", "run": "llama-70b-pretrain", "rank": 0, "world_size": 64, "model": "LlamaForCausalLM",
                     "dtype": "bfloat16", "device": "NVIDIA H200", "peak_flops_per_second": PEAK,
                     "flops_per_step": 1.2e15, "report_every_steps": 10, "mfuwatch_version": "0.1.0"})
                out({"kind": "attempt", "pid": 4242 + step // restart_every, "host": "gpu-node-017", "timestamp": ts,
                     "lost_steps": 120, "lost_seconds": 60.0, "lost_ignored": 0})
            step += 10
            ts = t0 + step * STEP_SECONDS
            k = (step * 7919) % 13
            st = STEP_SECONDS * (1 + 0.02 * (k - 6) / 6)
            mfu = 1.2e15 / st / PEAK / 8
            m = StepMeasurement(step=step, steps=10, timestamp=ts, step_time_seconds=st, tokens=10 * 131072,
                                tokens_per_second=131072 / st, model_flops=1.2e15, hardware_flops=1.6e15,
                                model_flops_per_second=1.2e15 / st, mfu=mfu, hfu=mfu * 4 / 3,
                                loss=2.0 + 1.0 / (1 + step / 1e5), tokens_per_step=131072.0, tensor_active=0.41,
                                tensor_active_bound=0.40, sm_active=0.93, dram_active=0.35)
            mfu_w += mfu * 10
            step_sum += 10
            out(to_record("step", m))
            if step % 20 == 0:
                out(to_record("gpu", GpuHealth(
                    timestamp=ts, utilization=0.99, memory_bandwidth_utilization=0.38, sm_clock_hertz=1.98e9,
                    sm_clock_max_hertz=1.98e9, power_watts=600.0 + k, power_limit_watts=700.0,
                    temperature_celsius=62.0, memory_used_bytes=1.21e11, memory_total_bytes=1.43e11,
                    energy_joules=1.0e9 + step * 300.0,
                    clock_event_reasons={"sw_power_cap": False, "hw_slowdown": False, "sw_thermal": False},
                    ecc_errors={"corrected": 0, "uncorrected": 0}, xid_errors=0, sm_active=0.93,
                    tensor_active=0.41, dram_active=0.35)))
            if step % 600 == 0:
                out(_window(step, ts))
            if step % 1000 == 0:
                out({"kind": "phase", "name": "eval", "bucket": "eval", "step": step, "seconds": 42.0, "timestamp": ts})
            if step % 5000 == 0:
                out({"kind": "phase", "name": "checkpoint_save", "bucket": "checkpoint_save", "step": step,
                     "seconds": 31.5, "timestamp": ts})
                out({"kind": "checkpoint", "phase": "save", "step": step, "seconds": 31.5, "source": "checkpoint_save",
                     "timestamp": ts})
            if step % 20000 == 0:
                for status in ("firing", "resolved"):
                    out({"kind": "alert", "alertname": "MfuLow", "status": status, "severity": "warning",
                         "timestamp": ts, "summary": "MFU is 31.0% (below 35%)",
                         "labels": {"alertname": "MfuLow", "run": "llama-70b-pretrain", "rank": "0",
                                    "severity": "warning"},
                         "annotations": {"summary": "MFU is 31.0% (below 35%)",
                                         "runbook_url": "https://example.org/runbooks/mfu-low"}})
            if len(buf) > 5000:
                fh.write("".join(buf))
                buf = []
        fh.write("".join(buf))
    return {"records": counts, "steps": step, "step_sum": step_sum, "mfu_weighted_mean": mfu_w / step_sum,
            "bytes": written}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--gb", type=float, default=1.0)
    a = ap.parse_args()
    print(json.dumps(make(Path(a.path), a.gb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
