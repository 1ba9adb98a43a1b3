"""Analytic FLOPs by architecture against an independent count, on small Hugging Face models (no download).

The independent count is ``FlopCounterMode`` over one real forward+backward of the same
weights, with eager attention (plain matmuls) and, for MoE, experts run as plain linears
(``experts_implementation="eager"``); a hand-derived formula where the counter cannot
see the convention (sliding windows, causal halving).
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

transformers = pytest.importorskip("transformers")

from mfuwatch.agent.flops import architectures as A  # noqa: E402
from mfuwatch.agent.flops import op_flops  # noqa: E402

B, T = 2, 12


def counted(model, **inputs) -> int:
    """FLOPs of one real training step (forward + backward of the loss), every matmul counted."""
    with FlopCounterMode(display=False, custom_mapping=op_flops.flop_counter_mapping()) as fc:
        out = model(**inputs)
        out.loss.backward()
    return fc.get_total_flops()


def analytic(model, lengths, sequences=B, **kw):
    model_f, hw, _ = A.from_model(model, **kw).step_flops(lengths, sequences)
    return model_f, hw


def close(a, b, tol=0.02):
    return abs(a - b) <= tol * abs(b)


def ids(vocab=64, b=B, t=T):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(0))


def llama(**kw):
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, attn_implementation="eager")
    cfg.update(kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))


@pytest.mark.parametrize("kv_heads,head_dim", [(4, None), (1, None), (2, 12)])
def test_llama_mha_gqa_mqa_and_head_dim(kv_heads, head_dim):
    m = llama(num_key_value_heads=kv_heads, **({"head_dim": head_dim} if head_dim else {}))
    x = ids()
    truth = counted(m, input_ids=x, labels=x)
    got, hw = analytic(m, A.Lengths(T))
    assert got == truth and hw == got  # exact: every matmul is a Linear or an eager attention bmm


def test_mixtral_moe_counts_top_k_of_the_3d_experts():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.MixtralForCausalLM(cfg)
    assert m.model.layers[0].mlp.experts.gate_up_proj.dim() == 3  # transformers 5: 3-D expert parameters
    x = ids()
    got, _ = analytic(m, A.Lengths(T))
    # hand count per token and layer: attention 4 d^2 (q, o) + 2 * 2 d (d/2) (k, v), router E d,
    # top_k experts of 3 d I each; head V d; attention scores 12 d T per token and layer
    d, i, e, k, v, L = 32, 40, 4, 2, 64, 2
    per_tok = L * (2 * d * d + 2 * d * 16 + e * d + k * 3 * d * i) + v * d
    hand = 6 * per_tok * B * T + 12 * L * d * T * B * T
    assert got == hand
    # the counted path sees the experts too: grouped mm (our formula) and a plain per-expert loop agree
    assert counted(m, input_ids=x, labels=x) == pytest.approx(hand, rel=0.02)
    m.config._experts_implementation = "eager"
    m.set_experts_implementation("eager") if hasattr(m, "set_experts_implementation") else None
    assert counted(m, input_ids=x, labels=x) == pytest.approx(hand, rel=0.02)


def test_moe_dense_layers_interleaved_and_shared_experts():
    cfg = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, mlp_only_layers=[0], attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.Qwen2MoeForCausalLM(cfg)
    x = ids()
    got, _ = analytic(m, A.Lengths(T))
    d = 32
    attn = 2 * d * d + 2 * d * 16  # q, o + k, v (2 KV heads of 8)
    dense = 3 * d * 48  # layer 0: mlp_only_layers
    moe = 4 * d + 2 * 3 * d * 16 + 3 * d * 24 + d  # router, 2 of 4 experts, shared expert, shared-expert gate
    per_tok = 2 * attn + dense + moe + 64 * d
    assert got == 6 * per_tok * B * T + 12 * 2 * d * T * B * T
    m.config._experts_implementation = "eager"
    if hasattr(m, "set_experts_implementation"):
        m.set_experts_implementation("eager")
    assert close(counted(m, input_ids=x, labels=x), got)


def test_frozen_weights_cost_4n_lora_adapters_6n():
    peft = pytest.importorskip("peft", reason="peft is in the dev extra")
    base = llama(num_key_value_heads=2)
    m = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    x = ids()
    truth = counted(m, input_ids=x, labels=x)
    got, _ = analytic(m, A.Lengths(T))
    assert close(got, truth), (got, truth)
    every_weight_trainable = 6 * sum(p.numel() for n, p in base.named_parameters() if p.dim() == 2
                                     and "embed" not in n) * B * T
    assert got < every_weight_trainable  # the old 6N over-count (issue: 1.53x)


def test_merged_adapter_is_re_read_and_not_counted():
    peft = pytest.importorskip("peft", reason="peft is in the dev extra")
    m = peft.get_peft_model(llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    before, _ = analytic(m, A.Lengths(T))
    sig = A.trainable_signature(m)
    m.merge_adapter()
    assert A.trainable_signature(m) != sig
    m.get_output_embeddings().weight.requires_grad_(True)  # something trainable still runs after the merge
    after, _ = analytic(m, A.Lengths(T))
    x = ids()
    assert not any("lora" in mm.path for mm in A.from_model(m).matmuls)
    assert after != before and close(after, counted(m, input_ids=x, labels=x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_hardware_flops(reentrant):
    m = llama(num_key_value_heads=2)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    m.train()
    x = ids()
    executed = counted(m, input_ids=x, labels=x)
    model_f, hw = analytic(m, A.Lengths(T))
    plain, _ = analytic(llama(num_key_value_heads=2), A.Lengths(T))
    assert model_f == plain  # MFU's numerator excludes recomputation (PaLM)
    assert close(hw, executed) and hw > model_f


def test_sliding_window_layers_hand_count():
    # gpt-oss-like per-layer pattern on a Llama-shaped model: layer_types alternate
    m = llama(num_hidden_layers=4)
    m.config.layer_types = ["sliding_attention", "full_attention"] * 2
    m.config.sliding_window = 5
    arch = A.from_model(m)
    assert [(a.kind, a.window) for a in arch.attention] == [("sliding", 5), ("full", None)] * 2
    full, _ = analytic(llama(num_hidden_layers=4), A.Lengths(T))
    got, _ = arch.step_flops(A.Lengths(T), B)[:2]
    d = 32
    assert full - got == 2 * 12 * d * B * (T * T - T * 5)  # two sliding layers see 5 keys, not 12
    causal = A.from_model(m, causal=True).step_flops(A.Lengths(T), B)[0]
    pairs_sliding = sum(min(i + 1, 5) for i in range(T))
    pairs_full = T * (T + 1) // 2
    assert full - causal == 12 * d * B * (2 * (T * T - pairs_sliding) + 2 * (T * T - pairs_full))


def test_mistral_sliding_window_everywhere_and_unknown_layer_type():
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    m = transformers.MistralForCausalLM(cfg)
    assert {(a.kind, a.window) for a in A.from_model(m).attention} == {("sliding", 4)}
    m.config.layer_types = ["mystery_attention", "full_attention"]
    with pytest.raises(A.UnknownArchitecture, match="mystery_attention"):
        A.from_model(m)


def test_t5_encoder_decoder_with_different_source_and_target_lengths():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0)
    torch.manual_seed(0)
    m = transformers.T5ForConditionalGeneration(cfg)
    src, tgt = ids(t=10), ids(t=6)
    truth = counted(m, input_ids=src, labels=tgt)
    arch = A.from_model(m)
    lengths = arch.lengths_from_inputs((), {"input_ids": src, "labels": tgt})
    assert lengths == A.Lengths(target=6, source=10)
    got, _, _ = arch.step_flops(lengths, B)
    assert close(got, truth), (got, truth)


def test_bart_encoder_decoder():
    cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                  decoder_ffn_dim=48, max_position_embeddings=32, attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.BartForConditionalGeneration(cfg)
    src, tgt = ids(t=10), ids(t=7)
    truth = counted(m, input_ids=src, labels=tgt)
    got, _, _ = A.from_model(m).step_flops(A.Lengths(target=7, source=10), B)
    assert close(got, truth), (got, truth)


def test_bert_mlm_encoder():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.BertForMaskedLM(cfg)
    x = ids()
    truth = counted(m, input_ids=x, labels=x)
    got, _ = analytic(m, A.Lengths(T))
    assert close(got, truth), (got, truth)
    assert A.from_model(m).family == "encoder"


def test_vit_tokens_from_pixels_and_config():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                 image_size=16, patch_size=4, num_labels=3, attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.ViTForImageClassification(cfg)
    px = torch.randn(B, 3, 16, 16)
    truth = counted(m, pixel_values=px, labels=torch.tensor([0, 2]))
    arch = A.from_model(m)
    lengths = arch.lengths_from_inputs((), {"pixel_values": px})
    assert lengths == A.Lengths(target=(16 // 4) ** 2 + 1) == arch.default_lengths
    assert arch.units_per_sequence(lengths) == 1.0  # the agent counts images for ViT inputs
    got, _, _ = arch.step_flops(lengths, B)
    assert close(got, truth), (got, truth)


def test_unknown_architecture_goes_to_the_counted_path():
    class Weird(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.LlamaConfig(num_hidden_layers=1)
            self.w = torch.nn.Parameter(torch.randn(8, 8))

    with pytest.raises(A.UnknownArchitecture):
        A.from_model(Weird())
    m = llama()
    m.model.layers[0].mlp.extra = torch.nn.Parameter(torch.randn(4, 4))  # a raw matmul weight we cannot place
    with pytest.raises(A.UnknownArchitecture, match="extra"):
        A.from_model(m)


def test_tensor_and_context_parallel_rules():
    m = llama()
    full, _ = analytic(m, A.Lengths(T))
    arch_cp = A.from_model(m, cp=2)
    # CP=2: each rank holds T/2 queries of a 2T-long sequence; per local token the keys double
    cp_f = arch_cp.step_flops(A.Lengths(T), B)[0]
    assert cp_f - full == 12 * 32 * 2 * B * T * T  # two layers, attention term doubles; matmuls unchanged
    # TP over local (non-DTensor) shards: the weights are already local, the attention width is divided
    tp_f = A.from_model(m, tp=2).step_flops(A.Lengths(T), B)[0]
    assert full - tp_f == 12 * 32 * 2 * B * T * T / 2
