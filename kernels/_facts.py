"""What each bundled kernel declares about itself, and how the package reads those declarations (no torch).

Every op module declares its kernel(s) in one ``FACTS`` assignment beside its ``autograd.Function``
(:class:`KernelFacts`: the bytes the fused op must move, its FLOPs per element, the profiled op pattern it
replaces, where its patch rule is), and ``mfuwatch.kernels._KERNELS`` lists each kernel once, with the module
that declares it. Everything that enumerates kernels is derived from that list and those declarations:
``AVAILABLE_KERNELS`` and the lazy names of :mod:`mfuwatch.kernels`, :func:`~.traffic.minimal_bytes`, the
bundled entries of :data:`~.remedies.REMEDIES`, the names :func:`~.patching.patch` accepts and the rules it
applies, and the FLOP counts the ops register (:mod:`._flops`). Adding a kernel: docs/kernels.md.

Reading a declaration does not import the op module (which imports torch and triton and registers custom
ops): :func:`facts` parses the module's source and evaluates the right-hand side of its ``FACTS = ...``
with only the names of :data:`DECLARATION_NAMES` in scope (no builtins), so that ``mfuwatch analyze``
and the agent's suggestions read the remedies table without a GPU stack. A module already imported is read
from its ``FACTS`` attribute, the same value. So ``FACTS`` must be one expression built from those names,
strings, numbers, tuples and dicts (no other name of the module).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

_PACKAGE = __name__.rpartition(".")[0]


def aten(*names: str) -> Tuple[str, ...]:
    """Profiler op names of ATen ops: ``aten("mul", "mul_")`` -> ``("aten::mul", "aten::mul_")``."""
    return tuple("aten::" + n for n in names)


def patch_line(kernel: str) -> str:
    """The one line that applies a bundled kernel: ``mfuwatch.kernels.patch(model, kernels=["<kernel>"])``."""
    return f'mfuwatch.kernels.patch(model, kernels=["{kernel}"])'


@dataclass(frozen=True)
class Step:
    """One element of a :attr:`Remedy.sequence`: an op whose name is in ``ops``."""

    ops: Tuple[str, ...]
    optional: bool = False
    gap: int = 0  # unrelated top-level ops allowed before this step (not claimed)
    claim: bool = True


@dataclass(frozen=True)
class Remedy:
    """A remedy for a profiled op pattern (:mod:`.remedies` gives every field's meaning)."""

    kernel: str  # short id; the Suggestion's ``kernel`` and the metric label
    title: str
    kind: str  # "existing" | "bundled"
    apply: str  # the one line that applies it
    replaces: str  # the op pattern in words, for docs and tables
    sequence: Tuple[Step, ...] = ()
    region: Optional[str] = None  # regex on a user_annotation name
    exclude: Tuple[str, ...] = ()  # ops that show the remedy is already in use
    detector: Optional[str] = None
    anchor_op: Optional[str] = None
    anchor_arg: int = 0
    anchor_sum: bool = False
    passes_forward: float = 2.0
    passes_backward: float = 3.0
    keeps_flops: bool = False
    views: Tuple[str, ...] = ()  # view ops inside the pattern whose backward the replacement also removes
    returns_input_layout: bool = False  # the replacement's backward writes input gradients in the inputs' layout
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("existing", "bundled"):
            raise ValueError(f"Remedy {self.kernel!r}: kind must be 'existing' or 'bundled', got {self.kind!r}")
        if self.kind == "bundled" and self.kernel not in kernel_names():
            raise ValueError(f"Remedy {self.kernel!r} is marked bundled but mfuwatch.kernels.AVAILABLE_KERNELS "
                             f"has only {sorted(kernel_names())}")

    @property
    def bundled(self) -> bool:
        """True when the remedy is a Triton kernel shipped in :mod:`mfuwatch.kernels`."""
        return self.kind == "bundled"

    def minimal_bytes(self, numel: int, hidden: int, itemsize: int, *, backward: bool) -> float:
        """Bytes the replacement must move for an anchor of ``numel`` elements (last dim ``hidden``)
        of ``itemsize`` bytes, forward plus backward when ``backward``.

        Bundled kernels: the kernel's declared bytes (:meth:`KernelFacts.minimal_bytes`, rows = numel / hidden).
        Existing fixes: ``(passes_forward + passes_backward) × numel × itemsize``.
        """
        if self.bundled:
            rows, hidden = (numel // hidden, hidden) if hidden > 0 else (numel, 1)
            kf = facts(self.kernel)
            total = kf.minimal_bytes(rows, hidden, itemsize)
            if backward:
                total += kf.minimal_bytes(rows, hidden, itemsize, backward=True)
            return float(total)
        return (self.passes_forward + (self.passes_backward if backward else 0.0)) * numel * itemsize


@dataclass(frozen=True)
class Bytes:
    """Bytes one pass (forward or backward) of a fused kernel must move, for a ``rows x hidden`` input
    of ``b`` bytes per element and a weight/bias vector of ``hidden`` elements of ``wb`` bytes:
    ``activations * rows * hidden * b + weights * hidden * wb`` (each tensor read or written counted once;
    per-row statistics and fp32 partial sums are implementation details, left out)."""

    activations: int
    weights: int = 0


@dataclass(frozen=True)
class KernelFacts:
    """One bundled kernel, as its op module declares it (``FACTS = KernelFacts(...)``).

    Fields:
        name: the kernel's name (what ``patch(model, kernels=[...])`` takes, the remedy's id).
        forward, backward: the minimal bytes of each pass (:class:`Bytes`).
        flops: FLOPs per element (of the input the op module's FLOP formula names) by case;
            ``"forward"`` and ``"backward"`` always, other cases as the op has them
            (``"forward_no_weight"``, ``"forward_softcap"``, ...). The counting convention: :mod:`._flops`.
        remedy: the profiled op pattern it replaces (a ``kind="bundled"`` :class:`Remedy`), or None.
        exports: the names :mod:`mfuwatch.kernels` serves from the declaring module (functional, module,
            ``autograd.Function``); ``exports_from`` maps other modules (``".stem"``) to names served from them.
        patch: the module (``".stem"``) holding the kernel's patch rule, or None (no module pattern); a rule
            module defines ``swap_candidate(module)`` or ``patch_model(model, wanted, verify, report,
            **options)`` with ``unpatch_model(model)`` (:mod:`._patch_types`, :mod:`.patching`).
        patch_note: what ``patch`` notes when the kernel is requested and has no rule.
    """

    name: str
    forward: Bytes
    backward: Bytes
    flops: Mapping[str, int]
    remedy: Optional[Remedy] = None
    exports: Tuple[str, ...] = ()
    exports_from: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    patch: Optional[str] = None
    patch_note: str = ""

    def minimal_bytes(self, rows: int, hidden: int, dtype_bytes: int = 2, *, backward: bool = False,
                      weight_bytes: Optional[int] = None) -> int:
        """Bytes of one pass for a ``rows x hidden`` input (see :class:`Bytes`); ``weight_bytes`` defaults
        to ``dtype_bytes``."""
        b = self.backward if backward else self.forward
        wb = dtype_bytes if weight_bytes is None else weight_bytes
        return b.activations * rows * hidden * dtype_bytes + b.weights * hidden * wb


#: The names a ``FACTS`` expression may use.
DECLARATION_NAMES = {"KernelFacts": KernelFacts, "Bytes": Bytes, "Remedy": Remedy, "Step": Step, "aten": aten,
                     "patch_line": patch_line}

_CACHE: Dict[str, Tuple[KernelFacts, ...]] = {}
_LOCK = threading.Lock()


def registered() -> Dict[str, str]:
    """The kernel list (``mfuwatch.kernels._KERNELS``): kernel name -> declaring module, in patch order."""
    return sys.modules[_PACKAGE]._KERNELS


def kernel_names() -> Tuple[str, ...]:
    """The bundled kernels' names, in the order of the kernel list."""
    return tuple(registered())


def facts(name: str) -> KernelFacts:
    """The declaration of kernel ``name``. Raises ValueError for a name not in the kernel list (the accepted
    names are given) and LookupError when its module declares no ``FACTS`` entry of that name."""
    module = registered().get(name)
    if module is None:
        raise ValueError(f"unknown kernel {name!r}; accepted: {', '.join(kernel_names())}")
    for kf in declared(module):
        if kf.name == name:
            return kf
    raise LookupError(f"{module} declares no kernel {name!r} in its FACTS")


def all_facts() -> Tuple[KernelFacts, ...]:
    """Every registered kernel's declaration, in the order of the kernel list."""
    return tuple(facts(n) for n in kernel_names())


def declared(module: str) -> Tuple[KernelFacts, ...]:
    """The ``FACTS`` of ``module`` (relative to this package, ``".rms_norm"``, or absolute) as a tuple; from the
    module itself when it is imported, else from its source without importing it (see the module docstring)."""
    name = importlib.util.resolve_name(module, _PACKAGE)
    mod = sys.modules.get(name)
    if mod is not None and hasattr(mod, "FACTS"):
        value = mod.FACTS
        return value if isinstance(value, tuple) else (value,)
    with _LOCK:
        if name not in _CACHE:
            _CACHE[name] = _read(name)
        return _CACHE[name]


def _read(name: str) -> Tuple[KernelFacts, ...]:
    spec = importlib.util.find_spec(name)
    source = spec.loader.get_source(name) if spec is not None and spec.loader is not None else None
    if source is None:  # no source to read (e.g. a bytecode-only install): import the module
        value = importlib.import_module(name).FACTS
        return value if isinstance(value, tuple) else (value,)
    for node in ast.parse(source, spec.origin).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FACTS" for t in node.targets):
            code = compile(ast.Expression(node.value), spec.origin, "eval")
            value = eval(code, {"__builtins__": {}}, dict(DECLARATION_NAMES))  # noqa: S307 - declaration names only
            return value if isinstance(value, tuple) else (value,)
    raise LookupError(f"{spec.origin} has no top-level FACTS = ... declaration")
