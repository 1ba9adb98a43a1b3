"""Read the committed Grafana dashboards (grafana/dashboards/*.json) and the PromQL they hold.

Shared by the structural tests and the end-to-end test that runs every query
against a real Prometheus. Template variables are substituted the way Grafana
does for a regex matcher: a single value is regex-escaped, "All" is ``.*``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO / "grafana" / "dashboards"

#: The datasource reference every panel, target, variable and annotation must use.
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}


@dataclass
class Query:
    dashboard: str  # file name
    where: str  # "panel 7 'MFU and HFU' A", "annotation 'Firing alerts'", "variable run"
    expr: str
    legend: str = ""
    kind: str = "expr"  # "expr" | "label_values"


def load_dashboards() -> Dict[str, dict]:
    """{file name: dashboard JSON} of every dashboard file."""
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dash: dict) -> List[dict]:
    """All panels, rows' collapsed children included."""
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(name: str, dash: dict) -> Iterator[Query]:
    """Every PromQL expression of a dashboard: panel targets, annotations, variable queries."""
    for p in panels(dash):
        for t in p.get("targets", []):
            yield Query(name, f"panel {p['id']} {p.get('title')!r} {t.get('refId')}", t["expr"],
                        t.get("legendFormat", ""))
    for a in dash.get("annotations", {}).get("list", []):
        if a.get("expr"):
            yield Query(name, f"annotation {a.get('name')!r}", a["expr"], a.get("titleFormat", ""))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"] if isinstance(v["query"], str) else v["query"]["query"]
            yield Query(name, f"variable {v['name']}", q, kind="label_values")


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>.+?)\s*,\s*(?P<label>\w+)\s*\)\s*$")


def parse_label_values(expr: str) -> Optional[tuple]:
    """``label_values(selector, label)`` -> (selector, label); None for other variable queries."""
    m = _LABEL_VALUES.match(expr)
    return (m.group("selector"), m.group("label")) if m else None


def substitute(expr: str, variables: Dict[str, str], rate_interval: str) -> str:
    """Replace ``$var`` / ``${var}`` by the given regex values and ``$__rate_interval``."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value)
        expr = re.sub(r"\$" + name + r"\b", lambda _m: value, expr)
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def legend_labels(legend: str) -> List[str]:
    """Label names a legend format refers to (``{{rank}}`` -> ``rank``)."""
    return re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)
