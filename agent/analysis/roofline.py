"""Roofline classification of a profiler window and its time breakdown.

For each GPU activity in a window (kernels, memcpys, memsets):

1. find the CPU op that launched it (:class:`mfuwatch.agent.trace.TraceIndex` links
   them by ``External id``) and that op's FLOPs and bytes (:mod:`.opcost`);
2. arithmetic intensity = FLOPs / bytes; machine balance = peak FLOP/s of the unit the
   op uses / peak memory bandwidth. Matmul-like ops in bf16/fp16/fp8 (and tf32 when
   enabled) use the tensor-core peak of their dtype; every other op uses the CUDA-core
   fp32 peak (``peak_flops["fp32"]``). Intensity below the balance ⇒ **memory-bound**,
   at or above ⇒ **compute-bound** (Williams, Waterman & Patterson, "Roofline", CACM 2009);
3. NCCL kernels are **communication** whatever launched them; activities with no
   launching op, or whose op has no recorded shapes, are classified by
   :data:`KERNEL_RULES` (kernel name) then :func:`op_name_bound` (op name).

The window's breakdown gives each GPU-busy category its share of summed activity time
(``compute_bound + memory_bound + communication + other == 1``; with concurrent streams
summed time exceeds busy time), and **idle** = (wall − union of activity intervals) / wall.

On a CPU-only run (``device_type="cpu"``) each CPU op's *self time* (its duration minus
its children's, e.g. the BLAS call inside ``aten::addmm`` without the ``aten::expand`` it
calls) acts as a kernel. An op whose self time is at least half its duration does its own
work and is classified by its own FLOPs and bytes; the self time of a composite op whose
children do most of the work (``aten::linear``, ``aten::to``: dispatch overhead) is
"other". The CPU's balance is
``peak_flops["fp32"]`` (a calibrated or configured CPU matmul FLOP/s; CPUs have no tensor
cores, so every op uses it) over the calibrated or configured memory bandwidth. Busy time
is the union of the top-level ops; idle is the rest of the wall time (Python between ops).
"""

from __future__ import annotations

import dataclasses
import re
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from . import opcost
from .schema import BUSY_CATEGORIES, OpShare, Suggestion, WindowMeasurement
from .trace import GPU_CATEGORIES, TraceError, TraceIndex

_MEMCPY, _MEMSET = GPU_CATEGORIES["gpu_memcpy"], GPU_CATEGORIES["gpu_memset"]

#: Kernel-name rules for activities without a usable launching op: (regex, bound), first match wins.
KERNEL_RULES: Tuple[Tuple[str, str], ...] = (
    (r"nccl", "communication"),  # NCCL collectives and p2p
    (r"^triton_poi_", "memory"),  # Inductor pointwise
    (r"^triton_(red|per)_", "memory"),  # Inductor reductions (looped / persistent)
    (r"^triton_tem_|^triton_.*_(mm|bmm|addmm)_", "compute"),  # Inductor matmul templates
    (r"gemm|cutlass|xmma|cublas|nvjet|wgmma|hmma|_mma_|\bsgemm|matmul", "compute"),  # cuBLAS/CUTLASS GEMMs
    (r"flash|fmha|sdpa|attention|fprop|dgrad|wgrad|conv", "compute"),  # attention / convolution libraries
    (r"multi_tensor_apply|foreach|[Aa]dam", "memory"),  # optimizer kernels
    (r"elementwise|vectorized|unrolled|reduce_kernel|[Rr]educe|[Ss]oft[Mm]ax|norm|[Nn]orm|index|gather|scatter"
     r"|copy|[Ff]ill|[Cc]at[Aa]rray|embedding|nll_loss|radix_sort|scan|[Mm]emcpy|[Mm]emset", "memory"),
)
_KERNEL_RULES = tuple((re.compile(p), b) for p, b in KERNEL_RULES)
_COMM_OPS = re.compile(r"^(c10d::|nccl:|record_param_comms)")
_INDUCTOR_SUFFIX = re.compile(r"_\d+$")


def kernel_name_bound(name: str) -> str:
    """Bound of a GPU kernel from its name alone (:data:`KERNEL_RULES`); ``"other"`` if none matches."""
    for rx, bound in _KERNEL_RULES:
        if rx.search(name):
            return bound
    return "other"


def op_name_bound(name: str) -> str:
    """Bound of an op without recorded shapes, from its name: matmul-like ⇒ compute, collectives ⇒
    communication, other ``aten::`` ops (pointwise, reductions, copies, ``_foreach_*``) ⇒ memory."""
    if name in opcost.MATMUL_OPS or re.search(r"(^aten::|_)(mm|matmul|linear|conv\w*|\w*attention\w*)$", name):
        return "compute"
    if _COMM_OPS.search(name):
        return "communication"
    return "memory" if name.startswith("aten::") and name not in opcost.VIEW_OPS else "other"


@dataclass
class Peaks:
    """Peak FLOP/s and memory bandwidth of one device: what the roofline needs.

    ``peak_flops``: dense FLOP/s per dtype key ("fp32" = CUDA cores; "tf32", "bf16", "fp16",
    "fp8" = tensor cores), as in ``mfuwatch.agent.peaks.GpuSpec``. ``fp32_matmul``: the
    unit fp32 matmuls use, "fp32" (torch's default, ``allow_tf32=False``) or "tf32".
    ``measured_bandwidth_bytes_per_second``: a calibrated bandwidth, preferred for gains.
    """

    peak_flops: Dict[str, float]
    memory_bandwidth_bytes_per_second: float
    name: str = ""
    source: str = ""
    measured_bandwidth_bytes_per_second: Optional[float] = None
    fp32_matmul: str = "fp32"

    def __post_init__(self) -> None:
        if not self.peak_flops or not any(v and v > 0 for v in self.peak_flops.values()):
            raise ValueError("peak_flops: need at least one positive FLOP/s value, e.g. {'fp32': 67e12}")
        if not self.memory_bandwidth_bytes_per_second or self.memory_bandwidth_bytes_per_second <= 0:
            raise ValueError("memory_bandwidth_bytes_per_second: need a positive bandwidth in bytes/s")

    @classmethod
    def from_any(cls, obj: Any) -> "Peaks":
        """Accept a :class:`Peaks`, a ``GpuSpec`` (attributes ``peak_flops`` and
        ``memory_bandwidth_bytes_per_second``) or a mapping with those keys.

        Raises:
            ValueError: missing or non-positive peak or bandwidth.
        """
        if isinstance(obj, cls):
            return obj
        get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
        return cls(peak_flops={k: float(v) for k, v in (get("peak_flops") or {}).items() if v},
                   memory_bandwidth_bytes_per_second=float(get("memory_bandwidth_bytes_per_second") or 0.0),
                   name=str(get("name", "") or ""), source=str(get("source", "") or ""),
                   measured_bandwidth_bytes_per_second=get("measured_bandwidth_bytes_per_second"),
                   fp32_matmul=str(get("fp32_matmul", "fp32") or "fp32"))

    def flops_for(self, dtype: Optional[str], matmul: bool) -> float:
        """Peak FLOP/s of the unit an op uses: tensor cores of ``dtype`` for matmul-like ops, else fp32."""
        fp32 = self.peak_flops.get("fp32") or max(self.peak_flops.values())
        if not matmul or dtype is None:
            return fp32
        key = self.fp32_matmul if dtype == "fp32" else dtype
        return self.peak_flops.get(key) or fp32

    def balance(self, dtype: Optional[str], matmul: bool) -> float:
        """Machine balance in FLOP/byte for that unit."""
        return self.flops_for(dtype, matmul) / self.memory_bandwidth_bytes_per_second


@dataclass
class Window:
    """One window's activities, classified: the shared input of the breakdown and of :mod:`.suggest`.

    ``kr_*`` are per activity (GPU activity, or an op's self time on the CPU): start/duration in µs, the
    op index in ``index`` (or -1), the bound, the label for top-op tables. ``op_costs`` caches
    :class:`opcost.OpCost` per signature. Times in the public fields are seconds.
    """

    index: TraceIndex
    peaks: Peaks
    steps: int
    device_type: str
    kr_ts: array = field(default_factory=lambda: array("d"))
    kr_dur: array = field(default_factory=lambda: array("d"))
    kr_op: array = field(default_factory=lambda: array("q"))
    kr_bound: List[str] = field(default_factory=list)
    kr_label: List[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    busy_seconds: float = 0.0
    gaps_us: List[float] = field(default_factory=list)  # idle gaps between busy intervals
    _costs: Dict[int, opcost.OpCost] = field(default_factory=dict)

    def cost(self, op: int) -> Optional[opcost.OpCost]:
        """Cost of op instance ``op`` from its recorded shapes, or None without shapes."""
        if op < 0:
            return None
        sid = self.index.op_sig[op]
        if sid < 0:
            return None
        c = self._costs.get(sid)
        if c is None:
            s = self.index.sigs[sid]
            c = self._costs[sid] = opcost.op_cost(s.name, s.dims, s.types, s.concrete)
        return c

    def classify_op(self, op: int) -> Optional[str]:
        """Roofline bound of op instance ``op`` ("compute"/"memory"), or None when it has no bytes."""
        c = self.cost(op)
        if c is None or c.bytes <= 0:
            return None
        return "compute" if c.flops / c.bytes >= self.peaks.balance(c.dtype, c.matmul) else "memory"

    def bandwidth(self) -> float:
        """Bandwidth for replacement times: calibrated if given, else what this window's large
        streaming ops (≥ 8 MiB pointwise/copy) achieved, capped at the datasheet peak, else the peak."""
        p = self.peaks
        if p.measured_bandwidth_bytes_per_second:
            return float(p.measured_bandwidth_bytes_per_second)
        seen: Dict[int, float] = {}
        for op, dur in zip(self.kr_op, self.kr_dur):
            if op >= 0 and self.index.op_label(op) in _STREAMING_OPS:
                c = self.cost(op)
                if c is not None and c.bytes >= 8 * 2**20:
                    seen[op] = seen.get(op, 0.0) + dur
        total_us = sum(seen.values())
        if total_us <= 0:
            return p.memory_bandwidth_bytes_per_second
        achieved = sum(self.cost(op).bytes for op in seen) / (total_us * 1e-6)
        return min(achieved, p.memory_bandwidth_bytes_per_second)


_STREAMING_OPS = frozenset("aten::" + n for n in ("copy_", "add", "add_", "mul", "mul_", "sub", "div", "neg", "silu",
                                                  "gelu", "rsqrt", "pow", "where", "masked_fill", "clone"))


def build_window(index: TraceIndex, peaks: Peaks, *, steps: Optional[int] = None,
                 device_type: str = "cuda") -> Window:
    """Classify every activity of ``index`` and compute wall, busy and idle gaps.

    ``steps``: training steps in the window; None ⇒ the trace's ``ProfilerStep#`` count,
    else the count of its most frequent ``Optimizer.step#…`` annotation, else 1.
    """
    w = Window(index, peaks, steps or infer_steps(index), device_type)
    names = index.names
    busy_ts, busy_dur = w.kr_ts, w.kr_dur
    if device_type == "cpu":
        busy_ts, busy_dur = array("d"), array("d")
        for i in range(len(index.op_ts)):
            if index.op_kind[i]:
                continue
            if index.op_top[i] == i:  # busy time = the union of top-level ops
                busy_ts.append(index.op_ts[i])
                busy_dur.append(index.op_dur[i])
            own = index.op_self[i]
            if own > 0:
                w.kr_ts.append(index.op_ts[i])
                w.kr_dur.append(own)
                w.kr_op.append(i)
                label = names[index.op_name[i]]
                if own < 0.5 * index.op_dur[i]:
                    bound = "other"  # a composite op (linear, to, layer_norm): its children do the work
                else:
                    bound = w.classify_op(i) or op_name_bound(label)
                w.kr_bound.append(bound)
                w.kr_label.append(label)
    else:
        for k in range(index.n_kernels):
            kname = names[index.k_name[k]]
            op = index.k_op[k]
            label, bound = _classify_activity(w, kname, index.k_cat[k], op)
            w.kr_ts.append(index.k_ts[k])
            w.kr_dur.append(index.k_dur[k])
            w.kr_op.append(op)
            w.kr_bound.append(bound)
            w.kr_label.append(label)
    start, end = index.wall_span_us()
    w.wall_seconds = max(0.0, end - start) * 1e-6
    busy_us, gaps = _union(busy_ts, busy_dur, start, end)
    w.busy_seconds, w.gaps_us = busy_us * 1e-6, gaps
    return w


def _classify_activity(w: Window, kname: str, cat: int, op: int) -> Tuple[str, str]:
    """(label, bound) of one GPU activity."""
    if "nccl" in kname.lower():
        return ("nccl:" + kname.split("(")[0].replace("void ", "")[:60], "communication")
    if cat == _MEMCPY:
        if "PtoP" in kname or "Peer" in kname:
            return "Memcpy PtoP", "communication"
        return ("Memcpy DtoD", "memory") if "DtoD" in kname else (kname.split(" (")[0], "other")
    if cat == _MEMSET:
        return "Memset", "memory"
    klabel = _INDUCTOR_SUFFIX.sub("", kname) if kname.startswith("triton_") else kname[:80]
    if op >= 0:
        label = w.index.op_label(op)
        bound = w.classify_op(op)
        if bound is None:
            kb = kernel_name_bound(kname)
            bound = kb if kb != "other" else op_name_bound(label)
            if not label.startswith("aten::"):  # e.g. CompiledFunction around Inductor's kernels
                label = klabel
        return label, bound
    return klabel, kernel_name_bound(kname)


def _union(ts: Sequence[float], dur: Sequence[float], start: float, end: float) -> Tuple[float, List[float]]:
    """Length of the union of [ts, ts+dur) clipped to [start, end], and the gaps between its pieces (µs)."""
    import numpy as np

    s = np.asarray(ts, dtype=np.float64)
    e = np.minimum(s + np.asarray(dur, dtype=np.float64), end)
    s = np.maximum(s, start)
    keep = e > s
    s, e = s[keep], e[keep]
    if not len(s):
        return 0.0, []
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)  # furthest end seen so far
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]  # a piece starts where an interval begins after everything before it ended
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    total = float(np.sum(reach[last] - s[first]))
    gaps = (s[first[1:]] - reach[last[:-1]]).tolist()
    return total, gaps


def infer_steps(index: TraceIndex) -> int:
    """Training steps in a trace: ``ProfilerStep#`` annotations, else ``Optimizer.step#`` ones, else 1."""
    if index.steps:
        return len(index.steps)
    counts: Dict[int, int] = {}
    opt = {i for i, n in enumerate(index.names) if n.startswith("Optimizer.step#")}
    if opt:
        for i, nid in enumerate(index.op_name):
            if nid in opt and index.op_kind[i] == 1:
                counts[nid] = counts.get(nid, 0) + 1
    return max(counts.values()) if counts else 1


def measure(w: Window, *, top_k: int = 8, step_time_seconds: Optional[float] = None,
            suggestions: Optional[List[Suggestion]] = None, step: int = 0,
            timestamp: Optional[float] = None) -> WindowMeasurement:
    """The :class:`WindowMeasurement` of a classified window (breakdown, top ops, kernel stats)."""
    by_bound = {b: 0.0 for b in ("compute", "memory", "communication", "other")}
    per_label: Dict[Tuple[str, str], List[float]] = {}
    counted_ops: Dict[Tuple[str, str], set] = {}
    for op, dur, bound, label in zip(w.kr_op, w.kr_dur, w.kr_bound, w.kr_label):
        by_bound[bound] += dur
        agg = per_label.setdefault((label, bound), [0.0, 0, 0.0, 0.0])
        agg[0] += dur
        agg[1] += 1
        if op >= 0 and op not in counted_ops.setdefault((label, bound), set()):
            counted_ops[(label, bound)].add(op)
            c = w.cost(op)
            if c is not None:
                agg[2] += c.flops
                agg[3] += c.bytes
    total_us = sum(by_bound.values())
    share = (lambda t: t / total_us) if total_us > 0 else (lambda t: 0.0)
    breakdown = {f"{b}_bound" if b in ("compute", "memory") else b: share(t) for b, t in by_bound.items()}
    breakdown = {k: breakdown[k] for k in BUSY_CATEGORIES}
    breakdown["idle"] = (max(0.0, w.wall_seconds - w.busy_seconds) / w.wall_seconds) if w.wall_seconds > 0 else 0.0
    top = sorted(per_label.items(), key=lambda kv: -kv[1][0])[:top_k]
    top_ops = [OpShare(op=label, bound=bound, share=share(t), time_seconds=t * 1e-6, kernels=n, flops=fl, bytes=by,
                       arithmetic_intensity=(fl / by if by > 0 else None))
               for (label, bound), (t, n, fl, by) in top]
    n = len(w.kr_dur)
    return WindowMeasurement(
        step=step, timestamp=time.time() if timestamp is None else timestamp, steps=w.steps,
        wall_seconds=w.wall_seconds, busy_seconds=w.busy_seconds, breakdown=breakdown,
        memory_bound_share=breakdown["memory_bound"], top_ops=top_ops, suggestions=list(suggestions or []),
        kernels_per_step=n / w.steps if w.steps else 0.0, mean_kernel_seconds=(total_us * 1e-6 / n) if n else 0.0,
        step_time_seconds=step_time_seconds)


def analyze_events(events_iter: Iterable[Dict[str, Any]], *, spec_or_peaks: Any, steps: Optional[int] = None,
                   step_time_seconds: Optional[float] = None, top_k: int = 8, registry: Optional[Sequence] = None,
                   device_type: str = "cuda", step: int = 0, timestamp: Optional[float] = None) -> WindowMeasurement:
    """Breakdown, top ops and suggestions of one profiler window: the function the live sampler and
    ``mfuwatch analyze`` share.

    Args:
        events_iter: chrome-trace event dicts (e.g. ``read_trace(path).events()``); streamed once.
        spec_or_peaks: a ``GpuSpec``, :class:`Peaks` or mapping with ``peak_flops`` (FLOP/s per dtype)
            and ``memory_bandwidth_bytes_per_second``.
        steps: training steps in the window (None: inferred, see :func:`build_window`).
        step_time_seconds: step time measured outside the window, for the Amdahl gains; None ⇒
            window wall time / steps.
        top_k: how many ops to keep in ``top_ops`` (bounded metric cardinality).
        registry: remedies to match (default ``mfuwatch.kernels.registry.REGISTRY``).
        device_type: "cuda" (GPU activities are the kernels) or "cpu" (each CPU op's self time is).

    Returns:
        WindowMeasurement; ``breakdown`` busy categories sum to 1 when any activity was seen.

    Raises:
        ValueError: bad peaks.
        TraceError: no events, no GPU activity (``device_type="cuda"``) or no CPU ops (``"cpu"``), or a
            truncated/corrupt streaming source.
    """
    from . import suggest

    peaks = Peaks.from_any(spec_or_peaks)
    index = TraceIndex.build(events_iter)
    if index.events_seen == 0:
        raise TraceError("the trace has no events")
    if device_type != "cpu" and index.n_kernels == 0:
        raise TraceError("the trace has no GPU activity (kernels, memcpy, memset): was it recorded with "
                         "ProfilerActivity.CUDA? For a CPU-only trace use device_type='cpu' (--device cpu)")
    if device_type == "cpu" and not any(k == 0 for k in index.op_kind):
        raise TraceError("the trace has no CPU ops")
    w = build_window(index, peaks, steps=steps, device_type=device_type)
    st = step_time_seconds or (w.wall_seconds / w.steps if w.steps and w.wall_seconds > 0 else None)
    sugg = suggest.suggest(w, step_time_seconds=st, registry=registry) if st else []
    return measure(w, top_k=top_k, step_time_seconds=st, suggestions=sugg, step=step, timestamp=timestamp)


def window_from_dict(d: Dict[str, Any]) -> WindowMeasurement:
    """Rebuild a :class:`WindowMeasurement` from its ``dataclasses.asdict`` form (the ``--json`` output)."""
    names = {f.name for f in dataclasses.fields(WindowMeasurement)}
    d = {k: v for k, v in d.items() if k in names}  # drops "kind" and extras such as "analysis"
    d["top_ops"] = [OpShare(**o) for o in d.get("top_ops", [])]
    d["suggestions"] = [Suggestion(**s) for s in d.get("suggestions", [])]
    return WindowMeasurement(**d)

