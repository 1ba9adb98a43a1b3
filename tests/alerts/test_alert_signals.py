"""alerts/signals.py: each signal's in-process value from measurements, against hand-computed values."""

from __future__ import annotations


from mfuwatch.agent.schema import GpuHealth, OpShare, StepMeasurement, Suggestion, WindowMeasurement
from mfuwatch.alerts.signals import MeasurementStore, memory_bound_ops, suggestion_rows


def step(mfu, i=1):
    return StepMeasurement(step=i, steps=1, timestamp=0.0, step_time_seconds=1.0, tokens=1, tokens_per_second=1.0,
                           model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0, mfu=mfu)


def test_no_data_means_no_value(clock):
    s = MeasurementStore(clock)
    for name in ("mfu", "mfu_vs_baseline", "memory_bound_share", "idle_share", "seconds_since_last_step",
                 "gpu_throttle_reasons", "gpu_xid_errors_increase", "gpu_ecc_uncorrected_increase",
                 "gpu_memory_used_ratio", "step_time_vs_run_median"):
        assert s.value(name, {"window": 60.0, "offset": 0.0, "reasons": ("hw_slowdown",)}, clock()) is None


def test_mfu_and_baseline_median(clock):
    s = MeasurementStore(clock)
    rule = {"window": 100.0, "offset": 50.0}
    t0 = clock()
    # samples at t0 .. t0+150 every 10 s; baseline window at now=t0+150 is (t0, t0+100]
    values = [0.40, 0.42, 0.38, 0.44, 0.41, 0.39, 0.43, 0.40, 0.45, 0.41, 0.42, 0.40, 0.30, 0.30, 0.30, 0.30]
    for i, v in enumerate(values):
        clock.t = t0 + 10 * i
        s.observe_step(step(v, i))
    now = clock()
    assert s.value("mfu", rule, now) == 0.30
    # a median over time, as Prometheus's quantile_over_time of the scraped gauge: each report's value is held
    # until the next one; in (t0, t0+100] values[0..9] are held 10 s each (values[10] arrives at the end)
    held = sorted(values[:10])  # .38 .39 .40 .40 .41 .41 .42 .43 .44 .45
    expected = 0.30 / held[4]
    assert abs(s.value("mfu_vs_baseline", rule, now) - expected) < 1e-12
    assert abs(expected - 0.30 / 0.41) < 1e-12
    assert s.value("mfu", rule, now) is not None and s.value("seconds_since_last_step", rule, now) == 0.0
    assert s.value("seconds_since_last_step", rule, now + 42.0) == 42.0


def test_mfu_none_when_peak_unknown(clock):
    s = MeasurementStore(clock)
    s.observe_step(step(None))
    assert s.value("mfu", {}, clock()) is None and s.value("mfu_vs_baseline", {"window": 9, "offset": 0}, 0) is None
    assert s.value("seconds_since_last_step", {}, clock() + 5) == 5.0


def test_window_signals(clock):
    s = MeasurementStore(clock)
    w = WindowMeasurement(step=1, timestamp=0, steps=3, wall_seconds=2.0, busy_seconds=1.5,
                          breakdown={"compute_bound": 0.3, "memory_bound": 0.6, "communication": 0.0, "other": 0.1,
                                     "idle": 0.25}, memory_bound_share=0.6,
                          top_ops=[OpShare("aten::mm", "compute", 0.3, 0.45), OpShare("aten::add", "memory", 0.1, .15),
                                   OpShare("aten::native_layer_norm", "memory", 0.35, 0.525)],
                          suggestions=[Suggestion("torch_compile", "torch.compile", "model = torch.compile(model)",
                                                  ["aten::add"], 0.1, 0.05, "existing"),
                                       Suggestion("rms_norm", "Fused RMSNorm", "mfuwatch.kernels.patch(model, "
                                                  "kernels=[\"rms_norm\"])", ["aten::native_layer_norm"], 0.2, 0.2,
                                                  "bundled")])
    s.observe_window(w)
    assert s.value("memory_bound_share", {}, 0) == 0.6 and s.value("idle_share", {}, 0) == 0.25
    assert [o["op"] for o in memory_bound_ops(w)] == ["aten::native_layer_norm", "aten::add"]
    rows = suggestion_rows(w)
    assert [r["kernel"] for r in rows] == ["torch_compile", "rms_norm"] and rows[1]["kind"] == "bundled"
    # the agent ranks existing fixes first; a bundled kernel past the limit is still named
    assert [r["kernel"] for r in suggestion_rows(w, limit=1)] == ["torch_compile", "rms_norm"]
    w.suggestions = w.suggestions[:1] * 4
    assert [r["kernel"] for r in suggestion_rows(w, limit=3)] == ["torch_compile"] * 3


def test_gpu_signals_and_error_increase(clock):
    s = MeasurementStore(clock)
    rule = {"window": 600.0, "reasons": ("hw_slowdown", "hw_thermal_slowdown")}
    t0 = clock()
    s.observe_gpu(GpuHealth(timestamp=0, xid_errors=5, ecc_errors={"uncorrected": 2}, memory_used_bytes=90.0,
                            memory_total_bytes=100.0,
                            clock_event_reasons={"hw_slowdown": True, "sw_power_cap": True,
                                                 "hw_thermal_slowdown": False}))
    # the first sample is the baseline: counts since driver load are not new errors
    assert s.value("gpu_xid_errors_increase", rule, t0) == 0.0
    assert s.value("gpu_ecc_uncorrected_increase", rule, t0) == 0.0
    assert s.value("gpu_throttle_reasons", rule, t0) == 1.0  # sw_power_cap is not in the list
    assert s.value("gpu_memory_used_ratio", rule, t0) == 0.9
    clock.t = t0 + 100
    s.observe_gpu(GpuHealth(timestamp=0, xid_errors=7, ecc_errors={"uncorrected": 2}))
    clock.t = t0 + 200
    s.observe_gpu(GpuHealth(timestamp=0, xid_errors=1, ecc_errors={"uncorrected": 3}))  # xid counter reset
    assert s.value("gpu_xid_errors_increase", rule, t0 + 200) == 3.0  # +2, then +1 after the reset
    assert s.value("gpu_ecc_uncorrected_increase", rule, t0 + 200) == 1.0
    assert s.value("gpu_xid_errors_increase", rule, t0 + 750) == 1.0  # the +2 at t0+100 left the window
    assert s.value("gpu_xid_errors_increase", rule, t0 + 850) == 0.0
    assert s.value("gpu_memory_used_ratio", rule, t0) is None  # latest sample has no memory figures
