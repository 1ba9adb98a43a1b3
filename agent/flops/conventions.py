"""Named FLOP conventions: which model FLOPs MFU's numerator counts, and the inputs of each formula.

Frameworks publish MFU under different conventions; the same run reads as different MFUs. The
``flops_convention`` setting names the one the agent uses (and ``mfuwatch flops`` prints all three):

* ``palm`` (default) — PaLM (Chowdhery et al. 2022, appendix B): ``6·N`` per token for the weight
  matmuls plus ``12·L·d·T`` for the attention scores, every (query, key) pair of the ``T × T``
  matrix counted (no halving for a causal mask). torchtitan's ``get_num_flop_per_token``
  (``6·N + 12·L·H·Q·T``) is this convention.
* ``megatron`` — Megatron-LM's ``num_floating_point_operations`` (Narayanan et al. 2021, eq. 3, with
  the causal halving Megatron-LM added to its attention term): the same weight matmuls, and only
  the (query, key) pairs a causal mask keeps. We count ``T(T+1)/2`` pairs per sequence, Megatron
  ``T²/2``: a relative difference of ``1/T`` in the attention term.
* ``6n`` — ``6·N`` per token, no attention term, ``N`` every parameter except embeddings: what
  Hugging Face's ``PreTrainedModel.floating_point_ops`` (the Trainer's ``total_flos``) reports
  (``6 × tokens × num_parameters(exclude_embeddings=True)``).

``N`` in ``palm`` and ``megatron`` is the parameters used in matmuls (embedding lookups excluded,
the output projection included; routed experts scaled by top-k / experts), read by
:mod:`.architectures` or given as ``model_shape.n_params``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

#: accepted values of ``flops_convention``, with what each counts
CONVENTIONS: Dict[str, str] = {
    "palm": "6*N + 12*L*d*T per token: every (query, key) pair (PaLM appendix B; torchtitan)",
    "megatron": "6*N + 12*L*d*(T+1)/2 per token: causal (query, key) pairs only (Megatron-LM)",
    "6n": "6*N per token, N = parameters without embeddings, no attention (Hugging Face total_flos)",
}
#: the attention_flops value each convention implies ("6n" has no attention term)
ATTENTION_OF = {"palm": "full", "megatron": "causal", "6n": "full"}


def dense_flops_per_token(convention: str, n_params: float, n_layers: int, width: int, seq_len: int) -> float:
    """Model FLOPs per token of one forward + backward of a dense decoder under ``convention``.

    Args:
        convention: a key of :data:`CONVENTIONS`.
        n_params: N (matmul parameters for ``palm``/``megatron``; parameters without embeddings for ``6n``).
        n_layers: L attention layers. width: d = query heads x head dim. seq_len: T tokens per sequence.

    Returns:
        FLOPs per token (float): ``6N + 12LdT`` (palm), ``6N + 6Ld(T+1)`` (megatron), ``6N`` (6n).

    Raises:
        ValueError: an unknown convention or a negative argument.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown FLOP convention {convention!r}; expected one of {', '.join(CONVENTIONS)}")
    if min(n_params, n_layers, width, seq_len) < 0:
        raise ValueError("dense_flops_per_token: arguments must be non-negative")
    if convention == "6n":
        return 6.0 * n_params
    if convention == "megatron":
        return 6.0 * n_params + 6.0 * n_layers * width * (seq_len + 1)
    return 6.0 * n_params + 12.0 * n_layers * width * seq_len


def six_n_parameters(model: Any) -> int:
    """N of the ``6n`` convention: every parameter of ``model`` except embedding tables, each tensor once.

    A Hugging Face model answers with its own ``num_parameters(exclude_embeddings=True)`` (so the
    number is the one behind the Trainer's ``total_flos``); any other module: the unique parameters
    minus those of its ``nn.Embedding`` / ``nn.EmbeddingBag`` modules.
    """
    count = getattr(model, "num_parameters", None)
    if callable(count):
        try:
            return int(count(exclude_embeddings=True))
        except TypeError:
            pass
    from torch import nn

    emb = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for p in m.parameters()}
    return int(sum(p.numel() for p in model.parameters() if id(p) not in emb))


def formula_inputs(flop_model: Any, seq_len: Optional[int] = None) -> Dict[str, Any]:
    """The inputs of the run's FLOP formula, for ``run_info`` and the breakdown; ``{}`` when counted or given.

    Keys: ``parameters`` (N of the convention), ``layers``, ``heads``, ``head_dim``, ``width``
    (heads x head_dim, over TP), ``seq_len`` (when known). Never raises.
    """
    try:
        return _inputs(flop_model, seq_len)
    except Exception:  # noqa: BLE001 - facts for a record, never a failure of the agent
        return {}


def _inputs(fm: Any, seq_len: Optional[int]) -> Dict[str, Any]:
    conv = getattr(fm.config, "flops_convention", None) or "palm"
    out: Dict[str, Any] = {}
    if fm.source not in ("analytic",):
        return out
    if conv == "6n" and getattr(fm, "six_n", None) is not None:
        out["parameters"] = int(fm.six_n)
    if fm.shape is not None:
        s = fm.shape
        out.setdefault("parameters", int(s.n_params))
        out.update(layers=int(s.n_layers), width=int(s.d_model))
        seq_len = s.seq_len or seq_len
    elif fm.arch is not None:
        arch = fm.arch
        out.setdefault("parameters", int(round(sum(mm.params for mm in arch.matmuls))))
        out["layers"] = len(arch.attention)
        if arch.attention:
            out["width"] = int(round(arch.attention[0].width))
        heads, head_dim = _config_heads(getattr(fm.model, "config", None))
        if heads:
            out["heads"] = heads
        if head_dim:
            out["head_dim"] = head_dim
    if seq_len:
        out["seq_len"] = int(seq_len)
    return out


def _config_heads(cfg: Any) -> tuple:
    """``(query heads, head_dim)`` as a Hugging Face config states them (``None`` for what it does not)."""
    def first(*names: str) -> Optional[int]:
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    if cfg is None:
        return None, None
    heads = first("num_attention_heads", "n_head", "num_heads", "n_heads")
    head_dim = first("head_dim", "d_kv", "attention_head_size")
    width = first("hidden_size", "d_model", "n_embd", "dim")
    if head_dim is None and heads and width:
        head_dim = width // heads
    return heads, head_dim


def side_by_side(arch: Any, model: Any, lengths: Any, sequences: float) -> str:
    """A table of one step's model FLOPs under the three conventions (``mfuwatch flops``).

    ``arch``: an :class:`~.architectures.ArchitectureModel`; ``model``: the module (for ``6n``'s N);
    ``lengths``: :class:`~.architectures.Lengths`; ``sequences``: sequences per step. Restores
    ``arch.causal``.
    """
    tokens = arch.units_per_sequence(lengths) * sequences
    rows = [f"{'convention':<10} {'model FLOPs':>14} {'per token':>12} {'vs palm':>8}  what it counts"]
    saved = arch.causal
    try:
        arch.causal = False
        palm = arch.step_flops(lengths, sequences)[0]
        arch.causal = True
        megatron = arch.step_flops(lengths, sequences)[0]
    finally:
        arch.causal = saved
    six_n = 6.0 * six_n_parameters(model) * tokens
    for name, value in (("palm", palm), ("megatron", megatron), ("6n", six_n)):
        rows.append(f"{name:<10} {value:>14.4g} {value / tokens if tokens else 0:>12.4g} "
                    f"{value / palm if palm else 0:>8.3f}  {CONVENTIONS[name]}")
    return "\n".join(rows)
