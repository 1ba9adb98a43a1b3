"""``mfuwatch flops``: the FLOPs of one training step of a Hugging Face model, explained.

    mfuwatch flops path/to/config.json --seq-len 4096 --batch 8
    mfuwatch flops meta-llama/Llama-3.1-8B --seq-len 8192      # only if already in the local HF cache
    mfuwatch flops config.json --count                            # also count with FlopCounterMode

Prints the per-component breakdown of the analytic formula (attention projections,
MLP, routed and shared experts, router, head, attention scores, frozen share,
recomputation) with the formula of each, and with ``--count`` the value
``FlopCounterMode`` counts over one forward and backward of the model built on
the meta device (or the CPU when small), with the ops that counted 0 ("untracked
ops"). Never downloads: a model id is looked up in the local cache only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: op name fragments of compute ops whose FLOPs matter; one of these counting 0 is reported
_COMPUTE_HINTS = ("mm", "conv", "attention", "matmul", "linear", "einsum", "addmm", "bmm", "grouped")


def _load_config(spec: str) -> Any:
    import transformers

    p = Path(spec)
    if p.is_file():
        data = json.loads(p.read_text())
        mt = data.pop("model_type", None)
        if not mt:
            raise ValueError(f"{spec}: no model_type in the config")
        return transformers.AutoConfig.for_model(mt, **data)
    if p.is_dir():
        return transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download
    return transformers.AutoConfig.from_pretrained(spec, local_files_only=True)


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mfuwatch flops", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a Hugging Face config.json, a model folder, or a model id in the local cache")
    ap.add_argument("--seq-len", type=int, default=2048, help="target tokens per sequence (default 2048)")
    ap.add_argument("--source-len", type=int, default=None, help="encoder tokens per sequence (encoder-decoders)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per optimizer step (default 1)")
    ap.add_argument("--causal", action="store_true", help="count only the attention pairs a causal mask keeps")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="count recomputation (hardware FLOPs)")
    ap.add_argument("--count", action="store_true",
                    help="also count one step with FlopCounterMode (meta device; CPU for small models)")
    args = ap.parse_args(argv)
    for name in ("seq_len", "batch", "tp", "cp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("mfuwatch flops: needs transformers (pip install 'mfuwatch[hf]')", file=sys.stderr)
        return 1
    from . import architectures as A

    try:
        cfg = _load_config(args.model)
    except Exception as exc:  # noqa: BLE001 - a missing cache entry or a bad file: one clear line
        print(f"mfuwatch flops: cannot read a config from {args.model!r} (local files only, no download): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    model = build_model(cfg, "meta")
    if args.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    arch = None
    try:
        arch = A.from_model(model, causal=args.causal, tp=args.tp, cp=args.cp)
    except A.UnknownArchitecture as exc:
        print(f"analytic formula: not available ({exc}); the agent counts this model with FlopCounterMode")
    lengths = None
    if arch is not None:
        if arch.family == "vision":
            lengths = arch.default_lengths
        elif arch.family == "encoder-decoder":
            lengths = A.Lengths(args.seq_len, args.source_len or args.seq_len)
        else:
            lengths = A.Lengths(args.seq_len)
        print(f"{type(model).__name__} ({arch.family}, model_type {arch.model_type}), {args.batch} x {lengths}")
        print(A.describe(arch, lengths, args.batch))
    if args.count:
        counted, untracked, where = count_from_config(cfg, arch, args.batch, args.seq_len, args.source_len,
                                                      args.gradient_checkpointing)
        if counted is None:
            print(f"counted: not available ({where})")
        else:
            line = f"counted (FlopCounterMode, {where}): {counted:.4g} executed FLOPs"
            if arch is not None:
                _, hw, _ = arch.step_flops(lengths, args.batch)
                line += f"; analytic hardware FLOPs {hw:.4g} (ratio {hw / counted:.3f})" if counted else ""
            print(line)
            print("untracked ops (counted 0): " + (", ".join(untracked) if untracked else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
