"""GPU validation of multi-rank support (issue 7): torchrun + DDP over NCCL on 2 GPUs, per-rank MFU and the
communication share of each rank's profiler windows.

Run on the 2-GPU machine (the project installed with ``pip install --no-deps --no-build-isolation -e .``):

    python3 benchmarks/ddp_validation.py [--steps 120] [--quick] [--hf]

1. ``torchrun --nproc-per-node 1 -m mfuwatch.agent.cli demo`` (the GPU preset: ~200 M matmul parameters, bf16
   autocast, 16 x 1024 tokens per step) with profiler windows every 20 steps: the single-GPU baseline.
2. The same with ``--nproc-per-node 2``: DDP over NCCL, the same batch per rank. While it runs, both exporters
   (base port and base port + 1) are scraped: each must carry only its own ``rank`` label.
3. From each rank's timeline: MFU (median of the step records after the first), tokens/s, step time, and from
   the profiler windows the communication / compute / memory-bound / other shares of GPU busy time and the idle
   share of wall time. MFU is cross-checked against an independent figure: the analytic FLOPs
   ``6 N + 12 L d T`` per token (PaLM appendix B), N counted here from the preset's shape, over the run's wall
   time (a lower bound: it includes start-up and profiler overhead).
4. ``--hf``: the Hugging Face Trainer with ``MFUWatchCallback`` under the same torchrun (2 ranks), when
   transformers and accelerate are installed.

NVLink SHARP / multicast stay off on that machine: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set here and inherited by every child process.

Prints markdown tables; writes them to $OUT/ddp_validation.md, the numbers to $OUT/ddp_validation.json and the
timelines under $OUT/ddp/ when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NCCL_ENV)  # before anything initialises NCCL, and inherited by torchrun's children

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' port helper, as fault_injection
from helpers.net import free_port_pair  # noqa: E402


def scrape(port: int) -> Optional[List[tuple]]:
    """[(name, labels dict, value)] of one exporter, or None while it is down."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def launch(nproc: int, argv: List[str], env: Dict[str, str], base_port: Optional[int], log: Path) -> Dict[str, Any]:
    """Run ``torchrun --nproc-per-node nproc <argv>``; scrape the exporters on ``base_port`` + local rank while it
    runs (``None``: no scraping). Returns the exit code, the last scrape with MFU per rank and the log's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *argv]
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        seen: Dict[int, Any] = {}
        while proc.poll() is None:
            for r in range(nproc if base_port is not None else 0):
                s = scrape(base_port + r)
                if s and any(n == "mfuwatch_mfu_ratio" for n, _, _ in s):
                    seen[r] = s  # keep the latest scrape that has MFU
            time.sleep(0.5)
    return {"returncode": proc.returncode, "scrapes": seen, "log": log.read_text()[-3000:]}


def read_timeline(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def analytic_flops_per_step(shape: Any) -> float:
    """6 N + 12 L d T per token (PaLM appendix B) for the demo model, N written out from its shape, x tokens/step."""
    d, ff, L, V, T = shape.d_model, shape.d_ff, shape.n_layers, shape.vocab, shape.seq
    n = L * (d * 3 * d + d * d + 3 * d * ff) + d * V  # qkv, o, gate/up/down per layer; the output projection
    return (6.0 * n + 12.0 * L * d * T) * shape.batch * T


def summarize_rank(records: List[dict], summary: Dict[str, Any], flops_per_step: float) -> Dict[str, Any]:
    """Per-rank figures from a timeline. MFU, tokens/s and step time are medians over the step records after the
    first (warm-up) that do not overlap a profiler window (profiling slows the steps it records)."""
    run = records[0]
    steps = [r for r in records if r["kind"] == "step"]
    windows = [r for r in records if r["kind"] == "window"]
    spans = [(w["step"] - w["steps"] - 2, w["step"] + 1) for w in windows]  # warm-up + active steps, with margin
    clean = [r for r in steps[1:] if not any(r["step"] - r["steps"] + 1 <= hi and r["step"] >= lo for lo, hi in spans)]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    out: Dict[str, Any] = {
        "rank": run["rank"], "world_size": run["world_size"], "gpu": run.get("gpu_name"),
        "dtype": summary.get("dtype") or run.get("dtype"),
        "peak_flops": summary.get("peak_flops_per_second") or run.get("peak_flops_per_second"),
        "steps": sum(r["steps"] for r in steps), "records_used": len(clean),
        "mfu_median": med([r["mfu"] for r in clean if r.get("mfu") is not None]),
        "tokens_per_second_median": med([r["tokens_per_second"] for r in clean]),
        "step_ms_median": 1e3 * med([r["step_time_seconds"] for r in clean]) if clean else None,
        "model_flops_per_step": steps[-1]["model_flops"] if steps else None, "windows": len(windows),
    }
    if windows:
        for cat in ("communication", "compute_bound", "memory_bound", "other", "idle"):
            out[f"{cat}_share"] = statistics.mean(w["breakdown"].get(cat, 0.0) for w in windows)
        out["communication_share_per_window"] = [round(w["breakdown"].get("communication", 0.0), 4) for w in windows]
        comm_ops = sorted({o["op"] for w in windows for o in w["top_ops"] if o["bound"] == "communication"})
        out["communication_ops"] = comm_ops[:4]
    peak = out["peak_flops"]
    if peak and summary.get("elapsed_seconds"):
        out["mfu_wall_lower_bound"] = flops_per_step * summary["steps"] / summary["elapsed_seconds"] / peak
    out["flops_match_analytic"] = (abs(out["model_flops_per_step"] / flops_per_step - 1) < 1e-6
                                   if out["model_flops_per_step"] else None)
    return out


def table(rows: List[Dict[str, Any]], cols: List[str]) -> str:
    fmt = lambda v: "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def demo_runs(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    from mfuwatch.agent.demo import PRESETS

    preset = "gpu" if args.device == "cuda" else "cpu"
    flops = analytic_flops_per_step(PRESETS[preset])
    results: Dict[str, Any] = {"analytic_flops_per_step": flops, "configs": {}}
    for name, nproc in (("1 GPU", 1), ("DDP 2 GPUs", 2)):
        d = work / name.replace(" ", "_")
        d.mkdir(parents=True, exist_ok=True)
        base = free_port_pair()
        env = dict(os.environ, MFUWATCH_RUN=f"ddp-validation-{nproc}", OMP_NUM_THREADS="4")
        (d / "agent.yaml").write_text("report_every_steps: 5\n")  # records short enough to skip profiled steps
        argv = ["-m", "mfuwatch.agent.cli", "demo", "--device", args.device, "--model", preset, "--steps", str(args.steps),
                "--port", str(base),
                "--profile-every", f"{args.profile_every} steps", "--timeline", str(d / "timeline.jsonl"),
                "--summary-json", str(d / "summary.json"), "--report", "", "--log-every", "20",
                "--config", str(d / "agent.yaml")]
        seen = launch(nproc, argv, env, base, d / "torchrun.log")
        ok = seen["returncode"] == 0
        ranks = []
        for r in range(nproc):
            sfx = f".rank{r}" if nproc > 1 else ""
            tl, sj = d / f"timeline{sfx}.jsonl", d / f"summary{sfx}.json"
            if not (tl.exists() and sj.exists()):
                ok = False
                continue
            row = summarize_rank(read_timeline(tl), json.loads(sj.read_text()), flops)
            s = seen["scrapes"].get(r)
            row["scraped_rank_labels"] = sorted({lab.get("rank") for n, lab, _ in s if n.startswith("mfuwatch_")}) if s else None
            row["scraped_run_labels"] = sorted({lab.get("run") for n, lab, _ in s if n.startswith("mfuwatch_")}) if s else None
            row["config"] = name
            ranks.append(row)
        results["configs"][name] = {"ok": ok, "ranks": ranks, "log_tail": None if ok else seen["log"]}
    return results


HF_WORKER_ARG = "--hf-worker"


def hf_worker(out_dir: str, steps: int, device: str) -> None:
    """One rank of the Trainer run (started by torchrun): a ~200 M Llama from a config, random tokens, bf16.

    ``device`` "cpu" (the script's smoke test) shrinks the model and the batch and trains in fp32 with gloo.
    """
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    from mfuwatch.agent.integrations.hf import MFUWatchCallback

    rank = int(os.environ.get("RANK", "0"))
    gpu = device == "cuda"
    V, T, B = (32000, 1024, 8) if gpu else (256, 64, 2)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=1024 if gpu else 64, intermediate_size=2816 if gpu else 176,
                                   num_hidden_layers=12 if gpu else 2, num_attention_heads=16 if gpu else 4,
                                   num_key_value_heads=16 if gpu else 4, max_position_embeddings=T)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    cb = MFUWatchCallback(port=0, timeline=f"{out_dir}/hf_timeline.rank{rank}.jsonl", profile_every="10 steps",
                          report_every_steps=5, patch_kernels=True, **({} if gpu else {"calibrate": True}))
    args = TrainingArguments(output_dir=f"{out_dir}/hf_out", per_device_train_batch_size=B, gradient_accumulation_steps=2,
                             max_steps=steps, bf16=gpu, use_cpu=not gpu, report_to="none", save_strategy="no",
                             logging_steps=10, disable_tqdm=True, dataloader_num_workers=2 if gpu else 0,
                             ddp_find_unused_parameters=False)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    swapped = len(cb.patch_report.swapped) if cb.patch_report is not None else 0
    Path(f"{out_dir}/hf_rank{rank}.json").write_text(json.dumps({"patched_modules": swapped,
                                                                 "expected_tokens_per_step": B * 2 * T}))


def hf_run(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import importlib.util

    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"not installed: {', '.join(missing)}"}
    d = work / "hf"
    d.mkdir(parents=True, exist_ok=True)
    seen = launch(2, [str(Path(__file__).resolve()), HF_WORKER_ARG, str(d), str(args.hf_steps), args.device],
                  dict(os.environ, MFUWATCH_RUN="ddp-validation-hf", OMP_NUM_THREADS="4"), None, d / "torchrun.log")
    rows = []
    for r in range(2):
        tl = d / f"hf_timeline.rank{r}.jsonl"
        if not tl.exists():
            continue
        recs = read_timeline(tl)
        steps = [x for x in recs if x["kind"] == "step"]
        tokens_per_step = steps[-1]["tokens"] / steps[-1]["steps"] if steps else None
        row = summarize_rank(recs, {}, float("nan"))
        row.pop("flops_match_analytic", None)
        row["ok"] = seen["returncode"] == 0
        row.update(config="HF Trainer, 2 ranks", tokens_per_step=tokens_per_step, flops_source=recs[0].get("flops_source"))
        p = d / f"hf_rank{r}.json"
        if p.exists():
            row.update(json.loads(p.read_text()))
        rows.append(row)
    return {"ok": seen["returncode"] == 0, "ranks": rows, "log_tail": None if seen["returncode"] == 0 else seen["log"]}


def demo_report(demo: Dict[str, Any], md: List[str], checks: List[tuple]) -> None:
    """Append the demo runs' table to ``md`` and their pass/fail checks to ``checks``."""
    cols = ["config", "rank", "gpu", "dtype", "steps", "records_used", "mfu_median", "mfu_wall_lower_bound",
            "tokens_per_second_median", "step_ms_median", "windows", "communication_share", "compute_bound_share",
            "memory_bound_share", "other_share", "idle_share", "scraped_rank_labels", "scraped_run_labels",
            "flops_match_analytic"]
    rows = [r for c in demo["configs"].values() for r in c["ranks"]]
    md += ["## mfuwatch demo under torchrun (NCCL)", "", table(rows, cols), ""]
    ddp = demo["configs"]["DDP 2 GPUs"]["ranks"]
    single = demo["configs"]["1 GPU"]["ranks"]
    checks.append(("both runs exited 0", all(c["ok"] for c in demo["configs"].values())))
    checks.append(("DDP: two ranks with MFU", len(ddp) == 2 and all(r["mfu_median"] for r in ddp)))
    checks.append(("DDP: each exporter carries only its own rank label",
                   len(ddp) == 2 and all(r["scraped_rank_labels"] == [str(r["rank"])] for r in ddp)))
    checks.append(("DDP: non-zero communication share on every rank",
                   len(ddp) == 2 and all((r.get("communication_share") or 0) > 0 for r in ddp)))
    checks.append(("1 GPU: profiler windows with zero communication share",
                   bool(single) and single[0]["windows"] > 0 and single[0].get("communication_share") == 0))
    checks.append(("agent MFU >= 0.95 x wall-clock lower bound",
                   bool(rows) and all(r["mfu_median"] and r.get("mfu_wall_lower_bound")
                                      and r["mfu_median"] >= 0.95 * r["mfu_wall_lower_bound"] for r in rows)))
    checks.append(("same run label on both ranks (needs the demo's $MFUWATCH_RUN fix)",
                   len(ddp) == 2 and ddp[0]["scraped_run_labels"] == ddp[1]["scraped_run_labels"]))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == HF_WORKER_ARG:
        hf_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--profile-every", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="60 steps")
    p.add_argument("--hf", action="store_true", help="also run the Hugging Face Trainer callback on 2 ranks")
    p.add_argument("--hf-steps", type=int, default=40)
    p.add_argument("--skip-demo", action="store_true", help="with --hf: only the Trainer run")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke test of this script with gloo and the CPU preset (no GPU numbers)")
    args = p.parse_args()
    if args.quick:
        args.steps = 60
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, found {torch.cuda.device_count()}")
        return 2
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work = Path(tempfile.mkdtemp(prefix="mfuwatch-ddp-"))
    results = {"env": NCCL_ENV, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "demo": {"configs": {}} if args.skip_demo else demo_runs(args, work)}
    if args.hf:
        results["hf"] = hf_run(args, work)

    md: List[str] = []
    checks: List[tuple] = []
    if not args.skip_demo:
        demo_report(results["demo"], md, checks)
    if "hf" in results and "ranks" in results["hf"]:
        hf_cols = ["config", "rank", "steps", "mfu_median", "tokens_per_second_median", "step_ms_median",
                   "tokens_per_step", "expected_tokens_per_step", "flops_source", "communication_share",
                   "memory_bound_share", "idle_share", "patched_modules"]
        md += ["## Hugging Face Trainer + MFUWatchCallback, 2 ranks", "", table(results["hf"]["ranks"], hf_cols), ""]
        hf = results["hf"]["ranks"]
        checks.append(("HF: the 2-rank Trainer run exited 0", results["hf"]["ok"]))
        checks.append(("HF: MFU on both ranks", len(hf) == 2 and all(r["mfu_median"] for r in hf)))
        checks.append(("HF: tokens per step = batch x accumulation x seq on both ranks",
                       len(hf) == 2 and all(r["tokens_per_step"] == r["expected_tokens_per_step"] for r in hf)))
    elif "hf" in results:
        md += [f"HF run skipped: {results['hf']['skipped']}", ""]
    md += ["## Checks", ""] + [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in checks]
    for name, c in list(results["demo"]["configs"].items()) + ([("hf", results["hf"])] if "hf" in results else []):
        if c.get("log_tail"):
            md += ["", f"### {name}: log tail", "```", c["log_tail"], "```"]
    text = "\n".join(md)
    print(text)
    results["checks"] = {what: ok for what, ok in checks}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ddp_validation.md").write_text(text + "\n")
        (out / "ddp_validation.json").write_text(json.dumps(results, indent=2, default=str))
        shutil.copytree(work, out / "ddp", dirs_exist_ok=True, ignore=shutil.ignore_patterns("hf_out"))
    return 0 if all(ok for what, ok in checks if "needs the demo" not in what) else 1


if __name__ == "__main__":
    sys.exit(main())
