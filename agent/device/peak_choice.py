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

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from . import peaks

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
