"""``_launch``: row views (copy only when needed), and which calls ``Launcher`` sends through Triton's JIT
and which reuse the compiled kernel.

The direct path only runs on a GPU (the interpreter has no compiled kernels), so these tests hand
the launcher a stand-in for a ``@triton.jit`` function and for the CUDA stream getters, and check
what it calls and with which arguments. On the GPU machine the whole kernel suite
(``MFUWATCH_KERNEL_TESTS_ON_GPU=1``) and ``benchmarks/kernels.py`` run through the direct path.
"""

import types

import pytest
import torch

from mfuwatch.kernels import _launch
from mfuwatch.kernels._launch import Launcher, _direct_args, as_rows, pow2_at_least


def test_as_rows_views_without_copy_when_strides_allow():
    x = torch.randn(2, 3, 8)
    v, s = as_rows(x, 8)
    assert v.shape == (6, 8) and s == 8 and v.data_ptr() == x.data_ptr()
    wide = torch.randn(5, 12)
    v, s = as_rows(wide[:, 2:10], 8)  # a slice of wider rows: read in place with row stride 12
    assert s == 12 and v.data_ptr() == wide[:, 2:].data_ptr()
    b = torch.randn(1, 8).expand(4, 8)  # broadcast rows: row stride 0
    v, s = as_rows(b, 8)
    assert s == 0 and v.data_ptr() == b.data_ptr()


def test_as_rows_copies_a_strided_last_dimension():
    t = torch.randn(8, 3).t()  # (3, 8), last-dim stride 3
    v, s = as_rows(t, 8)
    assert v.is_contiguous() and s == 8 and torch.equal(v, t)
    with pytest.raises(ValueError, match=r"shape \(3, 8\) as rows of 5"):
        as_rows(t, 5)


def test_pow2_at_least():
    assert [pow2_at_least(n) for n in (0, 1, 2, 17, 64, 5120)] == [1, 1, 2, 32, 64, 8192]


class FakeCompiled:
    def __init__(self, log):
        self.log = log
        self.function = "FUNC"
        self.packed_metadata = "META"

    def run(self, *a):
        self.log.append(("direct", a))


class FakeJit:
    """Stands in for a JITFunction: ``fn[grid](*args, **consts)`` logs the call and returns a compiled kernel."""

    def __init__(self, arg_names):
        self.arg_names = arg_names
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return FakeCompiled(self.log)
        return launch


@pytest.fixture
def fast(monkeypatch):
    rt = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)

    def make(arg_names):
        fn = FakeJit(arg_names)
        lau = Launcher(fn)
        lau._rt = rt
        return fn, lau
    return make, rt


def kinds(log):
    return [e[0] for e in log]


def test_second_call_with_same_specialisation_is_direct_with_all_arguments_in_order(fast):
    make, _ = fast
    fn, lau = make(["X", "Y", "n", "eps", "A", "B"])
    x = torch.zeros(64, dtype=torch.bfloat16)
    y = torch.zeros(64, dtype=torch.bfloat16)
    lau(7, (x, y, 64, 1e-6), {"A": True, "B": 128}, 4)
    assert kinds(fn.log) == ["jit"]
    assert fn.log[0][1] == (7,) and fn.log[0][3] == {"A": True, "B": 128, "num_warps": 4}
    lau(9, (x, y, 64, 1e-5), {"A": True, "B": 128}, 4)  # a different float and grid: same kernel
    assert kinds(fn.log) == ["jit", "direct"]
    # tensors reach the compiled launcher as their data pointers (no data_ptr() call or pointer check there)
    assert fn.log[1][1] == (9, 1, 1, 1234, "FUNC", "META", None, None, None, x.data_ptr(), y.data_ptr(), 64, 1e-5,
                            True, 128)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_is_one", "int_not_div16", "int64", "consts", "warps",
                                    "maxnreg"])
def test_a_different_specialisation_goes_through_the_jit(fast, change):
    make, _ = fast
    fn, lau = make(["X", "n", "B"])
    base = torch.zeros(80, dtype=torch.bfloat16)
    x, n, consts, warps = base[:64], 64, {"B": 1}, 4
    lau(1, (x, n), consts, warps)
    lau(1, (x, n), consts, warps)
    assert kinds(fn.log) == ["jit", "direct"]
    if change == "misaligned":
        x = base[1:65]  # data pointer 2 bytes past a 16-byte boundary
    elif change == "dtype":
        x = torch.zeros(64, dtype=torch.float16)
    elif change == "int_is_one":
        n = 1
    elif change == "int_not_div16":
        n = 65
    elif change == "int64":
        n = 2 ** 33
    elif change == "consts":
        consts = {"B": 2}
    elif change == "maxnreg":
        lau(1, (x, n), consts, warps, 64)
        assert kinds(fn.log) == ["jit", "direct", "jit"]
        return
    else:
        warps = 8
    lau(1, (x, n), consts, warps)
    assert kinds(fn.log) == ["jit", "direct", "jit"]


def test_maxnreg_reaches_triton_only_when_set(fast):
    """A register cap is a compile option: passed to Triton's launch as ``maxnreg``, and absent (the compiler's
    choice) when None, so that a Triton without the option still runs the uncapped settings."""
    make, _ = fast
    fn, lau = make(["X", "B"])
    x = torch.zeros(64, dtype=torch.bfloat16)
    lau(1, (x,), {"B": 1}, 16, 64)
    lau(1, (x,), {"B": 1}, 16, None)
    assert fn.log[0][3] == {"B": 1, "num_warps": 16, "maxnreg": 64}
    assert fn.log[1][3] == {"B": 1, "num_warps": 16}
    lau(1, (x,), {"B": 1}, 16, 64)  # the capped kernel again: direct
    assert kinds(fn.log) == ["jit", "jit", "direct"]


def test_specialisation_key_classes():
    def key(a):
        return _direct_args((a,))[0][0]
    assert key(1) != key(16) != key(17)
    assert key(32) == key(48)  # both divisible by 16, int32
    assert key(2 ** 31) != key(32)  # int64 vs int32
    assert key(0.5) == key(3.0)  # floats are not specialised
    assert key(None) is None and key(True) is True
    t = torch.zeros(8, dtype=torch.float16)
    assert _direct_args((t, 3, None))[1] == [t.data_ptr(), 3, None]
    # one tensor in several slots (an absent operand pointing at another) is read once, keyed the same
    u = torch.zeros(24, dtype=torch.bfloat16)[1:]  # misaligned: 2 bytes past a 16-byte boundary
    k, call = _direct_args((t, u, t, 5, u))
    assert call == [t.data_ptr(), u.data_ptr(), t.data_ptr(), 5, u.data_ptr()]
    assert k[0] == k[2] == (torch.float16, True, False) and k[1] == k[4] == (torch.bfloat16, False, False)


def test_a_host_tensor_is_keyed_apart_from_a_device_tensor(fast):
    """A CPU tensor must not reuse a kernel compiled for device pointers: it takes the JIT path, whose
    pointer check raises, instead of a launch on a host address."""
    make, _ = fast
    fn, lau = make(["X", "B"])

    def fake(is_cuda):
        return types.SimpleNamespace(dtype=torch.bfloat16, is_cuda=is_cuda, data_ptr=lambda: 4096)
    lau(1, (fake(True),), {"B": 1}, 4)
    lau(1, (fake(True),), {"B": 1}, 4)
    lau(1, (fake(False),), {"B": 1}, 4)
    assert kinds(fn.log) == ["jit", "direct", "jit"]


class Chain:
    """Like Triton's ``HookChain``: always present, empty when no hook is registered."""

    def __init__(self):
        self.calls = []


def test_launch_hook_set_means_jit_every_time(fast):
    make, rt = fast
    rt.launch_enter_hook, rt.launch_exit_hook = Chain(), Chain()  # empty chains: no hook
    fn, lau = make(["X", "B"])
    x = torch.zeros(16)
    lau(1, (x,), {"B": 1}, 4)
    lau(1, (x,), {"B": 1}, 4)
    assert kinds(fn.log) == ["jit", "direct"]
    rt.launch_enter_hook.calls.append(lambda *a: None)
    lau(1, (x,), {"B": 1}, 4)
    rt.launch_enter_hook = lambda *a: None  # a plain callable (older Triton)
    lau(1, (x,), {"B": 1}, 4)
    assert kinds(fn.log) == ["jit", "direct", "jit", "jit"]


def test_constexprs_not_closing_the_signature_always_jit(fast):
    make, _ = fast
    fn, lau = make(["X", "B", "n"])  # a constexpr between runtime arguments
    x = torch.zeros(16)
    for _ in range(3):
        lau(1, (x, 16), {"B": 1}, 4)
    assert kinds(fn.log) == ["jit", "jit", "jit"]


def test_interpreter_or_switch_off_means_no_direct_path(monkeypatch):
    if _launch.INTERPRET:  # the CI session runs the interpreter: no compiled kernels to call
        assert _launch._triton_runtime_knobs() is None
    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "FAST_LAUNCH", False)
    assert _launch._triton_runtime_knobs() is None


def test_this_tritons_default_hooks_count_as_unset():
    triton = pytest.importorskip("triton")
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:
        pytest.skip("this Triton has no knobs")
    assert not _launch._hook_set(rt.launch_enter_hook) and not _launch._hook_set(rt.launch_exit_hook)
