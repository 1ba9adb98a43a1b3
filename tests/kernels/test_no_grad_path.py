"""Calls that record no autograd history skip the ``autograd.Function`` and give the same outputs."""

import importlib
import pytest
import torch

import mfuwatch.kernels as mk
from mfuwatch.kernels import glu
from tests.helpers.kernel_checks import DEVICE

add_rmsnorm, layernorm, rmsnorm = (importlib.import_module(f"mfuwatch.kernels.{m}")
                                   for m in ("add_rms_norm", "layer_norm", "rms_norm"))

FUNCTIONS = [(rmsnorm, "RMSNormFunction"), (layernorm, "LayerNormFunction"), (add_rmsnorm, "AddRMSNormFunction"),
             (glu, "GLUFunction"), (glu, "GLUFunction")]


def calls(x, r, w, b):
    return [lambda: mk.rms_norm(x, w), lambda: mk.layer_norm(x, (x.shape[-1],), w, b),
            lambda: mk.add_rms_norm(x, r, w), lambda: mk.swiglu(x, r), lambda: mk.geglu(x, r, "tanh")]


def as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("i", range(5))
@pytest.mark.parametrize("how", ["no_grad", "frozen_inputs", "inference_mode"])
def test_no_history_skips_the_function_and_matches_the_recorded_path(i, how, monkeypatch, gen):
    x, r = (torch.randn(5, 24, generator=gen).to(DEVICE) for _ in range(2))
    w, b = (torch.randn(24, generator=gen).to(DEVICE) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    recorded = [t.detach() for t in as_list(calls(*leaves)[i]())]
    assert all(t is not None for t in recorded)

    module, cls = FUNCTIONS[i]

    def refuse(*a, **k):
        raise AssertionError("the autograd.Function ran for a call that records no history")
    monkeypatch.setattr(getattr(module, cls), "apply", refuse)
    if how == "no_grad":
        with torch.no_grad():
            out = as_list(calls(*leaves)[i]())
    elif how == "inference_mode":
        with torch.inference_mode():
            out = as_list(calls(x, r, w, b)[i]())
    else:
        out = as_list(calls(x, r, w, b)[i]())
    assert len(out) == len(recorded)
    for got, want in zip(out, recorded):
        assert got.grad_fn is None and not got.requires_grad
        assert torch.equal(got, want)


def test_a_call_that_records_history_still_uses_the_function(gen):
    x = torch.randn(4, 8, generator=gen).to(DEVICE).requires_grad_()
    y = mk.rms_norm(x, None)
    assert type(y.grad_fn).__name__ == "RMSNormFunctionBackward"


@pytest.mark.parametrize("shape", [(3, 0), (2, 4, 0)])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_rows_of_zero_elements_give_empty_results_and_gradients_like_torch(shape, wdt):
    """A hidden size of 0: empty outputs shaped like the input (torch's norms return the same), in the op's dtype,
    and a backward that gives empty gradients instead of an error."""
    x = torch.randn(shape, dtype=torch.bfloat16).to(DEVICE).requires_grad_()
    r = torch.randn(shape, dtype=torch.bfloat16).to(DEVICE).requires_grad_()
    w = torch.randn(0, dtype=wdt).to(DEVICE).requires_grad_()
    b = torch.randn(0, dtype=wdt).to(DEVICE).requires_grad_()
    y_rms = mk.rms_norm(x, w)
    y_gemma = mk.rms_norm(x, w, offset=1.0)
    y_add, h = mk.add_rms_norm(x, r, w)
    y_ln = mk.layer_norm(x, (0,), w.to(x.dtype), b.to(x.dtype))
    llama_dt = torch.promote_types(x.dtype, wdt)
    assert y_rms.shape == y_gemma.shape == y_add.shape == h.shape == y_ln.shape == x.shape
    assert (y_rms.dtype, y_gemma.dtype, y_add.dtype, h.dtype) == (llama_dt, x.dtype, llama_dt, x.dtype)
    assert y_ln.shape == torch.nn.functional.layer_norm(x, (0,)).shape
    (y_rms.sum() + y_gemma.sum() + y_add.sum() + h.sum() + y_ln.sum()).backward()
    assert x.grad.shape == x.shape and r.grad.shape == r.shape and w.grad.shape == (0,) and b.grad.shape == (0,)
    m = mk.RMSNorm(0, eps=1e-6).to(DEVICE)
    assert m(x).shape == x.shape


def test_multi_dim_rmsnorm_module_on_zero_rows_and_layer_norm_width_zero_with_mixed_dtypes():
    """RMSNorm((2, 3)) on 0 rows returns (0, 2, 3) as torch.nn.RMSNorm does (the flatten needs an explicit
    width); layer_norm at width 0 accepts the dtype mixes it accepts at any other width."""
    for m in (mk.RMSNorm((2, 3)), mk.RMSNorm((2, 3), elementwise_affine=False), mk.RMSNorm((2, 3), offset=1.0)):
        x = torch.randn(0, 2, 3).to(DEVICE)
        assert m.to(DEVICE)(x).shape == (0, 2, 3)
        y, s = m(x, torch.randn(0, 2, 3).to(DEVICE))
        assert y.shape == s.shape == (0, 2, 3)
    x = torch.randn(3, 0).to(DEVICE)
    y = mk.layer_norm(x, 0, torch.randn(0, dtype=torch.bfloat16).to(DEVICE))
    assert y.shape == (3, 0) and y.dtype == torch.float32
    xb = torch.randn(2, 4, 0, dtype=torch.bfloat16).to(DEVICE).requires_grad_()
    b = torch.randn(0).to(DEVICE).requires_grad_()
    out = mk.layer_norm(xb, 0, None, b)
    assert out.dtype == torch.bfloat16
    out.sum().backward()
    assert xb.grad.shape == xb.shape and b.grad.dtype == torch.float32 and b.grad.shape == (0,)
