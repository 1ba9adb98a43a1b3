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
from typing import Any, Optional, Sequence, Tuple

from .config_count import build_model, count_from_config, lengths_text  # noqa: F401

#: sequence length when ``--seq-len`` is not given (capped at the config's ``max_position_embeddings``)
DEFAULT_SEQ_LEN = 2048


class ConfigNotFound(ValueError):
    """``mfuwatch flops`` cannot find or read the config it was given; the message says what to pass instead."""


def _check_model_type(mt: Any, where: str) -> None:
    """Raise :class:`ConfigNotFound` when ``mt`` is not a ``model_type`` this transformers knows, naming the
    closest known ones (difflib) rather than transformers' list of several hundred."""
    import difflib

    from transformers import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if mt in known:
        return
    near = difflib.get_close_matches(str(mt), known, n=5, cutoff=0.6)
    hint = f"closest: {', '.join(near)}; " if near else ""
    raise ConfigNotFound(f"{where}: model_type {mt!r} is not one this transformers "
                         f"({_transformers_version()}) knows; {hint}the full list: mfuwatch flops --list-model-types")


def _transformers_version() -> str:
    import transformers

    return getattr(transformers, "__version__", "?")


def _cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # noqa: BLE001 - only for the message
        return "~/.cache/huggingface/hub"


def _load_config(spec: str) -> Any:
    """The transformers config of ``spec``: a config.json file, a model folder, or a model id in the local
    Hugging Face cache. Never downloads.

    Raises:
        ConfigNotFound: a model id missing from the local cache, a missing or unknown ``model_type``.
        OSError, ValueError: an unreadable or malformed file (from json / transformers).
    """
    import transformers

    p = Path(spec)
    if p.is_file():
        data = json.loads(p.read_text())
        mt = data.pop("model_type", None)
        if not mt:
            raise ConfigNotFound(f"{spec}: no model_type in the config (e.g. \"model_type\": \"llama\")")
        _check_model_type(mt, spec)
        return transformers.AutoConfig.for_model(mt, **data)
    if p.is_dir():
        mt = transformers.PretrainedConfig.get_config_dict(str(p), local_files_only=True)[0].get("model_type")
        if not mt:
            raise ConfigNotFound(f"{p / 'config.json'}: no model_type in the config (e.g. \"model_type\": \"llama\")")
        _check_model_type(mt, str(p / "config.json"))
        return transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
    if spec.endswith(".json") or spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise ConfigNotFound(f"{spec}: no such file or folder")  # a path, not an "org/name" model id
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download
    try:
        mt = transformers.PretrainedConfig.get_config_dict(spec, local_files_only=True)[0].get("model_type")
    except OSError:  # transformers' "couldn't connect ... check your internet connection": not our case
        raise ConfigNotFound(
            f"{spec!r} is not a file or folder here, and not in the local Hugging Face cache ({_cache_dir()}). "
            "mfuwatch builds the model from its config and never downloads anything. Pass the config "
            f"instead: mfuwatch flops path/to/config.json (the model's config.json, e.g. saved from its "
            f"Hugging Face page), or a folder that holds config.json; or put it in the cache first with "
            f"`huggingface-cli download {spec} config.json`.") from None
    if mt:
        _check_model_type(mt, spec)
    return transformers.AutoConfig.from_pretrained(spec, local_files_only=True)


def _seq_len(given: Optional[int], cfg: Any) -> Tuple[int, str]:
    """``(sequence length, where it came from)``: ``given``, else :data:`DEFAULT_SEQ_LEN` capped at the
    config's ``max_position_embeddings`` (``n_positions`` for GPT-2 style configs)."""
    max_pos = None
    for name in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            max_pos = (name, v)
            break
    if given is not None:
        note = "from --seq-len"
        if max_pos and given > max_pos[1]:
            note += f", above the config's {max_pos[0]} {max_pos[1]}"
        return given, note
    if max_pos and max_pos[1] < DEFAULT_SEQ_LEN:
        return max_pos[1], (f"the config's {max_pos[0]}, below the default {DEFAULT_SEQ_LEN}; "
                            "--seq-len sets another")
    return DEFAULT_SEQ_LEN, "the default; --seq-len sets another"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mfuwatch flops", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?",
                    help="a Hugging Face config.json, a model folder, or a model id in the local cache")
    ap.add_argument("--seq-len", type=int, default=None,
                    help=f"target tokens per sequence (default {DEFAULT_SEQ_LEN}, or the config's "
                         "max_position_embeddings when smaller)")
    ap.add_argument("--source-len", type=int, default=None, help="encoder tokens per sequence (encoder-decoders)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per optimizer step (default 1)")
    ap.add_argument("--causal", action="store_true", help="count only the attention pairs a causal mask keeps")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="count recomputation (hardware FLOPs)")
    ap.add_argument("--count", action="store_true",
                    help="also count one step with FlopCounterMode (meta device; CPU for small models)")
    ap.add_argument("--list-model-types", action="store_true",
                    help="print every model_type the installed transformers knows, and exit")
    args = ap.parse_args(argv)
    for name in ("seq_len", "batch", "tp", "cp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("mfuwatch flops: needs transformers (pip install 'mfuwatch[hf]')", file=sys.stderr)
        return 1
    if args.list_model_types:
        from transformers import CONFIG_MAPPING

        print("\n".join(sorted(CONFIG_MAPPING.keys())))
        return 0
    if args.model is None:
        ap.error("the model argument is required (a config.json, a model folder or a cached model id)")
    from . import architectures as A

    try:
        cfg = _load_config(args.model)
    except ConfigNotFound as exc:
        print(f"mfuwatch flops: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bad file: one clear line
        print(f"mfuwatch flops: cannot read a config from {args.model!r} (local files only, no download): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    args.seq_len, seq_note = _seq_len(args.seq_len, cfg)
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
        print(f"{type(model).__name__} ({arch.family}, model_type {arch.model_type}), "
              f"{lengths_text(lengths, arch.family, args.batch)}")
        if arch.family != "vision":
            side = "decoder length" if arch.family == "encoder-decoder" else "sequence length"
            print(f"{side} {args.seq_len} ({seq_note})")
        print(A.describe(arch, lengths, args.batch))
        from .conventions import side_by_side

        print("\nthe same step under each flops_convention (the agent's setting; --causal is 'megatron'):")
        print(side_by_side(arch, model, lengths, args.batch))
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
