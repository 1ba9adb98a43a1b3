"""patch(model, kernels=["cross_entropy"]) on Hugging Face causal LMs built from small configs (no download):
loss and gradients equal the unpatched model's, on this instance only; unpatch restores it."""

import copy

import pytest
import torch

import mfuwatch.kernels as mk
from mfuwatch.kernels._hf_lm_head import LMHead

transformers = pytest.importorskip("transformers")

V = 97  # odd vocabulary


def _config(family):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None), transformers.MistralForCausalLM
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=8), transformers.Qwen3ForCausalLM
    if family == "phi3":
        return transformers.Phi3Config(**common, pad_token_id=0), transformers.Phi3ForCausalLM
    if family == "gemma2":
        return (transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0,
                                          attn_implementation="eager"), transformers.Gemma2ForCausalLM)
    if family == "gemma3":
        return (transformers.Gemma3TextConfig(**common, head_dim=8, final_logit_softcapping=3.0,
                                              attn_implementation="eager"), transformers.Gemma3ForCausalLM)
    raise ValueError(family)


def _build(family, seed=0):
    config, cls = _config(family)
    torch.manual_seed(seed)
    return cls(config).eval()  # eval: no dropout, so both runs see the same function


def _run(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "phi3", "gemma2", "gemma3"])
def test_loss_and_gradients_equal_the_unpatched_model(family):
    ref_model = _build(family)
    model = copy.deepcopy(ref_model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    ref_out, ref_grads = _run(ref_model, ids, labels)
    report = mk.patch(model, kernels=["cross_entropy"])
    assert report.count("cross_entropy") == 1, str(report)
    assert isinstance(model.lm_head, LMHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings
    assert list(model.state_dict()) == list(ref_model.state_dict())  # same keys (lm_head.weight kept)
    if family.startswith("gemma"):
        assert f"softcap {model.config.final_logit_softcapping:g}" in str(report)
    out, grads = _run(model, ids, labels)
    assert out.logits is None
    assert torch.allclose(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6), (float(out.loss), float(ref_out.loss))
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.allclose(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6), n
    # logits when asked for, equal to the unpatched model's (softcap included)
    out2 = model(input_ids=ids, labels=labels, return_logits=True)
    assert torch.allclose(out2.logits, ref_out.logits, rtol=1e-5, atol=1e-6)
    # without labels, or in an evaluation loop under no_grad, the model is unchanged: the logits are returned
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref_model(input_ids=ids).logits, atol=1e-6)
        ev = model(input_ids=ids, labels=labels)
        assert torch.allclose(ev.logits, ref_out.logits, atol=1e-6) and torch.allclose(ev.loss, ref_out.loss)


def test_num_items_in_batch_and_tuple_outputs():
    ref_model = _build("llama")
    model = copy.deepcopy(ref_model)
    mk.patch(model, kernels=["cross_entropy"])
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 6), generator=g)
    n = torch.tensor(17)  # gradient accumulation: tokens over all micro-batches, a tensor (no host sync)
    ref = ref_model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    got = model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    assert torch.allclose(got, ref, rtol=1e-5)
    tup = model(input_ids=ids, labels=ids, return_dict=False)
    assert torch.allclose(tup[0], ref_model(input_ids=ids, labels=ids).loss, rtol=1e-5)


def test_patch_is_per_instance_and_unpatch_restores():
    a, b = _build("qwen3"), _build("qwen3")
    head = a.lm_head
    mk.patch(a, kernels=["cross_entropy"])
    assert type(b.lm_head) is torch.nn.Linear and "forward" not in b.__dict__  # the other instance untouched
    assert type(a).forward is type(b).forward
    a.lm_head.weight.data.add_(1.0)  # "training" since the patch
    assert mk.unpatch(a) == 1
    assert a.lm_head is head and "forward" not in a.__dict__
    assert torch.equal(head.weight, b.lm_head.weight + 1.0)
    assert mk.patch(a, kernels=["cross_entropy"]).count() == 1  # and it can be patched again


def test_unrecognised_models_are_left_with_a_reason():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2,
                                                                        bos_token_id=0, eos_token_id=0))
    report = mk.patch(gpt2, kernels=["cross_entropy"])
    assert report.count() == 0 and any("no Hugging Face *ForCausalLM" in n for n in report.notes)
    m = _build("llama")
    m.lm_head.register_forward_hook(lambda *a: None)
    report = mk.patch(m, kernels=["cross_entropy"])
    left = [x for x in report.left if x.kernel == "cross_entropy"]
    assert report.count() == 0 and left[0].name == "lm_head" and "hooks" in left[0].reason


def test_patched_model_under_torch_compile_equals_the_eager_unpatched_one():
    ref_model = _build("llama")
    model = copy.deepcopy(ref_model)
    mk.patch(model, kernels=["cross_entropy"])
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    ref_out, ref_grads = _run(ref_model, ids, ids)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break either
    out, grads = _run(compiled, ids, ids)
    assert torch.allclose(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    for n in ref_grads:
        assert torch.allclose(grads["_orig_mod." + n] if "_orig_mod." + n in grads else grads[n], ref_grads[n],
                              rtol=1e-4, atol=1e-6), n
