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
    """``{module: {agent modules it imports}}`` for every module under agent/, lazy imports included."""
    import ast
    from pathlib import Path

    import mfuwatch.agent

    root = Path(mfuwatch.agent.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        names[path] = (".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)), parts[:-1]
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
        graph[name] = {d for d in deps if d in known and d not in (name, "")}
    return graph


def test_agent_modules_import_without_cycles():
    graph = _agent_import_graph()
    assert {"core", "lifecycle", "live.hooks", "live.reporter", "device.peak_choice"} <= set(graph)
    state: dict = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", "import cycle: " + " -> ".join(path + [m])
        state[m] = "open"
        for d in sorted(graph[m]):
            visit(d, path + [m])
        state[m] = "done"

    for m in sorted(graph):
        visit(m, [])
    # the Agent's parts are imported by core, never the other way round
    for part in ("lifecycle", "live.hooks", "live.reporter", "device.peak_choice"):
        assert "core" not in graph[part]
