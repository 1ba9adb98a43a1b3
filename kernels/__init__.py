"""mfuwatch.kernels: Triton fused kernels for the memory-bound ops of transformer training.

Functional ops, ``nn.Module`` drop-ins, and
``patch(model, kernels=[...])``, which swaps the recognised modules of one
model for the fused ones::

    import mfuwatch.kernels
    report = mfuwatch.kernels.patch(model, kernels=["rms_norm", "swiglu"])
    print(report)                       # what was swapped, what was left and why
    mfuwatch.kernels.unpatch(model)     # the original modules back

Importing this package is cheap: torch and triton load only when one of the
names below is first used (PEP 562 module ``__getattr__``), so
``mfuwatch.kernels.registry`` and ``mfuwatch.kernels.traffic`` can be read by
the ``mfuwatch analyze`` command without a GPU stack.
"""

from __future__ import annotations

import importlib

#: Kernel names accepted by :func:`patch` (and used by the suggestions registry).
AVAILABLE_KERNELS = ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "geglu", "cross_entropy")

_LAZY = {
    "rms_norm": ".rmsnorm",
    "RMSNorm": ".rmsnorm",
    "RMSNormFunction": ".rmsnorm",
    "layer_norm": ".layernorm",
    "LayerNorm": ".layernorm",
    "LayerNormFunction": ".layernorm",
    "add_rms_norm": ".add_rmsnorm",
    "AddRMSNormFunction": ".add_rmsnorm",
    "swiglu": ".glu",
    "geglu": ".glu",
    "SwiGLUMLP": ".glu",
    "GeGLUMLP": ".glu",
    "GLUFunction": ".glu",
    "cross_entropy": ".cross_entropy",
    "CrossEntropyLoss": ".cross_entropy",
    "linear_cross_entropy": ".linear_cross_entropy",
    "LinearCrossEntropyLoss": ".linear_cross_entropy",
    "patch": ".patching",
    "unpatch": ".patching",
    "PatchReport": ".patching",
    "minimal_bytes": ".traffic",
}

__all__ = ["AVAILABLE_KERNELS", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
