"""Minimal-bytes formulas of the fused kernels, checked against hand counts."""

import pytest

from mfuwatch.kernels.traffic import KERNELS, minimal_bytes


def test_rms_norm_llama_shape_by_hand():
    # 4096 tokens x 2048 hidden, bf16: forward reads x (16 MiB) and writes y (16 MiB) and reads
    # the 2048-element weight (4 KiB); backward reads x and dy, writes dx, reads w and writes dw.
    e = 4096 * 2048 * 2
    assert minimal_bytes("rms_norm", 4096, 2048) == 2 * e + 4096
    assert minimal_bytes("rms_norm", 4096, 2048, backward=True) == 3 * e + 2 * 4096


def test_other_kernels_by_hand():
    assert minimal_bytes("layer_norm", 10, 8, 4) == 2 * 320 + 2 * 32  # x, y; weight and bias
    assert minimal_bytes("layer_norm", 10, 8, 4, backward=True) == 3 * 320 + 4 * 32
    assert minimal_bytes("add_rms_norm", 10, 8, 2, weight_bytes=4) == 4 * 160 + 32
    assert minimal_bytes("add_rms_norm", 10, 8, 2, backward=True, weight_bytes=4) == 4 * 160 + 64
    # SwiGLU at 8192 x 11008 bf16: gate, up read and y written = 3 x 180,355,072 bytes
    assert minimal_bytes("swiglu", 8192, 11008) == 3 * 180_355_072
    assert minimal_bytes("geglu", 8192, 11008, backward=True) == 5 * 180_355_072


def test_errors_and_names():
    assert KERNELS == ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "geglu", "cross_entropy")
    with pytest.raises(ValueError, match="unknown kernel 'softmax'"):
        minimal_bytes("softmax", 1, 1)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        minimal_bytes("rms_norm", -1, 8)
