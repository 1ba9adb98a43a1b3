"""The hardware cross-check of MFU: in-process signal values against a hand computation, and the NVML field."""

import pytest

from mfuwatch.agent.schema import GpuHealth, StepMeasurement
from mfuwatch.alerts.signals import MeasurementStore


def _step(mfu):
    return StepMeasurement(step=10, steps=10, timestamp=0.0, step_time_seconds=1.0, tokens=1, tokens_per_second=1.0,
                           model_flops=1.0, hardware_flops=1.0, model_flops_per_second=1.0, mfu=mfu)


def test_excess_and_fraction_follow_tensor_activity_and_clock():
    st = MeasurementStore(clock=lambda: 0.0)
    assert st.value("mfu_tensor_active_excess", {}, 0.0) is None  # nothing yet
    st.observe_step(_step(0.5))
    st.observe_gpu(GpuHealth(timestamp=0.0, tensor_active=0.4, sm_clock_hertz=1800e6, sm_clock_max_hertz=1980e6))
    bound = 0.4 * 1800 / 1980
    assert st.value("mfu_tensor_active_excess", {}, 0.0) == pytest.approx(0.5 - bound)
    assert st.value("mfu_tensor_active_fraction", {}, 0.0) == pytest.approx(0.5 / bound)
    # no GPM (older GPU) or no max clock: no value, so the rules never fire on missing data
    st.observe_gpu(GpuHealth(timestamp=1.0, tensor_active=None, sm_clock_hertz=1800e6, sm_clock_max_hertz=1980e6))
    assert st.value("mfu_tensor_active_excess", {}, 0.0) is None
    st.observe_gpu(GpuHealth(timestamp=2.0, tensor_active=0.0, sm_clock_hertz=1800e6, sm_clock_max_hertz=1980e6))
    assert st.value("mfu_tensor_active_fraction", {}, 0.0) is None  # idle tensor cores: no ratio


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
