"""FLOPs of one training step counted on a model rebuilt from its Hugging Face config on the meta device.

:func:`count_from_config` builds the model from its config (``device="meta"``: no memory, no compute),
makes inputs of the given batch and lengths, and runs :class:`~torch.utils.flop_counter.FlopCounterMode`
over one forward and backward (:func:`count_step`), naming the compute ops that counted 0. Used by
``agent.flops_breakdown(count=True)`` and by ``mfuwatch flops --count`` (:mod:`.cli`). transformers
is imported inside the functions.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

#: op name fragments of compute ops whose FLOPs matter; one of these counting 0 is reported
_COMPUTE_HINTS = ("mm", "conv", "attention", "matmul", "linear", "einsum", "addmm", "bmm", "grouped")


def lengths_text(lengths: Any, family: str = "decoder", sequences: Optional[float] = None) -> str:
    """``lengths`` (an ``architectures.Lengths``) in words for the breakdown text.

    Without ``sequences``: ``"sequence length 2048"``, ``"encoder length 512, decoder length 128"``
    (encoder-decoders), ``"197 tokens per image"`` (ViT: patches + class token). With ``sequences``
    (images for a ViT): ``"4 sequences of 2048 tokens"``, ``"4 sequences of 512 encoder and 128 decoder
    tokens"``, ``"4 images of 197 tokens"``.
    """
    if sequences is None:
        if family == "vision":
            return f"{lengths.target} tokens per image (patches + class token)"
        if family == "encoder-decoder":
            return f"encoder length {lengths.source}, decoder length {lengths.target}"
        return f"sequence length {lengths.target}"
    unit = "image" if family == "vision" else "sequence"
    n = f"{sequences:g} {unit}{'' if sequences == 1 else 's'}"
    if family == "encoder-decoder":
        return f"{n} of {lengths.source} encoder and {lengths.target} decoder tokens"
    return f"{n} of {lengths.target} tokens"


def _auto_class(cfg: Any) -> Any:
    import transformers

    from .architectures import ENCODER_TYPES, VISION_TYPES

    mt = getattr(cfg, "model_type", "")
    if getattr(cfg, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    if mt in VISION_TYPES:
        return transformers.AutoModelForImageClassification
    if mt in ENCODER_TYPES:
        return transformers.AutoModelForMaskedLM
    return transformers.AutoModelForCausalLM


def build_model(cfg: Any, device: str = "meta") -> Any:
    """The model of ``cfg`` with eager attention on ``device`` ("meta": shapes only, no memory; in bf16,
    which grouped-mm experts require). Sets ``cfg``'s attention implementation: pass a copy."""
    import torch

    try:
        cfg._attn_implementation = "eager"
    except Exception:  # noqa: BLE001
        pass
    with torch.device(device):
        model = _auto_class(cfg).from_config(cfg)
    if device == "meta":
        model = model.to(torch.bfloat16)
    model.train()
    return model


def count_from_config(cfg: Any, arch: Any, batch: int, seq_len: int, source_len: Optional[int],
                      gradient_checkpointing: bool = False, max_cpu_params: int = 200_000_000
                      ) -> Tuple[Optional[int], List[str], str]:
    """``(FLOPs or None, untracked ops, where or why not)`` of one step of ``cfg``'s model: meta device
    first, the CPU for models up to ``max_cpu_params`` when an op cannot run on meta tensors."""
    import copy

    why = ""
    for device in ("meta", "cpu"):
        try:
            m = build_model(copy.deepcopy(cfg), device)
            n = sum(p.numel() for p in m.parameters())
            if device == "cpu" and n > max_cpu_params:
                return None, [], f"{why}; too large for the CPU ({n:,} parameters)"
            if gradient_checkpointing and hasattr(m, "gradient_checkpointing_enable"):
                m.gradient_checkpointing_enable()
            counted, untracked = count_step(m, example_inputs(m, arch, batch, seq_len, source_len, device))
            return counted, untracked, device
        except Exception as exc:  # noqa: BLE001 - e.g. a data-dependent op on meta tensors
            why = (why + "; " if why else "") + f"{device}: {type(exc).__name__}: {str(exc)[:160]}"
    return None, [], why


def example_inputs(model: Any, arch: Any, batch: int, seq_len: int, source_len: Optional[int],
                   device: str) -> Dict[str, Any]:
    """Inputs of one training step for ``model`` (random ids / pixels on ``device``)."""
    import torch

    cfg = model.config
    vocab = int(getattr(cfg, "vocab_size", 0) or 2)
    if arch is not None and arch.family == "vision":
        size = getattr(cfg, "image_size", 224)
        size = (size, size) if isinstance(size, int) else tuple(size)
        dtype = next(model.parameters()).dtype
        return {"pixel_values": torch.randn(batch, getattr(cfg, "num_channels", 3), *size, device=device,
                                            dtype=dtype),
                "labels": torch.zeros(batch, dtype=torch.long, device=device)}
    ids = torch.randint(0, vocab, (batch, source_len or seq_len), device=device)
    if arch is not None and arch.family == "encoder-decoder":
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (batch, seq_len), device=device)}
    return {"input_ids": ids, "labels": ids}


def count_step(model: Any, inputs: Dict[str, Any]) -> Tuple[int, List[str]]:
    """``(FLOPs, untracked ops)`` of one forward + backward under ``FlopCounterMode`` with our formulas.

    Untracked ops: compute-looking aten ops (matmul, conv, attention, grouped mm) that ran
    with no FLOP formula, i.e. counted 0.
    """
    from torch.utils.flop_counter import FlopCounterMode, flop_registry
    from torch.utils._python_dispatch import TorchDispatchMode

    from . import op_flops

    mapping = op_flops.flop_counter_mapping()
    seen: set = set()

    class _Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            seen.add(func._overloadpacket)
            return func(*args, **(kwargs or {}))

    with FlopCounterMode(display=False, custom_mapping=mapping) as fc, _Seen():
        out = model(**inputs)
        out.loss.backward()
    known = set(flop_registry) | set(mapping)
    untracked = sorted(str(op) for op in seen if op not in known and any(h in str(op).split(".")[-1]
                                                                         for h in _COMPUTE_HINTS))
    return int(fc.get_total_flops()), untracked
