"""``mfuwatch analyze`` refuses inputs no profiler writes before parsing them (issue #28): one huge JSON string
(ijson's cost grows with its square), a gzip bomb of whitespace, one huge event. The refusal comes from the
pre-scan after the first MiBs past the limit, not after reading the whole stream: checked by counting the
decompressed bytes the analysis read."""

from __future__ import annotations

import gzip
import io
import json

import pytest

from mfuwatch.agent.analysis import trace as trace_mod
from mfuwatch.agent.analysis.analyze import main
from mfuwatch.agent.analysis.trace import MAX_EVENT_BYTES, MAX_TOKEN_BYTES, check_json_depth
from tests.helpers.chrome_trace_builder import TraceBuilder


def _gz_stream(path, head: bytes, fill: bytes, fill_bytes: int, tail: bytes) -> None:
    """Write ``head + fill * n + tail`` gzip-compressed without holding it (fill_bytes of filler)."""
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(head)
        block = fill * ((1 << 20) // len(fill))
        for _ in range(fill_bytes // len(block)):
            fh.write(block)
        fh.write(tail)


@pytest.fixture
def read_counter(monkeypatch):
    """Counts the bytes every stream opened by the trace reader returns."""
    total = {"bytes": 0}
    real = trace_mod._open_binary

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            total["bytes"] += len(data)
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(trace_mod, "_open_binary", lambda path: Counting(real(path)))
    return total


@pytest.mark.parametrize("case", ["string", "whitespace", "event"])
def test_oversized_token_or_event_fails_fast_with_a_clear_error(tmp_path, capsys, read_counter, case):
    path = tmp_path / f"{case}.json.gz"
    size = 64 << 20  # 64 MiB decompressed; the refusal must come after the first few
    if case == "string":
        _gz_stream(path, b'{"traceEvents": [{"ph": "X", "name": "', b"a", size, b'"}]}')
        expected = "one JSON string longer than 1 MiB"
    elif case == "whitespace":
        _gz_stream(path, b'{"traceEvents": [', b" \n\t", size, b"]}")
        expected = "whitespace (or one number) between two JSON tokens longer than 1 MiB"
    else:  # many short tokens in one event: no token is long, the event is
        _gz_stream(path, b'{"traceEvents": [{"ph": "X", "args": {"v": [', b"1,", size, b"1]}}]}")
        expected = "one trace event (or top-level value) larger than 16 MiB"
    assert main([str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and str(path) in err[0]
    # stopped within two scan chunks of the limit
    limit = MAX_EVENT_BYTES if case == "event" else MAX_TOKEN_BYTES
    assert read_counter["bytes"] <= (64 << 10) + limit + 2 * trace_mod._SCAN_CHUNK


def test_real_traces_pass_the_limits():
    b = TraceBuilder()
    b.session(0.0, 100.0)
    long_name = "void cutlass::Kernel<" + "cutlass_80_tensorop_bf16_s16816gemm_relu_" * 100 + ">"  # ~4 KB
    ext = b.op("aten::mm", 1.0, 10.0, dims=[[64, 64], [64, 64]], types=["float"] * 2)
    b.kernel(long_name, 2.0, 5.0, ext=ext)
    raw = json.dumps(b.document(), indent=2).encode()
    assert check_json_depth(io.BytesIO(raw), max_token_bytes=MAX_TOKEN_BYTES, max_event_bytes=MAX_EVENT_BYTES) <= 6


def test_limits_are_exact_at_the_boundary():
    inside = b'{"a": "' + b"x" * 1000 + b'"}'
    assert check_json_depth(io.BytesIO(inside), max_token_bytes=1001) == 1  # 1000 bytes + the closing quote
    with pytest.raises(ValueError, match="one JSON string longer than"):
        check_json_depth(io.BytesIO(inside), max_token_bytes=999)
    spaced = b"[1," + b" " * 5000 + b"2]"
    with pytest.raises(ValueError, match="whitespace"):
        check_json_depth(io.BytesIO(spaced), max_token_bytes=4000)
    # a long string whose escaped quotes do not end it, split across scan chunks
    esc = b'{"a": "' + b'\\"' * (trace_mod._SCAN_CHUNK // 2 + 7) + b'"}'
    with pytest.raises(ValueError, match="one JSON string"):
        check_json_depth(io.BytesIO(esc), max_token_bytes=1 << 20)
    assert check_json_depth(io.BytesIO(esc), max_token_bytes=4 << 20) == 1
