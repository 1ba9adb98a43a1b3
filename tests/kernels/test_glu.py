"""SwiGLU / GeGLU kernels and the gated MLP modules against float64 references."""

import math

import pytest
import torch

from mfuwatch.kernels import glu
from mfuwatch.kernels.glu import GeGLUMLP, SwiGLUMLP, geglu, swiglu
from tests.helpers.kernel_checks import DEVICE, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The interpreter evaluates sigmoid's exp in numpy, which warns where it overflows to inf
# (large |gate|); the result (sigmoid = 0 or 1) is the correct limit and is checked below.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def ref_act(g, kind):
    """float64 activations written from their definitions (not torch's implementations)."""
    g = g.double()
    if kind == "silu":
        return g / (1.0 + torch.exp(-g))
    if kind == "none":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


def fused(kind, gate, up):
    return swiglu(gate, up) if kind == "silu" else geglu(gate, up, approximate=kind)


def assert_matches_float64(kind, gate, up, dtype, gen):
    gate, up = gate.to(DEVICE).detach().requires_grad_(), up.to(DEVICE).detach().requires_grad_()
    y = fused(kind, gate, up)
    assert y.shape == gate.shape and y.dtype == dtype
    dy = torch.randn(y.shape, generator=gen).to(dtype).to(DEVICE)
    y.backward(dy)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    yr = ref_act(g64, kind) * u64
    yr.backward(dy.double())
    assert_close(y, yr, dtype, "y")
    assert_close(gate.grad, g64.grad, dtype, "dgate")
    assert_close(up.grad, u64.grad, dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["silu", "none", "tanh"])
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (5, 17), (2, 5120), (2, 3, 40)], ids=str)
def test_forward_backward_match_float64(shape, kind, dtype, gen):
    gate = (3.0 * torch.randn(*shape, generator=gen)).to(dtype)  # wide range: both tails of the activation
    up = torch.randn(*shape, generator=gen).to(dtype)
    assert_matches_float64(kind, gate, up, dtype, gen)


@pytest.mark.parametrize("kind", ["silu", "tanh"])
def test_strided_halves_of_a_fused_projection(kind, gen):
    # gate and up as the two halves of one (rows, 2N) projection: row stride 2N, read in place
    h = torch.randn(7, 2 * 48, generator=gen)
    gate, up = h.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    assert_matches_float64(kind, gate, up, torch.float32, gen)
    # and a transposed gate (last-dim stride != 1) is copied, not misread
    assert_matches_float64(kind, torch.randn(48, 7, generator=gen).t(), torch.randn(7, 48, generator=gen),
                  torch.float32, gen)


def test_large_magnitudes_stay_finite(gen):
    gate = torch.tensor([[-80.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 80.0, 300.0]]).to(torch.bfloat16)
    up = torch.ones_like(gate)
    for kind in ("silu", "none", "tanh"):
        assert_matches_float64(kind, gate, up, torch.bfloat16, gen)


def test_custom_op_path_equals_fast_path(monkeypatch, gen):
    gate, up, dy = (torch.randn(3, 40, generator=gen, dtype=torch.bfloat16).to(DEVICE) for _ in range(3))
    for kind in ("silu", "tanh"):
        results = []
        for forced in (False, True):
            monkeypatch.setattr(glu, "use_custom_op", lambda *t, f=forced: f)
            g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
            y = fused(kind, g, u)
            y.backward(dy)
            results.append((y, g.grad, u.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b)


def test_input_errors_name_both_values():
    a = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"gate shape \(2, 8\) != up shape \(2, 9\)"):
        swiglu(a, torch.randn(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="gate dtype torch.float32 != up dtype torch.bfloat16"):
        swiglu(a, a.to(torch.bfloat16))
    with pytest.raises(ValueError, match="approximate='fast'"):
        geglu(a, a, approximate="fast")


@pytest.mark.parametrize("cls, kind", [(SwiGLUMLP, "silu"), (GeGLUMLP, "tanh")])
def test_mlp_modules_match_reference(cls, kind, gen):
    kwargs = {"approximate": "tanh"} if cls is GeGLUMLP else {}
    m = cls(24, 40, **kwargs)
    assert [k for k in m.state_dict()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert m.gate_proj.weight.shape == (40, 24) and m.down_proj.weight.shape == (24, 40)
    m = m.to(DEVICE)
    x = torch.randn(2, 3, 24, generator=gen).to(DEVICE)
    y = m(x)
    w = {k: v.detach().double() for k, v in m.state_dict().items()}
    x64 = x.double()
    ref = (ref_act(x64 @ w["gate_proj.weight"].T, kind) * (x64 @ w["up_proj.weight"].T)) @ w["down_proj.weight"].T
    assert_close(y, ref, torch.float32, "mlp", scale=10.0)  # three fp32 matmuls besides the fused op
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    assert list(cls(24, 40, bias=True, **kwargs).state_dict())[1] == "gate_proj.bias"


def _mlp_float64(m, x, kind):
    """The MLP in float64 autograd from the definitions: (y, {name: grad}, x's grad)."""
    w = {k: v.detach().double().requires_grad_() for k, v in m.named_parameters()}
    x64 = x.detach().double().requires_grad_()

    def lin(name, t):
        out = t @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    y = lin("down_proj", ref_act(lin("gate_proj", x64), kind) * lin("up_proj", x64))
    return y, w, x64


def _count_activations(shapes, n, tokens):
    """How many of ``shapes`` are (tokens, n) activations (any leading shape; weights, kept as they are or
    transposed, have other sizes)."""
    return sum(1 for s in shapes if s and s[-1] == n and math.prod(s) == tokens * n)


def _saved_with_last_dim(fn, n, tokens):
    """How many (tokens, n) activations autograd saves during ``fn()``, and fn's output."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return _count_activations(shapes, n, tokens), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cls, kind", [(SwiGLUMLP, "silu"), (GeGLUMLP, "none")])
def test_fused_down_projection_matches_float64_forward_and_backward(cls, kind, dtype, gen):
    """GLUDownFunction (the patched MLP's default in eager training): output and every gradient (x, the three
    weights, the biases) against the float64 MLP; odd sizes, a bias, a non-contiguous input."""
    torch.manual_seed(0)
    m = cls(24, 37, bias=True).to(DEVICE, dtype)
    x = torch.randn(3, 24, 5, generator=gen).transpose(1, 2).to(DEVICE, dtype).requires_grad_()  # (3, 5, 24)
    assert not x.is_contiguous() and glu._fused_down_ok(m.down_proj, m.gate_proj(x), m.up_proj(x))
    y = m(x)
    dy = torch.randn(y.shape, generator=gen).to(DEVICE, dtype)
    y.backward(dy)
    yr, w, x64 = _mlp_float64(m, x, kind)
    yr.backward(dy.double())
    scale = 10.0  # three matmuls besides the fused op, each rounding in dtype
    assert_close(y, yr, dtype, "y", scale=scale)
    assert_close(x.grad, x64.grad, dtype, "dx", scale=scale)
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype, name
        assert_close(p.grad, w[name].grad, dtype, name, scale=scale)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU autocast; the GPU runs the same comparison in the benchmarks")
@pytest.mark.parametrize("bias", [False, True])
def test_fused_down_projection_is_bit_identical_to_the_unfused_mlp_under_autocast(monkeypatch, bias, gen):
    """fp32 master weights under bf16 autocast (as the end-to-end training runs): the fused form computes the
    same ops on the same values, so output and gradients (the biases' too) equal the unfused MLP's bit for bit,
    while autograd keeps one (tokens, intermediate) tensor fewer (the down projection's input)."""
    m = SwiGLUMLP(32, 48, bias=bias).to(DEVICE)
    x = torch.randn(2, 7, 32, generator=gen).to(DEVICE).requires_grad_()

    def run(fused):
        monkeypatch.setattr(glu, "RECOMPUTE_DOWN_INPUT", fused)
        m.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept, y = _saved_with_last_dim(lambda: m(x), 48, 14)
        y.float().square().sum().backward()
        return kept, y.detach(), x.grad.clone(), [p.grad.clone() for p in m.parameters()]

    k1, y1, dx1, g1 = run(True)
    k0, y0, dx0, g0 = run(False)
    assert (k0, k1) == (3, 2)  # unfused: gate, up and h = silu(gate) * up; fused: gate and up
    assert y1.dtype == torch.bfloat16 and torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(g1, g0))


def test_fused_down_projection_steps_aside_for_hooks_subclasses_and_frozen_inputs(gen):
    """Where the fused form could change what runs, the MLP calls down_proj as written."""
    m = SwiGLUMLP(16, 24).to(DEVICE)
    x = torch.randn(4, 16, generator=gen).to(DEVICE)
    g, u = m.gate_proj(x), m.up_proj(x)
    assert glu._fused_down_ok(m.down_proj, g, u)
    seen = []
    h = m.down_proj.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    assert not glu._fused_down_ok(m.down_proj, g, u)
    kept, _ = _saved_with_last_dim(lambda: m(x), 24, 4)
    assert seen == [(4, 24)] and kept == 3  # the hook saw h; h was kept
    h.remove()

    class LoRALike(torch.nn.Linear):
        pass

    sub = LoRALike(24, 16).to(DEVICE)
    assert not glu._fused_down_ok(sub, g, u)
    with torch.no_grad():
        assert not glu._fused_down_ok(m.down_proj, m.gate_proj(x), m.up_proj(x))
    for p in m.parameters():
        p.requires_grad_(False)
    assert not glu._fused_down_ok(m.down_proj, m.gate_proj(x), m.up_proj(x))  # nothing to differentiate


def _compiled_saves_with_last_dim(fn, n, tokens):
    """Compile ``fn`` (fullgraph) with AOTAutograd and the min-cut partitioner Inductor uses, run it once, and
    return (how many (tokens, n) tensors the forward graph hands to the backward, fn's output)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kept = []

    def fw(gm, example_inputs):
        out = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        vals = [a.meta.get("val") for a in out if isinstance(a, torch.fx.Node)]
        kept.append(_count_activations([tuple(v.shape) for v in vals if isinstance(v, torch.Tensor)], n, tokens))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, ex: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)()
    assert len(kept) == 1
    return kept[0], out


@pytest.mark.parametrize("decompose", [True, False], ids=["pytorch-ops", "custom-ops"])
@pytest.mark.parametrize("cls, kind", [(SwiGLUMLP, "silu"), (GeGLUMLP, "tanh")])
def test_compiled_mlp_forms_the_down_projections_input_again_in_the_backward(monkeypatch, cls, kind, decompose,
                                                                              gen):
    """Under torch.compile the activation is a checkpointed region: the partitioner keeps gate and up for the
    backward, not h = act(gate) * up (without the region it keeps all three, as for Hugging Face's MLP), and
    output and gradients match the float64 MLP; with the activation written out in PyTorch ops (the default)
    and as the custom op (MFUWATCH_KERNELS_COMPILE_DECOMPOSE=0)."""
    from mfuwatch.kernels import _dispatch

    monkeypatch.setattr(_dispatch, "COMPILE_DECOMPOSE", decompose)
    torch.manual_seed(0)
    m = (cls(16, 40, bias=True) if cls is SwiGLUMLP else cls(16, 40, bias=True, approximate="tanh")).to(DEVICE)
    x = torch.randn(2, 5, 16, generator=gen).to(DEVICE).requires_grad_()

    def run(recompute):
        monkeypatch.setattr(glu, "RECOMPUTE_DOWN_INPUT", recompute)
        m.zero_grad(set_to_none=True)
        x.grad = None
        kept, y = _compiled_saves_with_last_dim(lambda: m(x), 40, 10)
        dy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view(y.shape)
        y.backward(dy)
        return kept, y.detach(), dy

    k0, _, _ = run(False)
    k1, y, dy = run(True)
    assert (k0, k1) == (3, 2)
    yr, w, x64 = _mlp_float64(m, x, kind)
    yr.backward(dy.double())
    assert_close(y, yr, torch.float32, "y", scale=10.0)
    assert_close(x.grad, x64.grad, torch.float32, "dx", scale=10.0)
    for name, p in m.named_parameters():
        assert_close(p.grad, w[name].grad, torch.float32, name, scale=10.0)


def test_fused_down_projection_steps_aside_for_a_replaced_forward(monkeypatch, gen):
    """A down_proj whose forward was replaced, on the instance (as accelerate's add_hook_to_module does) or on
    nn.Linear itself, is called: the MLP's output is what that forward returns."""
    import functools

    m = SwiGLUMLP(16, 40).to(DEVICE)
    x = torch.randn(5, 16, generator=gen).to(DEVICE).requires_grad_()
    plain = m.down_proj(swiglu(m.gate_proj(x), m.up_proj(x))).detach()
    original = m.down_proj.forward

    def doubled(mod, inp):
        return 2 * original(inp)

    m.down_proj.forward = functools.partial(doubled, m.down_proj)
    assert not glu._fused_down_ok(m.down_proj, m.gate_proj(x), m.up_proj(x))
    assert torch.equal(m(x).detach(), 2 * plain)
    del m.down_proj.forward
    assert glu._fused_down_ok(m.down_proj, m.gate_proj(x), m.up_proj(x))
    linear_forward = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda mod, inp: 3 * linear_forward(mod, inp))
    assert not glu._fused_down_ok(m.down_proj, m.gate_proj(x), m.up_proj(x))
    monkeypatch.undo()
    assert torch.equal(m(x).detach(), plain)  # unpatched again: the fused form, the same output


@pytest.mark.parametrize("hidden, inter", [(0, 8), (8, 0)])
def test_fused_down_projection_with_an_empty_hidden_or_intermediate_size(monkeypatch, hidden, inter, gen):
    """A 0 hidden or intermediate size: the output and every gradient are those of the unfused MLP (empty, or
    zeros where the sum over the empty size is empty), no error."""
    torch.manual_seed(0)
    m = SwiGLUMLP(hidden, inter, bias=True).to(DEVICE)
    x = torch.randn(3, 4, hidden, generator=gen).to(DEVICE).requires_grad_()
    assert glu._fused_down_ok(m.down_proj, m.gate_proj(x), m.up_proj(x))

    def run(fused):
        monkeypatch.setattr(glu, "RECOMPUTE_DOWN_INPUT", fused)
        m.zero_grad(set_to_none=True)
        x.grad = None
        y = m(x)
        (y * torch.arange(y.numel(), dtype=y.dtype, device=y.device).view(y.shape)).sum().backward()
        return y.detach(), x.grad, [p.grad for p in m.parameters()]

    y1, dx1, g1 = run(True)
    y0, dx0, g0 = run(False)
    assert y1.shape == (3, 4, hidden) and torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert all(a.shape == p.shape and torch.equal(a, b) for a, b, p in zip(g1, g0, m.parameters()))
    if inter == 0:  # y is the down projection's bias alone: its gradient is the upstream one summed over rows
        assert torch.equal(m.down_proj.bias.grad, torch.arange(12 * hidden, dtype=torch.float32).view(12, hidden)
                           .sum(0).to(DEVICE))


def test_glu_backward_can_also_return_the_forward_output(gen):
    """glu_bwd(..., want_y=True)'s third output is glu_fwd's, bit for bit; the gradients are unchanged."""
    from mfuwatch.kernels import _glu_triton as K

    g = torch.randn(5, 33, generator=gen).to(DEVICE, torch.bfloat16)
    u = torch.randn(5, 33, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(5, 33, generator=gen).to(DEVICE, torch.bfloat16)
    for act in ("silu", "gelu", "gelu_tanh"):
        dg, du, y = K.glu_bwd(dy, g, u, act, want_y=True)
        dg0, du0 = K.glu_bwd(dy, g, u, act)
        assert torch.equal(y, K.glu_fwd(g, u, act)) and torch.equal(dg, dg0) and torch.equal(du, du0)
