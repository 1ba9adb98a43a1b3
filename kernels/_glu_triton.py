"""Triton kernels for the gated activations of GLU MLPs: SwiGLU and GeGLU.

``y = act(gate) * up`` elementwise (Shazeer 2020, "GLU Variants Improve
Transformer"), with ``act`` one of::

    silu(g)       = g * sigmoid(g)
    gelu(g)       = g * Phi(g) = 0.5 * g * (1 + erf(g / sqrt(2)))
    gelu_tanh(g)  = 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))

(the GELU forms are those of Hendrycks & Gimpel 2016 and of
``torch.nn.functional.gelu(approximate="tanh")``). Backward::

    d_up   = dy * act(g)
    d_gate = dy * up * act'(g)
    silu'(g)      = s * (1 + g * (1 - s)),               s = sigmoid(g)
    gelu'(g)      = Phi(g) + g * exp(-g^2 / 2) / sqrt(2 pi)
    gelu_tanh'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2)

Bytes per element (``e`` bytes each): the forward reads ``gate`` and ``up``
and writes ``y``, ``3e``; the backward reads ``gate``, ``up``, ``dy`` and writes
``d_gate``, ``d_up``, ``5e``. Unfused eager PyTorch moves ``5e`` forward
(``silu`` writes a temporary that ``mul`` reads back) and more backward.

Inputs are addressed as ``(rows, N)`` with a row stride and unit column
stride, so the two halves of a fused ``gate_up`` projection
(``h.chunk(2, -1)``) are read in place; contiguous inputs are treated as one
long row. The grid is 1-D (``rows * column blocks`` programs, int64 offsets).
All arithmetic in fp32; each output is rounded once.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ._launch import Launcher, as_rows, cdiv, device_guard, use_triton
from ._tuning import row_bucket, tuned

#: Activation codes (constexpr in the kernels).
SILU, GELU, GELU_TANH = 0, 1, 2
ACTIVATIONS = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH}

@triton.jit
def _tanh(z):
    """tanh via the sigmoid (exact identity tanh(z) = 2 sigmoid(2z) - 1; no libdevice needed)."""
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """act(g) and, when NEED_GRAD, act'(g) (else the second value is a dummy); g is fp32.

    Constants: 0.7071067811865476 = 1/sqrt(2); 0.3989422804014327 = 1/sqrt(2 pi);
    0.7978845608028654 = sqrt(2/pi); 0.044715 = the tanh-GELU cubic coefficient.
    """
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        if NEED_GRAD:
            da = s * (1.0 + g * (1.0 - s))
        else:
            da = a
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        if NEED_GRAD:
            da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
        else:
            da = a
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = _tanh(inner)
        a = 0.5 * g * (1.0 + t)
        if NEED_GRAD:
            da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        else:
            da = a
    return a, da


@triton.jit
def _glu_fwd_elementwise(
    G, U, Y,  # G, U: (rows, N) inputs, row strides below, column stride 1; Y: (rows, N) contiguous
    stride_g, stride_u, N, n_col_blocks,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    g = tl.load(G + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT, False)
    tl.store(Y + row * N + cols, (a * u).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _glu_bwd_elementwise(
    DY, G, U, DG, DU, Y,  # DY, G, U: (rows, N) with row strides; DG, DU (and Y with WRITE_Y): contiguous outputs
    stride_dy, stride_g, stride_u, N, n_col_blocks,
    ACT: tl.constexpr, BLOCK: tl.constexpr, WRITE_Y: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    dy = tl.load(DY + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT, True)
    tl.store(DU + row * N + cols, (dy * a).to(DU.dtype.element_ty), mask=m)
    tl.store(DG + row * N + cols, (dy * u * da).to(DG.dtype.element_ty), mask=m)
    if WRITE_Y:  # the forward's output again, for a caller that did not keep it (the fused down projection)
        tl.store(Y + row * N + cols, (a * u).to(Y.dtype.element_ty), mask=m)


_FWD = Launcher(_glu_fwd_elementwise)
_BWD = Launcher(_glu_bwd_elementwise)

_CANDIDATES = [(1024, 4), (2048, 8), (4096, 8), (1024, 8), (2048, 4), (512, 4)]  # (BLOCK, num_warps)


def _rows(gate: torch.Tensor, up: torch.Tensor, *more: torch.Tensor):
    """Views of the inputs as (rows, N) with strides; one long row when all are contiguous."""
    ts = (gate, up) + more
    if all(t.is_contiguous() for t in ts):
        return [(t.view(1, -1), t.numel()) for t in ts], 1, gate.numel()
    n = gate.shape[-1] if gate.dim() else 1
    views = [as_rows(t, n) for t in ts]
    return views, views[0][0].shape[0], n


def _check(gate: torch.Tensor, up: torch.Tensor, activation: str) -> int:
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate dtype {gate.dtype} != up dtype {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate device {gate.device} != up device {up.device}")
    if gate.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {gate.dtype} is not supported (float32, float16 or bfloat16)")
    act = ACTIVATIONS.get(activation)
    if act is None:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    return act


def glu_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up``. gate, up: same shape, dtype and device, any strides. Returns a contiguous tensor."""
    act = _check(gate, up, activation)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel() == 0:
        return y
    if not use_triton(gate):
        return y.copy_(_torch_act(gate.float(), activation) * up.float())
    [(g2, sg), (u2, su)], rows, n = _rows(gate, up)

    def launch(c):
        ncb = cdiv(n, c[0])
        _FWD(rows * ncb, (g2, u2, y, sg, su, n, ncb), {"ACT": act, "BLOCK": c[0]}, c[1])

    with device_guard(gate):
        launch(tuned("glu_fwd", gate.device, (act, gate.dtype, rows == 1, row_bucket(y.numel())),
                     lambda: _CANDIDATES, launch, y.numel()))
    return y


def glu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, want_y: bool = False
            ) -> Tuple[torch.Tensor, ...]:
    """Gradients ``(d_gate, d_up)`` of :func:`glu_fwd`; contiguous, in the inputs' dtype. With ``want_y`` also
    the forward's output ``act(gate) * up`` (bit-identical to :func:`glu_fwd`'s), written by the same launch:
    ``(d_gate, d_up, y)``."""
    act = _check(gate, up, activation)
    if dy.shape != gate.shape or dy.device != gate.device:
        raise ValueError(f"gradient {tuple(dy.shape)} on {dy.device} != gate {tuple(gate.shape)} on {gate.device}")
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if want_y else None
    if dg.numel() == 0:
        return (dg, du, y) if want_y else (dg, du)
    if not use_triton(gate):  # PyTorch fallback in fp32: aten's own activation backward (no autograd needed,
        # so it also runs inside the custom op, where autograd is off: under torch.compile or FlopCounterMode)
        g = gate.float()
        gu = dy.float() * up.float()
        if activation == "silu":
            da = torch.ops.aten.silu_backward(gu, g)
        else:
            da = torch.ops.aten.gelu_backward(gu, g, approximate="tanh" if activation == "gelu_tanh" else "none")
        a = _torch_act(g, activation)
        dg.copy_(da), du.copy_(dy.float() * a)
        return (dg, du, y.copy_(a * up.float())) if want_y else (dg, du)
    [(dy2, sdy), (g2, sg), (u2, su)], rows, n = _rows(dy, gate, up)

    def launch(c):
        ncb = cdiv(n, c[0])
        _BWD(rows * ncb, (dy2, g2, u2, dg, du, y if want_y else dg, sdy, sg, su, n, ncb),
             {"ACT": act, "BLOCK": c[0], "WRITE_Y": want_y}, c[1])

    with device_guard(gate):
        launch(tuned("glu_bwd", gate.device, (act, gate.dtype, rows == 1, row_bucket(dg.numel()), want_y),
                     lambda: _CANDIDATES, launch, dg.numel()))
    return (dg, du, y) if want_y else (dg, du)


def reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` in differentiable PyTorch ops, fp32 math and one rounding as the kernels (the graph
    ``torch.compile`` is given). Raises ValueError as :func:`glu_fwd`."""
    _check(gate, up, activation)
    return (_torch_act(gate.float(), activation) * up.float()).to(gate.dtype)


def _torch_act(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(g)
    return torch.nn.functional.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")
