"""The environment the kernels run in: Triton's interpreter flag, boolean switches, and one interpreter fix.

* :data:`INTERPRET`: whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, as in CI),
  which decides where a CPU tensor goes (:func:`._launch.use_triton`).
* :func:`env_flag`: the ``MFUWATCH_KERNELS_*`` switches (each defined beside the code it switches:
  ``AUTOTUNE`` in :mod:`._tuning`, ``FAST_LAUNCH`` in :mod:`._launch`, ``COMPILE_DECOMPOSE`` in
  :mod:`._dispatch`).
* :func:`interpreter_index_fix`: applied on import, so that every kernel module (which imports this one
  through :mod:`._launch`) runs under the interpreter of Triton <= 3.6 with NumPy >= 2.4.
"""

from __future__ import annotations

import os
from typing import Any, Tuple

#: True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``),
#: read once, as Triton itself does when it decorates the kernels.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _version(mod: Any) -> Tuple[int, int]:
    """(major, minor) of a module's ``__version__``; (0, 0) when it cannot be read."""
    try:
        return tuple(int(p) for p in mod.__version__.split(".")[:2])  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - a missing or odd version string: treated as unknown
        return (0, 0)


def interpreter_index_fix() -> bool:
    """Let Triton <= 3.6's interpreter loop over runtime bounds under NumPy >= 2.4; True when applied.

    Triton's interpreter holds every scalar as a one-element NumPy array and,
    up to Triton 3.6, turns it into a Python int with ``int(array)``: a
    deprecation warning since NumPy 1.25 and a ``TypeError`` ("only
    0-dimensional arrays can be converted to Python scalars") since NumPy 2.4,
    raised by any ``for i in range(n)`` whose bound is a kernel argument. Triton
    3.7 squeezes the array first (``interpreter.py``, ``__index__`` of the
    patched tensor); this installs that same conversion on older Triton, only
    under ``TRITON_INTERPRET=1`` with NumPy >= 2.4, and changes nothing else.
    """
    if not INTERPRET:
        return False
    try:
        import numpy
        import triton
        import triton.runtime.interpreter as ti
    except Exception:  # noqa: BLE001 - no Triton or NumPy: nothing to fix
        return False
    if _version(triton) >= (3, 7) or _version(numpy) < (2, 4) or getattr(ti, "_mfuwatch_index_fix", False):
        return False
    original = getattr(ti, "_patch_lang_tensor", None)
    if original is None:
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    ti._patch_lang_tensor = patch_lang_tensor
    ti._mfuwatch_index_fix = True
    return True


interpreter_index_fix()


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment switch: 1/true/on/yes or 0/false/off/no (any case, spaces ignored).

    Unset or empty gives ``default``; any other value gives ``default`` too, with
    one warning naming the variable and the accepted values.
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    if raw:
        import warnings

        warnings.warn(f"{name}={os.environ[name]!r} is not one of {'/'.join(_ON)} or {'/'.join(_OFF)}; "
                      f"using the default ({'on' if default else 'off'})", stacklevel=2)
    return default
