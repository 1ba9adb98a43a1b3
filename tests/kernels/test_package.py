"""The package namespace: cheap to import, lazy attributes, the names the alerts print."""

import importlib
import subprocess
import sys

import mfuwatch.kernels as mk


def test_import_loads_neither_torch_nor_triton():
    code = ("import sys, mfuwatch.kernels as mk, mfuwatch.kernels.traffic; "
            "assert mk.AVAILABLE_KERNELS == ('rms_norm', 'layer_norm', 'add_rms_norm', 'swiglu', 'geglu', 'rotary', 'cross_entropy'); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_lazy_names_resolve_to_the_functions_and_classes():
    for stem in ("rms_norm", "layer_norm", "add_rms_norm"):  # a submodule of the same name as the
        module = importlib.import_module(f"mfuwatch.kernels.{stem}")  # function must not shadow it
        assert getattr(mk, stem) is getattr(module, stem) and callable(getattr(mk, stem)), stem
    assert mk.rms_norm.__module__ == "mfuwatch.kernels.rms_norm"
    from mfuwatch.kernels import rms_norm  # the from-import gives the function too
    assert rms_norm is mk.rms_norm
    # the old module names still resolve, to the renamed modules
    assert mk.rmsnorm is importlib.import_module("mfuwatch.kernels.rms_norm")
    assert mk.layernorm.layer_norm is mk.layer_norm
    for name in ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "geglu", "patch", "unpatch"):
        assert callable(getattr(mk, name)), name
    for name in ("RMSNorm", "LayerNorm", "SwiGLUMLP", "GeGLUMLP"):
        assert isinstance(getattr(mk, name), type), name
    from mfuwatch.kernels._facts import facts

    for kernel in mk.AVAILABLE_KERNELS:  # each kernel's public names (the rotary kernel's functional is apply_rotary)
        assert set(facts(kernel).exports) <= set(dir(mk)), kernel
    try:
        mk.no_such_kernel
    except AttributeError as exc:
        assert "no_such_kernel" in str(exc)
    else:
        raise AssertionError("unknown attribute did not raise")
