"""Streaming reader for chrome traces exported by ``torch.profiler`` (``.json`` or ``.json.gz``).

A profiler trace is one JSON object ``{"deviceProperties": [...], ..., "traceEvents": [...]}``
(or, in the bare Chrome "JSON array" format, just the event list). Traces of long
windows reach gigabytes, so nothing here holds the event list: :func:`read_trace`
reads the small header (``deviceProperties``, versions) and :meth:`TraceFile.events`
streams the events one dict at a time with ijson's C backend. :class:`TraceIndex`
keeps only what the roofline needs, in typed arrays (about 60 bytes per CPU op and
per GPU activity, plus one copy of each distinct op signature), so a 1 GB trace
is indexed in a few hundred MB at most.

What the index links, using the fields Kineto writes:

* a GPU activity (``cat`` ``kernel``, ``gpu_memcpy``, ``gpu_memset``) to the CPU op that
  launched it: equal ``args["External id"]`` (or, when the activity lacks it, through
  the ``cuda_runtime``/``cuda_driver`` launch with the same ``args["correlation"]``).
  Kineto tags a launch with the innermost op on the stack, e.g. ``aten::mm`` rather than
  ``aten::linear``;
* CPU ops to their top-level op (interval nesting per thread), and to the innermost
  ``user_annotation`` around them (``Optimizer.step#AdamW.step``), used as the op's *region*;
* steps: ``ProfilerStep#N`` annotations when the trace has them.

Usage::

    tf = read_trace("trace.json.gz")          # TraceError if not a readable trace
    index = TraceIndex.build(tf.events())
"""

from __future__ import annotations

import gzip
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import ijson

from .compact import first_by_key, last_by_key, lookup, np_view, to_array

#: GPU activity categories Kineto writes, with the code stored in the index.
GPU_CATEGORIES = {"kernel": 0, "gpu_memcpy": 1, "gpu_memset": 2}
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
_STEP_PREFIX = "ProfilerStep#"
_EPS_US = 1e-3  # trace timestamps are microseconds with nanosecond digits


#: Deepest JSON nesting accepted. Kineto's events nest 6 levels at most (``args`` → ``Input Dims`` → a
#: TensorList of shapes); ijson keeps one prefix string per open level, so memory grows with the square
#: of the depth: deeper files are refused before parsing.
MAX_JSON_DEPTH = 64
#: Longest run of bytes between two JSON tokens accepted (one string, whitespace, one number). Kineto's
#: longest strings are templated kernel names of a few KB; ijson's cost grows with the square of a string's
#: length (a 256 MiB string ran past 300 s), and a gzip bomb of whitespace decompresses forever: both are
#: refused at the first MiB past this, in the pre-scan.
MAX_TOKEN_BYTES = 1 << 20
#: Largest single trace event (one element of ``traceEvents``) accepted: ijson builds each event as one dict.
MAX_EVENT_BYTES = 16 << 20
_LINK_CHUNK = 1 << 18  # ops per chunk when linking activities to ops (a few MB of numpy temporaries)
_SCAN_CHUNK = 1 << 21  # bytes per chunk of the depth scan (its numpy temporaries are ~20x this)


class TraceError(Exception):
    """A file that is not a readable profiler trace (not JSON, truncated, no events, no GPU activity)."""


def check_json_depth(f, limit: int = MAX_JSON_DEPTH, max_token_bytes: Optional[int] = None,
                     max_event_bytes: Optional[int] = None, event_level: int = 2) -> int:
    """Scan a binary JSON stream and return its maximum nesting depth; ``ValueError`` past a limit.

    Limits: nesting deeper than ``limit``; with ``max_token_bytes``, a run of more bytes than that
    between two JSON tokens (one string, or whitespace, or a number: what a parser must hold, or
    spin on, at once); with ``max_event_bytes``, more bytes than that between two structural
    characters at nesting level ``event_level`` or above it (one element of the event list: 2 for
    ``{"traceEvents": [...]}``, 1 for a bare list). The error comes as soon as the limit is passed,
    not at the end of the stream.

    Brackets inside strings do not count; a quote preceded by an odd run of backslashes is
    escaped. Vectorised with numpy over chunks of :data:`_SCAN_CHUNK` bytes (the state —
    depth, inside a string, trailing backslashes, the last token and event boundaries — carries
    across chunks), so the scan costs one sequential read and bounded memory.
    """
    import numpy as np

    depth, in_str, bs_run, deepest = 0, False, 0, 0
    offset, last_tok, last_ev = 0, 0, 0  # stream offsets of the last token / event boundary seen
    while True:
        chunk = f.read(_SCAN_CHUNK)
        if not chunk:
            return deepest
        a = np.frombuffer(chunk, dtype=np.uint8)
        n = a.size
        idx = np.arange(n, dtype=np.int64)
        is_bs = a == 92
        # length of the backslash run just before each position (carrying the previous chunk's run)
        last_other = np.maximum.accumulate(np.where(is_bs, -1, idx))
        before = np.empty(n, dtype=np.int64)
        before[0] = bs_run
        run_to = idx - last_other  # backslashes ending at each position (0 where not a backslash)
        run_to = np.where(last_other < 0, run_to + bs_run, run_to)
        before[1:] = run_to[:-1]
        quote = (a == 34) & (before % 2 == 0)
        q = np.cumsum(quote, dtype=np.int64)
        inside = ((q - quote) % 2 == 1) ^ in_str  # state before each byte
        opening = ((a == 91) | (a == 123)) & ~inside
        closing = ((a == 93) | (a == 125)) & ~inside
        level = depth + np.cumsum(opening.astype(np.int64) - closing.astype(np.int64))
        if n:
            deepest = max(deepest, int(level.max()))
            if deepest > limit:
                raise ValueError(f"JSON nested deeper than {limit} levels (a profiler trace nests about 6)")
            if max_token_bytes is not None or max_event_bytes is not None:
                structural = (opening | closing | (((a == 44) | (a == 58)) & ~inside))
                if max_token_bytes is not None:
                    pos = np.flatnonzero(structural | quote)
                    gaps = np.diff(np.concatenate(([last_tok - offset], pos, [n])))
                    worst = int(gaps.argmax())
                    if int(gaps[worst]) > max_token_bytes:
                        start = last_tok if worst == 0 else offset + int(pos[worst - 1])
                        if worst == 0:
                            in_string = in_str  # the run began in an earlier chunk
                        else:
                            p0 = int(pos[worst - 1])
                            in_string = bool(quote[p0] and not inside[p0])  # it follows an opening quote
                        what = ("one JSON string longer than" if in_string else
                                "whitespace (or one number) between two JSON tokens longer than")
                        raise ValueError(f"{what} {max_token_bytes >> 20} MiB (from byte {start} of the JSON); "
                                         "a profiler trace's longest string is a few KB")
                    if pos.size:
                        last_tok = offset + int(pos[-1])
                if max_event_bytes is not None:
                    pos = np.flatnonzero(structural & (level <= event_level) & ~(opening & (level > event_level)))
                    gaps = np.diff(np.concatenate(([last_ev - offset], pos, [n])))
                    if gaps.size and int(gaps.max()) > max_event_bytes:
                        worst = int(gaps.argmax())
                        start = last_ev if worst == 0 else offset + int(pos[worst - 1])
                        raise ValueError(f"one trace event (or top-level value) larger than {max_event_bytes >> 20} "
                                         f"MiB (from byte {start}); a profiler event is well under 1 MB")
                    if pos.size:
                        last_ev = offset + int(pos[-1])
            depth = int(level[-1])
            in_str = bool(in_str ^ (int(q[-1]) % 2 == 1))
            bs_run = int(run_to[-1])
        offset += n


def _open_binary(path: str):
    """Open ``path``, transparently gunzipping; the result supports ``read``."""
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return raw


def _wrap_errors(path: str, exc: BaseException) -> TraceError:
    text = str(exc).strip().splitlines()
    exc_text = text[0] if text else type(exc).__name__
    if isinstance(exc, ijson.IncompleteJSONError) and "premature" in str(exc).lower():
        return TraceError(f"{path}: the trace is truncated (JSON ends early): {exc_text}")
    if isinstance(exc, (EOFError, zlib.error, gzip.BadGzipFile)):
        return TraceError(f"{path}: the gzip stream is truncated or corrupt: {exc_text}")
    return TraceError(f"{path}: not a JSON chrome trace: {type(exc).__name__}: {exc_text}")


@dataclass
class TraceFile:
    """A trace on disk: its header metadata, read eagerly, and its events, streamed on demand.

    ``metadata`` holds the top-level keys that precede ``traceEvents`` (Kineto writes
    ``schemaVersion``, ``deviceProperties`` — a list of dicts with ``name``, ``numSms``,
    ``computeMajor`` … — and the CUDA versions first). ``array_format`` is True for a
    bare JSON list of events.
    """

    path: str
    metadata: Dict[str, Any]
    array_format: bool = False

    def events(self) -> Iterator[Dict[str, Any]]:
        """Yield every trace event as a dict (floats as ``float``); one pass over the file.

        Raises:
            TraceError: the file is truncated or stops being valid JSON part-way.
        """
        prefix = "item" if self.array_format else "traceEvents.item"
        try:
            with _open_binary(self.path) as f:
                yield from ijson.items(f, prefix, use_float=True)
        except TraceError:
            raise
        except (ijson.JSONError, EOFError, zlib.error, gzip.BadGzipFile, OSError, ValueError) as exc:
            raise _wrap_errors(self.path, exc) from exc

    @property
    def device_properties(self) -> List[Dict[str, Any]]:
        """``deviceProperties`` from the header (one dict per GPU), or ``[]``."""
        dp = self.metadata.get("deviceProperties")
        return dp if isinstance(dp, list) else []


def read_trace(path: str) -> TraceFile:
    """Open a chrome trace and read its header; events stay on disk until :meth:`TraceFile.events`.

    Args:
        path: a ``.json`` or ``.json.gz`` file exported by ``torch.profiler`` (any
            chrome trace with a ``traceEvents`` list, or a bare event list).

    Raises:
        TraceError: unreadable file, not JSON, no ``traceEvents`` key, or truncated header.
    """
    try:
        with _open_binary(path) as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _wrap_errors(path, exc) from exc
    first = head.lstrip()[:1]
    if first in (b"[", b"{"):
        try:
            with _open_binary(path) as f:
                check_json_depth(f, max_token_bytes=MAX_TOKEN_BYTES, max_event_bytes=MAX_EVENT_BYTES,
                                 event_level=2 if first == b"{" else 1)
        except ValueError as exc:
            raise TraceError(f"{path}: not a profiler trace: {exc}") from None
        except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise _wrap_errors(path, exc) from exc
    if first == b"[":
        return TraceFile(path, {}, array_format=True)
    if first != b"{":
        raise TraceError(f"{path}: not a JSON chrome trace (starts with {head[:16]!r})")
    metadata: Dict[str, Any] = {}
    try:
        with _open_binary(path) as f:
            parser = ijson.parse(f, use_float=True)
            for prefix, event, value in parser:
                if prefix == "" and event == "map_key":
                    if value == "traceEvents":
                        return TraceFile(path, metadata)
                    metadata[value] = _build_value(parser)
    except (ijson.JSONError, EOFError, zlib.error, gzip.BadGzipFile, ValueError) as exc:
        raise _wrap_errors(path, exc) from exc
    raise TraceError(f"{path}: JSON without a 'traceEvents' list: not a chrome trace")


@dataclass
class OpSig:
    """One distinct recorded op call: name and the ``record_shapes`` args, shared by all calls alike."""

    name: str
    dims: Optional[list]  # "Input Dims": per input a shape list, a list of shapes (TensorList) or []
    types: Optional[list]  # "Input type": "float", "c10::BFloat16", "Scalar", "TensorList", "" (None) ...
    concrete: Optional[list]  # "Concrete Inputs": scalar args as strings ("[-1]", "True", "15") or ""
    strides: Optional[list] = None  # "Input Strides" (torch >= 2.1 with record_shapes): per input, like dims


@dataclass
class TraceIndex:
    """Compact, array-backed index of one trace's CPU ops, annotations and GPU activities.

    Times are microseconds (trace units). Arrays are parallel: ``op_*`` for CPU ops and
    user annotations (``op_kind`` 0 = op, 1 = annotation), ``k_*`` for GPU activities
    (``k_cat`` codes in :data:`GPU_CATEGORIES`). After :meth:`finalize` (which empties
    ``op_ext``): ``k_op`` = index of the launching op or -1; ``op_top`` = the top-level op
    (itself if top-level); ``op_region`` = name id of the innermost non-step annotation or
    -1; ``op_self`` = the op's own (exclusive) time in µs, its duration minus its children's.
    """

    names: List[str] = field(default_factory=list)
    sigs: List[OpSig] = field(default_factory=list)
    op_ts: array = field(default_factory=lambda: array("d"))
    op_dur: array = field(default_factory=lambda: array("d"))
    op_thread: array = field(default_factory=lambda: array("i"))
    op_name: array = field(default_factory=lambda: array("i"))
    op_ext: array = field(default_factory=lambda: array("q"))
    op_seq: array = field(default_factory=lambda: array("q"))
    op_sig: array = field(default_factory=lambda: array("i"))
    op_kind: array = field(default_factory=lambda: array("b"))
    k_ts: array = field(default_factory=lambda: array("d"))
    k_dur: array = field(default_factory=lambda: array("d"))
    k_name: array = field(default_factory=lambda: array("i"))
    k_ext: array = field(default_factory=lambda: array("q"))
    k_corr: array = field(default_factory=lambda: array("q"))
    k_cat: array = field(default_factory=lambda: array("b"))
    k_op: array = field(default_factory=lambda: array("i"))
    k_launch_end: array = field(default_factory=lambda: array("d"))  # end (µs) of the launch call; NaN unknown
    steps: List[Tuple[float, float]] = field(default_factory=list)  # ProfilerStep# (ts, dur)
    session: Optional[Tuple[float, float]] = None  # the "PyTorch Profiler (0)" span (ts, dur)
    start_us: float = float("inf")
    end_us: float = float("-inf")
    events_seen: int = 0
    op_top: array = field(default_factory=lambda: array("i"))
    op_region: array = field(default_factory=lambda: array("i"))
    op_self: array = field(default_factory=lambda: array("d"))
    _name_ids: Dict[str, int] = field(default_factory=dict, repr=False)
    _sig_ids: Dict[tuple, int] = field(default_factory=dict, repr=False)
    _threads: Dict[tuple, int] = field(default_factory=dict, repr=False)
    _rt_corr: array = field(default_factory=lambda: array("q"), repr=False)
    _rt_ext: array = field(default_factory=lambda: array("q"), repr=False)
    _rt_corr_all: array = field(default_factory=lambda: array("q"), repr=False)
    _rt_end: array = field(default_factory=lambda: array("d"), repr=False)

    @classmethod
    def build(cls, events: Iterable[Dict[str, Any]]) -> "TraceIndex":
        """Index an event stream (any iterable of chrome-trace event dicts) in one pass.

        Raises:
            TraceError: propagated from a streaming source that is truncated or corrupt.
        """
        index = cls()
        add = index.add
        for ev in events:
            add(ev)
        index.finalize()
        return index

    def intern(self, name: str) -> int:
        """Return the id of ``name`` in :attr:`names`, adding it if new."""
        i = self._name_ids.get(name)
        if i is None:
            i = self._name_ids[name] = len(self.names)
            self.names.append(name)
        return i

    def add(self, ev: Dict[str, Any]) -> None:
        """Add one event; only complete events (``ph`` ``X``) with a duration matter."""
        self.events_seen += 1
        if not isinstance(ev, dict) or ev.get("ph") != "X":  # chrome traces hold objects; skip anything else
            return
        cat = ev.get("cat")
        try:
            ts = float(ev["ts"])
            dur = float(ev.get("dur") or 0.0)
        except (KeyError, TypeError, ValueError):
            return
        args = ev.get("args") or {}
        if not isinstance(args, dict):
            args = {}
        if cat == "cpu_op" or cat == "user_annotation":
            name = str(ev.get("name", ""))
            if cat == "user_annotation" and name.startswith(_STEP_PREFIX):
                self.steps.append((ts, dur))
            self._extend(ts, ts + dur)
            self.op_ts.append(ts)
            self.op_dur.append(dur)
            key = (ev.get("pid"), ev.get("tid"))
            t = self._threads.get(key)
            if t is None:
                t = self._threads[key] = len(self._threads)
            self.op_thread.append(t)
            nid = self.intern(name)
            self.op_name.append(nid)
            self.op_ext.append(_int(args.get("External id")))
            self.op_seq.append(_int(args.get("Sequence number")))
            self.op_kind.append(0 if cat == "cpu_op" else 1)
            dims = args.get("Input Dims")
            if dims is None or cat != "cpu_op":
                self.op_sig.append(-1)
                return
            types = args.get("Input type")
            concrete = args.get("Concrete Inputs")
            strides = args.get("Input Strides")
            skey = (nid, repr(dims), repr(types), repr(concrete), repr(strides))
            sid = self._sig_ids.get(skey)
            if sid is None:
                sid = self._sig_ids[skey] = len(self.sigs)
                self.sigs.append(OpSig(name, dims, types, concrete, strides if isinstance(strides, list) else None))
            self.op_sig.append(sid)
        elif cat in GPU_CATEGORIES:
            self._extend(ts, ts + dur)
            self.k_ts.append(ts)
            self.k_dur.append(dur)
            self.k_name.append(self.intern(str(ev.get("name", ""))))
            self.k_ext.append(_int(args.get("External id")))
            self.k_corr.append(_int(args.get("correlation")))
            self.k_cat.append(GPU_CATEGORIES[cat])
        elif cat == "Trace" and str(ev.get("name", "")).startswith("PyTorch Profiler"):
            self.session = (ts, dur)
        elif cat in _LAUNCH_CATEGORIES:
            self._extend(ts, ts + dur)
            ext, corr = _int(args.get("External id")), _int(args.get("correlation"))
            if corr >= 0:
                self._rt_corr_all.append(corr)
                self._rt_end.append(ts + dur)
            if ext >= 0 and corr >= 0:
                self._rt_corr.append(corr)
                self._rt_ext.append(ext)

    def _extend(self, start: float, end: float) -> None:
        if start < self.start_us:
            self.start_us = start
        if end > self.end_us:
            self.end_us = end

    # ------------------------------------------------------------------ linking
    def finalize(self) -> None:
        """Link GPU activities to ops and nest ops per thread (see the class docstring)."""
        self._link_kernels()
        self._nest_ops()
        self._rt_corr = array("q")
        self._rt_ext = array("q")
        self._rt_corr_all, self._rt_end = array("q"), array("d")
        self._sig_ids = {}
        self.op_ext = array("q")  # only needed for linking; frees 8 bytes per op

    def _link_kernels(self) -> None:
        """``k_op`` and ``k_launch_end`` (the class docstring), joined on sorted numpy arrays rather than dicts
        (a 1 GB trace's ~400 k activities and 1.5 M ops made ~80 MB of dicts and sets, its analysis's peak).

        An activity without an ``External id`` takes the one of the launch with its ``correlation`` (the last
        such launch). An External id's op is its last ``cpu_op``, else its first op (an annotation).
        """
        import numpy as np

        k_ext = np_view(self.k_ext, np.int64)  # a view: the fix-up below writes self.k_ext
        if len(self._rt_corr) and bool((k_ext < 0).any()):
            keys, ext = last_by_key(np_view(self._rt_corr, np.int64), np_view(self._rt_ext, np.int64))
            missing = np.flatnonzero(k_ext < 0)
            k_ext[missing] = lookup(keys, ext, np_view(self.k_corr, np.int64)[missing], -1)
        wanted = np.unique(k_ext[k_ext != -1])  # the External ids some activity names
        # the ops carrying one of them (in chunks: no temporary as long as the op columns)
        op_ext, kind = np_view(self.op_ext, np.int64), np_view(self.op_kind, np.int8)
        found = []
        for lo in range(0, op_ext.size if wanted.size else 0, _LINK_CHUNK):
            e = op_ext[lo:lo + _LINK_CHUNK]
            pos = np.minimum(np.searchsorted(wanted, e), wanted.size - 1)
            found.append(lo + np.flatnonzero(wanted[pos] == e))
        ops = np.concatenate(found) if found else np.zeros(0, np.int64)
        ops_ext, is_op = op_ext[ops], kind[ops] == 0
        last_op = last_by_key(ops_ext[is_op], ops[is_op])
        first_any = first_by_key(ops_ext, ops)
        k_op = lookup(*last_op, k_ext, -1)
        no_op = k_op < 0
        k_op[no_op] = lookup(*first_any, k_ext[no_op], -1)
        self.k_op = to_array(k_op.astype(np.int32))
        # when each activity's launch call returned (the last launch with its correlation; NaN: none)
        corr_end = last_by_key(np_view(self._rt_corr_all, np.int64), np_view(self._rt_end, np.float64))
        self.k_launch_end = to_array(lookup(*corr_end, np_view(self.k_corr, np.int64), float("nan")))

    def _nest_ops(self) -> None:
        import numpy as np

        n = len(self.op_ts)
        ts = np.frombuffer(self.op_ts, dtype=np.float64) if n else np.zeros(0)
        dur = np.frombuffer(self.op_dur, dtype=np.float64) if n else np.zeros(0)
        thread = np.frombuffer(self.op_thread, dtype=np.int32) if n else np.zeros(0, np.int32)
        # one copy each into the arrays (frombytes reads the numpy buffer; no bytes object in between): at
        # ~2 million ops the transient copies were the peak of a 1 GB trace's analysis
        order = array("q")
        order.frombytes(memoryview(np.lexsort((-dur, ts, thread)).astype(np.int64, copy=False)).cast("B"))  # thread, start, longest
        end = array("d")
        end.frombytes(memoryview(ts + dur).cast("B"))
        del ts, dur, thread
        starts, threads, kind, names = self.op_ts, self.op_thread, self.op_kind, self.op_name
        step_names = {i for i, s in enumerate(self.names) if s.startswith(_STEP_PREFIX)}
        top = array("i", bytes(4 * n))
        region = array("i", bytes(4 * n))
        self_us = array("d", self.op_dur)  # minus the children's durations below
        ops: List[int] = []
        anns: List[int] = []
        cur = None
        for i in order:
            if threads[i] != cur:
                cur = threads[i]
                ops.clear()
                anns.clear()
            s = starts[i]
            while ops and end[ops[-1]] <= s + _EPS_US:
                ops.pop()
            while anns and end[anns[-1]] <= s + _EPS_US:
                anns.pop()
            region[i] = names[anns[-1]] if anns else -1
            if kind[i]:
                top[i] = i
                if names[i] not in step_names:
                    anns.append(i)
                continue
            if ops:
                p = ops[-1]
                top[i] = top[p]
                self_us[p] = max(0.0, self_us[p] - self.op_dur[i])
            else:
                top[i] = i
            ops.append(i)
        self.op_top, self.op_region, self.op_self = top, region, self_us

    # ------------------------------------------------------------------ queries
    @property
    def n_kernels(self) -> int:
        """Number of GPU activities (kernels, memcpys, memsets)."""
        return len(self.k_ts)

    def op_label(self, i: int) -> str:
        """Name of CPU op ``i``."""
        return self.names[self.op_name[i]]

    def wall_span_us(self) -> Tuple[float, float]:
        """The window's wall interval in µs.

        With ``ProfilerStep#`` annotations: from the first step's start to the later of the
        last step's end and the last GPU activity's end (kernels of the last step finish
        after its CPU side). Else the profiling session's span (Kineto's ``Trace`` event
        ``PyTorch Profiler (0)``), which includes host time before the first op, e.g. an input
        stall. Else the envelope of all CPU ops, launches and GPU activity.
        """
        if self.steps:
            start = min(s for s, _ in self.steps)
            end = max(s + d for s, d in self.steps)
            if len(self.k_ts):
                end = max(end, max(t + d for t, d in zip(self.k_ts, self.k_dur)))
            return start, end
        if self.session is not None and self.session[1] > 0:
            return self.session[0], self.session[0] + self.session[1]
        if self.start_us > self.end_us:
            return 0.0, 0.0
        return self.start_us, self.end_us


def _build_value(parser: Iterator[Tuple[str, str, Any]]) -> Any:
    """Consume one complete JSON value from an ijson ``parse`` stream and return it."""
    builder = ijson.ObjectBuilder()
    depth = 0
    for _prefix, event, value in parser:
        builder.event(event, value)
        if event in ("start_map", "start_array"):
            depth += 1
        elif event in ("end_map", "end_array"):
            depth -= 1
        if depth == 0:
            return builder.value
    raise ijson.IncompleteJSONError("premature EOF in the trace header")


def _int(value: Any) -> int:
    """An id from the trace as int, -1 when absent or not integral."""
    if value is None:
        return -1
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
