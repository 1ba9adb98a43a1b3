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


def test_the_runbook_set_is_the_folder():
    from mfuwatch.alerts.rules import RUNBOOKS as NAMES

    assert NAMES == {p.stem for p in RUNBOOKS.glob("*.md")}


def _links(text: str):
    return re.findall(r"runbook_url: (\S+)", text)


def _resolves(url: str) -> bool:
    """A runbook link of the default base (``https://github.com/mfuwatch/mfuwatch/blob/main/<path>``) names
    a file of this repository."""
    prefix = "https://github.com/mfuwatch/mfuwatch/blob/main/"
    return url.startswith(prefix) and (REPO / url[len(prefix):]).is_file()


def test_every_runbook_link_of_the_shipped_and_custom_rules_resolves():
    from mfuwatch.alerts import render_prometheus
    from mfuwatch.alerts.fleet_rules import render_fleet

    # custom rules: one reading a built-in's expression (it links that rule's runbook), one naming its own link
    cfg = load_config({"notifiers": [], "rules": {
        "MfuBelowThird": {"expr": "mfu", "op": "<", "threshold": 0.33},
        "OwnRunbook": {"expr": "mfu", "op": "<", "threshold": 0.1,
                       "annotations": {"runbook_url": "https://github.com/mfuwatch/mfuwatch/blob/main/docs/alerts.md"}}}})
    links = {r.name: r.annotations["runbook_url"].render(value=None, labels={}, static=r.static())
             for r in cfg.rules if "runbook_url" in r.annotations}
    assert links["MfuBelowThird"].endswith("/docs/runbooks/MfuLow.md")  # was /docs/runbooks/MfuBelowThird.md
    shipped = [REPO / "grafana" / "prometheus" / "rules" / f for f in ("mfuwatch.rules.yml",
                                                                        "mfuwatch-fleet.rules.yml")]
    every = list(links.values()) + _links(render_prometheus(cfg)) + _links(render_fleet())
    for f in shipped:
        every += _links(f.read_text())
    assert len(every) > 2 * len(CFG.rules)
    assert [u for u in every if not _resolves(u)] == []


def test_a_custom_rule_of_an_expression_without_a_runbook_gets_no_link():
    from mfuwatch.alerts.rules import runbook_for

    assert runbook_for("Custom", "mfu", {"MfuLow": {"expr": "mfu"}}) == "MfuLow"
    assert runbook_for("Custom", "idle_share", {"MfuLow": {"expr": "mfu"}}) is None
    assert runbook_for("MfuLow", None, {}) == "MfuLow"
