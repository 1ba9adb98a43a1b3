"""The custom-op path (``torch.compile``, ``FlopCounterMode``) and the PyTorch fallback, where they differ from
the eager ``autograd.Function`` path: gradient storage, activation backward, forward-mode AD."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils.flop_counter import FlopCounterMode

import mfuwatch.kernels as mk
from mfuwatch.kernels import _dispatch, _launch
from tests.helpers.kernel_checks import DEVICE, assert_close


def _ref_glu(g, u, act):
    g, u = g.double(), u.double()
    if act == "swiglu":
        return g * torch.sigmoid(g) * u
    return 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)) * u  # exact GELU (Hendrycks & Gimpel 2016)


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "pytorch_fallback"])
@pytest.mark.parametrize("mode", ["flop_counter", "compiled"])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_glu_backward_on_the_custom_op_path(monkeypatch, gen, triton_path, mode, act):
    # the fallback's backward used torch.autograd.grad, which fails inside a custom op (autograd is off there)
    monkeypatch.setattr(_launch, "INTERPRET", triton_path)
    monkeypatch.setattr(_dispatch, "COMPILE_DECOMPOSE", False)  # the custom op inside torch.compile too
    g = torch.randn(5, 24, generator=gen).to(DEVICE).requires_grad_()
    u = torch.randn(5, 24, generator=gen).to(DEVICE).requires_grad_()
    dy = torch.randn(5, 24, generator=gen).to(DEVICE)
    fn = getattr(mk, act)
    if mode == "compiled":
        y = torch.compile(fn, backend="aot_eager", fullgraph=True)(g, u)
        (y * dy).sum().backward()
    else:
        with FlopCounterMode(display=False) as counter:
            y = fn(g, u)
            (y * dy).sum().backward()
        per = 5 + 11 if act == "swiglu" else 6 + 14
        assert counter.get_total_flops() == g.numel() * per
    gd, ud = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    (_ref_glu(gd, ud, act) * dy.double()).sum().backward()
    assert_close(y, _ref_glu(g, u, act), torch.float32, "y")
    assert_close(g.grad, gd.grad, torch.float32, "d gate")
    assert_close(u.grad, ud.grad, torch.float32, "d up")


def _shares_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", ["flop_counter", "compiled"])
def test_views_of_leaves_get_their_own_gradients_on_the_custom_op_path(gen, mode, monkeypatch):
    # there leafness cannot be told, so both inputs that need a gradient get their own tensor
    monkeypatch.setattr(_dispatch, "COMPILE_DECOMPOSE", False)  # the custom op inside torch.compile too
    m = mk.RMSNorm((4, 8), eps=1e-6).to(DEVICE)
    a = torch.randn(96, generator=gen).to(DEVICE).requires_grad_()
    b = torch.randn(96, generator=gen).to(DEVICE).requires_grad_()

    def step():
        y, s = m(a.view(3, 4, 8), b.view(3, 4, 8))
        (y.sum() + 2 * s.sum()).backward()

    if mode == "compiled":
        f = torch.compile(lambda: m(a.view(3, 4, 8), b.view(3, 4, 8)), backend="aot_eager", fullgraph=True)
        y, s = f()
        (y.sum() + 2 * s.sum()).backward()
    else:
        with FlopCounterMode(display=False):
            step()
    assert not _shares_storage(a.grad, b.grad)
    b_grad = b.grad.clone()
    a.grad.zero_()
    assert torch.equal(b.grad, b_grad)
    ad, bd = a.detach().double().view(3, 4, 8), b.detach().double().view(3, 4, 8)
    ad.requires_grad_()
    bd.requires_grad_()
    h = ad + bd
    y = h * torch.rsqrt(h.pow(2).mean((-2, -1), keepdim=True) + 1e-6)
    (y.sum() + 2 * h.sum()).backward()
    assert_close(b.grad.view(3, 4, 8), bd.grad, torch.float32, "d residual")


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm", "swiglu"])
def test_forward_mode_ad_is_refused_not_dropped(gen, op):
    # without autograd history the ops launch directly; a dual input must not lose its tangent silently
    x = torch.randn(4, 16, generator=gen).to(DEVICE)
    w = torch.randn(16, generator=gen).to(DEVICE)
    call = {"rms_norm": lambda d: mk.rms_norm(d, w), "layer_norm": lambda d: mk.layer_norm(d, (16,), w),
            "add_rms_norm": lambda d: mk.add_rms_norm(d, x, w)[0], "swiglu": lambda d: mk.swiglu(d, x)}[op]
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.randn_like(x))
        try:
            y = call(dual)
        except (RuntimeError, NotImplementedError) as exc:  # PyTorch's "implement the jvp" error
            assert "jvp" in str(exc)
        else:
            assert fwAD.unpack_dual(y).tangent is not None, "the tangent was dropped"
        y = call(x)  # a plain input inside a dual level: an ordinary result
        assert fwAD.unpack_dual(y).tangent is None
