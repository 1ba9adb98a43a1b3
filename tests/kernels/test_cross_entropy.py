"""Fused cross-entropy against a float64 reference written here from the definition (not torch's loss)."""

import os
import subprocess
import sys
import textwrap

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import triton
import triton.language as tl

from mfuwatch.kernels._cross_entropy_triton import _rcp12
from mfuwatch.kernels.cross_entropy import CrossEntropyLoss, cross_entropy
from tests.helpers.kernel_checks import DEVICE, assert_close

#: the module (``mfuwatch.kernels.cross_entropy`` as a package attribute may be the function of that name)
ce_mod = importlib.import_module("mfuwatch.kernels.cross_entropy")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def ref_rows(x, t, ignore_index=-100, smoothing=0.0, z_loss=0.0, softcap=None):
    """float64 per-row loss: -(1-eps) log p_t - eps/V sum_j log p_j + zl lse^2, 0 for ignored rows."""
    z = x.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.log(torch.exp(z - z.max(-1, keepdim=True).values).sum(-1)) + z.max(-1).values
    logp = z - lse.unsqueeze(-1)
    keep = t != ignore_index
    tt = torch.where(keep, t, 0).long()
    nll = -logp.gather(-1, tt.unsqueeze(-1)).squeeze(-1)
    smooth = -logp.mean(-1)
    rows = (1 - smoothing) * nll + smoothing * smooth + z_loss * lse ** 2
    return torch.where(keep, rows, torch.zeros_like(rows))


def ref_loss(x, t, reduction, ignore_index=-100, **kw):
    rows = ref_rows(x, t, ignore_index, **kw)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (t != ignore_index).sum()


OPTIONS = [dict(), dict(softcap=4.0, smoothing=0.1, z_loss=1e-3), dict(smoothing=1.0), dict(softcap=0.5)]


def assert_matches_reference(x, t, reduction, dtype, gen, scale=1.0, **kw):
    """Forward and backward (with a random upstream gradient) of the fused op against ref_loss."""
    x = x.to(DEVICE).detach().requires_grad_()
    t = t.to(DEVICE)
    loss = cross_entropy(x, t, reduction=reduction, label_smoothing=kw.get("smoothing", 0.0),
                         z_loss=kw.get("z_loss", 0.0), softcap=kw.get("softcap"))
    assert loss.dtype == torch.float32
    up = (torch.randn(loss.shape, generator=gen) if reduction == "none" else torch.tensor(1.7)).to(DEVICE)
    loss.backward(up)
    x64 = x.detach().cpu().double().requires_grad_()
    r = ref_loss(x64, t.cpu(), reduction, **kw)
    r.backward(up.cpu().double())
    assert_close(loss, r, torch.float32, "loss", scale=scale)
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    assert_close(x.grad, x64.grad, dtype, "dlogits", scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", OPTIONS, ids=["plain", "softcap+smooth+z", "smooth1", "hardcap"])
def test_forward_backward_match_float64(dtype, reduction, opts, gen):
    V = 263  # odd, a partial last block
    x = (3 * torch.randn(7, V, generator=gen)).to(dtype)
    t = torch.randint(0, V, (7,), generator=gen)
    t[2] = -100
    assert_matches_reference(x, t, reduction, dtype, gen, **opts)


def test_largest_vocabulary_padded_lanes_take_no_mass(gen):
    # 262144 - 3 classes: the last block has 3 padded lanes, which under a softcap would be -c, not -inf
    V = 262144 - 3
    x = (2 * torch.randn(2, V, generator=gen)).to(torch.bfloat16)
    t = torch.tensor([V - 1, 5])
    assert_matches_reference(x, t, "mean", torch.bfloat16, gen, softcap=30.0)


def test_custom_ignore_index_and_layouts(gen):
    # (N, C, d) layout with classes in dim 1 (F.cross_entropy's), and a (C,) row with a 0-d target
    x = torch.randn(3, 11, 4, generator=gen)
    t = torch.randint(0, 11, (3, 4), generator=gen)
    t[0, 1] = 7
    xd = x.clone().to(DEVICE).detach().requires_grad_()
    loss = cross_entropy(xd, t.to(DEVICE), reduction="none", ignore_index=7)
    assert loss.shape == (3, 4)
    x64 = x.double().requires_grad_()
    r = ref_rows(x64.movedim(1, -1).reshape(-1, 11), t.reshape(-1), ignore_index=7).reshape(3, 4)
    assert_close(loss, r, torch.float32, "loss")
    up = torch.randn(3, 4, generator=gen)
    loss.backward(up.to(DEVICE))
    r.backward(up.double())
    assert_close(xd.grad, x64.grad, torch.float32, "dlogits")
    one = cross_entropy(x[0, :, 0].to(DEVICE), t[0, 0].to(DEVICE))
    assert one.shape == () and abs(float(one) - float(ref_rows(x[0, :, 0][None], t[0, :1]))) < 1e-5


def test_non_contiguous_logits_are_read_correctly(gen):
    wide = torch.randn(6, 300, generator=gen)
    t = torch.randint(0, 129, (6,), generator=gen)
    assert_matches_reference(wide[:, 5:134], t, "mean", torch.float32, gen)  # a slice: row stride 300
    assert_matches_reference(torch.randn(129, 6, generator=gen).t(), t, "sum", torch.float32, gen)  # transposed: copied once


def test_all_ignored_mean_is_nan_with_zero_gradients():
    x = torch.randn(4, 9, device=DEVICE, requires_grad=True)
    t = torch.full((4,), -100, device=DEVICE)
    for opts in (dict(), dict(z_loss=1e-2, label_smoothing=0.2, softcap=3.0)):
        x.grad = None
        loss = cross_entropy(x, t, **opts)
        assert torch.isnan(loss)
        loss.backward()
        assert torch.equal(x.grad, torch.zeros_like(x))
    ref = torch.nn.functional.cross_entropy(x.detach().requires_grad_(), t)  # torch's own behaviour, for the record
    assert torch.isnan(ref)


def test_out_of_range_target_gives_nan_not_a_wrong_number():
    x = torch.randn(3, 9, device=DEVICE, requires_grad=True)
    loss = cross_entropy(x, torch.tensor([1, 9, 2], device=DEVICE), reduction="none")
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()


def test_gradient_not_written_into_logits_that_feed_a_second_loss(gen):
    x0 = torch.randn(5, 40, generator=gen)
    t = torch.randint(0, 40, (5,), generator=gen)
    x = x0.clone().to(DEVICE).requires_grad_()
    y = x * 2.0  # a non-leaf whose value autograd still needs for the second loss
    loss = cross_entropy(y, t.to(DEVICE)) + (y ** 2).sum()
    loss.backward()
    assert torch.equal(y.detach().cpu(), 2 * x0)
    x64 = x0.double().requires_grad_()
    y64 = 2 * x64
    (ref_loss(y64, t, "mean") + (y64 ** 2).sum()).backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_retained_graph_second_backward_equals_first(gen):
    x = torch.randn(4, 33, generator=gen).to(DEVICE).requires_grad_()
    t = torch.randint(0, 33, (4,), generator=gen).to(DEVICE)
    loss = cross_entropy(x, t, z_loss=1e-3)
    loss.backward(torch.tensor(3.0, device=DEVICE), retain_graph=True)
    first = x.grad.clone()
    loss.backward(torch.tensor(3.0, device=DEVICE))
    assert_close(x.grad, 2 * first, torch.float32, "accumulated")


def test_loss_scale_as_a_tensor_for_gradient_accumulation(gen):
    x = torch.randn(6, 20, generator=gen).to(DEVICE).requires_grad_()
    t = torch.randint(0, 20, (6,), generator=gen)
    t[0] = -100
    n_items = (t != -100).sum().to(DEVICE) * 2  # e.g. items over two micro-batches, never read on the host
    (cross_entropy(x, t.to(DEVICE), reduction="sum") / n_items).backward()
    x64 = x.detach().cpu().double().requires_grad_()
    (ref_loss(x64, t, "sum") / n_items.cpu()).backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_custom_op_path_equals_fast_path(monkeypatch, gen):
    x0 = torch.randn(5, 70, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    t = torch.randint(0, 70, (5,), generator=gen).to(DEVICE)
    for reduction in ("mean", "none"):
        results = []
        for forced in (False, True):
            monkeypatch.setattr(ce_mod, "use_custom_op", lambda *a, f=forced: f)
            x = x0.clone().requires_grad_()
            loss = cross_entropy(x, t, reduction=reduction, softcap=5.0)
            loss.sum().backward()
            results.append((loss.detach().float(), x.grad.float()))
        for a, b in zip(*results):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_flop_counter_counts_the_registered_formula():
    x = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 50, (4,), device=DEVICE)
    with FlopCounterMode(display=False) as fc:
        cross_entropy(x, t).backward()
    assert fc.get_total_flops() == 4 * 50 * (4 + 5)  # forward 4 per logit, backward 5 (kernels/_flops.py)
    with FlopCounterMode(display=False) as fc:
        cross_entropy(x, t, softcap=2.0).backward()
    assert fc.get_total_flops() == 4 * 50 * (4 + 3 + 5 + 6)


def test_compiled_graph_gets_the_plain_decomposition(gen):
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    x = torch.randn(3, 17, generator=gen).to(DEVICE).requires_grad_()
    t = torch.randint(0, 17, (3,), generator=gen).to(DEVICE)
    f = torch.compile(lambda a, b: cross_entropy(a, b, softcap=3.0, z_loss=1e-3), backend=backend, fullgraph=True)
    loss = f(x, t)
    assert seen and not any("mfuwatch" in s for s in seen)
    loss.backward()
    x64 = x.detach().cpu().double().requires_grad_()
    r = ref_loss(x64, t.cpu(), "mean", softcap=3.0, z_loss=1e-3)
    r.backward()
    assert_close(loss, r, torch.float32, "loss")
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_module_and_option_errors():
    m = CrossEntropyLoss(reduction="sum", softcap=2.0)
    x = torch.randn(2, 5, device=DEVICE)
    t = torch.tensor([0, 4], device=DEVICE)
    assert abs(float(m(x, t)) - float(ref_loss(x.cpu(), t.cpu(), "sum", softcap=2.0))) < 1e-4
    with pytest.raises(ValueError, match="reduction='avg'"):
        CrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="softcap=0"):
        cross_entropy(x, t, softcap=0)
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"target shape \(3,\) != \(2,\)"):
        cross_entropy(x, torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="class-probability"):
        cross_entropy(x, torch.rand(2, device=DEVICE))


SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from mfuwatch.kernels.cross_entropy import cross_entropy

    V, STRIDE = 64, 2**30
    base = torch.empty(2 * STRIDE + 4 * V, dtype=torch.bfloat16)   # 2**31 + 256 elements, untouched
    x = base.as_strided((3, V), (STRIDE, 1))
    x.copy_(torch.randn(3, V, generator=torch.Generator().manual_seed(0)))
    t = torch.tensor([1, 2, 63])
    res = []
    for a in (x, x.contiguous()):
        a = a.detach().requires_grad_()
        loss = cross_entropy(a, t, reduction="none", softcap=10.0)
        (g,) = torch.autograd.grad(loss, a, torch.ones(3))
        res.append((loss, g))
    assert torch.equal(res[0][0], res[1][0]), "forward differs"
    assert torch.equal(res[0][1], res[1][1]), "backward differs"
    print("ok")
    """
)


def test_rows_past_2_pow_31_elements():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}")


@pytest.fixture
def split_kernel(monkeypatch):
    """The split forward (several programs per row, each holding its columns in registers) on every device:
    under the interpreter its programs run one after another, so only one-segment rows can finish there."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    monkeypatch.setattr(K, "split_ok", lambda x: True)
    monkeypatch.setattr(K, "SPLIT_SETTINGS", ((64, 2),))
    return K


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", OPTIONS[:2], ids=["plain", "softcap+smooth+z"])
def test_split_kernel_one_segment_per_row(dtype, opts, gen, split_kernel):
    x = torch.randn(9, 50, generator=gen).to(dtype) * 3
    t = torch.randint(0, 50, (9,), generator=gen)
    t[2] = -100
    assert split_kernel._candidates(50, True, True)[0][2] == "split"
    assert_matches_reference(x, t, "mean", dtype, gen, **opts)
    assert_matches_reference(x, t, "sum", dtype, gen, **opts)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's one-program-at-a-time order")
def test_split_kernel_gives_up_with_nan_instead_of_hanging(gen, split_kernel, monkeypatch):
    """Two segments per row under the interpreter: segment 0 cannot see segment 1 (not yet run), polls
    MAX_SPIN times and writes NaN; segment 1 runs last, sees both partials and writes the right gradient."""
    monkeypatch.setattr(split_kernel, "MAX_SPIN", 3)
    x = torch.randn(4, 100, generator=gen) * 2
    t = torch.randint(0, 100, (4,), generator=gen)
    xg = x.clone().requires_grad_()
    cross_entropy(xg, t, reduction="sum").backward()
    x64 = x.double().requires_grad_()
    ref_loss(x64, t, "sum").backward()
    assert torch.isnan(xg.grad[:, :64]).all()
    assert_close(xg.grad[:, 64:], x64.grad[:, 64:], torch.float32, "second segment")


@pytest.mark.parametrize("kind", ["rev", "revh", "lane", "laneh"])
@pytest.mark.parametrize("opts", OPTIONS[:2], ids=["plain", "softcap+smooth+z"])
def test_reversed_gradient_pass(kind, opts, gen, monkeypatch):
    """The gradient pass walking each row from its end (several blocks per row: BLOCK 16 over V = 50, the last
    block partial) writes the same gradient as the float64 reference; "lane"/"laneh" with the per-lane running
    log-sum-exp (rows scaled by 3, so that lanes see new maxima in later blocks)."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    C = importlib.import_module("mfuwatch.kernels._tuning")
    monkeypatch.setattr(K, "_candidates", lambda V, write=False, split=False: [(16, 1, kind, 0, 1)] if write
                        else [(16, 1, "row", 0, 1)])
    monkeypatch.setattr(C, "_TUNED", {})
    x = torch.randn(7, 50, generator=gen) * 3
    t = torch.randint(0, 50, (7,), generator=gen)
    t[3] = -100
    assert_matches_reference(x, t, "mean", torch.float32, gen, **opts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", OPTIONS, ids=["plain", "softcap+smooth+z", "smooth1", "softcap0.5"])
@pytest.mark.parametrize("setting", [(16, 1, "team", 1, 1), (16, 2, "team", 2, 3), (64, 1, "team", 1, 0),
                                     (32, 1, "team", 8, 2), (8, 1, "team2", 1, 21), (16, 2, "team2", 2, 12),
                                     (16, 1, "team2", 1, 41), (8, 1, "team2", 1, 1021), (16, 2, "team2", 2, 1041)],
                         ids=["S4", "S4-prefetch", "S1", "S2-prefetch", "L2-S4", "L2-S2", "L2-S1", "L2-S4-flags",
                              "L2-S1-flags"])
def test_team_kernel_matches_float64(dtype, opts, setting, gen):
    """The persistent team kernels, S programs per row ("team": S = ceil(V / BLOCK), each holding its columns in
    registers; "team2": S = ceil(V / (BLOCK * blocks per segment)), each streaming its segment twice; "flags": the
    64-bit flag-word exchange instead of the counter; V = 50, so the last segment is partial; 9 rows over fewer teams, so each program walks several rows) writes
    the loss, the lse and the gradient of the float64 reference, on logits with a row stride > V. Under the
    interpreter its programs run one after another: all but a row's last program give up waiting and read the
    row themselves, the last combines the published partials, so both paths are checked."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    base = (torch.randn(9, 64, generator=gen) * 3).to(dtype)
    x = base[:, :50]  # row stride 64
    t = torch.randint(0, 50, (9,), generator=gen)
    t[2] = -100
    t[5] = 49  # the target in the last, partial segment
    _check_fused_against_float64(K, x, t, opts, dtype, setting)


def _check_fused_against_float64(K, x, t, opts, dtype, setting):
    """``ce_fwd`` writing the gradient (scale 0.37, into a NaN-poisoned buffer) against the float64 reference:
    loss rows, lse and dlogits of ``x`` (rows x 50, any stride) with targets ``t`` (-100 ignored)."""
    sm, eps, zl = opts.get("softcap"), opts.get("smoothing", 0.0), opts.get("z_loss", 0.0)
    scale = torch.tensor([0.37])
    dx = torch.full(tuple(x.shape), float("nan"), dtype=dtype)
    xd, td, dxd = x.to(DEVICE), t.to(DEVICE), dx.to(DEVICE)
    loss, lse = K.ce_fwd(xd, td, -100, eps, zl, sm or 0.0, grad_scale=scale.to(DEVICE), dx=dxd, setting=setting)
    x64 = x.double().requires_grad_()
    rows = ref_rows(x64, t, -100, eps, zl, sm)
    (rows.sum() * 0.37).backward()
    assert_close(loss.cpu(), rows.detach(), torch.float32, "loss rows")
    z = x.double() if sm is None else sm * torch.tanh(x.double() / sm)
    assert_close(lse.cpu(), torch.logsumexp(z, -1), torch.float32, "lse")
    assert not torch.isnan(dxd).any()
    assert_close(dxd.cpu().float(), x64.grad, dtype, "dlogits")


def test_team_grid_caps_registers_so_the_programs_fit_together():
    """team_grid: pps programs of w warps per SM, a whole number of teams; 2 x 8 warps = 512 threads, so 65536 /
    512 = 128 registers per thread on a GPU (None under the interpreter, which has no registers); more than the
    2048 threads an SM holds is refused."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    cpu = torch.device("cpu")  # sm_count: 4 for the CPU
    progs, maxnreg = K.team_grid(3, 8, 2, cpu)
    assert progs == 6  # 2 * 4 = 8 programs, rounded down to whole teams of 3
    assert maxnreg == (None if K.INTERPRET else 128)
    assert K.team_grid(16, 4, 2, cpu)[0] == 16  # fewer programs than one team: one team (correct, not co-resident)
    with pytest.raises(ValueError, match="2048 threads"):
        K.team_grid(4, 32, 3, cpu)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", OPTIONS, ids=["plain", "softcap+smooth+z", "smooth1", "softcap0.5"])
@pytest.mark.parametrize("setting", [(16, 1, "fast", 0, 1), (16, 2, "fast", 2, 32), (16, 1, "fast", 0, 12),
                                     (64, 1, "fast", 0, 1), (8, 1, "fast", 3, 21), (16, 1, "fast", 0, 1001),
                                     (16, 2, "fast", 2, 1012), (64, 1, "fast", 0, 1001)],
                         ids=["B16", "B16-newton-persistent", "B16-newton1", "tail-only", "B8-newton2-persistent",
                              "B16-local", "B16-local-newton1-persistent", "tail-only-local"])
def test_fast_kernel_matches_float64(dtype, opts, setting, gen):
    """The "fast" kernel (unmasked full blocks + one masked tail, smoothing and z-loss specialised away when 0, the
    target column written by a scalar store after the gradient pass; under the interpreter the pure-tl forms of
    ex2 and the reciprocal, and the FMA-pipe reciprocal where the setting asks for it; "local": the per-thread
    forward, which with these softcaps (<= 40) sums exp(z - c) without a running max): loss, lse and gradient of
    the float64 reference on logits with a row stride > V (V = 50: three full blocks of 16 and a tail of 2; BLOCK
    64: the tail alone), targets in the first and the last column and an ignored row; the gradient buffer poisoned
    with NaN first."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    base = (torch.randn(9, 64, generator=gen) * 3).to(dtype)
    x = base[:, :50]
    t = torch.randint(0, 50, (9,), generator=gen)
    t[2] = -100
    t[5] = 49
    t[6] = 0
    _check_fused_against_float64(K, x, t, opts, dtype, setting)


@pytest.mark.parametrize("stages", [1, 1001], ids=["block", "local"])
def test_fast_kernel_rows_with_minus_inf_logits(stages, gen):
    """Runs of -inf logits (a masked vocabulary: whole 16-column blocks and whole 16-byte vectors of them, the tail
    too) take no probability and get gradient 0, the loss stays finite: the per-thread forward's running max
    starts at -inf and a vector of -inf logits must not turn it into NaN."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    x = torch.randn(4, 50, generator=gen) * 3
    x[:, 16:40] = float("-inf")
    x[:, 48:] = float("-inf")
    t = torch.tensor([3, 45, -100, 0])
    dx = torch.full_like(x, float("nan"))
    loss, _ = K.ce_fwd(x.to(DEVICE), t.to(DEVICE), -100, 0.0, 0.0, 0.0, grad_scale=torch.tensor([1.0]).to(DEVICE),
                       dx=(dx := dx.to(DEVICE)), setting=(16, 1, "fast", 0, stages))
    keep = torch.cat([torch.arange(16), torch.arange(40, 48)])
    x64 = x[:, keep].double().requires_grad_()
    tk = torch.tensor([3, 16 + 45 - 40, -100, 0])
    ref_rows(x64, tk).sum().backward()
    assert_close(loss.cpu(), ref_rows(x[:, keep].double(), tk), torch.float32, "loss rows")
    assert_close(dx.cpu()[:, keep], x64.grad, torch.float32, "dlogits")
    assert (dx.cpu()[:, 16:40] == 0).all() and (dx.cpu()[:, 48:] == 0).all()


def test_fast_kernel_in_place_and_negative_scale(gen):
    """The fast kernel writing the gradient over its own logits (as linear CE does) with a negative gradient scale
    (the upstream gradient of ``-loss``): the target column's scalar store uses the target logit read before the
    gradient pass overwrote it."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    x = torch.randn(5, 40, generator=gen) * 3
    t = torch.randint(0, 40, (5,), generator=gen)
    t[1] = -100
    xd = x.clone().to(DEVICE)
    K.ce_fwd(xd, t.to(DEVICE), -100, 0.0, 1e-3, 5.0, grad_scale=torch.tensor([-0.5]).to(DEVICE), dx=xd,
             setting=(16, 1, "fast", 0, 1))
    x64 = x.double().requires_grad_()
    (ref_rows(x64, t, -100, 0.0, 1e-3, 5.0).sum() * -0.5).backward()
    assert_close(xd.cpu(), x64.grad, torch.float32, "dlogits in place")


@triton.jit
def _rcp12_probe(D, R, n, NEWTON: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    d = tl.load(D + o, mask=m, other=1.0)
    tl.store(R + o, _rcp12(d, NEWTON, False), mask=m)


def test_fma_pipe_reciprocal_is_accurate():
    """_rcp12 with NEWTON (the minimax quadratic and two Newton steps, FMA only) on 4097 points of [1, 2]: relative
    error under 3e-7 (about 2.5 fp32 ulps) against float64; the initial quadratic alone is within 1/99."""
    d = torch.linspace(1.0, 2.0, 4097, dtype=torch.float32)
    r = torch.empty_like(d).to(DEVICE)
    _rcp12_probe[(1,)](d.to(DEVICE), r, d.numel(), NEWTON=True, BLOCK=8192)
    err = (r.cpu().double() * d.double() - 1).abs().max()
    assert float(err) < 3e-7
    q = (32 * d.double() ** 2 - 144 * d.double() + 210) / 99
    assert abs(float((q * d.double() - 1).abs().max()) - 1 / 99) < 1e-6


@pytest.mark.parametrize("stages", [1001, 1011])
def test_fast_kernel_local_forward_with_a_large_softcap(stages, gen):
    """A softcap above FIXED_MAX_SOFTCAP (50 > 40): the per-thread forward keeps its running max (exp(z - c) could
    underflow to 0 for z near -c), on logits spread wide enough (x up to ~120) to saturate it."""
    K = importlib.import_module("mfuwatch.kernels._cross_entropy_triton")
    assert 50.0 > K.FIXED_MAX_SOFTCAP
    x = torch.randn(6, 70, generator=gen) * 40
    t = torch.randint(0, 70, (6,), generator=gen)
    t[4] = -100
    dx = torch.full_like(x, float("nan")).to(DEVICE)
    loss, _ = K.ce_fwd(x.to(DEVICE), t.to(DEVICE), -100, 0.1, 1e-3, 50.0, grad_scale=torch.tensor([0.5]).to(DEVICE),
                       dx=dx, setting=(16, 1, "fast", 0, stages))
    x64 = x.double().requires_grad_()
    rows = ref_rows(x64, t, -100, 0.1, 1e-3, 50.0)
    (rows.sum() * 0.5).backward()
    assert_close(loss.cpu(), rows.detach(), torch.float32, "loss rows")
    assert_close(dx.cpu(), x64.grad, torch.float32, "dlogits")
