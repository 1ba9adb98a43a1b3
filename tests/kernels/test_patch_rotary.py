"""patch(kernels=["rotary"]) on small Hugging Face models of each family: same outputs and gradients, this
instance only, unpatch restores."""

import copy
import importlib

import pytest
import torch

import mfuwatch.kernels as mk
from tests.helpers.kernel_checks import DEVICE

transformers = pytest.importorskip("transformers")
hf_rotary = importlib.import_module("mfuwatch.kernels._hf_rotary")

COMMON = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, vocab_size=96, num_attention_heads=4,
              max_position_embeddings=64)


def build(family):
    """A tiny model of one family (no download) and the number of attention modules it has."""
    t = transformers
    if family == "llama":
        cfg, cls = t.LlamaConfig(**COMMON, num_key_value_heads=2), t.LlamaForCausalLM
    elif family == "mistral":
        cfg, cls = t.MistralConfig(**COMMON, num_key_value_heads=1), t.MistralForCausalLM
    elif family == "qwen2":
        cfg, cls = t.Qwen2Config(**COMMON, num_key_value_heads=2), t.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = t.Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=8), t.Qwen3ForCausalLM
    elif family == "gemma2":
        cfg, cls = t.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=8), t.Gemma2ForCausalLM
    elif family == "gemma3":
        cfg, cls = t.Gemma3TextConfig(**COMMON, num_key_value_heads=1, head_dim=8), t.Gemma3ForCausalLM
    elif family == "phi3":  # partial rotary: 6 of the 8 head dims rotated
        cfg = t.Phi3Config(**COMMON, num_key_value_heads=2, pad_token_id=0)
        cfg.rope_parameters = {**(cfg.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}),
                               "partial_rotary_factor": 0.75}
        cls = t.Phi3ForCausalLM
    else:
        raise AssertionError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).to(DEVICE)
    return model, cfg.num_hidden_layers


def loss_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    # with the cross_entropy drop-in patched too, a call with labels returns the loss and no logits
    value = out.logits if out.logits is not None else out.loss
    return value.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_rotary_wiring_keeps_outputs_and_gradients(family, monkeypatch):
    model, layers = build(family)
    other = copy.deepcopy(model)  # another instance of the same classes: must stay as it is
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits0, grads0 = loss_grads(model, ids)
    module_fn = hf_rotary.rotary_function(model.model.layers[0].self_attn)
    assert module_fn is not None and module_fn.__module__.startswith("transformers.models.")

    report = mk.patch(model, kernels=["rotary"])
    assert report.count("rotary") == layers, str(report)
    assert all(s.replacement == "mfuwatch.kernels.apply_rotary" for s in report.swapped)
    calls = []
    real = hf_rotary.apply_rotary
    monkeypatch.setattr(hf_rotary, "apply_rotary", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    logits1, grads1 = loss_grads(model, ids)
    assert len(calls) == layers  # the fused function ran once per layer
    assert torch.allclose(logits1, logits0, rtol=1e-5, atol=1e-5)
    for n in grads0:
        assert torch.allclose(grads1[n], grads0[n], rtol=1e-4, atol=1e-6), n

    # this instance only: the class, the modeling module's function and the other model are untouched
    attn = model.model.layers[0].self_attn
    assert "forward" in attn.__dict__ and "forward" not in other.model.layers[0].self_attn.__dict__
    assert hf_rotary.rotary_function(attn) is module_fn
    calls.clear()
    loss_grads(other, ids)
    assert calls == []
    assert "already wired" in str(mk.patch(model, kernels=["rotary"]))

    assert mk.unpatch(model) == layers
    assert "forward" not in attn.__dict__
    calls.clear()
    logits2, _ = loss_grads(model, ids)
    assert calls == [] and torch.equal(logits2, logits0)


def test_all_kernels_on_llama_and_the_report_names_the_swap():
    model, layers = build("llama")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    report = mk.patch(model)
    assert report.count("rotary") == layers and report.count("rms_norm") == 2 * layers + 1
    assert report.count("cross_entropy") == 1  # the LM head + loss
    text = str(report)
    assert "swapped  model.layers.0.self_attn: LlamaAttention.forward: apply_rotary_pos_emb -> " \
           "mfuwatch.kernels.apply_rotary (rotary)" in text
    a, ga = loss_grads(model, ids)
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    b, gb = out.loss.detach(), {n: q.grad.detach().clone() for n, q in ref.named_parameters()}
    assert a.shape == b.shape == ()
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    for n in gb:
        assert torch.allclose(ga[n], gb[n], rtol=1e-3, atol=1e-5), n


def test_not_requested_and_instance_forward_are_reported():
    model, layers = build("llama")
    report = mk.patch(model, kernels=["rms_norm"])
    assert sum(1 for s in report.left if s.kernel == "rotary" and "not requested" in s.reason) == layers
    attn = model.model.layers[1].self_attn
    attn.forward = attn.forward  # an instance forward, as accelerate's hooks install
    report = mk.patch(model, kernels=["rotary"])
    assert report.count("rotary") == layers - 1
    assert any(s.name == "model.layers.1.self_attn" and "wrapped on the instance" in s.reason for s in report.left)


def test_shapes_the_kernel_does_not_take_go_to_the_original(gen):
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    model, _ = build("llama")
    mk.patch(model, kernels=["rotary"])
    fused = model.model.layers[0].self_attn.forward.__func__
    while not hf_rotary._calls_rotary(fused):
        fused = fused.__wrapped__
    wired = fused.__globals__[hf_rotary.GLOBAL]
    assert wired is not llama.apply_rotary_pos_emb
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 1, 3, 8, generator=gen)
    cos, sin = torch.randn(1, 1, 3, 8, generator=gen), torch.randn(1, 1, 3, 8, generator=gen)  # 4-D cos
    want = llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    got = wired(q, k, cos, sin, unsqueeze_dim=0)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    cos3, sin3 = cos[0], sin[0]  # (B, H, T, D) layout with unsqueeze_dim=2 given as (B, T, H, D)
    want = llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos3, sin3, unsqueeze_dim=2)
    got = wired(q.transpose(1, 2), k.transpose(1, 2), cos3, sin3, unsqueeze_dim=2)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, got))
