"""RMSNorm kernels against a float64 reference (forward and every gradient), on fresh random inputs."""

import importlib
import pytest
import torch
from torch import nn

from tests.helpers.kernel_checks import DEVICE, assert_close
from mfuwatch.kernels import _launch, _norm_launch
from mfuwatch.kernels.rms_norm import RMSNorm, rms_norm

rms_norm_mod = importlib.import_module("mfuwatch.kernels.rms_norm")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ref_rms_norm(x, w, eps, offset=0.0):
    """float64 reference: x / sqrt(mean(x^2) + eps) * (w + offset), no intermediate rounding."""
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * (w.double() + offset)


def make_input(kind, dtype, gen):
    """Inputs of the shapes the issue lists, as (tensor, description)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    if kind == "transposed":  # (6, 64) view of a (64, 6) tensor: last-dim stride 6
        return rnd(64, 6).t()
    if kind == "sliced":  # rows of 64 taken from rows of 100: row stride 100, no copy needed
        return rnd(4, 100)[:, 10:74]
    return rnd(*kind)


SHAPES = [(0, 64), (1, 64), (5, 17), (3, 1536), (2, 5120), (2, 3, 40), (70, 24), "transposed", "sliced"]


def assert_matches_float64(x, w, dtype, eps=1e-6, offset=0.0, casting="auto", gen=None, scale=1.0):
    x = x.to(DEVICE).detach().requires_grad_()
    w = w.to(DEVICE).detach().requires_grad_() if w is not None else None
    y = rms_norm(x, w, eps, offset, casting=casting)
    assert y.shape == x.shape
    dy = torch.randn(y.shape, generator=gen).to(y.dtype).to(DEVICE)
    y.backward(dy)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_() if w is not None else None
    yr = ref_rms_norm(xr, wr, eps, offset)
    yr.backward(dy.double())
    assert_close(y, yr, dtype, "y", scale)
    assert_close(x.grad, xr.grad, dtype, "dx", scale)
    assert x.grad.dtype == x.dtype
    if w is not None:
        assert_close(w.grad, wr.grad, dtype, "dw", scale)
        assert w.grad.dtype == w.dtype
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", SHAPES, ids=str)
def test_forward_backward_match_float64(kind, dtype, gen):
    x = make_input(kind, dtype, gen)
    w = (1.0 + 0.1 * torch.randn(x.shape[-1], generator=gen)).to(dtype)
    y = assert_matches_float64(x, w, dtype, gen=gen)
    assert y.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_weight(dtype, gen):
    assert_matches_float64(torch.randn(4, 48, generator=gen).to(dtype), None, dtype, eps=1e-5, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma_offset(dtype, gen):
    # Gemma stores w around 0 and scales by (1 + w) formed in fp32; the result keeps x's dtype.
    x = torch.randn(3, 96, generator=gen).to(dtype)
    w = (0.1 * torch.randn(96, generator=gen)).to(dtype)
    y = assert_matches_float64(x, w, dtype, offset=1.0, gen=gen)
    assert y.dtype == dtype
    # with w = 0 the output is xhat, not 0: the offset is really applied
    z = rms_norm(x.to(DEVICE), torch.zeros(96, dtype=dtype, device=DEVICE), 1e-6, offset=1.0)
    assert_close(z, ref_rms_norm(x, None, 1e-6), dtype, "offset with zero weight")


def test_llama_casting_rounds_xhat_then_promotes(gen):
    # Hugging Face LlamaRMSNorm: weight * (x.float() * rstd).to(x.dtype): bf16 x, fp32 weight -> fp32 out.
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    w = 1.0 + 0.1 * torch.randn(64, generator=gen)
    y = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, casting="llama")
    assert y.dtype == torch.float32
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert_close(y, hf, torch.bfloat16, "llama casting")
    y32 = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, casting="fp32")
    assert y32.dtype == torch.bfloat16


def test_bf16_rows_with_large_outliers(gen):
    # Massive activations (a few features 1e3-1e4 times the rest) must not overflow or lose the
    # small entries: statistics accumulate in fp32.
    x = torch.randn(4, 1536, generator=gen)
    x[:, 7] = 3.0e4
    x[1, 100] = -6.0e4
    x[2] *= 1e-3
    x = x.to(torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(1536, generator=gen)).to(torch.bfloat16)
    assert_matches_float64(x, w, torch.bfloat16, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [200, 520])
def test_looped_path_for_wide_rows(monkeypatch, n, dtype, gen):
    # Rows wider than the register budget walk the row in chunks; shrink the budget to reach
    # that code at test sizes (a chunk of 64 leaves a partial last chunk for both widths).
    monkeypatch.setattr(_norm_launch, "FWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "BWD_MAX_FUSED", 128)
    monkeypatch.setattr(_norm_launch, "LOOP_BLOCK", 64)
    x = torch.randn(21, n, generator=gen).to(dtype)  # more rows than programs: rows share a dw partial
    w = (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    assert_matches_float64(x, w, dtype, gen=gen)


def test_more_than_65536_rows_forward(gen):
    # Rows go on grid axis 0 (up to 2**31 - 1 programs), not the 65,535-limited axes 1 and 2.
    # (The backward's many-rows-per-program loop is covered by the (70, 24) case above; at this
    # size it would take minutes in the interpreter.)
    x = torch.randn(65_600, 8, generator=gen)
    w = 1.0 + 0.1 * torch.randn(8, generator=gen)
    y = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6)
    assert_close(y, ref_rms_norm(x, w, 1e-6), torch.float32, "y")


def test_custom_op_path_equals_fast_path(monkeypatch, gen):
    x = torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    w = torch.randn(40, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    dy = torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    results = []
    for forced in (False, True):
        monkeypatch.setattr(rms_norm_mod, "use_custom_op", lambda *t, f=forced: f)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(xg, wg)
        y.backward(dy)
        results.append((y, xg.grad, wg.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cpu_fallback_without_triton(monkeypatch, gen):
    monkeypatch.setattr(_launch, "INTERPRET", False)
    x = torch.randn(3, 33, generator=gen)
    assert not _launch.use_triton(x)
    assert_matches_float64(x, 1.0 + 0.1 * torch.randn(33, generator=gen), torch.float32, gen=gen)


def test_module_matches_torch_rmsnorm(gen):
    ours, ref = RMSNorm((4, 8), eps=1e-5), nn.RMSNorm((4, 8), eps=1e-5)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight"]
    assert ours.weight.shape == ref.weight.shape == (4, 8)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(4, 8, generator=gen))
    ours.load_state_dict(ref.state_dict())
    ours, ref = ours.to(DEVICE), ref.to(DEVICE)
    x = torch.randn(2, 3, 4, 8, generator=gen).to(DEVICE)
    assert_close(ours(x), ref(x).double(), torch.float32, "module vs nn.RMSNorm")
    bare = RMSNorm(8, elementwise_affine=False)
    assert bare.weight is None and list(bare.state_dict()) == []
    # eps=None means finfo(dtype).eps, as torch
    xe = torch.randn(2, 8, generator=gen).to(DEVICE)
    assert_close(bare(xe), ref_rms_norm(xe, None, torch.finfo(torch.float32).eps), torch.float32, "eps None")


def test_module_gemma_init_and_residual_form(gen):
    m = RMSNorm(16, eps=1e-6, offset=1.0, casting="fp32")
    assert torch.equal(m.weight, torch.zeros(16))
    x = torch.randn(2, 16, generator=gen)
    r = torch.randn(2, 16, generator=gen)
    y, s = m.to(DEVICE)(x.to(DEVICE), r.to(DEVICE))
    assert_close(s, (x + r).double(), torch.float32, "new residual")
    assert_close(y, ref_rms_norm(x + r, None, 1e-6), torch.float32, "normed")


def test_errors_name_both_sizes():
    with pytest.raises(ValueError, match=r"weight shape \(7,\) != \(8,\)"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight shape \(1, 8\) != \(8,\)"):  # as F.rms_norm: no broadcasting
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="casting"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(8, device=DEVICE), casting="gemma")
    with pytest.raises(ValueError, match="input dtype torch.float64 is not supported"):
        rms_norm(torch.randn(2, 8, device=DEVICE, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="weight is on meta but the input is on"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(8, device="meta"))


def test_module_default_casting_follows_the_offset(gen):
    """RMSNorm() computes as Hugging Face Llama (offset 0) and as Gemma (offset 1), like rms_norm's "auto"."""
    from mfuwatch.kernels.rms_norm import RMSNorm as FusedRMSNorm

    x = (torch.randn(4, 24, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    for offset, mode in ((0.0, "llama"), (1.0, "fp32")):
        m = FusedRMSNorm(24, eps=1e-6, offset=offset, dtype=torch.float32).to(DEVICE)
        with torch.no_grad():
            m.weight.copy_(0.1 * torch.randn(24, generator=gen))
        ref = rms_norm(x, m.weight, 1e-6, offset, casting=mode)
        other = rms_norm(x, m.weight, 1e-6, offset, casting="fp32" if mode == "llama" else "llama")
        out = m(x)
        assert out.dtype == ref.dtype and torch.equal(out, ref)
        assert out.dtype != other.dtype or not torch.equal(out, other)  # the two modes do differ here


def test_zero_dim_input_and_eps_none():
    with pytest.raises(ValueError, match="0-d tensor"):
        rms_norm(torch.tensor(1.0, device=DEVICE), torch.ones(1, device=DEVICE))
    x = torch.randn(3, 16, device=DEVICE)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
    assert_close(rms_norm(x, None, None), ref, torch.float32, "eps=None is the dtype's epsilon")
