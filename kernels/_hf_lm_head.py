"""``patch(model, kernels=["cross_entropy"])`` for Hugging Face causal LMs: the LM head + loss through
:func:`mfuwatch.kernels.linear_cross_entropy` on this model instance only.

Recognised: ``*ForCausalLM`` models whose ``config.model_type`` is in :data:`FAMILIES` (Llama, Mistral,
Qwen2/3, Gemma 1/2/3 with Gemma 2/3's ``final_logit_softcapping``, Phi-3), with an ``nn.Linear``
``lm_head``, a ``model`` base module and transformers' default causal-LM loss (``ForCausalLMLoss``).

What changes, on the instance only (no class or function of transformers is touched):

* ``lm_head`` becomes an :class:`LMHead` holding the *same* ``weight`` (and ``bias``) ``Parameter``
  objects, so ``state_dict`` keys, tied embeddings and optimizers built earlier are unchanged. Called
  normally it computes ``F.linear`` exactly as ``nn.Linear`` does (generation, evaluation without labels).
* ``model.forward`` becomes a wrapper. Without ``labels``, under ``torch.no_grad()`` (evaluation loops,
  which read the logits) or with ``logits_to_keep`` other than 0 it is the original forward. With
  ``labels`` and grad mode on (training) it runs the original forward with ``labels=None`` while the head
  hands its input (the last hidden states) over instead of forming the logits, then computes
  transformers' loss (labels shifted left by one, ``ignore_index`` -100, the mean over counted tokens, or
  the sum over ``num_items_in_batch`` when given; ``shift_labels`` honoured) with
  ``linear_cross_entropy(hidden, lm_head.weight, shift_labels, softcap=final_logit_softcapping)``.
  The output's ``logits`` is then None, unless the call passes ``return_logits=True`` (an extra
  keyword the wrapper takes out): the logits are then also formed (softcapped as the model would), at
  the memory cost the patch otherwise avoids.

:func:`unpatch_lm_heads` restores the original ``nn.Linear`` (with the current parameters) and forward.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._patch_types import Left, PatchReport, Swapped
from .linear_cross_entropy import linear_cross_entropy

#: ``config.model_type`` values whose causal-LM forward is ``lm_head`` (+ Gemma's softcap) + ``ForCausalLMLoss``.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3")
KERNEL = "cross_entropy"
_MARK = "_mfuwatch_lm_head"


class LMHead(nn.Linear):
    """The LM head ``nn.Linear`` of a patched model: ``F.linear(x, weight, bias)``, or, while the patched
    forward collects into :attr:`box`, the input appended to it and an empty (..., 0) tensor returned.

    A subclass of ``nn.Linear`` (built around the original's parameters, none allocated), so that whatever
    reads a model's linears still finds the head: the agent's analytic FLOP count
    (``mfuwatch.agent.architectures``, which places every 2-D weight by its module's class and would otherwise
    fall back to the counted path), PEFT's and FSDP's module rules, ``isinstance`` checks."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate and initialise a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        else:
            self.register_parameter("bias", None)
        self.box: Optional[List[torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.box is not None:
            self.box.append(x)
            return x.new_empty((*x.shape[:-1], 0))
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _softcap_of(config) -> Optional[float]:
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _why_not(model: nn.Module) -> Optional[str]:
    """None when ``model`` is a recognised causal LM, else the reason (for the patch report)."""
    config = getattr(model, "config", None)
    mt = getattr(config, "model_type", None)
    if mt not in FAMILIES:
        return f"model_type {mt!r} is not one of the recognised families {FAMILIES}"
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "no nn.Linear `lm_head`"
    if not isinstance(getattr(model, "model", None), nn.Module):
        return "no `model` base module"
    if "forward" in model.__dict__:
        return "its forward is wrapped on the instance already (e.g. an accelerate hook)"
    head = model.lm_head
    if head._forward_hooks or head._forward_pre_hooks or head._backward_hooks:
        return "lm_head has hooks that the replacement would not carry"
    loss_fn = getattr(model, "loss_function", None)
    if getattr(loss_fn, "__name__", "") != "ForCausalLMLoss":
        return f"its loss function is {getattr(loss_fn, '__name__', loss_fn)!r}, not transformers' ForCausalLMLoss"
    w = head.weight
    if not (w.is_floating_point() and w.dtype != torch.float64):
        return f"lm_head dtype {w.dtype} is not fp32/fp16/bf16"
    return None


def _causal_lms(model: nn.Module):
    """(dotted name, module) of the model and its submodules that look like causal LMs (``*ForCausalLM``)."""
    for name, m in list(model.named_modules()):
        if type(m).__name__.endswith("ForCausalLM") and hasattr(m, "lm_head"):
            yield name, m


def patch_model(model: nn.Module, wanted, verify: bool, report: PatchReport, *,
                lm_head_mode: str = "chunked", **_options) -> None:
    """The ``cross_entropy`` patch rule (:mod:`._patch_types`): :func:`patch_lm_heads` when requested, the loss
    in ``lm_head_mode`` (:func:`~mfuwatch.kernels.patch`'s keyword of that name)."""
    if KERNEL in wanted:
        patch_lm_heads(model, report, lm_head_mode)


def patch_lm_heads(model: nn.Module, report: PatchReport, mode: str = "chunked") -> None:
    """Wire every recognised causal LM in ``model`` (the model itself or a submodule); record in ``report``
    what was swapped or left, and why. ``mode``: the :func:`~mfuwatch.kernels.linear_cross_entropy` mode the
    loss runs in ("chunked" or "recompute")."""
    found = False
    for name, m in _causal_lms(model):
        found = True
        label = (name + ".lm_head") if name else "lm_head"
        if getattr(m, _MARK, None) is not None:
            continue  # patched before
        reason = _why_not(m)
        if reason is not None:
            report.left.append(Left(label, type(m).__name__, KERNEL, reason))
            continue
        _wire(m, mode)
        cap = _softcap_of(m.config)
        what = ", ".join(([f"softcap {cap:g}"] if cap else []) + ([f"mode {mode}"] if mode != "chunked" else []))
        report.swapped.append(Swapped(label, f"{type(m).__name__}.lm_head + loss",
                                      "mfuwatch.kernels.linear_cross_entropy" + (f" ({what})" if what else ""),
                                      KERNEL))
    if found:
        report.notes.append("cross_entropy: with labels, the patched forward returns logits=None unless called "
                            "with return_logits=True")
    else:
        report.notes.append("cross_entropy: no Hugging Face *ForCausalLM module found; call "
                            "mfuwatch.kernels.linear_cross_entropy(hidden, lm_head.weight, targets) or "
                            "mfuwatch.kernels.cross_entropy(logits, targets) in model code")


def _wire(m: nn.Module, mode: str = "chunked") -> None:
    original_head = m.lm_head
    head = LMHead(original_head)
    head.train(original_head.training)
    orig_forward = m.forward  # the class's forward, bound to this instance
    sig = inspect.signature(orig_forward)
    cap = _softcap_of(m.config)

    def forward(*args, return_logits: bool = False, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return orig_forward(*args, **kwargs)
        labels = bound.arguments.get("labels")
        keep = bound.arguments.get("logits_to_keep", 0)
        if labels is None or not torch.is_grad_enabled() or not (isinstance(keep, int) and keep == 0):
            return orig_forward(*args, **kwargs)  # inference and evaluation (no_grad) keep their logits
        bound.arguments["labels"] = None
        extra = dict(bound.arguments.get("kwargs", {}))
        box: List[torch.Tensor] = []
        head.box = box
        try:
            out = orig_forward(*bound.args, **bound.kwargs)
        finally:
            head.box = None
        hidden = box[0]
        loss = causal_lm_loss(hidden, head.weight, head.bias, labels, cap, extra, mode)
        logits = None
        if return_logits:
            logits = F.linear(hidden, head.weight, head.bias)
            if cap:
                logits = torch.tanh(logits / cap) * cap
        if isinstance(out, tuple):
            return (loss,) + ((logits,) if logits is not None else ()) + tuple(out[1:])
        out["loss"] = loss
        if logits is None:  # as transformers leaves a None field: out of the keys, the attribute None
            if "logits" in out.keys():
                OrderedDict.__delitem__(out, "logits")
            object.__setattr__(out, "logits", None)
        else:
            out["logits"] = logits
        return out

    forward.__wrapped__ = orig_forward  # what inspect.signature and readers see
    object.__setattr__(m, _MARK, original_head)
    m.lm_head = head
    m.forward = forward


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                   softcap: Optional[float], kwargs: dict, mode: str = "chunked") -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` over ``hidden @ weight.T (+ bias)`` (softcapped), without the logits.

    hidden: (B, T, H); labels: (B, T) token ids, -100 (or ``kwargs["ignore_index"]``) where unlabelled;
    ``kwargs`` may hold ``shift_labels`` (used as given) and ``num_items_in_batch`` (a tensor or int: the
    loss is then the sum over it). ``mode``: :func:`linear_cross_entropy`'s. Returns an fp32 0-d loss.
    """
    ii = kwargs.get("ignore_index", -100)
    shift = kwargs.get("shift_labels")
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ii)[..., 1:]
    target = shift.reshape(-1).to(hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])
    n = kwargs.get("num_items_in_batch")
    if n is None:
        return linear_cross_entropy(h, weight, target, bias, ignore_index=ii, softcap=softcap, mode=mode)
    total = linear_cross_entropy(h, weight, target, bias, ignore_index=ii, reduction="sum", softcap=softcap,
                                 mode=mode)
    return total / (n.to(total.device) if torch.is_tensor(n) else n)


def unpatch_model(model: nn.Module) -> int:
    """The ``cross_entropy`` unpatch rule: :func:`unpatch_lm_heads`."""
    return unpatch_lm_heads(model)


def unpatch_lm_heads(model: nn.Module) -> int:
    """Restore the original ``lm_head`` (with the current parameters and mode) and forward of every causal
    LM :func:`patch_lm_heads` wired in ``model``; return how many."""
    restored = 0
    for _name, m in list(model.named_modules()):
        orig = m.__dict__.get(_MARK)
        if orig is None:
            continue
        head = m.lm_head
        orig.weight = head.weight
        if head.bias is not None:
            orig.bias = head.bias
        orig.train(head.training)
        m.lm_head = orig
        m.__dict__.pop("forward", None)
        object.__delattr__(m, _MARK)
        restored += 1
    return restored
