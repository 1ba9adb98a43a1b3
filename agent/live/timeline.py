"""The local timeline: one JSON line per measurement, for reports and offline analysis.

Record kinds (``schema.to_record`` and the fleet's): ``run``, ``attempt``, ``step``, ``window``,
``gpu``, ``alert``, ``phase``, ``checkpoint``, ``hang``. Writes never block the training thread;
each line is flushed as it is written.

Order. Records go to the file in the order of their ``timestamp`` (unix seconds), though they
are written from several threads and a ``step`` record is known only after its steps complete
on the device, when the agent thread reads them — later than, say, the ``phase`` record of an
evaluation that followed those steps. So a record stamped at or after the **watermark** (the
earliest time a step record still to come can carry, :meth:`Timeline.advance`) waits in memory
until the agent thread moves the watermark past it, writes the step record before it
(:meth:`Timeline.write_in_order`), or :data:`MAX_HOLD_SECONDS` pass; :meth:`Timeline.close`
writes whatever waits. A job killed with SIGKILL loses at most those seconds of records, and may
leave its last line cut: a ``Timeline`` opened on a file that does not end with a newline writes one
first, so the cut line stays one bad line (readers skip it) and the new records are whole. At the
agent's close, once the last step record is written, :meth:`Timeline.release` writes what waits and
lets later records (the alerts' resolutions) straight out, before the close waits on the network.

The ``run`` record. Each agent writes one, first: :meth:`Timeline.start_header` holds every
record until the run's facts settle (the training dtype and its peak are known at the first
forward, the first step's completion is awaited), then :meth:`Timeline.write_header` writes it
ahead of them. If they have not settled after :data:`MAX_HOLD_SECONDS` (no forward yet: a long
checkpoint load or compilation), the record goes out with what is known, and a later ``run``
record with the same ``run``/``rank`` fills in what was learnt later (readers update the run's
facts from it; :func:`mfuwatch.agent.report.html.load_timeline` does).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

#: seconds a record may wait for the records stamped before it (and the run record) at most
MAX_HOLD_SECONDS = 15.0


def _clean(obj: Any) -> Any:
    """JSON has no NaN/Infinity: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _stamp(record: Dict[str, Any]) -> float:
    """The record's ``timestamp`` (unix seconds), else now."""
    ts = record.get("timestamp")
    if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts):
        return float(ts)
    return time.time()


def _ends_with_newline(fh: Any) -> bool:
    """Whether the file open for appending in ``fh`` is empty or ends with ``\\n``; ``True`` when it is no
    regular file (a pipe, ``/dev/stdout``: never read) or cannot be read back (nothing to repair then)."""
    import os
    import stat

    try:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return True
        with open(fh.name, "rb") as rd:
            rd.seek(st.st_size - 1)
            return rd.read(1) in (b"\n", b"")
    except (OSError, ValueError):
        return True


class Timeline:
    """Append-only JSONL writer that keeps records in timestamp order. ``path=None`` makes every call a no-op.

    Any thread may call :meth:`write`; the agent thread calls :meth:`advance`, :meth:`write_in_order`
    and :meth:`write_header` (see the module docstring for the order they keep).

    Args:
        path: the JSONL file, appended to (its folder is created); when it does not end with a newline (a
            job killed mid-write), one is written first.
        max_hold_seconds: how long a record may wait for those stamped before it, at most.
        monotonic: ``time.monotonic``-like clock for the waiting time (tests).

    Raises:
        OSError: at construction, if the file cannot be opened for appending; from the write
            methods, if the disk fails (the agent counts it under ``timeline``).
    """

    def __init__(self, path: Optional[Union[str, Path]], max_hold_seconds: float = MAX_HOLD_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path) if path else None
        self.max_hold_seconds = float(max_hold_seconds)
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._fh = None
        self._held: List[Tuple[float, int, float, Dict[str, Any]]] = []  # heap of (stamp, seq, held since, record)
        self._seq = itertools.count()
        self._watermark: Optional[float] = None  # None: no step record pending, records go straight out
        self._header: Optional[Callable[[], Dict[str, Any]]] = None
        self._header_since = 0.0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")
            if not _ends_with_newline(self._fh):  # a job killed mid-write cut the last line: end it first,
                self._fh.write("\n")            # so it stays one bad line and this run's records are whole
                self._fh.flush()

    # ------------------------------------------------------------------ any thread
    def write(self, record: Dict[str, Any]) -> None:
        """Append one record (a dict with a ``kind`` key), or hold it while records stamped before it
        may still come (at or after the watermark) or the run record is pending."""
        if self._fh is None:
            return
        with self._lock:
            stamp = _stamp(record)
            if self._header is not None or (self._watermark is not None and stamp >= self._watermark):
                heapq.heappush(self._held, (stamp, next(self._seq), self._monotonic(), record))
                return
            self._emit(record)

    @property
    def held(self) -> int:
        """Records waiting in memory (for tests and diagnostics)."""
        with self._lock:
            return len(self._held)

    # ------------------------------------------------------------------ agent thread
    def start_header(self, build: Callable[[], Dict[str, Any]]) -> None:
        """Hold every record until :meth:`write_header` (or :data:`MAX_HOLD_SECONDS`, or :meth:`close`)
        writes ``build()``, the run record, ahead of them."""
        with self._lock:
            self._header = build
            self._header_since = self._monotonic()

    @property
    def header_pending(self) -> bool:
        """Whether the run record of :meth:`start_header` is still to be written."""
        return self._header is not None

    def write_header(self) -> None:
        """Write the pending run record now (no-op when none is pending). The records held behind it go out
        at the next :meth:`advance` or :meth:`write_in_order`, which know the watermark."""
        with self._lock:
            self._flush_header()

    def advance(self, watermark: Optional[float]) -> None:
        """Move the watermark to ``watermark`` (never back; ``None`` keeps it) and write the held records
        stamped before it, and those held longer than ``max_hold_seconds`` (with every record stamped
        before them), in timestamp order."""
        with self._lock:
            if self._header is not None and self._monotonic() - self._header_since >= self.max_hold_seconds:
                self._flush_header()
            if watermark is not None and (self._watermark is None or watermark > self._watermark):
                self._watermark = watermark
            self._release(self._watermark)

    def write_in_order(self, record: Dict[str, Any]) -> None:
        """Write ``record`` (a ``step`` record) after the held records stamped before it; its timestamp
        becomes the watermark."""
        if self._fh is None:
            return
        with self._lock:
            self._flush_header()
            stamp = _stamp(record)
            self._release(stamp, expire=False)
            self._emit(record)
            if self._watermark is None or stamp > self._watermark:
                self._watermark = stamp

    def release(self) -> None:
        """Write the pending run record and every held record now (in timestamp order), and from now on
        every record as it comes: for when no step record is to come any more (the agent's close, after
        its reporter's final pass), so that what follows reaches the file even if the process dies
        before :meth:`close`. Idempotent."""
        with self._lock:
            self._flush_header()
            self._release(None, expire=False)
            self._watermark = None

    def close(self) -> None:
        """Write the pending run record and every held record (in timestamp order), then close the file."""
        with self._lock:
            if self._fh is None:
                return
            try:
                self._flush_header()
                while self._held:
                    self._emit(heapq.heappop(self._held)[3])
            finally:
                fh, self._fh = self._fh, None
                self._held.clear()
                fh.close()

    # ------------------------------------------------------------------ under the lock
    def _flush_header(self) -> None:
        build, self._header = self._header, None
        if build is not None:
            self._emit(build())

    def _release(self, before: Optional[float], expire: bool = True) -> None:
        """Emit held records stamped before ``before`` (all, when ``None`` and no header is pending) and,
        with ``expire``, every record up to the latest one that waited ``max_hold_seconds``."""
        if self._header is not None or not self._held:
            return
        limit = float("inf") if before is None else before
        if expire:
            now = self._monotonic()
            expired = [s for s, _, since, _ in self._held if now - since >= self.max_hold_seconds]
            if expired:
                limit = max(limit, max(expired) + 1e-9)
        while self._held and self._held[0][0] < limit:
            self._emit(heapq.heappop(self._held)[3])

    def _emit(self, record: Dict[str, Any]) -> None:
        if self._fh is None:
            return
        line = json.dumps(_clean(record), separators=(",", ":"), default=str)
        self._fh.write(line + "\n")
        self._fh.flush()


def read_timeline(path: Union[str, Path]) -> Iterator[Dict[str, Any]]:
    """Yield the records of a timeline file; a torn last line (a killed job) is skipped.

    Raises:
        OSError: if the file cannot be read.
        ValueError: if a line other than the last is not JSON (naming the line number).
    """
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):
                return
            raise ValueError(f"{path}:{i}: not a JSON line: {exc}") from None
