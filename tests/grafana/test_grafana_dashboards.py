"""Structural checks of the hand-written dashboards in grafana/dashboards/.

Panel ids unique, grid positions inside the 24-column grid and not overlapping, every panel,
target, variable and annotation on the Prometheus datasource chosen by the ``datasource``
variable (no hard-coded uid), a known unit on every panel, metric names and label values from
the data contract (agent/schema.py). That every query returns data from a real agent is
tested in test_grafana_end_to_end.py.
"""

from __future__ import annotations

import itertools
import re

import pytest

from mfuwatch.agent.fleet.goodput import BUCKETS
from mfuwatch.agent.schema import BASE_LABELS, CATEGORIES, EXTRA_LABELS, M
from mfuwatch.alerts.fleet_rules import FleetRuleConfig, recording_rules
from tests.helpers.grafana_dashboards import DATASOURCE_REF, load_dashboards, panels, parse_label_values, queries

DASHBOARDS = load_dashboards()
EXPECTED = {
    "training-mfu.json": ("mfuwatch-training-mfu", "mfuwatch / Training MFU"),
    "gpu-health.json": ("mfuwatch-gpu-health", "mfuwatch / GPU health"),
    "cross-rank.json": ("mfuwatch-cross-rank", "mfuwatch / Cross-rank"),
}
#: Unit ids of Grafana's value formats (packages/grafana-data/src/valueFormats/categories.ts) used here;
#: ``suffix:<text>`` is Grafana's custom-unit syntax.
KNOWN_UNITS = {"percentunit", "flops", "s", "short", "none", "bytes", "watt", "celsius", "hertz", "bool"}
#: Metrics of schema.M on no dashboard, and why.
NOT_ON_DASHBOARDS = {
    M.PROFILE_WINDOWS_TOTAL: "agent self-monitoring; counted for the alert rules and the logs",
    M.SUGGESTION_ORDER: "read by the MemoryBoundDominant rule (its Top suggestion); the remedies table shows the gains",
    M.AGENT_ERRORS_TOTAL: "agent self-monitoring; has no series in a healthy run",
    M.IMPLAUSIBLE_RATIO_TOTAL: "0 in a sound run; read by the MfuImplausible rule, which pages on any increase",
    M.SIGNALS_TOTAL: "has a series only in the last moments of a preempted run (its timeline records the signal)",
    M.NOTIFICATIONS_TOTAL: "notifier self-monitoring; has no series until a notification is sent",
    M.LAST_STEP_DURATION_SECONDS: "the step-time histogram gives the same per-rank mean, and quantiles",
    M.MODEL_FLOPS_TOTAL: "read through the recorded job:mfuwatch_mfu:ratio (fleet rules)",
    M.HARDWARE_FLOPS_TOTAL: "read through the recorded job:mfuwatch_hfu:ratio (fleet rules)",
    M.STEP_SECONDS_TOTAL: "for sum/rate queries of other stores; the dashboards use the step-time histogram",
    M.HANG_INFO: "has a series only while a step is stuck; the fleet TrainingStalled notification shows its frame",
    M.PHASE_IN_PROGRESS: "read by the TrainingStalled rules (no page while a phase is open); the goodput row "
                         "shows the phases' time (eval, checkpoint buckets)",
    M.LAST_PHASE_END_TIMESTAMP_SECONDS: "read by the TrainingStalled rules (the stall clock restarts at a phase's end)",
    M.STALL_SECONDS: "the TrainingStalled value of both paths (the agent's monotonic stall clock)",
    M.INTERVAL_TENSOR_ACTIVE: "the GPM side of the MFU cross-check over a report's steps; the GPU-health panels "
                              "show the live GPM activity",
    M.INTERVAL_TENSOR_ACTIVE_BOUND: "read by MfuAboveTensorActivity / MfuFarBelowTensorActivity",
    M.INTERVAL_SM_ACTIVE: "the live SM activity is on the GPU-health dashboard",
    M.INTERVAL_DRAM_ACTIVE: "the live DRAM activity is on the GPU-health dashboard",
    M.EXPORTER_REQUESTS_TOTAL: "exporter self-monitoring (scrapes answered by status); read when a scrape fails",
    M.EXPORTER_DROPPED_CONNECTIONS_TOTAL: "exporter self-monitoring; 0 unless clients misbehave (cap, timeouts)",
    M.EXPORTER_SERVER_CPU_SECONDS_TOTAL: "exporter self-monitoring; bounded by exporter_max_cpu_share",
}
#: Series recorded by the fleet rules (grafana/prometheus/rules/mfuwatch-fleet.rules.yml) the dashboards read.
RECORDED = {r["record"] for r in recording_rules(FleetRuleConfig())}
ALL_METRICS = {v for k, v in vars(M).items() if k.isupper()}
HISTOGRAM_SERIES = {M.STEP_DURATION_SECONDS + s for s in ("_bucket", "_sum", "_count")}
#: Label values the exporter writes (schema docstrings: OpShare.bound, GpuHealth.ecc_errors keys).
LABEL_VALUES = {"category": set(CATEGORIES), "bound": {"compute", "memory", "communication", "other"},
                "bucket": set(BUCKETS),
                "type": {"corrected", "uncorrected"}, "alertstate": {"firing", "pending"}}
#: Labels outside the contract that the queries may use: histogram buckets, Prometheus's ALERTS,
#: and the host of mfuwatch_run_info.
OTHER_LABELS = {"le", "alertstate", "alertname", "severity", "host"}


def all_queries():
    return [q for name, d in DASHBOARDS.items() for q in queries(name, d)]


def test_the_three_dashboards_are_there():
    assert {n: (d["uid"], d["title"]) for n, d in DASHBOARDS.items()} == EXPECTED
    for d in DASHBOARDS.values():
        assert "mfuwatch" in d["tags"] and d["schemaVersion"] >= 39


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_panel_ids_are_unique_and_grid_positions_do_not_overlap(name):
    ps = panels(DASHBOARDS[name])
    ids = [p["id"] for p in ps]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(ids) == len(set(ids)), ids
    for p in ps:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
    for a, b in itertools.combinations(ps, 2):
        ga, gb = a["gridPos"], b["gridPos"]
        apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"] or
                 ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
        assert apart, f"{name}: {a['title']!r} overlaps {b['title']!r}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_everything_uses_the_datasource_variable(name):
    d = DASHBOARDS[name]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for p in panels(d):
        assert p["datasource"] == DATASOURCE_REF, p["title"]
        if p["type"] == "row":
            continue  # a row only groups panels: no queries
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE_REF, (p["title"], t["refId"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE_REF, v["name"]
    for a in d["annotations"]["list"]:
        assert a["datasource"] == DATASOURCE_REF, a["name"]

    def uids(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "uid" and node is not d:
                    yield v
                yield from uids(v)
        elif isinstance(node, list):
            for v in node:
                yield from uids(v)

    assert set(uids(d)) == {"${datasource}"}  # no hard-coded datasource uid anywhere


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_panel_has_a_unit(name):
    for p in panels(DASHBOARDS[name]):
        if p["type"] == "row":
            continue  # a row only groups panels
        unit = p["fieldConfig"]["defaults"].get("unit", "")
        assert unit in KNOWN_UNITS or re.fullmatch(r"suffix:.+", unit), (p["title"], unit)


def test_run_and_rank_variables_come_from_run_info():
    for name, d in DASHBOARDS.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert parse_label_values(variables["run"]["query"]) == (M.RUN_INFO, "run")
        if "rank" in variables:
            assert parse_label_values(variables["rank"]["query"]) == (M.RUN_INFO + '{run=~"$run"}', "rank")
            assert variables["rank"]["includeAll"] and variables["rank"]["allValue"] == ".*"
        assert any('run=~"$run"' in a["expr"] and a["expr"].startswith("ALERTS{")
                   for a in d["annotations"]["list"]), name


def test_queries_use_contract_metric_names_labels_and_values():
    used = set()
    for q in all_queries():
        recorded = set(re.findall(r"\b\w+:mfuwatch_\w+:\w+", q.expr))
        assert recorded <= RECORDED, f"{q.where}: not recorded by the fleet rules: {recorded - RECORDED}"
        names = set(re.findall(r"\bmfuwatch_\w+", re.sub(r"\b\w+:mfuwatch_\w+:\w+", "", q.expr)))
        assert names or recorded or q.expr.startswith("ALERTS"), q.where
        unknown = names - ALL_METRICS - HISTOGRAM_SERIES
        assert not unknown, f"{q.dashboard} {q.where}: not in schema.M: {unknown}"
        used |= {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                 if n in HISTOGRAM_SERIES else n for n in names}
        known_labels = set(BASE_LABELS) | OTHER_LABELS | {lab for labs in EXTRA_LABELS.values() for lab in labs}
        for label, _op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', q.expr):
            assert label in known_labels, f"{q.where}: label {label!r}"
            if label in LABEL_VALUES:
                assert value in LABEL_VALUES[label], f"{q.where}: {label}={value!r}"
        for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", q.expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in known_labels, f"{q.where}: grouping label {label!r}"
    missing = ALL_METRICS - used - set(NOT_ON_DASHBOARDS)
    assert not missing, f"metrics on no dashboard (add a panel or a reason in NOT_ON_DASHBOARDS): {missing}"
    assert not (used & set(NOT_ON_DASHBOARDS)), "a metric listed as absent is on a dashboard: update the list"


def test_training_dashboard_has_the_panels_the_issue_asks_for():
    d = DASHBOARDS["training-mfu.json"]
    by_title = {p["title"]: p for p in panels(d)}
    exprs = " ".join(t["expr"] for p in panels(d) for t in p["targets"])
    for needle in (M.MFU, M.HFU, M.MODEL_FLOPS_PER_SECOND, M.PEAK_FLOPS_PER_SECOND, M.TOKENS_TOTAL,
                   f"histogram_quantile(0.99, sum by (le) (rate({M.STEP_DURATION_SECONDS}_bucket",
                   M.GPU_TIME_SHARE, M.MEMORY_BOUND_SHARE, M.OP_GPU_TIME_SHARE, M.SUGGESTION_EXPECTED_GAIN):
        assert needle in exprs, needle
    assert by_title["Time breakdown (share of profiler window wall time)"]["fieldConfig"]["defaults"][
        "custom"]["stacking"]["mode"] == "normal"
    for title in ("Top memory-bound ops (latest profiler window)", "Suggested remedies and expected gain"):
        assert by_title[title]["type"] == "table"
        assert all(t.get("instant") and t.get("format") == "table" for t in by_title[title]["targets"])
