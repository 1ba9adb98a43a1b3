"""profile_every is honoured while an analysis is still running: windows keep their cadence, one trace
waits for the running analysis, further ones are counted as ``skipped_busy``; the child runs in its own
session (a Ctrl-C in the terminal does not reach it)."""

from __future__ import annotations

import threading

import torch

from mfuwatch.agent.live import profiler as profiler_mod
from mfuwatch.agent.device.peaks import Peaks
from mfuwatch.agent.live.profiler import ProfilerSampler
from tests.agent.test_profiler import _loop

PEAKS = Peaks(peak_flops={"fp32": 1e11}, memory_bandwidth_bytes_per_second=1e10)


class HangingChild:
    """A stand-in for the analysis child: runs until released, then exits 1 (its window counts as 'error')."""

    def __init__(self, release: threading.Event) -> None:
        self.release, self.returncode = release, None

    def communicate(self, timeout=None):
        self.release.wait(timeout)
        self.returncode = 1
        return b"", b"released"

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self.release.wait(timeout)
        return self.returncode

    def terminate(self):
        self.release.set()

    kill = terminate


def test_windows_keep_their_cadence_while_an_analysis_runs(monkeypatch):
    release = threading.Event()
    launched = []

    def fake_popen(cmd, **kwargs):
        launched.append(kwargs)
        return HangingChild(release)

    monkeypatch.setattr(profiler_mod.subprocess, "Popen", fake_popen)
    errors = []
    sampler = ProfilerSampler(every_steps=5, warmup_steps=0, active_steps=1, device=torch.device("cpu"),
                              peaks=PEAKS, on_window=lambda w: None, on_error=lambda c, e: errors.append(e))
    step = _loop()
    try:
        for i in range(1, 31):  # windows due at steps 5, 10, 15, 20, 25, 30
            step()
            sampler.on_step(i, 0.01)
        assert len(launched) == 1  # the first analysis still runs: one at a time
        assert sampler._pending is not None  # the second window's trace waits for it
        assert sampler.windows["skipped_busy"] >= 3  # the windows after it were recorded on cadence, then dropped
        assert launched[0].get("start_new_session") is True  # Ctrl-C goes to the training process only
        release.set()
        for _ in range(100):
            if len(launched) == 2:
                break
            threading.Event().wait(0.05)
        assert len(launched) == 2  # the waiting trace was analysed as soon as the first analysis ended
    finally:
        release.set()
        sampler.close()
