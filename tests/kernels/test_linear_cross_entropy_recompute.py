"""linear_cross_entropy(..., mode="recompute") (no logits tile in memory; kernels/_lce_recompute_triton.py)
against a float64 reference, over several row and vocabulary chunks, with every option of the API."""

import copy
import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mfuwatch.kernels as mk
from mfuwatch.kernels.linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy
from tests.helpers.kernel_checks import DEVICE, assert_close, assert_compiles_in_subprocess
from tests.kernels import test_linear_cross_entropy as lce_tests
from tests.kernels.test_cross_entropy import ref_loss

R = importlib.import_module("mfuwatch.kernels._lce_recompute_triton")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture
def small_chunks(monkeypatch):
    """Vocabulary chunks of 32 rows of dW and row chunks of 16 rows of dh (the interpreter's tiles are 16)."""
    monkeypatch.setattr(R, "VOCAB_CHUNK", 32)
    monkeypatch.setattr(R, "ROW_CHUNK_BYTES", 16 * 4 * 32)


def make(gen, dtype, n=37, h=24, v=41, bias=False):
    """Inputs as the chunked mode's tests draw them, with more rows (several row tiles) and two ignored targets."""
    x, w, b, t = lce_tests.make(gen, dtype, n=n, h=h, v=v, bias=bias)
    t[n // 2 + 1] = -100
    return x, w, b, t


def run(*args, **kw):
    return lce_tests.run(*args, mode="recompute", **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", ["plain", "bias+softcap+smoothing+z"])
def test_matches_float64_over_several_chunks(dtype, reduction, opts, gen, small_chunks):
    bias = opts != "plain"  # H = 24 (not a multiple of the 16-wide tile) without a bias, 32 (EVEN_K) with one
    lce_tests.check_float64(make(gen, dtype, h=32 if bias else 24, bias=bias), dtype, reduction, gen, "recompute")


def test_3d_non_contiguous_hidden_and_int32_targets(gen, small_chunks):
    x, w, _, t = make(gen, torch.float32, n=2 * 13)
    x3 = x.reshape(13, 2, 24).transpose(0, 1)  # (2, 13, 24), not contiguous
    t3 = t.reshape(13, 2).t().to(torch.int32)
    h = x3.to(DEVICE).detach().requires_grad_()
    loss = linear_cross_entropy(h, w.to(DEVICE), t3.to(DEVICE), mode="recompute", reduction="none")
    assert loss.shape == (2, 13)
    ref = ref_loss(x3.double().reshape(-1, 24) @ w.double().T, t3.reshape(-1).long(), "none").reshape(2, 13)
    assert_close(loss, ref, torch.float32, "loss")


def test_all_ignored_mean_is_nan_with_zero_gradients_and_bad_target_is_nan(gen):
    x, w, _, t = make(gen, torch.float32, n=5)
    h = x.to(DEVICE).requires_grad_()
    ww = w.to(DEVICE).requires_grad_()
    loss = linear_cross_entropy(h, ww, torch.full((5,), -100, device=DEVICE), mode="recompute")
    loss.backward()
    assert torch.isnan(loss) and (h.grad == 0).all() and (ww.grad == 0).all()
    t = t.clone()
    t[0] = 41  # outside [0, V): NaN (checking would cost a host sync)
    rows = linear_cross_entropy(x.to(DEVICE), w.to(DEVICE), t.to(DEVICE), mode="recompute", reduction="none")
    assert torch.isnan(rows[0]) and torch.isfinite(rows[2:]).all()


def test_two_backwards_through_a_retained_graph_and_fp32_weight_under_autocast(gen, small_chunks):
    x, w, _, t = make(gen, torch.float32)
    h = x.to(DEVICE).requires_grad_()
    ww = w.to(DEVICE).requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, ww, t.to(DEVICE), mode="recompute")
    loss.backward(retain_graph=True)
    g1 = ww.grad.clone()
    loss.backward()  # recompute mode hands nothing over: a second backward is allowed and adds the same
    assert ww.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    ref = ref_loss(x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T, t, "mean")
    assert_close(loss, ref, torch.bfloat16, "autocast loss")
    assert_close(ww.grad, 2 * g1, torch.float32, "second backward")


def test_custom_op_path_under_compile_and_flop_counter(gen, small_chunks):
    x, w, b, t = make(gen, torch.float32, bias=True)
    leaves = [a.to(DEVICE).requires_grad_() for a in (x, w, b)]
    td = t.to(DEVICE)
    eager = linear_cross_entropy(*leaves[:2], td, leaves[2], z_loss=1e-3, mode="recompute")
    eg = torch.autograd.grad(eager, leaves)
    f = torch.compile(lambda a, c, d: linear_cross_entropy(a, c, td, d, z_loss=1e-3, mode="recompute"),
                      backend="aot_eager", fullgraph=True)
    comp = f(*leaves)
    cg = torch.autograd.grad(comp, leaves)
    assert_close(comp, eager, torch.float32, "compiled loss")
    for a, c in zip(cg, eg):
        assert_close(a, c, torch.float32, "compiled grad")
    n, h, v = 37, 24, 41
    with FlopCounterMode(display=False) as fc:
        linear_cross_entropy(*leaves[:2], td, leaves[2], mode="recompute").backward()
    # as the chunked mode (model FLOPs exclude the recompute): three GEMMs, 4 + 5 per logit, 1 per logit for db
    assert fc.get_total_flops() == 3 * 2 * n * h * v + n * v * (4 + 5) + n * v


def test_mode_is_validated_per_call_module_and_patch():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="mode='recomputed'.*did you mean 'recompute'"):
        linear_cross_entropy(x, torch.randn(5, 8), torch.zeros(3, dtype=torch.long), mode="recomputed")
    with pytest.raises(ValueError, match="expected one of"):
        LinearCrossEntropyLoss(mode="none")
    with pytest.raises(ValueError, match="lm_head_mode='chunk'.*did you mean 'chunked'"):
        mk.patch(torch.nn.Linear(2, 2), lm_head_mode="chunk")


def test_patch_lm_head_mode_recompute_equals_the_unpatched_model(gen):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    model = copy.deepcopy(ref)
    report = mk.patch(model, kernels=["cross_entropy"], lm_head_mode="recompute")
    assert "mode recompute" in str(report)
    ids = torch.randint(0, 53, (2, 9), generator=gen)
    outs = []
    for m in (ref, model):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append((out.loss, {n: p.grad for n, p in m.named_parameters()}))
    assert torch.allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    for n, g in outs[0][1].items():
        assert torch.allclose(outs[1][1][n], g, rtol=1e-4, atol=1e-6), n


COMPILE_SCRIPT = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mfuwatch.kernels import _lce_recompute_triton as R

target = GPUTarget("cuda", 90, 32)
n = 0
for p, dt, f32 in (("*bf16", tl.bfloat16, False), ("*fp32", tl.bfloat16, False)):  # bf16, and fp32 under autocast
    common = dict(Hp=p, Wp=p, Bp=p, T="*i64", N="i32", V="i32", K="i32", stride_h="i32", stride_w="i32")
    flags = dict(HAS_BIAS=True, HAS_SOFTCAP=True, F32=f32, IEEE=f32, DT=dt)
    BM, BN, BK, w, s = R.FWD_SETTING
    sig = dict(common, PM="*fp32", PS="*fp32", PZ="*fp32", PT="*fp32", cols_per_split="i32", softcap="fp32")
    for even in (True, False):
        k = triton.compile(ASTSource(R._lse_fwd_kernel, sig, dict(flags, BM=BM, BN=BN, BK=BK, STAGES=s, EVEN_K=even)),
                           target=target, options=dict(num_warps=w, num_stages=s))
        assert "wgmma" in k.asm["ptx"], "forward: no wgmma"
        n += 1
    BM, BN, BK, w, s = R.BWD_SETTING
    sig = dict(common, LSE="*fp32", COEF="*fp32", DH="*fp32", DW="*fp32", DB="*fp32", v0="i32", chunk="i32",
               smoothing="fp32", z_loss="fp32", softcap="fp32")
    for offset in (True, False):
        k = triton.compile(ASTSource(R._grad_bwd_kernel, sig, dict(flags, NEED_DH=True, NEED_DW=True, NEED_DB=True,
                                                                   DW_OFFSET=offset, BM=BM, BN=BN, BK=BK, STAGES=s,
                                                                   EVEN_K=True)),
                           target=target, options=dict(num_warps=w, num_stages=s))
        assert "wgmma" in k.asm["ptx"], "backward: no wgmma"
        n += 1
print("compiled", n)
"""


@pytest.mark.slow
def test_recompute_kernels_compile_for_sm90():
    """Both kernels lower to sm_90 code with the default tiles (bf16 operands on wgmma), no GPU needed: the
    interpreter never lowers them (see test_gpu_compile.py for the other kernels)."""
    assert_compiles_in_subprocess(COMPILE_SCRIPT, 8)
