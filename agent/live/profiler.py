"""Profiler sampler: a short ``torch.profiler`` window every few minutes, analysed in a child process.

Cadence: every ``every_steps`` optimizer steps or ``every_seconds`` (whichever comes first), driven
by :meth:`on_step` at each optimizer step boundary: ``torch.profiler.profile`` (CPU + CUDA
activities, ``record_shapes=True``) for ``warmup_steps`` then ``active_steps``. The trace is
exported to a temporary file on the training thread and analysed by ``python -m
mfuwatch.agent.analysis.analyze --json`` in a child process (nice 10 next to a GPU job, 5 next to
CPU training; one BLAS thread), so parsing never holds the training loop's GIL. The child's
:class:`WindowMeasurement` reaches ``on_window`` from a waiter thread.

Cadence and analyses in flight: a window starts on its cadence even while the previous
window's analysis still runs. At most one analysis runs at a time and at most one finished
trace waits for it; a window due while one is already waiting is not recorded (no profiling
overhead for a result that would be dropped) and is counted (``skipped_busy``). So a slow
analysis delays results by at most one window and never stretches the cadence.

Expected gains are fractions of the window's *own* step time (the mean interval of its
active steps, profiler overhead included), the time the op durations in the trace were
measured against; the step time measured outside the window would be shorter and inflate them.

Guards (each counted in :attr:`windows` and reported through ``on_error`` or the log once):
another profiler active ⇒ the window is skipped; a trace over ``max_trace_bytes`` is not
analysed and later windows record half as many steps; with CUDA >= 12.6 ``TEARDOWN_CUPTI=1`` is
set unless the environment sets it (pytorch/pytorch#144455), and a median step interval after
a window above the one before by more than :data:`LASTING_SLOWDOWN`, in two checks 16 steps
apart, stops further windows.

Peaks: the ``peaks`` given (the agent passes what :func:`mfuwatch.agent.device.peaks.resolve_peaks`
found for its GPU, PCI id first), else ``resolve_peaks`` by the CUDA device name, else a
calibration. They reach the child in one form, :meth:`Peaks.to_dict` as a JSON file read back
by ``mfuwatch analyze --peaks``. On a CPU-only run the window records CPU ops and is analysed
with ``--device cpu``. Details and measured costs: docs/analyze.md.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Dict, Optional

from ..device.peaks import Peaks
from ..schema import WindowMeasurement, window_from_record

log = logging.getLogger("mfuwatch")

#: Relative step-time increase after a window, sustained over 16 steps, reported as a lasting slowdown.
LASTING_SLOWDOWN = 0.10


class ProfilerSampler:
    """Short profiler windows on a cadence, analysed off the training thread.

    Args:
        every_steps: a window every this many optimizer steps (None: no step cadence).
        every_seconds: a window every this many seconds (None: no time cadence).
        warmup_steps: profiler warm-up steps before recording (0 allowed; torch warns).
        active_steps: recorded steps per window (>= 1).
        device: the training ``torch.device``; "cuda" records CUDA activities too.
        peaks: :class:`~mfuwatch.agent.device.peaks.Peaks` (or what :meth:`Peaks.from_any` accepts) of the
            device; None ⇒ :func:`~mfuwatch.agent.device.peaks.resolve_peaks` by CUDA device name, else calibrated.
        top_k: ops kept in ``WindowMeasurement.top_ops``.
        on_window: called with each :class:`WindowMeasurement`, from a waiter thread.
        on_error: ``on_error("profiler", exc)`` for every failure (never raised to the caller).
        max_trace_bytes: larger exported traces are not analysed (default 1 GiB).
        analyze_timeout_seconds: the child is killed after this long (default 300 s).
        shared_key: when set (CPU ranks of one job: ``"<run>|<host>"``), a calibration is shared by
            the ranks on this host (:func:`mfuwatch.agent.device.calibrate.measured`).
        on_outcome: optional ``on_outcome(outcome)`` per window, outcome one of "ok", "error",
            "skipped_other_profiler", "skipped_busy", "too_large" (for ``mfuwatch_profile_windows_total{outcome}``);
            the same counts are kept in :attr:`windows`.

    Raises:
        ValueError: neither cadence set, or a non-positive cadence / step count (fail fast).
    """

    def __init__(self, *, every_steps: Optional[int] = None, every_seconds: Optional[float] = None,
                 warmup_steps: int = 1, active_steps: int = 3, device: Any = "cpu", peaks: Any = None,
                 top_k: int = 8, on_window: Callable[[WindowMeasurement], None],
                 on_error: Callable[[str, BaseException], None], max_trace_bytes: int = 1 << 30,
                 analyze_timeout_seconds: float = 300.0,
                 on_outcome: Optional[Callable[[str], None]] = None, shared_key: Optional[str] = None) -> None:
        if not every_steps and not every_seconds:
            raise ValueError("profile_every: set every_steps or every_seconds (e.g. '500 steps' or '300s')")
        if (every_steps is not None and every_steps <= 0) or (every_seconds is not None and every_seconds <= 0):
            raise ValueError(f"profile_every: must be positive, got steps={every_steps} seconds={every_seconds}")
        if warmup_steps < 0 or active_steps < 1:
            raise ValueError(f"profile_warmup_steps >= 0 and profile_active_steps >= 1 required, "
                             f"got {warmup_steps} and {active_steps}")
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.warmup_steps, self.active_steps = int(warmup_steps), int(active_steps)
        self.peaks: Optional[Peaks] = None if peaks is None else Peaks.from_any(peaks)
        self.top_k = int(top_k)
        self.on_window, self.on_error, self.on_outcome = on_window, on_error, on_outcome
        self.max_trace_bytes, self.analyze_timeout_seconds = max_trace_bytes, analyze_timeout_seconds
        #: window outcomes: ok, error, skipped_other_profiler, too_large (for profile_windows_total{outcome})
        self.windows: Dict[str, int] = collections.Counter()
        self.lasting_slowdown: Optional[float] = None  # relative slowdown seen after a window, if any
        #: ``[first, last]`` optimizer steps timed with each window in them (the latest 64; written on the training
        #: thread; ``last`` None while it records): its warm-up and recorded steps, and the step after them, which
        #: carries the trace export. Their step times include the profiler's overhead (see :meth:`profiled`).
        self.profiled_steps: collections.deque = collections.deque(maxlen=64)
        self.disabled = False
        self._intervals: collections.deque = collections.deque(maxlen=64)
        self._n = 0  # step boundaries seen
        self._last_t: Optional[float] = None
        self._next_step = every_steps if every_steps else None
        self._next_time = time.monotonic() + every_seconds if every_seconds else None
        self._prof = None
        self._prof_steps = 0
        self._window_step = 0
        self._step_time: Optional[float] = None
        self._before: Optional[float] = None
        self._watch_at: Optional[int] = None
        self._watch_hits = 0
        self._busy = False  # a child analysis is running
        self._pending: Optional[tuple] = None  # one exported trace waiting for the running analysis
        self._marks: list = []
        self._closing = False  # set by close(): results of a terminated child are dropped
        self._stopping = False  # set by close(): no new windows
        self._said_skip = False
        self._child: Optional[subprocess.Popen] = None
        self._waiter: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._shared_key = shared_key
        if self.cuda and "TEARDOWN_CUPTI" not in os.environ and _cuda_at_least(12, 6):
            os.environ["TEARDOWN_CUPTI"] = "1"  # detach CUPTI after each window (pytorch/pytorch#144455)

    # ------------------------------------------------------------------ training thread
    def on_step(self, step: int, step_time_seconds: Optional[float] = None) -> None:
        """Mark an optimizer step boundary (training thread). Microseconds when no window is due; never raises.

        ``step_time_seconds``: the latest step time measured outside the profiler (for gains), if known.
        """
        now = time.perf_counter()
        if self._last_t is not None:
            self._intervals.append(now - self._last_t)
        self._last_t = now
        self._n += 1
        if self._prof is not None:
            self._advance(step)
            return
        if self._watch_at is not None and self._n >= self._watch_at:
            self._check_slowdown()
        if self.disabled or self._stopping:
            return
        if (self._next_step is not None and step >= self._next_step) or (
                self._next_time is not None and time.monotonic() >= self._next_time):
            if self._pending is not None:  # one analysis runs and one trace waits: recording more is wasted
                self._schedule_next(step)
                self._count("skipped_busy")
                return
            self._start(step, step_time_seconds)

    def _schedule_next(self, step: int) -> None:
        if self.every_steps:
            self._next_step = step + self.every_steps
        if self.every_seconds:
            self._next_time = time.monotonic() + self.every_seconds

    def _start(self, step: int, step_time_seconds: Optional[float]) -> None:
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile, schedule

            self._schedule_next(step)
            if torch.autograd._profiler_enabled():
                self._skip_other()
                return
            if self.peaks is None:
                self.peaks = self._find_peaks()
            recent = list(self._intervals)[-32:]
            self._before = statistics.median(recent) if len(recent) >= 8 else None
            self._step_time = step_time_seconds or (statistics.median(recent) if recent else None)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            with warnings.catch_warnings():  # warmup_steps=0 is the user's choice; torch warns about it
                warnings.simplefilter("ignore", UserWarning)
                prof = profile(activities=acts, record_shapes=True, on_trace_ready=self._ready,
                               schedule=schedule(wait=0, warmup=self.warmup_steps, active=self.active_steps,
                                                 repeat=1))
            self._window_step, self._prof_steps = step, 0
            try:
                prof.start()
                self._marks = [time.perf_counter()]  # step boundaries of this window (for its own step time)
            except RuntimeError as exc:  # Kineto refuses a second session: the user's profiler won the race
                if "already" in str(exc).lower() or "enabled" in str(exc).lower():
                    self._skip_other()
                    return
                raise
            self._prof = prof
            self.profiled_steps.append([step + 1, None])
        except Exception as exc:  # noqa: BLE001 - never crash training
            self._fail(exc)

    def _count(self, outcome: str) -> None:
        self.windows[outcome] += 1
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception:  # noqa: BLE001
                pass

    def _skip_other(self) -> None:
        self._count("skipped_other_profiler")
        if not self._said_skip:
            self._said_skip = True
            log.warning("mfuwatch: another torch profiler is active; profiler windows are skipped while it runs "
                        "(counted in mfuwatch_profile_windows_total{outcome=\"skipped_other_profiler\"})")

    def profiled(self, first: int, last: int) -> bool:
        """Whether any of the optimizer steps ``first..last`` (inclusive) was timed with a profiler window in it
        (:attr:`profiled_steps`; windows older than its latest 64 are not known)."""
        return any(a <= last and (b is None or first <= b) for a, b in list(self.profiled_steps))

    def _end_profiled(self, step: int) -> None:
        """The window stopped at this boundary: the next step carries the stop (and the trace export)."""
        if self.profiled_steps and self.profiled_steps[-1][1] is None:
            self.profiled_steps[-1][1] = step + 1

    def _advance(self, step: int) -> None:
        prof = self._prof
        self._window_step = step  # the window's measurement is stamped with its last step
        self._marks.append(time.perf_counter())
        w, n = self.warmup_steps, self.active_steps
        if len(self._marks) == w + n + 1:  # this boundary ends the last active step: the window's own step time
            own = (self._marks[w + n] - self._marks[w]) / n
            if own > 0:
                self._step_time = own
        try:
            prof.step()  # the last call stops the trace and runs _ready() on this thread
            self._prof_steps += 1
            if self._prof_steps >= self.warmup_steps + self.active_steps:
                self._prof = None
                self._end_profiled(step)
                prof.stop()
                if self.cuda:  # CUPTI is a GPU-side concern; CPU step times are too noisy to judge
                    self._watch_at, self._watch_hits = self._n + 2 + 16, 0
                self._schedule_next(step)
        except Exception as exc:  # noqa: BLE001
            self._prof = None
            self._end_profiled(step)
            try:
                prof.stop()
            except Exception:  # noqa: BLE001
                pass
            self._fail(exc)

    def _ready(self, prof: Any) -> None:
        """``on_trace_ready``: export the trace and start the child analysis (training thread)."""
        if self._stopping:
            return
        workdir = tempfile.mkdtemp(prefix="mfuwatch-window-")
        try:
            path = os.path.join(workdir, "window.json")
            prof.export_chrome_trace(path)
            size = os.path.getsize(path)
            if size > self.max_trace_bytes:
                self._count("too_large")
                self.active_steps = max(1, self.active_steps // 2)
                raise RuntimeError(f"profiler trace of {size} bytes exceeds max_trace_bytes={self.max_trace_bytes}; "
                                   f"later windows record {self.active_steps} step(s)")
            out = os.path.join(workdir, "window.out.json")
            nice = "10" if self.cuda else "5"  # CPU training owns the cores; a nicer child would starve
            peaks_path = os.path.join(workdir, "peaks.json")
            with open(peaks_path, "w", encoding="utf-8") as f:
                json.dump(self.child_peaks().to_dict(), f)
            cmd = [sys.executable, "-m", "mfuwatch.agent.analysis.analyze", path, "--json", "--output", out,
                   "--nice", nice, "--steps", str(self.active_steps), "--top-k", str(self.top_k),
                   "--device", "cuda" if self.cuda else "cpu", "--peaks", peaks_path]
            if self._step_time:
                cmd += ["--step-time", repr(float(self._step_time))]
            job = (cmd, out, workdir, self._window_step)
            with self._lock:
                if self._busy:
                    if self._pending is None:
                        self._pending, job = job, None  # started by the waiter when the running analysis ends
                    else:
                        self._count("skipped_busy")
                        shutil.rmtree(workdir, ignore_errors=True)
                        return
            if job is not None:
                self._launch(job)
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(workdir, ignore_errors=True)
            self._fail(exc)

    def _launch(self, job: tuple) -> None:
        """Start the child analysis of one exported trace and its waiter thread."""
        cmd, out, workdir, step = job
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        # its own session: a Ctrl-C in the terminal goes to the training process, not to the analysis child
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, env=env, close_fds=True, start_new_session=True)
        with self._lock:
            self._busy, self._child = True, child
        self._waiter = threading.Thread(target=self._wait_child, args=(child, out, workdir, step),
                                        name="mfuwatch-window", daemon=True)
        self._waiter.start()

    # ------------------------------------------------------------------ waiter thread
    def _wait_child(self, child: subprocess.Popen, out: str, workdir: str, step: int) -> None:
        try:
            try:
                _, err = child.communicate(timeout=self.analyze_timeout_seconds)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                raise RuntimeError(f"window analysis took over {self.analyze_timeout_seconds} s; killed")
            if self._closing:
                return
            if child.returncode != 0:
                tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
                raise RuntimeError(f"window analysis exited with {child.returncode}: {' | '.join(tail)}")
            with open(out, encoding="utf-8") as f:
                wm = window_from_record(json.load(f))
            wm.step, wm.timestamp = step, time.time()
            self._count("ok")
            self.on_window(wm)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            with self._lock:
                self._busy, self._child = False, None
                job, self._pending = self._pending, None
            if job is not None:
                if self._closing or self._stopping:
                    shutil.rmtree(job[2], ignore_errors=True)
                else:
                    try:
                        self._launch(job)
                    except Exception as exc:  # noqa: BLE001
                        shutil.rmtree(job[2], ignore_errors=True)
                        self._fail(exc)

    # ------------------------------------------------------------------ helpers
    def _fail(self, exc: BaseException) -> None:
        self._count("error")
        try:
            self.on_error("profiler", exc)
        except Exception:  # noqa: BLE001
            pass

    def _check_slowdown(self) -> None:
        """Compare the last 16 step intervals with the 32 before the window; flag only when two checks,
        16 steps apart, both exceed :data:`LASTING_SLOWDOWN` (one slow stretch can be noise)."""
        self._watch_at = None
        after = list(self._intervals)[-16:]
        if self._before is None or len(after) < 8 or self._before <= 0:
            return
        ratio = statistics.median(after) / self._before - 1.0
        if ratio <= LASTING_SLOWDOWN:
            return
        self._watch_hits += 1
        if self._watch_hits < 2:
            self._watch_at = self._n + 16
            return
        self.lasting_slowdown = ratio
        self.disabled = True
        self._fail(RuntimeError(
            f"steps after a profiler window are {ratio:.0%} slower than before it (CUPTI left attached?); "
            "profiler windows are disabled for this run (set TEARDOWN_CUPTI=1 or profile_every='off')"))

    def child_peaks(self) -> Peaks:
        """The peaks the window's child process analyses with: :attr:`peaks` with ``fp32_matmul`` set
        to the unit torch runs fp32 matmuls on now ("tf32" when CUDA matmuls may use TF32)."""
        import dataclasses

        from ..device.peaks import torch_allows_tf32

        p = self.peaks if self.peaks is not None else self._find_peaks()
        tf32 = self.cuda and torch_allows_tf32()
        return dataclasses.replace(p, fp32_matmul="tf32" if tf32 else "fp32")

    def _find_peaks(self) -> Peaks:
        """No peaks given: the peak table by CUDA device name, else a calibration (blocks, once per process;
        the CPU ranks of one job share one, :func:`~mfuwatch.agent.device.calibrate.measured`)."""
        import torch

        from ..device.calibrate import calibrated_peaks
        from ..device.peaks import resolve_peaks

        if self.cuda:
            found = resolve_peaks(name=torch.cuda.get_device_name(self.device), warn=False)
            if found is not None:
                return found
            return calibrated_peaks(self.device, ("fp32", "bf16", "fp16"), self._shared_key)
        return calibrated_peaks(self.device, ("fp32",), self._shared_key)

    def close(self, wait_seconds: float = 0.8) -> None:
        """Stop any window; give a running analysis up to ``wait_seconds`` to finish and deliver its
        window, then terminate it. Blocks about ``wait_seconds + 0.5`` s at most. Never raises."""
        self._stopping = True  # no new window, and a window being stopped now is not exported
        prof, self._prof = self._prof, None
        if prof is not None:
            self._end_profiled(self._window_step)
            try:
                prof.stop()
            except Exception:  # noqa: BLE001
                pass
        with self._lock:
            child = self._child
        if child is not None and child.poll() is None:
            try:
                child.wait(timeout=max(0.0, wait_seconds))
            except subprocess.TimeoutExpired:
                self._closing = True  # the waiter drops the killed child's result silently
                try:
                    child.terminate()
                    child.wait(timeout=0.2)
                except Exception:  # noqa: BLE001
                    try:
                        child.kill()
                    except Exception:  # noqa: BLE001
                        pass
        if self._waiter is not None:
            self._waiter.join(timeout=0.3 if wait_seconds <= 0.8 else 5.0)  # parse + deliver the finished window
        self._closing = True


def _cuda_at_least(major: int, minor: int) -> bool:
    import torch

    try:
        got = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)
