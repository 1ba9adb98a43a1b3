"""Our attention and grouped-matmul FLOP formulas: hand counts, torch-version independence, trace shapes."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mfuwatch.agent.flops import op_flops


def test_gqa_sdpa_formula_on_shapes_torch_2_11_rejects():
    # 16 query heads over 4 KV heads: torch 2.11's sdpa_flop_count raises "shapes are incompatible" here
    B, Hq, Hkv, Tq, Tk, D = 2, 16, 4, 24, 40, 8
    q, k, v = (B, Hq, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D)
    mm = 2 * B * Hq * Tq * Tk * D  # one (Tq x D) @ (D x Tk) product per batch and query head
    assert op_flops.op_flops("aten::_scaled_dot_product_flash_attention", [q, k, v]) == 2 * mm
    assert op_flops.op_flops("aten::_scaled_dot_product_cudnn_attention_backward", [q, q, k, v]) == 5 * mm
    # (B, T, H, D) layout of the low-level kernels gives the same
    bt = lambda s: (s[0], s[2], s[1], s[3])  # noqa: E731
    assert op_flops.op_flops("aten::_flash_attention_forward", [bt(q), bt(k), bt(v), None, None, Tq, Tk]) == 2 * mm
    assert op_flops.op_flops("aten::_efficient_attention_backward",
                             [bt(q), bt(q), bt(k), bt(v), None, bt(q), None, None, Tq, Tk]) == 5 * mm
    # heads that do not divide are not attention we know: no number rather than a wrong one
    assert op_flops.op_flops("aten::_scaled_dot_product_flash_attention", [(B, 6, Tq, D), (B, 4, Tk, D),
                                                                            (B, 4, Tk, D)]) is None


def test_gqa_sdpa_counted_equals_eager_with_repeated_kv_heads():
    # independent count: eager attention with the KV heads repeated, counted by torch's bmm formula
    B, Hq, Hkv, T, D = 1, 16, 4, 12, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, generator=g, requires_grad=True)
    with FlopCounterMode(display=False) as eager:
        kk, vv = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        (torch.softmax(q @ kk.transpose(-1, -2) / D ** 0.5, -1) @ vv).sum().backward()
    ours = FlopCounterMode(display=False, custom_mapping=op_flops.flop_counter_mapping())
    with ours:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum().backward()
    fwd = 2 * 2 * B * Hq * T * T * D
    assert eager.get_total_flops() == 3 * fwd  # forward + dQ, dK, dP, dV
    assert ours.get_total_flops() == fwd + 5 * fwd // 2  # the fused backward also recomputes Q K^T


def test_grouped_mm_formula_matches_a_loop_of_mms():
    g = torch.Generator().manual_seed(0)
    G, K, N = 3, 8, 8  # row strides a multiple of 16 bytes, as the kernel requires
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)  # group sizes 4, 0, 7 (an empty expert)
    a = torch.randn(11, K, generator=g)
    b = torch.randn(G, K, N, generator=g)
    assert op_flops.grouped_mm_flops(tuple(a.shape), tuple(b.shape), (11, N)) == 2 * 11 * K * N
    assert op_flops.grouped_mm_flops((G, 4, K), (G, K, N)) == 2 * G * 4 * K * N
    assert op_flops.grouped_mm_flops((K, 11), (11, N)) == 2 * K * 11 * N  # weight-gradient form
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    try:
        with FlopCounterMode(display=False, custom_mapping=op_flops.flop_counter_mapping()) as fc:
            torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as exc:  # the CPU kernel may be missing from a build
        pytest.skip(f"torch._grouped_mm does not run here: {exc}")
    with FlopCounterMode(display=False) as loop:
        for lo, hi, w in ((0, 4, b[0]), (4, 4, b[1]), (4, 11, b[2])):
            a[lo:hi] @ w
    assert fc.get_total_flops() == loop.get_total_flops() == 2 * 11 * K * N


def test_trace_shapes_and_unknown_ops():
    assert op_flops.trace_op_flops("aten::_grouped_mm", [[64, 32], [4, 32, 16], [4]], None) == 2 * 64 * 32 * 16
    assert op_flops.trace_op_flops("aten::mm", [[2, 2], [2, 2]]) is None  # not ours: torch's table has it
    assert op_flops.trace_op_flops("aten::_scaled_dot_product_flash_attention", [[1, 2], [], []]) is None
