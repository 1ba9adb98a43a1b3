"""The rotary drop-in's gain beyond the ops it matches: rotate_half's slice backward and the gradient layout.

Synthetic windows with hand-derived expected gains (docs/analyze.md, "How the gains are modelled", gives the
H200 measurements these rules come from: docs/gpu-runs/rotary_gain-run1.md).
"""

from __future__ import annotations

import pytest
import torch

from mfuwatch.agent.analysis.analyze import analyze_events
from mfuwatch.agent.analysis.gain_model import eager_grad_layout, relayout_credit
from mfuwatch.kernels import traffic
from tests.helpers.chrome_trace_builder import TraceBuilder

F32 = "float"
BW = 1e12  # bytes/s
PEAKS = {"peak_flops": {"fp32": 10e12, "bf16": 100e12}, "memory_bandwidth_bytes_per_second": 2e12,
         "measured_bandwidth_bytes_per_second": BW}
STEP = 1e-3  # s
B, H, T, D = 4, 8, 256, 64
E = B * H * T * D  # elements of q
#: q = base.transpose(1, 2) with base (B, T, H, D) contiguous
Q_STRIDES = [T * H * D, D, H * D, 1]
CONTIG = [H * T * D, T * D, D, 1]
#: eager's gradient (contiguous in (B, H, T, D)) as base's backward sees it: (B, T, H, D) dims
SEEN_DIMS, SEEN_STRIDES = [B, T, H, D], [H * T * D, D, T * D, 1]
STRIDED = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<BinaryFunctor<float> > >(int)"
VECTORIZED = "void at::native::vectorized_elementwise_kernel<4, BinaryFunctor<float> >(int)"


def test_eager_grad_layout_is_a_contiguous_q_gradient_seen_through_the_transpose():
    base = torch.empty(B, T, H, D)
    q = base.transpose(1, 2)  # the transposed projection (or its q-norm's output)
    assert list(q.stride()) == Q_STRIDES
    # a gradient contiguous in q's (B, H, T, D) order, as the base's backward sees it (strides by torch itself)
    seen = torch.empty(q.shape).transpose(1, 2)
    assert eager_grad_layout(list(q.shape), list(q.stride())) == (tuple(seen.shape), seen.stride())
    assert (tuple(seen.shape), seen.stride()) == (tuple(SEEN_DIMS), tuple(SEEN_STRIDES))
    assert not seen.is_contiguous()
    # a permutation of three dims (a channels-last view) is handled alike
    cl = torch.empty(2, 5, 7, 3).permute(0, 3, 1, 2)
    seen = torch.empty(cl.shape).permute(0, 2, 3, 1)
    assert eager_grad_layout(list(cl.shape), list(cl.stride())) == (tuple(seen.shape), seen.stride())


def test_eager_grad_layout_refuses_contiguous_and_non_dense_views():
    assert eager_grad_layout([B, H, T, D], CONTIG) is None  # contiguous: the gradient comes back alike
    sliced = torch.empty(B, T, H, 2 * D).transpose(1, 2)[..., :D]
    assert eager_grad_layout(list(sliced.shape), list(sliced.stride())) is None  # gaps: not a permutation
    assert eager_grad_layout([B, H], [1]) is None


def test_relayout_credit_is_strided_time_less_one_contiguous_pass():
    assert relayout_credit(20.0, 6e6, 1e12) == pytest.approx(14.0)
    assert relayout_credit(5.0, 6e6, 1e12) == 0.0  # already at the bandwidth: nothing to gain
    assert relayout_credit(20.0, 6e6, 0.0) == 0.0


def _window(q_strides, *, upstream):
    """One rotary call on q as Hugging Face's eager apply_rotary_pos_emb runs it (forward on thread 1, backward
    nodes on thread 2), plus ``upstream``: backward nodes outside the pattern as (node, op, dims, strides,
    kernel name, µs)."""
    b = TraceBuilder()
    t, seq = 0.0, 200
    bwd_t = 10_000.0

    def node(name, s, kernels):
        nonlocal bwd_t
        b.op(f"autograd::engine::evaluate_function: {name}", bwd_t, 20.0, tid=2, seq=s)
        for i, us in enumerate(kernels):
            ext = b.op("aten::mul", bwd_t + 1 + 4 * i, 3.0, tid=2, dims=[[B, H, T, D]], types=[F32])
            b.kernel("k_bwd", bwd_t + 1 + 4 * i, us, ext=ext)
        bwd_t += 30.0

    def fwd(name, dims, types, kernel_us, strides=None, backward=None):
        nonlocal t, seq
        seq += 1
        ext = b.op(name, t, 5.0, dims=dims, types=types, seq=seq, strides=strides)
        if kernel_us:
            b.kernel("k_" + name, t + 1.0, kernel_us, ext=ext)
        if backward is not None:
            node(backward[0], seq, backward[1])
        t += 20.0

    half = [B, H, T, D // 2]
    fwd("aten::mul", [[B, H, T, D], [1, 1, T, D]], [F32, F32], 10.0, [q_strides, [T * D, T * D, D, 1]],
        ("MulBackward0", [10.0]))
    fwd("aten::slice", [[B, H, T, D], [], [], [], []], [F32] + ["Scalar"] * 4, 0.0, None,
        ("SliceBackward0", [2.0, 3.0]))  # zero-fill, copy into the half
    fwd("aten::slice", [[B, H, T, D], [], [], [], []], [F32] + ["Scalar"] * 4, 0.0, None,
        ("SliceBackward0", [2.0, 3.0, 4.0]))  # zero-fill, copy, add of the two halves
    fwd("aten::neg", [half], [F32], 5.0, None, ("NegBackward0", [5.0]))
    fwd("aten::cat", [[half, half], []], ["TensorList", "Scalar"], 6.0, None, ("CatBackward0", []))
    fwd("aten::mul", [[B, H, T, D], [1, 1, T, D]], [F32, F32], 10.0, None, ("MulBackward0", [10.0]))
    fwd("aten::add", [[B, H, T, D], [B, H, T, D], []], [F32, F32, "Scalar"], 8.0, None, ("AddBackward0", []))
    for i, (name, op, dims, strides, kname, us) in enumerate(upstream):
        b.op(f"autograd::engine::evaluate_function: {name}", bwd_t, 40.0, tid=2, seq=150 - i)
        ext = b.op(op, bwd_t + 1, 30.0, tid=2, dims=dims, types=[F32] * len(dims), strides=strides)
        b.kernel(kname, bwd_t + 2, us, ext=ext)
        bwd_t += 50.0
    wm = analyze_events(b.events, spec_or_peaks=PEAKS, steps=1, step_time_seconds=STEP)
    return {s.kernel: s for s in wm.suggestions}["rotary"]


#: fwd mul, neg, cat, mul, add + their backward (MulBackward0 x2, NegBackward0) and the two SliceBackward0
MATCHED_US = (10 + 5 + 6 + 10 + 8) + (10 + 10 + 5) + (2 + 3) + (2 + 3 + 4)
#: the drop-in: forward reads q and writes q_embed, backward reads the gradient and writes dq (fp32)
FUSED_BYTES = traffic.minimal_bytes("rotary", B * H * T, D, 4) + traffic.minimal_bytes("rotary", B * H * T, D, 4,
                                                                                      backward=True)
MUL_BYTES = 3 * E * 4  # aten::mul of two (B, T, H, D) fp32 tensors: two reads, one write


def _upstream():
    seen_in = [SEEN_DIMS, SEEN_DIMS]
    return [
        # the q-norm's backward: fed eager's gradient, strided: credited 20 µs - one pass
        ("MulBackward0", "aten::mul", seen_in, [SEEN_STRIDES, [T * H * D, H * D, D, 1]], STRIDED, 20.0),
        # the same op with contiguous inputs: not fed by the rotary's gradient
        ("MulBackward0", "aten::mul", seen_in, [[T * H * D, H * D, D, 1]] * 2, STRIDED, 20.0),
        # fed eager's gradient but already vectorized (a layout-preserving op): nothing to gain
        ("MulBackward0", "aten::mul", seen_in, [SEEN_STRIDES, SEEN_STRIDES], VECTORIZED, 20.0),
    ]


def test_rotary_claims_the_slice_backward_of_rotate_half_and_credits_the_relayout():
    s = _rotary_suggestion(Q_STRIDES)
    assert FUSED_BYTES == 2 * (2 * E * 4)
    credit = 20.0 - MUL_BYTES / BW * 1e6  # the strided upstream mul less one contiguous pass
    assert credit == pytest.approx(20.0 - 6.291456)
    assert s.time_seconds == pytest.approx((MATCHED_US + credit) * 1e-6)  # what it saves there, not its 20 µs
    assert s.expected_gain == pytest.approx((MATCHED_US * 1e-6 - FUSED_BYTES / BW + credit * 1e-6) / STEP,
                                            rel=1e-12)


def test_a_contiguous_rotary_input_gets_no_relayout_credit():
    s = _rotary_suggestion(CONTIG)  # q not a transposed view: eager's gradient has q's layout already
    assert s.time_seconds == pytest.approx(MATCHED_US * 1e-6)
    assert s.expected_gain == pytest.approx((MATCHED_US * 1e-6 - FUSED_BYTES / BW) / STEP, rel=1e-12)


def _rotary_suggestion(q_strides):
    return _window(q_strides, upstream=_upstream())
