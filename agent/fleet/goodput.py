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


#: Bytes of a timeline's end read at start-up for the lost-progress figure (about 50k records, half a
#: million steps at the default report cadence): a long run's timeline can be gigabytes, and only its
#: last attempt matters. Read off the training thread (:class:`ResumeReader`).
TAIL_BYTES = 16 * 2**20
#: A longer line in that tail is not one of the agent's records (theirs are a few KB): skipped, counted.
MAX_RECORD_BYTES = 2**20
#: Largest step number believed (a step a microsecond for eleven days); and the fastest step rate
#: believed between two records with timestamps (steps per second).
MAX_PLAUSIBLE_STEP = 10**12
MAX_STEPS_PER_SECOND = 1e5


def iter_tail_records(path: Any, max_bytes: int = TAIL_BYTES, skipped: Optional[List[int]] = None):
    """Yield the JSON records (dicts) of the last ``max_bytes`` of a timeline; a cut first line, a torn last
    line, garbage and lines longer than :data:`MAX_RECORD_BYTES` are skipped (each counted in
    ``skipped[0]`` when a one-element list is given).

    Raises:
        OSError: the file cannot be read.
    """
    import json
    import os

    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        start = max(0, size - max_bytes)
        fh.seek(start)
        data = fh.read(max_bytes)
    pos = 0
    if start > 0:
        cut = data.find(b"\n")
        pos = len(data) if cut < 0 else cut + 1  # the first line is cut
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            end = len(data)
        line = data[pos:end]
        pos = end + 1
        if not line.strip():
            continue
        if len(line) > MAX_RECORD_BYTES:
            if skipped is not None:
                skipped[0] += 1
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if skipped is not None and end < len(data):  # a torn last line is no sign of trouble
                skipped[0] += 1
            continue
        if isinstance(rec, dict):
            yield rec


def tail_records(path: Any, max_bytes: int = TAIL_BYTES) -> List[Dict[str, Any]]:
    """The records of :func:`iter_tail_records` as a list.

    Raises:
        OSError: the file cannot be read.
    """
    return list(iter_tail_records(path, max_bytes))


def _whole(x: Any) -> Optional[int]:
    """``x`` as an int when it is a finite whole number (an int, or a float such as 10.0), else ``None``."""
    import math

    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, float) and math.isfinite(x) and x == int(x):
        return int(x)
    return None


def _finite(x: Any) -> Optional[float]:
    import math

    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def steps_to_redo(records: Iterable[Mapping[str, Any]], ignored: Optional[List[int]] = None) -> Dict[str, float]:
    """Progress the previous attempt of a run lost: steps it ran after its last checkpoint.

    ``records`` is the run's own timeline (:func:`mfuwatch.agent.live.timeline.read_timeline`):
    each attempt (one process's agent) starts with an ``attempt`` record (the
    ``run`` records are not used: an attempt normally writes one, and another
    when its dtype or peak changes later); ``checkpoint`` records (kind
    ``checkpoint``, written when a checkpoint save ends) carry the agent's
    ``step``; ``step`` records carry ``step``, ``steps`` and ``step_time_seconds``.

    Implausible records are ignored, and counted in ``ignored[0]`` when a one-element list is
    given: a ``step`` record whose ``step``/``steps`` are not whole numbers with
    ``1 <= steps <= step <= MAX_PLAUSIBLE_STEP``, whose ``step_time_seconds`` is not finite and >= 0,
    that does not come after the attempt's previous step record, or that claims more steps since
    the previous record (or the attempt record) than :data:`MAX_STEPS_PER_SECOND` allow in the time
    between their timestamps; a ``checkpoint`` record whose ``step`` is not a whole number in
    ``0..MAX_PLAUSIBLE_STEP`` or is past the same rate bound.

    Returns ``{"steps": S - C, "seconds": time those steps took, "last_step": S,
    "checkpoint_step": C}`` for the last attempt in the file (zeros when it has
    no step after its last checkpoint). Without any checkpoint in that attempt,
    every step it ran is lost (a restart from scratch). When ``records`` begin inside the
    attempt (a bounded tail without its ``attempt`` record), C is at least the step before
    their first step record: only the steps in view are counted, a lower bound.
    """
    bad = [0]
    last_step = 0
    ckpt = 0
    seen_attempt = False
    base: Optional[int] = None  # without the attempt record in view: the step before the first record seen
    steps: List[tuple] = []  # (last step of the record, steps, step_time_seconds)
    ref_ts: Optional[float] = None  # timestamp of the attempt record or the last accepted step record

    def too_fast(step: int, ts: Optional[float], slack: int) -> bool:
        """More steps since the reference than the rate bound allows in the time between their stamps."""
        if ts is None or ref_ts is None:
            return False
        return step - last_step > MAX_STEPS_PER_SECOND * max(0.0, ts - ref_ts) + slack

    for rec in records:
        kind = rec.get("kind")
        if kind == "attempt":
            last_step, ckpt, steps, seen_attempt, base = 0, 0, [], True, None
            ref_ts = _finite(rec.get("timestamp"))
        elif kind == "step":
            s, n = _whole(rec.get("step")), _whole(rec.get("steps", 1) if rec.get("steps") is not None else 1)
            st = _finite(rec.get("step_time_seconds") if rec.get("step_time_seconds") is not None else 0.0)
            ts = _finite(rec.get("timestamp"))
            if s is None or n is None or st is None or not (1 <= n <= s <= MAX_PLAUSIBLE_STEP) or st < 0 or \
                    s <= last_step or too_fast(s, ts, n):
                bad[0] += 1
                continue
            if not seen_attempt and base is None:
                base = s - n
            last_step = max(last_step, s)
            if ts is not None:
                ref_ts = ts
            steps.append((s, n, st))
        elif kind == "checkpoint" and rec.get("phase", "save") == "save":
            c = _whole(rec.get("step") if rec.get("step") is not None else 0)
            if c is None or not 0 <= c <= MAX_PLAUSIBLE_STEP or too_fast(c, _finite(rec.get("timestamp")), 1):
                bad[0] += 1
                continue
            ckpt = max(ckpt, c)
    if ignored is not None:
        ignored[0] += bad[0]
    # a tail that starts inside the attempt shows only its own steps: those after the tail's first record
    # (a lower bound of what was lost; a whole attempt without a checkpoint in view is not assumed lost)
    floor = ckpt if base is None else max(ckpt, base)
    lost = max(0, last_step - floor)
    seconds = 0.0
    for s, n, st in steps:
        first = s - n + 1
        after = s - max(first - 1, floor)  # steps of this record after the checkpoint
        if after > 0:
            seconds += min(after, n) * st
    return {"steps": float(lost), "seconds": seconds, "last_step": float(last_step), "checkpoint_step": float(ckpt)}


def read_resume(path: Any, max_bytes: int = TAIL_BYTES) -> Dict[str, float]:
    """:func:`steps_to_redo` of the last ``max_bytes`` of the timeline at ``path``, streaming, plus
    ``"ignored"``: the records skipped as implausible, oversized or garbled.

    Raises:
        OSError: the file cannot be read.
    """
    skipped = [0]
    out = steps_to_redo(iter_tail_records(path, max_bytes, skipped), skipped)
    out["ignored"] = float(skipped[0])
    return out


class ResumeReader:
    """Reads :func:`read_resume` on its own daemon thread, so a start-up never waits for the disk.

    Args:
        path: the timeline (a missing file: no previous attempt, zeros at once).
        on_done: called on the reader thread with the result (it never raises into the reader).

    Call :meth:`start` to begin (after the owner holds the reader, which ``on_done`` may use).

    :meth:`result` waits for the read (at most ``timeout`` seconds) and returns it, or ``None`` if
    it is still running; a read that failed returns zeros and ``error`` holds the exception.
    """

    ZERO = {"steps": 0.0, "seconds": 0.0, "last_step": 0.0, "checkpoint_step": 0.0}

    def __init__(self, path: Any, on_done: Optional[Callable[[Dict[str, float]], None]] = None) -> None:
        self.path = path
        self.on_done = on_done
        self.error: Optional[BaseException] = None
        self.ignored = 0
        self._result: Optional[Dict[str, float]] = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mfuwatch-resume", daemon=True)

    def start(self) -> "ResumeReader":
        """Start the reader thread; returns ``self``."""
        self._thread.start()
        return self

    def _run(self) -> None:
        import os

        out = dict(self.ZERO)
        try:
            if os.path.isfile(self.path):
                got = read_resume(self.path)
                self.ignored = int(got.pop("ignored"))
                out = got
        except Exception as exc:  # noqa: BLE001 - a torn or foreign timeline: no lost-progress figure
            self.error = exc
        self._result = out
        if self.on_done is not None:
            try:
                self.on_done(out)
            except Exception:  # noqa: BLE001
                pass
        self._done.set()  # after on_done: whoever waits sees its effects

    @property
    def done(self) -> bool:
        """Whether the read has finished."""
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> Optional[Dict[str, float]]:
        """The resume figures (see the class docstring)."""
        self._done.wait(timeout)
        return self._result
