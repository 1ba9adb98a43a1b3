"""A stand-in for the ``pynvml`` module (nvidia-ml-py) with settable GPUs and failure injection.

Pass an instance where code expects the module: ``NvmlSampler(..., nvml=FakeNvml([...]))``.
Constants and error classes are the real ones from the installed pynvml (they are plain
Python and need no driver), so code under test sees the same values and exception types as
on a GPU machine. Device values are in NVML's own units (mW, MHz, mJ, percent, bytes).

    fake = FakeNvml(make_gpus(4))
    fake.gpus[0].power_mw = 312_500
    fake.fail("nvmlDeviceGetPowerUsage", fake.NVMLError_NotSupported)   # every call raises
    fake.remove("nvmlDeviceGetTemperatureV")                            # an older pynvml
    fake.gpus[0].gpm_busy_seconds["tensor"] += 0.5; fake.gpus[0].gpm_clock_seconds += 2.0
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import pynvml as _real

# GPM metric id -> key of FakeGpu.gpm_busy_seconds
_GPM_KEYS = {_real.NVML_GPM_METRIC_SM_UTIL: "sm", _real.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor",
             _real.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram"}


@dataclass
class FakeGpu:
    """One GPU as NVML reports it (raw NVML units)."""

    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_device_id: int = 0x233510DE  # NVML's 32-bit form: device id << 16 | vendor 0x10de
    util_gpu: int = 0  # percent
    util_memory: int = 0  # percent
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    power_mw: int = 100_000
    power_limit_mw: int = 700_000
    temperature_c: int = 40
    memory_used: int = 0
    memory_total: int = 150_754_820_096
    energy_mj: int = 0
    clock_event_mask: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    gpm_supported: bool = True
    gpm_clock_seconds: float = 0.0  # GPM time base; advance it together with the busy times
    gpm_busy_seconds: Dict[str, float] = field(default_factory=lambda: {"sm": 0.0, "tensor": 0.0, "dram": 0.0})
    gpm_failed_metrics: set = field(default_factory=set)  # metric ids whose nvmlReturn is NotSupported
    xid_queue: collections.deque = field(default_factory=collections.deque)  # pending Xid codes


def make_gpus(n: int, name: str = "NVIDIA H200") -> List[FakeGpu]:
    """``n`` GPUs with distinct UUIDs ``GPU-<i>...`` and PCI device id of an H200."""
    return [FakeGpu(name=name, uuid=f"GPU-{i}{i}{i}{i}aaaa-bbbb-cccc-dddd-{i:012d}") for i in range(n)]


class _Handle(SimpleNamespace):
    pass


class _MetricsGet:
    """Python version of ``c_nvmlGpmMetricsGet_t`` (fields as pynvml's ctypes struct)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1 = self.sample2 = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(16)]


class FakeNvml:
    """The pynvml functions the agent uses, over a list of :class:`FakeGpu`."""

    c_nvmlGpmMetricsGet_t = _MetricsGet

    def __init__(self, gpus: Optional[List[FakeGpu]] = None) -> None:
        for name in dir(_real):  # constants and NVMLError classes of the real module
            value = getattr(_real, name)
            if (name.startswith(("NVML_", "nvmlClocks", "nvmlEventType")) and isinstance(value, int)) or (
                    name.startswith("NVMLError") and isinstance(value, type)):
                object.__setattr__(self, name, value)
        self.gpus = list(gpus) if gpus is not None else make_gpus(1)
        self.calls: collections.Counter = collections.Counter()
        self.initialised = 0  # nvmlInit minus nvmlShutdown
        self.live_gpm_samples: set = set()
        self.live_event_sets: set = set()
        self._failures: Dict[str, List[Any]] = {}  # function -> [error, remaining calls or None]
        self._removed: set = set()
        self._next_id = 0

    # -------------------------------------------------------------- injection
    def fail(self, function: str, error: Any, times: Optional[int] = None) -> None:
        """Make ``function`` raise ``error`` (class or instance) on every call, or the next ``times``."""
        self._failures[function] = [error, times]

    def heal(self, function: str) -> None:
        self._failures.pop(function, None)

    def remove(self, function: str) -> None:
        """Make ``function`` absent, like an older pynvml without it."""
        self._removed.add(function)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "_removed"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _enter(self, function: str) -> None:
        self.calls[function] += 1
        failure = self._failures.get(function)
        if failure is None:
            return
        error, times = failure
        if times is not None:
            failure[1] = times - 1
            if failure[1] <= 0:
                self.heal(function)
        raise error() if isinstance(error, type) else error

    def _gpu(self, handle: _Handle) -> FakeGpu:
        return self.gpus[handle.index]

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -------------------------------------------------------------- library and devices
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        if self.initialised <= 0:
            raise self.NVMLError_Uninitialized()
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise self.NVMLError_InvalidArgument()
        return _Handle(index=index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetUUID")
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetPciInfo")
        return SimpleNamespace(pciDeviceId=self._gpu(handle).pci_device_id, busId=f"00000000:{handle.index:02X}:00.0")

    # -------------------------------------------------------------- readings
    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates")
        g = self._gpu(handle)
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_memory)

    def nvmlDeviceGetMaxClockInfo(self, handle: _Handle, clock_type: int) -> int:
        self._enter("nvmlDeviceGetMaxClockInfo")
        if clock_type != self.NVML_CLOCK_SM:
            raise self.NVMLError_InvalidArgument()
        return self._gpu(handle).sm_clock_max_mhz

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        self._enter("nvmlDeviceGetClockInfo")
        if clock_type != self.NVML_CLOCK_SM:
            raise self.NVMLError_InvalidArgument()
        return self._gpu(handle).sm_clock_mhz

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetPowerUsage")
        return self._gpu(handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetEnforcedPowerLimit")
        return self._gpu(handle).power_limit_mw

    def nvmlDeviceGetTemperatureV(self, handle: _Handle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperatureV")
        return self._gpu(handle).temperature_c

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature")
        return self._gpu(handle).temperature_c

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo")
        g = self._gpu(handle)
        return SimpleNamespace(used=g.memory_used, total=g.memory_total, free=g.memory_total - g.memory_used)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetTotalEnergyConsumption")
        return self._gpu(handle).energy_mj

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons")
        return self._gpu(handle).clock_event_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksThrottleReasons")
        return self._gpu(handle).clock_event_mask

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter_type: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors")
        g = self._gpu(handle)
        return g.ecc_corrected if error_type == self.NVML_MEMORY_ERROR_TYPE_CORRECTED else g.ecc_uncorrected

    # -------------------------------------------------------------- events (Xid)
    def nvmlEventSetCreate(self) -> SimpleNamespace:
        self._enter("nvmlEventSetCreate")
        es = SimpleNamespace(id=self._new_id(), handles=[])
        self.live_event_sets.add(es.id)
        return es

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: SimpleNamespace) -> None:
        self._enter("nvmlDeviceRegisterEvents")
        if event_types & self.nvmlEventTypeXidCriticalError:
            event_set.handles.append(handle)

    def nvmlEventSetWait(self, event_set: SimpleNamespace, timeout_ms: int) -> SimpleNamespace:
        self._enter("nvmlEventSetWait")
        for handle in event_set.handles:
            queue = self._gpu(handle).xid_queue
            if queue:
                return SimpleNamespace(device=handle, eventType=self.nvmlEventTypeXidCriticalError,
                                       eventData=queue.popleft(), gpuInstanceId=0, computeInstanceId=0)
        raise self.NVMLError_Timeout()

    def nvmlEventSetFree(self, event_set: SimpleNamespace) -> None:
        self._enter("nvmlEventSetFree")
        self.live_event_sets.discard(event_set.id)

    # -------------------------------------------------------------- GPM
    def nvmlGpmQueryDeviceSupport(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlGpmQueryDeviceSupport")
        return SimpleNamespace(version=1, isSupportedDevice=int(self._gpu(handle).gpm_supported))

    def nvmlGpmSampleAlloc(self) -> SimpleNamespace:
        self._enter("nvmlGpmSampleAlloc")
        sample = SimpleNamespace(id=self._new_id(), snapshot=None)
        self.live_gpm_samples.add(sample.id)
        return sample

    def nvmlGpmSampleFree(self, sample: SimpleNamespace) -> None:
        self._enter("nvmlGpmSampleFree")
        self.live_gpm_samples.discard(sample.id)

    def nvmlGpmSampleGet(self, handle: _Handle, sample: SimpleNamespace) -> SimpleNamespace:
        self._enter("nvmlGpmSampleGet")
        g = self._gpu(handle)
        sample.snapshot = (g, g.gpm_clock_seconds, dict(g.gpm_busy_seconds))
        return sample

    def nvmlGpmMetricsGet(self, mg: _MetricsGet) -> _MetricsGet:
        """Percent busy between the samples: 100 * d(busy seconds) / d(clock seconds)."""
        self._enter("nvmlGpmMetricsGet")
        if mg.version != self.NVML_GPM_METRICS_GET_VERSION or mg.sample1.snapshot is None \
                or mg.sample2.snapshot is None:
            raise self.NVMLError_InvalidArgument()
        gpu, t1, busy1 = mg.sample1.snapshot
        _, t2, busy2 = mg.sample2.snapshot
        if t2 < t1:  # samples passed in the wrong order
            raise self.NVMLError_InvalidArgument()
        for m in mg.metrics[:mg.numMetrics]:
            key = _GPM_KEYS.get(m.metricId)
            if key is None or m.metricId in gpu.gpm_failed_metrics:
                m.nvmlReturn, m.value = self.NVML_ERROR_NOT_SUPPORTED, 0.0
            else:  # a test that did not advance the clock sees an idle GPU
                busy = busy2[key] - busy1[key]
                m.nvmlReturn, m.value = self.NVML_SUCCESS, 100.0 * busy / (t2 - t1) if t2 > t1 else 0.0
        return mg
