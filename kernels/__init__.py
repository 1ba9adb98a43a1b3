"""mfuwatch.kernels: Triton fused kernels for the memory-bound ops of transformer training.

Functional ops, ``nn.Module`` drop-ins, and
``patch(model, kernels=[...])``, which swaps the recognised modules of one
model for the fused ones::

    import mfuwatch.kernels
    report = mfuwatch.kernels.patch(model, kernels=["rms_norm", "swiglu"])
    print(report)                       # what was swapped, what was left and why
    mfuwatch.kernels.unpatch(model)     # the original modules back

One file stem per op (``rms_norm.py`` holds ``rms_norm``, ``RMSNormFunction``
and ``RMSNorm``), ``patching.py`` for :func:`patch`, ``registry.py`` for the
suggestions table the agent reads (op pattern -> remedy) and ``traffic.py``
for the bytes each kernel must move. A name that is both a function and a submodule (``rms_norm``,
``layer_norm``, ``add_rms_norm``) is always the function here, even after the submodule is
imported; reach the module with ``from mfuwatch.kernels.rms_norm import ...``
or ``importlib.import_module("mfuwatch.kernels.rms_norm")``.

Importing this package is cheap: torch and triton load only when one of the
names below is first used (PEP 562 module ``__getattr__``), so
``mfuwatch.kernels.registry`` and ``mfuwatch.kernels.traffic`` can be read by
the ``mfuwatch analyze`` command without a GPU stack.
"""

from __future__ import annotations

import importlib
import sys
import types

#: Kernel names accepted by :func:`patch` (and used by the suggestions registry).
AVAILABLE_KERNELS = ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "geglu", "rotary", "cross_entropy")

_LAZY = {
    "rms_norm": ".rms_norm",
    "RMSNorm": ".rms_norm",
    "RMSNormFunction": ".rms_norm",
    "layer_norm": ".layer_norm",
    "LayerNorm": ".layer_norm",
    "LayerNormFunction": ".layer_norm",
    "add_rms_norm": ".add_rms_norm",
    "AddRMSNormFunction": ".add_rms_norm",
    "swiglu": ".glu",
    "geglu": ".glu",
    "SwiGLUMLP": ".glu",
    "GeGLUMLP": ".glu",
    "GLUFunction": ".glu",
    "apply_rotary": ".rotary",
    "RotaryFunction": ".rotary",
    "cross_entropy": ".cross_entropy",
    "CrossEntropyLoss": ".cross_entropy",
    "linear_cross_entropy": ".linear_cross_entropy",
    "LinearCrossEntropyLoss": ".linear_cross_entropy",
    "patch": ".patching",
    "unpatch": ".patching",
    "PatchReport": ".patching",
    "minimal_bytes": ".traffic",
}

#: Module names before the stems followed the op names, kept as attributes (``from mfuwatch.kernels import
#: rmsnorm`` still works; ``import mfuwatch.kernels.rmsnorm`` does not).
_RENAMED = {"rmsnorm": ".rms_norm", "layernorm": ".layer_norm", "add_rmsnorm": ".add_rms_norm"}

__all__ = ["AVAILABLE_KERNELS", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif name in _RENAMED:
        value = importlib.import_module(_RENAMED[name], __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """The package's module type: importing submodule ``rms_norm`` (or ``patch``) binds the package attribute
    of that name to the function it holds, not to the module, as the import system would otherwise do."""

    def __setattr__(self, name: str, value) -> None:
        if (name in _LAZY and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}" and hasattr(value, name)):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
