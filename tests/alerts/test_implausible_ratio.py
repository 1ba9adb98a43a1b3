"""MFU/HFU above 1.0: withheld from the measurement (agent/plausibility.py), and the MfuImplausible alert fires
on it in the in-process engine (the Prometheus side is in test_alert_prometheus's promtool cases)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from mfuwatch.agent.plausibility import ImplausibleRatioGuard, withhold_impossible
from mfuwatch.agent.schema import RunInfo, StepMeasurement
from mfuwatch.alerts import AlertEngine, load_config
from tests.helpers.capture_notifier import Capture


def step(mfu, hfu=None):
    return StepMeasurement(step=1, steps=1, timestamp=0.0, step_time_seconds=1.0, tokens=1, tokens_per_second=1.0,
                           model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0, mfu=mfu, hfu=hfu)


def test_withhold_keeps_possible_ratios_and_records_the_impossible_ones():
    m = step(0.42, 1.0)
    assert withhold_impossible(m) == (m, {})  # exactly the peak is possible
    m2, out = withhold_impossible(step(6.63, 0.5))
    assert out == {"mfu": 6.63} and m2.mfu is None and m2.hfu == 0.5 and m2.implausible == {"mfu": 6.63}
    m3, out = withhold_impossible(step(1.2, float("nan")))
    assert m3.mfu is None and m3.hfu is None and out["mfu"] == 1.2 and math.isnan(out["hfu"])


def test_guard_counts_every_report_and_logs_once_per_ratio(caplog):
    reg = CollectorRegistry()
    info = RunInfo(run="r", rank=3, dtype="bf16", peak_flops_per_second=5.1e13, peak_source="calibrated (fp32 matmul)",
                   flops_source="analytic")
    g = ImplausibleRatioGuard(reg, info)
    lab = {"run": "r", "rank": "3", "ratio": "mfu"}
    assert reg.get_sample_value("mfuwatch_implausible_ratio_total", lab) == 0.0  # the series exists before any
    with caplog.at_level("WARNING", logger="mfuwatch"):
        for _ in range(4):
            assert g.check(step(6.63)).mfu is None
        assert g.check(step(0.4)).mfu == 0.4
    assert reg.get_sample_value("mfuwatch_implausible_ratio_total", lab) == 4.0
    assert reg.get_sample_value("mfuwatch_implausible_ratio_total", {**lab, "ratio": "hfu"}) == 0.0
    msgs = [r.getMessage() for r in caplog.records if "above 100%" in r.getMessage()]
    assert len(msgs) == 1
    assert all(s in msgs[0] for s in ("663%", "5.1e+13", "bf16", "calibrated (fp32 matmul)", "analytic"))


def test_engine_fires_mfu_implausible_and_resolves_when_the_window_has_passed(clock):
    info = RunInfo(run="run-a", rank=0)
    e = AlertEngine.from_config(load_config(None), run_info=info, registry=CollectorRegistry(), clock=clock)
    cap = Capture()
    e.workers = [cap]
    g = ImplausibleRatioGuard(None, info)
    e.observe_step(g.check(step(0.4)))
    e.evaluate()
    assert e.state("MfuImplausible") == "inactive"
    clock.advance(60)
    e.observe_step(g.check(step(6.63, 6.9)))  # both ratios withheld: 2 counted
    e.evaluate()
    assert e.state("MfuImplausible") == "firing"  # for: 0s
    alert = [a for n in cap.sent for a in n.alerts if a.name == "MfuImplausible"][0]
    # one report, two values withheld: the text counts values, not reports (fresh-user pass: it said "2 report(s)")
    assert alert.value == 2.0 and "2 MFU/HFU value(s) withheld in 10m" in alert.annotations["summary"]
    assert "report(s)" not in alert.annotations["summary"] + alert.annotations["description"]
    assert e.state("MfuLow") == "inactive"  # the withheld MFU does not read as a low one either
    for _ in range(10):  # plausible reports for 10 more minutes: the withheld one leaves the window
        clock.advance(60)
        e.observe_step(g.check(step(0.4)))
        e.evaluate()
    assert e.state("MfuImplausible") == "inactive"
    assert ("MfuImplausible", "resolved") in cap.alerts()
