"""Tests for mfuwatch.agent.device.nvml.NvmlSampler against the fake NVML of tests/helpers."""

from __future__ import annotations

import logging
import sys
import threading

import pynvml
import pytest

from mfuwatch.agent.device import nvml_device
from mfuwatch.agent.device.nvml import NvmlSampler
from mfuwatch.agent.schema import GpuHealth
from tests.helpers.fake_nvml import FakeNvml, make_gpus


class Recorder:
    """on_sample / on_error sinks that remember what they got."""

    def __init__(self):
        self.samples, self.errors = [], []
        self.got_two = threading.Event()

    def on_sample(self, health):
        self.samples.append(health)
        if len(self.samples) >= 2:
            self.got_two.set()

    def on_error(self, component, exc):
        self.errors.append((component, exc))


@pytest.fixture
def no_torch_uuid(monkeypatch):
    """No CUDA in the test process: map devices through CUDA_VISIBLE_DEVICES / the index."""
    monkeypatch.setattr(nvml_device, "_torch_uuid", lambda index: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _sampler(fake, rec, device="cuda:0", interval=1.0):
    return NvmlSampler(torch_device=device, interval_seconds=interval, on_sample=rec.on_sample,
                       on_error=rec.on_error, nvml=fake)


def test_values_arrive_in_base_units(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    g = fake.gpus[0]
    g.util_gpu, g.util_memory, g.sm_clock_mhz = 87, 41, 1755
    g.power_mw, g.power_limit_mw, g.temperature_c = 612_345, 700_000, 63
    g.memory_used, g.memory_total, g.energy_mj = 70_000_000_000, 150_754_820_096, 9_876_543_210
    g.clock_event_mask = pynvml.nvmlClocksEventReasonSwPowerCap
    g.ecc_corrected, g.ecc_uncorrected = 5, 1
    rec = Recorder()
    s = _sampler(fake, rec)
    assert s.open() and s.available
    assert (s.gpu_name, s.pci_device_id, s.nvml_index) == ("NVIDIA H200", 0x2335, 0)
    h = s.sample()
    assert isinstance(h, GpuHealth) and s.latest is h
    assert h.utilization == pytest.approx(0.87) and h.memory_bandwidth_utilization == pytest.approx(0.41)
    assert h.sm_clock_hertz == pytest.approx(1.755e9)
    assert h.power_watts == pytest.approx(612.345) and h.power_limit_watts == pytest.approx(700.0)
    assert h.temperature_celsius == 63.0
    assert h.memory_used_bytes == 70e9 and h.memory_total_bytes == 150_754_820_096
    assert h.energy_joules == pytest.approx(9_876_543.21)
    assert h.clock_event_reasons["sw_power_cap"] is True
    assert sum(h.clock_event_reasons.values()) == 1
    assert h.ecc_errors == {"corrected": 5, "uncorrected": 1}
    assert h.xid_errors == 0
    assert (h.sm_active, h.tensor_active, h.dram_active) == (None, None, None)  # first GPM sample
    assert rec.errors == []
    s.close()
    assert fake.initialised == 0 and fake.live_gpm_samples == set() and fake.live_event_sets == set()


def test_gpm_ratios_from_consecutive_samples(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    g = fake.gpus[0]
    rec = Recorder()
    s = _sampler(fake, rec)
    s.open()
    s.sample()
    g.gpm_clock_seconds += 1.0
    g.gpm_busy_seconds.update(sm=0.9, tensor=0.6, dram=0.3)
    h = s.sample()
    assert (h.sm_active, h.tensor_active, h.dram_active) == pytest.approx((0.9, 0.6, 0.3))
    s.close()


def test_not_supported_field_is_none_and_reported_once(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    fake.fail("nvmlDeviceGetPowerUsage", fake.NVMLError_NotSupported)
    fake.fail("nvmlDeviceGetTotalEccErrors", fake.NVMLError_NotSupported)
    rec = Recorder()
    s = _sampler(fake, rec)
    s.open()
    for _ in range(3):
        h = s.sample()
        assert h.power_watts is None and h.ecc_errors == {}
        assert h.power_limit_watts == 700.0 and h.temperature_celsius == 40.0  # the others still read
    assert sorted(c for c, _ in rec.errors) == ["nvml.ecc", "nvml.power"]
    assert all(isinstance(e, pynvml.NVMLError_NotSupported) for _, e in rec.errors)
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1  # switched off, not asked again
    s.close()


def test_transient_error_is_reported_each_time_and_the_field_recovers(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    fake.fail("nvmlDeviceGetClockInfo", fake.NVMLError_Unknown, times=2)
    rec = Recorder()
    s = _sampler(fake, rec)
    s.open()
    assert s.sample().sm_clock_hertz is None
    assert s.sample().sm_clock_hertz is None
    assert s.sample().sm_clock_hertz == pytest.approx(1.98e9)
    assert [c for c, _ in rec.errors] == ["nvml.sm_clock", "nvml.sm_clock"]
    s.close()


def test_older_module_without_new_functions_falls_back(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    fake.remove("nvmlDeviceGetTemperatureV")
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", fake.NVMLError_FunctionNotFound)  # old driver
    fake.gpus[0].clock_event_mask = pynvml.nvmlClocksThrottleReasonHwSlowdown
    rec = Recorder()
    s = _sampler(fake, rec)
    s.open()
    for _ in range(2):
        h = s.sample()
        assert h.temperature_celsius == 40.0 and h.clock_event_reasons["hw_slowdown"] is True
    assert rec.errors == []
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1  # the fallback is remembered
    s.close()


def test_xid_events_are_counted(no_torch_uuid, caplog):
    fake = FakeNvml(make_gpus(1))
    rec = Recorder()
    s = _sampler(fake, rec)
    s.open()
    assert s.sample().xid_errors == 0
    fake.gpus[0].xid_queue.extend([79, 48])
    caplog.set_level(logging.WARNING, logger="mfuwatch.agent.device.nvml")
    assert s.sample().xid_errors == 2 and s.last_xid == 48
    assert s.sample().xid_errors == 2
    assert sum("Xid 79" in r.getMessage() for r in caplog.records) == 1
    s.close()


def test_xid_registration_unsupported_counts_nothing_and_notes_once(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    fake.fail("nvmlDeviceRegisterEvents", fake.NVMLError_NotSupported)
    rec = Recorder()
    s = _sampler(fake, rec)
    s.open()
    fake.gpus[0].xid_queue.append(31)
    assert [s.sample().xid_errors for _ in range(2)] == [0, 0]
    assert [c for c, _ in rec.errors] == ["nvml.xid"]
    assert fake.calls["nvmlEventSetWait"] == 0
    s.close()
    assert fake.live_event_sets == set()


def test_uuid_mapping_picks_the_visible_device(monkeypatch):
    fake = FakeNvml(make_gpus(4))
    for i, g in enumerate(fake.gpus):
        g.power_mw = (i + 1) * 100_000
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    # torch's cuda:1 is physical GPU 1; torch reports the UUID without "GPU-".
    monkeypatch.setattr(nvml_device, "_torch_uuid", lambda index: fake.gpus[[3, 1][index]].uuid[4:])
    rec = Recorder()
    s = _sampler(fake, rec, device="cuda:1")
    s.open()
    assert s.nvml_index == 1 and s.sample().power_watts == 200.0
    s.close()
    monkeypatch.setattr(nvml_device, "_torch_uuid", lambda index: None)  # no UUID: use the variable
    s = _sampler(fake, rec, device="cuda:0")
    s.open()
    assert s.nvml_index == 3 and s.sample().power_watts == 400.0
    s.close()


def test_nvml_library_missing_turns_the_sampler_off_with_one_info_line(no_torch_uuid, caplog):
    caplog.set_level(logging.INFO, logger="mfuwatch.agent.device.nvml")
    fake = FakeNvml(make_gpus(1))
    fake.fail("nvmlInit", fake.NVMLError_LibraryNotFound)
    rec = Recorder()
    s = _sampler(fake, rec)
    assert s.start() is False and s.start() is False
    assert s.available is False and s.latest is None and s._thread is None
    lines = [r for r in caplog.records if r.name == "mfuwatch.agent.device.nvml"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "NVML" in lines[0].getMessage()
    s.close()  # harmless
    assert rec.errors == [] and fake.calls["nvmlShutdown"] == 0


def test_pynvml_not_importable_turns_the_sampler_off(no_torch_uuid, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mfuwatch.agent.device.nvml")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    s = NvmlSampler(torch_device="cuda:0", on_sample=lambda h: None, on_error=lambda c, e: None)
    assert s.start() is False
    assert len(caplog.records) == 1 and "nvidia-ml-py" in caplog.records[0].getMessage()


def test_cpu_device_never_touches_nvml(caplog):
    caplog.set_level(logging.INFO, logger="mfuwatch.agent.device.nvml")
    fake = FakeNvml(make_gpus(1))
    s = _sampler(fake, Recorder(), device="cpu")
    assert s.start() is False and s.available is False
    assert sum(fake.calls.values()) == 0
    assert len(caplog.records) == 1 and "not a CUDA GPU" in caplog.records[0].getMessage()


def test_thread_samples_and_close_stops_it(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    rec = Recorder()
    s = _sampler(fake, rec, interval=0.01)
    assert s.start()
    assert rec.got_two.wait(timeout=10)
    thread = s._thread
    assert thread.name == "mfuwatch-nvml" and thread.daemon
    s.close()
    assert not thread.is_alive()
    n = len(rec.samples)
    assert fake.calls["nvmlDeviceGetPowerUsage"] == n  # nothing sampled after close
    assert fake.initialised == 0 and fake.live_gpm_samples == set()
    s.close()  # twice is fine
    assert fake.calls["nvmlShutdown"] == 1


def test_failing_callbacks_do_not_stop_the_thread(no_torch_uuid):
    fake = FakeNvml(make_gpus(1))
    seen, errors = [], []
    done = threading.Event()

    def on_sample(h):
        seen.append(h)
        if len(seen) >= 3:
            done.set()
        raise ValueError("consumer bug")

    def on_error(component, exc):
        errors.append(component)
        raise RuntimeError("the error sink is broken too")

    s = NvmlSampler(torch_device="cuda:0", interval_seconds=0.01, on_sample=on_sample, on_error=on_error,
                    nvml=fake)
    s.start()
    assert done.wait(timeout=10)
    s.close()
    assert set(errors) == {"nvml.on_sample"} and len(errors) >= 3


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_seconds"):
        NvmlSampler(torch_device="cuda:0", interval_seconds=0, on_sample=print, on_error=print)
