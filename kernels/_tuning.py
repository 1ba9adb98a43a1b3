"""Choosing launch settings: :func:`tuned` times a short list of candidate settings once per (kernel,
device, shape class) on the GPU with :func:`gpu_ms` (GPU time of back-to-back launches) and keeps the
fastest. The first candidate is the heuristic default, used under the interpreter, during CUDA-graph
capture, and when ``MFUWATCH_KERNELS_AUTOTUNE=0``.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable, Dict, Hashable, Sequence

import torch

from ._env import env_flag

#: Measure launch settings on first use (set ``MFUWATCH_KERNELS_AUTOTUNE=0`` to
#: keep the heuristic defaults, e.g. for bit-for-bit reproducible runs).
AUTOTUNE = env_flag("MFUWATCH_KERNELS_AUTOTUNE", True)

_TUNED: Dict[Hashable, Any] = {}
_TUNE_LOCK = threading.Lock()


def row_bucket(rows: int) -> int:
    """Shape class of a row count for the tuning cache: the next power of two, capped at 2**17."""
    return 1 << min(17, max(0, rows - 1).bit_length())


#: Below this many elements a launch is dominated by its fixed cost: no timing, the default setting.
MIN_TUNE_ELEMENTS = 1 << 20


def tuned(kernel: str, device: torch.device, key: Hashable, candidates: Callable[[], Sequence[Any]],
          launch: Callable[[Any], Any], elements: int) -> Any:
    """Pick the fastest launch setting among ``candidates()`` for this kernel, device and key.

    ``candidates()`` lists the settings, the heuristic default first (called
    only on a cache miss). ``launch(candidate)`` must run the kernel with that
    setting and be idempotent (write the same outputs every time). Timing
    happens once per cache key on CUDA devices (:func:`gpu_ms`, a few tens of
    milliseconds per candidate); a candidate that fails
    to compile is skipped. Returns the first candidate without timing under the
    interpreter, on the CPU, during CUDA-graph capture, for launches of fewer
    than :data:`MIN_TUNE_ELEMENTS` elements (e.g. ``patch``'s probe), or when
    autotuning is off.
    """
    full_key = (kernel, device.index, key)
    best = _TUNED.get(full_key)
    if best is not None:
        return best
    cands = candidates()
    if len(cands) == 1 or not AUTOTUNE or device.type != "cuda" or elements < MIN_TUNE_ELEMENTS:
        return cands[0]
    if torch.cuda.is_current_stream_capturing():
        return cands[0]
    candidates = cands
    with _TUNE_LOCK:
        best = _TUNED.get(full_key)
        if best is not None:
            return best
        timings = []
        for cand in candidates:
            try:
                ms = gpu_ms(lambda: launch(cand))
            except Exception:  # e.g. out of registers/shared memory for this setting
                ms = float("inf")
            timings.append(ms)
        best = candidates[min(range(len(candidates)), key=timings.__getitem__)]
        _TUNED[full_key] = best
    return best


#: GPU clock used to turn a wait into ``torch.cuda._sleep`` cycles: above the H100/H200 boost clock (1.98 GHz,
#: NVIDIA H100/H200 datasheets), so that the wait lasts at least as long as asked on those GPUs.
_SLEEP_CYCLES_PER_S = 2.0e9


def gpu_ms(fn: Callable[[], Any], target_ms: float = 2.0, rounds: int = 3) -> float:
    """Median GPU milliseconds per call of ``fn`` (which launches work on the current stream), calls back to back.

    ``fn`` runs once to compile and warm up, once timed to size the loop, then ``rounds`` times
    ``k`` calls (``k`` so that a round takes about ``target_ms``, 3 to 200 calls) between two CUDA
    events. Each round starts behind a GPU wait (``torch.cuda._sleep``) longer than the host needs to
    enqueue its calls (up to 100 ms), so the events time the kernels alone, without the host's launch gaps, and
    each call finds what the previous one left in L2, as in CUDA-graph replay and in a training
    step, where a norm's input has just been written (``triton.testing.do_bench`` clears L2 and
    includes host time). Synchronises the device; raises what ``fn`` raises.
    """
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_s = time.perf_counter() - t0
    end.synchronize()
    k = max(3, min(200, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    sleep = getattr(torch.cuda, "_sleep", None)
    per_call = []
    for _ in range(rounds):
        if sleep is not None:  # twice the host's time for k calls, at least 50 µs, at most 100 ms
            sleep(int(min(max(2 * k * host_s, 50e-6), 0.1) * _SLEEP_CYCLES_PER_S))
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / k)
    return statistics.median(per_call)


def tuned_settings() -> Dict[Hashable, Any]:
    """A copy of the launch settings chosen so far, keyed by (kernel, device index, shape key)."""
    return dict(_TUNED)
