"""One peak path: the agent, the profiler window's child process and `mfuwatch analyze` get the same
:class:`Peaks` for the same GPU from :func:`mfuwatch.agent.device.peaks.resolve_peaks`, PCI id first."""

from __future__ import annotations

import json

import pytest

from mfuwatch.agent.analysis.analyze import main as analyze_main
from mfuwatch.agent.device.peak_choice import PeakSettings, choose_mfu_peak
from mfuwatch.agent.device.peaks import Peaks, resolve_peaks
from mfuwatch.agent.live.profiler import ProfilerSampler
from tests.helpers.traces import TRACES

LLAMA = str(TRACES / "llama_bf16_eager.json.gz")  # its deviceProperties name is "NVIDIA H200"
TABLE = PeakSettings(user_peak=None, calibrate=False, device_type="cuda")


def _no_calibration(key):
    raise AssertionError(f"the table path calibrated ({key})")


def _agent_peaks(name: str, pci: int):
    """The agent's peaks for a CUDA GPU called ``name`` whose NVML PCI id is ``pci``, and its bf16 MFU peak:
    the resolver the agent calls with NVML's id, then the one peak choice (no GPU, no Agent needed)."""
    gpu = resolve_peaks(name, pci, warn=True)
    value, _ = choose_mfu_peak(TABLE, "bf16", gpu, _no_calibration)
    return gpu, value


def _child_peaks(peaks: Peaks, tmp_path) -> dict:
    """What the profiler window's child analyses with, read back by `mfuwatch analyze --peaks`."""
    sampler = ProfilerSampler(every_steps=1, device="cpu", peaks=peaks, on_window=lambda w: None,
                              on_error=lambda c, e: None)
    path = tmp_path / "peaks.json"
    path.write_text(json.dumps(sampler.child_peaks().to_dict()))
    sampler.close()
    return path


def _analyze(args, capsys) -> dict:
    assert analyze_main([LLAMA, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["analysis"]["peaks"]


def test_pci_id_path_is_the_same_peaks_for_agent_window_and_analyze(tmp_path, capsys):
    # CUDA names both H200 variants "NVIDIA H200"; NVML's PCI id 0x233B is the NVL (835.5 TFLOP/s dense bf16)
    peaks, mfu_peak = _agent_peaks("NVIDIA H200", 0x233B10DE)
    expected = resolve_peaks(pci_device_id=0x233B)
    assert peaks == expected and peaks.name == "NVIDIA H200 NVL"
    assert mfu_peak == pytest.approx(835.5e12)
    window = _analyze(["--peaks", str(_child_peaks(peaks, tmp_path))], capsys)
    assert window == expected.to_dict()
    assert _analyze(["--gpu", "NVIDIA H200 NVL"], capsys) == expected.to_dict()


def test_name_path_is_the_same_peaks_for_agent_window_and_analyze(tmp_path, capsys):
    peaks, mfu_peak = _agent_peaks("NVIDIA H200", 0x2335)  # the SXM's id, same row as its name
    expected = resolve_peaks(name="NVIDIA H200")
    assert peaks == expected and peaks.name == "NVIDIA H200 SXM" and mfu_peak == pytest.approx(989.4e12)
    assert _analyze(["--peaks", str(_child_peaks(peaks, tmp_path))], capsys) == expected.to_dict()
    assert _analyze([], capsys) == expected.to_dict()  # analyze reads the trace's deviceProperties name


def test_unknown_gpu_gives_the_agent_no_mfu_and_analyze_an_error(caplog, capsys):
    peaks, mfu_peak = _agent_peaks("NVIDIA Quantum Z1", 0x7FFF10DE)
    assert peaks is None and mfu_peak is None
    assert sum("NVIDIA Quantum Z1" in r.getMessage() for r in caplog.records) == 1
    assert analyze_main([LLAMA, "--gpu", "NVIDIA Quantum Z1"]) == 1
    assert "not in the peak table" in capsys.readouterr().err


def test_the_choice_waits_for_the_dtype_and_calibrates_in_it():
    calls = []
    measure = lambda key: calls.append(key) or {"bf16": 2.0e11, "fp32": 5.0e10}[key]  # noqa: E731
    cal = PeakSettings(user_peak=None, calibrate=True, device_type="cuda")
    assert choose_mfu_peak(cal, None, None, measure) == (None, "") and calls == []  # before the first forward
    assert choose_mfu_peak(cal, "bf16", None, measure) == (2.0e11, "calibrated (bf16 matmul)")
    assert choose_mfu_peak(cal, "fp32", None, measure) == (5.0e10, "calibrated (fp32 matmul)")
    assert calls == ["bf16", "fp32"]
    no_model = PeakSettings(user_peak=None, calibrate=True, device_type="cpu", has_model=False)
    assert choose_mfu_peak(no_model, None, None, measure) == (5.0e10, "calibrated (fp32 matmul)")


def test_the_user_peak_wins_and_nothing_is_measured():
    user = PeakSettings(user_peak=123.0e12, calibrate=True, device_type="cuda")
    gpu = resolve_peaks(name="NVIDIA H200")
    assert choose_mfu_peak(user, None, gpu, _no_calibration) == (123.0e12, "user (peak_flops)")
    assert choose_mfu_peak(user, "fp8", gpu, _no_calibration) == (123.0e12, "user (peak_flops)")


def test_the_table_path_by_dtype():
    gpu = resolve_peaks(name="NVIDIA H200")
    assert choose_mfu_peak(TABLE, None, gpu, _no_calibration) == (None, "")  # waits for the dtype
    assert choose_mfu_peak(TABLE, "bf16", gpu, _no_calibration) == (pytest.approx(989.4e12), gpu.source)
    assert choose_mfu_peak(TABLE, "tf32", gpu, _no_calibration) == (pytest.approx(494.7e12), gpu.source)
    a100 = resolve_peaks(name="NVIDIA A100-SXM4-80GB")
    assert choose_mfu_peak(TABLE, "fp8", a100, _no_calibration) == (None, a100.source)  # no fp8 unit
    cpu = PeakSettings(user_peak=None, calibrate=False, device_type="cpu")
    assert choose_mfu_peak(cpu, "fp32", None, _no_calibration) == (None, "none")
    with pytest.raises(ValueError, match="fp64"):
        choose_mfu_peak(TABLE, "fp64", gpu, _no_calibration)


def test_calibrate_under_bf16_autocast_measures_bf16_and_again_when_the_dtype_changes(monkeypatch):
    """Issue 24: calibrate=True under bf16 autocast measured an fp32 matmul at start-up (MFU 6.63 on an H200)."""
    import torch

    from mfuwatch.agent import Agent
    from mfuwatch.agent.device import calibrate

    monkeypatch.setattr(calibrate, "_measured", {})
    calls = []
    figures = {"bf16": 4.0e11, "fp32": 1.0e11}
    monkeypatch.setattr(calibrate, "calibrate_matmul", lambda device, key: calls.append(key) or figures[key])
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = Agent(model, opt, config=dict(exporter=False, nvml=False, alerts=False, profile_every="off",
                                      calibrate=True, report_every_steps=1000))
    try:
        assert calls == [] and a.run_info.peak_flops_per_second is None  # nothing measured before the dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 8)).float().sum().backward()
        opt.step()
        assert calls == ["bf16"] and a.run_info.dtype == "bf16"
        assert a.run_info.peak_flops_per_second == 4.0e11 and a.run_info.peak_source == "calibrated (bf16 matmul)"
        model(torch.randn(4, 8)).sum().backward()  # autocast off: the matmuls now run in fp32
        opt.step()
        assert calls == ["bf16", "fp32"] and a.run_info.dtype == "fp32"
        assert a.run_info.peak_flops_per_second == 1.0e11 and a.run_info.peak_source == "calibrated (fp32 matmul)"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 8)).float().sum().backward()
        assert calls == ["bf16", "fp32"] and a.run_info.peak_flops_per_second == 4.0e11  # taken once per dtype
    finally:
        a.close()
