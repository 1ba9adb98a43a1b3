"""CPU ranks of one job share one calibrated peak, so identical ranks report the same MFU."""

from __future__ import annotations

import multiprocessing as mp

from mfuwatch.agent import Agent
from mfuwatch.agent.device import calibrate as peak_table
from mfuwatch.agent.device.calib_cache import shared_value


def _rank(key, cache, q):
    import os
    import random
    import time

    os.environ["MFUWATCH_CACHE_DIR"] = cache

    def measure():
        time.sleep(0.3)  # a calibration takes a while; the other rank arrives meanwhile
        return random.SystemRandom().random()

    q.put(shared_value(key, measure))


def test_two_processes_get_one_value(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=("job-1|host", str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert got[0] == got[1]


def test_agents_of_two_cpu_ranks_report_the_same_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("MFUWATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_table, "_measured", {})  # nothing measured yet in this process
    calls = iter([1.0e11, 2.5e11, 4.0e11])  # each calibration would give another value
    monkeypatch.setattr(peak_table, "calibrate_matmul", lambda device, dtype: next(calls))
    base = dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="ddp-cpu", calibrate=True,
                world_size=2, flops_per_step=1e9)
    a0 = Agent(config=dict(base, rank=0))
    a1 = Agent(config=dict(base, rank=1, local_rank=1))
    try:
        assert a0.run_info.peak_flops_per_second == a1.run_info.peak_flops_per_second == 1.0e11
    finally:
        a0.close()
        a1.close()


def test_window_calibration_of_cpu_ranks_is_shared(tmp_path, monkeypatch):
    import torch

    from mfuwatch.agent.live import profiler as profiler_mod

    monkeypatch.setenv("MFUWATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_table, "_measured", {})
    monkeypatch.setattr(peak_table, "calibrate_bandwidth", lambda device: 3.0e10)  # this rank would measure...
    monkeypatch.setattr(peak_table, "calibrate_matmul", lambda device, dtype: 9.0e10)
    share = "job|host"
    cpu = torch.device("cpu")
    shared_value(f"calibration|{share}|cpu|bandwidth", lambda: 2.0e10)  # ...but rank 0 measured first
    shared_value(f"calibration|{share}|cpu|fp32", lambda: 5.0e10)
    s = profiler_mod.ProfilerSampler(every_steps=5, device=cpu, on_window=lambda w: None,
                                     on_error=lambda c, e: None, shared_key=share)
    p = s.child_peaks()
    assert p.memory_bandwidth_bytes_per_second == 2.0e10 and p.peak_flops == {"fp32": 5.0e10}
    assert p.name == "cpu" and p.source == "calibrated"


def test_the_mfu_peak_and_the_window_share_one_calibration(tmp_path, monkeypatch):
    """One path, one key: the MFU calibration of an fp32 run is the window's fp32 matmul figure."""
    import torch

    from mfuwatch.agent.live import profiler as profiler_mod

    monkeypatch.setenv("MFUWATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_table, "_measured", {})
    calls = []
    monkeypatch.setattr(peak_table, "calibrate_matmul", lambda device, dtype: calls.append(dtype) or 7.0e10)
    monkeypatch.setattr(peak_table, "calibrate_bandwidth", lambda device: 4.0e10)
    a = Agent(config=dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="one-key",
                          calibrate=True, flops_per_step=1e9))
    try:
        s = profiler_mod.ProfilerSampler(every_steps=5, device=torch.device("cpu"), on_window=lambda w: None,
                                         on_error=lambda c, e: None)
        assert s.child_peaks().peak_flops == {"fp32": 7.0e10}
        assert a.run_info.peak_flops_per_second == 7.0e10 and a.run_info.peak_source == "calibrated (fp32 matmul)"
        assert calls == ["fp32"]  # measured once in this process, for both
    finally:
        a.close()
