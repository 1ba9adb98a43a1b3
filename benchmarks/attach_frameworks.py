"""Frameworks under ``mfuwatch run`` on the CPU: the agent's steps, tokens, tokens/s and FLOPs next to the
framework's own (the scripts of tests/fixtures/attach, unmodified). Prints a markdown table.

    python benchmarks/attach_frameworks.py

MFU needs a peak: the CPU has none in the datasheet table, so ``peak_flops: 1e12`` is given and the MFU
column is the agent's model FLOP/s over 1 TFLOP/s (the comparison is of the numerator).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "attach"
RUNS = [
    ("plain loop (TinyLM)", "plain_train.py", ["--steps", "30"], {}),
    ("HF Trainer (tiny Llama)", "hf_trainer.py", ["--steps", "30", "--batch", "4"], {"flops_convention": "6n"}),
    ("Lightning (tiny Llama, accumulate 2)", "lightning_train.py", ["--steps", "30", "--batch", "4", "--accumulate", "2"], {}),
    ("Accelerate (tiny Llama, accumulate 2)", "accelerate_train.py", ["--micro", "60", "--batch", "4", "--accumulate", "2"], {}),
]


def run(script, args, cfg, d):
    tl = Path(d) / "tl.jsonl"
    conf = Path(d) / "agent.yaml"
    conf.write_text(yaml.safe_dump(dict(exporter=False, nvml=False, profile_every="off", alerts=False,
                                        report_every_steps=1, progress=False, timeline=str(tl), peak_flops=1e12,
                                        **cfg)))
    out = Path(d) / "fw.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("MFUWATCH_CONFIG", None)
    cmd = [sys.executable, "-m", "mfuwatch.agent.cli", "run", "--config", str(conf), "--", sys.executable,
           str(FIX / script), "--out", str(out), *args]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    recs = [json.loads(x) for x in tl.read_text().splitlines() if x.strip()]
    return [r for r in recs if r["kind"] == "step"], [r for r in recs if r["kind"] == "run"][-1], \
        json.loads(out.read_text())


def main():
    print("| job | framework steps | agent steps (first) | tokens/step | agent tokens/s (median) | framework's own "
          "| agent model FLOPs/step | framework FLOPs/step | flops_source |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, script, args, cfg in RUNS:
        with tempfile.TemporaryDirectory() as d:
            steps, runrec, fw = run(script, args, cfg, d)
        fw_steps = fw.get("global_step", fw.get("optimizer_steps", len(fw.get("losses", [])) or "-"))
        tps = statistics.median(s["tokens_per_second"] for s in steps)
        own = "-"
        if "train_tokens_per_second" in fw:
            own = f"{float(fw['train_tokens_per_second']):,.0f} tokens/s (train_tokens_per_second)"
        elif "train_steps_per_second" in fw:
            own = f"{float(fw['train_steps_per_second']) * steps[0]['tokens']:,.0f} tokens/s (steps/s x tokens)"
        elif "fit_seconds" in fw:
            own = f"{fw['global_step'] * steps[0]['tokens'] / fw['fit_seconds']:,.0f} tokens/s (fit wall time)"
        elif "loop_seconds" in fw:
            own = f"{fw['optimizer_steps'] * steps[0]['tokens'] / fw['loop_seconds']:,.0f} tokens/s (loop wall time)"
        fwf = f"{fw['total_flos'] / fw['global_step']:.6g} (total_flos)" if "total_flos" in fw else "-"
        print(f"| {name} | {fw_steps} | {len(steps)} ({steps[0]['step']}) | {steps[0]['tokens']} | {tps:,.0f} | {own} "
              f"| {steps[-1]['model_flops']:.6g} | {fwf} | {runrec['flops_source']} ({runrec['flops_convention']}) |")


if __name__ == "__main__":
    main()
