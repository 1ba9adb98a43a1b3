"""alerts/prometheus.py: the rendered rules file, promtool check/test, and the example Alertmanager config.

``promtool test rules`` runs every built-in rule against synthetic series and expects it to
fire with the labels below and with exactly the annotation text the in-process engine
renders for the same value: the two paths say the same thing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from mfuwatch.alerts import load_config, render_prometheus
from mfuwatch.alerts.prometheus import rule_expr

REPO = Path(__file__).resolve().parents[2]
RULES_FILE = REPO / "grafana" / "prometheus" / "rules" / "mfuwatch.rules.yml"
AM_FILE = REPO / "grafana" / "alertmanager" / "alertmanager.yml"
GRAFANA = "http://localhost:3000/d/"

# rule -> (input series, eval time, rank that fires, its value as the engine would see it, dashboard uid,
#          time at which it must not fire yet, or None)
S = 'run="r",rank="0"'
CASES = {
    "MfuLow": ([(f"mfuwatch_mfu_ratio{{{S}}}", "0.1x30")], "11m", "0", 0.1, "mfuwatch-training-mfu", "9m"),
    # MFU 0.5 for 70 min, then 0.3: 85 min in, the baseline (median over [15m, 75m]) is still 0.5
    "MfuRegression": ([(f"mfuwatch_mfu_ratio{{{S}}}", "0.5x69 0.3x30")], "85m", "0", 0.3 / 0.5,
                      "mfuwatch-training-mfu", "79m"),
    "MemoryBoundDominant": ([(f"mfuwatch_memory_bound_share_ratio{{{S}}}", "0.62x10"),
                             # the agent ranks the existing fix first although the drop-in's gain is larger:
                             # the page names torch_compile, as the engine does (topk of the gains would not)
                             (f'mfuwatch_suggestion_expected_gain_ratio{{{S},kernel="rms_norm"}}', "0.123x10"),
                             (f'mfuwatch_suggestion_expected_gain_ratio{{{S},kernel="torch_compile"}}', "0.05x10"),
                             (f'mfuwatch_suggestion_order{{{S},kernel="torch_compile"}}', "1x10"),
                             (f'mfuwatch_suggestion_order{{{S},kernel="rms_norm"}}', "2x10")],
                            "6m", "0", 0.62, "mfuwatch-training-mfu", "4m"),  # for: 5m
    # last step at t=60 s; at 10 min nothing has moved for 540 s
    "TrainingStalled": ([(f"mfuwatch_last_step_timestamp_seconds{{{S}}}", "60x20")], "10m", "0", 540.0,
                        "mfuwatch-cross-rank", "5m"),
    "GpuThrottling": ([(f'mfuwatch_gpu_clock_event_reason{{{S},reason="hw_slowdown"}}', "1x10"),
                       (f'mfuwatch_gpu_clock_event_reason{{{S},reason="sw_power_cap"}}', "1x10"),
                       (f'mfuwatch_gpu_clock_event_reason{{{S},reason="hw_thermal_slowdown"}}', "0x10")],
                      "6m", "0", 1.0, "mfuwatch-gpu-health", "4m"),
    "GpuXidErrors": ([(f"mfuwatch_gpu_xid_errors_total{{{S}}}", "0 0 0 1 1 1 1 1")], "5m", "0", 1.0,
                     "mfuwatch-gpu-health", "2m"),
    "GpuEccErrors": ([(f'mfuwatch_gpu_ecc_errors_total{{{S},type="uncorrected"}}', "0 0 0 1 1 1 1 1"),
                      (f'mfuwatch_gpu_ecc_errors_total{{{S},type="corrected"}}', "0 5 10 15 20 25 30 35")],
                     "5m", "0", 1.0, "mfuwatch-gpu-health", "2m"),
    "GpuMemoryPressure": ([(f"mfuwatch_gpu_memory_used_bytes{{{S}}}", "96x10"),
                           (f"mfuwatch_gpu_memory_total_bytes{{{S}}}", "100x10")], "6m", "0", 0.96,
                          "mfuwatch-gpu-health", "4m"),
    "InputStall": ([(f'mfuwatch_gpu_time_share_ratio{{{S},category="idle"}}', "0.5x5"),
                    (f'mfuwatch_gpu_time_share_ratio{{{S},category="memory_bound"}}', "0.6x5")], "1m", "0", 0.5,
                   "mfuwatch-training-mfu", None),
    # ranks 0-2 take 1 s per step, rank 3 takes 1.5 s: 1.5 / median(1, 1, 1, 1.5) = 1.5
    "StragglerRank": ([(f'mfuwatch_step_duration_seconds_sum{{run="r",rank="{k}"}}', "0+1x30") for k in "012"]
                      + [('mfuwatch_step_duration_seconds_sum{run="r",rank="3"}', "0+1.5x30")]
                      + [(f'mfuwatch_step_duration_seconds_count{{run="r",rank="{k}"}}', "0+1x30") for k in "0123"],
                      "20m", "3", 1.5, "mfuwatch-cross-rank", "9m"),
    # MFU 0.5 while the tensor cores were active 40% at 1800 of 1980 MHz over the same report interval: bound
    # 0.364, MFU 0.136 above it; the agent's stall clock reads 2 s (steps of 1 s: fresh, no phase open)
    "MfuAboveTensorActivity": ([(f"mfuwatch_mfu_ratio{{{S}}}", "0.5x20"),
                                (f"mfuwatch_interval_tensor_active_bound_ratio{{{S}}}", f"{0.4 * 1800 / 1980!r}x20"),
                                (f"mfuwatch_stall_seconds{{{S}}}", "2x20"),
                                (f"mfuwatch_last_step_duration_seconds{{{S}}}", "1x20")],
                               "11m", "0", 0.5 - 0.4 * 1800 / 1980, "mfuwatch-gpu-health", "9m"),
    # one report with an MFU above 1 at t=3m (withheld by the agent, counted): pages once it is counted
    "MfuImplausible": ([(f'mfuwatch_implausible_ratio_total{{{S},ratio="mfu"}}', "0 0 0 1 1 1 1 1"),
                        (f'mfuwatch_implausible_ratio_total{{{S},ratio="hfu"}}', "0 0 0 0 0 0 0 0")],
                       "5m", "0", 1.0, "mfuwatch-training-mfu", "2m"),
    # MFU 0.05 against tensor active 0.8 at the full clock: 0.0625 of the bound for more than an hour
    "MfuFarBelowTensorActivity": ([(f"mfuwatch_mfu_ratio{{{S}}}", "0.05x70"),
                                   (f"mfuwatch_interval_tensor_active_bound_ratio{{{S}}}", "0.8x70"),
                                   (f"mfuwatch_stall_seconds{{{S}}}", "2x70"),
                                   (f"mfuwatch_last_step_duration_seconds{{{S}}}", "1x70")],
                                  "61m", "0", 0.05 / 0.8, "mfuwatch-gpu-health", "59m"),
}


def test_committed_rules_file_is_the_renderer_output():
    assert RULES_FILE.read_text(encoding="utf-8") == render_prometheus(None), (
        "grafana/prometheus/rules/mfuwatch.rules.yml is stale: run "
        "`mfuwatch alerts render-prometheus -o grafana/prometheus/rules/mfuwatch.rules.yml`")


def test_rendered_rules_mirror_the_config():
    cfg = load_config({"rules": {"MfuLow": {"threshold": 0.3, "for": "90s", "labels": {"team": "ml"}},
                                 "InputStall": {"enabled": False},
                                 "SlowMemory": {"expr": "gpu_memory_used_ratio", "op": ">=", "threshold": 0.5,
                                                "annotations": {"summary": "mem {value:pct} {{x}}"}}}})
    doc = yaml.safe_load(render_prometheus(cfg))
    rules = {r["alert"]: r for r in doc["groups"][0]["rules"]}
    assert "InputStall" not in rules and len(rules) == len(load_config(None).rules)  # one off, SlowMemory on
    assert rules["MfuLow"]["expr"] == "mfuwatch_mfu_ratio < 0.3" and rules["MfuLow"]["for"] == "1m30s"
    assert rules["MfuLow"]["labels"] == {"severity": "warning", "team": "ml"}
    assert rules["SlowMemory"]["expr"] == "mfuwatch_gpu_memory_used_bytes / mfuwatch_gpu_memory_total_bytes >= 0.5"
    assert "for" not in rules["SlowMemory"]
    assert rules["SlowMemory"]["annotations"]["summary"] == 'mem {{ $value | humanizePercentage }} {{ "{" }}x}'
    # the agent's monotonic stall clock; older agents: from the later of the last step and the last phase's end,
    # nothing while a phase is open
    assert rules["TrainingStalled"]["expr"] == (
        "(mfuwatch_stall_seconds or (time() - (mfuwatch_last_phase_end_timestamp_seconds > "
        "mfuwatch_last_step_timestamp_seconds or mfuwatch_last_step_timestamp_seconds) unless "
        "mfuwatch_phase_in_progress > 0)) > 300")
    for r in cfg.rules:
        if r.enabled:
            assert rules[r.name]["expr"] == rule_expr(r)


def test_promtool_check_rules(promtool):
    out = subprocess.run([promtool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(load_config(None).rules)} rules found" in out.stdout


def expected_annotations(rule, rank: str, value: float, uid: str) -> dict:
    suggestion = ("torch_compile", 0.05) if rule.name == "MemoryBoundDominant" else None
    labels = {"run": "r", "rank": rank}
    out = {k: t.render(value=value, labels=labels, static=rule.static(), suggestion=suggestion)
           for k, t in rule.annotations.items()}
    out["dashboard_url"] = f"{GRAFANA}{uid}?var-run=r&var-rank={rank}"
    return out


def test_promtool_unit_tests_every_rule_fires(promtool, tmp_path):
    cfg = load_config(None)
    assert set(CASES) == {r.name for r in cfg.rules}
    tests = []
    for name, (series, at, rank, value, uid, quiet_at) in CASES.items():
        rule = cfg.rule(name)
        checks = [{"eval_time": at, "alertname": name, "exp_alerts": [
            {"exp_labels": {"severity": rule.severity, "run": "r", "rank": rank},
             "exp_annotations": expected_annotations(rule, rank, value, uid)}]}]
        if quiet_at:
            checks.append({"eval_time": quiet_at, "alertname": name, "exp_alerts": []})
        tests.append({"name": name, "interval": "1m",
                      "input_series": [{"series": s, "values": v} for s, v in series], "alert_rule_test": checks})
    test_file = tmp_path / "mfuwatch_rules_test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m",
                                         "tests": tests}, sort_keys=False, width=10_000))
    out = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_example_alertmanager_config_is_valid(amtool):
    out = subprocess.run([amtool, "check-config", str(AM_FILE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 receivers" in out.stdout and "1 inhibit rules" in out.stdout

    def route(*labels):
        res = subprocess.run([amtool, "config", "routes", "test", f"--config.file={AM_FILE}", *labels],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    assert route("alertname=TrainingStalled", "severity=critical", "run=x") == "webhook,slack"
    assert route("alertname=MemoryBoundDominant", "severity=info", "run=x") == "slack"


def test_example_alertmanager_inhibits_like_the_engine():
    am = yaml.safe_load(AM_FILE.read_text())
    engine_default = [i.to_dict() for i in load_config(None).inhibit_rules]
    assert am["inhibit_rules"] == engine_default
    assert am["route"]["group_by"] == list(load_config(None).group_by)


def test_promtool_count_alerts_end_with_the_process(promtool, tmp_path):
    # fresh-user pass (issue 24), on a real Prometheus 2.42: MfuImplausible kept firing after the job had ended
    # and its target was gone (increase over [10m] still held the counted samples), while the engine had
    # resolved it "run ended". The counter rules now end with their series, as the job rules do.
    ended = "0 0 0 1 1 stale"  # counted at 3m; the process ends after 4m (its series goes stale at 5m)
    cases = {"MfuImplausible": [f'mfuwatch_implausible_ratio_total{{{S},ratio="mfu"}}'],
             "GpuXidErrors": [f"mfuwatch_gpu_xid_errors_total{{{S}}}"],
             "GpuEccErrors": [f'mfuwatch_gpu_ecc_errors_total{{{S},type="uncorrected"}}']}
    cfg = load_config(None)
    tests = []
    for name, series in cases.items():
        rule = cfg.rule(name)
        firing = {"exp_labels": {"severity": rule.severity, "run": "r", "rank": "0"},
                  "exp_annotations": expected_annotations(rule, "0", 1.0, CASES[name][4])}
        tests.append({"name": name, "interval": "1m",
                      "input_series": [{"series": s, "values": ended} for s in series],
                      "alert_rule_test": [{"eval_time": "4m", "alertname": name, "exp_alerts": [firing]},
                                          {"eval_time": "6m", "alertname": name, "exp_alerts": []},
                                          {"eval_time": "12m", "alertname": name, "exp_alerts": []}]})
    test_file = tmp_path / "ended_test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m",
                                         "tests": tests}, sort_keys=False, width=10_000))
    out = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
