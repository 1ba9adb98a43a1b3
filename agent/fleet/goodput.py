"""Goodput: where each second of a rank's wall time went, as monotonic per-bucket counters.

**Goodput** = productive step time / wall time since the agent started, per rank
(``mfuwatch_goodput_ratio``); the job's is the recording rule
``sum(rate(productive)) / sum(rate(all buckets))`` (``docs/fleet.md``). Every
second between the agent's start and the latest event on the training thread
lands in exactly one bucket of :data:`BUCKETS`:

``productive``       optimizer steps from their first forward to the step boundary, after warm-up
``input_wait``       step boundary (or phase end) to the next step's first forward: the loop waits for data
``warmup``           the first ``warmup_steps`` steps, and any step during which ``torch.compile`` compiled
                     a new graph (recompilation)
``checkpoint_save``  ``with agent.phase("checkpoint")``, and ``torch.save`` / ``torch.distributed.checkpoint``
                     saves the agent hooked (:mod:`mfuwatch.agent.fleet.checkpoint_hooks`)
``checkpoint_load``  ``with agent.phase("checkpoint_load")`` and the hooked loads
``eval``             ``with agent.phase("eval")``
``lost_progress``    steps re-done after a restart: the steps the previous attempt ran after its last
                     checkpoint, read from the run's own timeline (:func:`steps_to_redo`)
``startup``          agent start to the first forward (model set-up, data loader start)
``other``            the tail after the last step, counted at ``close()``

Times are host ``time.perf_counter()`` readings on the training thread (no
device sync). On a GPU the host can run ahead of the device, so
a boundary-to-forward gap the host spends loading data while the GPU still
computes counts as input wait; in steady state the host waits on the device
inside the step and the partition matches device time (``docs/fleet.md``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

BUCKETS = ("productive", "input_wait", "warmup", "checkpoint_save", "checkpoint_load", "eval", "lost_progress",
           "startup", "other")

#: ``agent.phase(name)`` names and the bucket each fills.
PHASES: Dict[str, str] = {
    "eval": "eval",
    "evaluation": "eval",
    "checkpoint": "checkpoint_save",
    "checkpoint_save": "checkpoint_save",
    "checkpoint_load": "checkpoint_load",
}


def phase_bucket(name: str) -> str:
    """The goodput bucket of phase ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`PHASES` (the message lists them).
    """
    try:
        return PHASES[name]
    except (KeyError, TypeError):
        raise ValueError(f"phase: unknown phase {name!r}; accepted: {', '.join(sorted(PHASES))}") from None


class GoodputClock:
    """Partitions wall time into :data:`BUCKETS` from events on the training thread.

    Args:
        warmup_steps: the first optimizer steps counted as ``warmup`` (compilation, allocator and cache warm-up).
        redo_steps: steps after these that re-do lost progress (``lost_progress``), from :func:`steps_to_redo`.
        now: a ``time.perf_counter``-like clock in seconds (injectable for tests).

    Events are called on the training thread; :meth:`snapshot` may be called
    from any thread (it copies under a lock). Each event is O(1).
    """

    def __init__(self, warmup_steps: int = 1, redo_steps: int = 0, now: Callable[[], float] = time.perf_counter) -> None:
        self.warmup_steps = int(warmup_steps)
        self.redo_steps = int(redo_steps)
        self._now = now
        self._lock = threading.Lock()
        self.seconds: Dict[str, float] = {b: 0.0 for b in BUCKETS}
        self._t = now()
        self._state = "startup"  # "startup" | "between" | "step"
        self._step_acc = 0.0  # step time accumulated before a phase inside the step
        self._phases: List[tuple] = []  # stack of (bucket, state at entry)
        self._steps = 0
        self._forward_seen = False

    def _add(self, bucket: str, dt: float) -> None:
        if dt > 0:
            with self._lock:
                self.seconds[bucket] += dt

    def step_bucket(self, step: int, compiled: bool = False) -> str:
        """The bucket of optimizer step ``step`` (1-based): warm-up, re-done progress or productive."""
        if step <= self.warmup_steps or compiled:
            return "warmup"
        if step <= self.warmup_steps + self.redo_steps:
            return "lost_progress"
        return "productive"

    # -- training-thread events ----------------------------------------------------------------
    def forward_start(self) -> None:
        """The first forward of a step begins (the forward pre-hook, once per step)."""
        if self._phases or self._state == "step":
            return
        t = self._now()
        self._add("input_wait" if self._state == "between" else "startup", t - self._t)
        self._t, self._state, self._forward_seen = t, "step", True

    def boundary(self, step: int, compiled: bool = False) -> str:
        """Optimizer step ``step`` ended; returns the bucket its time went to.

        Without a forward hook (``agent.step()`` with no model) the whole
        boundary-to-boundary time is step time.
        """
        t = self._now()
        self._steps = step
        bucket = self.step_bucket(step, compiled)
        if self._state == "startup" and self._forward_seen is False and step == 1 and not self._phases:
            # no forward hook: the first step began when the loop started, which we cannot see
            self._add(bucket, t - self._t)
        elif not self._phases:
            self._add(bucket, self._step_acc + (t - self._t))
        self._step_acc = 0.0
        self._t, self._state = t, "between"
        return bucket

    def enter(self, bucket: str) -> None:
        """A phase (eval, checkpoint) begins; the current segment is closed first."""
        t = self._now()
        if self._phases:
            self._add(self._phases[-1][0], t - self._t)
        elif self._state == "step":
            self._step_acc += t - self._t
        else:
            self._add("other" if self._state == "between" else "startup", t - self._t)
        self._phases.append((bucket, self._state))
        self._t = t

    def exit(self) -> Optional[str]:
        """The innermost phase ends; returns the state it returns to (``"between"``, ``"step"``, ``"startup"``)."""
        if not self._phases:
            return None
        t = self._now()
        bucket, state = self._phases.pop()
        self._add(bucket, t - self._t)
        self._t = t
        if state == "startup":
            state = "between" if self._steps else "startup"
        self._state = state
        return state

    @property
    def in_phase(self) -> bool:
        """Whether a phase is open."""
        return bool(self._phases)

    def close(self) -> None:
        """Count the time since the last event (the tail after the last step) as ``other``."""
        t = self._now()
        while self._phases:
            self.exit()
        self._add("other", t - self._t)
        self._t = t

    # -- any thread ---------------------------------------------------------------------------
    def snapshot(self) -> Dict[str, float]:
        """``{bucket: seconds}`` so far (closed segments only), a copy."""
        with self._lock:
            return dict(self.seconds)

    @staticmethod
    def ratio(seconds: Mapping[str, float]) -> Optional[float]:
        """Productive / total seconds of a snapshot, ``None`` before any time is counted."""
        total = sum(seconds.values())
        return seconds.get("productive", 0.0) / total if total > 0 else None


#: Bytes of a timeline's end read at start-up for the lost-progress figure (about 200k records):
#: a long run's timeline can be gigabytes, and only its last attempt matters.
TAIL_BYTES = 64 * 2**20


def tail_records(path: Any, max_bytes: int = TAIL_BYTES) -> List[Dict[str, Any]]:
    """The JSON records of the last ``max_bytes`` of a timeline (a cut first line and a torn last line skipped).

    Raises:
        OSError: the file cannot be read.
    """
    import json
    import os

    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        start = max(0, size - max_bytes)
        fh.seek(start)
        data = fh.read()
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first line is cut
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line (a killed job) or garbage: not a record
        if isinstance(rec, dict):
            out.append(rec)
    return out


def steps_to_redo(records: Iterable[Mapping[str, Any]]) -> Dict[str, float]:
    """Progress the previous attempt of a run lost: steps it ran after its last checkpoint.

    ``records`` is the run's own timeline (:func:`mfuwatch.agent.live.timeline.read_timeline`):
    each attempt (one process's agent) starts with an ``attempt`` record (the
    ``run`` records are not used: an attempt normally writes one, and another
    when its dtype or peak changes later); ``checkpoint`` records (kind
    ``checkpoint``, written when a checkpoint save ends) carry the agent's
    ``step``; ``step`` records carry ``step``, ``steps`` and ``step_time_seconds``.

    Returns ``{"steps": S - C, "seconds": time those steps took, "last_step": S,
    "checkpoint_step": C}`` for the last attempt in the file (zeros when it has
    no step after its last checkpoint). Without any checkpoint in that attempt,
    every step it ran is lost (a restart from scratch).
    """
    last_step = 0
    ckpt = 0
    steps: List[tuple] = []  # (last step of the record, steps, step_time_seconds)
    for rec in records:
        kind = rec.get("kind")
        if kind == "attempt":
            last_step, ckpt, steps = 0, 0, []
        elif kind == "step":
            try:
                s, n, st = int(rec["step"]), int(rec.get("steps") or 1), float(rec.get("step_time_seconds") or 0.0)
            except (KeyError, TypeError, ValueError):
                continue
            last_step = max(last_step, s)
            steps.append((s, n, st))
        elif kind == "checkpoint" and rec.get("phase", "save") == "save":
            try:
                ckpt = max(ckpt, int(rec.get("step") or 0))
            except (TypeError, ValueError):
                continue
    lost = max(0, last_step - ckpt)
    seconds = 0.0
    for s, n, st in steps:
        first = s - n + 1
        after = s - max(first - 1, ckpt)  # steps of this record after the checkpoint
        if after > 0:
            seconds += min(after, n) * st
    return {"steps": float(lost), "seconds": seconds, "last_step": float(last_step), "checkpoint_step": float(ckpt)}
