"""docs/runbooks/<alertname>.md: one per built-in alert, linked from every notification, not stale.

Each runbook has the three sections, names the metrics its rule's expression reads, and
every Grafana dashboard and panel it tells the reader to open exists in grafana/dashboards/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mfuwatch.alerts import load_config
from mfuwatch.alerts.prometheus import rule_expr

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
CFG = load_config(None)


def dashboards():
    titles, panels = set(), set()
    for f in (REPO / "grafana" / "dashboards").glob("*.json"):
        d = json.loads(f.read_text())
        titles.add(d["title"])
        stack = list(d.get("panels", []))
        while stack:
            p = stack.pop()
            panels.add(p.get("title"))
            stack.extend(p.get("panels", []))
    return titles, panels


@pytest.mark.parametrize("rule", CFG.rules, ids=lambda r: r.name)
def test_runbook_exists_and_is_linked(rule):
    path = RUNBOOKS / f"{rule.name}.md"
    assert path.is_file(), f"missing runbook {path}"
    text = path.read_text()
    assert text.startswith(f"# {rule.name}\n")
    for heading in ("## What it means", "## How to confirm", "## What to do"):
        assert heading in text, f"{path.name}: no '{heading}'"
    assert "mfuwatch analyze" in text
    url = rule.annotations["runbook_url"].render(value=None, labels={}, static=rule.static())
    assert url.endswith(f"/docs/runbooks/{rule.name}.md")
    for metric in set(re.findall(r"mfuwatch_[a-z_]+", rule_expr(rule))):
        base = re.sub(r"_(sum|count|bucket)$", "", metric)
        assert base in text, f"{path.name} does not name the metric {base}"


@pytest.mark.parametrize("rule", CFG.rules, ids=lambda r: r.name)
def test_runbook_points_at_existing_dashboards_and_panels(rule):
    titles, panels = dashboards()
    text = (RUNBOOKS / f"{rule.name}.md").read_text()
    named = re.findall(r"\*\*(mfuwatch / [^*]+)\*\*", text)
    assert named, "no Grafana dashboard named"
    for title in named:
        assert title in titles, f"{rule.name}: no dashboard titled {title!r}"
    bullets = text.replace("\n  ", " ").splitlines()  # join wrapped list items
    quoted = [q for line in bullets if "panel" in line for q in re.findall(r'"([^"]+)"', line)]
    assert quoted, "no Grafana panel named"
    for q in quoted:
        assert q in panels, f"{rule.name}: no panel titled {q!r} in grafana/dashboards"
