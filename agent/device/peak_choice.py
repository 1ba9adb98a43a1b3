"""The MFU denominator: which peak FLOP/s, from which source, for the training dtype.

Precedence: the user's ``peak_flops`` > a ``calibrate`` matmul measurement in the training dtype >
the GPU's datasheet peak for the training dtype (:func:`~.peaks.resolve_peaks`, NVML PCI id first,
else the CUDA device name). An unknown peak leaves MFU unreported (``None``) with one warning, never
a guessed figure.

:func:`choose_mfu_peak` is the one place that decides; it is pure apart from the ``measure``
callable it is handed (a calibration) and the table's once-per-GPU warning. The agent calls it on
the training thread when the training dtype becomes known (the configured ``dtype`` at start-up,
else the first training forward) and again when the dtype changes, so a calibration under bf16
autocast measures a bf16 matmul, not fp32 (issue 24: MFU 6.63 on an H200 measured against fp32).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from . import peaks

log = logging.getLogger("mfuwatch")

#: the dtype a calibration measures in when nothing will show the training dtype (no model to watch)
NO_MODEL_DTYPE = "fp32"


@dataclass(frozen=True)
class PeakSettings:
    """What the choice depends on besides the dtype: the user's ``peak_flops`` (FLOP/s or None),
    ``calibrate`` (bool), the device type ("cuda", "cpu", ...) and whether a model is watched (its
    first forward shows the dtype; without one a calibration measures in :data:`NO_MODEL_DTYPE`)."""

    user_peak: Optional[float]
    calibrate: bool
    device_type: str
    has_model: bool = True


def choose_mfu_peak(settings: PeakSettings, dtype_key: Optional[str], gpu_peaks: Optional[peaks.Peaks],
                    measure: Callable[[str], float]) -> Tuple[Optional[float], str]:
    """``(peak FLOP/s, source)`` for the training dtype key ``dtype_key`` (None: not known yet).

    ``measure(dtype_key)`` calibrates a matmul in that dtype (FLOP/s; called only when
    ``settings.calibrate`` and no user peak). Returns ``(None, "")`` while the choice must wait
    for the dtype, ``(None, "none")`` for a device without a peak table (off CUDA, no calibration),
    ``(None, source)`` for a GPU row without that dtype (one warning, from :func:`peaks.mfu_peak`),
    and ``(None, "")`` without a row. Raises what ``measure`` raises, and ValueError for a
    ``dtype_key`` outside :data:`peaks.DTYPES`.
    """
    if settings.user_peak is not None:
        return float(settings.user_peak), "user (peak_flops)"
    if settings.calibrate:
        key = dtype_key or (None if settings.has_model else NO_MODEL_DTYPE)
        if key is None:
            return None, ""  # wait for the first forward: it shows the dtype to measure in
        return float(measure(key)), f"calibrated ({key} matmul)"
    if settings.device_type != "cuda":
        return None, "none"
    if dtype_key is None:
        return None, ""
    return peaks.mfu_peak(gpu_peaks, dtype_key)


class MfuPeak:
    """The MFU denominator of one agent, and the only writer of the peak fields of its ``RunInfo``.

    Args: ``settings`` (:class:`PeakSettings`), ``device`` (the training ``torch.device``), ``run_info``
    (its ``peak_flops_per_second``, ``peak_source``, ``dtype`` and peak bandwidth are written here),
    ``measure(dtype_key)`` (a calibration, FLOP/s), ``on_change()`` (told when the facts changed) and
    ``errors`` (failures counted under ``peak``). :attr:`value` is read by the reporter (agent thread);
    :meth:`choose` runs on the training thread only (start-up and each new dtype).
    """

    def __init__(self, settings: PeakSettings, *, device: Any, run_info: Any, measure: Callable[[str], float],
                 on_change: Callable[[], None], errors: Any) -> None:
        self.settings, self.device, self.run_info = settings, device, run_info
        self.measure, self.on_change, self.errors = measure, on_change, errors
        self.value: Optional[float] = None
        #: the GPU's peaks from :func:`peaks.resolve_peaks` (None off CUDA or for a GPU not in the table)
        self.gpu_peaks: Optional[peaks.Peaks] = None
        self._warned = False

    def resolve_gpu(self, pci_device_id: Optional[int]) -> None:
        """The GPU's :class:`peaks.Peaks` from the one resolver (NVML PCI id first, else the CUDA name).

        A GPU missing from the table gets ``None`` and one warning, unless ``peak_flops`` or
        ``calibrate`` gives the MFU denominator anyway.
        """
        if self.settings.device_type != "cuda":
            return
        s = self.settings
        try:
            self.gpu_peaks = peaks.resolve_peaks(self.run_info.gpu_name or None, pci_device_id,
                                                 warn=s.user_peak is None and not s.calibrate)
            if self.gpu_peaks is not None:
                self.run_info.peak_memory_bandwidth_bytes_per_second = self.gpu_peaks.memory_bandwidth_bytes_per_second
        except Exception as exc:  # noqa: BLE001
            self.errors.count("peak", exc)

    def choose(self, dtype_key: Optional[str]) -> None:
        """Set the peak for the training dtype known now (:func:`choose_mfu_peak`); a new dtype without a
        peak clears the old one. Never raises."""
        try:
            value, source = choose_mfu_peak(self.settings, dtype_key, self.gpu_peaks, self.measure)
            if source == "none" and not self._warned:
                self._warned = True
                log.warning("mfuwatch: no peak FLOP/s for device %s: MFU is not reported; pass calibrate=True "
                            "or peak_flops=<FLOP/s>", self.device)
            if value or (self.value is not None and source):
                self.value = float(value) if value else None
                self.run_info.peak_flops_per_second = self.value
                self.run_info.peak_source = source
                self.run_info.dtype = dtype_key or self.run_info.dtype
                self.on_change()  # the agent thread writes an updated "run" record to the timeline
        except Exception as exc:  # noqa: BLE001
            self.errors.count("peak", exc)
