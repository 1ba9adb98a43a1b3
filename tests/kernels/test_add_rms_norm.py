"""Fused residual add + RMSNorm against a float64 reference, both outputs and every gradient."""

import importlib
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mfuwatch.kernels import _norm_launch
from mfuwatch.kernels.add_rms_norm import add_rms_norm
from mfuwatch.kernels.rms_norm import RMSNorm
from tests.helpers.kernel_checks import DEVICE, assert_close

add_rms_norm_mod = importlib.import_module("mfuwatch.kernels.add_rms_norm")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ref_add_rms_norm(x, r, w, eps, offset=0.0):
    """float64 reference: h = x + r; (h / sqrt(mean(h^2) + eps) * (w + offset), h)."""
    h = x.double() + r.double()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y if w is None else y * (w.double() + offset)), h


def assert_matches_float64(x, r, w, dtype, gen, use_residual_grad=True, offset=0.0):
    x, r = x.to(DEVICE).detach().requires_grad_(), r.to(DEVICE).detach().requires_grad_()
    w = w.to(DEVICE).detach().requires_grad_() if w is not None else None
    y, h = add_rms_norm(x, r, w, 1e-6, offset)
    assert y.shape == h.shape == x.shape
    dy = torch.randn(y.shape, generator=gen).to(y.dtype).to(DEVICE)
    dh = torch.randn(h.shape, generator=gen).to(h.dtype).to(DEVICE)
    (y * dy).sum().add((h * dh).sum() if use_residual_grad else 0).backward()
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, r, w)]
    yr, hr = ref_add_rms_norm(*leaves, 1e-6, offset)
    (yr * dy.double()).sum().add((hr * dh.double()).sum() if use_residual_grad else 0).backward()
    assert_close(y, yr, dtype, "normed")
    assert_close(h, hr, dtype, "new residual")
    for name, t, ref in zip(("dx", "dresidual", "dw"), (x, r, w), leaves):
        if t is not None:
            assert t.grad.dtype == t.dtype
            assert_close(t.grad, ref.grad, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0, 32), (1, 64), (5, 17), (2, 5120), (2, 3, 40), (70, 24)], ids=str)
def test_forward_backward_match_float64(shape, dtype, gen):
    x = torch.randn(*shape, generator=gen).to(dtype)
    r = torch.randn(*shape, generator=gen).to(dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    assert_matches_float64(x, r, w, dtype, gen)


def test_unused_new_residual_and_gemma_offset(gen):
    x = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    r = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    assert_matches_float64(x, r, (0.1 * torch.randn(96, generator=gen)).to(torch.bfloat16), torch.bfloat16, gen,
                  use_residual_grad=False, offset=1.0)


def test_mixed_dtypes_promote_the_sum(gen):
    # a bf16 branch added to an fp32 residual stream (autocast training): the sum is fp32
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(3, 64, generator=gen).to(DEVICE)
    y, h = add_rms_norm(x, r, torch.ones(64, device=DEVICE))
    assert h.dtype == torch.float32 and y.dtype == torch.float32
    assert_close(h, x.double() + r.double(), torch.float32, "sum")


def test_transposed_inputs_and_wide_rows(monkeypatch, gen):
    monkeypatch.setattr(_norm_launch, "FWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "BWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "LOOP_BLOCK", 64)
    x = torch.randn(200, 21, generator=gen).t()
    r = torch.randn(21, 200, generator=gen)
    assert_matches_float64(x, r, 1.0 + 0.1 * torch.randn(200, generator=gen), torch.float32, gen)


def test_custom_op_path_equals_fast_path(monkeypatch, gen):
    ins = [torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE) for _ in range(3)]
    dy, dh = (torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE) for _ in range(2))
    results = []
    for forced in (False, True):
        monkeypatch.setattr(add_rms_norm_mod, "use_custom_op", lambda *t, f=forced: f)
        x, r = ins[0].clone().requires_grad_(), ins[1].clone().requires_grad_()
        w = ins[2][0].clone().requires_grad_()
        y, h = add_rms_norm(x, r, w)
        torch.autograd.backward([y, h], [dy, dh])
        results.append((y, h, x.grad, r.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"residual shape \(2, 7\) != input shape \(2, 8\)"):
        add_rms_norm(torch.randn(2, 8, device=DEVICE), torch.randn(2, 7, device=DEVICE), None)
    with pytest.raises(ValueError, match=r"weight shape \(1, 8\) != \(8,\)"):
        add_rms_norm(torch.randn(2, 8, device=DEVICE), torch.randn(2, 8, device=DEVICE), torch.ones(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="0-d tensor"):
        add_rms_norm(torch.tensor(1.0, device=DEVICE), torch.tensor(2.0, device=DEVICE), None)


class _CopiesOutsideKernels(TorchDispatchMode):
    """Records the copies of whole tensors (``copy_``, ``clone``) outside ``norm_bwd`` (the interpreter copies
    too); dtype casts (``_to_copy``) are not counted."""

    def __init__(self):
        super().__init__()
        self.in_kernel = False
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self.in_kernel and name in ("aten.copy_.default", "aten.clone.default"):
            self.copies.append(name)
        return func(*args, **(kwargs or {}))


def _backward_copies(monkeypatch, fused, leaf_x, leaf_r, dtypes=(torch.bfloat16, torch.bfloat16)):
    """Copies autograd makes in the backward of add + RMSNorm with leaf or non-leaf inputs; and x's, r's grads."""
    mode = _CopiesOutsideKernels()
    real = _norm_launch.norm_bwd

    def traced(*a, **k):
        mode.in_kernel = True
        try:
            return real(*a, **k)
        finally:
            mode.in_kernel = False

    monkeypatch.setattr(add_rms_norm_mod.K, "norm_bwd", traced)
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(6, 40, generator=gen).to(dtypes[0]).to(DEVICE).requires_grad_()
    r0 = torch.randn(6, 40, generator=gen).to(dtypes[1]).to(DEVICE).requires_grad_()
    w = torch.ones(40, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    x = x0 if leaf_x else x0 * 1
    r = r0 if leaf_r else r0 * 1
    seen = {}
    for name, t in (("x", x), ("r", r)):
        if not t.is_leaf:
            t.register_hook(lambda g, name=name: seen.__setitem__(name, g))
    if fused:
        y, h = add_rms_norm(x, r, w)
    else:
        h = x + r
        y = torch.nn.functional.rms_norm(h, (40,), w, 1e-6)
    dy, dh = torch.randn(y.shape, generator=gen).to(y.dtype), torch.randn(h.shape, generator=gen).to(h.dtype)
    with mode:
        torch.autograd.backward([y, h], [dy.to(DEVICE), dh.to(DEVICE)])
    return mode.copies, x0.grad, r0.grad, seen


@pytest.mark.parametrize("leaf_x, leaf_r", [(True, True), (True, False), (False, True)])
def test_leaf_inputs_get_two_written_gradients_not_a_copy(monkeypatch, leaf_x, leaf_r):
    # the method sees the copy autograd makes when one gradient tensor reaches a leaf and another input
    copies, *_ = _backward_copies(monkeypatch, False, leaf_x, leaf_r)
    assert len(copies) == 1, copies
    copies, gx, gr, _ = _backward_copies(monkeypatch, True, leaf_x, leaf_r)
    assert copies == [], copies
    assert gx.data_ptr() != gr.data_ptr()
    copies_ref, gx_ref, gr_ref, _ = _backward_copies(monkeypatch, False, leaf_x, leaf_r)
    assert_close(gx, gx_ref.double(), torch.bfloat16, "dx")
    assert torch.equal(gx, gr)  # the same values, written twice


def test_non_leaf_inputs_share_one_gradient(monkeypatch):
    # nothing copies a gradient that only flows on to other ops: one tensor, written once, goes to both
    copies, gx, gr, seen = _backward_copies(monkeypatch, True, False, False)
    assert copies == []
    assert seen["x"] is seen["r"]
    assert torch.equal(gx, gr)


def test_mixed_dtype_leaves_take_the_cast(monkeypatch):
    # fp32 residual, bf16 branch: the sum is fp32 and x's gradient a cast, so no second store is needed
    copies, gx, gr, _ = _backward_copies(monkeypatch, True, True, True, (torch.bfloat16, torch.float32))
    assert gx.dtype == torch.bfloat16 and gr.dtype == torch.float32
    assert copies == []
    assert_close(gx, gr.double(), torch.bfloat16, "dx against the fp32 gradient")


def _shares_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_module_over_several_dims_gives_leaves_their_own_gradients(compiled, gen):
    # RMSNorm((4, 10))(x, residual): normalised over the last two dims, inputs passed as they are (a reshape
    # made them non-leaves, one gradient tensor went to both, and each leaf kept a view of it as .grad)
    m = RMSNorm((4, 10), eps=1e-6).to(DEVICE)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.1 * torch.randn(4, 10, generator=gen))
    x = torch.randn(2, 3, 4, 10, generator=gen).to(DEVICE).requires_grad_()
    r = torch.randn(2, 3, 4, 10, generator=gen).to(DEVICE).requires_grad_()
    dy, dh = torch.randn(2, 3, 4, 10, generator=gen).to(DEVICE), torch.randn(2, 3, 4, 10, generator=gen).to(DEVICE)
    fn = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
    y, h = fn(x, r)
    torch.autograd.backward([y, h], [dy, dh])
    assert not _shares_storage(x.grad, r.grad)
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, m.weight))
    hd = xd + rd
    yd = hd * torch.rsqrt(hd.pow(2).mean((-2, -1), keepdim=True) + 1e-6) * wd
    torch.autograd.backward([yd, hd], [dy.double(), dh.double()])
    assert_close(y, yd, torch.float32, "normed")
    for name, t, ref in (("dx", x, xd), ("dresidual", r, rd), ("dw", m.weight, wd)):
        assert t.grad.shape == t.shape
        assert_close(t.grad, ref.grad, torch.float32, name)
    r_grad = r.grad.clone()
    x.grad.zero_()
    assert torch.equal(r.grad, r_grad)


def test_views_of_leaves_get_their_own_gradients(gen):
    # plain PyTorch's a.view(...) + b.view(...) hands both leaves views of one gradient; the fused op does not
    a = torch.randn(240, generator=gen).to(DEVICE).requires_grad_()
    b = torch.randn(2, 120, generator=gen).to(DEVICE).requires_grad_()
    y, h = add_rms_norm(a.view(6, 40), b.view(6, 40), torch.ones(40, device=DEVICE))
    (y.sum() + h.sum()).backward()
    assert not _shares_storage(a.grad, b.grad)
    assert torch.equal(a.grad.view(6, 40), b.grad.view(6, 40))


@pytest.mark.parametrize("custom_op", [False, True], ids=["function", "custom_op"])
def test_only_the_weight_trains(monkeypatch, custom_op, gen):
    # x + residual depends on no trainable tensor: like plain PyTorch, it carries no autograd history
    monkeypatch.setattr(add_rms_norm_mod, "use_custom_op", lambda *t: custom_op)
    x, r = (torch.randn(5, 24, generator=gen).to(DEVICE) for _ in range(2))
    w = (1.0 + 0.1 * torch.randn(24, generator=gen)).to(DEVICE).requires_grad_()
    y, h = add_rms_norm(x, r, w)
    assert y.requires_grad and not h.requires_grad and h.grad_fn is None
    dy = torch.randn(5, 24, generator=gen).to(DEVICE)
    (y * dy).sum().backward()
    wd = w.detach().double().requires_grad_()
    (ref_add_rms_norm(x, r, wd, 1e-6)[0] * dy.double()).sum().backward()
    assert_close(w.grad, wd.grad, torch.float32, "dw")
