"""``mfuwatch analyze`` on bad input: a fixed-seed fuzz of 200 malformed traces under a memory cap, deep
JSON nesting, NaN in --json, unwritable --output, negative --steps."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mfuwatch.agent.analysis.analyze import main
from mfuwatch.agent.analysis.trace import MAX_JSON_DEPTH, TraceError, read_trace
from tests.helpers.chrome_trace_builder import TraceBuilder

MEMORY_CAP = 2 << 30  # address space of the fuzz child (numpy + the analysis fit in well under this)


def _seed_trace() -> dict:
    b = TraceBuilder()
    b.session(0.0, 400.0)
    b.annotation("ProfilerStep#1", 0.0, 200.0)
    b.annotation("ProfilerStep#2", 200.0, 200.0)
    t = 1.0
    for _ in range(2):
        for name, dims in (("aten::mm", [[64, 64], [64, 64]]), ("aten::add", [[64, 64], [64, 64]]),
                           ("aten::native_layer_norm", [[64, 64], [], [64], [64], []])):
            ext = b.op(name, t, 10.0, dims=dims, types=["c10::BFloat16"] * len(dims))
            b.kernel("k_" + name, t + 2.0, 6.0, ext=ext)
            t += 30.0
        t = 201.0
    return b.document()


def _mutations(rng: random.Random, doc: dict, raw: bytes):
    """Yield (kind, bytes) malformed variants of one valid trace; deterministic for a seeded ``rng``."""
    events = doc["traceEvents"]
    bad_values = [None, "x", -1, 1e308, -1e308, [], {}, [[[]]], True, "NaN", 2 ** 70, ""]
    kinds = ["truncate", "flip", "deep", "wrong_type", "drop_key", "junk", "gzip_cut", "array", "empty",
             "huge_dims", "nan_numbers", "not_object_events"]
    while True:
        kind = rng.choice(kinds)
        if kind == "truncate":
            yield kind, raw[: rng.randrange(0, len(raw))]
        elif kind == "flip":
            b = bytearray(raw)
            for _ in range(rng.randint(1, 20)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            yield kind, bytes(b)
        elif kind == "deep":
            depth = rng.choice([MAX_JSON_DEPTH + 1, 1000, 50_000])
            yield kind, b'{"traceEvents": [{"ph": "X", "args": ' + b"[" * depth + b"]" * depth + b"}]}"
        elif kind == "wrong_type":
            d = json.loads(json.dumps(doc))
            ev = rng.choice(d["traceEvents"])
            key = rng.choice(["ts", "dur", "args", "name", "cat", "ph", "pid", "tid"])
            ev[key] = rng.choice(bad_values)
            if isinstance(ev.get("args"), dict) and rng.random() < 0.5:
                ev["args"][rng.choice(["Input Dims", "Input type", "External id", "Concrete Inputs",
                                       "Sequence number"])] = rng.choice(bad_values)
            yield kind, json.dumps(d).encode()
        elif kind == "drop_key":
            d = json.loads(json.dumps(doc))
            ev = rng.choice(d["traceEvents"])
            ev.pop(rng.choice(list(ev)), None)
            yield kind, json.dumps(d).encode()
        elif kind == "junk":
            yield kind, bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
        elif kind == "gzip_cut":
            z = gzip.compress(raw)
            yield kind, z[: rng.randrange(2, len(z))]
        elif kind == "array":
            yield kind, json.dumps(events[: rng.randint(0, len(events))]).encode()
        elif kind == "empty":
            yield kind, rng.choice([b"", b"{}", b"[]", b'{"traceEvents": []}', b'{"traceEvents": null}', b"null"])
        elif kind == "huge_dims":
            d = json.loads(json.dumps(doc))
            for ev in d["traceEvents"]:
                if isinstance(ev.get("args"), dict) and "Input Dims" in ev["args"]:
                    ev["args"]["Input Dims"] = [[2 ** 62, 2 ** 62]] * 3
            yield kind, json.dumps(d).encode()
        elif kind == "nan_numbers":
            text = json.dumps(doc).replace('"dur": 6.0', '"dur": NaN').replace('"ts": 1.0', '"ts": Infinity')
            yield kind, text.encode()
        else:
            d = json.loads(json.dumps(doc))
            d["traceEvents"] = [rng.choice([1, "s", None, [1, 2], True])] + d["traceEvents"]
            yield kind, json.dumps(d).encode()


def test_fuzz_200_malformed_traces_end_in_one_line_under_a_memory_cap(tmp_path):
    rng = random.Random(20261201)
    doc = _seed_trace()
    raw = json.dumps(doc).encode()
    cases = tmp_path / "cases"
    cases.mkdir()
    gen = _mutations(rng, doc, raw)
    kinds = {}
    for i in range(200):
        kind, data = next(gen)
        name = f"{i:03d}-{kind}.case"
        kinds[name] = kind
        (cases / name).write_bytes(data)
    out = tmp_path / "results.json"
    child = Path(__file__).with_name("_fuzz_child.py")
    r = subprocess.run([sys.executable, str(child), str(cases), str(out), str(MEMORY_CAP)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    results = got["results"]
    assert len(results) == 200
    escaped = [x for x in results if x["traceback"] or x["rc"] not in (0, 1)]
    assert escaped == []  # every case ended with status 0 or 1, never a traceback
    for x in results:
        if x["rc"] == 1:
            assert len(x["stderr"]) == 1 and x["stderr"][0].startswith("mfuwatch analyze: error: ")
        assert not x["nan"]
    assert got["peak_rss_mb"] < 1024  # the deep-nesting cases no longer take gigabytes
    table = Counter((kinds[x["case"]], x["rc"]) for x in results)
    print("\nfuzz outcomes (kind, exit status): count")
    for (kind, rc), n in sorted(table.items()):
        print(f"  {kind:18s} {rc}: {n}")
    print(f"  peak RSS of the child: {got['peak_rss_mb']:.0f} MB")


def test_deep_nesting_is_refused_quickly(tmp_path):
    p = tmp_path / "deep.json"
    p.write_bytes(b'{"traceEvents": [' + b"[" * 200_000 + b"]" * 200_000 + b"]}")  # 400 KB of brackets
    with pytest.raises(TraceError, match="nested deeper than"):
        read_trace(str(p))


def test_json_output_has_no_nan(tmp_path, capsys):
    doc = _seed_trace()
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    # zero bandwidth-free idle etc. are fine; force a non-finite through an absurd but valid flag set
    rc = main([str(p), "--json", "--peak-flops", "bf16=1e-300", "--peak-flops", "fp32=1e-300",
               "--bandwidth", "1e-300"])
    text = capsys.readouterr().out
    assert rc == 0
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))


def test_unwritable_output_and_negative_steps_are_one_line_errors(tmp_path, capsys):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(_seed_trace()))
    rc = main([str(p), "--peak-flops", "bf16=989e12", "--bandwidth", "4.8e12", "--output",
               "/proc/mfuwatch-nope/out.txt"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("mfuwatch analyze: error: cannot write --output") and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:
        main([str(p), "--steps", "-3"])
    assert info.value.code == 2
    assert "--steps" in capsys.readouterr().err
