"""The remedies table: plain data, bundled entries exist, byte counts agree with the kernels'."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import mfuwatch.kernels
from mfuwatch.kernels import _facts, remedies, traffic
from mfuwatch.kernels.remedies import REMEDIES, Remedy

SOURCES = [Path(remedies.__file__), Path(_facts.__file__), Path(traffic.__file__)]


def by_kernel(kernel: str) -> Remedy:
    """The one remedies entry with id ``kernel`` (a test helper)."""
    (entry,) = [r for r in REMEDIES if r.kernel == kernel]
    return entry


def test_remedies_sources_import_no_torch_triton_or_agent():
    imported = set()
    for node in (n for src in SOURCES for n in ast.walk(ast.parse(src.read_text()))):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
    assert not any(m.split(".")[0] in ("torch", "triton") or "agent" in m for m in imported), imported


def test_importing_the_remedies_loads_no_torch_or_triton():
    code = ("import sys, mfuwatch.kernels.remedies as r; "
            "next(e for e in r.REMEDIES if e.kernel == 'rms_norm').minimal_bytes(8, 4, 2, backward=True);"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')"
            " or m.startswith('mfuwatch.agent')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bundled_entries_are_exactly_kernels_that_exist():
    bundled = {r.kernel for r in REMEDIES if r.bundled}
    assert bundled <= set(mfuwatch.kernels.AVAILABLE_KERNELS)
    assert {"rms_norm", "layer_norm", "swiglu", "geglu"} <= bundled
    for r in REMEDIES:
        if r.bundled:
            assert r.apply == f'mfuwatch.kernels.patch(model, kernels=["{r.kernel}"])'
    with pytest.raises(ValueError, match="AVAILABLE_KERNELS"):
        Remedy(kernel="no_such_kernel", title="t", kind="bundled", apply="x", replaces="y")


def test_rotary_and_cross_entropy_are_bundled_drop_ins():
    for k in ("rotary", "cross_entropy"):  # the rotate-half chain and the loss now have drop-ins
        r = by_kernel(k)
        assert r.kind == "bundled" and r.bundled
        assert r.apply == f'mfuwatch.kernels.patch(model, kernels=["{k}"])'
    ids = [r.kernel for r in REMEDIES]
    assert len(ids) == len(set(ids))  # one entry per kernel id


def test_existing_fixes_named_by_the_issue_are_present():
    applies = {r.kernel: r.apply for r in REMEDIES}
    assert "fused=True" in applies["fused_adamw"]
    assert "scaled_dot_product_attention" in applies["sdpa"]
    assert applies["torch_compile"] == "model = torch.compile(model)"
    assert 'mode="reduce-overhead"' in applies["cuda_graphs"]
    assert "torch.autocast" in applies["bf16_autocast"]
    assert all(r.kind in ("existing", "bundled") and r.apply and r.title for r in REMEDIES)
    assert len({r.kernel for r in REMEDIES}) == len(REMEDIES)


def test_bundled_minimal_bytes_are_the_kernels_traffic_counts():
    rows, hidden = 4096, 2048
    e = rows * hidden
    r = by_kernel("rms_norm")
    # forward: read x, w; write y. backward: read x, dy, w; write dx, dw (bf16, 2 B)
    assert r.minimal_bytes(e, hidden, 2, backward=False) == 2 * e * 2 + hidden * 2
    assert r.minimal_bytes(e, hidden, 2, backward=True) == (2 * e * 2 + hidden * 2) + (3 * e * 2 + 2 * hidden * 2)
    for k in ("layer_norm", "swiglu", "geglu"):
        assert by_kernel(k).minimal_bytes(e, hidden, 4, backward=True) == (
            traffic.minimal_bytes(k, rows, hidden, 4) + traffic.minimal_bytes(k, rows, hidden, 4, backward=True))


def test_existing_fix_minimal_bytes_are_passes_over_the_anchor():
    r = by_kernel("sdpa")  # flash attention: 4 passes of q's size forward, 8 backward
    assert r.minimal_bytes(1000, 10, 2, backward=True) == 12 * 1000 * 2
    assert r.minimal_bytes(1000, 10, 2, backward=False) == 4 * 1000 * 2
    assert by_kernel("fused_adamw").minimal_bytes(100, 1, 4, backward=False) == 7 * 100 * 4


def test_rotate_half_pattern_names_the_bundled_rotary_with_its_bytes():
    r = by_kernel("rotary")
    assert r.bundled and r.apply == 'mfuwatch.kernels.patch(model, kernels=["rotary"])'
    assert [s.ops for s in r.sequence] == [("aten::mul",), ("aten::neg",), ("aten::cat",), ("aten::mul",),
                                            ("aten::add",)]
    # q of a Llama-3-8B layer at 16384 tokens, bf16: (1, 32, 16384, 128); read once and written once forward,
    # the gradient read once and dq written once backward
    e = 32 * 16384 * 128
    assert r.minimal_bytes(e, 128, 2, backward=False) == 2 * e * 2
    assert r.minimal_bytes(e, 128, 2, backward=True) == 4 * e * 2
