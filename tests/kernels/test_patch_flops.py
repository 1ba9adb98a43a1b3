"""patch(model) leaves the agent's FLOP number alone: a patched Hugging Face causal LM keeps the analytic FLOP
path (``flops_source == "analytic"``) and exactly the FLOPs per step of the unpatched model, for every family
whose LM head ``patch`` wires (issue 27: the patched head used to send the agent to the counted path, +1.3% FLOPs
on a Qwen2, +1.9% on a small Llama)."""

import copy

import pytest
import torch

import mfuwatch.kernels as mk
from mfuwatch.agent import Agent
from mfuwatch.kernels._hf_lm_head import FAMILIES, LMHead

transformers = pytest.importorskip("transformers")

BASE = dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="t", peak_flops=1e12)
B, T, V = 2, 12, 61


def _build(model_type):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    spec = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 8}),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                   {"head_dim": 8, "final_logit_softcapping": 2.0}),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                        {"head_dim": 8, "final_logit_softcapping": 3.0}),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {}),
    }
    if model_type not in spec:
        pytest.skip(f"no small config written for {model_type}")
    cfg_cls, cls, extra = spec[model_type]
    torch.manual_seed(0)
    return cls(cfg_cls(**common, **extra, attn_implementation="eager"))


def _flops(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, config=dict(BASE, report_every_steps=1))
    try:
        a.hooks.seq_len = T  # as the first training forward would set it
        return a.run_info.flops_source, a.flops_per_step(B * T)
    finally:
        a.close()


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f != "gemma3"])  # gemma3 = the text model's config
def test_patched_model_keeps_the_analytic_path_and_its_flops(model_type):
    ref = _build(model_type)
    model = copy.deepcopy(ref)
    report = mk.patch(model)  # every kernel, as the alert's one line applies it
    assert report.count("cross_entropy") == 1, str(report)
    assert isinstance(model.lm_head, LMHead)
    src_ref, (mf_ref, hw_ref) = _flops(ref)
    src, (mf, hw) = _flops(model)
    assert src_ref == "analytic" and src == "analytic"
    # exact: the analytic count is 6 * weights per token + the attention term, the same modules before and after.
    # By hand for the head alone: 6 * V * H per token, whatever the head's class.
    assert mf == mf_ref and hw == hw_ref, (mf, mf_ref)
    assert mf > 6 * V * 32 * B * T


def test_patched_qwen2_through_training_steps_reports_the_unpatched_flops():
    """The agent attached to a patched Qwen2 over real steps: same source, same model FLOPs per step as the
    unpatched model over the same steps."""
    from tests.helpers.integration_fixtures import install_fake_clock

    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    got = {}
    for patched in (False, True):
        model = _build("qwen2")
        if patched:
            mk.patch(model, kernels=["cross_entropy"])
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        a = Agent(model, opt, config=dict(BASE, report_every_steps=2))
        now = install_fake_clock(a)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            now.t += 0.5
            opt.step()
            opt.zero_grad()
        a.close()
        got[patched] = (a.run_info.flops_source, a.latest.model_flops, a.latest.tokens)
    assert got[True] == got[False] and got[False][0] == "analytic", got
