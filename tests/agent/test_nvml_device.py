"""Tests for mfuwatch.agent.device.nvml_device: device mapping, clock-event decoding, GPM ratios."""

from __future__ import annotations

import pynvml
import pytest

from mfuwatch.agent.device import nvml_device
from mfuwatch.agent.device.nvml_device import (GpmReader, decode_clock_event_reasons, gpm_ratios, normalize_uuid,
                                        nvml_index_for_torch_device, read_gpm)
from tests.helpers.fake_nvml import FakeNvml, make_gpus


def test_decode_clock_event_reasons_against_pynvml_constants():
    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    reasons = decode_clock_event_reasons(pynvml, mask)
    assert {k for k, v in reasons.items() if v} == {"sw_power_cap", "hw_thermal_slowdown"}
    assert len(reasons) == 9
    everything = decode_clock_event_reasons(pynvml, pynvml.nvmlClocksEventReasonAll)
    assert all(everything.values())
    assert not any(decode_clock_event_reasons(pynvml, pynvml.nvmlClocksEventReasonNone).values())
    # Each name decodes exactly its own bit.
    for name, const, _, _ in nvml_device.CLOCK_EVENT_REASONS:
        got = decode_clock_event_reasons(pynvml, getattr(pynvml, const))
        assert [k for k, v in got.items() if v] == [name]


def test_decode_uses_old_throttle_names_when_new_ones_are_missing():
    class OldModule:
        nvmlClocksThrottleReasonGpuIdle = 0x1
        nvmlClocksThrottleReasonSyncBoost = 0x10

    reasons = decode_clock_event_reasons(OldModule, 0x11)
    assert reasons["gpu_idle"] and reasons["sync_boost"] and not reasons["sw_power_cap"]


@pytest.mark.parametrize("raw,norm", [
    ("GPU-3F2A1B00-aaaa-bbbb-cccc-0123456789ab", "3f2a1b00aaaabbbbcccc0123456789ab"),
    ("3f2a1b00-aaaa-bbbb-cccc-0123456789ab", "3f2a1b00aaaabbbbcccc0123456789ab"),
    (b"GPU-3f2a1b00-aaaa-bbbb-cccc-0123456789ab", "3f2a1b00aaaabbbbcccc0123456789ab"),
])
def test_normalize_uuid(raw, norm):
    assert normalize_uuid(raw) == norm


def test_uuid_mapping_with_visible_devices_reordered():
    fake = FakeNvml(make_gpus(4))
    # CUDA_VISIBLE_DEVICES=2,0,3: torch's cuda:0 is physical GPU 2, cuda:2 is GPU 3.
    # torch reports UUIDs without the "GPU-" prefix.
    for torch_index, physical in [(0, 2), (1, 0), (2, 3)]:
        torch_uuid = fake.gpus[physical].uuid[len("GPU-"):]
        assert nvml_index_for_torch_device(fake, torch_index, torch_uuid=torch_uuid,
                                           visible_devices="2,0,3") == physical
    assert nvml_index_for_torch_device(fake, 0, torch_uuid="ffffffff-0000-0000-0000-000000000000") is None


def test_visible_devices_fallback_without_torch_uuid():
    fake = FakeNvml(make_gpus(4))
    visible = f"3,{fake.gpus[1].uuid[:9]}"  # an index, then a UUID prefix ("GPU-1111a")
    assert nvml_index_for_torch_device(fake, 0, visible_devices=visible) == 3
    assert nvml_index_for_torch_device(fake, 1, visible_devices=visible) == 1
    assert nvml_index_for_torch_device(fake, 2, visible_devices=visible) is None  # beyond the list
    assert nvml_index_for_torch_device(fake, 0, visible_devices="GPU-") is None  # prefix matches all 4
    assert nvml_index_for_torch_device(fake, 0, visible_devices="7") is None  # no such GPU
    assert nvml_index_for_torch_device(fake, 2) == 2  # no variable: same index
    assert nvml_index_for_torch_device(fake, 4) is None


def _advance(gpu, seconds, sm, tensor, dram):
    gpu.gpm_clock_seconds += seconds
    gpu.gpm_busy_seconds["sm"] += sm
    gpu.gpm_busy_seconds["tensor"] += tensor
    gpu.gpm_busy_seconds["dram"] += dram


def test_gpm_reader_ratios_from_two_samples():
    fake = FakeNvml(make_gpus(1))
    gpu, handle = fake.gpus[0], fake.nvmlDeviceGetHandleByIndex(0)
    reader = GpmReader(fake, handle)
    assert reader.read() is None  # one sample: no interval yet
    _advance(gpu, 2.0, sm=1.8, tensor=1.5, dram=0.4)
    assert reader.read() == pytest.approx({"sm_active": 0.9, "tensor_active": 0.75, "dram_active": 0.2})
    _advance(gpu, 1.0, sm=0.1, tensor=0.0, dram=0.05)  # the next interval only, not cumulative
    assert reader.read() == pytest.approx({"sm_active": 0.1, "tensor_active": 0.0, "dram_active": 0.05})
    reader.close()
    assert fake.live_gpm_samples == set()


def test_read_gpm_failed_metric_is_none_and_percent_is_clamped():
    fake = FakeNvml(make_gpus(1))
    gpu, handle = fake.gpus[0], fake.nvmlDeviceGetHandleByIndex(0)
    gpu.gpm_failed_metrics.add(pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL)
    s1 = fake.nvmlGpmSampleGet(handle, fake.nvmlGpmSampleAlloc())
    _advance(gpu, 1.0, sm=1.02, tensor=0.5, dram=0.5)  # 102 %: counter jitter
    s2 = fake.nvmlGpmSampleGet(handle, fake.nvmlGpmSampleAlloc())
    assert read_gpm(fake, s1, s2) == {"sm_active": 1.0, "tensor_active": 0.5, "dram_active": None}


def test_gpm_ratios_over_an_interval_with_workload(monkeypatch):
    fake = FakeNvml(make_gpus(2))
    monkeypatch.setattr(nvml_device, "_torch_uuid", lambda index: fake.gpus[1].uuid)
    calls = []

    def workload():  # each call: 0.25 s of GPM time, 0.2 s tensor-busy
        calls.append(1)
        _advance(fake.gpus[1], 0.25, sm=0.25, tensor=0.2, dram=0.1)

    ratios = gpm_ratios("cuda:0", seconds=0.05, workload=workload, nvml=fake)
    assert calls
    assert ratios == pytest.approx({"sm_active": 1.0, "tensor_active": 0.8, "dram_active": 0.4})
    assert fake.initialised == 0 and fake.live_gpm_samples == set()


def test_gpm_ratios_raises_without_gpm(monkeypatch):
    fake = FakeNvml(make_gpus(1))
    fake.gpus[0].gpm_supported = False
    monkeypatch.setattr(nvml_device, "_torch_uuid", lambda index: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RuntimeError, match="GPM"):
        gpm_ratios(0, seconds=0.0, nvml=fake)
    assert fake.initialised == 0
