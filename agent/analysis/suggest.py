"""Suggestions: match the remedies registry against a classified window and estimate each one's gain.

The remedies table (``mfuwatch.kernels.remedies``) says which op patterns a remedy replaces and
how many bytes its replacement must move; this module finds those ops in a
:class:`mfuwatch.agent.analysis.roofline.Window` and computes the **expected gain** (Amdahl):

    gain = (time the matched ops took in the window − time the replacement needs) / steps / step time

where the replacement needs ``minimal bytes / bandwidth`` (``bandwidth`` from
:meth:`Window.bandwidth`: calibrated, else achieved by the window's large streaming ops),
or at least ``FLOPs / peak`` when it keeps the ops' FLOPs (attention, autocast). The
matched time includes the backward ops autograd ran for the matched forward ops (linked
by the ``Sequence number`` the profiler records on both). Remedies whose gain is below
:data:`MIN_GAIN` are dropped; the rest are ranked existing fixes first, then bundled
kernels, each by gain. Gains of overlapping remedies (``torch_compile`` covers the
pointwise chains a drop-in also replaces) are alternatives, not additive.
"""

from __future__ import annotations

import dataclasses

import re
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .opcost import DTYPE_BYTES, MATMUL_OPS, VIEW_OPS
from .roofline import Window
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


class _Context:
    """Per-top-level-op aggregates of a window, the forward op streams and the forward→backward links.

    ``time``/``mem``/``flop_s``/``bytes`` are arrays indexed by op (non-zero on top-level ops only):
    µs of activity under the op, of which memory-bound; the seconds its distinct launching ops'
    FLOPs need at their unit's peak; their bytes.
    """

    def __init__(self, w: Window) -> None:
        ix = w.index
        self.w, self.ix = w, ix
        n = len(ix.op_ts)
        self.time, self.mem = array("d", bytes(8 * n)), array("d", bytes(8 * n))
        self.flop_s, self.bytes = array("d", bytes(8 * n)), array("d", bytes(8 * n))
        seen = bytearray(n)
        for op, dur, bound in zip(w.kr_op, w.kr_dur, w.kr_bound):
            if op < 0:
                continue
            t = ix.op_top[op]
            self.time[t] += dur
            if bound == "memory":
                self.mem[t] += dur
            if not seen[op]:
                seen[op] = 1
                c = w.cost(op)
                if c is not None:
                    self.flop_s[t] += c.flops / w.peaks.flops_for(c.dtype, c.matmul)
                    self.bytes[t] += c.bytes
        del seen
        names = ix.names
        backward_names = {i for i, s in enumerate(names) if s.startswith(_BACKWARD_PREFIX)}
        self.tops: List[int] = []  # top-level ops that launched work
        self.backward: Dict[int, List[int]] = {}  # sequence number -> backward nodes that launched work
        self.seqs: Dict[int, List[int]] = {}  # forward top-level op -> sequence numbers inside it
        streams: Dict[int, List[int]] = {}
        time, top_of, seq_of, name_of = self.time, ix.op_top, ix.op_seq, ix.op_name
        for i in range(n):
            t = top_of[i]
            if ix.op_kind[i] or time[t] <= 0:
                continue
            seq = seq_of[i]
            if name_of[t] in backward_names:
                if t == i:
                    self.tops.append(i)
                    if seq >= 0:
                        self.backward.setdefault(seq, []).append(i)
                continue
            if seq >= 0:
                lst = self.seqs.setdefault(t, [])
                if seq not in lst:
                    lst.append(seq)
            if t == i:
                self.tops.append(i)
                if names[name_of[i]] not in VIEW_OPS and (w.device_type != "cpu" or self.bytes[i] > 0):
                    streams.setdefault(ix.op_thread[i], []).append(i)
        self.streams = [sorted(s, key=lambda i: ix.op_ts[i]) for s in streams.values()]

    def name(self, op: int) -> str:
        return self.ix.names[self.ix.op_name[op]]

    def linked_backward(self, tops: Sequence[int], claimed: Set[int]) -> List[int]:
        out: List[int] = []
        for t in tops:
            for seq in self.seqs.get(t, ()):
                out.extend(b for b in self.backward.get(seq, ()) if b not in claimed and b not in out)
        return out

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


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def suggest(w: Window, *, step_time_seconds: float, registry: Optional[Sequence] = None,
            min_gain: float = MIN_GAIN) -> List[Suggestion]:
    """Suggestions for one window, ranked existing fixes first, then bundled kernels, each by gain.

    Args:
        w: the classified window (:func:`mfuwatch.agent.analysis.roofline.build_window`).
        step_time_seconds: step time (s) the gains are fractions of.
        registry: ``Remedy`` entries (default ``mfuwatch.kernels.remedies.REMEDIES``).
        min_gain: drop suggestions whose expected gain is below this fraction.
    """
    from mfuwatch.kernels import remedies as reg

    remedies = reg.REMEDIES if registry is None else registry
    if step_time_seconds <= 0 or w.steps <= 0:
        return []
    ctx = _Context(w)
    bw = w.bandwidth()
    claimed: Set[int] = set()
    out: List[Suggestion] = []
    for r in remedies:
        if r.bundled and w.device_type == "cpu":
            continue  # the bundled drop-ins are Triton kernels: patch() refuses them without CUDA
        if r.detector == "launch_bound":
            if w.device_type == "cpu":
                continue
            small = [g for g in w.gaps_us if g < reg.MAX_LAUNCH_GAP_SECONDS * 1e6]
            matches = [_Match(time_us=sum(small), replace_s=0.0)] if small else []  # an upper bound
            names = ["(GPU idle gaps < %d µs)" % round(reg.MAX_LAUNCH_GAP_SECONDS * 1e6)]
        elif r.detector == "fp32_matmul":
            matches, names = _fp32_matmuls(ctx, bw)
        else:
            if r.detector == "pointwise_chain":
                matches = _pointwise_chains(ctx, r, reg.MIN_CHAIN, set())
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
                m.replace_s = m.min_bytes / bw
                if r.keeps_flops:
                    m.replace_s = max(m.replace_s, sum(ctx.flop_s[t] for t in m.fwd + m.bwd))
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
    total = sum(x.expected_gain for x in out)
    if total > 1.0:
        # Amdahl gains of disjoint ops cannot exceed the step; a larger sum means the step time given was
        # shorter than the window's own (e.g. measured outside the profiler). Scale them to fit in one step.
        out = [dataclasses.replace(x, expected_gain=x.expected_gain / total) for x in out]
    out.sort(key=lambda s: (s.kind != "existing", -s.expected_gain))
    return out


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


def _finish(ctx: _Context, r, fwd: List[int], claimed: Set[int]) -> _Match:
    bwd = ctx.linked_backward(fwd, claimed)
    claimed.update(fwd)
    claimed.update(bwd)
    anchor = _anchor(ctx, r, fwd)
    mb = None if anchor is None else r.minimal_bytes(*anchor, backward=bool(bwd))
    return _Match(fwd=list(fwd), bwd=bwd, min_bytes=mb)


def _sequences(ctx: _Context, r, claimed: Set[int]) -> List[_Match]:
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


def _match_at(ctx: _Context, stream: List[int], i: int, steps, claimed: Set[int]):
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


def _region(ctx: _Context, r, claimed: Set[int]) -> List[_Match]:
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


def _pointwise_chains(ctx: _Context, r, min_chain: int, claimed: Set[int]) -> List[_Match]:
    ix = ctx.ix
    out = []

    def pointwise(t: int) -> bool:
        return (ctx.time[t] > 0 and ctx.mem[t] >= ctx.time[t] * 0.999 and ix.op_region[t] < 0
                and ctx.name(t) not in MATMUL_OPS)

    for stream in ctx.streams:
        run: List[int] = []
        for t in stream + [-1]:
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
