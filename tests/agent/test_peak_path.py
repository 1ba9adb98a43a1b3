"""One peak path: the agent, the profiler window's child process and `mfuwatch analyze` get the same
:class:`Peaks` for the same GPU from :func:`mfuwatch.agent.device.peaks.resolve_peaks`, PCI id first."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mfuwatch.agent import Agent
from mfuwatch.agent.analysis.analyze import main as analyze_main
from mfuwatch.agent.device.peaks import Peaks, resolve_peaks
from mfuwatch.agent.live.profiler import ProfilerSampler
from tests.helpers.traces import TRACES

LLAMA = str(TRACES / "llama_bf16_eager.json.gz")  # its deviceProperties name is "NVIDIA H200"
BASE = dict(exporter=False, nvml=False, alerts=False, profile_every="off", report_every_steps=1000)


def _agent_peaks(name: str, pci: int):
    """The agent's peaks for a CUDA GPU called ``name`` whose NVML PCI id is ``pci`` (no GPU needed)."""
    a = Agent(config=dict(BASE))
    try:
        a.device = torch.device("cuda", 0)
        a.run_info.gpu_name = name
        a.nvml = SimpleNamespace(pci_device_id=pci)
        a._resolve_gpu_peaks()
        a._dtype_key = "bf16"
        a._choose_mfu_peak()
        return a.gpu_peaks, a.run_info.peak_flops_per_second
    finally:
        a.device, a.nvml = torch.device("cpu"), None
        a.close()


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
