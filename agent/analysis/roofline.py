"""Roofline classification of a profiler window and its time breakdown.

For each GPU activity in a window (kernels, memcpys, memsets):

1. find the CPU op that launched it (:class:`mfuwatch.agent.analysis.trace.TraceIndex` links
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

import re
import time
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..device.peaks import Peaks
from ..schema import BUSY_CATEGORIES, OpShare, Suggestion, WindowMeasurement
from . import opcost
from .trace import GPU_CATEGORIES, TraceIndex

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
            timestamp: Optional[float] = None, combined_gain: Optional[float] = None) -> WindowMeasurement:
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
        step_time_seconds=step_time_seconds, combined_gain=combined_gain)
