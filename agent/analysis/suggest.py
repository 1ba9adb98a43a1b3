"""Suggestions: match the remedies registry against a classified window and estimate each one's gain.

The remedies table (``mfuwatch.kernels.remedies``) says which op patterns a remedy replaces and
how many bytes its replacement must move; this module finds those ops in a
:class:`mfuwatch.agent.analysis.roofline.Window` and computes the **expected gain** (Amdahl):

    gain = (time the matched ops took in the window − time the replacement needs) / steps / step time

where the replacement needs ``minimal bytes / bandwidth`` (``bandwidth`` from
:meth:`Window.bandwidth`: calibrated, else achieved by the window's large streaming ops),
or at least ``FLOPs / peak`` when it keeps the ops' FLOPs (attention, autocast). The
matched time includes the backward ops autograd ran for the matched forward ops (linked
by the ``Sequence number`` the profiler records on both), and those of the remedy's ``views`` inside the
pattern (rotate_half's slices); a remedy with ``returns_input_layout`` is also credited the strided kernels
eager's gradient layout forced on the backward ops upstream of it (:func:`_relayout`,
:func:`.gain_model.relayout_credit`). Remedies whose gain is below
:data:`MIN_GAIN` are dropped; the rest are ranked existing fixes first, then bundled
kernels, each by gain. The drop-ins reach the bandwidth fraction they were measured at
(:func:`.gain_model.replacement_efficiency`); CUDA graphs gain only the idle gaps in which the GPU
waited for a launch (:func:`.gain_model.host_bound_gaps`). Overlapping remedies (``torch_compile``
fuses the ops a drop-in also replaces) are combined by :func:`suggest_set`: each suggestion's gain in
the proposed set counts only time no earlier one claimed, and the set's combined gain is Amdahl over
that disjoint time (docs/analyze.md, "How the gains are modelled").
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import re
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import gain_model
from .compact import IdSet, IntGroups, SparseColumn, np_view, to_array
from .opcost import DTYPE_BYTES, MATMUL_OPS, VIEW_OPS
from .roofline import Window
from .trace import TraceIndex
from ..schema import Suggestion

#: Smallest expected gain (fraction of step time) worth reporting.
MIN_GAIN = 0.005
_BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


@dataclass
class _Match:
    fwd: List[int] = field(default_factory=list)  # claimed forward top-level ops
    bwd: List[int] = field(default_factory=list)  # backward nodes linked to them
    min_bytes: Optional[float] = None  # the replacement's minimal bytes; None: unknown anchor
    time_us: float = 0.0  # time the matched ops took
    replace_s: Optional[float] = None  # set directly by detectors: the replacement's seconds
    elements: int = 0  # elements of the anchor tensor (for the drop-in's measured bandwidth fraction)
    relayout: Dict[int, float] = field(default_factory=dict)  # backward node -> µs its strided kernels save


class _Context:
    """Per-top-level-op aggregates of a window, the forward op streams and the forward→backward links.

    Everything is held in typed arrays, not per-op Python objects (a 1 GB trace has ~1.5 M ops, ~150 k of
    them top-level ops that launched work; docs/reliability.md, "Where ``analyze``'s memory goes"):

    * ``time``/``mem``/``flop_s``/``bytes``: :class:`.compact.SparseColumn` s read by op id (0.0 on any op
      but a top-level op that launched GPU work): µs of activity under the op, of which memory-bound; the
      seconds its distinct launching ops' FLOPs need at their unit's peak; their bytes. The four share
      ``top_ids`` (``array("q")``, ascending op ids), the top-level ops of the window's activities.
    * ``tops``: ``array("q")``, the top-level ops (not annotations) that launched work, ascending.
    * ``backward``: :class:`.compact.IntGroups`, sequence number → the backward nodes (top-level
      ``autograd::engine::evaluate_function:`` ops that launched work) with it, ascending.
    * ``seqs``: :class:`.compact.IntGroups`, forward top-level op → the sequence numbers of the ops inside
      it that have one (itself included), in op order; a number may repeat.
    * ``streams``: one ``array("q")`` per thread (threads in the order of their first op), its forward
      top-level ops that launched work, by start time: the op stream the patterns are matched in.
    """

    def __init__(self, w: Window) -> None:
        import numpy as np

        ix = w.index
        self.w, self.ix = w, ix
        n = len(ix.op_ts)
        op_top = np_view(ix.op_top, np.int32)
        # the top-level op of each activity (-1: no launching op); the columns hold one value per distinct one
        kr_op = np_view(w.kr_op, np.int64)
        kr_top = np.full(kr_op.size, -1, dtype=np.int64)
        launched = kr_op >= 0
        kr_top[launched] = op_top[kr_op[launched]]
        self.top_ids = to_array(np.unique(kr_top[launched]))
        pos = to_array(np.searchsorted(np_view(self.top_ids, np.int64), kr_top))  # activity -> column position
        del kr_op, kr_top, launched
        m = len(self.top_ids)
        self.time, self.mem, self.flop_s, self.bytes = (SparseColumn(self.top_ids, array("d", bytes(8 * m)))
                                                        for _ in range(4))
        time, mem, flop_s, nbytes = self.time.values, self.mem.values, self.flop_s.values, self.bytes.values
        seen = bytearray(n)
        for k, (op, dur, bound) in enumerate(zip(w.kr_op, w.kr_dur, w.kr_bound)):
            if op < 0:
                continue
            p = pos[k]
            time[p] += dur
            if bound == "memory":
                mem[p] += dur
            if not seen[op]:
                seen[op] = 1
                c = w.cost(op)
                if c is not None:
                    flop_s[p] += c.flops / w.peaks.flops_for(c.dtype, c.matmul)
                    nbytes[p] += c.bytes
        del seen, pos
        worked = bytearray(n)  # 1: a top-level op whose activities took time
        for t, us in zip(self.top_ids, time):
            if us > 0:
                worked[t] = 1
        names = ix.names
        backward_names = {i for i, s in enumerate(names) if s.startswith(_BACKWARD_PREFIX)}
        self.tops = array("q")
        bwd_seq, bwd_op = array("q"), array("q")  # entries of `backward`
        fwd_top, fwd_seq = array("q"), array("q")  # entries of `seqs`
        stream_thread, stream_op = array("q"), array("q")
        top_of, seq_of, name_of, kind = ix.op_top, ix.op_seq, ix.op_name, ix.op_kind
        for i in range(n):
            t = top_of[i]
            if kind[i] or not worked[t]:
                continue
            seq = seq_of[i]
            if name_of[t] in backward_names:
                if t == i:
                    self.tops.append(i)
                    if seq >= 0:
                        bwd_seq.append(seq)
                        bwd_op.append(i)
                continue
            if seq >= 0:
                fwd_top.append(t)
                fwd_seq.append(seq)
            if t == i:
                self.tops.append(i)
                # a "view" op that launched GPU work copied (x.float() is aten::to, x.contiguous() a clone):
                # it is part of the op stream (HF's loss upcasts the logits with .float() before cross_entropy)
                if w.device_type != "cpu" or (names[name_of[i]] not in VIEW_OPS and self.bytes[i] > 0):
                    stream_thread.append(ix.op_thread[i])
                    stream_op.append(i)
        del worked
        self.backward = IntGroups(np_view(bwd_seq, np.int64), np_view(bwd_op, np.int64))
        self.seqs = IntGroups(np_view(fwd_top, np.int64), np_view(fwd_seq, np.int64))
        self.streams = _by_thread_in_time(ix, np_view(stream_thread, np.int64), np_view(stream_op, np.int64))
        self._thread_tops: Optional[Dict[int, Tuple[array, array]]] = None  # built on first use

    def name(self, op: int) -> str:
        return self.ix.names[self.ix.op_name[op]]

    def linked_backward(self, tops: Sequence[int], claimed: IdSet, views: Sequence[int] = ()) -> List[int]:
        """Unclaimed backward nodes autograd ran for the forward top-level ops ``tops`` (every sequence number
        inside them) and for the ``views`` (top-level ops that launched nothing: their own sequence number)."""
        out: List[int] = []
        seqs = [seq for t in tops for seq in self.seqs.get(t)]
        seqs += [self.ix.op_seq[v] for v in views if self.ix.op_seq[v] >= 0]
        for seq in dict.fromkeys(seqs):  # each once, in order (a repeat would add no node)
            out.extend(b for b in self.backward.get(seq) if b not in claimed and b not in out)
        return out

    def views_between(self, first: int, last: int, names: Sequence[str]) -> List[int]:
        """Top-level ops named in ``names`` on ``first``'s thread that start after ``first`` and before ``last``
        and launched no GPU work (views: not in the op stream)."""
        if not names:
            return []
        ix = self.ix
        if self._thread_tops is None:
            import numpy as np

            top_level = array("q")
            top_of, kind = ix.op_top, ix.op_kind
            for i in range(len(ix.op_ts)):
                if not kind[i] and top_of[i] == i:
                    top_level.append(i)
            ops = np_view(top_level, np.int64)
            threads = np_view(ix.op_thread, np.int32)[ops].astype(np.int64)
            ts = np_view(ix.op_ts, np.float64)
            self._thread_tops = {ix.op_thread[s[0]]: (s, to_array(ts[np_view(s, np.int64)]))
                                 for s in _by_thread_in_time(ix, threads, ops)}
        ops, ts = self._thread_tops.get(ix.op_thread[first], (array("q"), array("d")))
        lo, hi = bisect.bisect_right(ts, ix.op_ts[first]), bisect.bisect_left(ts, ix.op_ts[last])
        wanted = set(names)
        return [i for i in ops[lo:hi] if self.time[i] <= 0 and self.name(i) in wanted]

    def input_tensor(self, op: int, arg: int) -> Optional[Tuple[int, int, int]]:
        """(numel, last dim, itemsize) of input ``arg`` of op ``op`` (a TensorList: summed, 4 B/element),
        or None when the trace has no shape for it."""
        sid = self.ix.op_sig[op]
        if sid < 0:
            return None
        s = self.ix.sigs[sid]
        if not s.types or arg >= len(s.types) or not s.dims or arg >= len(s.dims):
            return None
        t, d = s.types[arg], s.dims[arg]
        if t == "TensorList":
            shapes = [x for x in d if isinstance(x, list)]
            return (sum(_numel(x) for x in shapes), 1, 4) if shapes else None
        if t not in DTYPE_BYTES or not isinstance(d, list):
            return None
        return _numel(d), int(d[-1]) if d else 1, DTYPE_BYTES[t]

    def max_input_bytes(self, op: int) -> float:
        sid = self.ix.op_sig[op]
        if sid < 0:
            return 0.0
        sizes = [self.input_tensor(op, a) for a in range(len(self.ix.sigs[sid].types or []))]
        return float(max((n * b for n, _, b in filter(None, sizes)), default=0))


def _by_thread_in_time(ix: TraceIndex, threads, ops) -> List[array]:
    """The op ids ``ops`` (1-D int64, ascending) grouped by thread (``threads``: each op's thread id, int64), the
    threads in the order of their first op, each group ordered by start time (``ix.op_ts``; ops starting at
    the same time keep their order): one ``array("q")`` per thread."""
    import numpy as np

    if not ops.size:
        return []
    distinct, first = np.unique(threads, return_index=True)
    ts = np_view(ix.op_ts, np.float64)
    out = []
    for thread in distinct[np.argsort(first)]:
        mine = ops[threads == thread]
        out.append(to_array(mine[np.argsort(ts[mine], kind="stable")]))
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def suggest(w: Window, *, step_time_seconds: float, registry: Optional[Sequence] = None,
            min_gain: float = MIN_GAIN) -> List[Suggestion]:
    """Suggestions for one window, ranked existing fixes first, then bundled kernels, each by gain.

    Each suggestion's ``expected_gain`` is its gain applied alone; ``gain_in_set`` and ``covered_by``
    say what it adds to the set the window proposes (:func:`proposal`, :func:`.gain_model.combine`).

    Args:
        w: the classified window (:func:`mfuwatch.agent.analysis.roofline.build_window`).
        step_time_seconds: step time (s) the gains are fractions of.
        registry: ``Remedy`` entries (default ``mfuwatch.kernels.remedies.REMEDIES``).
        min_gain: drop suggestions whose expected gain is below this fraction.
    """
    out, _ = suggest_set(w, step_time_seconds=step_time_seconds, registry=registry, min_gain=min_gain)
    return out


#: Bundled drop-ins whose ops torch.compile (Inductor) fuses into its own kernels: after compile they add
#: nothing (H200, docs/gpu-runs/hf_llama_e2e-run3.md call 4: compile 56.9 ms vs compile + all drop-ins
#: 57.6 ms at V=32000, 77.6 vs 77.5 at V=128256; Inductor's kernel names show the fused ops, e.g.
#: ``triton_poi_fused__unsafe_view_mul_silu``, ``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt``).
COMPILE_FUSES = frozenset({"rms_norm", "layer_norm", "rotary", "swiglu", "geglu", "cross_entropy"})


def suggest_set(w: Window, *, step_time_seconds: float, registry: Optional[Sequence] = None,
                min_gain: float = MIN_GAIN) -> Tuple[List[Suggestion], float]:
    """:func:`suggest`'s ranked list and the combined gain of the set it proposes (fraction of step time).

    The set is the ranked suggestions in order, each counted for the op time (and host-bound idle time)
    no earlier member claimed (Amdahl over disjoint time, :func:`.gain_model.combine`); members have
    ``covered_by`` None. ``torch_compile`` also claims the ops of the drop-ins in :data:`COMPILE_FUSES`
    (Inductor fuses them too) and the idle gaps next to its kernels (their launches go), so after it the
    drop-ins and ``cuda_graphs`` are covered or count only what is left.
    """
    from mfuwatch.kernels import remedies as reg

    remedies = reg.REMEDIES if registry is None else registry
    if step_time_seconds <= 0 or w.steps <= 0:
        return [], 0.0
    ctx = _Context(w)
    bw = w.bandwidth()
    claimed = IdSet(len(w.index.op_ts))  # top-level ops a drop-in's match took (the next ones skip them)
    out: List[Suggestion] = []
    claims: Dict[str, gain_model.Claim] = {}
    dropin_matches: Dict[str, List[_Match]] = {}
    gaps: List[Tuple[float, int, int]] = [] if w.device_type == "cpu" else gain_model.host_bound_gaps(
        w.kr_ts, w.kr_dur, w.index.k_launch_end, reg.MAX_LAUNCH_GAP_SECONDS * 1e6)
    where = _launch_regions(ctx) if gaps else bytearray()
    fusing: Optional[List[_Match]] = None  # torch.compile's matches (for CUDA graphs after it)
    for r in remedies:
        if r.bundled and w.device_type == "cpu":
            continue  # the bundled drop-ins are Triton kernels: patch() refuses them without CUDA
        if r.detector == "launch_bound":
            if w.device_type == "cpu":
                continue
            # mode="reduce-overhead" captures the compiled model's forward and backward only: the gaps of the
            # optimizer step (and anything else outside the model) stay
            graph_gaps = [x for x in gaps if where[x[2]] != gain_model.OUTSIDE]
            matches = [_Match(time_us=sum(g for g, _, _ in graph_gaps), replace_s=0.0)] if graph_gaps else []
            names = ["(GPU idle gaps < %d µs waiting for a launch)" % round(reg.MAX_LAUNCH_GAP_SECONDS * 1e6)]
        elif r.detector == "fp32_matmul":
            matches, names = _fp32_matmuls(ctx, bw)
        else:
            if r.detector == "pointwise_chain":
                matches = _pointwise_chains(ctx, r, reg.MIN_CHAIN, IdSet(len(w.index.op_ts)))
            elif r.region:
                matches = _region(ctx, r, claimed)
                _infer_list_bytes(ctx, r, matches, bw)
            elif r.sequence:
                matches = _sequences(ctx, r, claimed)
            else:
                continue
            matches = [m for m in matches if m.min_bytes is not None]  # no shapes, no estimate
            for m in matches:
                m.time_us = sum(ctx.time[t] for t in m.fwd + m.bwd)
                eff = gain_model.replacement_efficiency(r.kernel, m.elements) if r.bundled else 1.0
                m.replace_s = m.min_bytes / (bw * eff)
                if r.keeps_flops:
                    m.replace_s = max(m.replace_s, sum(ctx.flop_s[t] for t in m.fwd + m.bwd))
            if getattr(r, "returns_input_layout", False) and matches:
                matches = matches + _relayout(ctx, r, matches, bw)
            if r.detector == "pointwise_chain":
                matches = matches + _fused_by_compile(ctx, matches, dropin_matches)
                fusing = matches
            elif r.kernel in COMPILE_FUSES:
                dropin_matches[r.kernel] = matches
            names = sorted({ctx.name(t) for m in matches for t in m.fwd})
        if not matches:
            continue
        time_us = sum(m.time_us for m in matches)
        replace_s = sum(m.replace_s for m in matches)
        per_step = time_us * 1e-6 / w.steps
        gain = (time_us * 1e-6 - replace_s) / w.steps / step_time_seconds
        if gain < min_gain:
            continue
        out.append(Suggestion(kernel=r.kernel, title=r.title, apply=r.apply, ops=names, time_seconds=per_step,
                              expected_gain=min(gain, 1.0), kind="bundled" if r.bundled else "existing"))
        claims[r.kernel] = _claim(ctx, r, matches, graph_gaps if r.detector == "launch_bound" else gaps, gain)
    total = sum(x.expected_gain for x in out)
    if total > 1.0:
        # Amdahl gains of disjoint ops cannot exceed the step; a larger sum means the step time given was
        # shorter than the window's own (e.g. measured outside the profiler). Scale them to fit in one step.
        out = [dataclasses.replace(x, expected_gain=x.expected_gain / total) for x in out]
        for c in claims.values():
            c.gain /= total
    out.sort(key=lambda s: (s.kind != "existing", -s.expected_gain))
    in_set, covered, combined = gain_model.combine([claims[s.kernel] for s in out], min_gain)
    order = [s.kernel for s in out]
    if ("cuda_graphs" in in_set and fusing is not None and "torch_compile" in in_set
            and order.index("torch_compile") < order.index("cuda_graphs") and "torch_compile" not in covered):
        # after torch.compile the eager window's gaps are gone with its launches; graphs gain only where the
        # compiled regions' launches outlast their GPU work (gain_model.graphs_after_compile)
        residual = gain_model.graphs_after_compile(_regions_after_compile(ctx, where, fusing))
        # the bound takes eager's host cost per launch; no more than the starving the eager window shows
        g = min(residual * 1e-6 / w.steps / step_time_seconds, claims["cuda_graphs"].gain)
        in_set["cuda_graphs"] = g
        if g < min_gain:
            covered["cuda_graphs"] = "torch_compile"
        else:
            covered.pop("cuda_graphs", None)
        combined = min(1.0, sum(v for k, v in in_set.items() if k not in covered and v >= min_gain))
    out = [dataclasses.replace(s, gain_in_set=in_set.get(s.kernel), covered_by=covered.get(s.kernel)) for s in out]
    return out, combined


def _launch_regions(ctx: _Context) -> bytearray:
    """Per GPU activity of the window: :data:`.gain_model.FORWARD`, ``BACKWARD`` (launched under an autograd
    engine node) or ``OUTSIDE`` (under an ``Optimizer.*`` annotation, i.e. ``optimizer.step`` / ``zero_grad``,
    or with no launching op)."""
    ix, w = ctx.ix, ctx.w
    optim = {i for i, n in enumerate(ix.names) if n.startswith("Optimizer.")}
    out = bytearray(len(w.kr_op))
    for k, op in enumerate(w.kr_op):
        if op < 0:
            out[k] = gain_model.OUTSIDE
            continue
        t = ix.op_top[op]
        if ix.op_region[t] in optim or ix.op_region[op] in optim:
            out[k] = gain_model.OUTSIDE
        elif ctx.name(t).startswith(_BACKWARD_PREFIX):
            out[k] = gain_model.BACKWARD
        else:
            out[k] = gain_model.FORWARD
    return out


def _regions_after_compile(ctx: _Context, where: bytearray, fusing: List[_Match]) -> List[gain_model.RegionLaunches]:
    """The forward and backward regions as :func:`.gain_model.graphs_after_compile` takes them: their eager
    launches and host time (per profiler step: first to last launch call's return), and what compile leaves:
    the kernels of ops it does not fuse (kept, at their eager time) plus one kernel per fused group in each
    direction (at the group's replacement time, split between forward and backward by their eager time)."""
    ix, w = ctx.ix, ctx.w
    fused = {t for m in fusing for t in m.fwd + m.bwd}
    steps = sorted(ix.steps) or [(float("-inf"), float("inf"))]
    starts = [a for a, _ in steps]
    regions = []
    for code in (gain_model.FORWARD, gain_model.BACKWARD):
        launches, kept, kept_us = 0, 0, 0.0
        span: Dict[int, List[float]] = {}
        for k, op in enumerate(w.kr_op):
            if where[k] != code:
                continue
            launches += 1
            le = ix.k_launch_end[k]
            if le == le:
                i = max(0, bisect.bisect_right(starts, le) - 1)
                lo_hi = span.setdefault(i, [le, le])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], le), max(lo_hi[1], le)
            if ix.op_top[op] not in fused:
                kept += 1
                kept_us += w.kr_dur[k]
        groups, group_us = 0, 0.0
        for m in fusing:
            part = m.fwd if code == gain_model.FORWARD else m.bwd
            if not part or m.time_us <= 0:
                continue
            groups += 1
            group_us += (m.replace_s or 0.0) * 1e6 * sum(ctx.time[t] for t in part) / m.time_us
        regions.append(gain_model.RegionLaunches(launches=launches, host_us=sum(b - a for a, b in span.values()),
                                                 kernels_after=kept + groups, gpu_us_after=kept_us + group_us))
    return regions


def _claim(ctx: _Context, r, matches: List[_Match], gaps, gain: float) -> gain_model.Claim:
    """What a suggestion removes, keyed for :func:`.gain_model.combine`: a top-level op by its id, the
    host-bound gap before activity ``k`` by :func:`.gain_model.gap_key` ``(k)``, an fp32 matmul activity by
    ``("fp32", i)`` (plain ints for the first two: a 1 GB trace's claims hold ~250 k of them)."""
    c = gain_model.Claim(kernel=r.kernel, gain=gain)
    gap_key = gain_model.gap_key
    if r.detector == "launch_bound":
        c.time_us = {gap_key(nxt): g for g, _, nxt in gaps}
        return c
    if r.detector == "fp32_matmul":
        c.time_us = {("fp32", i): m.time_us for i, m in enumerate(matches)}
        return c
    tops = {t for m in matches for t in m.fwd + m.bwd}
    c.time_us = {t: ctx.time[t] for t in tops}
    for m in matches:  # backward nodes the remedy speeds up without replacing them: what it saves there
        for t, us in m.relayout.items():
            c.time_us[t] = c.time_us.get(t, 0.0) + us
    if gaps:  # fusing ops removes their launches, and with them the host-bound gaps next to their kernels
        top_of, kr_op = ctx.ix.op_top, ctx.w.kr_op
        for g, prev, nxt in gaps:
            for k in (prev, nxt):
                op = kr_op[k]
                if op >= 0 and top_of[op] in tops:
                    c.also[gap_key(nxt)] = g
                    break
    return c


def _fused_by_compile(ctx: _Context, chains: List[_Match], dropins: Dict[str, List[_Match]]) -> List[_Match]:
    """The drop-in matches of :data:`COMPILE_FUSES` outside compile's chains, as compile's own: Inductor fuses
    them as well (silu·mul around a matmul, a lone norm), at the drop-in's replacement cost for the part of
    their time the chains did not already claim."""
    in_chains = {t for m in chains for t in m.fwd + m.bwd}
    extra = []
    for matches in dropins.values():
        for m in matches:
            tops = [t for t in m.fwd + m.bwd if t not in in_chains]
            if not tops or m.time_us <= 0:
                continue
            left = sum(ctx.time[t] for t in tops)
            in_chains.update(tops)
            extra.append(_Match(fwd=[t for t in m.fwd if t in tops], bwd=[t for t in m.bwd if t in tops],
                                min_bytes=m.min_bytes, time_us=left, replace_s=m.replace_s * left / m.time_us))
    return extra


#: ATen's strided elementwise path (``launch_legacy_kernel`` in ``ATen/native/cuda/CUDALoops.cuh``): taken when
#: the operands' layouts do not coalesce into one contiguous run (contiguous inputs take ``vectorized_`` /
#: ``unrolled_elementwise_kernel``)
_STRIDED_KERNEL = "void at::native::elementwise_kernel<"


def _relayout(ctx: _Context, r, matches: List[_Match], bw: float) -> List[_Match]:
    """What a drop-in that returns its input gradients in the inputs' layout (``returns_input_layout``) saves
    in the backward ops that receive them, beside the ops it replaces.

    For each match whose anchor input is a permuted view, :func:`.gain_model.eager_grad_layout` gives the
    (dims, strides) in which eager's gradient reaches the ops upstream of the view. Every op inside a backward
    node not claimed by these matches that has an input of exactly that layout and whose GPU activities are
    all strided elementwise kernels (:data:`_STRIDED_KERNEL`) is credited :func:`.gain_model.relayout_credit`:
    its kernels' time less one contiguous pass over its bytes (``w.cost``) at ``bw``. Reductions and casts
    that keep the layout (``ToCopyBackward0``'s copy) run the same either way and are not counted.

    The trace records no tensor identities: another gradient of the same shape and layout (v's beside k's
    when they have as many heads) is counted too (docs/analyze.md gives the size on Qwen3 and Llama).
    Returns one match (no claimed ops; ``relayout``: µs saved per backward node, its ``time_us`` their sum and
    its replacement 0: the suggestion's time counts what the relayout saves, not those ops' whole time) or
    none. ``r.anchor_arg`` of each match's first claimed op is the anchor (remedies with this flag have no
    ``anchor_op``).
    """
    ix, w = ctx.ix, ctx.w
    layouts = set()
    for m in matches:
        if not m.fwd:
            continue
        sid = ix.op_sig[m.fwd[0]]
        s = ix.sigs[sid] if sid >= 0 else None
        if s is None or not s.dims or not s.strides or r.anchor_arg >= min(len(s.dims), len(s.strides)):
            continue
        d, st = s.dims[r.anchor_arg], s.strides[r.anchor_arg]
        if isinstance(d, list) and isinstance(st, list) and all(isinstance(x, int) for x in d + st):
            got = gain_model.eager_grad_layout(d, st)
            if got is not None:
                layouts.add(got)
    if not layouts:
        return []
    own = {t for m in matches for t in m.bwd}
    names = ix.names
    has_layout: Dict[int, bool] = {}  # signature -> it has an input of one of the layouts

    def of_layout(sid: int) -> bool:
        got = has_layout.get(sid)
        if got is None:
            s = ix.sigs[sid] if sid >= 0 else None
            got = has_layout[sid] = bool(s is not None and s.dims and s.strides and any(
                isinstance(d, list) and isinstance(st, list) and (tuple(d), tuple(st)) in layouts
                for d, st in zip(s.dims, s.strides)))
        return got

    per_op: Dict[int, List[float]] = {}  # op with an input of the layouts -> [µs, all strided]
    for k, op in enumerate(w.kr_op):
        if op < 0 or not of_layout(ix.op_sig[op]):
            continue
        t = ix.op_top[op]
        if t in own or not ctx.name(t).startswith(_BACKWARD_PREFIX):
            continue
        acc = per_op.setdefault(op, [0.0, 1.0])
        acc[0] += w.kr_dur[k]
        if not names[ix.k_name[k]].startswith(_STRIDED_KERNEL):
            acc[1] = 0.0
    credit: Dict[int, float] = {}
    for op, (us, strided) in per_op.items():
        if not strided:
            continue
        c = w.cost(op)
        if c is None:
            continue
        saved = gain_model.relayout_credit(us, c.bytes, bw)
        if saved <= 0:
            continue
        t = ix.op_top[op]
        credit[t] = credit.get(t, 0.0) + saved
    if not credit:
        return []
    # the ops stay: only what they save counts as the remedy's time (replacement 0), not their whole time
    return [_Match(time_us=sum(credit.values()), replace_s=0.0, min_bytes=0.0, relayout=credit)]


def _anchor(ctx: _Context, r, tops: List[int]) -> Optional[Tuple[int, int, int]]:
    """The remedy's anchor tensor among the claimed ops as (numel, last dim, itemsize), or None."""
    if r.anchor_op is None:
        return ctx.input_tensor(tops[0], r.anchor_arg) if tops else None
    rx = re.compile(r.anchor_op)
    vals = [ctx.input_tensor(t, r.anchor_arg) for t in tops if rx.search(ctx.name(t))]
    if not vals or any(v is None for v in vals):
        return None
    if not r.anchor_sum:
        return vals[0]
    return sum(v[0] for v in vals), vals[0][1], vals[0][2]


def _finish(ctx: _Context, r, fwd: List[int], claimed: IdSet) -> _Match:
    views = ctx.views_between(fwd[0], fwd[-1], getattr(r, "views", ())) if len(fwd) > 1 else []
    bwd = ctx.linked_backward(fwd, claimed, views)
    claimed.update(fwd)
    claimed.update(bwd)
    anchor = _anchor(ctx, r, fwd)
    mb = None if anchor is None else r.minimal_bytes(*anchor, backward=bool(bwd))
    return _Match(fwd=list(fwd), bwd=bwd, min_bytes=mb, elements=anchor[0] if anchor else 0)


def _sequences(ctx: _Context, r, claimed: IdSet) -> List[_Match]:
    out = []
    for stream in ctx.streams:
        i = 0
        while i < len(stream):
            got = _match_at(ctx, stream, i, r.sequence, claimed)
            if got is None:
                i += 1
                continue
            fwd, end = got
            out.append(_finish(ctx, r, fwd, claimed))
            i = end
    return out


def _match_at(ctx: _Context, stream: Sequence[int], i: int, steps, claimed: IdSet):
    pos, fwd = i, []
    for st in steps:
        found = None
        for j in range(pos, min(len(stream), pos + st.gap + 1)):
            if ctx.name(stream[j]) in st.ops and stream[j] not in claimed:
                found = j
                break
        if found is None:
            if st.optional:
                continue
            return None
        if st.claim:
            fwd.append(stream[found])
        pos = found + 1
    return (fwd, pos) if fwd else None


def _region(ctx: _Context, r, claimed: IdSet) -> List[_Match]:
    ix = ctx.ix
    rx = re.compile(r.region)
    regions = {i for i, n in enumerate(ix.names) if rx.search(n)}
    tops = [t for t in ctx.tops if ix.op_region[t] in regions and t not in claimed]
    if not tops:
        return []
    exclude = set(r.exclude)
    if any(ix.op_kind[i] == 0 and ix.op_region[ix.op_top[i]] in regions and ctx.name(i) in exclude
           for i in range(len(ix.op_ts))):
        return []
    tops.sort(key=lambda t: ix.op_ts[t])
    return [_finish(ctx, r, tops, claimed)]


def _infer_list_bytes(ctx: _Context, r, matches: List[_Match], bw: float) -> None:
    """Minimal bytes of a region remedy whose anchor lists were not recorded (Kineto leaves long
    TensorLists empty). Each foreach op moves (TensorList args + 1 written) lists of B bytes, so the
    matched ops moved Σ lists × B = their time × ``bw``; the replacement moves ``passes_forward × B``
    per call of the anchor op (one per optimizer step and parameter group)."""
    rx = re.compile(r.anchor_op) if r.anchor_op else None
    for m in matches:
        if m.min_bytes is not None:
            continue
        lists, us, calls = 0, 0.0, 0
        for t in m.fwd:
            sid = ctx.ix.op_sig[t]
            n = sum(1 for x in (ctx.ix.sigs[sid].types or []) if x == "TensorList") if sid >= 0 else 0
            if n:
                lists += n + 1
                us += ctx.time[t]
            if rx is not None and rx.search(ctx.name(t)):
                calls += 1
        if lists:
            per_list = us * 1e-6 * bw / lists
            m.min_bytes = r.passes_forward * per_list * (calls or ctx.w.steps)


def _pointwise_chains(ctx: _Context, r, min_chain: int, claimed: IdSet) -> List[_Match]:
    ix = ctx.ix
    out = []

    def pointwise(t: int) -> bool:
        return (ctx.time[t] > 0 and ctx.mem[t] >= ctx.time[t] * 0.999 and ix.op_region[t] < 0
                and ctx.name(t) not in MATMUL_OPS)

    for stream in ctx.streams:
        run: List[int] = []
        for t in itertools.chain(stream, (-1,)):
            if t >= 0 and pointwise(t):
                run.append(t)
                continue
            if len(run) >= min_chain:
                m = _finish(ctx, r, run, claimed)
                anchor = max(ctx.max_input_bytes(x) for x in run)
                m.min_bytes = (r.passes_forward + (r.passes_backward if m.bwd else 0.0)) * anchor
                out.append(m)
            run = []
    return out


def _fp32_matmuls(ctx: _Context, bw: float):
    w = ctx.w
    bf16 = w.peaks.peak_flops.get("bf16")
    if w.device_type == "cpu" or not bf16:
        return [], []
    matches, names, seen = [], set(), set()
    for op, dur in zip(w.kr_op, w.kr_dur):
        c = w.cost(op)
        if c is None or not c.matmul or c.dtype != "fp32":
            continue
        m = _Match(time_us=dur, replace_s=0.0)
        if op not in seen:
            seen.add(op)
            m.replace_s = max(c.flops / bf16, c.bytes / 2 / bw)
            names.add(ctx.name(op))
        matches.append(m)
    return matches, sorted(names)
