"""The MFU denominator of one agent: which peak FLOP/s, from which source.

Precedence: the user's ``peak_flops`` > a ``calibrate`` matmul measurement > the GPU's
datasheet peaks for the training dtype (:func:`peaks.resolve_peaks`, NVML PCI id first,
else the CUDA device name). An unknown peak leaves MFU unreported (``None``) with one
warning, never a guessed figure. The chosen value and its source go into ``RunInfo``
(``peak_flops_per_second``, ``peak_source``).
"""

from __future__ import annotations

import logging
import socket
from typing import Optional

import torch

from . import calibrate, peaks

log = logging.getLogger("mfuwatch")

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class MfuPeak:
    """Mixin of :class:`~mfuwatch.agent.core.Agent`: resolves and sets the peak FLOP/s.

    Reads ``config``, ``device``, ``nvml``, ``errors``, ``_dtype_key``; writes ``gpu_peaks``,
    ``_peak``, ``_peak_warned``, ``_run_info_dirty`` and the peak fields of ``run_info``.
    Every failure is counted under ``peak``.
    """

    def _resolve_gpu_peaks(self) -> None:
        """The GPU's :class:`peaks.Peaks` from the one resolver (NVML PCI id first, else the CUDA name).

        A GPU missing from the table gets ``None`` and one warning, unless ``peak_flops`` or
        ``calibrate`` gives the MFU denominator anyway.
        """
        if self.device.type != "cuda":
            return
        cfg = self.config
        try:
            self.gpu_peaks = peaks.resolve_peaks(self.run_info.gpu_name or None, self._pci_device_id(),
                                                 warn=cfg.peak_flops is None and not cfg.calibrate)
            if self.gpu_peaks is not None:
                self.run_info.peak_memory_bandwidth_bytes_per_second = self.gpu_peaks.memory_bandwidth_bytes_per_second
        except Exception as exc:  # noqa: BLE001
            self.errors.count("peak", exc)

    def _choose_mfu_peak(self) -> None:
        """Peak FLOP/s: user value > calibration > the GPU's peaks for the training dtype. Unknown => None."""
        cfg = self.config
        try:
            if cfg.peak_flops is not None:
                self._set_peak(cfg.peak_flops, "user (peak_flops)")
                return
            if cfg.calibrate:
                dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self._dtype_key or "", torch.float32)
                measure = lambda: calibrate.calibrate_matmul(self.device, dtype)  # noqa: E731
                if cfg.world_size > 1 and self.device.type == "cpu":
                    # CPU ranks of one job share one measurement (they would compete for the cores otherwise)
                    from .calib_cache import shared_value

                    measure = (lambda m=measure: shared_value(
                        f"peak|{cfg.run}|{socket.gethostname()}|{self.device}|{_dkey(dtype)}", m))
                self._set_peak(measure(), f"calibrated ({_dkey(dtype)} matmul)")
                return
            if self.device.type != "cuda":
                if not self._peak_warned:
                    self._peak_warned = True
                    log.warning("mfuwatch: no peak FLOP/s for device %s: MFU is not reported; pass calibrate=True "
                                "or peak_flops=<FLOP/s>", self.device)
                return
            if self._dtype_key is None:
                return  # wait for the first forward to know the training dtype
            value, source = peaks.mfu_peak(self.gpu_peaks, self._dtype_key)  # warns once for a missing dtype
            if value:
                self._set_peak(value, source)
            else:
                self._peak_warned = True  # final: the table has nothing for this GPU and dtype
        except Exception as exc:  # noqa: BLE001
            self.errors.count("peak", exc)

    def _pci_device_id(self) -> Optional[int]:
        nv = getattr(self, "nvml", None)
        return getattr(nv, "pci_device_id", None) if nv is not None else None

    def _set_peak(self, value: float, source: str) -> None:
        self._peak = float(value)
        self.run_info.peak_flops_per_second = self._peak
        self.run_info.peak_source = source
        self.run_info.dtype = self._dtype_key or self.run_info.dtype
        self._run_info_dirty = True  # the agent thread writes an updated "run" record to the timeline


def _dkey(dtype: torch.dtype) -> str:
    return _DTYPE_KEYS.get(dtype, str(dtype))
