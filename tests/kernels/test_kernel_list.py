"""One kernel list: a kernel registered once (one line in ``_KERNELS``) appears in every view derived from it,
and each kernel's declaration read from source (no torch) is the one its module holds."""

import importlib
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import mfuwatch.kernels as mk
from mfuwatch.kernels import _facts, patching, remedies, traffic


@pytest.fixture
def fake_registered(monkeypatch):
    """``fake_double`` (tests/kernels/fake_kernel.py) registered as the package's own kernels are."""
    monkeypatch.setitem(mk._KERNELS, "fake_double", "tests.kernels.fake_kernel")
    yield importlib.import_module("tests.kernels.fake_kernel")
    for name in ("double", "Doubler"):  # the package caches the names it resolved: none may outlive the test
        vars(mk).pop(name, None)


def test_a_registered_kernel_is_in_every_derived_view(fake_registered):
    fake = fake_registered
    assert mk.AVAILABLE_KERNELS[-1] == "fake_double" and patching.KERNEL_NAMES == mk.AVAILABLE_KERNELS
    assert "fake_double" in remedies.BUNDLED_KERNELS
    (entry,) = [r for r in remedies.REMEDIES if r.kernel == "fake_double"]
    assert entry.apply == 'mfuwatch.kernels.patch(model, kernels=["fake_double"])'
    kinds = [r.kind for r in remedies.REMEDIES]  # bundled entries after the first existing fixes, before detectors
    assert kinds.index("bundled") > 0 and remedies.REMEDIES[-1].detector is not None
    # bytes by hand: forward 2 passes of 5 x 8 fp32 elements; backward 2 passes + the 8-element weight once
    assert traffic.minimal_bytes("fake_double", 5, 8, 4) == 2 * 40 * 4
    assert traffic.minimal_bytes("fake_double", 5, 8, 4, backward=True) == 2 * 40 * 4 + 8 * 4
    assert entry.minimal_bytes(40, 8, 4, backward=True) == 2 * 40 * 4 + 2 * 40 * 4 + 8 * 4
    # the package's lazy names
    assert mk.double is fake.double and mk.Doubler is fake.Doubler and "Doubler" in dir(mk)
    assert "double" in mk.__all__
    # the patcher: the name is accepted and its swap rule applied; unpatch restores the module
    model = nn.Sequential(nn.Linear(3, 3), fake.UserDoubler())
    report = mk.patch(model, kernels=["fake_double"])
    assert [(s.name, s.kernel) for s in report.swapped] == [("1", "fake_double")]
    assert isinstance(model[1], fake.Doubler) and model[1].weight is not None
    assert mk.unpatch(model) == 1 and isinstance(model[1], fake.UserDoubler)
    left = mk.patch(model, kernels=["rms_norm"]).left
    assert [(x.name, x.kernel, x.reason) for x in left] == [
        ("1", "fake_double", "not requested (kernels=['rms_norm'])")]
    # the FLOPs its formula registers: 1 per element
    with FlopCounterMode(display=False) as fc:
        mk.double(torch.ones(6, 7))
    assert fc.get_total_flops() == 42


def test_an_unregistered_name_is_in_no_view():
    assert "fake_double" not in mk.AVAILABLE_KERNELS
    with pytest.raises(ValueError, match="unknown kernel 'fake_double'"):
        traffic.minimal_bytes("fake_double", 1, 1)
    with pytest.raises(ValueError, match="unknown kernel 'fake_double'"):
        mk.patch(nn.Linear(2, 2), kernels=["fake_double"])
    assert "fake_double" not in {r.kernel for r in remedies.REMEDIES}


@pytest.mark.parametrize("kernel", list(mk._KERNELS))
def test_the_declaration_read_from_source_is_the_modules_own(kernel):
    module = mk._KERNELS[kernel]
    from_source = _facts._read(importlib.util.resolve_name(module, "mfuwatch.kernels"))
    imported = importlib.import_module(module, "mfuwatch.kernels").FACTS
    assert from_source == (imported if isinstance(imported, tuple) else (imported,))
    kf = _facts.facts(kernel)
    assert kf.name == kernel and {"forward", "backward"} <= set(kf.flops)
    assert kf.remedy is None or (kf.remedy.kernel == kernel and kf.remedy.bundled)
    assert kf.patch or kf.patch_note  # patch either applies it or says why it cannot


def test_reading_every_declaration_imports_no_torch():
    code = ("import sys, mfuwatch.kernels as mk, mfuwatch.kernels._facts as f; f.all_facts(); dir(mk); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
