"""mfuwatch.kernels: Triton fused kernels for the memory-bound ops of transformer training.

Functional ops, ``nn.Module`` drop-ins, and
``patch(model, kernels=[...])``, which swaps the recognised modules of one
model for the fused ones::

    import mfuwatch.kernels
    report = mfuwatch.kernels.patch(model, kernels=["rms_norm", "swiglu"])
    print(report)                       # what was swapped, what was left and why
    mfuwatch.kernels.unpatch(model)     # the original modules back

One file stem per op (``rms_norm.py`` holds ``rms_norm``, ``RMSNormFunction``
and ``RMSNorm``, and its ``FACTS``: bytes, FLOPs, remedy pattern, patch rule),
``patching.py`` for :func:`patch`, ``remedies.py`` for the table the agent
reads (op pattern -> remedy) and ``traffic.py`` for the bytes each kernel must
move; :data:`_KERNELS` below is the one list of kernels. A name that is both a function and a submodule (``rms_norm``,
``layer_norm``, ``add_rms_norm``) is always the function here, even after the submodule is
imported; reach the module with ``from mfuwatch.kernels.rms_norm import ...``
or ``importlib.import_module("mfuwatch.kernels.rms_norm")``.

Importing this package is cheap: torch and triton load only when one of the
names below is first used (PEP 562 module ``__getattr__``), so
``mfuwatch.kernels.remedies`` and ``mfuwatch.kernels.traffic`` can be read by
the ``mfuwatch analyze`` command without a GPU stack.
"""

from __future__ import annotations

import importlib
import sys
import types

#: The bundled kernels, in the order :func:`patch` applies them: each kernel's name and the module whose
#: ``FACTS`` declares it (its bytes, FLOPs, remedy pattern and patch rule: :mod:`._facts`). Every list of
#: kernels (``AVAILABLE_KERNELS``, the names below, the remedies table, patch's rules, the byte counts) is
#: derived from this one; adding a kernel is one line here (docs/kernels.md, "Adding a kernel").
_KERNELS = {
    "rms_norm": ".rms_norm",
    "layer_norm": ".layer_norm",
    "add_rms_norm": ".add_rms_norm",
    "swiglu": ".glu",
    "geglu": ".glu",
    "rotary": ".rotary",
    "cross_entropy": ".cross_entropy",
}

#: Names served from modules that declare no kernel.
_TOOLS = {"patch": ".patching", "unpatch": ".patching", "PatchReport": ".patching", "minimal_bytes": ".traffic"}


def _lazy() -> dict:
    """Public name -> module, from each kernel's declared exports (read without importing torch) and :data:`_TOOLS`."""
    from ._facts import declared

    out = {}
    for module in dict.fromkeys(_KERNELS.values()):
        for kf in declared(module):
            out.update({n: module for n in kf.exports})
            for other, names in kf.exports_from.items():
                out.update({n: other for n in names})
    out.update(_TOOLS)
    return out


#: Module names before the stems followed the op names, kept as attributes (``from mfuwatch.kernels import
#: rmsnorm`` still works; ``import mfuwatch.kernels.rmsnorm`` does not).
_RENAMED = {"rmsnorm": ".rms_norm", "layernorm": ".layer_norm", "add_rmsnorm": ".add_rms_norm"}


def __getattr__(name: str):
    if name == "AVAILABLE_KERNELS":  # derived on each read: the kernel list is the one place
        return tuple(_KERNELS)
    if name == "__all__":
        return ["AVAILABLE_KERNELS", *_lazy()]
    module = _TOOLS.get(name) or (_lazy().get(name) if not name.startswith("__") else None)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif name in _RENAMED:
        value = importlib.import_module(_RENAMED[name], __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_lazy()) | {"AVAILABLE_KERNELS"})


class _Package(types.ModuleType):
    """The package's module type: importing submodule ``rms_norm`` (or ``patch``) binds the package attribute
    of that name to the function it holds, not to the module, as the import system would otherwise do."""

    def __setattr__(self, name: str, value) -> None:
        if (isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}" and hasattr(value, name)
                and name in _lazy()):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
