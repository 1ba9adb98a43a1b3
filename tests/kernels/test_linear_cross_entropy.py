"""Chunked linear + cross-entropy against a float64 reference (logits formed in float64 here)."""

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mfuwatch.kernels.linear_cross_entropy import LinearCrossEntropyLoss, chunk_rows, linear_cross_entropy
from tests.helpers.kernel_checks import DEVICE, assert_close
from tests.kernels.test_cross_entropy import ref_loss

#: the module (``mfuwatch.kernels.linear_cross_entropy`` as a package attribute may be the function of that name)
lce_mod = importlib.import_module("mfuwatch.kernels.linear_cross_entropy")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 rows and dW slabs of 8 rows, so that every loop runs several times at test sizes."""
    monkeypatch.setattr(lce_mod, "CHUNK_ELEMENTS", 4 * 41)
    monkeypatch.setattr(lce_mod, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(lce_mod, "SLAB_ELEMENTS", 8 * 24)


def make(gen, dtype, n=11, h=24, v=41, bias=False):
    x = torch.randn(n, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) / 3).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=gen)
    t[1] = -100
    return x, w, b, t


def run(x, w, b, t, reduction, gen, mode="chunked", **kw):
    """The fused op's loss and gradients (in ``mode``) for a random upstream gradient, and the float64 reference's."""
    leaves = [a.to(DEVICE).detach().requires_grad_() for a in (x, w)] + (
        [b.to(DEVICE).detach().requires_grad_()] if b is not None else [])
    loss = linear_cross_entropy(leaves[0], leaves[1], t.to(DEVICE), leaves[2] if b is not None else None,
                                reduction=reduction, label_smoothing=kw.get("smoothing", 0.0),
                                z_loss=kw.get("z_loss", 0.0), softcap=kw.get("softcap"), mode=mode)
    up = torch.randn(loss.shape, generator=gen) if reduction == "none" else torch.tensor(0.6)
    loss.backward(up.to(DEVICE))
    ref = [a.detach().cpu().double().requires_grad_() for a in leaves]
    logits = ref[0] @ ref[1].T + (ref[2] if b is not None else 0)
    r = ref_loss(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction, **kw)
    r = r.reshape(t.shape) if reduction == "none" else r
    r.backward(up.double())
    return loss, r, [(a.grad, c.grad) for a, c in zip(leaves, ref)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_float64_over_several_chunks(dtype, reduction, bias, gen, small_chunks):
    check_float64(make(gen, dtype, bias=bias), dtype, reduction, gen)


def check_float64(inputs, dtype, reduction, gen, mode="chunked"):
    """Loss and every gradient against float64; with a bias also softcap, smoothing and z-loss."""
    x, w, b, t = inputs
    kw = dict(softcap=3.0, smoothing=0.1, z_loss=1e-3) if b is not None else {}
    loss, r, grads = run(x, w, b, t, reduction, gen, mode=mode, **kw)
    assert loss.dtype == torch.float32 and loss.shape == r.shape
    assert_close(loss, r, dtype, "loss", scale=2.0)
    for (g, gr), name in zip(grads, ("dhidden", "dweight", "dbias")):
        assert g.dtype == dtype
        assert_close(g, gr, dtype, name, scale=2.0)  # the logits are rounded to dtype once, as in the GEMM


@pytest.mark.parametrize("mode", [None, True, False], ids=["auto", "fp32", "weight-dtype"])
def test_dw_accumulation_modes_for_a_bf16_weight(mode, gen, small_chunks, monkeypatch):
    monkeypatch.setattr(lce_mod, "ACCUMULATE_FP32", mode)
    assert lce_mod.accumulate_fp32(torch.bfloat16, torch.bfloat16) is bool(mode)
    x, w, b, t = make(gen, torch.bfloat16)
    loss, r, grads = run(x, w, None, t, "mean", gen)
    assert_close(loss, r, torch.bfloat16, "loss", scale=2.0)
    assert grads[1][0].dtype == torch.bfloat16
    # three chunks, each rounded to bf16 on the way without the fp32 accumulator: a few roundings more
    assert_close(grads[1][0], grads[1][1], torch.bfloat16, "dweight", scale=2.0 if mode else 4.0)


def test_accumulation_policy():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert lce_mod.accumulate_fp32(bf16, f32)  # autocast with fp32 master weights: into the fp32 gradient
    assert lce_mod.accumulate_fp32(f32, f32) and lce_mod.accumulate_fp32(f32, bf16)
    assert not lce_mod.accumulate_fp32(bf16, bf16) and not lce_mod.accumulate_fp32(f16, f16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_weight_gradient_accumulated_over_two_backward_calls(reduction, gen, small_chunks):
    """Default (weight-dtype) dW accumulation: two micro-batches' gradients add up in w.grad."""
    x1, w, _, t1 = make(gen, torch.bfloat16)
    x2, _, _, t2 = make(gen, torch.bfloat16)
    wd = w.clone().to(DEVICE).requires_grad_()
    for x, t in ((x1, t1), (x2, t2)):
        loss = linear_cross_entropy(x.to(DEVICE), wd, t.to(DEVICE), reduction=reduction)
        (loss if reduction == "mean" else loss.sum()).backward()
    assert wd.grad.dtype == torch.bfloat16
    w64 = w.detach().double().requires_grad_()
    red = "mean" if reduction == "mean" else "sum"
    (ref_loss(x1.double() @ w64.T, t1, red) + ref_loss(x2.double() @ w64.T, t2, red)).backward()
    assert_close(wd.grad, w64.grad, torch.bfloat16, "accumulated dweight", scale=4.0)


def test_fp32_weight_under_autocast_accumulates_into_its_fp32_gradient(gen, small_chunks, monkeypatch):
    """fp32 master weight, bf16 GEMMs: dW is accumulated in fp32 (the buffer handed over as w.grad), over
    several chunks and two backward calls, with no rounding of dW to bf16 anywhere."""
    seen = []
    real = lce_mod._accumulate_dw
    monkeypatch.setattr(lce_mod, "_accumulate_dw", lambda acc, g, h: (seen.append(acc.dtype), real(acc, g, h)))
    x1, w, _, t1 = make(gen, torch.float32)
    x2, _, _, t2 = make(gen, torch.float32)
    wd = w.clone().to(DEVICE).requires_grad_()
    for x, t in ((x1, t1), (x2, t2)):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            linear_cross_entropy(x.to(DEVICE), wd, t.to(DEVICE), reduction="sum").backward()
    assert wd.grad.dtype == torch.float32 and seen and set(seen) == {torch.float32}
    # reference from the bf16-rounded operands the GEMMs saw, in float64
    xb = [a.to(torch.bfloat16).double() for a in (x1, x2)]
    w64 = w.to(torch.bfloat16).double().requires_grad_()
    (ref_loss(xb[0] @ w64.T, t1, "sum") + ref_loss(xb[1] @ w64.T, t2, "sum")).backward()
    assert_close(wd.grad, w64.grad, torch.bfloat16, "accumulated fp32 dweight", scale=2.0)


def test_three_dim_non_contiguous_hidden(gen, small_chunks):
    x = torch.randn(3, 24, 4, generator=gen).transpose(1, 2)  # (B, T, H) with a non-unit last stride
    _, w, _, _ = make(gen, torch.float32)
    t = torch.randint(0, 41, (3, 4), generator=gen)
    loss, r, grads = run(x, w, None, t, "none", gen)
    assert loss.shape == (3, 4)
    assert_close(loss, r, torch.float32, "loss")
    for g, gr in grads:
        assert_close(g, gr, torch.float32, "grad")


def test_autocast_runs_the_gemms_in_bf16_and_keeps_fp32_gradients(gen, small_chunks):
    x, w, _, t = make(gen, torch.float32)
    w = w.to(DEVICE).requires_grad_()
    x = x.to(DEVICE).requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, t.to(DEVICE))
        ref_logits = torch.nn.functional.linear(x, w)  # what nn.Linear gives under autocast
    assert ref_logits.dtype == torch.bfloat16
    loss.backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    ref_loss(x64 @ w64.T, t, "mean").backward()
    assert_close(loss, ref_loss(ref_logits.detach().cpu(), t, "mean"), torch.float32, "loss vs bf16 logits")
    assert_close(w.grad, w64.grad, torch.bfloat16, "dweight")
    assert_close(x.grad, x64.grad, torch.bfloat16, "dhidden")


def test_gradient_accumulation_over_micro_batches(gen, small_chunks):
    x1, w, _, t1 = make(gen, torch.float32)
    x2, _, _, t2 = make(gen, torch.float32)
    wd = w.clone().to(DEVICE).requires_grad_()
    for x, t in ((x1, t1), (x2, t2)):
        linear_cross_entropy(x.to(DEVICE), wd, t.to(DEVICE), reduction="sum").backward()
    w64 = w.detach().double().requires_grad_()
    (ref_loss(x1.double() @ w64.T, t1, "sum") + ref_loss(x2.double() @ w64.T, t2, "sum")).backward()
    assert_close(wd.grad, w64.grad, torch.float32, "accumulated dweight")


def test_all_ignored_mean_is_nan_with_zero_gradients(gen):
    x, w, _, _ = make(gen, torch.float32)
    x, w = x.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
    loss = linear_cross_entropy(x, w, torch.full((11,), -100, device=DEVICE))
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


def test_second_backward_of_a_reduced_loss_is_refused_clearly(gen):
    x, w, _, t = make(gen, torch.float32)
    loss = linear_cross_entropy(x.to(DEVICE).requires_grad_(), w.to(DEVICE), t.to(DEVICE))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_custom_op_path_under_compile_and_flop_counter(gen, small_chunks):
    x, w, b, t = make(gen, torch.float32, bias=True)
    leaves = [a.to(DEVICE).requires_grad_() for a in (x, w, b)]
    td = t.to(DEVICE)
    for reduction in ("mean", "none"):
        eager = linear_cross_entropy(*leaves[:2], td, leaves[2], reduction=reduction, z_loss=1e-3)
        eg = torch.autograd.grad(eager.sum(), leaves)
        seen = []

        def backend(gm, example_inputs):
            seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            boxed = lambda g, _: make_boxed_func(g)  # noqa: E731 - run the traced graphs as they are
            return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

        f = torch.compile(lambda a, c, d: linear_cross_entropy(a, c, td, d, reduction=reduction, z_loss=1e-3),
                          backend=backend, fullgraph=True)
        comp = f(*leaves)
        cg = torch.autograd.grad(comp.sum(), leaves)
        assert any("linear_cross_entropy" in s for s in seen), seen  # the chunked op stays in the graph
        assert_close(comp, eager, torch.float32, "compiled loss")
        for a, c in zip(cg, eg):
            assert_close(a, c, torch.float32, "compiled grad")
    n, h, v = 11, 24, 41
    with FlopCounterMode(display=False) as fc:
        linear_cross_entropy(*leaves[:2], td, leaves[2]).backward()
    # three GEMMs 2nhv each, cross-entropy 4 + 5 per logit, bias gradient 1 per logit (kernels/_flops.py)
    assert fc.get_total_flops() == 3 * 2 * n * h * v + n * v * (4 + 5) + n * v


def test_chunk_rows_keep_the_dw_gemm_compute_bound():
    assert chunk_rows(8192, 128256) == 2048  # 2^27 / 128256 = 1046 rows, raised to the 2048-row floor
    assert chunk_rows(8192, 32000) == 4096  # 2^27 / 32000 = 4194 -> the power of two below
    assert chunk_rows(100, 262144) == 100
    assert chunk_rows(8192, 262144) == 2048
    assert chunk_rows(1 << 20, 1000) == 1 << 17  # 2^27 / 1000 = 134217 -> 131072


def test_overlap_only_for_chunks_up_to_the_byte_limit(monkeypatch):
    monkeypatch.setattr(lce_mod, "OVERLAP", None)
    assert not lce_mod.overlaps(2048, 128256, 2)  # 513 MB of bf16 logits: one stream
    assert lce_mod.overlaps(2048, 32000, 2)  # 131.1 MB <= 2^27 = 134.2 MB: overlapped
    assert not lce_mod.overlaps(4096, 32000, 2)  # 262 MB
    monkeypatch.setattr(lce_mod, "OVERLAP", True)
    assert lce_mod.overlaps(2048, 128256, 2)
    monkeypatch.setattr(lce_mod, "OVERLAP", False)
    assert not lce_mod.overlaps(8, 8, 2)


def test_module_and_errors(gen):
    x, w, _, t = make(gen, torch.float32)
    m = LinearCrossEntropyLoss(reduction="sum")
    val = m(x.to(DEVICE), w.to(DEVICE), t.to(DEVICE))
    assert abs(float(val) - float(ref_loss(x.double() @ w.double().T, t, "sum"))) < 1e-3
    with pytest.raises(ValueError, match=r"weight shape \(41, 23\)"):
        linear_cross_entropy(x, w[:, :23], t)
    with pytest.raises(ValueError, match=r"target shape \(10,\) != \(11,\)"):
        linear_cross_entropy(x, w, t[:10])
    with pytest.raises(ValueError, match="z_loss=-1"):
        LinearCrossEntropyLoss(z_loss=-1)


@pytest.mark.skipif(DEVICE != "cuda", reason="the side stream exists on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_overlapped_chunks_equal_the_serial_loop(dtype, reduction, gen, small_chunks, monkeypatch):
    """Two streams over two chunk buffers give the serial loop's loss and gradients (the same GEMMs)."""
    x, w, b, t = make(gen, dtype, n=37, bias=True)
    got = []
    for overlap in (True, False):
        monkeypatch.setattr(lce_mod, "OVERLAP", overlap)
        leaves = [a.to(DEVICE).requires_grad_() for a in (x, w, b)]
        loss = linear_cross_entropy(leaves[0], leaves[1], t.to(DEVICE), leaves[2], reduction=reduction)
        loss.sum().backward()
        torch.cuda.synchronize()
        got.append([loss.detach()] + [a.grad for a in leaves])
    for a, c in zip(*got):
        assert_close(a, c, dtype, "overlapped vs serial")
