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
    mods = _modules_after("import mfuwatch.agent.core, mfuwatch.agent.profiler")
    assert not [m for m in mods if m.startswith(("mfuwatch.agent.analysis", "mfuwatch.agent.report", "plotly"))]


@pytest.mark.parametrize("module", ["mfuwatch.agent.analysis.analyze", "mfuwatch.agent.report.html"])
def test_analysis_and_report_load_neither_torch_nor_the_live_agent(module):
    mods = _modules_after(f"import {module}")
    live = ("mfuwatch.agent.core", "mfuwatch.agent.profiler", "mfuwatch.agent.exporter", "mfuwatch.agent.nvml")
    assert "torch" not in mods and not [m for m in mods if m in live]


def test_kernels_import_neither_the_agent_nor_the_alerts():
    mods = _modules_after("import mfuwatch.kernels")
    assert not [m for m in mods if m.startswith(("mfuwatch.agent", "mfuwatch.alerts"))]
