"""``mfuwatch analyze TRACE``: time breakdown, top ops and suggestions of a saved profiler trace.

Reads any chrome trace exported by ``torch.profiler`` (``.json`` or ``.json.gz``),
streaming (memory stays bounded on multi-GB traces), and prints the breakdown
(compute-bound / memory-bound / communication / other, and idle), the top ops with
their share and bound, and the ranked suggestions with their expected gain — as tables,
or as one JSON ``WindowMeasurement`` record with ``--json``.

Peak FLOP/s and bandwidth come from :func:`mfuwatch.agent.device.peaks.resolve_peaks` (the resolver
the agent uses): the GPU named by ``--gpu``, else the trace's ``deviceProperties[0].name``,
with ``--peak-flops``/``--bandwidth`` overriding the table row; ``--peaks FILE`` reads a whole
:class:`~mfuwatch.agent.device.peaks.Peaks` as JSON instead (the profiler sampler passes the agent's
peaks to its child process this way). Exit status: 0 on success, 1 when the file is not a
readable trace (not JSON, truncated, nested deeper than any profiler trace, events of the
wrong shape, no GPU activity), the GPU is unknown or ``--output`` cannot be written (one
line on stderr, no traceback), 2 on usage errors (e.g. ``--steps -1``). ``--json`` never
prints NaN or Infinity (JSON has neither): a value that is not finite is ``null``.

    mfuwatch analyze trace.json.gz
    mfuwatch analyze trace.json --json --steps 3 --step-time 0.0267
    mfuwatch analyze cpu_trace.json --device cpu --peak-flops fp32=2e11 --bandwidth 2e10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..device.peaks import PEAK_KEYS, Peaks, resolve_peaks
from ..schema import WindowMeasurement, to_record
from . import opcost
from .roofline import build_window, measure
from .suggest import suggest_set
from .trace import GPU_CATEGORIES, TraceError, TraceIndex, read_trace

_DTYPES = PEAK_KEYS
#: why a trace or window gives no breakdown on a GPU: the reason, not a symptom such as the missing GPU name
NO_GPU_ACTIVITY = ("the trace has no GPU activity (no kernel, memcpy or memset events in the window): it was "
                   "recorded without ProfilerActivity.CUDA, on a CPU run, or while no GPU work ran")


def _has_gpu_activity(events: Iterable[Dict[str, Any]]) -> bool:
    """Whether any event is a GPU activity (:data:`~.trace.GPU_CATEGORIES`); stops at the first one."""
    return any(isinstance(ev, dict) and ev.get("cat") in GPU_CATEGORIES for ev in events)


def analyze_events(events_iter: Iterable[Dict[str, Any]], *, spec_or_peaks: Any, steps: Optional[int] = None,
                   step_time_seconds: Optional[float] = None, top_k: int = 8, registry: Optional[Sequence] = None,
                   device_type: str = "cuda", step: int = 0, timestamp: Optional[float] = None) -> WindowMeasurement:
    """Breakdown, top ops and suggestions of one profiler window: the function the live sampler and
    ``mfuwatch analyze`` share.

    Args:
        events_iter: chrome-trace event dicts (e.g. ``read_trace(path).events()``); streamed once.
        spec_or_peaks: a :class:`~mfuwatch.agent.device.peaks.Peaks`, a ``GpuSpec`` or a mapping with ``peak_flops``
            (FLOP/s per dtype) and ``memory_bandwidth_bytes_per_second`` (:meth:`Peaks.from_any`).
        steps: training steps in the window (None: inferred, see :func:`~.roofline.build_window`).
        step_time_seconds: step time measured outside the window, for the Amdahl gains; None ⇒
            window wall time / steps.
        top_k: how many ops to keep in ``top_ops`` (bounded metric cardinality).
        registry: remedies to match (default ``mfuwatch.kernels.remedies.REMEDIES``).
        device_type: "cuda" (GPU activities are the kernels) or "cpu" (each CPU op's self time is).

    Returns:
        WindowMeasurement; ``breakdown`` busy categories sum to 1 when any activity was seen.

    Raises:
        ValueError: bad peaks.
        TraceError: no events, no GPU activity (``device_type="cuda"``) or no CPU ops (``"cpu"``), or a
            truncated/corrupt streaming source.
    """
    peaks = Peaks.from_any(spec_or_peaks)
    index = TraceIndex.build(events_iter)
    if index.events_seen == 0:
        raise TraceError("the trace has no events")
    if device_type != "cpu" and index.n_kernels == 0:
        raise TraceError(NO_GPU_ACTIVITY + "; for a CPU-only trace use device_type='cpu' (--device cpu)")
    if device_type == "cpu" and not any(k == 0 for k in index.op_kind):
        raise TraceError("the trace has no CPU ops")
    w = build_window(index, peaks, steps=steps, device_type=device_type)
    st = step_time_seconds or (w.wall_seconds / w.steps if w.steps and w.wall_seconds > 0 else None)
    sugg, combined = suggest_set(w, step_time_seconds=st, registry=registry) if st else ([], None)
    return measure(w, top_k=top_k, step_time_seconds=st, suggestions=sugg, step=step, timestamp=timestamp,
                   combined_gain=combined if sugg else None)


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not v > 0 or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return v
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mfuwatch analyze", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="chrome trace exported by torch.profiler (.json or .json.gz)")
    p.add_argument("--json", action="store_true", help="print one JSON WindowMeasurement record")
    p.add_argument("--output", metavar="FILE", help="write the output to FILE instead of stdout")
    p.add_argument("--steps", type=_positive(int), help="training steps in the trace (default: ProfilerStep# or "
                                             "Optimizer.step# annotations, else 1)")
    p.add_argument("--step-time", type=_positive(float), metavar="SECONDS",
                   help="step time measured outside the profiler, for the gains (default: wall / steps)")
    p.add_argument("--gpu", help="GPU name for the peak table (default: the trace's deviceProperties)")
    p.add_argument("--peak-flops", action="append", default=[], metavar="DTYPE=FLOP/S",
                   help=f"dense peak FLOP/s per dtype ({', '.join(_DTYPES)}), e.g. bf16=989e12; repeatable")
    p.add_argument("--bandwidth", type=_positive(float), metavar="BYTES/S", help="peak memory bandwidth, e.g. 4.8e12")
    p.add_argument("--measured-bandwidth", type=_positive(float), metavar="BYTES/S",
                   help="calibrated bandwidth for the replacement times (default: from the window)")
    p.add_argument("--fp32-matmul", choices=("fp32", "tf32"), default="fp32",
                   help="unit fp32 matmuls ran on (tf32 when torch allowed TF32)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a CPU-only trace, each op's self time acts as a kernel (needs --peak-flops fp32=… --bandwidth)")
    p.add_argument("--peaks", metavar="FILE", help="peaks as JSON (the fields of mfuwatch.agent.device.peaks.Peaks); "
                                                "replaces --gpu, --peak-flops, --bandwidth and --fp32-matmul")
    p.add_argument("--top-k", type=_positive(int), default=8, help="ops to list (default 8)")
    p.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)  # the live sampler's child
    return p


def _peaks_from_args(args: argparse.Namespace, device_properties: List[Dict[str, Any]]) -> Tuple[Peaks, str]:
    """The :class:`Peaks` of the run and the GPU's name as given (``--gpu``, else the trace's):
    ``--peaks FILE``, else :func:`resolve_peaks` of that name and the flags.

    Raises:
        ValueError: a malformed ``--peak-flops``, an unreadable ``--peaks`` file, or an unknown GPU
            without both ``--peak-flops`` and ``--bandwidth``.
    """
    if args.peaks:
        try:
            with open(args.peaks, encoding="utf-8") as f:
                p = Peaks.from_any(json.load(f))
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"--peaks: cannot read {args.peaks}: {exc}") from None
        if args.measured_bandwidth:
            p.measured_bandwidth_bytes_per_second = args.measured_bandwidth
        return p, p.name
    flops: Dict[str, float] = {}
    for item in args.peak_flops:
        key, _, val = item.partition("=")
        try:
            flops[key] = float(val)
        except ValueError:
            key = ""
        if key not in _DTYPES or not 0 < flops.get(key, 0) < float("inf"):
            raise ValueError(f"--peak-flops: expected DTYPE=FLOP/S with DTYPE in {', '.join(_DTYPES)}, got {item!r}")
    name = args.gpu or (device_properties[0].get("name") if device_properties else None)
    p = resolve_peaks(name if args.device == "cuda" else None, peak_flops=flops,
                      memory_bandwidth_bytes_per_second=args.bandwidth,
                      measured_bandwidth_bytes_per_second=args.measured_bandwidth, fp32_matmul=args.fp32_matmul,
                      warn=False)
    if p is None:
        what = f"GPU {name!r} is not in the peak table" if name else "no GPU name in the trace"
        raise ValueError(f"{what}: pass --peak-flops DTYPE=FLOP/S (e.g. fp32=67e12 --peak-flops bf16=989e12) "
                         f"and --bandwidth BYTES/S")
    return p, name or ""


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``mfuwatch analyze``; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    opcost.import_formulas_without_triton()  # this process reads a trace: no Triton kernels to count (-75 MB)
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError:
            pass
    try:
        tf = read_trace(args.trace)
        try:
            peaks, gpu = _peaks_from_args(args, tf.device_properties)
        except ValueError:
            # no GPU name because the profiler saw no GPU: say that, not "no GPU name" (one more pass, only here)
            if (args.device == "cuda" and not args.peaks and not args.gpu and not tf.device_properties
                    and not _has_gpu_activity(tf.events())):
                raise TraceError(f"{args.trace}: {NO_GPU_ACTIVITY}; for a CPU-only trace pass --device cpu "
                                 "--peak-flops fp32=FLOP/S --bandwidth BYTES/S") from None
            raise
        wm = analyze_events(tf.events(), spec_or_peaks=peaks, steps=args.steps, step_time_seconds=args.step_time,
                            top_k=args.top_k, device_type=args.device, timestamp=os.path.getmtime(args.trace))
    except (TraceError, ValueError) as exc:
        print(f"mfuwatch analyze: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"mfuwatch analyze: error: {args.trace}: out of memory while indexing the trace", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a malformed trace is a one-line error, not a traceback
        print(f"mfuwatch analyze: error: {args.trace}: events of an unexpected shape "
              f"({type(exc).__name__}: {_one_line(exc)})", file=sys.stderr)
        return 1
    if args.json:
        rec = to_record("window", wm)
        rec["analysis"] = {"trace": args.trace, "gpu": gpu, "peak_flops": peaks.peak_flops,
                           "memory_bandwidth_bytes_per_second": peaks.memory_bandwidth_bytes_per_second,
                           "peaks": peaks.to_dict()}
        from ..live.timeline import _clean

        text = json.dumps(_clean(rec), allow_nan=False)  # NaN/Infinity → null: strict JSON readers accept it
    else:
        text = render(wm, title=f"{args.trace} ({gpu or args.device})")
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as exc:
            print(f"mfuwatch analyze: error: cannot write --output {args.output}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
    else:
        try:
            print(text)
            sys.stdout.flush()
        except BrokenPipeError:  # e.g. piped into `head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def render(wm: Any, title: str = "") -> str:
    """The human-readable tables of a :class:`WindowMeasurement` (rich, rendered to text)."""
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), record=True, width=120, force_terminal=False, color_system=None)
    step = f"{wm.step_time_seconds * 1e3:.2f} ms/step" if wm.step_time_seconds else "step time unknown"
    console.print(f"{title}\n{wm.steps} steps, wall {wm.wall_seconds * 1e3:.2f} ms, GPU busy {wm.busy_seconds * 1e3:.2f} ms, "
                  f"{step}, {wm.kernels_per_step:.0f} kernels/step, mean kernel {wm.mean_kernel_seconds * 1e6:.1f} µs")
    t = Table(title="Time breakdown")
    t.add_column("category")
    t.add_column("share", justify="right")
    for k, v in wm.breakdown.items():
        t.add_row(k, f"{v:.1%}" + ("  of wall time" if k == "idle" else "  of kernel time"))
    console.print(t)
    t = Table(title="Top ops (share of kernel time)")
    for c, j in (("op", "left"), ("bound", "left"), ("share", "right"), ("ms/step", "right"), ("kernels", "right"),
                 ("FLOP/B", "right")):
        t.add_column(c, justify=j)
    for o in wm.top_ops:
        ai = "" if o.arithmetic_intensity is None else f"{o.arithmetic_intensity:.3g}"
        t.add_row(o.op, o.bound, f"{o.share:.1%}", f"{o.time_seconds * 1e3 / max(wm.steps, 1):.3f}", str(o.kernels), ai)
    console.print(t)
    t = Table(title="Suggestions")
    if wm.suggestions:  # the legend on a line of its own: a table title wraps at the (narrow) table's width
        console.print("Suggestions, existing fixes first: alone = applied by itself, in set = on top of those above",
                      soft_wrap=True)
    for c in ("kernel", "kind", "alone", "in set", "ms/step"):
        t.add_column(c, justify="right" if c in ("alone", "in set", "ms/step") else "left")
    for s in wm.suggestions:
        in_set = (f"covered by {s.covered_by}" if s.covered_by else
                  "" if s.gain_in_set is None else f"{s.gain_in_set:.1%}")
        t.add_row(s.kernel, s.kind, f"{s.expected_gain:.1%}", in_set, f"{s.time_seconds * 1e3:.3f}")
    console.print(t if wm.suggestions else "No suggestion with an expected gain of 0.5% or more.")
    if wm.suggestions:
        # the lines that apply the fixes, each whole on one line (soft_wrap): a table cell wraps them at the
        # console width, and a line broken after `optimizer =` is not Python one can paste
        width = max(len(s.kernel) for s in wm.suggestions)
        console.print("Apply (one line each):")
        assigned: dict = {}  # `model = torch.compile(model, mode=...)` replaces `model = torch.compile(model)`
        for s in wm.suggestions:
            target = s.apply.split(" = ", 1)[0] if " = " in s.apply and "(" not in s.apply.split(" = ", 1)[0] else None
            note = f"  # instead of the {assigned[target]} line" if target in assigned else ""
            if target is not None:
                assigned.setdefault(target, s.kernel)
            console.print(f"  {s.kernel:<{width}}  {s.apply}{note}", soft_wrap=True, markup=False, highlight=False)
    if wm.suggestions and wm.combined_gain is not None:
        members = [s.kernel for s in wm.suggestions if not s.covered_by]
        console.print(f"Combined gain of the set ({', '.join(members)}): {wm.combined_gain:.1%} of step time "
                      f"(Amdahl over disjoint op time, not the sum of the parts)", soft_wrap=True)
    return console.export_text().rstrip()


if __name__ == "__main__":  # the profiler sampler's child process
    sys.exit(main())
