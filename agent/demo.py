"""``mfuwatch demo``: a real training run with the agent attached.

A small decoder-only transformer (Llama-style: RMSNorm written out in PyTorch
ops, SwiGLU MLP, SDPA attention), written in plain PyTorch, learns to predict
the next byte of the Python standard library's own source files — real text
that is on every machine with no download. On a GPU it trains in bf16 autocast;
on the CPU in fp32 with the peak measured by a matmul calibration.

Run: ``mfuwatch demo --steps 200`` (or ``make demo``). Live progress shows step,
loss, tokens/s and MFU (``(profiler window)`` marks a report whose steps a profiler
window slowed); the exporter serves on 127.0.0.1; at the end a summary table, an
optional ``--summary-json`` and an HTML report are written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from .llama import LlamaLM, LlamaShape

class DemoError(ValueError):
    """A demo argument that cannot work on this machine (reported in one line, exit code 2)."""


# ----------------------------------------------------------------------------- data


def load_stdlib_text(max_bytes: int = 16 << 20) -> torch.Tensor:
    """The bytes of the standard library's ``.py`` files (sorted, deterministic), as a uint8 tensor.

    Raises:
        RuntimeError: if fewer than 1 MB of source is found (a stripped Python install).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: List[bytes] = []
    total = 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    if total < (1 << 20):
        raise RuntimeError(f"only {total} bytes of Python source found under {root}; the demo needs >= 1 MB")
    data = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteBatches:
    """Random (B, T) windows of the byte stream: inputs and next-byte targets, int64."""

    def __init__(self, data: torch.Tensor, batch: int, seq: int, device: torch.device, seed: int = 0) -> None:
        self.data, self.batch, self.seq, self.device = data, batch, seq, device
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple:
        ix = torch.randint(0, self.data.numel() - self.seq - 1, (self.batch,), generator=self.gen)
        rows = torch.stack([self.data[i: i + self.seq + 1] for i in ix.tolist()]).long()
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------- model


@dataclass
class DemoShape(LlamaShape):
    """The model's sizes (:class:`~mfuwatch.agent.llama.LlamaShape`, bytes as the vocabulary) and the batch."""

    seq: int = 128
    batch: int = 16


#: The demo's model: the Llama-style decoder the benchmarks also use.
DemoLM = LlamaLM

PRESETS: Dict[str, DemoShape] = {
    # CPU default: ~0.8 M matmul params, ~0.15 s/step on 2 cores; loss falls from 5.5 to ~2.2 in 600 steps
    "cpu": DemoShape(),
    # GPU default: ~200 M matmul params, bf16 autocast, 16k tokens per step
    "gpu": DemoShape(d_model=1024, n_layers=12, n_heads=16, d_ff=2816, seq=1024, batch=16),
    # memory-bound on purpose: narrow and long, so norms and pointwise ops dominate the kernel time
    "memory-bound": DemoShape(d_model=16, n_layers=2, n_heads=2, d_ff=48, seq=32, batch=256),
}


# ----------------------------------------------------------------------------- run


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _device(text: str) -> str:
    """``--device``'s value, checked against this machine: "cpu", "cuda" or "cuda:N" (0 <= N < the CUDA device
    count); cuda needs ``torch.cuda.is_available()``. Raises argparse.ArgumentTypeError otherwise (argparse
    then prints it under the option's name and exits with status 2)."""
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N (N a CUDA device index), got {text!r}")
    if text == "cpu":
        return text
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch sees no CUDA device (torch.cuda.is_available() is "
                                         "False); expected cpu, cuda or cuda:N, and here only cpu works")
    n = torch.cuda.device_count()
    if ":" in text and int(text.split(":")[1]) >= n:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {n} CUDA device(s); expected cpu, cuda or "
                                         f"cuda:N with N in cuda:0..cuda:{n - 1}")
    return text


#: the demo's own defaults of two agent settings, used where neither the command line nor the config file sets them
DEFAULT_TIMELINE = "mfuwatch-demo/timeline.jsonl"
DEFAULT_PROFILE_EVERY = "50 steps"


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mfuwatch demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=_positive_int, default=600, help="optimizer steps (default 600: ~1.5 min on a 2-core CPU)")
    p.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="model preset (default: gpu on CUDA, cpu otherwise)")
    p.add_argument("--batch", type=_positive_int, default=None, help="sequences per micro-batch (default: the preset's)")
    p.add_argument("--seq", type=_positive_int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--port", type=int, default=None, help="exporter base port (0 = any free port; default 9478)")
    p.add_argument("--config", default=None, help="agent YAML config (alerts: etc.)")
    p.add_argument("--run-name", "--run", dest="run", default=None,
                   help="run label (default: the config's run, else $MFUWATCH_RUN, else a name shared by the job's ranks); "
                        "under torchrun spell it --run-name (torchrun claims --run)")
    p.add_argument("--timeline", default=None,
                   help=f"JSONL timeline path ('' = none; default: the config's timeline, else {DEFAULT_TIMELINE})")
    p.add_argument("--report", default="mfuwatch-demo/report.html", help="HTML report written at the end ('' = none)")
    p.add_argument("--summary-json", default=None, help="write the run summary as JSON here")
    p.add_argument("--profile-every", default=None,
                   help=f"profiler window cadence ('off' to disable; default: the config's profile_every, "
                        f"else {DEFAULT_PROFILE_EVERY})")
    p.add_argument("--patch-kernels", action="store_true", help="swap in mfuwatch.kernels' fused drop-ins")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--log-every", type=_positive_int, default=10, help="print progress every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def config_overrides(a: argparse.Namespace, user: Mapping[str, Any], *, shape: DemoShape,
                     device_type: str) -> Tuple[Dict[str, Any], List[str]]:
    """The agent settings the demo lays over the user's config ``user`` (:func:`~.config.user_settings`' mapping),
    and one note per value of ``user`` that the demo replaces.

    Per setting: an option given on the command line (``a``, from :func:`_parse`: None = not given) > the
    config file > the demo's default (:data:`DEFAULT_TIMELINE`, :data:`DEFAULT_PROFILE_EVERY`, ``calibrate``
    off CUDA). Two settings are the demo's own facts and replace the file's, each with a note when the file
    says otherwise: ``model_shape`` (the demo's model) and ``progress`` (False: the demo prints its own lines).
    """
    over: Dict[str, Any] = {}
    notes: List[str] = []
    for key, given, default in (("timeline", a.timeline, DEFAULT_TIMELINE),
                                ("profile_every", a.profile_every, DEFAULT_PROFILE_EVERY),
                                ("run", a.run or None, None), ("port", a.port, None)):
        if given is not None:
            over[key] = None if (key == "timeline" and not given) else given
        elif key not in user and default is not None:
            over[key] = default
    if device_type != "cuda" and "calibrate" not in user:
        over["calibrate"] = True  # no datasheet peak for a CPU: measure a matmul
    over["model_shape"] = {"n_layers": shape.n_layers, "d_model": shape.d_model, "seq_len": shape.seq}
    if user.get("model_shape") is not None:
        notes.append(f"config: model_shape {user['model_shape']} is replaced by the demo model's {over['model_shape']}")
    over["progress"] = False  # the demo prints its own progress lines (and --quiet silences them)
    if user.get("progress", False) is not False:
        notes.append(f"config: progress: {user['progress']} is not used: the demo prints its own progress lines")
    return over, notes


def in_profiler_window(m: Any, sampler: Any) -> bool:
    """Whether the steps of report ``m`` (a ``StepMeasurement``: steps ``m.step - m.steps + 1 .. m.step``) were
    timed with a profiler window in them (``sampler``: the agent's ``ProfilerSampler``, None without windows).
    Such a report's step time includes the profiler's overhead, so its MFU reads low."""
    return sampler is not None and sampler.profiled(m.step - m.steps + 1, m.step)


def _mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def short_source(source: str, width: int = 60) -> str:
    """A peak's source as one short label for the demo's lines: ``source`` itself when at most ``width``
    characters, else its text before the first " (", ",", ";" or " / " (a datasheet citation's title), cut to
    ``width`` characters with "…". The summary JSON and the exporter keep the whole citation."""
    if len(source) <= width:
        return source
    cut = min((i for i in (source.find(sep) for sep in (" (", ",", ";", " / ")) if i > 0), default=len(source))
    head = source[:cut].strip()
    return head if len(head) <= width else head[:width - 1] + "…"


def peak_line(info: Any, calibrate: bool, chosen: bool = False) -> str:
    """The demo's one line about the MFU denominator, from the agent's ``RunInfo`` ``info``.

    The agent chooses the peak when the training dtype is known: at start-up for a ``peak_flops`` or a
    configured ``dtype``, else at the first forward (a ``calibrate`` matmul measured then, in that dtype, or
    the GPU's datasheet row). ``chosen``: the first forward has run. Returns the peak in FLOP/s and its source
    once set, else what it waits for (before the first forward) or that MFU is not reported (after it).
    """
    if info.peak_flops_per_second:
        return f"peak: {info.peak_flops_per_second:.3g} FLOP/s ({short_source(info.peak_source)})"
    if not chosen:
        how = "calibrated at the first forward, in the training dtype" if calibrate else (
            "the datasheet's, for the first forward's dtype")
        return f"peak: not known yet ({how})"
    return "peak: unknown: MFU is not reported (set peak_flops or calibrate: true in --config)"


def run(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the demo; returns the summary dict (also written to ``--summary-json``)."""
    from rich.console import Console
    from rich.table import Table

    from .config import load_config, user_settings
    from .core import Agent
    from .distributed import rank_from_env

    a = _parse(argv)
    try:
        rank, local_rank, world = rank_from_env()
    except ValueError as exc:
        raise DemoError(str(exc)) from None
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))  # a.device: checked by _device
    preset = a.model or ("gpu" if device.type == "cuda" else "cpu")
    shape = PRESETS[preset]
    shape = DemoShape(**{**shape.__dict__, **({"batch": a.batch} if a.batch else {}), **({"seq": a.seq} if a.seq else {})})
    user = user_settings(a.config)  # the file (or $MFUWATCH_CONFIG's), as the user wrote it
    if user:
        load_config(user)  # every value the user wrote is checked, also those the demo replaces (ConfigError)
    overrides, notes = config_overrides(a, user, shape=shape, device_type=device.type)
    cfg = load_config(user, **overrides)
    timeline_ours = "timeline" in overrides  # the demo's or the command line's path, not the file's
    a.timeline = cfg.timeline or ""  # the file's "{rank}" replaced by the rank
    if a.report and a.timeline:
        from .report import missing_dependency

        missing = missing_dependency()
        if missing:
            raise DemoError(f"{missing} (or pass --report '' to run without the report)")
    con = Console(quiet=a.quiet or rank != 0, highlight=False)
    # Kineto prints "USDT: ... profiler_start/stop" at its level 5 for every window; 6 is above all its levels.
    # The demo owns its process, so it silences them unless the user chose a level; Kineto reads the variable
    # when the first profiler window initialises it, which is after this line.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    for note in notes:
        con.print(f"[yellow]{note}[/]")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:  # launched by torchrun: data-parallel over the ranks (NCCL on GPUs, gloo on the CPU)
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(a.seed)
    data = load_stdlib_text()
    batches = ByteBatches(data, shape.batch, shape.seq, device, seed=a.seed + rank)
    model = DemoLM(shape).to(device)
    patch_report = None
    if a.patch_kernels:
        from mfuwatch.kernels import patch

        patch_report = patch(model)
        con.print(str(patch_report))
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            **({"fused": True} if fused else {}))
    fwd = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        fwd = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    fwd = torch.compile(fwd) if a.compile else fwd
    amp = device.type == "cuda"

    if a.timeline and world > 1 and timeline_ours:  # one timeline per rank (a file's path says "{rank}" itself)
        stem = Path(a.timeline)
        a.timeline = str(stem.with_name(f"{stem.stem}.rank{rank}{stem.suffix}"))
        cfg.timeline = a.timeline
    if a.timeline:  # appended to, as every timeline (the report shows the file's last run)
        Path(a.timeline).parent.mkdir(parents=True, exist_ok=True)
    con.print(f"[bold]mfuwatch demo[/]: {preset} model, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
              f"{shape.batch}x{shape.seq} tokens x {a.grad_accum} micro-batches per step, device {device}")
    losses: List[float] = []
    mfus: List[float] = []  # MFU of each report the progress lines showed
    mfus_outside: List[float] = []  # ... of those not timed with a profiler window in them
    tps: List[float] = []
    t0 = time.time()
    interrupted = False
    with Agent(fwd, opt, config=cfg) as agent:  # hooks on what the loop calls (DDP / compiled wrapper)
        con.print(f"exporter: {agent.exporter_url or '(off)'}")
        con.print(peak_line(agent.run_info, cfg.calibrate))
        peak_said = bool(agent.run_info.peak_flops_per_second)
        last_m = None
        step = 0
        try:
          for step in range(1, a.steps + 1):
            for _ in range(a.grad_accum):
                x, y = batches.next()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    logits = fwd(x)
                    loss = F.cross_entropy(logits.float().view(-1, shape.vocab), y.reshape(-1)) / a.grad_accum
                loss.backward()
            agent.record_loss(loss.detach() * a.grad_accum)  # the timeline's loss, read off the training thread
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if not peak_said:  # the first forward chose the peak (measured it, for a calibration)
                con.print(peak_line(agent.run_info, cfg.calibrate, chosen=True))
                peak_said = True
            if step % a.log_every == 0 or step == 1 or step == a.steps:
                lv = loss.item() * a.grad_accum  # host-device sync, once per log interval
                losses.append(lv)
                m = agent.latest  # measured on the agent's thread; it trails the loop by a few steps
                if m is not None and m is not last_m:
                    last_m = m
                    tps.append(m.tokens_per_second)
                    if m.mfu is not None:
                        mfus.append(m.mfu)
                        if not in_profiler_window(m, agent.profiler):
                            mfus_outside.append(m.mfu)
                if m is None:
                    con.print(f"step {step:5d}  loss {lv:6.3f}  (first measurement after {cfg.report_every_steps} steps)")
                else:
                    mfu_s = f"{m.mfu:6.1%}" if m.mfu is not None else "   n/a"
                    window = "  (profiler window)" if in_profiler_window(m, agent.profiler) else ""
                    con.print(f"step {step:5d}  loss {lv:6.3f}  tokens/s {m.tokens_per_second:10.0f}  MFU {mfu_s}"
                              f"  (to step {m.step}){window}", soft_wrap=True)  # one line, however narrow
        except KeyboardInterrupt:  # Ctrl-C: stop training, still flush, summarise and write the report
            con.print(f"[yellow]interrupted at step {step}: finishing the summary[/]")
            a.steps = max(step - 1, 0)
            interrupted = True
        # flush: the last measurement, and the last profiler window if its analysis is still running
        agent.close(timeout=30.0)
    elapsed = time.time() - t0
    info = agent.run_info
    summary = {
        "steps": a.steps, "device": str(device), "model": preset,
        "initial_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        # means over the reports the progress lines showed; the agent's metrics keep every report as measured
        "mean_mfu": _mean(mfus),  # profiler windows included: their steps run slower under the profiler
        "mean_mfu_outside_profiler_windows": _mean(mfus_outside),
        "mean_tokens_per_second": _mean(tps),
        "peak_flops_per_second": info.peak_flops_per_second, "peak_source": info.peak_source,
        "flops_source": info.flops_source, "dtype": info.dtype,
        "exporter_url": agent.exporter_url, "timeline": a.timeline or None, "elapsed_seconds": elapsed,
        "agent_errors": agent.errors.snapshot(),
        "last_window": None,
        "patched": getattr(patch_report, "swapped", None) if patch_report is not None else None,
        "interrupted": interrupted,
    }
    w = agent.latest_window
    if w is not None:
        summary["last_window"] = {"memory_bound_share": w.memory_bound_share, "breakdown": w.breakdown,
                                  "suggestions": [s.kernel for s in w.suggestions]}
    if a.report and a.timeline:
        try:
            from .report.html import write_report

            summary["report"] = str(write_report(a.timeline, a.report))
        except Exception as exc:  # noqa: BLE001 - the run itself succeeded
            con.print(f"[yellow]report not written: {exc}[/]")
    t = Table(title="mfuwatch demo summary")
    t.add_column("measure")
    t.add_column("value", justify="right")
    fmt = lambda v: "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    pct = lambda v: None if v is None else f"{v:.1%}"  # noqa: E731
    summary_view = dict(summary, mean_mfu=pct(summary["mean_mfu"]),
                        mean_mfu_outside_profiler_windows=pct(summary["mean_mfu_outside_profiler_windows"]),
                        peak_source=short_source(summary["peak_source"] or ""))
    labels = {"mean_mfu": "mean_mfu (shown intervals, profiler windows included)",
              "mean_mfu_outside_profiler_windows": "mean_mfu (shown intervals outside profiler windows)"}
    for k in ("steps", "device", "initial_loss", "final_loss", "mean_mfu", "mean_mfu_outside_profiler_windows",
              "mean_tokens_per_second", "peak_flops_per_second", "peak_source", "flops_source", "exporter_url",
              "elapsed_seconds"):
        t.add_row(labels.get(k, k), fmt(summary_view[k]))
    if w is not None:
        t.add_row("memory-bound share (last window)", f"{w.memory_bound_share:.1%}")
    if summary["timeline"]:
        t.add_row("timeline", summary["timeline"])
    if summary.get("report"):
        t.add_row("report", summary["report"])
    con.print(t)
    if w is not None and w.suggestions:
        con.print("suggestions from the last profiler window (existing fixes first; expected gain = share of step time):")
        for s in w.suggestions:
            con.print(f"  {s.kernel:<14} gain {s.expected_gain:5.1%}  {s.apply}", soft_wrap=True)
    if world > 1:
        from .distributed import end_process_group

        summary["rank"], summary["world_size"] = rank, world
        del fwd, model, opt, agent  # what holds the process group goes first (end_process_group says why)
        end_process_group()
    if a.summary_json and world > 1:
        p = Path(a.summary_json)
        a.summary_json = str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))
    if a.summary_json:
        Path(a.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.summary_json).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``mfuwatch demo``. Returns 0 when the loss fell (or, with a single loss reading,
    is finite), 1 otherwise (saying why), 2 for a usage error, 130 when interrupted (Ctrl-C)."""
    from mfuwatch.alerts import AlertConfigError

    from .config import ConfigError

    try:
        s = run(argv)
    except (ConfigError, AlertConfigError, DemoError) as exc:  # bad configuration or arguments: one line, no traceback
        print(f"mfuwatch demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, closing)
        print("mfuwatch demo: interrupted", file=sys.stderr)
        return 130
    if s.get("interrupted"):
        return 130  # 128 + SIGINT, as a shell reports a job stopped by Ctrl-C
    first, last = s["initial_loss"], s["final_loss"]
    if first is None or last is None or not math.isfinite(last):
        print(f"mfuwatch demo: no finite loss was read (final loss {last})", file=sys.stderr)
        return 1
    if s["steps"] <= 1:
        return 0  # one step: one loss reading, nothing to compare
    if not last < first:
        print(f"mfuwatch demo: the loss did not fall ({first:.4f} -> {last:.4f})", file=sys.stderr)
        return 1
    return 0
