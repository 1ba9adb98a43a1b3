"""``patch(model, kernels=...)``: swap recognised modules of one model instance for fused drop-ins.

Only the given model object changes (its child modules are replaced in their
parents); no class or function is monkey-patched globally. What is recognised (each row is
the patch rule its kernel's ``FACTS.patch`` names, :mod:`._patch_types`: ``swap_candidate`` of
:mod:`.rms_norm`, :mod:`.layer_norm`, :mod:`.glu`; ``patch_model`` of :mod:`._hf_rotary`,
:mod:`._hf_lm_head`):

=====================  =====================================================  ==========
kernel                 modules                                                replacement
=====================  =====================================================  ==========
``layer_norm``         ``torch.nn.LayerNorm`` (and subclasses)                 LayerNorm
``rms_norm``           ``torch.nn.RMSNorm``; ``*RMSNorm`` classes with a       RMSNorm
                       ``weight`` and ``variance_epsilon`` or ``eps``
                       (Hugging Face Llama, Mistral, Qwen, Gemma, ...)
``swiglu``             modules with ``gate_proj``/``up_proj``/``down_proj``    SwiGLUMLP
                       ``nn.Linear`` children and a SiLU ``act_fn``
``geglu``              the same with a GELU ``act_fn`` (exact or tanh)          GeGLUMLP
``add_rms_norm``       none: the residual add lives in a decoder layer's       --
                       ``forward``; call the functional from model code
``rotary``             Hugging Face attention modules whose ``forward``         the module's
                       calls ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2/3, ``forward``
                       Gemma 2/3, Phi-3, ...)                                   (instance)
``cross_entropy``      a Hugging Face ``*ForCausalLM``'s ``lm_head`` + loss     linear_cross_entropy
                       (Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3; see
                       :mod:`._hf_lm_head`)
=====================  =====================================================  ==========

For ``rotary`` the attention module stays; this instance gets a ``forward`` that calls
:func:`~mfuwatch.kernels.apply_rotary` (see :mod:`._hf_rotary`), checked against the
model's own ``apply_rotary_pos_emb`` on a probe input when ``verify=True``.

The replacement *shares* the original's parameters (the same ``Parameter``
objects, so an optimizer built before patching keeps working) and keeps its
device, dtype and training mode; ``state_dict`` keys do not change. Norms
without affine parameters (``elementwise_affine=False``) are swapped too: their
replacement has no parameters either and runs on whatever device its input is
on (the Triton kernels on CUDA, the PyTorch fallback on the CPU). With
``verify=True`` (default) each replacement is first run next to the original
on a small random input (a private generator; the global RNG is untouched) and
only swapped when the outputs agree within the dtype's tolerance; for
``*RMSNorm`` classes this check also decides between ``w`` and Gemma's
``1 + w``. Modules that look like candidates but are not swapped are listed in
the report with the reason. :func:`unpatch` puts the originals back.
"""

from __future__ import annotations

import importlib
from typing import Iterable, Optional, Sequence, Tuple

import torch
from torch import nn

from ._env import INTERPRET
from ._facts import all_facts, kernel_names
from ._patch_types import Left, PatchReport, Swapped, device_reason, not_requested, tolerance

__all__ = ["patch", "unpatch", "PatchReport", "Swapped", "Left", "KERNEL_NAMES"]

_ORIGINAL = "_mfuwatch_original"


def __getattr__(name: str):
    if name == "KERNEL_NAMES":  # the kernel list's names (mfuwatch.kernels.AVAILABLE_KERNELS), on each read
        return kernel_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cls(m: nn.Module) -> str:
    return type(m).__name__


def _probe(orig: nn.Module, repl: nn.Module, shape: Tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> Optional[str]:
    """None when ``repl`` matches ``orig`` on a random input of ``shape``, else the reason."""
    if device.type == "meta":
        return None
    gen = torch.Generator(device=device).manual_seed(1234)
    x = (torch.randn(shape, generator=gen, device=device) * 2.0).to(dtype)
    try:  # fork_rng: a dropout inside the original must not advance the caller's global RNG
        with torch.no_grad(), _fork_rng(device):
            a, b = orig(x), repl(x)
    except Exception as exc:  # noqa: BLE001 - any failure means "do not swap"
        return f"probe run failed: {type(exc).__name__}: {exc}"
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        got = (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__
        return f"probe output {got} != fused {(tuple(b.shape), b.dtype)}"
    a, b = a.double(), b.double()
    err = float((a - b).abs().max()) / (1.0 + float(a.abs().max()))
    if not err <= tolerance(dtype):
        return f"probe output differs from the fused op (relative error {err:.2e})"
    if not orig.training and _random_in_training(orig, x, device):
        return "its forward is random in training mode (a functional dropout?), which the fused op would drop"
    return None


def _fork_rng(device: torch.device):
    """``torch.random.fork_rng`` over the CPU generator and ``device``'s: a random module run by a probe leaves
    the caller's RNG streams where they were."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _random_in_training(m: nn.Module, x: torch.Tensor, device: torch.device) -> bool:
    """Whether ``m`` (in eval mode now) gives two different outputs for one input in training mode: a dropout
    written as ``F.dropout(h, p, self.training)`` is invisible to an eval-mode probe and would be lost.
    Every submodule's mode and the caller's RNG state are restored."""
    modes = [(mod, mod.training) for mod in m.modules()]
    try:
        m.train()
        with torch.no_grad(), _fork_rng(device):
            return not torch.equal(m(x), m(x))
    except Exception:  # noqa: BLE001 - a module that cannot run in training mode here: judged by eval alone
        return False
    finally:
        for mod, mode in modes:
            mod.training = mode


def _probe_device() -> torch.device:
    """Where to probe a module that has no parameters: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _first_param(m: nn.Module) -> Optional[torch.Tensor]:
    return next(iter(m.parameters()), None)


def _hooked(m: nn.Module) -> Optional[str]:
    """Why ``m`` must not be swapped because of hooks on it or on a submodule, or None.

    Hooks on a submodule (an MLP's ``act_fn``, say) would be lost with it, and the
    probe would fire hooks on shared submodules (its projections) with random data.
    """
    for sub_name, sub in m.named_modules():
        where = f" (on its submodule {sub_name})" if sub_name else ""
        if "forward" in sub.__dict__:
            return f"its forward is wrapped on the instance (e.g. an accelerate hook){where}"
        if (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                or getattr(sub, "_backward_pre_hooks", None)):
            return f"it has forward/backward hooks that the replacement would not carry{where}"
    return None


def _resolve_kernels(kernels: Optional[Iterable[str]]) -> Tuple[str, ...]:
    names = kernel_names()
    if kernels is None:
        return names
    if isinstance(kernels, str):
        kernels = [kernels]
    out = tuple(kernels)
    for k in out:
        if k not in names:
            import difflib

            near = difflib.get_close_matches(k, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown kernel {k!r}{hint}; accepted: {', '.join(names)}")
    return out


def patch(model: nn.Module, kernels: Optional[Sequence[str]] = None, *, verify: bool = True,
          lm_head_mode: str = "chunked") -> PatchReport:
    """Swap the recognised modules of ``model`` (in place) for their fused drop-ins.

    Args:
        model: any ``nn.Module``; only this instance's submodules change.
        kernels: names from ``mfuwatch.kernels.AVAILABLE_KERNELS``,
            or None for all of them.
        verify: compare each replacement with the original on a probe input
            before swapping (see the module docstring).
        lm_head_mode: the ``mode`` of :func:`~mfuwatch.kernels.linear_cross_entropy` for the LM head + loss
            (``cross_entropy``): "chunked" (default, fastest) or "recompute" (no logits in memory, one GEMM
            more: for runs short of memory).
    Returns:
        A :class:`PatchReport`: what was swapped, what was left and why.
    Raises:
        ValueError: an unknown kernel name or ``lm_head_mode`` (the accepted values are listed).
    """
    from .linear_cross_entropy import check_mode

    check_mode(lm_head_mode, "lm_head_mode")
    wanted = _resolve_kernels(kernels)
    report = PatchReport()
    swaps, wirings = _rules()
    report.notes += [kf.patch_note for kf in all_facts() if kf.name in wanted and not kf.patch and kf.patch_note]
    plan = []
    for name, m in list(model.named_modules()):
        if _ours(m) or any(name.startswith(p + ".") for p, _c, _m in plan if p):
            continue
        cand = next((c for c in (rule.swap_candidate(m) for rule in swaps) if c is not None), None)
        if cand is None:
            continue
        if not cand.requested(wanted):
            report.left.append(Left(name, _cls(m), cand.kernel, not_requested(wanted)))
            continue
        if cand.builders is None:
            report.left.append(Left(name, _cls(m), cand.kernel, cand.reason))
            continue
        plan.append((name, cand, m))

    for name, cand, m in plan:
        reason = _check_swappable(name, m)
        new = None
        if reason is None:
            p = _first_param(m)
            # a parameter-free norm runs wherever its input is: probe it where the kernels run
            dev, dt = (p.device, p.dtype) if p is not None else (_probe_device(), torch.float32)
            for build in cand.builders:
                repl = build()
                repl.train(m.training)
                reason = _probe(m, repl, cand.probe_shape, dt, dev) if verify else None
                if reason is None:
                    new = repl
                    break
        if new is None:
            report.left.append(Left(name, _cls(m), cand.kernel, reason))
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        object.__setattr__(new, _ORIGINAL, m)
        setattr(parent, child, new)
        report.swapped.append(Swapped(name, _cls(m), "mfuwatch.kernels." + _cls(new), cand.kernel))
    for rule in wirings:  # rotary (the attention forward), cross_entropy (the LM head + loss, in lm_head_mode)
        rule.patch_model(model, wanted, verify, report, lm_head_mode=lm_head_mode)
    return report


def _rules() -> Tuple[list, list]:
    """(swap rules, wiring rules): the patch-rule modules the kernels' ``FACTS`` name, each once, in the order
    of the kernel list (see :mod:`._patch_types`)."""
    swaps, wirings = [], []
    for module in dict.fromkeys(kf.patch for kf in all_facts() if kf.patch):
        rule = importlib.import_module(module, __package__)
        (swaps if hasattr(rule, "swap_candidate") else wirings).append(rule)
    return swaps, wirings


def _ours(m: nn.Module) -> bool:
    """Whether ``m`` is one of this package's modules or a subclass of one (a drop-in: nothing to swap)."""
    return any(c.__module__.startswith(__package__ + ".") for c in type(m).__mro__)


def _check_swappable(name: str, m: nn.Module) -> Optional[str]:
    if not name:
        return "it is the model itself; use the fused module directly"
    p = _first_param(m)
    if p is None:
        if len(list(m.buffers())) == 0 and hasattr(m, "normalized_shape"):
            # a norm without affine parameters: the replacement follows its input's device
            if not (torch.cuda.is_available() or INTERPRET):
                return ("no parameters, and no CUDA device here: the Triton kernels need one "
                        "(TRITON_INTERPRET=1 runs them on the CPU, slowly)")
            return _hooked(m)
        return "it has no parameters to infer device and dtype from"
    return device_reason(p) or _hooked(m)


def unpatch(model: nn.Module) -> int:
    """Put back every module :func:`patch` replaced in ``model``; return how many.

    The originals get the replacement's current parameters (the same objects,
    so training since the patch is kept) and training mode; attention modules wired
    to the fused rotary get their class's ``forward`` back (each counts as one).
    """
    restored = sum(rule.unpatch_model(model) for rule in _rules()[1])
    for name, m in list(model.named_modules()):
        orig = m.__dict__.get(_ORIGINAL)
        if orig is None or not name:
            continue
        for pname, param in m.named_parameters(recurse=False):
            setattr(orig, pname, param)
        for cname, child in m.named_children():
            setattr(orig, cname, child)
        orig.train(m.training)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, orig)
        restored += 1
    return restored
