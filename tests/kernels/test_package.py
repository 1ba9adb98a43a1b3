"""The package namespace: cheap to import, lazy attributes, the names the alerts print."""

import importlib
import subprocess
import sys

import mfuwatch.kernels as mk


def test_import_loads_neither_torch_nor_triton():
    code = ("import sys, mfuwatch.kernels as mk, mfuwatch.kernels.traffic; "
            "assert mk.AVAILABLE_KERNELS == ('rms_norm', 'layer_norm', 'add_rms_norm', 'swiglu', 'geglu', 'cross_entropy'); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_lazy_names_resolve_to_the_functions_and_classes():
    importlib.import_module("mfuwatch.kernels.rmsnorm")  # a submodule import must not shadow the function

    assert callable(mk.rms_norm) and mk.rms_norm.__module__ == "mfuwatch.kernels.rmsnorm"
    for name in ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "geglu", "patch", "unpatch"):
        assert callable(getattr(mk, name)), name
    for name in ("RMSNorm", "LayerNorm", "SwiGLUMLP", "GeGLUMLP"):
        assert isinstance(getattr(mk, name), type), name
    assert set(mk.AVAILABLE_KERNELS) <= set(dir(mk))
    try:
        mk.no_such_kernel
    except AttributeError as exc:
        assert "no_such_kernel" in str(exc)
    else:
        raise AssertionError("unknown attribute did not raise")
