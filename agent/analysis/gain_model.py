"""The parts of the expected-gain model that rest on measurements rather than on byte counts alone.

:mod:`.suggest` estimates each remedy's gain as (time of the matched ops − time of the replacement)
/ step time. Three things here make those estimates come true when the fixes are applied
(docs/analyze.md, "How the gains are modelled", gives the measurements behind each):

* :func:`replacement_efficiency`: the fraction of the bandwidth a bundled drop-in actually reaches
  at the anchor's size (forward + backward, GPU time alone), from ``benchmarks/kernels.py`` on an
  H200 (docs/gpu-runs/kernels-run8.md, "CUDA-graph replay" table). A replacement moving B bytes
  takes B / (bandwidth × efficiency), not B / bandwidth: RMSNorm's backward (the ``dw`` column
  reduction) reaches 66% of HBM bandwidth at 4096 × 2048, 88–93% from 8192 × 4096 up.
* :func:`host_bound_gaps`: the GPU idle gaps CUDA graphs can recover are those where the GPU
  waited for the host, i.e. the next activity's launch call returned after the GPU had gone idle.
  A gap before an activity that was already queued (launched while the GPU was still busy) is the
  device's own kernel-to-kernel latency, which a graph replay keeps.
* :func:`graphs_after_compile`: what CUDA graphs still gain once ``torch.compile`` is applied. A compiled
  region (the model's forward, its backward) launches fewer kernels from Inductor's wrapper code, a cheaper
  path than eager dispatch; the GPU waits for the host only when issuing the region's launches takes longer
  than running them. Graphs recover that excess per region, ``max(0, H − G)``, and nothing outside the
  compiled region (``mode="reduce-overhead"`` captures only the compiled graphs: the optimizer step, the
  data loader, syncs stay as they are).
* :func:`eager_grad_layout` and :func:`relayout_credit`: a drop-in whose backward returns the input gradients
  in the inputs' layout (the rotary) also speeds up the backward ops that eager's gradient reached in
  another layout: from the anchor's recorded strides, the layout those ops see; each strided elementwise op
  of that input is credited its time less one contiguous pass over its bytes (H200 Qwen3: the q/k norms'
  backward and the view copies, 1.48 ms/step, docs/gpu-runs/rotary_gain-run1.md).
* :func:`combine`: the set of suggestions a window proposes and their combined gain, Amdahl over
  disjoint op time: a suggestion's gain *in the set* counts only the time of ops no earlier member
  already claimed; one left with under ``min_gain`` is shown as covered by the member that claimed
  most of its time.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .compact import to_array

#: Fraction of the measured bandwidth each bundled kernel reached, forward + backward, by element count
#: (rows × hidden) of its input: docs/gpu-runs/kernels-run8.md, "Timing — CUDA-graph replay" table (H200,
#: bf16, torch 2.11, Triton 3.6), the mfuwatch column's percentage of HBM bandwidth. Between two sizes
#: the fraction is interpolated in log(elements); outside them the nearest is used. Kernels without a
#: row (rotary, cross_entropy) are taken to reach the bandwidth (1.0).
EFFICIENCY: Dict[str, Tuple[Tuple[int, float], ...]] = {
    "rms_norm": ((4096 * 2048, 0.66), (8192 * 4096, 0.88), (16384 * 4096, 0.92), (8192 * 8192, 0.89),
                 (16384 * 8192, 0.93)),
    "layer_norm": ((4096 * 2048, 0.60), (8192 * 4096, 0.80), (16384 * 4096, 0.79), (8192 * 8192, 0.79),
                   (16384 * 8192, 0.84)),
    "swiglu": ((8192 * 11008, 1.0), (16384 * 14336, 1.0)),
    "geglu": ((8192 * 11008, 1.0), (16384 * 14336, 1.0)),
}


def replacement_efficiency(kernel: str, elements: int) -> float:
    """Fraction (0, 1] of the bandwidth the drop-in ``kernel`` reaches on an input of ``elements``
    elements (:data:`EFFICIENCY`; 1.0 for a kernel without measurements or ``elements <= 0``)."""
    rows = sorted(EFFICIENCY.get(kernel, ()))
    if not rows or elements <= 0:
        return 1.0
    sizes = [n for n, _ in rows]
    i = bisect.bisect_left(sizes, elements)
    if i == 0:
        return rows[0][1]
    if i == len(rows):
        return rows[-1][1]
    (n0, e0), (n1, e1) = rows[i - 1], rows[i]
    if n1 == n0:
        return max(e0, e1)
    t = (math.log(elements) - math.log(n0)) / (math.log(n1) - math.log(n0))
    return e0 + t * (e1 - e0)


def host_bound_gaps(ts: Sequence[float], dur: Sequence[float], launch_end: Sequence[float],
                    max_gap_us: float) -> List[Tuple[float, int, int]]:
    """GPU idle gaps shorter than ``max_gap_us`` in which the GPU waited for the host.

    Args:
        ts, dur: start and duration (µs) of each GPU activity (any order).
        launch_end: when each activity's launch call returned (µs; NaN unknown).
        max_gap_us: only gaps shorter than this (longer ones are input stalls, syncs, not launches).
    Returns:
        ``[(recoverable µs, activity before, activity after)]``: for each gap between the union of the
        activities before and the next activity, ``min(gap, launch_end(next) − gap start)`` when the launch
        returned after the gap began (the GPU ran dry waiting for it); gaps where the next activity was
        queued before the GPU went idle recover nothing. An unknown launch time counts the whole gap
        (the old upper bound).
    """
    import numpy as np

    out: List[Tuple[float, int, int]] = []
    if not len(ts):
        return out
    # activities by start (equal starts in index order), as an array("q"): 8 bytes an activity, not a list of ints
    order = to_array(np.argsort(np.asarray(ts, dtype=np.float64), kind="stable").astype(np.int64))
    reach, last = ts[order[0]] + dur[order[0]], order[0]
    for k in order[1:]:
        gap = ts[k] - reach
        if 0 < gap < max_gap_us:
            le = launch_end[k]
            if le != le:  # NaN: no launch event for it
                out.append((gap, last, k))
            elif le > reach:
                out.append((min(gap, le - reach), last, k))
        end = ts[k] + dur[k]
        if end > reach:
            reach, last = end, k
    return out


#: Where a GPU activity was launched from, for CUDA graphs: the model's forward, its backward (the autograd
#: engine), or outside both (the optimizer step, zero_grad, anything under another annotation).
FORWARD, BACKWARD, OUTSIDE = 0, 1, 2


@dataclass
class RegionLaunches:
    """One compiled region's launches in an eager window, and what ``torch.compile`` leaves of them.

    Attributes:
        launches: GPU activities the region launched in the window (eager).
        host_us: µs over which the host issued them (per step, first to last launch call's return; summed
            over the window's steps).
        kernels_after: activities it launches once compiled: the kernels compile keeps (matmuls, attention,
            any op it does not fuse) plus one per fused group.
        gpu_us_after: GPU µs of the region once compiled: the kept kernels' time plus the fused groups'
            replacement time.
    """

    launches: int
    host_us: float
    kernels_after: int
    gpu_us_after: float


def graphs_after_compile(regions: Sequence[RegionLaunches], host_us_per_launch: float = -1.0) -> float:
    """µs of the window CUDA graphs still recover once the regions are compiled: Σ max(0, H − G).

    ``H`` = ``kernels_after`` × the host µs per launch after compile, ``G`` = ``gpu_us_after``. The host cost
    of one launch after compile is bounded by the eager window's own (``host_us / launches`` of the most
    expensive region, or ``host_us_per_launch`` when given ≥ 0): eager dispatch goes through the Python
    module code, the dispatcher and the op's launch; Inductor's wrapper calls the launch directly. When the
    compiled region's GPU time exceeds that bound the host runs ahead of the GPU (the launch queue fills)
    and no gap is left for a graph replay to remove; below it the GPU starves for the difference.

    Raises nothing: regions without launches add 0.
    """
    per = host_us_per_launch
    if per < 0:
        per = max((r.host_us / r.launches for r in regions if r.launches > 0), default=0.0)
    return sum(max(0.0, r.kernels_after * per - r.gpu_us_after) for r in regions if r.launches > 0)


def gap_key(k: int) -> int:
    """The :class:`Claim` key of the host-bound idle gap before GPU activity ``k`` (``k`` ≥ 0): ``-1 - k``,
    negative, so it never equals an op's key (the op's id, ≥ 0). Plain ints rather than tuples such as
    ``("gap", k)``: 64 bytes less per key."""
    return -1 - k


@dataclass
class Claim:
    """What one suggestion replaces, for :func:`combine`.

    ``gain``: its gain alone (fraction of step time); ``time_us``: µs in the window of each thing its gain
    comes from; ``also``: what it removes besides, without counting it in its gain (a fix that fuses or
    replaces ops removes their launches, and with them the host-bound gaps next to their kernels: a later
    ``cuda_graphs`` cannot gain them again). Keys are any hashables, equal when two claims take the same
    thing: :mod:`.suggest` keys a top-level op (forward or backward) by its id (an int ≥ 0) and the
    host-bound idle gap before GPU activity ``k`` by :func:`gap_key` (a negative int).
    """

    kernel: str
    gain: float
    time_us: Dict[object, float] = field(default_factory=dict)
    also: Dict[object, float] = field(default_factory=dict)


def combine(claims: Sequence[Claim], min_gain: float) -> Tuple[Dict[str, float], Dict[str, str], float]:
    """Gains in the set, what covers what, and the combined gain (Amdahl over disjoint op time).

    ``claims`` in ranking order. A claim's gain in the set = its gain × (time of its keys no earlier
    member claimed) / (time of all its keys): the replacement is taken to shrink with the time left to
    it. A claim whose gain in the set is below ``min_gain`` is not a member; it is covered by the member
    that claimed most of its time (None when its own gain was the problem). Returns
    ``(gain_in_set by kernel, covered_by by kernel, combined gain = Σ members' gains in the set)``.
    """
    owner: Dict[object, str] = {}
    in_set: Dict[str, float] = {}
    covered: Dict[str, str] = {}
    for c in claims:
        total = sum(c.time_us.values())
        taken: Dict[str, float] = {}
        for key, t in c.time_us.items():
            o = owner.get(key)
            if o is not None:
                taken[o] = taken.get(o, 0.0) + t
        left = total - sum(taken.values())
        if left <= 1e-9 * total:  # all of it claimed already (summation leaves ~1e-16 residues)
            left = 0.0
        g = c.gain * (left / total) if total > 0 else c.gain
        in_set[c.kernel] = max(0.0, g)
        if g < min_gain and taken:
            covered[c.kernel] = max(taken, key=taken.get)
            continue
        if g < min_gain:
            continue
        for key in (*c.time_us, *c.also):
            owner.setdefault(key, c.kernel)
    combined = sum(g for k, g in in_set.items() if k not in covered and g >= min_gain)
    return in_set, covered, min(combined, 1.0)


def eager_grad_layout(dims: Sequence[int], strides: Sequence[int]) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """The (dims, strides) in which the backward ops upstream of a permuted view see a gradient that comes
    back contiguous in the view's own dim order, or None when the view is not a permuted dense tensor.

    A rotary input ``q = base.transpose(1, 2)`` (``base`` (B, T, H, D) contiguous, e.g. a projection or its
    q-norm's output) has ``dims`` (B, H, T, D) and strides (T·H·D, D, H·D, 1). In the H200 traces (torch
    2.11, docs/gpu-runs/rotary_gain-run1.md) eager ``rotate_half``'s gradient for q is accumulated into
    ``slice_backward``'s buffers (``zeros(q.shape)``, contiguous in (B, H, T, D)): the autograd engine adds the
    ``q * cos`` gradient into them in place. Seen by ``base``'s backward (in ``base``'s dim order: ``q``'s
    dims sorted by decreasing stride) it has dims (B, T, H, D) and strides (H·T·D, D, T·D, 1): not
    contiguous, so the elementwise kernels there take ATen's strided path and the ``view`` back to
    (B, T, H·D) copies. A drop-in whose backward writes the gradient in ``q``'s own strides hands ``base`` a
    contiguous one. Whether eager's gradient really arrives so is read from the trace, not assumed: only
    ops whose recorded ``Input Strides`` are this layout are credited (a torch that returns the gradient in
    the upstream gradient's layout, as 2.13 does on the CPU, shows no such op and gets no credit).

    Args:
        dims, strides: the view's recorded ``Input Dims`` and ``Input Strides`` (same length).
    Returns:
        ``(dims, strides)`` of that gradient in the base's dim order; None when ``strides`` are contiguous
        already (no relayout) or not a permutation of a dense layout (a slice, a broadcast), or lengths differ.
    """
    n = len(dims)
    if n < 2 or len(strides) != n or any(int(d) < 1 for d in dims):
        return None
    order = sorted(range(n), key=lambda i: -int(strides[i]))  # base's dim order (stable for equal strides)
    dense, acc = [0] * n, 1
    for i in reversed(order):
        dense[i] = acc
        acc *= int(dims[i])
    if any(int(dims[i]) > 1 and int(strides[i]) != dense[i] for i in range(n)):
        return None  # not a permuted dense tensor
    if order == list(range(n)):
        return None  # contiguous: eager's gradient has this layout too
    contig, acc = [0] * n, 1
    for i in reversed(range(n)):
        contig[i] = acc
        acc *= int(dims[i])
    return tuple(int(dims[i]) for i in order), tuple(contig[i] for i in order)


def relayout_credit(strided_us: float, contiguous_bytes: float, bandwidth: float) -> float:
    """µs a strided elementwise op saves once its input arrives in its own layout: its strided kernels'
    time less one contiguous pass over its bytes at ``bandwidth`` (bytes/s), at least 0.

    The op keeps its work (same bytes, same FLOPs); only the index arithmetic and uncoalesced accesses of
    ATen's strided path (``at::native::elementwise_kernel<128, N>``, ``launch_legacy_kernel`` in
    ``ATen/native/cuda/CUDALoops.cuh``) go. A copy that only re-laid the gradient out (``ViewBackward0``'s
    reshape) vanishes altogether with the drop-in; it is still charged one pass here (conservative)."""
    if strided_us <= 0 or bandwidth <= 0:
        return 0.0
    return max(0.0, strided_us - contiguous_bytes / bandwidth * 1e6)
