"""What :func:`~.patching.patch` and the kernels' patch rules share: the report types, the
:class:`Candidate` a swap rule returns, and the two checks a rule may run (probe tolerance, device).

A kernel's patch rule lives in the module its ``FACTS.patch`` names (:mod:`._facts`) and is one of:

* a **swap rule**: ``swap_candidate(module) -> Optional[Candidate]``, asked of every submodule of the model
  (in the order of the kernel list; the first rule that returns a :class:`Candidate` owns the module).
  :mod:`.patching` then checks, probes and swaps the module (:mod:`.rms_norm`, :mod:`.layer_norm`,
  :mod:`.glu`);
* a **wiring rule**: ``patch_model(model, wanted, verify, report, **options)`` and
  ``unpatch_model(model) -> int``, for kernels wired into the model's own forward instead of a module swap
  (:mod:`._hf_rotary`, :mod:`._hf_lm_head`). ``options`` are :func:`~.patching.patch`'s rule keywords, the
  same to every wiring rule (today ``lm_head_mode``, which :mod:`._hf_lm_head` reads); a rule takes those it
  knows and ignores the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._env import INTERPRET

#: probe tolerance on max|a - b| / (1 + max|a|), per dtype
_TOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def tolerance(dtype: torch.dtype) -> float:
    """Probe tolerance for outputs of ``dtype``: max|a - b| / (1 + max|a|) at most this (3e-2 if unlisted)."""
    return _TOL.get(dtype, 3e-2)


def device_reason(p: torch.Tensor) -> Optional[str]:
    """Why the Triton kernels cannot take a module whose first parameter is ``p``, or None."""
    if not (p.is_cuda or p.device.type == "meta" or (INTERPRET and p.device.type == "cpu")):
        return (f"on {p.device}: the Triton kernels need a CUDA device "
                "(TRITON_INTERPRET=1 runs them on the CPU, slowly)")
    if not p.is_floating_point() or p.dtype == torch.float64:
        return f"dtype {p.dtype} is not fp32/fp16/bf16"
    return None


@dataclass
class Candidate:
    """What a swap rule says about one module it recognises.

    ``kernel`` labels it in the report (a kernel name, or e.g. ``"swiglu or geglu"`` when no kernel fits);
    ``requested_by`` are the kernel names whose request makes it a candidate (default: ``(kernel,)``);
    ``builders`` build replacements to try in order (each returns a new module sharing the original's
    parameters), or None when it cannot be swapped, with ``reason``; ``probe_shape`` is the shape of the
    probe input (:func:`~.patching.patch` with ``verify=True``).
    """

    kernel: str
    builders: Optional[Sequence[Callable[[], nn.Module]]]
    reason: str = ""
    probe_shape: Tuple[int, ...] = ()
    requested_by: Tuple[str, ...] = ()

    def requested(self, wanted: Sequence[str]) -> bool:
        """Whether one of the kernels this candidate concerns is in ``wanted``."""
        return any(k in wanted for k in (self.requested_by or (self.kernel,)))


@dataclass
class Swapped:
    """One module replaced: its dotted name, the two class names and the kernel used."""

    name: str
    original: str
    replacement: str
    kernel: str


@dataclass
class Left:
    """One candidate module left in place, and why."""

    name: str
    module: str
    kernel: str
    reason: str


@dataclass
class PatchReport:
    """What :func:`~.patching.patch` did. ``str(report)`` is a readable table."""

    swapped: List[Swapped] = field(default_factory=list)
    left: List[Left] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def count(self, kernel: Optional[str] = None) -> int:
        """Number of swapped modules (for one kernel, or all)."""
        return sum(1 for s in self.swapped if kernel is None or s.kernel == kernel)

    def __str__(self) -> str:
        lines = [f"mfuwatch.kernels.patch: {len(self.swapped)} swapped, {len(self.left)} left"]
        lines += [f"  swapped  {s.name}: {s.original} -> {s.replacement} ({s.kernel})" for s in self.swapped]
        lines += [f"  left     {s.name}: {s.module} ({s.kernel}): {s.reason}" for s in self.left]
        lines += [f"  note     {n}" for n in self.notes]
        return "\n".join(lines)


def not_requested(wanted: Sequence[str]) -> str:
    """The reason recorded for a candidate whose kernel was not requested."""
    return f"not requested (kernels={list(wanted)})"
