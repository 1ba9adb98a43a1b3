"""linear_cross_entropy(..., mode="recompute") (one logits tile at a time; kernels/_lce_recompute.py) against a
float64 reference, over several row blocks and class slices, with every option of the API; and the tile shape's
choice against hand-derived byte counts."""

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

R = importlib.import_module("mfuwatch.kernels._lce_recompute")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture
def small_chunks(monkeypatch):
    """Tiles of 16 rows by 8 classes: at N = 37, V = 41 three row blocks (the last of 5 rows) and six class slices
    (the last of 1 class), so every running value is merged across tiles and dW is added to by later blocks."""
    monkeypatch.setattr(R, "TILE", (16, 8))


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
    with pytest.raises(ValueError, match="lm_head_mode='RECOMPUTE'.*did you mean 'recompute'"):
        mk.patch(torch.nn.Linear(2, 2), lm_head_mode="RECOMPUTE")  # the values are lower case; the hint says so
    assert repr(LinearCrossEntropyLoss(softcap=30.0, mode="recompute")) == (
        "LinearCrossEntropyLoss(ignore_index=-100, reduction='mean', label_smoothing=0.0, z_loss=0.0, "
        "softcap=30.0, mode='recompute')")


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
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mfuwatch.kernels import _lce_recompute as R

target = GPUTarget("cuda", 90, 32)
n = 0
for p in ("*bf16", "*fp16", "*fp32"):
    for cap in (False, True):
        sig = dict(X=p, T="*i64", M="*fp32", S="*fp32", SZ="*fp32", ZT="*fp32", stride_x="i32", ncols="i32",
                   col0="i32", softcap="fp32")
        triton.compile(ASTSource(R._tile_stats_kernel, sig, dict(HAS_SOFTCAP=cap, SMOOTH=True, BLOCK=R.BLOCK)),
                       target=target, options=dict(num_warps=R.WARPS))
        sig = dict(X=p, T="*i64", LSE="*fp32", COEF="*fp32", stride_x="i32", ncols="i32", col0="i32", V="i32",
                   smoothing="fp32", z_loss="fp32", softcap="fp32")
        triton.compile(ASTSource(R._tile_grad_kernel, sig, dict(HAS_SOFTCAP=cap, BLOCK=R.BLOCK)), target=target,
                       options=dict(num_warps=R.WARPS))
        n += 2
print("compiled", n)
"""


@pytest.mark.slow
def test_recompute_kernels_compile_for_sm90():
    """Both tile kernels lower to sm_90 code with the default block, for every logits dtype, with and without a
    softcap; no GPU needed (the interpreter never lowers them; see test_gpu_compile.py for the other kernels)."""
    assert_compiles_in_subprocess(COMPILE_SCRIPT, 12)


def test_tile_shape_at_the_benchmark_shape_by_hand():
    """8192 x 4096 x 128256 bf16 (the issue's shape). By the documented byte count, R = 4096 (C = 4096, 32 slices,
    2 row blocks): dh 8*8192*4096*32 + dW 128256*4096*2*3 + h 8192*4096*2*32 + W 128256*4096*2*2 = 16.0 GB,
    memory 32 + 64 = 96 MiB; R = 2048 (C = 8192, 16 slices, 4 blocks): 4.29 + 7.35 + 1.07 + 4.20 = 16.9 GB;
    R = 8192 (C = 2048) would hold a 128 MiB dh accumulator: over the 96 MiB budget."""
    N, H, V = 8192, 4096, 128256
    assert R.tile_shape(N, V, H, 2, True, True, 2, False, False) == (4096, 4096)
    moved = {4096: 8 * N * H * 32 + V * H * 2 * 3 + N * H * 2 * 32 + V * H * 2 * 2,
             2048: 8 * N * H * 16 + V * H * 2 * 7 + N * H * 2 * 16 + V * H * 2 * 4}
    assert moved[4096] < moved[2048]
    # fp32 hidden and weight under bf16 autocast (the HF end to end), H = 2048: dh accumulates in place (no
    # accumulator), W is cast slice by slice (6 bytes more per element and row block): R = N is allowed
    # (tile 32 MiB + h cast 32 MiB + W slice cast 8 MiB = 72 MiB), and it moves the fewest bytes there
    r, c = R.tile_shape(8192, 128256, 2048, 2, True, False, 4, True, True)
    assert r * c <= R.TILE_ELEMENTS and c % R.ALIGN == 0
    assert r * c * 2 + r * 2048 * 2 + c * 2048 * 2 <= R.BUDGET_BYTES


@pytest.mark.parametrize("n, v, h", [(1, 1, 1), (5, 300, 7), (100000, 50, 64), (3000, 262144, 8192)])
def test_tile_shape_stays_within_the_budget(n, v, h):
    r, c = R.tile_shape(n, v, h, 2, True, True, 2, True, True)
    assert 1 <= r <= n and 1 <= c <= v and r * c <= R.TILE_ELEMENTS
    assert r * c * 2 + 4 * r * h + r * h * 2 + c * h * 2 <= R.BUDGET_BYTES


def test_accumulate_fp32_is_followed_over_many_row_blocks(gen, monkeypatch):
    """A bf16 dW over 256 row blocks (tiles of 4 rows): added to in bf16 once per block by default (256 roundings of
    the running sum), in an fp32 buffer with ``ACCUMULATE_FP32 = True``, which the recompute mode follows as the
    chunked mode does: its error against float64 is several times smaller (about 0.2 x over six seeds: 3.3e-3
    against 1.6e-2), and dW stays bf16."""
    L = importlib.import_module("mfuwatch.kernels.linear_cross_entropy")
    monkeypatch.setattr(R, "TILE", (4, 64))
    n, h, v = 1024, 16, 64
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=gen) / 3).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=gen)
    wd = w.double().requires_grad_()  # reduction "sum": every row's gradient counts fully
    (dw64,) = torch.autograd.grad(ref_loss(x.double() @ wd.T, t, "sum"), [wd])
    errs = {}
    for acc in (None, True):
        monkeypatch.setattr(L, "ACCUMULATE_FP32", acc)
        ww = w.clone().to(DEVICE).requires_grad_()  # a fresh leaf per setting (w.to("cpu") is w itself)
        linear_cross_entropy(x.to(DEVICE), ww, t.to(DEVICE), reduction="sum", mode="recompute").backward()
        assert ww.grad.dtype == torch.bfloat16
        errs[acc] = ((ww.grad.cpu().double() - dw64).norm() / dw64.norm()).item()
    assert errs[True] < 0.5 * errs[None], errs


@pytest.mark.parametrize("mode, fused", [("chunked", True), ("chunked", False), ("recompute", False)])
def test_custom_ops_fake_outputs_match_the_real_ones(mode, fused):
    """torch.library.opcheck's fake-tensor test over both ops with a bf16 weight and an fp32 bias (the empty dbias
    output had the weight's dtype in the real op and the bias's in the fake one)."""
    h, w = torch.randn(5, 8).to(torch.bfloat16), torch.randn(7, 8).to(torch.bfloat16)
    b, t = torch.randn(7), torch.randint(0, 7, (5,))
    args = (h, w, t, b, -100, 0.0, 0.0, 0.0, torch.bfloat16, True, [True, True, False], fused, mode)
    ok = {"test_faketensor": "SUCCESS"}
    assert torch.library.opcheck(torch.ops.mfuwatch.linear_cross_entropy, args, test_utils=tuple(ok)) == ok
    if not fused:
        bargs = (torch.ones(5), h, w, t, b, torch.zeros(5), -100, 0.0, 0.0, 0.0, torch.bfloat16, [True, True, False],
                 mode)
        assert torch.library.opcheck(torch.ops.mfuwatch.linear_cross_entropy_backward, bargs,
                                     test_utils=tuple(ok)) == ok


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("opts", ["plain", "bias+softcap+smoothing+z"])
def test_cpu_fallback_without_triton_over_several_tiles(reduction, opts, monkeypatch, gen, small_chunks):
    """The plain-PyTorch tile passes (CPU without the interpreter) against float64, over the same tiles."""
    from mfuwatch.kernels import _launch

    monkeypatch.setattr(_launch, "INTERPRET", False)
    assert not _launch.use_triton(torch.zeros(1))
    bias = opts != "plain"
    lce_tests.check_float64(make(gen, torch.float32, h=32 if bias else 24, bias=bias), torch.float32, reduction, gen,
                            "recompute")
