"""Per-instance wiring of :func:`~mfuwatch.kernels.apply_rotary` into Hugging Face attention modules.

Hugging Face attention classes (``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``,
``Qwen3Attention``, ``Gemma2Attention``, ``Gemma3Attention``, ``Phi3Attention``, ...) call the
module-level function ``apply_rotary_pos_emb(q, k, cos, sin)`` of their modeling file from
``forward``. Replacing that global would change every model of the family in the process, so
instead the attention *instance* gets its own ``forward``: a copy of the class's function whose
globals (:func:`wired_globals`) map ``apply_rotary_pos_emb`` to the fused kernel (the decorators
around ``forward``, such as ``deprecate_kwarg``, are copied around it). The class, the modeling module
and every other instance are untouched; deleting the instance attribute restores the class's
``forward``.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._dispatch import compile_decomposes
from ._patch_types import Left, PatchReport, Swapped, device_reason, not_requested, tolerance
from .rotary import apply_rotary

GLOBAL = "apply_rotary_pos_emb"
_MARK = "_mfuwatch_rotary"


def fits(q, k, cos, unsqueeze_dim) -> bool:
    """Whether :func:`hf_apply_rotary_pos_emb` takes these shapes (else the wired module calls the original)."""
    return (cos.dim() == 3 and q.dim() == 4 and k.dim() == 4 and unsqueeze_dim in (1, 2)
            and cos.shape[-1] <= q.shape[-1] and cos.shape[-1] % 2 == 0)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` of Hugging Face on the fused kernel.

    q, k: (B, H, T, D) with ``unsqueeze_dim=1`` (every family wired here), or (B, T, H, D) with
    ``unsqueeze_dim=2``; cos, sin: (B, T, R), R <= D (Phi-3's partial rotary included).
    Returns ``(q_embed, k_embed)``. Raises what :func:`apply_rotary` raises.
    """
    if unsqueeze_dim == 2:  # (B, T, H, D): rotate the (B, H, T, D) views
        qo, ko = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2)
    return apply_rotary(q, k, cos, sin)


def _calls_rotary(fn) -> bool:
    return GLOBAL in fn.__code__.co_names and callable(fn.__globals__.get(GLOBAL))


def rotary_function(module: nn.Module) -> Optional[Callable]:
    """The function ``apply_rotary_pos_emb`` that ``type(module).forward`` calls, or None when it calls none
    (looked up through ``__wrapped__`` decorators; only classes from ``transformers.models``)."""
    if not type(module).__module__.startswith("transformers.models."):
        return None
    fn = getattr(type(module), "forward", None)
    while isinstance(fn, types.FunctionType):
        if _calls_rotary(fn):
            return fn.__globals__[GLOBAL]
        fn = getattr(fn, "__wrapped__", None)
    return None


def _copy(fn: types.FunctionType, globals_: dict, closure) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return new


_WIRED: Dict[str, types.ModuleType] = {}


def _fused_for(original: Callable) -> Callable:
    """The function a wired forward calls as ``apply_rotary_pos_emb``: the fused kernel, or ``original`` for
    shapes the kernel does not take."""
    extra = list(inspect.signature(original).parameters)[4:]  # (position_ids,) unsqueeze_dim
    at = extra.index("unsqueeze_dim") if "unsqueeze_dim" in extra else None

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        dim = kwargs.get("unsqueeze_dim", args[at] if at is not None and at < len(args) else 1)
        if not fits(q, k, cos, dim) or compile_decomposes():
            # shapes the kernel does not take (e.g. a multimodal 4-D cos), or torch.compile tracing: the model's
            # own function, so that Inductor sees the graph it sees unpatched (measured on the H200, HF Llama,
            # V = 128256: its fusion of the original ran the rotary in 1.1 ms per step, of our decomposition 2.1)
            return original(q, k, cos, sin, *args, **kwargs)
        return hf_apply_rotary_pos_emb(q, k, cos, sin, dim)

    return apply_rotary_pos_emb


def wired_globals(fn_globals: dict) -> dict:
    """The globals of a modeling module with ``apply_rotary_pos_emb`` bound to the fused kernel: the namespace of
    a module ``mfuwatch.kernels._hf_rotary.wired.<modeling module>`` (one per modeling module, made on first
    use from a copy of its globals; the modeling module itself is not changed). A registered module, not a
    bare dict, so that ``torch.compile`` can name (and guard) the globals of the forward it traces."""
    name = fn_globals["__name__"]
    mod = _WIRED.get(name)
    if mod is None:
        alias = f"{__name__}.wired.{name}"
        mod = types.ModuleType(alias)
        mod.__dict__.update(fn_globals)
        mod.__dict__.update(__name__=alias, __package__=None)
        mod.__dict__[GLOBAL] = _fused_for(fn_globals[GLOBAL])
        sys.modules[alias] = mod
        _WIRED[name] = mod
    return mod.__dict__


def _rebind(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` (and of the decorator wrappers around the function that calls :data:`GLOBAL`) whose
    globals are :func:`wired_globals`. Raises ValueError when a wrapper does not hold its wrapped function in a
    closure."""
    if _calls_rotary(fn):
        return _copy(fn, wired_globals(fn.__globals__), fn.__closure__)
    inner = getattr(fn, "__wrapped__", None)
    if not isinstance(inner, types.FunctionType):
        raise ValueError(f"{fn.__qualname__} neither calls {GLOBAL} nor wraps a function that does")
    new_inner = _rebind(inner)
    cells, found = [], False
    for c in fn.__closure__ or ():
        try:
            held = c.cell_contents
        except ValueError:  # an empty cell
            held = None
        if held is inner:
            cells.append(types.CellType(new_inner))
            found = True
        else:
            cells.append(c)
    if not found:
        raise ValueError(f"the decorator around {inner.__qualname__} does not keep it in a closure")
    new = _copy(fn, fn.__globals__, tuple(cells))
    new.__wrapped__ = new_inner
    return new


def _probe(original: Callable, head_dim: int, p: torch.Tensor, tol: float) -> Optional[str]:
    """None when :func:`hf_apply_rotary_pos_emb` matches ``original`` on a random input, else the reason."""
    if p.device.type == "meta":
        return None
    gen = torch.Generator(device=p.device).manual_seed(1234)
    q, k = (torch.randn((1, h, 3, head_dim), generator=gen, device=p.device).to(p.dtype) for h in (2, 1))
    cos, sin = (torch.randn((1, 3, head_dim), generator=gen, device=p.device).to(p.dtype) for _ in range(2))
    try:
        with torch.no_grad():
            want = original(q, k, cos, sin)
            got = hf_apply_rotary_pos_emb(q, k, cos, sin)
    except Exception as exc:  # noqa: BLE001 - any failure means "do not wire"
        return f"probe run failed: {type(exc).__name__}: {exc}"
    for a, b in zip(want, got):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"probe output {(tuple(a.shape), a.dtype)} != fused {(tuple(b.shape), b.dtype)}"
        err = float((a.double() - b.double()).abs().max()) / (1.0 + float(a.double().abs().max()))
        if not err <= tol:
            return f"probe output differs from the fused op (relative error {err:.2e})"
    return None


def candidates(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of the attention modules whose class calls a Hugging Face ``apply_rotary_pos_emb``."""
    return [(n, m) for n, m in model.named_modules() if n and rotary_function(m) is not None]


def wire(name: str, m: nn.Module, verify: bool, tol: Callable[[torch.dtype], float],
         device_reason: Callable[[torch.Tensor], Optional[str]]) -> Optional[str]:
    """Give attention module ``m`` a ``forward`` that calls the fused rotary; None when done, else why not."""
    if m.__dict__.get(_MARK):
        return "already wired to mfuwatch.kernels.apply_rotary"
    if "forward" in m.__dict__:
        return "its forward is wrapped on the instance (e.g. an accelerate hook)"
    p = next(iter(m.parameters()), None)
    if p is None:
        return "it has no parameters to infer device and dtype from"
    reason = device_reason(p)
    if reason is not None:
        return reason
    head_dim = getattr(m, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        return "no even int `head_dim` attribute"
    original = rotary_function(m)
    if verify:
        reason = _probe(original, head_dim, p, tol(p.dtype))
        if reason is not None:
            return reason

    try:
        forward = _rebind(type(m).forward)
    except ValueError as exc:
        return str(exc)
    m.forward = types.MethodType(forward, m)
    m.__dict__[_MARK] = True
    return None


def patch_model(model: nn.Module, wanted: Sequence[str], verify: bool, report: PatchReport, **_options) -> None:
    """The ``rotary`` patch rule (:mod:`._patch_types`): wire every candidate attention module of ``model``
    when ``"rotary"`` is in ``wanted``, and record in ``report`` what was wired or left, and why (none of
    :func:`~.patching.patch`'s rule options concerns it)."""
    for name, m in candidates(model):
        if "rotary" not in wanted:
            report.left.append(Left(name, type(m).__name__, "rotary", not_requested(wanted)))
            continue
        reason = wire(name, m, verify, tolerance, device_reason)
        if reason is None:
            report.swapped.append(Swapped(name, f"{type(m).__name__}.forward: {GLOBAL}",
                                          "mfuwatch.kernels.apply_rotary", "rotary"))
        else:
            report.left.append(Left(name, type(m).__name__, "rotary", reason))


def unpatch_model(model: nn.Module) -> int:
    """The ``rotary`` unpatch rule: give every attention module :func:`wire` changed its class's ``forward``
    back; return how many."""
    n = 0
    for m in model.modules():
        if m.__dict__.pop(_MARK, False):
            m.__dict__.pop("forward", None)
            n += 1
    return n
