"""Build small chrome traces shaped like ``torch.profiler`` exports, for exact tests of trace analysis.

Times are microseconds, as in Kineto's traces. Each CPU op gets a fresh ``External id``;
kernels point at an op through it (Kineto's correlation), or only through a
``cuda_runtime`` launch's ``correlation`` when ``via_runtime=True``.
"""

from __future__ import annotations

import gzip
import json
from typing import Any, Dict, List, Optional


class TraceBuilder:
    """Accumulates events; :meth:`document` returns the trace dict, :meth:`write` saves it."""

    def __init__(self, pid: int = 100) -> None:
        self.events: List[Dict[str, Any]] = []
        self.pid = pid
        self._ext = 1000
        self._corr = 5000

    def op(self, name: str, ts: float, dur: float, *, tid: int = 1, dims: Optional[list] = None,
           types: Optional[list] = None, concrete: Optional[list] = None, seq: Optional[int] = None,
           strides: Optional[list] = None) -> int:
        """Add a ``cpu_op``; returns its External id. ``strides``: its ``Input Strides`` (like ``dims``)."""
        self._ext += 1
        args: Dict[str, Any] = {"External id": self._ext, "Record function id": 0}
        if dims is not None:
            args["Input Dims"] = dims
            args["Input type"] = types if types is not None else ["float"] * len(dims)
            args["Concrete Inputs"] = concrete if concrete is not None else [""] * len(dims)
            if strides is not None:
                args["Input Strides"] = strides
        if seq is not None:
            args["Sequence number"] = seq
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": self.pid, "tid": tid,
                            "ts": ts, "dur": dur, "args": args})
        return self._ext

    def annotation(self, name: str, ts: float, dur: float, *, tid: int = 1) -> None:
        """Add a ``user_annotation`` (e.g. ``ProfilerStep#3``, ``Optimizer.step#AdamW.step``)."""
        self._ext += 1
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": self.pid, "tid": tid,
                            "ts": ts, "dur": dur, "args": {"External id": self._ext}})

    def kernel(self, name: str, ts: float, dur: float, *, ext: Optional[int] = None, cat: str = "kernel",
               via_runtime: bool = False, stream: int = 7, launch_end: Optional[float] = None) -> None:
        """Add a GPU activity launched by the op with External id ``ext`` (None: no launching op).

        ``launch_end``: also add its ``cudaLaunchKernel`` (3 µs) returning at that time (µs)."""
        self._corr += 1
        args: Dict[str, Any] = {"device": 0, "stream": stream, "correlation": self._corr}
        if ext is not None and not via_runtime:
            args["External id"] = ext
        if (ext is not None and via_runtime) or launch_end is not None:
            end = ts - 2.0 if launch_end is None else launch_end
            rt_args: Dict[str, Any] = {"correlation": self._corr}
            if ext is not None:
                rt_args["External id"] = ext
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": self.pid,
                                "tid": 1, "ts": end - 3.0, "dur": 3.0, "args": rt_args})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                            "args": args})

    def session(self, ts: float, dur: float) -> None:
        """The ``PyTorch Profiler (0)`` span Kineto writes around the whole session."""
        self.events.append({"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                            "tid": "PyTorch Profiler", "ts": ts, "dur": dur, "args": {"Op count": 0}})

    def document(self, device_name: Optional[str] = "NVIDIA H200") -> Dict[str, Any]:
        doc: Dict[str, Any] = {"schemaVersion": 1}
        if device_name:
            doc["deviceProperties"] = [{"id": 0, "name": device_name, "numSms": 132}]
        doc["traceEvents"] = list(self.events)
        doc["traceName"] = "synthetic"
        return doc

    def write(self, path: str, *, gz: bool = False, device_name: Optional[str] = "NVIDIA H200") -> str:
        data = json.dumps(self.document(device_name)).encode()
        if gz:
            with gzip.open(path, "wb") as f:
                f.write(data)
        else:
            with open(path, "wb") as f:
                f.write(data)
        return path
