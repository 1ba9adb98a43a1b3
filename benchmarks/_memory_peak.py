"""What is alive at the peak of a stretch of CUDA work: a replay of torch's allocator trace.

``record(fn)`` runs ``fn()`` under ``torch.cuda.memory._record_memory_history`` and returns the trace of the
current device (``torch.cuda.memory._snapshot()["device_traces"]``). ``peak_breakdown(trace)`` replays it:
each ``alloc`` adds its block, each ``free_requested`` (or a ``free_completed`` whose request was not seen)
removes it, as ``torch.cuda.memory_allocated`` counts. It returns the bytes above the start at the highest
point, and the blocks alive there grouped by where they were allocated: the innermost Python frame outside
torch's package folder (``site`` decides), so a group names the model, kernel or library line that asked for the memory.

Blocks allocated before ``fn`` started are not in the trace; the breakdown is of what ``fn`` added (and
frees of older blocks lower the running total below zero, which the replay allows).
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: Path fragments of frames skipped besides torch's own package (the standard library's wrappers).
SKIPPED_FRAGMENTS = ("<frozen", "/contextlib.py", "/functools.py")


def _torch_dir() -> str:
    """torch's package folder with a trailing slash ("" when torch is not importable). A path test, not a
    "/torch/" substring: an environment may itself live under a folder named torch."""
    try:
        import torch
    except ImportError:
        return ""
    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def site(frames: Sequence[dict], torch_dir: Optional[str] = None) -> str:
    """``file:line function`` of the innermost frame outside torch's package folder (``torch_dir``, found
    from ``torch.__file__`` when None) and :data:`SKIPPED_FRAGMENTS` (``frames`` innermost first, as the
    snapshot lists them); "?" when there is none."""
    tdir = _torch_dir() if torch_dir is None else torch_dir
    for f in frames:
        name = f.get("filename", "")
        if not (tdir and name.startswith(tdir)) and not any(p in name for p in SKIPPED_FRAGMENTS):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{f.get('line', 0)} {f.get('name', '')}"
    return "?"


def peak_breakdown(trace: Sequence[dict], where: Optional[Callable[[Sequence[dict]], str]] = None,
                   top: int = 12) -> Tuple[int, List[Tuple[int, int, str]]]:
    """(bytes above the start at the peak, [(bytes, blocks, site)] of the blocks alive there, largest first,
    at most ``top`` rows plus one "other" row for the rest).

    ``trace``: the allocator events of one device, each a dict with ``action`` ("alloc", "free_requested",
    "free_completed", or segment actions, which are ignored), ``addr``, ``size`` (bytes) and ``frames``.
    """
    if where is None:
        where = functools.partial(site, torch_dir=_torch_dir())
    alive: Dict[int, dict] = {}
    cur = best = 0
    best_i = -1
    for i, ev in enumerate(trace):
        act, addr = ev.get("action"), ev.get("addr")
        if act == "alloc":
            alive[addr] = ev
            cur += ev["size"]
        elif act in ("free_requested", "free_completed"):
            if act == "free_completed" and addr not in alive:
                continue  # its request was seen (and counted) earlier
            if addr in alive:
                alive.pop(addr)
            cur -= ev["size"]
        else:
            continue
        if cur > best:
            best, best_i = cur, i
    alive.clear()
    for ev in trace[:best_i + 1]:  # the second pass keeps the set alive at the peak
        act, addr = ev.get("action"), ev.get("addr")
        if act == "alloc":
            alive[addr] = ev
        elif act in ("free_requested", "free_completed"):
            alive.pop(addr, None)
    groups: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for ev in alive.values():
        g = groups[where(ev.get("frames") or [])]
        g[0] += ev["size"]
        g[1] += 1
    rows = sorted(((b, n, s) for s, (b, n) in groups.items()), reverse=True)
    if len(rows) > top:
        rest = rows[top:]
        rows = rows[:top] + [(sum(r[0] for r in rest), sum(r[1] for r in rest), f"other ({len(rest)} sites)")]
    return best, rows


def record(fn: Callable[[], object], max_entries: int = 500_000) -> List[dict]:
    """Run ``fn()`` (on the current CUDA device) with the allocator's history recorded (Python stacks);
    return that device's trace. The history is switched off again even if ``fn`` raises."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces") or [[]]
    return list(traces[torch.cuda.current_device()] if len(traces) > torch.cuda.current_device() else [])
