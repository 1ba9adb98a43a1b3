"""Suggestion limits: no Triton drop-in suggested on the CPU, gains of one window never sum past one step."""

from __future__ import annotations

import pytest

from mfuwatch.agent.analysis.analyze import analyze_events
from tests.agent.analysis.test_suggest import PEAKS, _rms_norm_timeline


def test_cpu_window_suggests_no_bundled_triton_kernel():
    tl = _rms_norm_timeline()
    gpu = analyze_events(tl.b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=1e-3)
    assert any(s.kind == "bundled" for s in gpu.suggestions)  # the same trace on a GPU names rms_norm
    cpu = analyze_events(tl.b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=1e-3, device_type="cpu")
    assert [s.kernel for s in cpu.suggestions if s.kind == "bundled"] == []  # patch() refuses them on the CPU


def test_gains_against_a_too_short_step_time_are_scaled_to_fit_one_step():
    tl = _rms_norm_timeline()
    ok = analyze_events(tl.b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=1e-3)
    raw = {s.kernel: s.expected_gain for s in ok.suggestions}
    short = analyze_events(tl.b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=1e-3 / 1.6)
    got = {s.kernel: s.expected_gain for s in short.suggestions}
    assert set(got) == set(raw)
    # each gain would be 1.6x its value at 1 ms (each below 100%), but their sum passes 100%: scaled to fit
    assert max(raw.values()) * 1.6 < 1.0
    total_unscaled = sum(g * 1.6 for g in raw.values())
    assert total_unscaled > 1.0
    assert sum(got.values()) == pytest.approx(1.0)
    for k in raw:
        assert got[k] == pytest.approx(raw[k] * 1.6 / total_unscaled)
