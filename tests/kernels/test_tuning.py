"""``_tuning``: the launch-setting tuner's choices, its shape classes, and ``gpu_ms``."""

import types

import pytest
import torch

from mfuwatch.kernels import _tuning
from mfuwatch.kernels._tuning import row_bucket, tuned
from tests.helpers.kernel_checks import DEVICE


def test_row_buckets():
    assert [row_bucket(r) for r in (0, 1, 3, 4096, 4097, 10**9)] == [1, 1, 4, 4096, 8192, 1 << 17]


class FakeBench:
    """Stands in for ``_tuning.gpu_ms``: each candidate's 'time' is looked up."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, fn, **kwargs):
        fn()
        cand = self.current
        self.calls.append(cand)
        if self.times[cand] is None:
            raise RuntimeError("out of resources")
        return self.times[cand]


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(_tuning, "_TUNED", {})
    monkeypatch.setattr(_tuning, "AUTOTUNE", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return types.SimpleNamespace(type="cuda", index=0)


def run_tuner(monkeypatch, device, times, elements=1 << 22, key="k"):
    bench = FakeBench(times)
    monkeypatch.setattr(_tuning, "gpu_ms", bench)

    def launch(c):
        bench.current = c

    return tuned("test_kernel", device, key, lambda: list(times), launch, elements), bench


def test_tuner_picks_the_fastest_skips_failures_and_caches(monkeypatch, fake_cuda):
    times = {"a": 3.0, "b": None, "c": 1.0, "d": 2.0}
    best, bench = run_tuner(monkeypatch, fake_cuda, times)
    assert best == "c" and bench.calls == ["a", "b", "c", "d"]
    best, bench = run_tuner(monkeypatch, fake_cuda, times)  # cached: nothing timed again
    assert best == "c" and bench.calls == []
    best, bench = run_tuner(monkeypatch, fake_cuda, times, key="other")  # a new key is timed
    assert best == "c" and len(bench.calls) == 4
    assert ("test_kernel", 0, "k") in _tuning.tuned_settings()


def test_tuner_uses_the_default_when_it_must_not_time(monkeypatch, fake_cuda):
    times = {"a": 3.0, "c": 1.0}
    best, bench = run_tuner(monkeypatch, fake_cuda, times, elements=1000)  # too small to matter
    assert best == "a" and bench.calls == []
    best, bench = run_tuner(monkeypatch, types.SimpleNamespace(type="cpu", index=None), times)
    assert best == "a" and bench.calls == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # CUDA-graph capture
    best, bench = run_tuner(monkeypatch, fake_cuda, times)
    assert best == "a" and bench.calls == []
    monkeypatch.setattr(_tuning, "AUTOTUNE", False)
    best, bench = run_tuner(monkeypatch, fake_cuda, times)
    assert best == "a" and bench.calls == []


@pytest.mark.skipif(DEVICE != "cuda", reason="times GPU work: MFUWATCH_KERNEL_TESTS_ON_GPU=1 on a GPU machine")
def test_gpu_ms_ranks_work_by_its_size_and_counts_calls():
    small = torch.empty(1 << 18, device="cuda")
    big = torch.empty(1 << 24, device="cuda")  # 64 times the bytes: far beyond any timing noise
    calls = {"small": 0, "big": 0}

    def fill(name, t):
        calls[name] += 1
        t.fill_(1.0)

    ms_small, ms_big = _tuning.gpu_ms(lambda: fill("small", small)), _tuning.gpu_ms(lambda: fill("big", big))
    assert 0 < ms_small < ms_big
    for n in calls.values():  # a warm-up call, a sizing call, then 3 rounds of k calls, 3 <= k <= 200
        assert (n - 2) % 3 == 0 and 3 <= (n - 2) // 3 <= 200, calls
    # 64 MB written: no faster than a generous 10 TB/s
    assert ms_big >= (big.numel() * 4) / 10e12 * 1e3


def test_gpu_ms_raises_what_the_launch_raises(monkeypatch):
    def broken():
        raise RuntimeError("out of resources")

    with pytest.raises(RuntimeError, match="out of resources"):
        _tuning.gpu_ms(broken)
