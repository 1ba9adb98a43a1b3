"""Tests for mfuwatch.agent.device.peaks: the GPU table, name/id matching, dtype keys, calibration."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mfuwatch.agent.device import calibrate, peaks
from mfuwatch.agent.device.peaks import DTYPES, GpuSpec, lookup

# NVML names (as nvidia-smi / nvmlDeviceGetName print them) -> the row each must resolve to.
NVML_NAMES = {
    "NVIDIA A100-SXM4-40GB": "NVIDIA A100 SXM4 40GB",
    "NVIDIA A100-SXM4-80GB": "NVIDIA A100 SXM4 80GB",
    "NVIDIA A100-PCIE-40GB": "NVIDIA A100 PCIe 40GB",
    "NVIDIA A100 80GB PCIe": "NVIDIA A100 PCIe 80GB",
    "NVIDIA H100 80GB HBM3": "NVIDIA H100 SXM5 80GB",
    "NVIDIA H100 PCIe": "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL": "NVIDIA H100 NVL",
    "NVIDIA H200": "NVIDIA H200 SXM",
    "NVIDIA H200 NVL": "NVIDIA H200 NVL",
    "NVIDIA B200": "NVIDIA B200",
    "NVIDIA GB200": "NVIDIA GB200",
    "NVIDIA L4": "NVIDIA L4",
    "NVIDIA L40S": "NVIDIA L40S",
    "NVIDIA A10G": "NVIDIA A10G",
}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    peaks._warned.clear()
    yield
    peaks._warned.clear()


def test_h200_by_name_matches_datasheet_dense_values():
    spec = lookup(name="NVIDIA H200")
    assert spec is not None and spec.name == "NVIDIA H200 SXM"
    # Datasheet prints tensor rates with 2:4 sparsity; dense is half of them.
    assert spec.peak_flops["bf16"] == pytest.approx(1979e12 / 2, rel=1e-3)
    assert spec.peak_flops["tf32"] == pytest.approx(989e12 / 2, rel=1e-3)
    assert spec.peak_flops["fp8"] == pytest.approx(3958e12 / 2, rel=1e-3)
    assert spec.peak_flops["fp32"] == pytest.approx(67e12, rel=0.01)
    assert spec.memory_bandwidth_bytes_per_second == pytest.approx(4.8e12)


@pytest.mark.parametrize("pci", [0x2335, 0x233510DE])
def test_h200_by_pci_id_16_and_32_bit(pci):
    spec = lookup(pci_device_id=pci)
    assert spec is not None and spec.name == "NVIDIA H200 SXM"


def test_pci_id_of_other_vendor_is_not_matched():
    assert lookup(pci_device_id=0x23351002) is None  # device 0x2335 but vendor AMD


def test_pci_id_wins_over_name_and_unknown_id_falls_back_to_name():
    assert lookup(name="NVIDIA H200", pci_device_id=0x233B).name == "NVIDIA H200 NVL"
    assert lookup(name="NVIDIA L4", pci_device_id=0xFFFE).name == "NVIDIA L4"


@pytest.mark.parametrize("nvml_name,row", sorted(NVML_NAMES.items()))
def test_every_listed_gpu_resolves(nvml_name, row):
    spec = lookup(name=nvml_name)
    assert spec is not None, nvml_name
    assert spec.name == row
    # The same row by its id, where the table lists one.
    for dev_id in spec.pci_device_ids:
        assert lookup(pci_device_id=(dev_id << 16) | 0x10DE) is spec


def test_longer_alias_wins():
    assert lookup(name="NVIDIA H200 NVL").name == "NVIDIA H200 NVL"
    assert lookup(name="NVIDIA H200").name == "NVIDIA H200 SXM"
    assert lookup(name="NVIDIA H200 141GB HBM3e NVL").name == "NVIDIA H200 NVL"  # words in another order
    assert lookup(name="NVIDIA H100 NVL").name == "NVIDIA H100 NVL"
    assert lookup(name="nvidia h100-pcie").name == "NVIDIA H100 PCIe"


def _row(name, aliases):
    flops = {k: 1e12 for k in DTYPES}
    return GpuSpec(name=name, aliases=aliases, pci_device_ids=[], peak_flops=flops,
                   memory_bandwidth_bytes_per_second=1e12, source="test")


def test_precedence_and_ties_on_a_custom_table():
    base, nvl, other = _row("X9", ["Acme X9"]), _row("X9 NVL", ["Acme X9 NVL"]), _row("Y1", ["X9 Turbo"])
    table = [base, nvl, other]
    assert lookup(name="Acme X9 NVL", table=table) is nvl  # 2 words beat 1
    assert lookup(name="Acme X9", table=table) is base
    # "X9 Turbo" (2 words, row Y1) beats the name "X9" (1 word, row X9).
    assert lookup(name="X9 Turbo", table=table) is other
    # Two rows matching with aliases of equal length: ambiguous, no guess.
    assert lookup(name="X9 NVL Turbo", table=table) is None


@pytest.mark.parametrize("name", [
    "NVIDIA GH200 480GB",  # not H200
    "NVIDIA H100",  # 0x2339, an H100 variant the table does not list
    "NVIDIA L40",  # not L40S
    "NVIDIA A10",  # not A10G
    "NVIDIA A100",  # which A100?
    "Tesla V100-SXM2-16GB",
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb",  # a MIG slice has a fraction of the peak
    "",
])
def test_unknown_gpu_is_none(name):
    assert lookup(name=name) is None


def test_unknown_gpu_gets_no_peak_and_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="mfuwatch.agent.device.peaks")
    for _ in range(3):
        assert peaks.resolve_peaks(name="NVIDIA GH200 480GB", pci_device_id=0x234210DE) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1
    assert "NVIDIA GH200 480GB" in msgs[0] and "0x2342" in msgs[0] and "peak_flops=" in msgs[0]
    assert peaks.mfu_peak(None, "bf16") == (None, "")


def test_resolve_peaks_is_the_table_row_in_base_units():
    p = peaks.resolve_peaks(name="NVIDIA H200")
    # the datasheet's H200 SXM column, dense: 989.4 TFLOP/s bf16, 66.9 fp32, 4.8 TB/s
    assert p.name == "NVIDIA H200 SXM" and "datasheet" in p.source
    assert p.peak_flops["bf16"] == pytest.approx(989.4e12) and p.peak_flops["fp32"] == pytest.approx(66.9e12)
    assert p.memory_bandwidth_bytes_per_second == pytest.approx(4.8e12)
    assert p.balance("bf16", True) == pytest.approx(989.4e12 / 4.8e12)
    assert peaks.mfu_peak(p, "bf16") == (pytest.approx(989.4e12), p.source)
    assert peaks.mfu_peak(p, "tf32")[0] == pytest.approx(494.7e12)


def test_resolve_peaks_takes_the_pci_id_before_the_name():
    # CUDA calls both H200 variants "NVIDIA H200"; the NVL's PCI id 0x233B picks its own row
    p = peaks.resolve_peaks(name="NVIDIA H200", pci_device_id=0x233B10DE)
    assert p.name == "NVIDIA H200 NVL" and p.peak_flops["bf16"] == pytest.approx(835.5e12)
    assert peaks.resolve_peaks(name="NVIDIA L4", pci_device_id=0xFFFE).name == "NVIDIA L4"  # unknown id: name


def test_resolve_peaks_flags_override_and_replace_the_row():
    p = peaks.resolve_peaks(name="NVIDIA H200", peak_flops={"bf16": 900e12})
    assert p.peak_flops["bf16"] == 900e12 and p.peak_flops["fp32"] == pytest.approx(66.9e12)  # one key overridden
    q = peaks.resolve_peaks(name="Acme X9", peak_flops={"fp32": 2e11}, memory_bandwidth_bytes_per_second=2e10)
    assert (q.peak_flops, q.memory_bandwidth_bytes_per_second, q.name, q.source) == ({"fp32": 2e11}, 2e10,
                                                                                      "Acme X9", "flags")
    with pytest.raises(ValueError, match="peak_flops"):
        peaks.resolve_peaks(name="NVIDIA H200", peak_flops={"int8": 1e15})


def test_peaks_round_trip_through_their_one_serialised_form():
    p = peaks.resolve_peaks(name="NVIDIA H200", pci_device_id=0x233B, measured_bandwidth_bytes_per_second=4.1e12,
                            fp32_matmul="tf32")
    assert peaks.Peaks.from_any(json.loads(json.dumps(p.to_dict()))) == p
    assert peaks.Peaks.from_any(lookup(name="NVIDIA H200 NVL")) == peaks.resolve_peaks(pci_device_id=0x233B)


def test_fp8_on_ampere_is_none_with_source(caplog):
    caplog.set_level(logging.WARNING, logger="mfuwatch.agent.device.peaks")
    p = peaks.resolve_peaks(name="NVIDIA A100-SXM4-80GB")
    for _ in range(2):
        flops, source = peaks.mfu_peak(p, "fp8")
    assert flops is None and "A100" in source
    assert len(caplog.records) == 1


@pytest.mark.parametrize("torch_dtype,autocast,tf32,key", [
    (torch.float32, None, False, "fp32"),
    (torch.float32, None, True, "tf32"),
    (torch.float32, torch.bfloat16, True, "bf16"),  # autocast decides the matmul dtype
    (torch.float32, torch.float16, False, "fp16"),
    (torch.bfloat16, None, True, "bf16"),
    (torch.float8_e4m3fn, None, False, "fp8"),
    ("bfloat16", None, False, "bf16"),
    ("float32", "bf16", False, "bf16"),
])
def test_training_dtype_key(torch_dtype, autocast, tf32, key):
    assert peaks.training_dtype_key(torch_dtype, autocast, tf32) == key


def test_training_dtype_key_rejects_other_dtypes():
    with pytest.raises(ValueError, match="int64"):
        peaks.training_dtype_key(torch.int64)


def test_torch_allows_tf32_follows_torch_settings():
    saved_flag = torch.backends.cuda.matmul.allow_tf32
    saved_prec = torch.get_float32_matmul_precision()
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert peaks.torch_allows_tf32() is False
        torch.set_float32_matmul_precision("high")
        assert peaks.torch_allows_tf32() is True
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = True
        assert peaks.torch_allows_tf32() is True
    finally:
        torch.set_float32_matmul_precision(saved_prec)
        torch.backends.cuda.matmul.allow_tf32 = saved_flag


def test_every_row_is_complete():
    table = peaks.load_table()
    assert len(table) >= 14
    names = [s.name for s in table]
    assert len(set(names)) == len(names)
    seen_ids = set()
    for spec in table:
        assert spec.source.strip(), spec.name
        assert set(spec.peak_flops) == set(DTYPES), spec.name
        for key, value in spec.peak_flops.items():
            if value is None:
                assert key == "fp8" and ("A100" in spec.name or "A10G" in spec.name), (spec.name, key)
            else:
                assert 1e12 <= value <= 1e16, (spec.name, key, value)
        # Tensor units are never slower than the CUDA cores, and 16-bit is at least TF32.
        assert spec.peak_flops["bf16"] >= spec.peak_flops["tf32"] >= spec.peak_flops["fp32"] * 0.99, spec.name
        assert spec.peak_flops["fp16"] == spec.peak_flops["bf16"], spec.name
        assert 1e11 <= spec.memory_bandwidth_bytes_per_second <= 2e13, spec.name
        assert not (seen_ids & set(spec.pci_device_ids)), spec.name  # an id names one row
        seen_ids |= set(spec.pci_device_ids)


def test_load_table_names_the_bad_field(tmp_path):
    bad = tmp_path / "gpus.yaml"
    bad.write_text("gpus:\n  - name: Foo\n    aliases: []\n    pci_device_ids: []\n"
                   "    peak_tflops: {fp32: 1, tf32: 2, bf16: 3, fp16: 3}\n"
                   "    memory_bandwidth_tb_per_second: 1\n    source: x\n")
    with pytest.raises(ValueError, match=r"Foo.*peak_tflops.*fp8"):
        peaks.load_table(bad)
    bad.write_text(bad.read_text().replace("fp16: 3}", "fp16: 3, fp8: 6}").replace("source: x", "source: ''"))
    with pytest.raises(ValueError, match="source"):
        peaks.load_table(bad)


def test_machine_balance_h200():
    spec = lookup(name="NVIDIA H200")
    # docs/architecture.md: about 989 TFLOP/s / 4.8 TB/s ~ 206 FLOP/B.
    assert peaks.machine_balance(spec, "bf16") == pytest.approx(989.4 / 4.8, rel=1e-6)
    assert peaks.machine_balance(spec, "bf16", unit="cuda") == pytest.approx(66.9 / 4.8, rel=1e-6)
    with pytest.raises(ValueError, match="unit"):
        peaks.machine_balance(spec, "bf16", unit="simd")
    with pytest.raises(ValueError, match="fp8"):
        peaks.machine_balance(lookup(name="NVIDIA A100-SXM4-80GB"), "fp8")


def test_calibrate_matmul_on_cpu_is_plausible():
    flops = calibrate.calibrate_matmul("cpu", torch.float32)
    assert 1e8 <= flops <= 1e13


def test_calibrate_bandwidth_on_cpu_is_plausible():
    bw = calibrate.calibrate_bandwidth("cpu")
    assert 1e8 <= bw <= 1e13
