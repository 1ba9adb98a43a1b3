"""The fused ops inside torch.compile (one graph, no break) and under FlopCounterMode (counted)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mfuwatch.kernels as mk
from mfuwatch.kernels import _dispatch
from tests.helpers.kernel_checks import DEVICE

# Import the ops before any FlopCounterMode is built: the mode copies the formula registry
# when it is constructed.
OPS = (mk.rms_norm, mk.layer_norm, mk.add_rms_norm, mk.swiglu, mk.geglu)


def all_ops(x, res, w, b, gate, up):
    y1 = mk.rms_norm(x, w)
    y2, h = mk.add_rms_norm(x, res, w)
    y3 = mk.layer_norm(h, (x.shape[-1],), w, b)
    y4 = mk.swiglu(gate, up) + mk.geglu(gate, up, approximate="tanh")
    return y1.sum() + y2.sum() + 0.5 * h.sum() + (y3 * y3).sum() + y4.sum()


def inputs(gen):
    shapes = [(3, 16), (3, 16), (16,), (16,), (3, 8), (3, 8)]
    return [torch.randn(s, generator=gen).to(DEVICE).requires_grad_() for s in shapes]


def grads_of(fn, leaves):
    for t in leaves:
        t.grad = None
    out = fn(*leaves)
    out.backward()
    return out.detach(), [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_compile_matches_eager(backend, gen):
    # fullgraph=True raises on any graph break; aot_eager also traces the backward (AOTAutograd)
    leaves = inputs(gen)
    torch._dynamo.reset()
    compiled = torch.compile(all_ops, backend=backend, fullgraph=True)
    out_c, grads_c = grads_of(compiled, leaves)
    out_e, grads_e = grads_of(all_ops, leaves)
    # both are fp32 math, summed in different orders (the decomposition vs the kernels): they agree to a few
    # ulps of the largest term (2e-6 of it: 16 ulps), not element for element to 1e-6 (2 of 40 random seeds
    # differed by 4-8e-6 on gradients of magnitude 20); a wrong formula is off by far more
    assert torch.allclose(out_c, out_e, rtol=1e-6, atol=2e-6 * float(out_e.abs()) + 1e-6)
    for a, b in zip(grads_c, grads_e):
        assert torch.allclose(a, b, rtol=1e-6, atol=2e-6 * float(b.abs().max()) + 1e-6), float((a - b).abs().max())


def test_compiled_graph_holds_the_custom_ops_when_decomposition_is_off(gen, monkeypatch):
    monkeypatch.setattr(_dispatch, "COMPILE_DECOMPOSE", False)  # MFUWATCH_KERNELS_COMPILE_DECOMPOSE=0
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(all_ops, backend=backend, fullgraph=True)(*inputs(gen))
    for op in ("mfuwatch.rms_norm", "mfuwatch.add_rms_norm", "mfuwatch.layer_norm", "mfuwatch.swiglu",
               "mfuwatch.geglu"):
        assert any(op in s for s in seen), f"{op} not in the compiled graph: {seen}"


def graph_recorder(seen):
    """An aot_eager-like backend that records the call targets of the forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def rotary_too(x, res, w, b, gate, up):
    q = x.view(1, 3, 2, 8).transpose(1, 2)  # (B, H, T, D) from a (B, T, H, D) projection
    cos, sin = res.detach()[None, :, :8].cos(), res.detach()[None, :, :8].sin()
    qe, ke = mk.apply_rotary(q, q[:, :1], cos, sin)
    return all_ops(x, res, w, b, gate, up) + (qe * qe).sum() + ke.sum()


def test_compiled_graph_gets_the_plain_decomposition(gen):
    # Inductor fuses norms, GLUs and rotary itself: under torch.compile they reach it as PyTorch ops (no
    # custom op in the forward or backward graph), computing what the kernels compute
    leaves = inputs(gen)
    seen = []
    torch._dynamo.reset()
    compiled = torch.compile(rotary_too, backend=graph_recorder(seen), fullgraph=True)
    out_c, grads_c = grads_of(compiled, leaves)
    out_e, grads_e = grads_of(rotary_too, leaves)  # eager: the Triton kernels (interpreter)
    assert seen and not any("mfuwatch" in s for s in seen), [s for s in seen if "mfuwatch" in s]
    assert torch.allclose(out_c, out_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_c, grads_e):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_patched_llama_has_no_custom_op_and_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=48, vocab_size=64,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEVICE)
    # the ops Inductor fuses itself; linear_cross_entropy stays a custom op under compile by design
    # (its point is memory), so it is left out here
    report = mk.patch(model, kernels=["rms_norm", "swiglu", "rotary"])
    assert {s.kernel for s in report.swapped} == {"rms_norm", "swiglu", "rotary"}, str(report)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def step(m):
        model.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    seen = []
    torch._dynamo.reset()
    loss_c, grads_c = step(torch.compile(model, backend=graph_recorder(seen)))
    loss_e, grads_e = step(model)
    assert seen and not any("mfuwatch" in s for s in seen), [s for s in seen if "mfuwatch" in s]
    assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_flop_counter_counts_each_op_by_hand():
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        mk.rms_norm(x, w).sum().backward()
    # 48 elements; forward 4 FLOPs each (square, sum, *rstd, *w) = 192; backward 9 each = 432
    assert fc.get_total_flops() == 192 + 432
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    assert counts == {"mfuwatch.rms_norm": 192, "mfuwatch.rms_norm_backward": 432}

    gate = torch.randn(2, 5, device=DEVICE, requires_grad=True)
    up = torch.randn(2, 5, device=DEVICE, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        mk.swiglu(gate, up).sum().backward()
    # 10 elements: forward 5 each (exp, add, divide, *g, *u), backward 11 each
    assert fc.get_total_flops() == 50 + 110

    with FlopCounterMode(display=False) as fc:
        mk.layer_norm(x, 16).sum().backward()  # no weight, no bias: 5 forward, 9 backward per element
    assert fc.get_total_flops() == 48 * 5 + 48 * 9


@pytest.mark.parametrize("name", ["add_rms_norm", "layer_norm", "geglu_none", "geglu_tanh"])
def test_flop_counter_uses_the_documented_table(name, gen):
    x, res, w, b, gate, up = inputs(gen)
    n = x.numel()
    with FlopCounterMode(display=False) as fc:
        if name == "add_rms_norm":
            y, h = mk.add_rms_norm(x, res, w)
            (y.sum() + h.sum()).backward()
            # rms_norm's 4 + the residual add forward; 9 + 1 backward (the new residual has a gradient)
            expected = n * 5 + n * 10
        elif name == "layer_norm":
            mk.layer_norm(x, 16, w, b).sum().backward()
            expected = n * 7 + n * 13  # with weight and bias (derivation beside layer_norm's FACTS)
        else:
            kind = name.split("_")[1]
            mk.geglu(gate, up, approximate=kind).sum().backward()
            expected = gate.numel() * ((6 + 14) if kind == "none" else (10 + 23))  # erf GELU; tanh GELU
    assert fc.get_total_flops() == expected


def test_modules_compile_fullgraph_including_the_residual_form(gen):
    norm = mk.RMSNorm(16, eps=1e-6).to(DEVICE)
    ln = mk.LayerNorm(16).to(DEVICE)
    mlp = mk.SwiGLUMLP(16, 24).to(DEVICE)

    def block(x, r):
        y, h = norm(x, r)
        return (mlp(ln(y)) + h).sum()

    x, r = (torch.randn(2, 3, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out_c, grads_c = grads_of(compiled, [x, r])
    out_e, grads_e = grads_of(block, [x, r])
    # a few ulps of the largest term, as in test_fullgraph_compile_matches_eager
    assert torch.allclose(out_c, out_e, rtol=1e-6, atol=2e-6 * float(out_e.abs()) + 1e-6)
    for a, b in zip(grads_c, grads_e):
        assert torch.allclose(a, b, rtol=1e-6, atol=2e-6 * float(b.abs().max()) + 1e-6), float((a - b).abs().max())


def test_ops_first_used_inside_an_open_flop_counter_are_counted():
    """The op modules load on first use; their formulas must reach a counter that is already open.

    A fresh interpreter, so that the ops are really imported inside the counter. Hand counts from
    the formulas the ops register (their FACTS): rms_norm 4 + 9 and layer_norm (weight and bias)
    7 + 13 FLOPs per element, forward + backward, of a 3 x 40 input.
    """
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from torch.utils.flop_counter import FlopCounterMode
        import mfuwatch.kernels as mk
        x = torch.randn(3, 40, requires_grad=True)
        w = torch.randn(40, requires_grad=True)
        with FlopCounterMode(display=False) as fc:
            mk.rms_norm(x, w).sum().backward()
            first = fc.get_total_flops()
            mk.layer_norm(x, (40,), w, w).sum().backward()
        print(first, fc.get_total_flops())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, total = map(int, proc.stdout.split()[-2:])
    assert first == 120 * (4 + 9)
    assert total == first + 120 * (7 + 13)


@pytest.mark.parametrize("loss", ["square", "sum"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm", "swiglu"])
def test_double_backward_says_so(op, loss):
    """Differentiating a gradient of a fused op raises, also when the incoming gradient is a constant
    (``y.sum()``: ones), where torch's ``once_differentiable`` returned a gradient that silently counted
    as a constant in the second backward."""
    import mfuwatch.kernels as mk

    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(8, device=DEVICE, requires_grad=True)
    out = {"rms_norm": lambda: mk.rms_norm(x, w), "layer_norm": lambda: mk.layer_norm(x, (8,), w),
           "add_rms_norm": lambda: mk.add_rms_norm(x, x * 2, w)[0], "swiglu": lambda: mk.swiglu(x, x * 3)}[op]()
    (g,) = torch.autograd.grad(out.pow(2).sum() if loss == "square" else out.sum(), x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.pow(2).sum() + g.pow(2).sum()).backward()


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm", "swiglu"])
def test_double_backward_to_chosen_inputs_says_so(op):
    """A second ``autograd.grad(..., inputs=[x])`` runs only the nodes on a path to ``x``: the error node
    must be on one, or the op's second-order term is silently dropped (the result read 2x, the
    gradient of the ``x ** 2`` term alone, with torch's ``once_differentiable`` wiring)."""
    import mfuwatch.kernels as mk

    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(8, device=DEVICE, requires_grad=True)
    c = torch.randn(3, 8, device=DEVICE)
    out = {"rms_norm": lambda: mk.rms_norm(x, w), "layer_norm": lambda: mk.layer_norm(x, (8,), w),
           "add_rms_norm": lambda: mk.add_rms_norm(x, torch.randn_like(x), w)[0],
           "swiglu": lambda: mk.swiglu(x, x * 3)}[op]()
    (g,) = torch.autograd.grad((out * c).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(g.pow(2).sum() + x.pow(2).sum(), [x])
    if op != "swiglu":  # the weight: a second-order path through the op, asked for by backward(inputs=...)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            (g.pow(2).sum()).backward(inputs=[w])


def test_first_order_gradient_under_create_graph_is_unchanged():
    """create_graph=True without a second backward gives the same first-order gradient as a plain backward."""
    import mfuwatch.kernels as mk

    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(8, device=DEVICE, requires_grad=True)
    (g1,) = torch.autograd.grad(mk.rms_norm(x, w).sum(), x, create_graph=True)
    (g0,) = torch.autograd.grad(mk.rms_norm(x, w).sum(), x)
    assert torch.equal(g1.detach(), g0)


def test_compiled_patched_rotary_is_the_models_own_graph():
    """Under torch.compile the wired rotary calls the model's own apply_rotary_pos_emb, so Inductor gets the
    graph it gets unpatched: the forward and backward graphs' call targets are identical, in order."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=48, vocab_size=64,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    graphs = []
    for patched in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(DEVICE)
        if patched:
            report = mk.patch(model, kernels=["rotary"])
            assert [s.kernel for s in report.swapped] == ["rotary"], str(report)
        seen = []
        torch._dynamo.reset()
        torch.compile(model, backend=graph_recorder(seen))(input_ids=ids, labels=ids).loss.backward()
        graphs.append(seen)
    assert graphs[0] and graphs[0] == graphs[1]
