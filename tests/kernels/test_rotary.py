"""apply_rotary against a float64 reference written here: layouts, partial rotary, strides, dtypes, fwd + bwd."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mfuwatch.kernels as mk
from tests.helpers.kernel_checks import DEVICE, assert_close


def ref_rotary(x, cos, sin, interleaved):
    """x * cos + rotate(x) * sin on the first R dims, the rest passed through, in float64."""
    x = x.double()
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    r = c.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    if interleaved:  # rotate(x)[2j] = -x[2j+1], rotate(x)[2j+1] = x[2j]
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:  # rotate_half: cat(-x2, x1)
        rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)
    return torch.cat((xr * c + rot * s, xp), dim=-1)


def angles(b, t, r, gen, dtype, interleaved=False):
    """cos/sin as a rotary module builds them (duplicated halves or repeat-interleaved), then perturbed so
    that a kernel reading the wrong half of cos/sin fails."""
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    pos = torch.arange(t, dtype=torch.float64)[:, None] + torch.rand(b, 1, 1, generator=gen, dtype=torch.float64) * 50
    f = pos * inv  # (b, t, r/2)
    emb = f.repeat_interleave(2, dim=-1) if interleaved else torch.cat((f, f), dim=-1)
    noise = 0.1 * torch.randn(2, b, t, r, generator=gen, dtype=torch.float64)
    return (emb.cos() + noise[0]).to(dtype).to(DEVICE), (emb.sin() + noise[1]).to(dtype).to(DEVICE)


def assert_rotary_matches_reference(q, k, cos, sin, interleaved, dtype, gen):
    q0, k0 = q.detach().clone(), k.detach().clone()
    q_emb, k_emb = mk.apply_rotary(q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0), "inputs modified"
    # reference and gradients by float64 autograd on the reference
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    rq, rk = ref_rotary(q64, cos, sin, interleaved), ref_rotary(k64, cos, sin, interleaved)
    assert q_emb.dtype == dtype and k_emb.dtype == dtype
    assert_close(q_emb, rq, dtype, "q_embed")
    assert_close(k_emb, rk, dtype, "k_embed")
    dq_out = torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE)
    dk_out = torch.randn(k.shape, generator=gen).to(dtype).to(DEVICE)
    (q_emb.float() * dq_out.float()).sum().add((k_emb.float() * dk_out.float()).sum()).backward()
    (rq * dq_out.double()).sum().add((rk * dk_out.double()).sum()).backward()
    assert q.grad.dtype == q.dtype and k.grad.dtype == k.dtype
    assert_close(q.grad, q64.grad, dtype, "dq")
    assert_close(k.grad, k64.grad, dtype, "dk")
    return q_emb, k_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hq,hk,d,r", [(4, 2, 16, 16), (3, 1, 13, 8), (5, 5, 20, 10), (2, 1, 6, 2)])
def test_matches_float64_reference(dtype, interleaved, hq, hk, d, r, gen):
    b, t = 2, 7
    q = torch.randn(b, hq, t, d, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    k = torch.randn(b, hk, t, d, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    cos, sin = angles(b, t, r, gen, dtype, interleaved)
    assert_rotary_matches_reference(q, k, cos, sin, interleaved, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_projections_broadcast_and_strided_cos(dtype, gen):
    # q and k as attention modules make them: (B, T, H, D) projections viewed as (B, H, T, D); k a slice of a
    # fused kv projection; cos/sin batch 1 (broadcast) and a slice of a wider tensor
    b, t, hq, hk, d = 3, 5, 4, 1, 12
    q_leaf = torch.randn(b, t, hq, d, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    kv_leaf = torch.randn(b, t, 2 * hk, d, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    q = q_leaf.transpose(1, 2)
    k = kv_leaf[:, :, :hk].transpose(1, 2)
    wide_c, wide_s = angles(1, t, 2 * d, gen, dtype)
    cos, sin = wide_c[..., :d], wide_s[..., :d]
    assert not q.is_contiguous() and not k.is_contiguous() and not cos.is_contiguous()
    q_emb, k_emb = mk.apply_rotary(q, k, cos, sin)
    assert q_emb.stride() == q.stride()  # a transposed projection stays transposed (as x * cos would)
    assert_close(q_emb, ref_rotary(q, cos, sin, False), dtype, "q_embed")
    assert_close(k_emb, ref_rotary(k, cos, sin, False), dtype, "k_embed")
    g = torch.randn(q_emb.shape, generator=gen).to(dtype).to(DEVICE)
    (q_emb.float() * g.float()).sum().add(k_emb.float().sum()).backward()
    q64 = q.detach().double().requires_grad_()
    (ref_rotary(q64, cos, sin, False) * g.double()).sum().backward()
    assert_close(q_leaf.grad.transpose(1, 2), q64.grad, dtype, "dq")
    assert kv_leaf.grad[:, :, hk:].abs().max() == 0  # the v half gets nothing


def test_matches_hugging_face_apply_rotary_pos_emb(gen):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    q = torch.randn(2, 4, 6, 16, generator=gen, dtype=torch.float64).float().to(DEVICE)
    k = torch.randn(2, 2, 6, 16, generator=gen, dtype=torch.float64).float().to(DEVICE)
    for fn, r in ((llama.apply_rotary_pos_emb, 16), (phi3.apply_rotary_pos_emb, 8)):
        cos, sin = angles(2, 6, r, gen, torch.float32)
        want_q, want_k = fn(q, k, cos, sin)
        got_q, got_k = mk.apply_rotary(q, k, cos, sin)
        assert torch.allclose(got_q, want_q, atol=1e-5) and torch.allclose(got_k, want_k, atol=1e-5), fn.__module__


def test_no_grad_path_and_empty_inputs(gen):
    q = torch.randn(1, 2, 3, 8, generator=gen).to(DEVICE)
    k = torch.randn(1, 1, 3, 8, generator=gen).to(DEVICE)
    cos, sin = angles(1, 3, 8, gen, torch.float32)
    with torch.no_grad():
        a, _ = mk.apply_rotary(q, k, cos, sin)
    assert a.grad_fn is None
    assert_close(a, ref_rotary(q, cos, sin, False), torch.float32, "no-grad q")
    e_q, e_k = mk.apply_rotary(q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0])
    assert e_q.shape == (1, 2, 0, 8) and e_k.shape == (1, 1, 0, 8)


def test_errors_name_the_shapes():
    q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match=r"rotary_dim 10 .* head_dim 8"):
        mk.apply_rotary(q, k, torch.zeros(1, 3, 10), torch.zeros(1, 3, 10))
    with pytest.raises(ValueError, match=r"rotary_dim 5"):
        mk.apply_rotary(q, k, torch.zeros(1, 3, 5), torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match=r"cos/sin \(1, 4, 8\) do not match q \(1, 2, 3, 8\)"):
        mk.apply_rotary(q, k, torch.zeros(1, 4, 8), torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match=r"differ in batch"):
        mk.apply_rotary(q, torch.zeros(1, 1, 3, 6), torch.zeros(1, 3, 6), torch.zeros(1, 3, 6))
    with pytest.raises(ValueError, match="cos/sin require grad"):
        mk.apply_rotary(q, k, torch.zeros(1, 3, 8, requires_grad=True), torch.zeros(1, 3, 8))


def test_flop_counter_and_custom_op_path(gen):
    b, hq, hk, t, d, r = 2, 3, 1, 5, 12, 8
    q = torch.randn(b, hq, t, d, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(b, hk, t, d, generator=gen).to(DEVICE).requires_grad_()
    cos, sin = angles(b, t, r, gen, torch.float32)
    with FlopCounterMode(display=False) as fc:  # a dispatch mode: the custom op path
        qe, ke = mk.apply_rotary(q, k, cos, sin)
        (qe.sum() + 2 * ke.sum()).backward()
    # 3 FLOPs (two multiplies, one add) per rotated element of q and k: b * t * (hq + hk) * r of them, both ways
    per_pass = 3 * b * t * (hq + hk) * r
    counts = {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}
    assert counts == {"mfuwatch.rotary": per_pass, "mfuwatch.rotary_backward": per_pass}
    assert_close(qe, ref_rotary(q, cos, sin, False), torch.float32, "custom-op q")
    q64 = q.detach().double().requires_grad_()
    ref_rotary(q64, cos, sin, False).sum().backward()
    assert_close(q.grad, q64.grad, torch.float32, "custom-op dq")


def test_mixed_dtypes_promote_and_a_strided_head_dim(gen):
    # bf16 q, k with fp32 cos/sin give fp32 results (as q * cos would); a head dim with stride 2 is read in place
    wide = torch.randn(2, 3, 5, 24, generator=gen).to(torch.bfloat16).to(DEVICE).requires_grad_()
    q = wide[..., ::2]  # (2, 3, 5, 12), stride 2 along D
    k = torch.randn(2, 1, 5, 12, generator=gen).to(torch.bfloat16).to(DEVICE).requires_grad_()
    cos, sin = angles(2, 5, 8, gen, torch.float32)
    qe, ke = mk.apply_rotary(q, k, cos, sin)
    assert qe.dtype == ke.dtype == torch.float32
    assert_close(qe, ref_rotary(q, cos, sin, False), torch.float32, "q_embed")
    assert_close(ke, ref_rotary(k, cos, sin, False), torch.float32, "k_embed")
    g = torch.randn(qe.shape, generator=gen).to(DEVICE)
    (qe * g).sum().add(ke.sum()).backward()
    assert wide.grad.dtype == torch.bfloat16 and k.grad.dtype == torch.bfloat16
    q64 = q.detach().double().requires_grad_()
    (ref_rotary(q64, cos, sin, False) * g.double()).sum().backward()
    assert_close(wide.grad[..., ::2], q64.grad, torch.bfloat16, "dq")
    assert wide.grad[..., 1::2].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_take_the_inputs_layout_whatever_layout_arrives(dtype, gen):
    """A contiguous (B, H, T, D) upstream gradient into a transposed (B, T, H, D) projection: dq comes back laid
    out as q was, so autograd hands it to the projection without a copy; its values match float64."""
    from mfuwatch.kernels._rotary_triton import dense_strides

    b, t, hq, hk, d = 2, 5, 3, 1, 8
    q = torch.randn(b, t, hq, d, generator=gen).to(dtype).to(DEVICE).requires_grad_().transpose(1, 2)
    k = torch.randn(b, t, hk, d, generator=gen).to(dtype).to(DEVICE).requires_grad_().transpose(1, 2)
    cos, sin = angles(1, t, d, gen, dtype)
    qe, ke = mk.apply_rotary(q, k, cos, sin)
    gq = torch.randn(b, hq, t, d, generator=gen).to(dtype).to(DEVICE)  # contiguous: another layout than q's
    gk = torch.randn(b, hk, t, d, generator=gen).to(dtype).to(DEVICE)
    dq, dk = torch.autograd.grad((qe, ke), (q, k), (gq, gk))
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    q64 = q.detach().double().requires_grad_()
    (ref_rotary(q64, cos, sin, False) * gq.double()).sum().backward()
    assert_close(dq, q64.grad, dtype, "dq")
    assert dense_strides((2, 3, 5, 8), (120, 8, 24, 1)) and dense_strides((2, 1, 5, 8), (40, 7, 8, 1))
    assert not dense_strides((2, 3, 5, 8), (240, 8, 48, 1))  # every other token: a gap
    assert not dense_strides((2, 3, 5, 8), (0, 8, 24, 1))  # broadcast over the batch: overlap
