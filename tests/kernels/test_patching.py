"""patch()/unpatch() on real module trees: a tiny Hugging Face Llama built from a config (no download)."""

import pytest
import torch
from torch import nn

import mfuwatch.kernels as mk
from mfuwatch.kernels import _patch_types, patching
from mfuwatch.kernels.glu import GeGLUMLP, SwiGLUMLP
from mfuwatch.kernels.layer_norm import LayerNorm
from mfuwatch.kernels.rms_norm import RMSNorm
from tests.helpers.kernel_checks import DEVICE

transformers = pytest.importorskip("transformers")


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, vocab_size=128,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(DEVICE)
    with torch.no_grad():  # norms start at ones; make them distinct so a wrong offset would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_patch_llama_keeps_loss_and_gradients_then_unpatch_restores():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    params_before = {n: p for n, p in model.named_parameters()}
    keys_before = list(model.state_dict())
    loss0, grads0 = loss_and_grads(model, ids)

    report = mk.patch(model, kernels=["rms_norm", "swiglu"])
    assert report.count("rms_norm") == 5 and report.count("swiglu") == 2
    # left: only the two attention modules, whose rotary was not asked for
    assert [(s.name, s.kernel) for s in report.left] == [(f"model.layers.{i}.self_attn", "rotary") for i in (0, 1)]
    assert all(s.reason.startswith("not requested") for s in report.left)
    assert isinstance(model.model.layers[0].input_layernorm, RMSNorm)
    assert isinstance(model.model.layers[1].mlp, SwiGLUMLP)
    assert model.model.norm.casting == "llama" and model.model.norm.offset == 0.0
    # same Parameter objects (an optimizer built before patching keeps working), same state_dict keys
    assert {n: p for n, p in model.named_parameters()}.keys() == params_before.keys()
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys_before

    loss1, grads1 = loss_and_grads(model, ids)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-5)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")

    assert mk.unpatch(model) == 7
    assert type(model.model.layers[0].input_layernorm).__name__ == "LlamaRMSNorm"
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert all(p is params_before[n] for n, p in model.named_parameters())
    loss2, _ = loss_and_grads(model, ids)
    assert torch.equal(loss2, loss0)


def test_optimizer_built_before_patch_still_trains_the_model():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mk.patch(model)
    w = model.model.norm.weight
    before = w.detach().clone()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(w.detach(), before)


def test_training_mode_dtype_and_kernel_filter():
    model = nn.Sequential(nn.LayerNorm(32), nn.RMSNorm(32, eps=1e-6), nn.Linear(32, 32)).to(DEVICE)
    model.eval()
    report = mk.patch(model, kernels=["layer_norm"])
    assert isinstance(model[0], LayerNorm) and not model[0].training
    assert isinstance(model[1], nn.RMSNorm)
    assert [(x.name, x.kernel) for x in report.left] == [("1", "rms_norm")]
    assert "not requested" in report.left[0].reason
    report = mk.patch(model)  # the already fused LayerNorm is skipped, the RMSNorm is swapped
    assert [(s.name, s.kernel) for s in report.swapped] == [("1", "rms_norm")]
    assert model[1].casting == "fp32" and model[1].eps == 1e-6  # torch.nn.RMSNorm computes in fp32
    assert "add_rms_norm has no module pattern" in report.notes[0]
    x = torch.randn(4, 32, device=DEVICE)
    ref = nn.RMSNorm(32, eps=1e-6).to(DEVICE)(nn.functional.layer_norm(x, (32,)))
    torch.testing.assert_close(model[:2](x), ref, rtol=1e-5, atol=1e-5)


def test_gemma_norm_offset_and_gelu_mlp_are_recognised():
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm

    cfg = GemmaConfig(hidden_size=32, intermediate_size=48, hidden_act="gelu_pytorch_tanh", vocab_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(3)
    block = nn.ModuleDict({"norm": GemmaRMSNorm(32, eps=1e-6), "mlp": GemmaMLP(cfg)}).to(DEVICE)
    with torch.no_grad():
        block["norm"].weight.normal_(0.0, 0.1)
    x = torch.randn(3, 32, device=DEVICE)
    ref_norm, ref_mlp = block["norm"](x), block["mlp"](x)
    report = mk.patch(block)
    assert report.count() == 2, str(report)
    assert block["norm"].offset == 1.0 and block["norm"].casting == "fp32"
    assert isinstance(block["mlp"], GeGLUMLP) and block["mlp"].approximate == "tanh"
    torch.testing.assert_close(block["norm"](x), ref_norm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block["mlp"](x), ref_mlp, rtol=1e-5, atol=1e-5)


class _OddMLP(nn.Module):
    """Has the gated-MLP attributes but computes something else: the probe must refuse it."""

    def __init__(self, act):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.down_proj = nn.Linear(24, 16, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


class _TraceStyleRMSNorm(nn.Module):
    """RMSNorm with its weight named ``w`` (as in the fixture traces' model): not swappable."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


def test_left_modules_carry_reasons():
    hooked = nn.LayerNorm(16)
    hooked.register_forward_hook(lambda m, i, o: None)
    model = nn.ModuleDict({
        "odd": _OddMLP(nn.SiLU()),
        "relu": _OddMLP(nn.ReLU()),
        "trace_norm": _TraceStyleRMSNorm(16),
        "hooked": hooked,
    }).to(DEVICE)
    report = mk.patch(model)
    assert report.swapped == []
    reasons = {x.name: x.reason for x in report.left}
    assert "probe output differs" in reasons["odd"]
    assert reasons["relu"] == "activation ReLU has no fused kernel"
    kernels = {x.name: x.kernel for x in report.left}
    assert kernels["relu"] == "swiglu or geglu" and kernels["odd"] == "swiglu"
    # asked for one GLU kernel only, the ReLU MLP is still reported with its real reason, not "not requested"
    only = {x.name: x.reason for x in mk.patch(model, kernels=["swiglu"]).left}
    assert only["relu"] == "activation ReLU has no fused kernel" and only["hooked"].startswith("not requested")
    assert reasons["trace_norm"] == "no 1-D `weight` parameter"
    assert "hooks" in reasons["hooked"]
    assert "left" in str(report) and "odd" in str(report)


def test_cpu_modules_are_left_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(_patch_types, "INTERPRET", False)  # what device_reason reads
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    report = mk.patch(model)
    assert report.swapped == [] and "need a CUDA device" in report.left[0].reason


def test_root_module_and_unknown_kernel_names():
    root = nn.LayerNorm(8).to(DEVICE)
    assert mk.patch(root).left[0].reason.startswith("it is the model itself")
    with pytest.raises(ValueError, match=r"unknown kernel 'rmsnorm' \(did you mean 'rms_norm'\?\); accepted: "
                                         r"rms_norm, layer_norm, add_rms_norm, swiglu, geglu"):
        mk.patch(root, kernels=["rmsnorm"])


@pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="torch without nn.RMSNorm")
def test_norms_without_affine_parameters_are_swapped_and_match(gen):
    model = nn.Sequential(nn.LayerNorm(24, elementwise_affine=False), nn.Linear(24, 24),
                          nn.RMSNorm(24, eps=1e-6, elementwise_affine=False)).to(DEVICE)
    x = torch.randn(5, 24, generator=gen).to(DEVICE)
    # independent float64 reference of the unpatched model
    x64 = x.double()
    h = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    h = h @ model[1].weight.double().t() + model[1].bias.double()
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    report = mk.patch(model)
    assert [(s.name, s.kernel) for s in report.swapped] == [("0", "layer_norm"), ("2", "rms_norm")]
    assert isinstance(model[0], LayerNorm) and isinstance(model[2], RMSNorm)
    assert list(model[0].parameters()) == [] and list(model[2].parameters()) == []
    out = model(x)
    assert torch.allclose(out.double().cpu(), ref.cpu(), atol=1e-4, rtol=1e-4)
    assert mk.unpatch(model) == 2 and type(model[0]) is nn.LayerNorm and type(model[2]) is nn.RMSNorm


def test_norms_without_affine_parameters_are_left_without_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(patching, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = mk.patch(nn.Sequential(nn.LayerNorm(8, elementwise_affine=False)))
    assert report.swapped == [] and "no CUDA device here" in report.left[0].reason


class _GatedMLP(_OddMLP):
    """A plain SwiGLU MLP."""

    def __init__(self):
        super().__init__(nn.SiLU())

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _DropoutMLP(_OddMLP):
    """A gated MLP with a dropout child: in eval mode its output equals the fused MLP's."""

    def __init__(self):
        super().__init__(nn.SiLU())
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class _DropoutRMSNorm(nn.Module):
    """An RMSNorm whose forward applies dropout in training mode (no extra parameters or buffers)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        x = nn.functional.dropout(x, 0.5, self.training)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_mlp_with_extra_submodules_is_left_even_in_eval_mode():
    model = nn.Sequential(_DropoutMLP()).to(DEVICE).eval()
    report = mk.patch(model)
    assert report.swapped == [] and report.left[0].reason == "it has submodules the fused MLP would drop: dropout"
    model.train()
    x = torch.randn(4, 16).to(DEVICE)
    assert not torch.equal(model(x), model(x))  # the dropout is still there


def test_hooks_on_a_submodule_leave_the_module_and_the_probe_does_not_fire_them():
    assert [x.kernel for x in mk.patch(nn.Sequential(_GatedMLP()).to(DEVICE)).swapped] == ["swiglu"]
    calls = []
    for sub in ("act_fn", "gate_proj"):
        mlp = _GatedMLP()
        getattr(mlp, sub).register_forward_hook(lambda m, i, o, sub=sub: calls.append(sub))
        report = mk.patch(nn.Sequential(mlp).to(DEVICE))
        assert report.swapped == []
        assert report.left[0].reason == ("it has forward/backward hooks that the replacement would not carry "
                                         f"(on its submodule {sub})")
    assert calls == []  # the probe never ran the hooked modules


def test_probe_leaves_the_global_rng_alone():
    model = nn.Sequential(_DropoutRMSNorm(16)).to(DEVICE).train()
    state = torch.get_rng_state()
    report = mk.patch(model)
    assert report.swapped == [] and "probe output differs" in report.left[0].reason  # dropout changed it
    assert torch.equal(torch.get_rng_state(), state)


class _DropoutGatedMLP(nn.Module):
    """A Llama-style gated MLP: ``down(act(gate(x)) * up(x))``, with an optional functional or module dropout."""

    def __init__(self, act, functional_dropout=0.0, dropout_module=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.down_proj = nn.Linear(24, 16, bias=False)
        self.act_fn = act
        self.p = functional_dropout
        if dropout_module:
            self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        h = torch.nn.functional.dropout(h, self.p, self.training)
        if hasattr(self, "dropout"):
            h = self.dropout(h)
        return self.down_proj(h)


def test_activation_functions_blockers_and_functional_dropout():
    """F.silu / F.gelu as plain functions are recognised; an activation without a kernel is the reported reason
    even when a dropout submodule is there too; a dropout written in forward (invisible in eval mode) blocks the
    swap instead of being lost after .train()."""
    quick = type("QuickGELUActivation", (nn.Module,), {"forward": lambda self, x: x * torch.sigmoid(1.702 * x)})
    model = nn.ModuleDict({
        "silu_fn": _DropoutGatedMLP(torch.nn.functional.silu),
        "gelu_fn": _DropoutGatedMLP(torch.nn.functional.gelu),
        "quick_drop": _DropoutGatedMLP(quick(), dropout_module=True),
        "relu_drop": _DropoutGatedMLP(nn.ReLU(), dropout_module=True),
        "silu_drop": _DropoutGatedMLP(nn.SiLU(), dropout_module=True),
        "functional_drop": _DropoutGatedMLP(nn.SiLU(), functional_dropout=0.5),
    }).to(DEVICE).eval()
    x = torch.randn(3, 16).to(DEVICE)
    want = {k: m(x) for k, m in model.items()}
    report = mk.patch(model)
    swapped = {s.name: s.kernel for s in report.swapped}
    left = {x_.name: (x_.kernel, x_.reason) for x_ in report.left}
    assert swapped == {"silu_fn": "swiglu", "gelu_fn": "geglu"}
    for k in ("silu_fn", "gelu_fn"):
        assert torch.allclose(model[k](x), want[k], atol=1e-5, rtol=1e-5)
    assert left["quick_drop"] == ("swiglu or geglu", "activation QuickGELUActivation has no fused kernel")
    assert left["relu_drop"] == ("swiglu or geglu", "activation ReLU has no fused kernel")
    assert left["silu_drop"] == ("swiglu", "it has submodules the fused MLP would drop: dropout")
    assert left["functional_drop"][0] == "swiglu" and "random in training mode" in left["functional_drop"][1]
    assert not model["functional_drop"].training, "the probe restored eval mode"
    model.train()
    assert not torch.equal(model["functional_drop"](x), model["functional_drop"](x)), "dropout kept"
