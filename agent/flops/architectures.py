"""Analytic FLOPs per training step, by architecture, from a model's modules and its Hugging Face config.

The count walks the model's modules (so what the formula sees is what this
rank holds: a pipeline stage's layers, routed and dense layers as built,
adapters as attached) and reads the attention layout from ``model.config``.
Per sequence of ``T`` target tokens (``S`` source tokens for encoder-decoders):

* **Weight matmuls** (``nn.Linear``, GPT-2's ``Conv1D``, 3-D expert tensors, the
  router): ``2·n`` FLOPs forward per token for ``n`` weights, ``2·n`` for the
  input gradient, ``2·n`` for the weight gradient of a trainable weight (PaLM,
  Chowdhery et al. 2022, appendix B: ``6·N``; a frozen weight costs ``4·n``).
  Routed experts count ``top_k / n_experts`` of their weights
  (``num_experts_per_tok`` over ``num_local_experts`` / ``num_experts`` /
  ``n_routed_experts``); shared experts and dense layers (``first_k_dense_replace``,
  ``decoder_sparse_step``, ``mlp_only_layers``) are whatever modules the model
  built for them, so their interleaving needs no rule of its own. A matmul whose
  input needs no gradient has no input-gradient term: one with no trainable
  parameter registered before it (registration order stands for forward order),
  a layer's Q/K/V projections when nothing before the layer and none of its norms
  is trainable, a ViT's patch projection (its input is pixels). Merged or
  disabled PEFT adapters are not counted.
* **Attention scores** (``Q Kᵀ`` and ``P V``): ``12 · Hq · D`` FLOPs per
  (query, key) pair and layer, forward and backward (PaLM's ``12·L·d·T`` per
  token with ``d = Hq·D``; GQA/MQA cost the same as MHA). Pairs per sequence:
  ``T²`` for a full layer, ``T · min(W, T)`` for a sliding window ``W``
  (``sliding_window`` with ``layer_types`` = ``sliding_attention``, or every
  layer when the config has a window and no ``layer_types``), ``Σ c²`` over
  chunks of ``attention_chunk_size`` for ``chunked_attention``, ``T·S`` for
  cross-attention. ``causal=True`` counts only the pairs a causal mask keeps
  (``T(T+1)/2`` for a full layer); the default (``False``) is PaLM's. The
  backward runs only the products whose inputs need a gradient (dQ, dK, dP, dV:
  a frozen first layer under LoRA on Q and V skips dK).
* **Recomputation** (hardware FLOPs only): one more forward of every layer that
  has ``gradient_checkpointing`` set (as ``gradient_checkpointing_enable()`` does).

Parallelism (compare Megatron-LM's ``num_floating_point_operations`` and
torchtitan's ``get_num_flop_per_token``): DTensor parameters (FSDP2, TP) report
global sizes, so ``tp`` divides those weights' and the attention FLOPs (a rank
computes ``1/TP`` of each matmul for the tokens it sees); plain local shards are
counted as they are. ``cp`` multiplies the keys each local query sees (its
sequence is ``cp`` times the local one). A pipeline stage holds only its own
layers and heads, and only those are counted.

An architecture this module does not know raises :class:`UnknownArchitecture`
(the caller then counts with ``FlopCounterMode``), never a guessed formula.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from torch import nn

from .arch_model import (ArchitectureModel, AttentionLayer, Component, Lengths, Matmul,  # noqa: F401
                         UnknownArchitecture, describe)

ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "electra"})
ENCODER_DECODER_TYPES = frozenset({"t5", "mt5", "umt5", "bart", "mbart"})
VISION_TYPES = {"vit": 1}  # model_type -> tokens added to the patches (the class token)
_QKV_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "W_pack",
                        "query", "key", "value", "q", "k", "v", "Wqkv"})
_CROSS_NAMES = ("encoder_attn", "EncDecAttention", "crossattention")
_SKIP_2D = ("embed", "position", "cls_token", "mask_token", "relative_attention_bias", "wpe", "wte")


def _cfg_int(cfg: Any, *names: str) -> Optional[int]:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _is_dtensor(p: Any) -> bool:
    return type(p).__name__ == "DTensor"


def _tp_divides(p: Any, tp_named: bool) -> bool:
    """Whether a DTensor parameter's FLOPs are split over the TP ranks.

    ``tp_named``: some parameter of the model lives on a mesh with a dimension named "tp". Then only a
    parameter sharded (``Shard``) on that dimension is split: FSDP2 + TP also makes the embedding and a
    replicated head DTensors, on the data-parallel submesh alone, and each TP rank runs those in full.
    Without a "tp"-named mesh (``tensor_parallel_size`` given): every DTensor parameter.
    """
    mesh = getattr(p, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not tp_named:
        return True
    if "tp" not in names:
        return False
    placements = tuple(getattr(p, "placements", ()) or ())
    i = names.index("tp")
    return i < len(placements) and type(placements[i]).__name__ in ("Shard", "_StridedShard")


def tp_size_from_params(model: nn.Module) -> int:
    """Tensor-parallel degree from DTensor parameters whose mesh has a dimension named "tp" (1 if none)."""
    for p in model.parameters():
        if _is_dtensor(p):
            mesh = getattr(p, "device_mesh", None)
            names = getattr(mesh, "mesh_dim_names", None) or ()
            if "tp" in names:
                return int(mesh["tp"].size())
    return 1


def _layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The repeated blocks: Hugging Face ``GradientCheckpointingLayer``s, else ``_no_split_modules`` classes."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except Exception:  # noqa: BLE001 - older transformers, or none
        GradientCheckpointingLayer = None  # noqa: N806
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: Dict[str, List[Tuple[str, nn.Module]]] = {"gc": [], "named": []}
    for path, mod in model.named_modules():
        if not path.rsplit(".", 1)[-1].isdigit():
            continue  # a repeated block sits in a ModuleList / ModuleDict under its index
        if GradientCheckpointingLayer is not None and isinstance(mod, GradientCheckpointingLayer):
            found["gc"].append((path, mod))
        elif type(mod).__name__ in names:
            found["named"].append((path, mod))
    out: List[Tuple[str, nn.Module]] = []
    for path, mod in found["gc"] or found["named"]:
        if not any(path.startswith(p + ".") for p, _ in out):
            out.append((path, mod))
    return out


def _layer_kind(cfg: Any, index: int) -> Tuple[str, Optional[int]]:
    types = getattr(cfg, "layer_types", None)
    window = _cfg_int(cfg, "sliding_window")
    if isinstance(types, (list, tuple)) and types:
        if index >= len(types):
            raise UnknownArchitecture(f"config.layer_types has {len(types)} entries, no entry for layer {index}")
        t = str(types[index])
        if t in ("full_attention", "full", "global", "attention"):
            return "full", None
        if t in ("sliding_attention", "sliding", "local"):
            if window is None:
                raise UnknownArchitecture(f"layer {index} is {t!r} but config.sliding_window is not set")
            return "sliding", window
        if t == "chunked_attention":
            chunk = _cfg_int(cfg, "attention_chunk_size")
            if chunk is None:
                raise UnknownArchitecture("chunked_attention layer without config.attention_chunk_size")
            return "chunked", chunk
        raise UnknownArchitecture(f"config.layer_types[{index}] = {t!r} has no attention FLOP rule")
    if window is not None and getattr(cfg, "use_sliding_window", True) is not False:
        return "sliding", window
    return "full", None


def _family(model: nn.Module, cfg: Any) -> str:
    mt = str(getattr(cfg, "model_type", "") or "")
    if getattr(cfg, "is_encoder_decoder", False):
        if mt not in ENCODER_DECODER_TYPES:
            raise UnknownArchitecture(f"encoder-decoder model_type {mt!r} has no analytic FLOP rule")
        return "encoder-decoder"
    if mt in VISION_TYPES:
        return "vision"
    if mt in ENCODER_TYPES:
        return "encoder"
    if hasattr(cfg, "vision_config") or hasattr(cfg, "text_config") or hasattr(cfg, "audio_config"):
        raise UnknownArchitecture(f"multi-modal model_type {mt!r} has no analytic FLOP rule")
    if getattr(cfg, "kv_lora_rank", None) or getattr(cfg, "v_head_dim", None):
        # multi-head latent attention (DeepSeek V2/V3): score and value widths differ from heads x head_dim
        raise UnknownArchitecture(f"model_type {mt!r}: latent attention (kv_lora_rank / v_head_dim) has no "
                                  "analytic rule here")
    if any(k in mt for k in ("vit", "swin", "clip", "whisper", "wav2vec", "llava", "deberta", "albert")):
        raise UnknownArchitecture(f"model_type {mt!r} has no analytic FLOP rule")
    return "decoder"


def from_model(model: nn.Module, *, causal: bool = False, tp: Optional[int] = None, cp: int = 1) -> ArchitectureModel:
    """Read a Hugging Face model (real, meta-device or sharded) into an :class:`ArchitectureModel`.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (or any module with a HF-like ``config``).
        causal: count only the (query, key) pairs a causal mask keeps (default: all, as PaLM).
        tp: tensor-parallel degree (default: from DTensor meshes with a "tp" dimension, else 1).
        cp: context-parallel degree (the local sequence is 1/cp of the attended one).

    Raises:
        UnknownArchitecture: no config, no layers found, a parameter with no FLOP rule, an
            attention layout it cannot read, or MoE experts without ``top_k``/``n_experts``.
    """
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise UnknownArchitecture("the model has no Hugging Face config")
    family = _family(model, cfg)
    layers = _layers(model)
    if not layers:
        raise UnknownArchitecture("no repeated transformer layers found")
    if any(type(p).__name__ == "FlatParameter" or getattr(p, "_is_flat_param", False) for p in model.parameters()):
        raise UnknownArchitecture("FSDP (1) flat parameters: the weights' shapes are gone (read the model before "
                                  "wrapping it, as the framework integrations do)")
    tp_named = tp_size_from_params(model) > 1  # a DeviceMesh dimension named "tp" holds some parameter
    tp = tp_size_from_params(model) if tp is None else int(tp)
    if tp < 1 or cp < 1:
        raise ValueError(f"tp and cp must be >= 1, got tp={tp} cp={cp}")
    top_k = _cfg_int(cfg, "num_experts_per_tok", "moe_topk", "top_k", "experts_per_token")
    n_exp = _cfg_int(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    seq_cls = type(model).__name__.endswith(("ForSequenceClassification", "ForImageClassification"))
    mt = str(getattr(cfg, "model_type", "") or "")

    layer_of: Dict[str, Tuple[int, str, nn.Module]] = {}
    for path, mod in layers:
        idx_s = path.rsplit(".", 1)[-1]
        idx = int(idx_s) if idx_s.isdigit() else len(layer_of)
        side = "encoder" if ".encoder." in f".{path}." and family == "encoder-decoder" else "decoder"
        layer_of[path] = (idx, side, mod)

    # Which matmuls need an input gradient: those with a trainable parameter upstream. Upstream is
    # approximated by registration order (the forward order of every family here), except for a layer's
    # Q/K/V projections, whose input is the layer's input: upstream there is what comes before the layer
    # plus the layer's norms.
    layer_norm_trainable = {lp: any(p.requires_grad for n, p in mod.named_parameters()
                                    if p.dim() == 1 and ("norm" in n or "ln" in n))
                            for lp, (_, _, mod) in layer_of.items()}
    trainable_before_layer: Dict[str, bool] = {}

    def layer_for(path: str) -> Optional[str]:
        return next((lp for lp in layer_of if path == lp or path.startswith(lp + ".")), None)

    def recomputed(lp: Optional[str]) -> bool:
        if lp is None:
            return False
        mod = layer_of[lp][2]
        return bool(getattr(mod, "gradient_checkpointing", False)) and mod.training

    matmuls: List[Matmul] = []
    routed_seen = False
    upstream = False  # a trainable parameter registered before this module
    inactive = _inactive_adapters(model)
    layer_trainable: Dict[str, bool] = {}
    for path, mod in model.named_modules():
        if any(path == pre or path.startswith(pre + ".") for pre in inactive):
            continue  # merged or disabled adapter weights do not run
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if p is not None]
        lp = layer_for(path)
        if lp is not None and lp not in trainable_before_layer:
            trainable_before_layer[lp] = upstream
        if lp is not None:
            layer_trainable[lp] = layer_trainable.get(lp, False) or any(p.requires_grad for _, p in own)
        before, upstream = upstream, upstream or any(p.requires_grad for _, p in own)
        if not own or isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
            continue
        parts = path.split(".")
        in_experts = "experts" in parts
        cls = type(mod).__name__
        for pname, p in own:
            if p.dim() < 2 or pname.endswith("bias"):
                continue
            full = f"{path}.{pname}" if path else pname
            n = float(p.numel())
            if _is_dtensor(p) and tp > 1 and _tp_divides(p, tp_named):
                n /= tp
            runs_on, input_grad = "target", before
            if in_experts:
                if top_k is None or n_exp is None:
                    raise UnknownArchitecture(f"{full}: experts without num_experts_per_tok / num_local_experts "
                                              "in the config")
                n *= top_k / n_exp
                comp = "experts (routed)"
                routed_seen = True
            elif isinstance(mod, nn.Linear) or (cls == "Conv1D" and pname == "weight"):
                comp = _component(parts, family)
            elif "Router" in cls or "Gate" in cls or parts[-1] in ("gate", "router"):
                comp = "router"
            elif isinstance(mod, nn.Conv2d) and family == "vision" and "patch" in path:
                comp, runs_on, input_grad = "patch embedding", "patch", False
            elif any(s in full.lower() for s in _SKIP_2D):
                continue  # a lookup or an addition, not a matmul
            else:
                raise UnknownArchitecture(f"parameter {full} ({cls}, shape {tuple(p.shape)}) has no FLOP rule")
            if family == "encoder-decoder":
                cross_kv = any(c in parts for c in _CROSS_NAMES) and parts[-1] in ("k", "v", "k_proj", "v_proj",
                                                                                  "key", "value")
                encoder_side = layer_of[lp][1] == "encoder" if lp is not None else "encoder" in parts[:2]
                if encoder_side or cross_kv:
                    runs_on = "source"
            if comp == "head" and (parts[0] == "pooler" or "pooler" in parts or (seq_cls and "classifier" in parts)):
                runs_on = "sequence"
            if lp is not None and comp != "patch embedding" and any(q in parts for q in _QKV_NAMES) and \
                    "lora_B" not in parts and not any(c in parts for c in _CROSS_NAMES):
                input_grad = trainable_before_layer[lp] or layer_norm_trainable[lp]
            matmuls.append(Matmul(full, comp, n, bool(p.requires_grad), runs_on, input_grad, recomputed(lp)))
    if not matmuls:
        raise UnknownArchitecture("no weight matmul found")
    matmuls = _early_stopped_recomputation(matmuls, layer_of, layer_for)
    if n_exp and top_k and not routed_seen and mt not in ("",):
        notes = [f"config names {n_exp} experts (top {top_k}) but no 'experts' module holds weights"]
    else:
        notes = []

    attention: List[AttentionLayer] = []
    for lp, (idx, side, mod) in layer_of.items():
        bwd = _attention_backward(lp, matmuls, trainable_before_layer.get(lp, True) or layer_trainable.get(lp, True))
        heads, head_dim = _heads(cfg, family, side)
        width = heads * head_dim / tp
        if family == "decoder":
            kind, window = _layer_kind(cfg, idx)
            attention.append(AttentionLayer(idx, "causal", width, kind, window, recomputed(lp), backward_matmuls=bwd))
        elif family == "encoder-decoder":
            role = "bidirectional" if side == "encoder" else "causal"
            attention.append(AttentionLayer(idx, role, width, "full", None, recomputed(lp), side == "encoder", bwd))
            if side == "decoder":
                attention.append(AttentionLayer(idx, "cross", width, "full", None, recomputed(lp),
                                                backward_matmuls=4 if bwd else 0))
        else:
            attention.append(AttentionLayer(idx, "bidirectional", width, "full", None, recomputed(lp), backward_matmuls=bwd))

    patch, default = None, None
    if family == "vision":
        ps = getattr(cfg, "patch_size", None)
        ps = (ps, ps) if isinstance(ps, int) else tuple(ps) if ps else None
        img = getattr(cfg, "image_size", None)
        img = (img, img) if isinstance(img, int) else tuple(img) if img else None
        if not ps:
            raise UnknownArchitecture("vision config without patch_size")
        patch = (int(ps[0]), int(ps[1]))
        if img:
            default = Lengths((img[0] // patch[0]) * (img[1] // patch[1]) + VISION_TYPES[mt])
    return ArchitectureModel(family, mt, matmuls, attention, causal=causal, cp=cp, patch_size=patch,
                             extra_tokens=VISION_TYPES.get(mt, 0), default_lengths=default, notes=notes)


_Q, _K, _V = {"q_proj", "q", "query"}, {"k_proj", "k", "key"}, {"v_proj", "v", "value"}
_FUSED_QKV = {"qkv_proj", "c_attn", "query_key_value", "W_pack", "Wqkv"}


def _attention_backward(lp: str, matmuls: List[Matmul], any_grad: bool) -> int:
    """How many of the attention backward matmuls (dQ, dK, dP, dV) run in layer ``lp``.

    dQ runs when Q needs a gradient (its projection is trainable or its input needs one), dK likewise,
    dP when either does, dV when V does. Without recognisable projections: all four, or none when
    nothing in or before the layer is trainable.
    """
    flags = {"q": False, "k": False, "v": False}
    found = False
    for mm in matmuls:
        if not mm.path.startswith(lp + "."):
            continue
        parts = set(mm.path.split("."))
        if parts & set(_CROSS_NAMES):
            continue
        grad = mm.trainable or mm.input_grad
        for key, names in (("q", _Q), ("k", _K), ("v", _V)):
            if parts & names or parts & _FUSED_QKV:
                found = True
                flags[key] = flags[key] or grad
    if not found:
        return 4 if any_grad else 0
    return int(flags["q"]) + int(flags["k"]) + int(flags["q"] or flags["k"]) + int(flags["v"])


def _early_stopped_recomputation(matmuls: List[Matmul], layer_of: Mapping[str, Any], layer_for: Any) -> List[Matmul]:
    """Non-reentrant checkpointing stops recomputing once the last saved tensor is rebuilt.

    ``torch.utils.checkpoint`` with ``use_reentrant=False`` (Hugging Face's default) and early
    stopping on (torch's default) never re-runs a layer's last matmul: its output is not saved for the
    backward. We take the layer's last weight matmul in registration order (the MLP's output
    projection in every family here) as that one.
    """
    try:
        import torch.utils.checkpoint as ckpt

        early = bool(getattr(ckpt, "_checkpoint_early_stop", None) is None or ckpt._checkpoint_early_stop)
    except Exception:  # noqa: BLE001
        early = True
    if not early:
        return matmuls
    out = list(matmuls)
    seen = set()
    for i in range(len(out) - 1, -1, -1):
        mm = out[i]
        lp = layer_for(mm.path)
        if lp is None or lp in seen or not mm.recomputed:
            continue
        seen.add(lp)
        func = getattr(layer_of[lp][2], "_gradient_checkpointing_func", None)
        if getattr(func, "keywords", {}).get("use_reentrant", True) is False:
            out[i] = Matmul(mm.path, mm.component, mm.params, mm.trainable, mm.runs_on, mm.input_grad, False)
    return out


def _heads(cfg: Any, family: str, side: str) -> Tuple[int, int]:
    width = _cfg_int(cfg, "hidden_size", "d_model", "n_embd", "dim")
    if family == "encoder-decoder":
        heads = _cfg_int(cfg, f"{side}_attention_heads", "num_heads", "num_attention_heads")
    else:
        heads = _cfg_int(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    if heads is None:
        raise UnknownArchitecture("config has no attention head count (num_attention_heads / num_heads)")
    head_dim = _cfg_int(cfg, "head_dim", "d_kv", "attention_head_size")
    if head_dim is None:
        if width is None:
            raise UnknownArchitecture("config has neither head_dim nor hidden_size")
        head_dim = width // heads
    return heads, head_dim


def _component(parts: List[str], family: str) -> str:
    low = [p.lower() for p in parts]
    if any("shared_expert" in p for p in low):
        return "shared experts"
    if parts[0] in ("lm_head", "cls", "classifier", "score", "pooler", "qa_outputs", "lm_loss") or \
            any(p in ("pooler", "lm_head") for p in parts):
        return "head"
    if any(("attn" in p or "attention" in p) for p in low):
        return "attention projections"
    return "mlp"


def _inactive_adapters(model: nn.Module) -> List[str]:
    """Module paths of PEFT adapter weights that do not run: merged into the base weight, or disabled."""
    out: List[str] = []
    for path, mod in model.named_modules():
        if not hasattr(mod, "lora_A") or not hasattr(mod, "merged"):
            continue
        try:
            off = bool(mod.merged) or bool(getattr(mod, "disable_adapters", False))
        except Exception:  # noqa: BLE001
            continue
        if off:
            out += [f"{path}.{n}" if path else n for n in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                                                           "lora_magnitude_vector")]
    return out


def trainable_signature(model: nn.Module) -> Tuple[int, int, int]:
    """A cheap fingerprint of the trainable set: (trainable tensors, trainable elements, merged adapters)."""
    n = e = 0
    for p in model.parameters():
        if p.requires_grad:
            n += 1
            e += p.numel()
    merged = 0
    for mod in model.modules():
        if hasattr(mod, "lora_A") and (getattr(mod, "merged", False) or getattr(mod, "disable_adapters", False)):
            merged += 1
    return n, e, merged
