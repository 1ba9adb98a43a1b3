"""``patch(model, kernels=...)``: swap recognised modules of one model instance for fused drop-ins.

Only the given model object changes (its child modules are replaced in their
parents); no class or function is monkey-patched globally. What is recognised:

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

from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _hf_rotary
from ._common import INTERPRET
from .glu import GeGLUMLP, SwiGLUMLP
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm

KERNEL_NAMES = ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "geglu", "rotary", "cross_entropy")
_ORIGINAL = "_mfuwatch_original"
_OURS = (RMSNorm, LayerNorm, SwiGLUMLP, GeGLUMLP)
_ACT_ATTRS = ("act_fn", "act", "activation_fn", "activation")
#: Kernel label of a gated MLP that neither GLU kernel can take (an activation other than SiLU or GELU): it is
#: reported as left whenever either GLU kernel is requested.
ANY_GLU = "swiglu or geglu"
_GELU_TANH_NAMES = ("PytorchGELUTanh", "GELUTanh", "NewGELUActivation", "GELUPytorchTanh", "GeluTanh")
#: probe tolerance on max|a - b| / (1 + max|a|), per dtype
_TOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 5e-3, torch.bfloat16: 3e-2}


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
    """What :func:`patch` did. ``str(report)`` is a readable table."""

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
    if not err <= _TOL.get(dtype, 3e-2):
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


def _rms_candidates(m: nn.Module) -> Tuple[Optional[List[Callable[[], nn.Module]]], str]:
    """Builders of RMSNorm replacements to try in order, or (None, reason)."""
    if hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm):
        def build():
            new = RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta", casting="fp32")
            if m.weight is not None:
                new.weight = m.weight
            return new
        return [build], ""
    w = getattr(m, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return None, "no 1-D `weight` parameter"
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(eps, (int, float)):
        return None, "no float `variance_epsilon`/`eps` attribute"
    if len(list(m.parameters(recurse=False))) != 1 or len(list(m.buffers(recurse=False))) != 0:
        return None, "has parameters or buffers besides `weight`"
    variants = [(0.0, "llama"), (1.0, "fp32")]
    if "gemma" in _cls(m).lower():
        variants.reverse()

    def builder(offset, casting):
        def build():
            new = RMSNorm(w.shape[0], float(eps), device="meta", offset=offset, casting=casting)
            new.weight = w
            return new
        return build
    return [builder(o, c) for o, c in variants], ""


def _glu_of(act) -> Tuple[str, Optional[str], str]:
    """(kernel, GELU approximation or None, "") for an activation a GLU kernel computes, else (ANY_GLU, None,
    reason). ``act`` is a module (``nn.SiLU``, ``nn.GELU``, Hugging Face's activation classes) or a function
    (``torch.nn.functional.silu`` / ``gelu``)."""
    import torch.nn.functional as F

    if act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU", "Swish"):
        return "swiglu", None, ""
    if act is F.gelu:
        return "geglu", "none", ""
    if isinstance(act, nn.GELU):
        return "geglu", getattr(act, "approximate", "none"), ""
    name = type(act).__name__
    if name in _GELU_TANH_NAMES:
        return "geglu", "tanh", ""
    if name == "GELUActivation":
        return "geglu", "none", ""
    label = getattr(act, "__name__", None) if callable(act) and not isinstance(act, nn.Module) else None
    return ANY_GLU, None, f"activation {label or name} has no fused kernel"


def _mlp_candidate(m: nn.Module) -> Tuple[Optional[str], Optional[Callable[[], nn.Module]], str]:
    """(kernel, builder, "") for a gated MLP, or (kernel or None, None, reason).

    The activation decides the kernel; an activation without one is the reason reported, before any
    other (e.g. a dropout submodule), so that the report names the real blocker.
    """
    if not all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")):
        return None, None, ""
    act = next((getattr(m, a) for a in _ACT_ATTRS if getattr(m, a, None) is not None), None)
    if act is None:
        return ANY_GLU, None, f"no activation attribute among {_ACT_ATTRS}"
    kind, approx, reason = _glu_of(act)
    if reason:
        return kind, None, reason
    g, u, d = m.gate_proj, m.up_proj, m.down_proj
    act_attr = next(a for a in _ACT_ATTRS if getattr(m, a, None) is act)
    extra = [n for n, _c in m.named_children() if n not in ("gate_proj", "up_proj", "down_proj", act_attr)]
    if extra:  # e.g. a dropout: identity in eval mode, so the probe would pass, and lost after .train()
        return kind, None, f"it has submodules the fused MLP would drop: {', '.join(extra)}"
    if kind == "swiglu":
        return "swiglu", lambda: SwiGLUMLP.from_linears(g, u, d), ""
    return "geglu", lambda: GeGLUMLP.from_linears(g, u, d, approximate=approx), ""


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
    if kernels is None:
        return KERNEL_NAMES
    if isinstance(kernels, str):
        kernels = [kernels]
    out = tuple(kernels)
    for k in out:
        if k not in KERNEL_NAMES:
            import difflib

            near = difflib.get_close_matches(k, KERNEL_NAMES, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown kernel {k!r}{hint}; accepted: {', '.join(KERNEL_NAMES)}")
    return out


def patch(model: nn.Module, kernels: Optional[Sequence[str]] = None, *, verify: bool = True,
          lm_head_mode: str = "chunked") -> PatchReport:
    """Swap the recognised modules of ``model`` (in place) for their fused drop-ins.

    Args:
        model: any ``nn.Module``; only this instance's submodules change.
        kernels: names from :data:`KERNEL_NAMES` (``mfuwatch.kernels.AVAILABLE_KERNELS``),
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
    if "add_rms_norm" in wanted:
        report.notes.append("add_rms_norm has no module pattern (the residual add is in the decoder layer's "
                            "forward): call mfuwatch.kernels.add_rms_norm(x, residual, weight) in model code")
    plan = []
    for name, m in list(model.named_modules()):
        if isinstance(m, _OURS) or any(name.startswith(p + ".") for p, _k, _b in plan if p):
            continue
        if isinstance(m, nn.LayerNorm):
            kernel = "layer_norm"

            def build(m=m):
                new = LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, bias=m.bias is not None,
                                device="meta")
                if m.weight is not None:
                    new.weight = m.weight
                if m.bias is not None:
                    new.bias = m.bias
                return new
            builders, reason = [build], ""
        elif (hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm)) or _cls(m).lower().endswith("rmsnorm"):
            kernel = "rms_norm"
            builders, reason = _rms_candidates(m)
        else:
            kernel, b, reason = _mlp_candidate(m)
            if kernel is None:
                continue
            builders = [b] if b is not None else None
        if kernel not in wanted and not (kernel == ANY_GLU and ("swiglu" in wanted or "geglu" in wanted)):
            report.left.append(Left(name, _cls(m), kernel, f"not requested (kernels={list(wanted)})"))
            continue
        if builders is None:
            report.left.append(Left(name, _cls(m), kernel, reason))
            continue
        plan.append((name, kernel, (m, builders)))

    for name, kernel, (m, builders) in plan:
        reason = _check_swappable(name, m)
        new = None
        if reason is None:
            p = _first_param(m)
            # a parameter-free norm runs wherever its input is: probe it where the kernels run
            dev, dt = (p.device, p.dtype) if p is not None else (_probe_device(), torch.float32)
            for build in builders:
                cand = build()
                cand.train(m.training)
                if hasattr(cand, "gate_proj"):
                    shape = (4, cand.gate_proj.in_features)
                else:
                    shape = (4, *cand.normalized_shape)
                reason = _probe(m, cand, shape, dt, dev) if verify else None
                if reason is None:
                    new = cand
                    break
        if new is None:
            report.left.append(Left(name, _cls(m), kernel, reason))
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        object.__setattr__(new, _ORIGINAL, m)
        setattr(parent, child, new)
        report.swapped.append(Swapped(name, _cls(m), "mfuwatch.kernels." + _cls(new), kernel))
    _patch_rotary(model, "rotary" in wanted, verify, wanted, report)
    # ---- cross_entropy: the LM head + loss of Hugging Face causal LMs (the wiring is in _hf_lm_head)
    if "cross_entropy" in wanted:
        from ._hf_lm_head import patch_lm_heads

        patch_lm_heads(model, report, lm_head_mode)
    return report


def _patch_rotary(model: nn.Module, requested: bool, verify: bool, wanted, report: PatchReport) -> None:
    """Wire the fused rotary into the Hugging Face attention modules of ``model`` (see :mod:`._hf_rotary`)."""
    for name, m in _hf_rotary.candidates(model):
        if not requested:
            report.left.append(Left(name, _cls(m), "rotary", f"not requested (kernels={list(wanted)})"))
            continue
        reason = _hf_rotary.wire(name, m, verify, lambda dt: _TOL.get(dt, 3e-2), _device_reason)
        if reason is None:
            report.swapped.append(Swapped(name, f"{_cls(m)}.forward: {_hf_rotary.GLOBAL}",
                                          "mfuwatch.kernels.apply_rotary", "rotary"))
        else:
            report.left.append(Left(name, _cls(m), "rotary", reason))


def _device_reason(p: torch.Tensor) -> Optional[str]:
    """Why the Triton kernels cannot take a module whose first parameter is ``p``, or None."""
    if not (p.is_cuda or p.device.type == "meta" or (INTERPRET and p.device.type == "cpu")):
        return (f"on {p.device}: the Triton kernels need a CUDA device "
                "(TRITON_INTERPRET=1 runs them on the CPU, slowly)")
    if not p.is_floating_point() or p.dtype == torch.float64:
        return f"dtype {p.dtype} is not fp32/fp16/bf16"
    return None


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
    return _device_reason(p) or _hooked(m)


def unpatch(model: nn.Module) -> int:
    """Put back every module :func:`patch` replaced in ``model``; return how many.

    The originals get the replacement's current parameters (the same objects,
    so training since the patch is kept) and training mode; attention modules wired
    to the fused rotary get their class's ``forward`` back (each counts as one).
    """
    restored = _hf_rotary.unwire(model)
    from ._hf_lm_head import unpatch_lm_heads

    restored += unpatch_lm_heads(model)
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
