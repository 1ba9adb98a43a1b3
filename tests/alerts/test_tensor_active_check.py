"""The hardware cross-check of MFU: in-process signal values against a hand computation, and the NVML field."""

import pytest

from mfuwatch.agent.schema import GpuHealth, StepMeasurement
from mfuwatch.alerts.signals import MeasurementStore


def _step(mfu, bound=None, step_time=1.0):
    return StepMeasurement(step=10, steps=10, timestamp=0.0, step_time_seconds=step_time, tokens=1,
                           tokens_per_second=1.0, model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0,
                           mfu=mfu, tensor_active_bound=bound)


def test_excess_and_fraction_compare_the_report_with_its_own_interval():
    now = [0.0]
    st = MeasurementStore(clock=lambda: now[0])
    assert st.value("mfu_tensor_active_excess", {}, 0.0) is None  # nothing yet
    bound = 0.4 * 1800 / 1980
    st.observe_step(_step(0.5, bound))
    assert st.value("mfu_tensor_active_excess", {}, 0.0) == pytest.approx(0.5 - bound)
    assert st.value("mfu_tensor_active_fraction", {}, 0.0) == pytest.approx(0.5 / bound)
    # the latest NVML sample plays no part: an idle GPU one second later leaves the report's comparison alone
    st.observe_gpu(GpuHealth(timestamp=1.0, tensor_active=0.0, sm_clock_hertz=1800e6, sm_clock_max_hertz=1980e6))
    assert st.value("mfu_tensor_active_excess", {}, 1.0) == pytest.approx(0.5 - bound)
    # stale: 60 s (3 step times would be 3 s) after the last step there is no comparison
    assert st.value("mfu_tensor_active_excess", {}, 59.9) is not None
    assert st.value("mfu_tensor_active_excess", {}, 60.0) is None
    # a phase open: none either
    st.pause_stall()
    assert st.value("mfu_tensor_active_excess", {}, 1.0) is None
    st.resume_stall()
    # no GPM average for the interval (older GPU, or a phase fell in it): no value, the rules never fire
    st.observe_step(_step(0.5, None))
    assert st.value("mfu_tensor_active_excess", {}, 1.0) is None
    st.observe_step(_step(0.5, 0.0))
    assert st.value("mfu_tensor_active_fraction", {}, 1.0) is None  # idle tensor cores: no ratio
    # slow steps (100 s each): fresh for three step times
    st.observe_step(_step(0.5, bound, step_time=100.0))
    assert st.value("mfu_tensor_active_excess", {}, 250.0) == pytest.approx(0.5 - bound)


def test_nvml_reports_the_max_sm_clock(monkeypatch):
    from mfuwatch.agent.device import nvml_device
    from mfuwatch.agent.device.nvml import NvmlSampler
    from tests.helpers.fake_nvml import FakeNvml, make_gpus

    monkeypatch.setattr(nvml_device, "_torch_uuid", lambda index: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml(make_gpus(1))
    fake.gpus[0].sm_clock_mhz, fake.gpus[0].sm_clock_max_mhz = 1500, 1980
    s = NvmlSampler(torch_device="cuda:0", on_sample=lambda h: None, on_error=lambda c, e: None, nvml=fake)
    assert s.open()
    h = s.sample()
    s.close()
    assert (h.sm_clock_hertz, h.sm_clock_max_hertz) == (1500e6, 1980e6)
