"""The fleet recording and alerting rules, run by ``promtool test rules`` over hand-built series of 3 ranks.

Series (1-minute samples, job "train", run "r"): each rank does 1e12 model FLOP/s on a 1e13 FLOP/s peak
(job MFU 0.1); ranks 0 and 2 step in 0.1 s, rank 1 in 0.13 s (a chronic straggler, ratio 1.3); rank 2 stops
stepping at minute 10 (its watchdog reports the frame it waits in from minute 12); productive time is 70%
of wall time on every rank (GoodputLow below 80%) and input wait 30% on every rank (all ranks wait alike:
no InputBoundRank). A second series set (:func:`_input_bound_series`) has equal step times on every rank and
one rank waiting for input far longer than the others, as synchronous data parallel with one slow data
loader does. A third (:func:`_phase_series`) has ranks that run a 30-minute eval phase: the stall rules
(fleet and per rank) must stay quiet inside it, restart their clock at its end, and fire for a rank that
hangs after it. The expected values below are computed by hand.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from mfuwatch.alerts.fleet_rules import render_fleet
from tests.helpers.debian_tools import ensure_binary

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "grafana" / "prometheus" / "rules" / "mfuwatch-fleet.rules.yml"
PER_RANK = REPO / "grafana" / "prometheus" / "rules" / "mfuwatch.rules.yml"
L = 'job="train",run="r"'


def _rank(r: int) -> str:
    return f'{L},rank="{r}",instance="node{r}:9478"'


def _series():
    s = []
    for r in range(3):
        lab = _rank(r)
        stop = r == 2
        s.append({"series": f"mfuwatch_model_flops_total{{{lab}}}",
                  "values": "0+6e13x10 6e14x60" if stop else "0+6e13x70"})
        s.append({"series": f"mfuwatch_peak_flops_per_second{{{lab}}}", "values": "1e13x70"})
        # the device-time of the timed steps (the job MFU's denominator): busy all the time
        s.append({"series": f"mfuwatch_step_seconds_total{{{lab}}}", "values": "0+60x10 600x60" if stop else "0+60x70"})
        per_step = 0.13 if r == 1 else 0.1
        s.append({"series": f"mfuwatch_step_duration_seconds_sum{{{lab}}}",
                  "values": f"0+{600 * per_step:g}x10 {6000 * per_step:g}x60" if stop else f"0+{600 * per_step:g}x70"})
        s.append({"series": f"mfuwatch_step_duration_seconds_count{{{lab}}}",
                  "values": "0+600x10 6000x60" if stop else "0+600x70"})
        s.append({"series": f"mfuwatch_steps_total{{{lab}}}", "values": "0+600x10 6000x60" if stop else "0+600x70"})
        s.append({"series": f"mfuwatch_last_step_timestamp_seconds{{{lab}}}",
                  "values": "0+60x10 600x60" if stop else "0+60x70"})
        s.append({"series": f"mfuwatch_last_step_duration_seconds{{{lab}}}", "values": f"{per_step:g}x70"})
        s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="productive"}}', "values": "0+42x70"})
        s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="input_wait"}}', "values": "0+18x70"})
        s.append({"series": f'mfuwatch_run_info{{{lab},host="gpu-node-{r}"}}', "values": "1x70"})
    s.append({"series": f'mfuwatch_hang_info{{{_rank(2)},frame="train.py:88 in next_batch",collective=""}}',
              "values": "_x12 1x58"})
    return s


#: Input-wait seconds per minute of wall time (the rest is productive): rank 1 waits 26.4% of its time,
#: ranks 0 and 2 wait 1.8% and 6% (the shares of a measured 2-rank gloo run, docs/fleet.md, plus one rank
#: above 3x the least-waiting rank but below the 10% floor).
INPUT_WAIT_PER_MIN = {0: 1.08, 1: 15.84, 2: 3.6}


def _input_bound_series():
    s = []
    for r in range(3):
        lab = _rank(r)
        wait = INPUT_WAIT_PER_MIN[r]
        s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="input_wait"}}', "values": f"0+{wait:g}x40"})
        s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="productive"}}',
                  "values": f"0+{60 - wait:g}x40"})
        # synchronous steps: every rank's step takes the same 0.48 s (the fast ranks wait in the all-reduce)
        s.append({"series": f"mfuwatch_step_duration_seconds_sum{{{lab}}}", "values": "0+60x40"})
        s.append({"series": f"mfuwatch_step_duration_seconds_count{{{lab}}}", "values": "0+125x40"})
        s.append({"series": f"mfuwatch_last_step_duration_seconds{{{lab}}}", "values": "0.48x40"})
        s.append({"series": f"mfuwatch_last_step_timestamp_seconds{{{lab}}}", "values": "0+60x40"})
        s.append({"series": f"mfuwatch_steps_total{{{lab}}}", "values": "0+125x40"})  # the exporter is scraped
        s.append({"series": f'mfuwatch_run_info{{{lab},host="gpu-node-{r}"}}', "values": "1x40"})
    return s


def _input_bound_test():
    return {
        "interval": "1m",
        "input_series": _input_bound_series(),
        "promql_expr_test": [
            {"expr": "round(rank:mfuwatch_input_wait:ratio, 0.0001)", "eval_time": "8m",
             "exp_samples": [{"labels": f'{{{L},rank="{r}"}}', "value": v}
                             for r, v in ((0, 0.018), (1, 0.264), (2, 0.06))]},  # wait / 60 s
            {"expr": "round(rank:mfuwatch_step_time_vs_fastest:ratio, 0.0001)", "eval_time": "8m",
             "exp_samples": [{"labels": f'{{{L},rank="{r}"}}', "value": 1.0} for r in range(3)]},
        ],
        "alert_rule_test": [
            {"alertname": "InputBoundRank", "eval_time": "9m", "exp_alerts": []},  # pending: for 10m
            {"alertname": "InputBoundRank", "eval_time": "16m", "exp_alerts": [{
                # rank 2 (6%) is above 3 x 1.8% but below the 10% floor: not named
                "exp_labels": {"severity": "warning", "job": "train", "run": "r", "rank": "1",
                               "host": "gpu-node-1"},  # recorded per (job, run, rank): no instance
                "exp_annotations": {
                    "summary": "Rank 1 on gpu-node-1 waits for input 26.4% of its wall time in run r; the job's "
                               "least-waiting rank waits 1.8%",
                    "description": "For 10m this rank has spent more than 10% of its wall time over 5m between the "
                                   "end of a step and the next forward (goodput bucket input_wait), over 3x the "
                                   "job's least-waiting rank. In synchronous data parallel the other ranks wait for "
                                   "it inside the gradient all-reduce, so every rank's step time grows alike and "
                                   "StragglerRank cannot name it. Check this rank's data loader (worker count, "
                                   "prefetch, its storage or network reads, CPU contention on its host) and whether "
                                   "its data shard is heavier than the others'.",
                    "runbook_url": "https://github.com/mfuwatch/mfuwatch/blob/main/docs/runbooks/"
                                   "InputBoundRank.md"}}]},
            {"alertname": "StragglerRank", "eval_time": "16m", "exp_alerts": []},  # step times are equal
        ],
    }


#: The phase scenario (1-minute samples, stalled_seconds 300). Every rank steps 600 times a minute until
#: minute 10 (last step at 600 s); then
#:   rank 0 steps on and exports no phase-end series (an older agent: timed from its steps alone);
#:   rank 1 runs an eval from 600 s to 2400 s (minutes 10-40: 30 min, 6x stalled_seconds) and then hangs;
#:   rank 2 runs the same eval and steps again from minute 41 (last step 2460 s, then one a minute);
#:   rank 3 stops stepping at minute 10 outside any phase (its phase gauge reads 0 throughout).
PHASE_STEPS = {0: "0+600x60", 1: "0+600x10 6000x50", 2: "0+600x10 6000x30 6600+600x19", 3: "0+600x10 6000x50"}
PHASE_LAST_STEP = {0: "0+60x60", 1: "0+60x10 600x50", 2: "0+60x10 600x30 2460+60x19", 3: "0+60x10 600x50"}
PHASE_OPEN = {0: "0x60", 1: "0x9 1x29 0x20", 2: "0x9 1x29 0x20", 3: "0x60"}  # 1 at minutes 10..39
PHASE_END = {1: "0x39 2400x20", 2: "0x39 2400x20", 3: "0x60"}  # 0 before the first phase; rank 0: no series


def _phase_series():
    s = []
    for r in range(4):
        lab = _rank(r)
        s.append({"series": f"mfuwatch_steps_total{{{lab}}}", "values": PHASE_STEPS[r]})
        s.append({"series": f"mfuwatch_last_step_timestamp_seconds{{{lab}}}", "values": PHASE_LAST_STEP[r]})
        s.append({"series": f"mfuwatch_phase_in_progress{{{lab}}}", "values": PHASE_OPEN[r]})
        if r in PHASE_END:
            s.append({"series": f"mfuwatch_last_phase_end_timestamp_seconds{{{lab}}}", "values": PHASE_END[r]})
        s.append({"series": f'mfuwatch_run_info{{{lab},host="gpu-node-{r}"}}', "values": "1x60"})
    return s


#: (eval minute, {rank: (seconds without progress, steps behind the leader rank 0)}) of the fleet alert
PHASE_EXPECTED = [
    (16, {3: (960 - 600, 9600 - 6000)}),  # ranks 1 and 2 are 360 s past their last step, inside the eval
    (20, {3: (1200 - 600, 12000 - 6000)}),  # 600 s, still inside: no page for an eval longer than the threshold
    (39, {3: (2340 - 600, 23400 - 6000)}),
    (44, {3: (2640 - 600, 26400 - 6000)}),  # the eval ended at 2400 s: rank 1 is at 240 s, rank 2 steps again
    (46, {1: (2760 - 2400, 27600 - 6000), 3: (2760 - 600, 27600 - 6000)}),  # rank 1 hangs 360 s after the eval
    (55, {1: (3300 - 2400, 33000 - 6000), 3: (3300 - 600, 33000 - 6000)}),  # rank 2 never: it steps
]

STALLED_DESCRIPTION = ("The training thread waits at: {where}. Ranks waiting in a collective while one rank is behind "
                       "point at that rank. Counted from the later of the rank's last step and the end of its last "
                       "eval or checkpoint phase; not raised while a phase is open.")


def _humanize(seconds: int) -> str:
    """Prometheus' humanizeDuration for whole seconds under an hour (``6m 0s``)."""
    return f"{seconds // 60}m {seconds % 60}s" if seconds >= 60 else f"{seconds}s"


def _phase_test():
    checks = []
    for minute, ranks in PHASE_EXPECTED:
        checks.append({"alertname": "TrainingStalled", "eval_time": f"{minute}m", "exp_alerts": [{
            "exp_labels": {"severity": "critical", "kind": "fleet", "job": "train", "run": "r", "rank": str(r),
                           "instance": f"node{r}:9478", "host": f"gpu-node-{r}"},
            "exp_annotations": {
                "summary": f"Rank {r} on gpu-node-{r} of run r has made no step for {_humanize(idle)}; it is "
                           f"{behind} step(s) behind the leader",
                "description": STALLED_DESCRIPTION.format(
                    where="not recorded (the hang watchdog has not judged this step stuck yet)"),
                "runbook_url": "https://github.com/mfuwatch/mfuwatch/blob/main/docs/runbooks/TrainingStalled.md"}}
            for r, (idle, behind) in sorted(ranks.items())]})
    return {"interval": "1m", "input_series": _phase_series(), "alert_rule_test": checks}


def _tests():
    stalled_summary = ("Rank 2 on gpu-node-2 of run r has made no step for {d}; it is 6000 step(s) behind the leader")
    return [{
        "interval": "1m",
        "input_series": _series(),
        "promql_expr_test": [
            # round(x, 1e-4): promtool 2.42 compares floats exactly
            {"expr": "round(job:mfuwatch_mfu:ratio, 0.0001)", "eval_time": "8m",
             "exp_samples": [{"labels": f"{{{L}}}", "value": 0.1}]},  # 3 x 1e12 / (3 x 1e13)
            {"expr": "round(rank:mfuwatch_step_time_vs_fastest:ratio, 0.0001)", "eval_time": "8m",
             "exp_samples": [{"labels": f'{{{L},rank="{r}"}}', "value": v} for r, v in ((0, 1.0), (1, 1.3), (2, 1.0))]},
            {"expr": "rank:mfuwatch_step_time_vs_fastest:ratio", "eval_time": "20m",  # rank 2 stopped: no ratio
             "exp_samples": [{"labels": f'rank:mfuwatch_step_time_vs_fastest:ratio{{{L},rank="{r}"}}', "value": v}
                             for r, v in ((0, 1.0), (1, 1.3))]},
            {"expr": "rank:mfuwatch_steps_behind_leader:count", "eval_time": "20m",
             "exp_samples": [{"labels": f'rank:mfuwatch_steps_behind_leader:count{{{L},rank="{r}"}}', "value": v}
                             for r, v in ((0, 0), (1, 0), (2, 6000))]},
            {"expr": "round(job:mfuwatch_goodput:ratio, 0.0001)", "eval_time": "40m",
             "exp_samples": [{"labels": f"{{{L}}}", "value": 0.7}]},  # 42 / (42 + 18)
            {"expr": "job:mfuwatch_tokens_total:rate", "eval_time": "8m", "exp_samples": []},  # no tokens series
            {"expr": "round(rank:mfuwatch_input_wait:ratio, 0.0001)", "eval_time": "8m",  # 18 / 60 on each rank
             "exp_samples": [{"labels": f'{{{L},rank="{r}"}}', "value": 0.3} for r in range(3)]},
        ],
        "alert_rule_test": [
            {"alertname": "StragglerRank", "eval_time": "9m", "exp_alerts": []},  # pending: for 10m
            {"alertname": "StragglerRank", "eval_time": "16m", "exp_alerts": [{  # the chronic one; no one-off
                "exp_labels": {"severity": "warning", "kind": "chronic", "job": "train", "run": "r",
                               "rank": "1", "host": "gpu-node-1"},
                "exp_annotations": {
                    "summary": "Rank 1 on gpu-node-1 is a chronic straggler of run r: step time 1.30x the fastest "
                               "rank's",
                    "description": "For 10m this rank's mean step time over 5m has stayed above 1.2x the fastest "
                                   "rank's. Every synchronous step waits for it: check its GPU clocks and "
                                   "throttling, its host's load, and its network link.",
                    "runbook_url": "https://github.com/mfuwatch/mfuwatch/blob/main/docs/runbooks/StragglerRank.md"}}]},
            {"alertname": "InputBoundRank", "eval_time": "30m", "exp_alerts": []},  # every rank waits 30%
            {"alertname": "TrainingStalled", "eval_time": "14m", "exp_alerts": []},  # 240 s < 300 s
            {"alertname": "TrainingStalled", "eval_time": "20m", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "kind": "fleet", "job": "train", "run": "r", "rank": "2",
                               "instance": "node2:9478", "host": "gpu-node-2"},
                "exp_annotations": {
                    "summary": stalled_summary.format(d="10m 0s"),
                    "description": STALLED_DESCRIPTION.format(where="train.py:88 in next_batch"),
                    "runbook_url": "https://github.com/mfuwatch/mfuwatch/blob/main/docs/runbooks/"
                                   "TrainingStalled.md"}}]},
            {"alertname": "GoodputLow", "eval_time": "29m", "exp_alerts": []},
            {"alertname": "GoodputLow", "eval_time": "65m", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "job": "train", "run": "r"},
                "exp_annotations": {
                    "summary": "Goodput of run r is 70%, below 80% for 30m",
                    "description": "Productive step time over all wall time of the job's ranks (buckets in "
                                   "mfuwatch_goodput_seconds_total: input_wait, warmup, checkpoint_save/load, "
                                   "eval, lost_progress). The goodput row of the Cross-rank dashboard shows which "
                                   "bucket grew. Not raised while an agent phase (eval, checkpoint) of the job falls "
                                   "in the 30m window: one planned eval or checkpoint is not an incident.",
                    "runbook_url": "https://github.com/mfuwatch/mfuwatch/blob/main/docs/runbooks/GoodputLow.md"}}]},
        ],
    }, _input_bound_test(), _phase_test(), _eval_barrier_test()]


def _eval_barrier_test():
    """Rank 0 evaluates alone for 40 minutes while ranks 1 and 2 wait for it between steps (their time goes to
    input_wait): no InputBoundRank while a phase is open, nor in the 5 m after it, whose rates still hold the
    wait; the same shares with no phase open would page (shown by the rule's own recording rule)."""
    s = []
    for r in range(3):
        lab = _rank(r)
        busy = "1x40 0x20" if r == 0 else "0x60"
        s.append({"series": f"mfuwatch_phase_in_progress{{{lab}}}", "values": busy})
        if r == 0:  # eval for 40 min, then productive
            s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="eval"}}', "values": "0+60x40 2400x20"})
            s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="productive"}}',
                      "values": "0x40 0+59x20"})
            s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="input_wait"}}',
                      "values": "0x40 0+1x20"})
        else:  # waiting at the next step's barrier for 40 min, then productive
            s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="input_wait"}}',
                      "values": "0+60x40 2400+1x20"})
            s.append({"series": f'mfuwatch_goodput_seconds_total{{{lab},bucket="productive"}}',
                      "values": "0x40 0+59x20"})
        s.append({"series": f"mfuwatch_steps_total{{{lab}}}", "values": "100x40 100+120x20"})  # scraped throughout
        s.append({"series": f'mfuwatch_run_info{{{lab},host="gpu-node-{r}"}}', "values": "1x60"})
    return {
        "interval": "1m",
        "input_series": s,
        "promql_expr_test": [
            {"expr": "round(rank:mfuwatch_input_wait:ratio, 0.0001)", "eval_time": "30m",
             "exp_samples": [{"labels": f'{{{L},rank="{r}"}}', "value": v} for r, v in ((0, 0.0), (1, 1.0), (2, 1.0))]},
        ],
        "alert_rule_test": [
            {"alertname": "InputBoundRank", "eval_time": "30m", "exp_alerts": []},
            {"alertname": "InputBoundRank", "eval_time": "39m", "exp_alerts": []},
            {"alertname": "InputBoundRank", "eval_time": "46m", "exp_alerts": []},
            {"alertname": "InputBoundRank", "eval_time": "58m", "exp_alerts": []},
        ],
    }


def test_shipped_fleet_rules_are_the_rendered_ones():
    assert SHIPPED.read_text() == render_fleet(), "render again: python -m mfuwatch.alerts.fleet_rules -o " + str(SHIPPED)


def test_promtool_checks_and_unit_tests_the_fleet_rules(tmp_path):
    promtool = ensure_binary(("promtool",), "prometheus")
    rules = tmp_path / "fleet.rules.yml"
    rules.write_text(render_fleet())
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    spec = tmp_path / "fleet.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": _tests()},
                                   sort_keys=False, width=10_000))
    res = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-6000:]


def test_per_rank_training_stalled_pauses_during_phases_too(tmp_path):
    """The per-rank ``TrainingStalled`` of ``mfuwatch.rules.yml`` over the phase scenario: the same ranks, no host."""
    from mfuwatch.alerts import load_config

    promtool = ensure_binary(("promtool",), "prometheus")
    rule = load_config(None).rule("TrainingStalled")
    checks = []
    for minute, ranks in PHASE_EXPECTED:
        alerts = []
        for r, (idle, _behind) in sorted(ranks.items()):
            labels = {"run": "r", "rank": str(r)}
            ann = {k: t.render(value=float(idle), labels=labels, static=rule.static())
                   for k, t in rule.annotations.items()}
            ann["dashboard_url"] = f"http://localhost:3000/d/mfuwatch-cross-rank?var-run=r&var-rank={r}"
            assert _humanize(idle) in ann["summary"], ann  # the engine's duration reads as promtool's
            alerts.append({"exp_labels": {"severity": "critical", "job": "train", "run": "r", "rank": str(r),
                                          "instance": f"node{r}:9478"}, "exp_annotations": ann})
        checks.append({"alertname": "TrainingStalled", "eval_time": f"{minute}m", "exp_alerts": alerts})
    spec = tmp_path / "per_rank.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(PER_RANK)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": _phase_series(), "alert_rule_test": checks}]}, sort_keys=False,
        width=10_000))
    res = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-6000:]


def test_every_fleet_alert_links_an_existing_runbook_that_names_existing_panels():
    import json
    import re

    from mfuwatch.alerts.fleet_rules import FleetRuleConfig, alerting_rules

    panels = set()
    for f in (REPO / "grafana" / "dashboards").glob("*.json"):
        panels |= {p.get("title") for p in json.loads(f.read_text())["panels"]}
    for rule in alerting_rules(FleetRuleConfig()):
        name = rule["annotations"]["runbook_url"].rsplit("/", 1)[1]
        path = REPO / "docs" / "runbooks" / name
        assert path.is_file(), f"{rule['alert']}: no runbook {path}"
        text = path.read_text()
        assert text.startswith(f"# {name[:-3]}\n"), path
        if rule["alert"] == "InputBoundRank":
            assert "rank:mfuwatch_input_wait:ratio" in text and "mfuwatch_goodput_seconds_total" in text
            quoted = re.findall(r'"([^"]+)"', text.replace("\n  ", " "))
            assert {"Input-wait share per rank", "Step time per rank"} <= set(quoted) <= panels | {"input_wait"}, \
                set(quoted) - panels


def _edge_series(gauges):
    """Two busy ranks (60 s of timed steps a minute at 1e13 FLOP/s peak: a capacity of 6e14 FLOPs a minute):
    rank 0 does 0.4 of it; rank 1's FLOPs counter runs at 2x its capacity, as a job's edge can make two
    rates extrapolated over different spans read. ``gauges``: each rank's reported mfuwatch_mfu_ratio."""
    s = []
    for r, flops in ((0, 2.4e14), (1, 1.2e15)):
        lab = _rank(r)
        s.append({"series": f"mfuwatch_model_flops_total{{{lab}}}", "values": f"0+{flops:g}x20"})
        s.append({"series": f"mfuwatch_step_seconds_total{{{lab}}}", "values": "0+60x20"})
        s.append({"series": f"mfuwatch_peak_flops_per_second{{{lab}}}", "values": "1e13x20"})
        s.append({"series": f"mfuwatch_steps_total{{{lab}}}", "values": "0+600x20"})
        if gauges is not None:
            s.append({"series": f"mfuwatch_mfu_ratio{{{lab}}}", "values": f"{gauges[r]:g}x20"})
    return s


@pytest.mark.parametrize("gauges, expected", [
    ((0.4, 0.6), 0.6),  # each rank's FLOPs at most its capacity: (0.4 + 1.0) / 2 = 0.7, then at most the 0.6 reported
    ((0.4, 0.9), 0.7),  # the ranks report more than 0.7: the capped ratio stands
    (None, 0.7),  # no rank reports one (withheld as implausible): the capped ratio, never the raw 1.2
])
def test_the_job_mfu_cannot_exceed_what_its_ranks_report(tmp_path, gauges, expected):
    promtool = ensure_binary(("promtool",), "prometheus")
    rules = tmp_path / "fleet.rules.yml"
    rules.write_text(render_fleet())
    test = {"interval": "1m", "input_series": _edge_series(gauges), "promql_expr_test": [
        {"expr": "round(job:mfuwatch_mfu:ratio, 0.0001)", "eval_time": "10m",
         "exp_samples": [{"labels": f"{{{L}}}", "value": expected}]},
        # the uncapped ratio of sums reads 1.2 here: (0.4 + 2.0) / 2
        {"expr": "round(sum by (job, run) (rate(mfuwatch_model_flops_total[5m])) / sum by (job, run) "
                 "(rate(mfuwatch_step_seconds_total[5m]) * mfuwatch_peak_flops_per_second), 0.0001)",
         "eval_time": "10m", "exp_samples": [{"labels": f"{{{L}}}", "value": 1.2}]}]}
    spec = tmp_path / "edge.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [test]},
                                   sort_keys=False, width=10_000))
    res = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-6000:]
