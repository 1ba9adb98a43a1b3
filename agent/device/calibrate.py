"""Measured peaks: a large matmul's FLOP/s and a large copy's bandwidth, for devices without a table row.

The one calibration path: ``calibrate=True`` (the MFU denominator, measured in the training dtype
once the first forward shows it), the CPU demo and profiler windows on a device the peak table
(:mod:`mfuwatch.agent.device.peaks`) does not list all go through :func:`measured`, which takes each
figure once per process and, for the CPU ranks of one job, once per host
(:func:`~mfuwatch.agent.device.calib_cache.shared_value` under :func:`cache_key`). Each measurement
blocks (one host-device sync). torch is imported inside the functions.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

from .peaks import Peaks, torch_dtype, training_dtype_key

#: what :func:`measured` took in this process: ``{(device, what): value}`` (``what``: a dtype key or "bandwidth")
_measured: Dict[Tuple[str, str], float] = {}


def _time_cuda(fn, device, warmup: int, reps: int) -> float:
    """Mean seconds per call of ``fn`` on ``device``, timed with CUDA events after warm-up."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()  # host-device sync: calibration runs once, before training
    return start.elapsed_time(end) / 1e3 / reps


def _time_cpu(fn, budget_seconds: float, max_reps: int) -> float:
    """Fastest of up to ``max_reps`` timed calls (after one warm-up) within a time budget."""
    fn()
    best, t_end = float("inf"), time.perf_counter() + budget_seconds
    for _ in range(max_reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return best


def calibrate_matmul(device: Any, dtype: Any) -> float:
    """Measured FLOP/s of a large matmul (``2 n^3`` FLOPs per ``n x n`` product).

    GPU: ``n = 8192`` in ``dtype`` (``"fp32"`` with TF32 off, ``"tf32"`` with it on, bf16,
    fp16; fp8 through ``torch._scaled_mm`` where this torch has it), 3 warm-up and 10 timed
    iterations between CUDA events. CPU: ``n = 1024``, best of up to 5 within about 1 s.
    Blocks (one host-device sync). Raises ValueError for fp8 on a device without it.
    """
    import torch

    dev = torch.device(device)
    key = training_dtype_key(dtype)
    tdtype = torch_dtype(key)
    if dev.type != "cuda":
        n = 1024
        cdtype = torch.float32 if key in ("fp32", "tf32", "fp8") else tdtype
        a, b = torch.randn(n, n, dtype=cdtype), torch.randn(n, n, dtype=cdtype)
        return 2.0 * n ** 3 / _time_cpu(lambda: torch.mm(a, b), 1.0, 5)
    n = 8192
    if key == "fp8":
        if not hasattr(torch, "_scaled_mm"):
            raise ValueError("this torch has no torch._scaled_mm: cannot calibrate fp8; pass peak_flops")
        a = torch.randn(n, n, device=dev).to(tdtype)
        b = torch.randn(n, n, device=dev).to(tdtype).t()  # column-major, as _scaled_mm requires
        one = torch.ones((), device=dev)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        a = torch.randn(n, n, device=dev, dtype=tdtype)
        b = torch.randn(n, n, device=dev, dtype=tdtype)
        fn = lambda: torch.mm(a, b)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
        try:
            seconds = _time_cuda(fn, dev, warmup=3, reps=10)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    return 2.0 * n ** 3 / seconds


def calibrate_bandwidth(device: Any) -> float:
    """Measured device-memory bandwidth in bytes/s: a large copy moves ``2 x nbytes``.

    GPU: a 1 GiB buffer copied 10 times between CUDA events after 3 warm-up copies.
    CPU: a 64 MiB buffer, best of up to 5 within about 0.5 s. Blocks.
    """
    import torch

    dev = torch.device(device)
    nbytes = (1 << 30) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    seconds = _time_cuda(fn, dev, 3, 10) if dev.type == "cuda" else _time_cpu(fn, 0.5, 5)
    return 2.0 * nbytes / seconds


def cache_key(share: str, device: Any, what: str) -> str:
    """The one key of a calibrated figure shared by the ranks of a job on one host.

    ``share`` is the job's scope (``"<run>|<host>"``), ``what`` a dtype key of
    :data:`~mfuwatch.agent.device.peaks.DTYPES` (matmul FLOP/s) or ``"bandwidth"`` (bytes/s).
    """
    return f"calibration|{share}|{device}|{what}"


def measured(device: Any, what: str, share: Optional[str] = None) -> float:
    """Calibrated matmul FLOP/s for dtype key ``what``, or the copy bandwidth (``what="bandwidth"``), bytes/s.

    Taken once per process and device; with ``share`` (the CPU ranks of one job, ``"<run>|<host>"``)
    once per host: the first rank measures, the others read its value (:func:`cache_key`). Blocks
    the first time. Raises what the measurement raises (fp8 without ``torch._scaled_mm``).
    """
    memo = (str(device), what)
    if memo not in _measured:
        compute = (lambda: calibrate_bandwidth(device)) if what == "bandwidth" else (
            lambda: calibrate_matmul(device, what))
        if share:
            from .calib_cache import shared_value

            _measured[memo] = shared_value(cache_key(share, device, what), compute)
        else:
            _measured[memo] = float(compute())
    return _measured[memo]


def calibrated_peaks(device: Any, dtypes: Sequence[str], share: Optional[str] = None) -> Peaks:
    """:class:`Peaks` of a device from :func:`measured`: matmul FLOP/s per dtype key, copy bandwidth.

    The measured bandwidth is both the peak and ``measured_bandwidth_bytes_per_second``; ``name`` is
    "cpu" on the CPU, ``source`` "calibrated". Blocks the first time each figure is taken.
    """
    import torch

    dev = torch.device(device)
    bw = measured(dev, "bandwidth", share)
    return Peaks(peak_flops={k: measured(dev, k, share) for k in dtypes}, memory_bandwidth_bytes_per_second=bw,
                 measured_bandwidth_bytes_per_second=bw, name="cpu" if dev.type == "cpu" else "",
                 source="calibrated")
