"""Minimal-bytes formulas of the fused kernels, checked against hand counts."""

import pytest

import mfuwatch.kernels as mk
from mfuwatch.kernels.traffic import minimal_bytes


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


def test_rotary_by_hand():
    # k of Llama-3-8B at 16384 tokens: 8 heads x 128 dims, bf16 = 33,554,432 bytes; read and written each way
    assert minimal_bytes("rotary", 16384 * 8, 128) == 2 * 33_554_432
    assert minimal_bytes("rotary", 16384 * 8, 128, backward=True) == 2 * 33_554_432


def test_errors_and_names():
    for kernel in mk.AVAILABLE_KERNELS:  # one kernel list (the package's): each has its byte count
        assert minimal_bytes(kernel, 2, 4) > 0, kernel
    with pytest.raises(ValueError, match="unknown kernel 'softmax'"):
        minimal_bytes("softmax", 1, 1)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        minimal_bytes("rms_norm", -1, 8)
