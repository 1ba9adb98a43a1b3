"""FLOP formulas of our own for attention and grouped-matmul ops, the same on every torch version.

Two users read them: the FLOP counter (a ``custom_mapping`` for
:class:`torch.utils.flop_counter.FlopCounterMode`, see :func:`flop_counter_mapping`)
and the trace analysis (:func:`trace_op_flops`, on the shapes a profiler trace
records). This module imports torch only inside :func:`flop_counter_mapping`, so
``mfuwatch analyze`` stays torch-free.

Conventions (multiply and add counted separately, as torch and PaLM do):

* Attention, query ``(B, Hq, Tq, D)``, key ``(B, Hkv, Tk, D)``, value
  ``(B, Hkv, Tk, Dv)``. Grouped-query and multi-query attention (``Hkv`` divides
  ``Hq``) cost what multi-head attention with ``Hq`` heads costs: every query
  head computes its own scores, the key/value heads are only re-read. So::

      forward  = 2·B·Hq·Tq·Tk·D  (S = Q Kᵀ)  + 2·B·Hq·Tq·Tk·Dv  (O = P V)
      backward = 2·B·Hq·Tq·Tk·(3·D + 2·Dv)   (S again, dV, dP, dQ, dK)

  The backward counts the recomputation of ``S`` that the fused kernels
  (FlashAttention-2, Dao 2023, algorithm 2; memory-efficient; cuDNN) execute,
  as torch's own ``sdpa_backward_flop_count`` does; a causal mask is not
  halved (the full ``Tq × Tk`` score matrix, PaLM's convention).
* ``aten.convolution_backward``: the forward's FLOPs once per gradient asked for (input, weight), the
  groups of a grouped or depthwise convolution accounted for (:func:`conv_backward_flops`).
* ``aten._grouped_mm(a, b, offs)`` (the MoE expert matmul of transformers 5):
  ``2 · out.numel() · K`` with ``K = a.shape[-1]``, except when both inputs
  are 2-D (the weight-gradient form, groups along ``K``): ``2 · M · K_total · N``.
  Each token row is multiplied by its group's matrix once, so the count is
  exact whatever the offsets.

Raises nothing: a formula given shapes it does not understand returns ``None``
(trace analysis) or 0 plus a count in :data:`UNRECOGNISED` (FLOP counter).
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

Shape = Sequence[int]

#: op name -> calls whose shapes the formulas could not read (FlopCounterMode path)
UNRECOGNISED: "collections.Counter[str]" = collections.Counter()

# Ops whose tensors are (B, H, T, D), first three arguments q, k, v
_SDPA_BHTD_FORWARD = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_fused_attention_overrideable", "_cudnn_attention_forward")
# ... and their backwards, first four arguments grad_out, q, k, v
_SDPA_BHTD_BACKWARD = tuple(n + "_backward" for n in _SDPA_BHTD_FORWARD[:-1]) + ("_cudnn_attention_backward",)
# Lower-level kernels whose tensors are (B, T, H, D), or (total, H, D) for variable-length batches
_SDPA_BTHD_FORWARD = ("_flash_attention_forward", "_efficient_attention_forward")
_SDPA_BTHD_BACKWARD = ("_flash_attention_backward", "_efficient_attention_backward")
_GROUPED_MM = ("_grouped_mm", "_scaled_grouped_mm")
_CONV_BACKWARD = ("convolution_backward",)

#: every op (aten overload packet name) this module has a formula for
OPS: Tuple[str, ...] = (_SDPA_BHTD_FORWARD + _SDPA_BHTD_BACKWARD + _SDPA_BTHD_FORWARD + _SDPA_BTHD_BACKWARD + _GROUPED_MM
                         + _CONV_BACKWARD)


def attention_forward_flops(batch: int, q_heads: int, q_len: int, k_len: int, head_dim: int,
                            v_head_dim: Optional[int] = None) -> int:
    """FLOPs of one attention forward (``Q Kᵀ`` and ``P V``), any number of KV heads.

    Args:
        batch: B. q_heads: Hq (query heads; the KV head count does not enter).
        q_len: Tq. k_len: Tk. head_dim: D of query and key. v_head_dim: Dv (default D).

    Returns:
        ``2·B·Hq·Tq·Tk·(D + Dv)`` FLOPs.
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    return 2 * batch * q_heads * q_len * k_len * (head_dim + dv)


def attention_backward_flops(batch: int, q_heads: int, q_len: int, k_len: int, head_dim: int,
                             v_head_dim: Optional[int] = None) -> int:
    """FLOPs of one fused attention backward: ``2·B·Hq·Tq·Tk·(3·D + 2·Dv)`` (recomputes ``S``; 5 matmuls)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    return 2 * batch * q_heads * q_len * k_len * (3 * head_dim + 2 * dv)


def _bhtd(q: Shape, k: Shape, v: Shape) -> Optional[Tuple[int, int, int, int, int, int]]:
    """``(B, Hq, Tq, Tk, D, Dv)`` from (B, H, T, D) shapes, or None when they do not fit together."""
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        return None
    b, hq, tq, d = q
    bk, hk, tk, dk = k
    bv, hv, tv, dv = v
    if not (b == bk == bv and hk == hv and tk == tv and d == dk) or hk <= 0 or hq % hk:
        return None
    return b, hq, tq, tk, d, dv


def _bthd(q: Shape, k: Shape, v: Shape, max_q: Any = None, max_k: Any = None
          ) -> Optional[Tuple[int, int, int, int, int, int]]:
    """Same from (B, T, H, D) shapes; a variable-length batch (total, H, D) counts total_q × max_k."""
    if len(q) == 4 and len(k) == 4 and len(v) == 4:
        return _bhtd((q[0], q[2], q[1], q[3]), (k[0], k[2], k[1], k[3]), (v[0], v[2], v[1], v[3]))
    if len(q) == 3 and len(k) == 3 and len(v) == 3 and isinstance(max_k, int) and max_k > 0:
        tq, hq, d = q
        _, hk, dk = k
        if hk <= 0 or hq % hk or d != dk:
            return None
        return 1, hq, tq, int(max_k), d, v[2]  # an upper bound: each query sees at most max_k keys
    return None


def _is_shape(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in x)


def grouped_mm_flops(a: Shape, b: Shape, out: Optional[Shape] = None) -> Optional[int]:
    """FLOPs of ``torch._grouped_mm(a, b, offs)`` from the shapes (see the module docstring), or None."""
    if not (_is_shape(a) and _is_shape(b)) or len(a) not in (2, 3) or len(b) not in (2, 3):
        return None
    if len(a) == 2 and len(b) == 2:  # (M, K_total) x (K_total, N) -> (G, M, N), groups along K
        return 2 * a[0] * a[1] * b[1] if a[1] == b[0] else None
    k = a[-1]
    if out is not None and _is_shape(out):
        return 2 * math.prod(out) * k
    if len(a) == 2 and len(b) == 3:  # (M_total, K) x (G, K, N) -> (M_total, N)
        return 2 * a[0] * k * b[2]
    if len(a) == 3 and len(b) == 3:  # (G, M, K) x (G, K, N) -> (G, M, N)
        return 2 * a[0] * a[1] * k * b[2]
    if len(a) == 3 and len(b) == 2:  # (G, M, K) x (K, N_total) -> (M, N_total)
        return 2 * a[1] * k * b[1]
    return None


def conv_backward_flops(grad_out: Shape, x: Shape, w: Shape, transposed: bool, output_mask: Sequence[bool]
                        ) -> Optional[int]:
    """FLOPs of ``aten.convolution_backward``: the forward's ``2 · (output elements) · (weight elements per
    output channel)`` once for the input gradient and once for the weight gradient, as requested by
    ``output_mask`` (the bias gradient is a sum, not counted).

    The weight is ``(C_out, C_in / groups, *kernel)`` (``(C_in, C_out / groups, *kernel)`` when
    ``transposed``), so grouped and depthwise convolutions (Mamba's causal conv1d) cost what they
    compute. torch's own formula forms the weight gradient as an ungrouped convolution and, for a
    depthwise one, counts ``C`` times its FLOPs. Returns None for shapes it cannot read.
    """
    if not (_is_shape(grad_out) and _is_shape(x) and _is_shape(w)) or len(w) < 3:
        return None
    per_out = math.prod(w[1:])
    forward = 2 * math.prod(x if transposed else grad_out) * per_out
    mask = list(output_mask or (True, True, False))
    return forward * (int(bool(mask[0])) + int(bool(mask[1]) if len(mask) > 1 else 0))


def _flag(v: Any) -> bool:
    """A bool argument as the counter passes it (a bool) or a trace records it (``"True"``, ``"0"``, ``""``)."""
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1")
    return bool(v)


def _mask(v: Any) -> Sequence[bool]:
    """``output_mask``: a bool sequence, or a trace's ``"[True, True, False]"``; missing = input and weight."""
    if isinstance(v, str):
        parts = [p for p in v.strip("[]() ").split(",") if p.strip()]
        return [_flag(p) for p in parts] or [True, True, False]
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (bool, int, str)) for x in v):
        return [_flag(x) for x in v]
    return [True, True, False]


def op_flops(name: str, args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None,
             out_shape: Any = None) -> Optional[int]:
    """FLOPs of one call of ``name`` (``"aten::_grouped_mm"`` or ``"_grouped_mm"``), args given as shapes.

    Args:
        name: the op's name, with or without the ``aten::`` prefix and an overload suffix.
        args: positional arguments with every tensor replaced by its shape (a tuple of ints);
            other arguments as they are (ints for ``max_q``/``max_k``).
        kwargs: keyword arguments, same form. out_shape: the output's shape, if known.

    Returns:
        FLOPs, or None when ``name`` has no formula here or the shapes do not fit it.
    """
    op = name.split("::")[-1].split(".")[0]
    kwargs = kwargs or {}
    shapes = list(args)
    try:
        if op in _SDPA_BHTD_FORWARD and len(shapes) >= 3:
            dims = _bhtd(shapes[0], shapes[1], shapes[2])
            return None if dims is None else attention_forward_flops(*dims)
        if op in _SDPA_BHTD_BACKWARD and len(shapes) >= 4:
            dims = _bhtd(shapes[1], shapes[2], shapes[3])
            return None if dims is None else attention_backward_flops(*dims)
        if op in _SDPA_BTHD_FORWARD and len(shapes) >= 3:
            max_k = shapes[6] if len(shapes) > 6 else kwargs.get("max_k", kwargs.get("max_seqlen_k"))
            if op == "_efficient_attention_forward":
                max_k = shapes[7] if len(shapes) > 7 else kwargs.get("max_seqlen_k")
            dims = _bthd(shapes[0], shapes[1], shapes[2], None, max_k)
            return None if dims is None else attention_forward_flops(*dims)
        if op in _SDPA_BTHD_BACKWARD and len(shapes) >= 4:
            max_k = shapes[9] if len(shapes) > 9 else kwargs.get("max_k", kwargs.get("max_seqlen_k"))
            dims = _bthd(shapes[1], shapes[2], shapes[3], None, max_k)
            return None if dims is None else attention_backward_flops(*dims)
        if op in _CONV_BACKWARD and len(shapes) >= 3:
            transposed = shapes[7] if len(shapes) > 7 else kwargs.get("transposed", False)
            mask = shapes[10] if len(shapes) > 10 else kwargs.get("output_mask", (True, True, False))
            return conv_backward_flops(shapes[0], shapes[1], shapes[2], _flag(transposed), _mask(mask))
        if op in _GROUPED_MM and len(shapes) >= 2:
            return grouped_mm_flops(shapes[0], shapes[1], out_shape if _is_shape(out_shape) else None)
    except (TypeError, ValueError, IndexError):
        return None
    return None


def trace_op_flops(name: str, arg_shapes: Sequence[Any], out_shape: Any = None) -> Optional[float]:
    """For the trace analysis: FLOPs of a recorded op from its ``Input Dims``, or None (not ours / unreadable).

    ``arg_shapes`` holds one entry per argument: a shape list for a tensor, a
    scalar for a scalar (profiler traces record ``max_q``/``max_k`` as
    ``Concrete Inputs``; missing ones arrive as empty lists).
    """
    args = [tuple(a) if isinstance(a, list) and _is_shape(a) and a else a for a in arg_shapes]
    value = op_flops(name, args, None, tuple(out_shape) if _is_shape(out_shape) else None)
    return None if value is None else float(value)


def flop_counter_mapping() -> Dict[Any, Callable[..., int]]:
    """``{aten overload packet: formula}`` for ``FlopCounterMode(custom_mapping=...)``.

    Replaces torch's formulas for these ops in that mode only (no global
    registration), so a torch whose SDPA formula rejects grouped-query shapes, or
    that has no formula for ``_grouped_mm`` or the CPU flash kernel, counts the
    same as any other. Ops missing from the installed torch are left out.
    """
    import torch

    mapping: Dict[Any, Callable[..., int]] = {}
    for op in OPS:
        packet = getattr(torch.ops.aten, op, None)
        if packet is None:
            continue
        mapping[packet] = _shape_formula(op)
    return mapping


def _shape_formula(op: str) -> Callable[..., int]:
    def formula(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        out = out_shape[0] if isinstance(out_shape, (tuple, list)) and out_shape and _is_shape(out_shape[0]) \
            else out_shape
        value = op_flops(op, args, kwargs, out if _is_shape(out) else None)
        if value is None:
            UNRECOGNISED[op] += 1
            return 0
        return int(value)

    formula.__name__ = f"mfuwatch_{op}_flop"
    return formula
