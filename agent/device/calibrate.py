"""Measured peaks: a large matmul's FLOP/s and a large copy's bandwidth, for devices without a table row.

Used by ``calibrate=True`` (the MFU denominator), the CPU demo and profiler windows on a device the
peak table (:mod:`mfuwatch.agent.device.peaks`) does not list. Each call blocks (one host-device sync) and
is meant for start-up only. torch is imported inside the functions.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from .peaks import training_dtype_key


def _torch_dtype(dtype: Any):
    import torch

    key = training_dtype_key(dtype)
    return key, {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                 "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[key]


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
    key, tdtype = _torch_dtype(dtype)
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
