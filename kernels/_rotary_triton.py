"""Triton kernel and launcher of the rotary position embedding (RoPE, Su et al. 2021, "RoFormer").

For one (batch, token) the first ``R`` of the ``D`` dims of every head of ``q`` and ``k`` are
rotated in pairs ``(x1, x2)`` by the angles whose cosines and sines are in ``cos``/``sin``;
dims ``R..D`` are copied. The pairs are ``(j, j + R/2)`` in the Llama ("rotate half") layout
and ``(2j, 2j + 1)`` in the GPT-J ("interleaved") layout. With ``c1, s1`` the cos/sin at the
pair's first index and ``c2, s2`` at its second::

    forward:   y1 = x1 c1 - x2 s1          y2 = x2 c2 + x1 s2
    backward:  dx1 = g1 c1 + g2 s2         dx2 = g2 c2 - g1 s1

(the backward is the transpose of the forward's linear map; no saved activation is needed).
This is ``x * cos + rotate_half(x) * sin`` element for element, whatever values ``cos`` and
``sin`` hold, as in Hugging Face's ``apply_rotary_pos_emb``.

Bytes per call (``e`` bytes per element, ``Hq + Hk`` heads): read and write ``(Hq + Hk) D``
elements and read ``2 R`` of ``cos``/``sin`` per token, forward and backward alike. One program
per (batch, block of tokens) reads those tokens' ``cos``/``sin`` once and loops over the heads; all
arithmetic in fp32, one rounding per output; int64 offsets.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ._env import INTERPRET
from ._launch import Launcher, cdiv, device_guard, pow2_at_least, use_triton

#: Elements of one half-tile (tokens x heads x pairs) per step of a program; larger under the interpreter,
#: whose time goes by the number of programs and steps, not by their size.
_TILE, _INTERPRETER_TILE = 2048, 1 << 16
#: Warps per program; None: 4 for tiles up to 2048 elements per half, else 8.
_WARPS = None


@triton.jit
def _rotate_heads(
    X, Y,  # X: (B, H, T, D) input, Y: (B, H, T, D) output, each with the strides below
    sx_b, sx_h, sx_t, sx_d, sy_b, sy_h, sy_t, sy_d,
    b, t, mt, H, D, R,  # t: (BLOCK_T,) token indices, mt their mask
    i1, i2, mj, c1, c2, s1, s2,  # pair indices (BLOCK_R,), their mask; cos/sin at them (BLOCK_T, BLOCK_R) fp32
    BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    c1, c2, s1, s2 = c1[:, None, :], c2[:, None, :], s1[:, None, :], s2[:, None, :]
    for h0 in range(0, H, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mth = mt[:, None, None] & (h < H)[None, :, None]
        m = mth & mj[None, None, :]
        xb = X + b * sx_b + t[:, None, None] * sx_t + h[None, :, None] * sx_h  # (BLOCK_T, BLOCK_H, 1) pointers
        yb = Y + b * sy_b + t[:, None, None] * sy_t + h[None, :, None] * sy_h
        x1 = tl.load(xb + i1[None, None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xb + i2[None, None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(yb + i1[None, None, :] * sy_d, y1.to(Y.dtype.element_ty), mask=m)
        tl.store(yb + i2[None, None, :] * sy_d, y2.to(Y.dtype.element_ty), mask=m)
        if HAS_PASS:  # dims R..D are passed through (partial rotary)
            p = (R + tl.arange(0, BLOCK_P)).to(tl.int64)
            mp = mth & (p < D)[None, None, :]
            v = tl.load(xb + p[None, None, :] * sx_d, mask=mp, other=0.0)
            tl.store(yb + p[None, None, :] * sy_d, v.to(Y.dtype.element_ty), mask=mp)


@triton.jit
def _rotary_kernel(
    Q, K, QO, KO,  # (B, Hq, T, D), (B, Hk, T, D) inputs; outputs of the same shapes; strides below
    C, S,  # (B, T, R) cos and sin (batch stride 0 when broadcast over the batch)
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
    sqo_b, sqo_h, sqo_t, sqo_d, sko_b, sko_h, sko_t, sko_d,
    sc_b, sc_t, sc_r, ss_b, ss_t, ss_r,
    T, HQ, HK, D, R, n_t_blocks,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_t_blocks
    t = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    mt = t < T
    j = tl.arange(0, BLOCK_R).to(tl.int64)
    half = R // 2
    mj = j < half
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + half
    m = mt[:, None] & mj[None, :]
    cb = C + b * sc_b + t[:, None] * sc_t
    sb = S + b * ss_b + t[:, None] * ss_t
    c1 = tl.load(cb + i1[None, :] * sc_r, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cb + i2[None, :] * sc_r, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sb + i1[None, :] * ss_r, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sb + i2[None, :] * ss_r, mask=m, other=0.0).to(tl.float32)
    _rotate_heads(Q, QO, sq_b, sq_h, sq_t, sq_d, sqo_b, sqo_h, sqo_t, sqo_d, b, t, mt, HQ, D, R,
                  i1, i2, mj, c1, c2, s1, s2, BACKWARD, HAS_PASS, BLOCK_HQ, BLOCK_P)
    _rotate_heads(K, KO, sk_b, sk_h, sk_t, sk_d, sko_b, sko_h, sko_t, sko_d, b, t, mt, HK, D, R,
                  i1, i2, mj, c1, c2, s1, s2, BACKWARD, HAS_PASS, BLOCK_HK, BLOCK_P)


_LAUNCH = Launcher(_rotary_kernel)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate shapes, dtypes and devices; return the rotary width ``R``. Raises ValueError naming both sides."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be 4-D (batch, heads, tokens, head_dim)")
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be one 3-D shape "
                         "(batch, tokens, rotary_dim)")
    (bq, _, tq, d), (bk, _, tk, dk) = q.shape, k.shape
    if (bq, tq, d) != (bk, tk, dk):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, tokens or head_dim")
    bc, tc, r = cos.shape
    if tc != tq or bc not in (1, bq):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match q {tuple(q.shape)}: expected ({bq} or 1, {tq}, R)")
    if r % 2 or r > d or r == 0:
        raise ValueError(f"rotary_dim {r} (cos.shape[-1]) must be even, positive and <= head_dim {d}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not supported (float32, float16 or bfloat16)")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return r


def out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    """The result dtype of ``x * cos + rotate_half(x) * sin`` under PyTorch's promotion."""
    return torch.promote_types(x.dtype, torch.promote_types(cos.dtype, sin.dtype))


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
              backward: bool = False, dtype=None) -> torch.Tensor:
    """The same map in PyTorch ops, in fp32 with one rounding to ``dtype``: the CPU fallback and the graph
    ``torch.compile`` fuses. x: (B, H, T, D); cos, sin: (B or 1, T, R)."""
    r = cos.shape[-1]
    c = cos.float().unsqueeze(1)
    s = sin.float().unsqueeze(1)
    xf = x.float()
    xr = xf[..., :r]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        c1, c2, s1, s2 = c[..., 0::2], c[..., 1::2], s[..., 0::2], s[..., 1::2]
    else:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        c1, c2, s1, s2 = c[..., : r // 2], c[..., r // 2:], s[..., : r // 2], s[..., r // 2:]
    if backward:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    if r < x.shape[-1]:
        y = torch.cat((y, xf[..., r:]), dim=-1)
    return y.to(dtype if dtype is not None else x.dtype)


def _strides4(t: torch.Tensor) -> Tuple[int, int, int, int]:
    return tuple(t.stride())  # type: ignore[return-value]


def dense_strides(shape, strides) -> bool:
    """Whether ``strides`` lay ``shape`` out densely (a permutation of a contiguous layout, no gaps or overlap)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n != 1)
    expect = 1
    for st, n in dims:
        if st != expect:
            return False
        expect *= n
    return True


def _empty(x: torch.Tensor, dtype: torch.dtype, strides=None) -> torch.Tensor:
    """An output shaped like ``x``: laid out as ``strides`` when given and dense for the shape, else as ``x``."""
    if strides is not None and dense_strides(x.shape, strides):
        return torch.empty_strided(x.shape, strides, dtype=dtype, device=x.device)
    return torch.empty_like(x, dtype=dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
           backward: bool = False, q_dtype=None, k_dtype=None, layouts=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (forward) or their gradients (``backward=True``); new tensors with the inputs'
    strides where those are dense (a transposed projection stays transposed), in ``q_dtype``/``k_dtype``
    (default: the forward's promoted dtype). q, k: (B, Hq, T, D), (B, Hk, T, D); cos, sin: (B or 1, T, R).
    ``layouts``: (q strides, k strides) for the outputs instead (the backward passes the forward inputs', so that
    the gradients land in the layout autograd accumulates into without a copy), used where dense."""
    r = check(q, k, cos, sin)
    qd = q_dtype if q_dtype is not None else out_dtype(q, cos, sin)
    kd = k_dtype if k_dtype is not None else out_dtype(k, cos, sin)
    qo = _empty(q, qd, layouts[0] if layouts else None)
    ko = _empty(k, kd, layouts[1] if layouts else None)
    b, hq, t, d = q.shape
    hk = k.shape[1]
    if b * t == 0 or (hq == 0 and hk == 0):
        return qo, ko
    if not use_triton(q):
        qo.copy_(reference(q, cos, sin, interleaved, backward, qd))
        ko.copy_(reference(k, cos, sin, interleaved, backward, kd))
        return qo, ko
    cos = cos.expand(b, t, r)
    sin = sin.expand(b, t, r)
    block_r = pow2_at_least(r // 2)
    block_p = pow2_at_least(d - r)
    # a tile of (tokens, heads, pairs): up to TILE elements per half, all heads when they fit, then tokens
    tile = _INTERPRETER_TILE if INTERPRET else _TILE
    block_hq = max(1, min(pow2_at_least(hq), tile // block_r))
    block_hk = max(1, min(pow2_at_least(hk), tile // block_r))
    block_t = max(1, min(pow2_at_least(t), tile // (block_r * max(block_hq, block_hk))))
    n_tb = cdiv(t, block_t)
    args = (q, k, qo, ko, cos, sin, *_strides4(q), *_strides4(k), *_strides4(qo), *_strides4(ko),
            *cos.stride(), *sin.stride(), t, hq, hk, d, r, n_tb)
    consts = {"INTERLEAVED": bool(interleaved), "BACKWARD": bool(backward), "HAS_PASS": r < d,
              "BLOCK_T": block_t, "BLOCK_HQ": block_hq, "BLOCK_HK": block_hk, "BLOCK_R": block_r, "BLOCK_P": block_p}
    with device_guard(q):
        warps = _WARPS or (4 if block_t * max(block_hq, block_hk) * block_r <= 2048 else 8)
        _LAUNCH(b * n_tb, args, consts, warps)
    return qo, ko
