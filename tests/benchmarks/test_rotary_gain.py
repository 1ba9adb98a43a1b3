"""benchmarks/rotary_gain.py: kernel names as its tables print them, and per-step attribution to launching nodes."""

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers.chrome_trace_builder import TraceBuilder

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "rotary_gain.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("rotary_gain", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STRIDED = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::BinaryFunctor<float, "
           "float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, "
           "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)"
           "::{lambda(int)#1}>(int, at::native::gpu_kernel_impl<...>::{lambda(int)#1})")
VECTOR = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
          "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")
TRIVIAL = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
           "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, "
           "2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
           "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, ...)")


def test_short_names_mark_the_strided_path_only():
    rg = _module()
    assert rg.short(STRIDED) == "elementwise_kernel BinaryFunctor [strided]"  # as run 1's tables print it
    assert rg.short(VECTOR) == "vectorized_elementwise_kernel FillFunctor"
    assert rg.short(TRIVIAL).startswith("unrolled_elementwise_kernel") and "[strided]" not in rg.short(TRIVIAL)
    assert rg.short("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN"


def test_aggregate_attributes_each_kernel_to_its_outermost_op_per_step(tmp_path):
    rg = _module()
    b = TraceBuilder()
    # two steps: a forward mul (one strided kernel) and a backward node whose inner mul launches a fill and
    # a strided kernel
    for step in range(2):
        t = 1000.0 * step
        ext = b.op("aten::mul", t, 5.0, dims=[[4, 4]])
        b.kernel(STRIDED, t + 1, 10.0, ext=ext)
        b.op("autograd::engine::evaluate_function: MulBackward0", t + 100, 20.0, tid=2, seq=7)
        ext = b.op("aten::mul", t + 101, 5.0, tid=2, dims=[[4, 4]])
        b.kernel(VECTOR, t + 102, 2.0, ext=ext)
        b.kernel(STRIDED, t + 105, 6.0, ext=ext, via_runtime=True)  # linked through its launch's correlation
    path = b.write(str(tmp_path / "t.json.gz"), gz=True)
    agg = rg.aggregate(path, steps=2)
    s, v = rg.short(STRIDED), rg.short(VECTOR)
    assert agg["kernel"][(s, "")] == pytest.approx([2.0, 16.0])  # per step: 2 strided kernels, 10 + 6 µs
    assert agg["kernel"][(v, "")] == pytest.approx([1.0, 2.0])
    assert agg["node"][("aten::mul", s)] == pytest.approx([1.0, 10.0])
    assert agg["node"][("bwd:MulBackward0", s)] == pytest.approx([1.0, 6.0])
    assert agg["node"][("bwd:MulBackward0", v)] == pytest.approx([1.0, 2.0])
