"""Step-time cost of the profiler sampler on one GPU: during a window, while it is analysed, and after.

Runs the Llama-style step of the H200 fixture traces (``_llama_workload.py``) and times every
step (``torch.cuda.synchronize()`` at each step end, the sampler's ``on_step`` included in the
step it ends), in phases:

* ``baseline``: no sampler;
* ``idle``: sampler attached, no window due (the cost of ``on_step`` itself);
* ``in window``: warm-up and recorded steps;
* ``window end``: the step whose boundary stops the trace, exports it and spawns the analysis child;
* ``while analysing``: steps while the child process parses the trace (the GIL question);
* ``after``: steps after the analysis returned (the CUPTI-left-attached question);
* ``naive thread``: for comparison, one window whose ``prof.key_averages()`` (i.e. ``prof.events()``)
  runs on a thread of the training process.

Cost of a window = Σ (step − baseline median) over its window, end and analysing steps;
amortised at the default cadence (one window per 300 s) and at this run's cadence.

    python3 benchmarks/profiler_overhead.py            # ~1-2 min on an H200; results in $OUT

Prints a table; writes ``$OUT/profiler_overhead.json``. Exits non-zero if a window fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama_workload import make_step  # noqa: E402

from mfuwatch.agent.device import peaks  # noqa: E402
from mfuwatch.agent.live.profiler import ProfilerSampler  # noqa: E402
from mfuwatch.agent.schema import BUSY_CATEGORIES  # noqa: E402

DEFAULT_CADENCE_SECONDS = 300.0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, after=None) -> float:
    t0 = time.perf_counter()
    step()
    _sync()
    if after is not None:
        after()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--every-steps", type=int, default=40, help="window cadence for this run (steps)")
    ap.add_argument("--baseline-steps", type=int, default=60)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script, not timings)")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    small = dict(d=128, ff=256, vocab=512, heads=4, batch=2, seq=64) if a.cpu_smoke else {}
    step = make_step(layers=a.layers, device=dev.type, **small)
    for _ in range(10):
        timed(step)
    baseline = [timed(step) for _ in range(a.baseline_steps)]
    base = statistics.median(baseline)

    # cost of on_step when nothing is due
    idle_sampler = ProfilerSampler(every_steps=10 ** 9, device=dev, peaks=None, on_window=print, on_error=print)
    t0 = time.perf_counter_ns()
    for i in range(100_000):
        idle_sampler.on_step(i, 0.02)
    on_step_ns = (time.perf_counter_ns() - t0) / 100_000
    idle_sampler.close()

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    spec = peaks.resolve_peaks(name=name) if dev.type == "cuda" else None
    windows, errors = [], []
    done = threading.Event()
    sampler = ProfilerSampler(every_steps=a.every_steps, warmup_steps=1, active_steps=3, device=dev, peaks=spec,
                              top_k=8, on_window=lambda w: (windows.append(w), done.set()),
                              on_error=lambda c, e: (errors.append(f"{c}: {e!r}"), done.set()))
    phases = {k: [] for k in ("idle", "in window", "window end", "while analysing", "after")}
    n, was_in_window, seen_windows = 0, False, 0
    t_start = time.perf_counter()
    while seen_windows < a.windows and n < 20_000:
        n += 1
        in_window = sampler._prof is not None
        analysing = sampler._busy
        dt = timed(step, lambda: sampler.on_step(n, base))
        if in_window and sampler._prof is None:
            phases["window end"].append(dt)
        elif in_window:
            phases["in window"].append(dt)
        elif analysing:
            phases["while analysing"].append(dt)
        elif seen_windows or was_in_window:
            phases["after"].append(dt)
        else:
            phases["idle"].append(dt)
        was_in_window = was_in_window or in_window
        seen_windows = len(windows) + len(errors)
    for _ in range(30):
        phases["after"].append(timed(step, lambda: sampler.on_step(n, base)))
    run_seconds = time.perf_counter() - t_start
    sampler.close()

    # naive: process the window's events on a thread of this process
    naive = []
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(3):
            step()
        _sync()
    worker = threading.Thread(target=lambda: prof.key_averages())
    worker.start()
    while worker.is_alive():
        naive.append(timed(step))
    worker.join()

    ok = len(windows) == a.windows and not errors
    extra = sum(sum(t - base for t in phases[k]) for k in ("in window", "window end", "while analysing"))
    per_window = extra / max(1, len(windows))
    rows = [("baseline (no sampler)", baseline)] + list(phases.items()) + [("naive thread (events())", naive)]
    print(f"{name}, torch {torch.__version__}, Llama-style {a.layers} layers, "
          f"window = 1 warm-up + 3 recorded steps every {a.every_steps} steps; on_step when idle: {on_step_ns:.0f} ns")
    print(f"{'phase':28s} {'steps':>6s} {'median ms':>10s} {'mean ms':>9s} {'vs baseline':>12s}")
    for name, ts in rows:
        if ts:
            med = statistics.median(ts)
            print(f"{name:28s} {len(ts):6d} {med * 1e3:10.2f} {statistics.fmean(ts) * 1e3:9.2f} "
                  f"{med / base - 1:+12.1%}")
    after = statistics.median(phases["after"]) if phases["after"] else float("nan")
    print(f"extra time per window {per_window * 1e3:.1f} ms; amortised: {per_window / DEFAULT_CADENCE_SECONDS:.3%} at "
          f"one window / {DEFAULT_CADENCE_SECONDS:.0f} s (goal < 1%), {extra / run_seconds:.2%} at this run's cadence")
    print(f"step after / before the windows: {after / base:.3f} (goal 1.00); windows {dict(sampler.windows)}; "
          f"lasting slowdown flagged: {sampler.lasting_slowdown}")
    if windows:
        w = windows[-1]
        busy = sum(w.breakdown[c] for c in BUSY_CATEGORIES)
        print(f"last window: memory-bound {w.memory_bound_share:.1%}, idle {w.breakdown['idle']:.1%}, busy shares sum "
              f"{busy:.6f}; suggestions: " + ", ".join(f"{s.kernel} {s.expected_gain:.1%}" for s in w.suggestions))
    for e in errors:
        print("ERROR", e)
    result = {"device": name, "torch": torch.__version__, "layers": a.layers,
              "on_step_idle_ns": on_step_ns, "baseline_median_s": base,
              "phases": {k: v for k, v in rows}, "extra_seconds_per_window": per_window,
              "amortised_default_cadence": per_window / DEFAULT_CADENCE_SECONDS, "after_over_before": after / base,
              "windows": dict(sampler.windows), "errors": errors,
              "last_window": windows[-1].__dict__ if windows else None}
    with open(out / "profiler_overhead.json", "w") as f:
        json.dump(result, f, indent=1, default=lambda o: getattr(o, "__dict__", str(o)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
