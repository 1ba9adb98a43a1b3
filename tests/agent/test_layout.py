"""The layout's import rules (docs/architecture.md), checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after(statement: str) -> list:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_live_agent_loads_neither_the_offline_analysis_nor_the_report():
    mods = _modules_after("import mfuwatch.agent.core, mfuwatch.agent.live.profiler")
    assert not [m for m in mods if m.startswith(("mfuwatch.agent.analysis", "mfuwatch.agent.report", "plotly"))]


@pytest.mark.parametrize("module", ["mfuwatch.agent.analysis.analyze", "mfuwatch.agent.report.html"])
def test_analysis_and_report_load_neither_torch_nor_the_live_agent(module):
    mods = _modules_after(f"import {module}")
    live = ("mfuwatch.agent.core", "mfuwatch.agent.live.profiler", "mfuwatch.agent.live.exporter", "mfuwatch.agent.device.nvml")
    assert "torch" not in mods and not [m for m in mods if m in live]


def test_kernels_import_neither_the_agent_nor_the_alerts():
    mods = _modules_after("import mfuwatch.kernels")
    assert not [m for m in mods if m.startswith(("mfuwatch.agent", "mfuwatch.alerts"))]


def _agent_import_graph() -> dict:
    """``{module: {agent modules it imports}}`` for every module under agent/, from the source: relative and
    absolute ``from`` imports and plain ``import mfuwatch.agent...``, the deferred ones in function bodies too."""
    import ast
    from pathlib import Path

    import mfuwatch.agent

    root = Path(mfuwatch.agent.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        names[path] = (".".join(parts[:-1]) if is_pkg else ".".join(parts)), (parts[:-1])
    known = {n for n, _ in names.values()}
    graph = {}
    for path, (name, pkg) in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = pkg[:len(pkg) - node.level + 1] + (node.module.split(".") if node.module else [])
                deps |= {".".join(base + [a.name]) for a in node.names} | {".".join(base)}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mfuwatch.agent"):
                base = node.module.split(".")[2:]
                deps |= {".".join(base + [a.name]) for a in node.names} | {".".join(base)}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("mfuwatch.agent."):
                        bits = a.name.split(".")[2:]
                        deps |= {".".join(bits[:i]) for i in range(1, len(bits) + 1)}
        graph[name or "__init__"] = {d for d in deps if d in known and d not in (name, "")}
    return graph


def _levels(graph: dict) -> dict:
    """Each module's level: 0 when it imports no agent module, else one above the highest it imports.
    Raises AssertionError naming the cycle when there is one."""
    level: dict = {}

    def visit(m, path):
        assert m not in path, "import cycle: " + " -> ".join(path + [m])
        if m not in level:
            level[m] = 1 + max((visit(d, path + [m]) for d in sorted(graph[m])), default=-1)
        return level[m]

    for m in sorted(graph):
        visit(m, [])
    return level


def _documented_levels() -> dict:
    """``{module: level}`` from the level table of docs/architecture.md (rows ``| N | `a`, `b` |``)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    table = doc[doc.index("| level | modules |"):]
    table = table[:table.index("\n\n")]
    out = {}
    for row in re.finditer(r"^\s*\|\s*(\d+)\s*\|(.*)\|\s*$", table, re.M):
        for mod in re.findall(r"`([\w.]+)`", row.group(2)):
            assert mod not in out, f"{mod} is listed twice in the level table"
            out[mod] = int(row.group(1))
    return out


def test_the_level_table_of_the_architecture_page_is_the_real_import_graph():
    graph = _agent_import_graph()
    real = _levels(graph)
    documented = _documented_levels()
    missing = sorted(set(real) - set(documented))
    unknown = sorted(set(documented) - set(real))
    wrong = {m: (documented[m], real[m]) for m in sorted(set(real) & set(documented)) if documented[m] != real[m]}
    assert not missing and not unknown and not wrong, (
        f"docs/architecture.md level table: missing {missing}, not modules {unknown}, "
        f"wrong (documented, real) {wrong}")


def test_the_levels_check_catches_a_cycle_and_an_upward_import():
    with pytest.raises(AssertionError, match="import cycle: a -> b -> a"):
        _levels({"a": {"b"}, "b": {"a"}})
    assert _levels({"core": {"live.hooks"}, "live.hooks": {"schema"}, "schema": set()}) == {
        "core": 2, "live.hooks": 1, "schema": 0}


def test_the_parts_of_the_agent_never_import_its_composition_root():
    graph = _agent_import_graph()
    parts = ("live.hooks", "live.reporter", "live.clock", "live.exporter", "live.timeline", "live.profiler",
             "live.otlp", "device.peak_choice", "device.calibrate", "device.nvml", "fleet.accounting")
    assert set(parts) <= set(graph)
    for part in parts:
        assert "core" not in graph[part] and "__init__" not in graph[part], part
    # the `mfuwatch flops` command is imported by no library module (cli.py dispatches to it by name)
    assert not [m for m, deps in graph.items() if "flops.cli" in deps]
