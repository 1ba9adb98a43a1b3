"""FLOPs and bytes of single ops from recorded shapes, checked against hand-derived counts."""

from __future__ import annotations

import pytest

from mfuwatch.agent.analysis.opcost import op_cost

BF16, F32, I64 = "c10::BFloat16", "float", "long int"


def test_mm_flops_and_bytes():
    c = op_cost("aten::mm", [[128, 64], [64, 32]], [BF16, BF16], ["", ""])
    assert c.flops == 2 * 128 * 64 * 32
    assert c.bytes == (128 * 64 + 64 * 32 + 128 * 32) * 2  # a, b read; c written; 2 B each
    assert c.matmul and c.exact_flops and c.dtype == "bf16"
    assert c.intensity == pytest.approx(2 * 128 * 64 * 32 / ((128 * 64 + 64 * 32 + 128 * 32) * 2))


def test_addmm_with_scalar_arguments_uses_torchs_formula():
    c = op_cost("aten::addmm", [[32], [128, 64], [64, 32], [], []], [F32, F32, F32, "Scalar", "Scalar"],
                ["", "", "", "1", "1"])
    assert c.exact_flops and c.flops == 2 * 128 * 64 * 32
    assert c.bytes == (32 + 128 * 64 + 64 * 32 + 128 * 32) * 4


def test_bmm_and_baddbmm():
    c = op_cost("aten::bmm", [[8, 16, 32], [8, 32, 4]], [F32, F32], ["", ""])
    assert c.flops == 2 * 8 * 16 * 32 * 4 and c.bytes == (8 * 16 * 32 + 8 * 32 * 4 + 8 * 16 * 4) * 4
    c = op_cost("aten::baddbmm", [[8, 16, 4], [8, 16, 32], [8, 32, 4], [], []], [F32, F32, F32, "Scalar", "Scalar"],
                ["", "", "", "1", "1"])
    assert c.flops == 2 * 8 * 16 * 32 * 4


def test_cudnn_attention_forward_and_backward():
    b, h, s, d = 2, 4, 128, 64
    q = [b, h, s, d]
    fwd = op_cost("aten::_cudnn_attention_forward", [q, q, q], [BF16] * 3, [""] * 3)
    assert fwd.flops == 4 * b * h * s * s * d  # q·kᵀ and p·v, 2 FLOP per multiply-add
    assert fwd.bytes == 4 * b * h * s * d * 2  # read q, k, v; write o
    bwd = op_cost("aten::_cudnn_attention_backward", [q] * 5 + [[b, h, s, 1]], [BF16] * 5 + [F32], [""] * 6)
    assert bwd.flops == 10 * b * h * s * s * d  # torch counts 5 matmuls backward (scores recomputed)
    assert bwd.bytes == (5 * b * h * s * d * 2 + b * h * s * 4) + 3 * b * h * s * d * 2  # + dq, dk, dv


@pytest.mark.parametrize("name, dims, types, concrete, out_hw, bias", [
    ("aten::cudnn_convolution", [[2, 3, 32, 32], [8, 3, 3, 3], [], [], [], [], [], [], []],
     [F32, F32, "ScalarList", "ScalarList", "ScalarList", "Scalar", "Scalar", "Scalar", "Scalar"],
     ["", "", "[1, 1]", "[1, 1]", "[1, 1]", "1", "False", "False", "True"], 32, 0),
    ("aten::convolution", [[2, 3, 32, 32], [8, 3, 3, 3], [8], [], [], [], [], [], []],
     [F32, F32, F32, "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList", "Scalar"],
     ["", "", "", "[2, 2]", "[0, 0]", "[1, 1]", "False", "[0, 0]", "1"], 15, 8),
])
def test_convolution_output_shape_and_flops(name, dims, types, concrete, out_hw, bias):
    c = op_cost(name, dims, types, concrete)
    n, cin, cout, k = 2, 3, 8, 3  # out = (32 + 2·pad − (k − 1) − 1) / stride + 1
    assert c.flops == 2 * n * cout * out_hw * out_hw * cin * k * k
    assert c.bytes == (n * cin * 32 * 32 + cout * cin * k * k + bias + n * cout * out_hw * out_hw) * 4


def test_pointwise_inplace_copy_fill_and_views():
    add = op_cost("aten::add", [[4, 256], [256]], [F32, F32], ["", ""])
    assert add.bytes == (4 * 256 + 256 + 4 * 256) * 4 and add.flops == 4 * 256 and not add.exact_flops
    add_ = op_cost("aten::add_", [[4, 256], [4, 256]], [F32, F32], ["", ""])
    assert add_.bytes == 3 * 4 * 256 * 4  # reads both, writes the first
    copy = op_cost("aten::copy_", [[1000], [1000], []], [BF16, F32, "Scalar"], ["", "", "False"])
    assert copy.bytes == 1000 * 2 + 1000 * 4  # reads the fp32 source, writes the bf16 destination
    assert op_cost("aten::fill_", [[100], []], [F32, "Scalar"], ["", "0"]).bytes == 400
    assert op_cost("aten::view", [[4, 256], []], [F32, "ScalarList"], ["", "[1024]"]).bytes == 0


def test_reduction_output_uses_dims_and_keepdim():
    c = op_cost("aten::mean", [[4, 1024, 2048], [], [], []], [F32, "ScalarList", "Scalar", ""],
                ["", "[-1]", "True", ""])
    assert c.bytes == 4 * 1024 * 2048 * 4 + 4 * 1024 * 4
    full = op_cost("aten::sum", [[8, 8], []], [F32, ""], ["", ""])
    assert full.bytes == 64 * 4 + 4


def test_to_copy_writes_the_requested_dtype_and_embedding_reads_rows():
    c = op_cost("aten::_to_copy", [[10, 10], [], [], [], [], [], []], [F32, "Scalar", "Scalar", "", "", "Scalar", ""],
                ["", "15", "0", "", "", "False", ""])
    assert c.bytes == 100 * 4 + 100 * 2  # ScalarType 15 = bfloat16
    e = op_cost("aten::embedding", [[32000, 2048], [4, 1024], [], [], []], [F32, I64, "Scalar", "Scalar", "Scalar"],
                ["", "", "-1", "False", "False"])
    assert e.bytes == 2 * 4 * 1024 * 2048 * 4 + 4 * 1024 * 8  # gathered rows read + written, indices read


def test_foreach_lists_with_and_without_recorded_shapes():
    unknown = op_cost("aten::_foreach_mul_", [[], []], ["TensorList", "Scalar"], ["", "0.9"])
    assert unknown.bytes == 0
    known = op_cost("aten::_foreach_add_", [[[10, 10], [5]], [[10, 10], [5]]], ["TensorList", "TensorList"], ["", ""])
    assert known.bytes == (105 * 4) * 2 + 105 * 4  # two lists read, the first rewritten (4 B/element)


def test_gather_like_ops_count_only_the_selected_elements():
    g = op_cost("aten::gather", [[4096, 32000], [], [4096, 1], []], [F32, "Scalar", I64, "Scalar"],
                ["", "1", "", "False"])
    assert g.bytes == 2 * 4096 * 4 + 4096 * 8  # selected elements read, output written, indices read
    s = op_cost("aten::index_select", [[100, 64], [], [10]], [F32, "Scalar", I64], ["", "0", ""])
    assert s.bytes == 2 * 10 * 64 * 4 + 10 * 8
