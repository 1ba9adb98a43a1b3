"""Predicted against measured: apply each fix the live profiler window suggests and time it.

For each model (Hugging Face classes built from configs, no download), one process trains the model as
written (eager, foreach AdamW, bf16 autocast), times it, then records a profiler window as the agent's
sampler records one and takes the suggestions of the live window's analysis (``analyze_events``, the
function the live window and ``mfuwatch analyze`` share; the trace is kept). Then every suggested fix runs
in a process of its own, from the same weights and batch, and is timed the same way:

================  ===============================================================================
fix               how it is applied
================  ===============================================================================
``fused_adamw``   ``torch.optim.AdamW(..., fused=True)``
``torch_compile`` ``torch.compile(model)``
``cuda_graphs``   ``torch.compile(model, mode="reduce-overhead")``: measured on top of ``torch_compile``
                  when that is suggested too (its prediction is then its gain in the set)
drop-ins          ``mfuwatch.kernels.patch(model, kernels=[name])``
the set           every suggestion not covered by another, together: against the window's combined gain
================  ===============================================================================

Every drop-in ``patch`` applies to both decoders (rms_norm, rotary, cross_entropy, swiglu) is measured alone even
when the window does not suggest it (its predicted gain is then 0: below ``MIN_GAIN``). A drop-in's process
applies it by executing the suggestion's own line (``mfuwatch.kernels.patch(model, kernels=["<name>"])``).

Measured gain = (reference ms/step − fix ms/step) / base ms/step, each ms/step the median over ``--rounds``
processes of each process's median of ``--steps`` synchronized steps after ``--warmup``; rounds alternate the
order (round 2 runs the configurations in reverse), and the table gives the spread of the per-round gains.
With ``--overlap N`` up to N processes are alive: the next ones import, build and run their first (compiling)
step while one, holding a file lock, runs its warm-up and timed steps; the base process, whose profiler window
gives the predictions, always runs alone. ``--reanalyze DIR`` re-derives a finished run's predictions from its
saved windows with the current checkout. Goal (issue 24): every predicted gain within 2 percentage points or 25% of the measured one,
whichever is larger. The parent prints a markdown table and, with ``$OUT`` set, writes ``$OUT/gain_truth.md``,
``$OUT/gain_truth/<model>.jsonl`` (one JSON record per configuration, written as each process finishes),
``$OUT/gain_truth/<model>.window.json.gz`` (the profiler window's trace) and ``children.log`` (their stderr).

    python3 benchmarks/gain_truth.py --models llama               # H200: one model, ~4-5 min
    python3 benchmarks/gain_truth.py --models qwen3 --budget 280  # stop starting processes after 280 s
    python3 benchmarks/gain_truth.py --cpu --tiny                 # CPU smoke test (CI): plumbing, no timing claims
    python3 benchmarks/gain_truth.py --models qwen3 --rounds 2 --overlap 3 --steps 6 --warmup 2   # run 3's
    python3 benchmarks/gain_truth.py --models llama,qwen3 --reanalyze DIR   # DIR: <model>.jsonl + .window.json.gz

Models: ``llama`` (8 layers, d=2048, GQA 16/4, SwiGLU ff 5632, V=32000) and ``qwen3`` (8 layers, d=2048,
16/8 heads of head_dim 128 with q/k RMSNorm, ff 6144, V=151936, tied embeddings); batch 4 x 2048.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hf_step import time_steps, train_step  # noqa: E402  (the step and timing shared with hf_llama_e2e)

BUNDLED = ("rms_norm", "rotary", "swiglu", "cross_entropy", "layer_norm", "geglu")
APPLICABLE = ("fused_adamw", "torch_compile", "cuda_graphs") + BUNDLED
#: the drop-ins ``patch`` applies to both decoders (Llama, Qwen3: RMSNorm, rotary, SwiGLU MLP, LM head + loss)
DECODER_DROPINS = ("rms_norm", "rotary", "cross_entropy", "swiglu")
#: order processes run in: the most telling first, so a budget cut leaves the least telling out
PRIORITY = ("torch_compile", "cuda_graphs", "fused_adamw", "rms_norm", "cross_entropy", "rotary", "swiglu",
            "layer_norm", "geglu")

P = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
P.add_argument("--models", default="llama,qwen3", help="comma-separated: llama, qwen3 (default both)")
P.add_argument("--steps", type=int, default=10, help="timed steps per process (default 10)")
P.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning; default 3)")
P.add_argument("--budget", type=float, default=0.0, help="seconds after which no new process starts (0: none)")
P.add_argument("--timeout", type=int, default=240, help="seconds allowed per child process (default 240)")
P.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: the CI smoke test)")
P.add_argument("--tiny", action="store_true", help="a 2-layer d=64 model, batch 2 x 32 (plumbing check)")
P.add_argument("--rounds", type=int, default=1,
               help="interleaved rounds: every configuration runs once per round, each time in a new process; the "
                    "table gives the median over rounds of each process's median step and the spread (default 1)")
P.add_argument("--overlap", type=int, default=1,
               help="processes alive at once (default 1). With N > 1 the next processes import, build, wrap and run "
                    "their first (compiling) step while one is timed; warm-up and timing hold an exclusive lock, "
                    "so only one process is timed at a time (the base process, which records the window, runs alone)")
P.add_argument("--reanalyze", metavar="DIR",
               help="no processes: re-derive the predictions of a finished run from its saved windows "
                    "(DIR/<model>.window.json.gz, analysed by this checkout's model for DEVICE_NAME, default "
                    "'NVIDIA H200') against its measurements (DIR/<model>.jsonl), and print the table")
P.add_argument("--child", help=argparse.SUPPRESS)  # internal: MODEL:FIX+FIX (or MODEL:base), print one JSON line


def tolerance(measured: float) -> float:
    """The goal's allowed error: 2 percentage points or 25% of the measured gain, whichever is larger."""
    return max(0.02, 0.25 * abs(measured))


# ------------------------------------------------------------------ child: one configuration

def build(model_name: str, tiny: bool, dev: str):
    """(model, input ids) of one model, seeded: every process starts from the same weights and batch."""
    import torch
    import transformers

    if tiny:
        shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128)
        batch, seq, vocab = 2, 32, 512
    else:
        shape = dict(num_hidden_layers=8, hidden_size=2048, num_attention_heads=16)
        batch, seq = 4, 2048
        vocab = 32000 if model_name == "llama" else 151936
    if model_name == "llama":
        if not tiny:
            shape.update(num_key_value_heads=4, intermediate_size=5632)
        cfg = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=seq, **shape)
        cls = transformers.LlamaForCausalLM
    elif model_name == "qwen3":
        if not tiny:
            shape.update(num_key_value_heads=8, intermediate_size=6144)
        head_dim = shape["hidden_size"] // shape["num_attention_heads"]
        cfg = transformers.Qwen3Config(vocab_size=vocab, max_position_embeddings=seq, head_dim=head_dim,
                                       tie_word_embeddings=True, **shape)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise SystemExit(f"--models: unknown {model_name!r}; accepted: llama, qwen3")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = cls(cfg)
    model.train()
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen, device=dev)
    return model, ids


def child(args) -> Dict[str, Any]:
    model_name, spec = args.child.split(":")
    fixes = [] if spec == "base" else spec.split("+")
    dev = "cpu" if args.cpu else "cuda"
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    model, ids = build(model_name, args.tiny, dev)
    swapped = ""
    kernels = [f for f in fixes if f in BUNDLED]
    if kernels:
        import mfuwatch
        import mfuwatch.kernels
        from mfuwatch.kernels import remedies as reg

        lines = {r.kernel: r.apply for r in reg.REMEDIES if r.bundled}
        if len(kernels) == 1 and kernels[0] in lines:
            # exactly the one line the suggestion prints (mfuwatch.kernels.patch(model, kernels=["<name>"]))
            scope = {"mfuwatch": mfuwatch, "model": model}
            exec(compile("report = " + lines[kernels[0]], "<suggestion>", "exec"), scope)
            report = scope["report"]
        else:
            report = mfuwatch.kernels.patch(model, kernels=kernels)
        swapped = ", ".join(f"{k} x{report.count(k)}" for k in dict.fromkeys(s.kernel for s in report.swapped))
    fwd = model
    graphs = "cuda_graphs" in fixes
    if graphs or "torch_compile" in fixes:
        kw = {"backend": "aot_eager"} if args.cpu else ({"mode": "reduce-overhead"} if graphs else {})
        fwd = torch.compile(model, **kw)
    # foreach AdamW, as torch picks it on CUDA by default; fused=True is the fix
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused="fused_adamw" in fixes,
                            foreach=None if "fused_adamw" in fixes else True)
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda")
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None) if graphs else None
    step = train_step(fwd, ids, opt, autocast, before=mark)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    lock = os.environ.get("GAIN_TRUTH_LOCK")
    pre_s, pre_loss = 0.0, None
    if lock:  # --overlap: the first (compiling) step before the lock, warm-up and timing under it
        import fcntl

        t0 = time.perf_counter()
        pre_loss = float(step().detach())
        sync()
        pre_s = time.perf_counter() - t0
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the process exits
        log(f"{spec}: lock taken after a {pre_s:.1f} s first step")
    first, warm_s, times = time_steps(step, sync, args.warmup, args.steps)
    first = first if pre_loss is None else pre_loss
    out: Dict[str, Any] = {"model": model_name, "config": spec, "ms": times, "median_ms": statistics.median(times),
                           "first_loss": first, "warmup_s": warm_s + pre_s, "swapped": swapped}
    log(f"{spec}: median {out['median_ms']:.1f} ms after {warm_s:.1f} s of warm-up")
    if spec == "base":
        out["window"] = window_of(step, sync, args, model_name)
        log("window analysed")
    return out


def window_of(step, sync, args, model_name: str) -> Optional[Dict[str, Any]]:
    """A profiler window over this training loop, as the agent's sampler records one (CPU + CUDA activities,
    ``record_shapes=True``, 1 warm-up + 3 active steps), analysed by the function the live window and
    ``mfuwatch analyze`` share (:func:`mfuwatch.agent.analysis.analyze.analyze_events`, the window's own step
    time as the gains' denominator). The trace is kept as ``$OUT/gain_truth/<model>/window.json.gz``."""
    import gzip
    import shutil
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from mfuwatch.agent.device.peaks import resolve_peaks

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() and not args.cpu else [])
    tmp = tempfile.mkdtemp(prefix="gain_truth_")
    raw = os.path.join(tmp, "window.json")
    with profile(activities=acts, record_shapes=True, schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(raw)) as prof:
        for _ in range(4):
            step()
            sync()
            prof.step()
    log(f"trace {os.path.getsize(raw) / 1e6:.1f} MB")
    out_dir = os.environ.get("OUT")
    if out_dir:
        d = os.path.join(out_dir, "gain_truth")
        os.makedirs(d, exist_ok=True)
        with open(raw, "rb") as src, gzip.open(os.path.join(d, f"{model_name}.window.json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    if args.cpu:
        from mfuwatch.agent.device.calibrate import calibrate_bandwidth, calibrate_matmul

        spec, device = {"peak_flops": {"fp32": calibrate_matmul("cpu", torch.float32)},
                        "memory_bandwidth_bytes_per_second": calibrate_bandwidth("cpu")}, "cpu"
    else:
        spec, device = resolve_peaks(torch.cuda.get_device_name(), warn=False), "cuda"
    rec = analyse(raw, spec, device)
    shutil.rmtree(tmp, ignore_errors=True)
    return rec


def analyse(path: str, spec, device: str) -> Dict[str, Any]:
    """The window record of a saved trace (``.json`` or ``.json.gz``), by the live window's analysis."""
    from mfuwatch.agent.analysis.analyze import analyze_events
    from mfuwatch.agent.analysis.trace import read_trace
    from mfuwatch.agent.schema import to_record

    return to_record("window", analyze_events(read_trace(path).events(), spec_or_peaks=spec, device_type=device))


def log(text: str) -> None:
    """A progress line on stderr (the parent keeps it in ``<config>.log``)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ parent

class Child:
    """One configuration's process, started at once; :meth:`result` waits for its JSON line."""

    def __init__(self, model: str, spec: str, args, lock: Optional[str]) -> None:
        import tempfile

        self.model, self.spec, self.args = model, spec, args
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{model}:{spec}", "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--cpu"] if args.cpu else []) + (["--tiny"] if args.tiny else [])
        env = dict(os.environ)
        if lock:
            env["GAIN_TRUTH_LOCK"] = lock
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, text=True, env=env)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self) -> Dict[str, Any]:
        args, model, spec = self.args, self.model, self.spec
        timed_out = False
        try:
            self.proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            timed_out = True
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read(), self.err.read()
        out_dir = os.environ.get("OUT")
        if out_dir:  # every child's stderr in one file (few files under $OUT: the device returns a limited number)
            os.makedirs(os.path.join(out_dir, "gain_truth"), exist_ok=True)
            with open(os.path.join(out_dir, "gain_truth", "children.log"), "a") as f:
                f.write(f"===== {model}:{spec}\n{err}\n")
        if timed_out:
            return {"model": model, "config": spec, "error": f"timed out after {args.timeout} s",
                    "log_tail": err.strip().splitlines()[-3:]}
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                res = json.loads(line)
                res["wall_s"] = time.perf_counter() - self.t0
                return res
        tail = (err or out).strip().splitlines()[-3:] or ["no output"]
        return {"model": model, "config": spec, "error": f"exit {self.proc.returncode}: {' | '.join(tail)[:400]}"}


def run_child(model: str, spec: str, args) -> Dict[str, Any]:
    """Run one configuration alone (no lock) and return its record."""
    return Child(model, spec, args, None).result()


def plan(window: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The rows to measure from a window record: one per suggestion with a fix to apply, then the set.

    Each row: ``kernel``, ``spec`` (the fixes of its process), ``ref`` (the spec its gain is measured
    from: "base", or "torch_compile" for CUDA graphs after compile), ``predicted``, ``claim`` (which of
    the window's numbers it checks).
    """
    sugg = window.get("suggestions") or []
    kernels = [s["kernel"] for s in sugg]
    rows = []
    for s in sugg:
        k = s["kernel"]
        if k not in APPLICABLE:
            rows.append({"kernel": k, "spec": None, "note": "no automatic fix in this benchmark"})
            continue
        if k == "cuda_graphs" and "torch_compile" in kernels and kernels.index("torch_compile") < kernels.index(k):
            rows.append({"kernel": k, "spec": "cuda_graphs", "ref": "torch_compile", "claim": "in set (on top of compile)",
                         "predicted": s.get("gain_in_set") if s.get("gain_in_set") is not None else s["expected_gain"]})
            continue
        claim = "alone" + (f"; in set: covered by {s['covered_by']}" if s.get("covered_by") else "")
        rows.append({"kernel": k, "spec": k, "ref": "base", "claim": claim, "predicted": s["expected_gain"]})
    for k in DECODER_DROPINS:  # a drop-in the window did not suggest is measured too: its predicted gain is < MIN_GAIN
        if k not in kernels:
            rows.append({"kernel": k, "spec": k, "ref": "base", "claim": "alone; not suggested", "predicted": 0.0})
    rows.sort(key=lambda r: PRIORITY.index(r["kernel"]) if r["kernel"] in PRIORITY else len(PRIORITY))
    members = [s["kernel"] for s in sugg if not s.get("covered_by") and s["kernel"] in APPLICABLE]
    if len(members) > 1 and window.get("combined_gain") is not None:
        rows.insert(min(3, len(rows)), {"kernel": "set: " + " + ".join(members), "spec": "+".join(members),
                                        "ref": "base", "claim": "combined gain", "predicted": window["combined_gain"]})
    return rows


def median_of(recs: List[Dict[str, Any]]) -> Optional[float]:
    """The median over rounds of the processes' median ms/step (None when no round has one)."""
    vals = [r["median_ms"] for r in recs if "median_ms" in r]
    return statistics.median(vals) if vals else None


def measure(rows: List[Dict[str, Any]], results: Dict[str, List[Dict[str, Any]]]) -> None:
    """Each row's measured gain: (median ref ms − median fix ms) / median base ms over rounds, and the spread
    (min, max) of the per-round gains, round i of the fix against round i of its reference."""
    base = median_of(results.get("base", []))
    for row in rows:
        if row["spec"] is None:
            continue
        fix, ref = results.get(row["spec"], []), results.get(row["ref"], [])
        mf, mr = median_of(fix), median_of(ref)
        if mf is None or mr is None or base is None:
            errs = [r.get("error") for r in fix + ref if r.get("error")]
            row["error"] = errs[0] if errs else "not run"
            continue
        row["measured"] = (mr - mf) / base
        per = [(r0["median_ms"] - r1["median_ms"]) / base for r0, r1 in zip(ref, fix)
               if "median_ms" in r0 and "median_ms" in r1]
        row["spread"] = (min(per), max(per)) if per else None
        row["rounds"] = len(per)
        row["ok"] = abs(row["predicted"] - row["measured"]) <= tolerance(row["measured"])


def main() -> int:
    args = P.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    if args.reanalyze:
        return reanalyze(args)
    t_start = time.monotonic()
    out_dir = os.environ.get("OUT")
    models = [m for m in args.models.split(",") if m]
    sections, failed = [], False
    import tempfile

    lock = os.path.join(tempfile.mkdtemp(prefix="gain_truth_lock_"), "gpu.lock") if args.overlap > 1 else None
    for model in models:
        results: Dict[str, List[Dict[str, Any]]] = {}

        def record(r: Dict[str, Any], rnd: int) -> None:
            r["round"] = rnd
            results.setdefault(r["config"], []).append(r)
            status = r.get("error") or f"median {r['median_ms']:.1f} ms, first loss {r['first_loss']:.4f}, " \
                                       f"{r.get('wall_s', 0):.0f} s"
            print(f"{model} round {rnd} {r['config']}: {status}", flush=True)
            if out_dir:  # one JSON line per configuration, written as each finishes
                os.makedirs(os.path.join(out_dir, "gain_truth"), exist_ok=True)
                with open(os.path.join(out_dir, "gain_truth", f"{model}.jsonl"), "a") as f:
                    f.write(json.dumps(r) + "\n")

        base = run_child(model, "base", args)  # alone: nothing else on the machine while the window is recorded
        base["config"] = "base"
        record(base, 1)
        window = base.get("window")
        if "error" in base or not window:
            sections.append(f"## {model}\n\nbase: {base.get('error') or 'the agent produced no profiler window'}\n")
            failed = True
            continue
        rows = plan(window)
        specs = list(dict.fromkeys([x for r in rows if r["spec"] for x in (r["spec"], r["ref"])]))
        # compiling and eager configurations alternate: an eager one is timed while a compiling one prepares
        slow = [sp for sp in specs if "torch_compile" in sp or "cuda_graphs" in sp]
        fast = [sp for sp in specs if sp not in slow]
        specs = [sp for pair in zip(slow + [None] * len(fast), fast + [None] * len(slow)) for sp in pair if sp]
        queue = []
        for rnd in range(1, args.rounds + 1):
            order = specs if rnd % 2 else list(reversed(specs))  # interleaved: alternate the order per round
            queue += [(rnd, sp) for sp in order if not (rnd == 1 and sp == "base")]
        alive: List[Any] = []
        while queue or alive:
            while queue and len(alive) < max(1, args.overlap):
                rnd, sp = queue.pop(0)
                if args.budget and time.monotonic() - t_start > args.budget:
                    record({"model": model, "config": sp, "error": f"not run: past the {args.budget:.0f} s budget"}, rnd)
                    continue
                alive.append((rnd, Child(model, sp, args, lock)))
            if alive:  # the first to finish (the lock serialises the timing; preparation overlaps)
                while not any(ch.done() for _, ch in alive) and not any(
                        time.perf_counter() - ch.t0 > args.timeout for _, ch in alive):
                    time.sleep(0.2)
                i = next((j for j, (_, ch) in enumerate(alive) if ch.done()), 0)
                rnd, ch = alive.pop(i)
                record(ch.result(), rnd)
        measure(rows, results)
        sections.append(section(model, results, window, rows, args.rounds))
        failed |= any(r.get("ok") is False for r in rows)
    import torch

    dev = "cpu" if args.cpu or not torch.cuda.is_available() else torch.cuda.get_device_name()
    text = (f"# Suggested gains against measured ({dev}, torch {torch.__version__})\n\n"
            f"{'tiny 2-layer d=64 models, batch 2 x 32 (plumbing check: no timing claims)' if args.tiny else '8 layers, d=2048, batch 4 x 2048, bf16 autocast, foreach AdamW'}; "
            f"{args.steps} timed steps after {args.warmup} warm-up, each configuration in its own process, "
            f"{args.rounds} interleaved round(s); ms/step = median over rounds of each process's median, "
            f"spread = min..max of the per-round gains. "
            f"Goal: |predicted − measured| ≤ max(2 points, 25% of measured).\n\n" + "\n".join(sections))
    print(text, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "gain_truth.md"), "w") as f:
            f.write(text + "\n")
    return 1 if failed and not args.tiny else 0


def reanalyze(args) -> int:
    """``--reanalyze DIR``: the table of a finished run, its windows analysed by this checkout."""
    from mfuwatch.agent.device.peaks import resolve_peaks

    device = os.environ.get("DEVICE_NAME", "NVIDIA H200")
    spec = resolve_peaks(device, warn=False)
    sections = []
    for model in [m for m in args.models.split(",") if m]:
        results: Dict[str, List[Dict[str, Any]]] = {}
        with open(os.path.join(args.reanalyze, f"{model}.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                results.setdefault(r["config"], []).append(r)
        window = analyse(os.path.join(args.reanalyze, f"{model}.window.json.gz"), spec, "cuda")
        rows = plan(window)
        measure(rows, results)
        rounds = max((r.get("round", 1) for rs in results.values() for r in rs), default=1)
        sections.append(section(model, results, window, rows, rounds))
    print(f"# Suggested gains against measured ({device}; predictions re-derived from the saved windows)\n\n"
          + "\n".join(sections), flush=True)
    return 0


def section(model: str, results: Dict[str, List[Dict[str, Any]]], window: Dict[str, Any],
            rows: List[Dict[str, Any]], rounds: int) -> str:
    bases = [r for r in results.get("base", []) if "median_ms" in r]
    bm = median_of(bases)
    per_round = ", ".join(f"{r['median_ms']:.1f}" for r in bases)
    lines = [f"## {model}: base {bm:.1f} ms/step (per-round medians {per_round}); window step "
             f"{(window.get('step_time_seconds') or 0) * 1e3:.1f} ms", "",
             "| suggestion | what is checked | predicted | measured | spread (rounds) | within goal | ms/step (from) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["spec"] is None:
            lines.append(f"| {r['kernel']} | {r['note']} | | | | | |")
            continue
        pred = f"{r['predicted']:.1%}"
        if "measured" not in r:
            lines.append(f"| {r['kernel']} | {r['claim']} | {pred} | — ({r.get('error', 'not run')[:80]}) | | | |")
            continue
        sp = r.get("spread")
        spread = f"{sp[0]:.1%}..{sp[1]:.1%} ({r['rounds']})" if sp else ""
        ms = f"{median_of(results[r['spec']]):.1f} ({r['ref']} {median_of(results[r['ref']]):.1f})"
        lines.append(f"| {r['kernel']} | {r['claim']} | {pred} | {r['measured']:.1%} | {spread} | "
                     f"{'yes' if r['ok'] else 'NO'} | {ms} |")
    lines += ["", "Window suggestions (alone / in set):", ""]
    for s in window.get("suggestions") or []:
        in_set = f"covered by {s['covered_by']}" if s.get("covered_by") else (
            f"{s['gain_in_set']:.1%}" if s.get("gain_in_set") is not None else "?")
        lines.append(f"- {s['kernel']} ({s['kind']}): {s['expected_gain']:.1%} / {in_set}; ops {', '.join(s['ops'])[:120]}")
    if window.get("combined_gain") is not None:
        lines.append(f"- combined gain of the set: {window['combined_gain']:.1%}")
    recs = [r for rs in results.values() for r in rs]
    swapped = sorted({f"{r['config']}: {r['swapped']}" for r in recs if r.get("swapped")})
    losses = sorted({f"{r['config']} {r['first_loss']:.4f}" for r in recs if "first_loss" in r})
    lines += ["", "Swapped by patch: " + ("; ".join(swapped) or "n/a"),
              "First-step losses (same weights and batch): " + "; ".join(losses), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
