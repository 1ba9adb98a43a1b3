"""NVML sampler: GPU health of the training GPU, read on the agent's own thread (default 1 Hz).

Each tick reads utilization, SM clock, power and its limit, temperature, memory used/total,
energy, clock-event (throttle) reasons, ECC counts, Xid events, and, where the GPU has GPM
(Hopper and later: ``nvmlGpmQueryDeviceSupport``), the SM / tensor / DRAM activity between
this tick and the last (``nvmlGpmMetricsGet`` over two ``nvmlGpmSampleGet`` samples). Values
go out as a :class:`~mfuwatch.agent.schema.GpuHealth` in base units. The tensor-active ratio
is the hardware's own view of how busy the tensor cores were: export it beside MFU.

Every field is read on its own: an NVML error for one field leaves it ``None``; errors that
will not go away (NotSupported, FunctionNotFound, NoPermission) switch the field off and are
reported once through ``on_error("nvml.<field>", exc)``, others are reported each time.
Nothing here ever raises into the training loop. No GPU or no NVML: the sampler is off, with
one info line. The torch device is mapped to its NVML device by UUID, so
``CUDA_VISIBLE_DEVICES`` reordering is respected. Usage::

    s = NvmlSampler(torch_device="cuda:0", on_sample=print, on_error=lambda c, e: None)
    s.start(); ...; s.latest; s.close()
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

from .nvml_device import (CLOCK_EVENT_REASONS, GPM_METRICS, GpmReader, decode_clock_event_reasons, gpm_ratios,
                          is_error, is_permanent, normalize_uuid, nvml_index_for_torch_device, open_nvml,
                          percent_to_ratio, read_gpm, text)
from ..schema import GpuHealth

__all__ = ["NvmlSampler", "CLOCK_EVENT_REASONS", "GPM_METRICS", "GpmReader", "decode_clock_event_reasons",
           "gpm_ratios", "normalize_uuid", "nvml_index_for_torch_device", "read_gpm"]

log = logging.getLogger(__name__)
_MAX_EVENTS_PER_TICK = 64  # Xid events drained per tick; more wait for the next one


class NvmlSampler:
    """GPU health of one torch CUDA device, sampled on a daemon thread.

    ``on_sample(GpuHealth)`` is called on that thread after each sample; ``on_error(component,
    exc)`` with ``component = "nvml.<field>"`` for a failed read (once per field for
    permanent errors). ``nvml`` is a pynvml-like module (default: ``import pynvml``).
    ``available``, ``gpu_name``, ``pci_device_id`` (16-bit, for the peak table) and
    ``nvml_index`` are set by :meth:`open` (which :meth:`start` calls).
    """

    def __init__(self, *, torch_device: Any, interval_seconds: float = 1.0,
                 on_sample: Callable[[GpuHealth], None], on_error: Callable[[str, BaseException], None],
                 nvml: Any = None) -> None:
        if not (isinstance(interval_seconds, (int, float)) and interval_seconds > 0):
            raise ValueError(f"interval_seconds: expected a number > 0, got {interval_seconds!r}")
        self.torch_device, self.interval_seconds = torch_device, float(interval_seconds)
        self._on_sample, self._on_error, self._nvml = on_sample, on_error, nvml
        self.available = False
        self.gpu_name: Optional[str] = None
        self.pci_device_id: Optional[int] = None
        self.nvml_index: Optional[int] = None
        self.last_xid: Optional[int] = None
        self._handle: Any = None
        self._gpm: Optional[GpmReader] = None
        self._event_set: Any = None
        self._xid_count = 0
        self._off: set = set()  # fields switched off after a permanent error
        self._first_choice: Dict[Tuple[str, ...], str] = {}
        self._latest: Optional[GpuHealth] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._opened = self._released = False

    # ------------------------------------------------------------------ life cycle
    def open(self) -> bool:
        """Initialise NVML and find the device; False (with one info line) when there is none."""
        if self._opened:
            return self.available
        self._opened = True
        try:
            self._nvml, self._handle, self.nvml_index = open_nvml(self.torch_device, self._nvml)
        except RuntimeError as exc:
            self._released = True
            log.info("mfuwatch: NVML sampler off: %s", exc)
            return False
        nv, h = self._nvml, self._handle
        self.gpu_name = self._read("name", lambda: text(nv.nvmlDeviceGetName(h)))
        pci = self._read("pci_info", lambda: nv.nvmlDeviceGetPciInfo(h).pciDeviceId)
        self.pci_device_id = None if pci is None else (int(pci) >> 16 if int(pci) > 0xFFFF else int(pci))
        self._open_gpm()
        self._open_xid()
        self.available = True
        return True

    def start(self) -> bool:
        """Open NVML and start the sampling thread; False when the sampler is off."""
        if not self.open():
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mfuwatch-nvml", daemon=True)
            self._thread.start()
        return True

    def close(self) -> None:
        """Stop the thread (joins for up to 1 s) and release NVML."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=1.0)
            if t.is_alive():
                return  # stuck in an NVML call: the thread releases NVML when it returns
        self._release()

    @property
    def latest(self) -> Optional[GpuHealth]:
        with self._lock:
            return self._latest

    # ------------------------------------------------------------------ sampling
    def sample(self) -> GpuHealth:
        """Read every field once and return it (the thread calls this each tick)."""
        if not self.available:
            raise RuntimeError("NVML sampler is not open")
        nv, h = self._nvml, self._handle
        g = GpuHealth(timestamp=time.time())
        util = self._read("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            g.utilization, g.memory_bandwidth_utilization = percent_to_ratio(util.gpu), percent_to_ratio(util.memory)
        mhz = self._read("sm_clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        g.sm_clock_hertz = None if mhz is None else float(mhz) * 1e6
        mhz = self._read("sm_clock_max", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))
        g.sm_clock_max_hertz = None if mhz is None else float(mhz) * 1e6
        mw = self._read("power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        g.power_watts = None if mw is None else mw / 1e3
        mw = self._read("power_limit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
        g.power_limit_watts = None if mw is None else mw / 1e3
        temp = self._read("temperature", lambda: self._call_first(
            ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), h, nv.NVML_TEMPERATURE_GPU))
        g.temperature_celsius = None if temp is None else float(temp)
        mem = self._read("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            g.memory_used_bytes, g.memory_total_bytes = float(mem.used), float(mem.total)
        mj = self._read("energy", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))
        g.energy_joules = None if mj is None else mj / 1e3
        mask = self._read("clock_event_reasons", lambda: self._call_first(
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h))
        g.clock_event_reasons = {} if mask is None else decode_clock_event_reasons(nv, mask)
        ecc = self._read("ecc", lambda: {
            kind: int(nv.nvmlDeviceGetTotalEccErrors(h, getattr(nv, f"NVML_MEMORY_ERROR_TYPE_{kind.upper()}"),
                                                     nv.NVML_VOLATILE_ECC))
            for kind in ("corrected", "uncorrected")})
        g.ecc_errors = ecc or {}
        g.xid_errors = self._poll_xid()
        gpm = self._read("gpm", self._gpm.read) if self._gpm is not None else None
        if gpm:
            g.sm_active, g.tensor_active, g.dram_active = gpm.get("sm_active"), gpm.get("tensor_active"), \
                gpm.get("dram_active")
        with self._lock:
            self._latest = g
        return g

    def _run(self) -> None:
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                health = None
                try:
                    health = self.sample()
                except Exception as exc:  # noqa: BLE001 - never let the thread die
                    self._report("sample", exc)
                if health is not None:
                    try:
                        self._on_sample(health)
                    except Exception as exc:  # noqa: BLE001
                        self._report("on_sample", exc)
                next_t += self.interval_seconds
                now = time.monotonic()
                if next_t < now:  # fell behind (slow NVML, suspended process): no burst of catch-up samples
                    next_t = now
                self._stop.wait(next_t - now)
        finally:
            self._release()

    # ------------------------------------------------------------------ helpers
    def _report(self, field: str, exc: BaseException) -> None:
        try:
            self._on_error(f"nvml.{field}", exc)
        except Exception:  # noqa: BLE001 - the error sink itself failed: nothing left to tell
            log.debug("mfuwatch: on_error failed for nvml.%s", field, exc_info=True)

    def _read(self, field: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None: a permanent error switches ``field`` off and is reported once."""
        if field in self._off:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            if is_permanent(self._nvml, exc):
                self._off.add(field)
            self._report(field, exc)
            return None

    def _call_first(self, names: Tuple[str, ...], *args: Any) -> Any:
        """Call the first of ``names`` this NVML has, moving on past FunctionNotFound."""
        if names in self._first_choice:
            return getattr(self._nvml, self._first_choice[names])(*args)
        last: Optional[BaseException] = None
        for name in names:
            fn = getattr(self._nvml, name, None)
            if fn is None:
                continue
            try:
                result = fn(*args)
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, AttributeError) or is_error(self._nvml, exc, ("NVMLError_FunctionNotFound",)):
                    last = exc
                    continue
                raise
            self._first_choice[names] = name
            return result
        raise last or AttributeError(f"NVML has none of {names}")

    def _open_gpm(self) -> None:
        nv = self._nvml
        try:
            supported = bool(getattr(nv.nvmlGpmQueryDeviceSupport(self._handle), "isSupportedDevice", 0))
        except Exception as exc:  # noqa: BLE001
            if not is_permanent(nv, exc):
                self._report("gpm", exc)
            supported = False
        if not supported:
            log.info("mfuwatch: %s has no NVML GPM: SM/tensor/DRAM activity not reported", self.gpu_name)
            return
        try:
            self._gpm = GpmReader(nv, self._handle)
        except Exception as exc:  # noqa: BLE001
            self._report("gpm", exc)

    def _open_xid(self) -> None:
        nv, es = self._nvml, None
        try:
            es = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(self._handle, nv.nvmlEventTypeXidCriticalError, es)
            self._event_set = es
        except Exception as exc:  # noqa: BLE001 - e.g. NotSupported in containers: count nothing
            self._off.add("xid")
            self._report("xid", exc)
            if es is not None:
                try:
                    nv.nvmlEventSetFree(es)
                except Exception:  # noqa: BLE001
                    pass

    def _poll_xid(self) -> int:
        """Drain pending Xid events without waiting (timeout 0); the count since start."""
        if self._event_set is None or "xid" in self._off:
            return self._xid_count
        nv = self._nvml
        for _ in range(_MAX_EVENTS_PER_TICK):
            try:
                data = nv.nvmlEventSetWait(self._event_set, 0)
            except Exception as exc:  # noqa: BLE001
                if not is_error(nv, exc, ("NVMLError_Timeout",)):  # Timeout = no event pending
                    if is_permanent(nv, exc):
                        self._off.add("xid")
                    self._report("xid", exc)
                break
            if int(data.eventType) & int(nv.nvmlEventTypeXidCriticalError):
                self._xid_count += 1
                self.last_xid = int(data.eventData)
                log.warning("mfuwatch: Xid %d on GPU %s (NVML index %s)", self.last_xid, self.gpu_name,
                            self.nvml_index)
        return self._xid_count

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        nv = self._nvml
        if self._gpm is not None:
            self._gpm.close()
        try:
            if self._event_set is not None:
                nv.nvmlEventSetFree(self._event_set)
        except Exception:  # noqa: BLE001 - shutting down
            pass
        try:
            nv.nvmlShutdown()  # NVML counts nvmlInit/nvmlShutdown pairs: other users are unaffected
        except Exception:  # noqa: BLE001
            pass
