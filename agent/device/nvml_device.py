"""NVML primitives for the sampler: find the torch device's NVML handle, decode, GPM.

* :func:`nvml_index_for_torch_device` maps ``cuda:N`` (after ``CUDA_VISIBLE_DEVICES``) to its
  NVML index by UUID; :func:`open_nvml` initialises NVML and returns the handle.
* :func:`decode_clock_event_reasons` turns the clock-event (throttle) bitmask into names.
* :func:`read_gpm`, :class:`GpmReader` and :func:`gpm_ratios` compute GPM (GPU Performance
  Monitoring, Hopper and later) SM / tensor / DRAM activity between two samples, following
  the NVML API reference: ``nvmlGpmSampleAlloc``, ``nvmlGpmSampleGet`` twice, then
  ``nvmlGpmMetricsGet`` with a ``nvmlGpmMetricsGet_t`` naming the metrics.

Every function takes the NVML module as an argument (pynvml, or a stand-in in tests).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

#: (GpuHealth.clock_event_reasons key, pynvml constant, its pre-12.x name, bit of nvml.h).
CLOCK_EVENT_REASONS: Tuple[Tuple[str, str, str, int], ...] = (
    ("gpu_idle", "nvmlClocksEventReasonGpuIdle", "nvmlClocksThrottleReasonGpuIdle", 0x1),
    ("applications_clocks_setting", "nvmlClocksEventReasonApplicationsClocksSetting",
     "nvmlClocksThrottleReasonApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "nvmlClocksEventReasonSwPowerCap", "nvmlClocksThrottleReasonSwPowerCap", 0x4),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown", "nvmlClocksThrottleReasonHwSlowdown", 0x8),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost", "nvmlClocksThrottleReasonSyncBoost", 0x10),
    ("sw_thermal_slowdown", "nvmlClocksEventReasonSwThermalSlowdown",
     "nvmlClocksThrottleReasonSwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "nvmlClocksEventReasonHwThermalSlowdown",
     "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "nvmlClocksEventReasonHwPowerBrakeSlowdown",
     "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "nvmlClocksEventReasonDisplayClockSetting",
     "nvmlClocksThrottleReasonDisplayClockSetting", 0x100),
)

#: (GpuHealth field, pynvml GPM metric constant, its value in nvml.h). NVML reports percent.
GPM_METRICS: Tuple[Tuple[str, str, int], ...] = (
    ("sm_active", "NVML_GPM_METRIC_SM_UTIL", 2),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL", 10),
)

_PERMANENT = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission",
              "NVMLError_ArgumentVersionMismatch")


def text(value: Any) -> str:
    """NVML strings are ``bytes`` in old pynvml releases and ``str`` in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def is_error(nvml: Any, exc: BaseException, names: Sequence[str]) -> bool:
    """Whether ``exc`` is one of the module's error classes ``names`` (e.g. ``NVMLError_Timeout``)."""
    classes = tuple(c for c in (getattr(nvml, n, None) for n in names) if isinstance(c, type))
    return bool(classes) and isinstance(exc, classes)


def is_permanent(nvml: Any, exc: BaseException) -> bool:
    """Errors a retry will not fix: the driver or GPU lacks the query, or we may not ask."""
    return (isinstance(exc, (AttributeError, NotImplementedError)) or is_error(nvml, exc, _PERMANENT)
            or type(exc).__name__ == "NVMLLibraryMismatchError")


def decode_clock_event_reasons(nvml: Any, mask: int) -> Dict[str, bool]:
    """Decode ``nvmlDeviceGetCurrentClocksEventReasons`` into named booleans.

    Bits come from the pynvml constants (``nvmlClocksEventReason*``, else the older
    ``nvmlClocksThrottleReason*``), falling back to the values of nvml.h.
    """
    out = {}
    for key, name, old_name, bit in CLOCK_EVENT_REASONS:
        value = getattr(nvml, name, getattr(nvml, old_name, bit))
        out[key] = bool(int(mask) & int(value))
    return out


def normalize_uuid(uuid: Any) -> str:
    """``"GPU-3f2a-..."`` / ``"3F2A..."`` -> lower-case hex without prefix and dashes."""
    s = text(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if s.startswith(prefix):
            s = s[len(prefix):]
    return s.replace("-", "")


def _torch_uuid(index: int) -> Optional[str]:
    """UUID of a CUDA device as torch sees it (after CUDA_VISIBLE_DEVICES), or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return None if uuid is None else str(uuid)
    except Exception:  # noqa: BLE001 - old torch, no driver: fall back to CUDA_VISIBLE_DEVICES
        return None


def nvml_index_for_torch_device(nvml: Any, torch_index: int, *, torch_uuid: Optional[str] = None,
                                visible_devices: Optional[str] = None) -> Optional[int]:
    """NVML index of the GPU torch calls ``cuda:<torch_index>``; None when none matches.

    By UUID when torch reports one (exact after :func:`normalize_uuid`). Otherwise the
    ``torch_index``-th entry of ``visible_devices`` (``CUDA_VISIBLE_DEVICES``): a UUID or
    unique UUID prefix, or an index, which is right when CUDA enumerates in PCI order as
    NVML does (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or a node of identical GPUs). No UUID and
    no variable: ``torch_index`` itself.
    """
    count = int(nvml.nvmlDeviceGetCount())
    uuids = [normalize_uuid(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
    if torch_uuid:
        wanted = normalize_uuid(torch_uuid)
        return uuids.index(wanted) if wanted in uuids else None
    if visible_devices is not None and visible_devices.strip():
        entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
        if torch_index >= len(entries):
            return None
        entry = entries[torch_index]
        if entry.isdigit():
            return int(entry) if int(entry) < count else None
        prefix = normalize_uuid(entry)
        hits = [i for i, u in enumerate(uuids) if prefix and u.startswith(prefix)]
        return hits[0] if len(hits) == 1 else None
    return torch_index if 0 <= torch_index < count else None


def percent_to_ratio(percent: Optional[float]) -> Optional[float]:
    """NVML percent (0..100) -> ratio clamped to 0..1; NaN or None -> None."""
    if percent is None or math.isnan(percent):
        return None
    return min(max(float(percent) / 100.0, 0.0), 1.0)


def read_gpm(nvml: Any, sample1: Any, sample2: Any,
             metrics: Sequence[Tuple[str, str, int]] = GPM_METRICS) -> Dict[str, Optional[float]]:
    """GPM ratios (0..1) between two ``nvmlGpmSampleGet`` samples, one per metric key.

    A metric NVML could not compute (its ``nvmlReturn`` is not success) is ``None``;
    percentages are clamped to 0..100. Raises the NVMLError of ``nvmlGpmMetricsGet``.
    """
    mg = nvml.c_nvmlGpmMetricsGet_t()
    mg.version = nvml.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = len(metrics)
    mg.sample1, mg.sample2 = sample1, sample2
    for i, (_, name, default) in enumerate(metrics):
        mg.metrics[i].metricId = getattr(nvml, name, default)
    nvml.nvmlGpmMetricsGet(mg)
    ok = getattr(nvml, "NVML_SUCCESS", 0)
    return {key: (percent_to_ratio(mg.metrics[i].value) if mg.metrics[i].nvmlReturn == ok else None)
            for i, (key, _, _) in enumerate(metrics)}


class GpmReader:
    """Two GPM sample buffers; each :meth:`read` returns the ratios since the previous one."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nv, self._handle = nvml, handle
        self._prev = nvml.nvmlGpmSampleAlloc()
        try:
            self._cur = nvml.nvmlGpmSampleAlloc()
        except Exception:
            nvml.nvmlGpmSampleFree(self._prev)
            raise
        self._have_prev = False

    def read(self) -> Optional[Dict[str, Optional[float]]]:
        """Take a sample; the ratios since the last one, or None on the first call."""
        self._nv.nvmlGpmSampleGet(self._handle, self._cur)
        out = read_gpm(self._nv, self._prev, self._cur) if self._have_prev else None
        self._prev, self._cur, self._have_prev = self._cur, self._prev, True
        return out

    def close(self) -> None:
        for s in (self._prev, self._cur):
            try:
                self._nv.nvmlGpmSampleFree(s)
            except Exception:  # noqa: BLE001 - freeing at shutdown
                pass


def _cuda_index(torch_device: Any) -> Optional[int]:
    """``cuda:1`` / torch.device / 1 -> 1; ``cuda`` -> torch's current device; else None."""
    if isinstance(torch_device, int):
        return torch_device
    kind, index = getattr(torch_device, "type", None), getattr(torch_device, "index", None)
    if kind is None:
        kind, _, rest = str(torch_device).partition(":")
        index = int(rest) if rest.isdigit() else None
    if kind != "cuda":
        return None
    if index is None:
        try:
            import torch

            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        except Exception:  # noqa: BLE001
            index = 0
    return index


def open_nvml(torch_device: Any, nvml: Any) -> Tuple[Any, Any, int]:
    """Import and initialise NVML and find the device. Raises RuntimeError saying why not."""
    index = _cuda_index(torch_device)
    if index is None:
        raise RuntimeError(f"device {torch_device} is not a CUDA GPU")
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            raise RuntimeError("the pynvml module is missing (pip install nvidia-ml-py)") from exc
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - library or driver missing
        raise RuntimeError(f"NVML did not initialise ({exc})") from exc
    try:
        nvml_index = nvml_index_for_torch_device(nvml, index, torch_uuid=_torch_uuid(index),
                                                 visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
        if nvml_index is None:
            raise RuntimeError(f"no NVML device matches cuda:{index}")
        return nvml, nvml.nvmlDeviceGetHandleByIndex(nvml_index), nvml_index
    except Exception as exc:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        if isinstance(exc, RuntimeError):
            raise
        raise RuntimeError(f"NVML device lookup failed ({exc})") from exc


def gpm_ratios(torch_device: Any = 0, seconds: float = 1.0, *, workload: Optional[Callable[[], Any]] = None,
               nvml: Any = None) -> Dict[str, Optional[float]]:
    """GPM SM / tensor / DRAM activity (0..1) of one GPU over ``seconds``.

    Calls ``workload()`` repeatedly during the interval when given (it should synchronize
    the device itself), else sleeps. For validation scripts, not the training loop. Raises
    RuntimeError when NVML is missing or the GPU has no GPM.
    """
    nvml, handle, _ = open_nvml(torch_device, nvml)
    try:
        support = nvml.nvmlGpmQueryDeviceSupport(handle)
        if not getattr(support, "isSupportedDevice", 0):
            raise RuntimeError("this GPU has no GPM (NVML GPU Performance Monitoring needs Hopper or later)")
        reader = GpmReader(nvml, handle)
        try:
            reader.read()
            t_end = time.monotonic() + seconds
            if workload is None:
                time.sleep(seconds)
            while workload is not None and time.monotonic() < t_end:
                workload()
            return reader.read() or {}
        finally:
            reader.close()
    finally:
        nvml.nvmlShutdown()
