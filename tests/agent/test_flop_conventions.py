"""Named FLOP conventions (palm, megatron, 6n): the setting, the agent's numbers, and published figures.

The published-figure tests take a framework's published tokens/s and model config, count the model's
FLOPs under the framework's convention with mfuwatch (the Llama architecture read from a meta-device
build of its Hugging Face config), and compare the MFU (or model TFLOP/s) the framework published.
"""

from __future__ import annotations

import pytest
import torch

from mfuwatch.agent import Agent, ConfigError
from mfuwatch.agent.flops.conventions import dense_flops_per_token, six_n_parameters
from tests.helpers.integration_fixtures import install_fake_clock

transformers = pytest.importorskip("transformers")
BASE = dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="t")


def _meta_llama(**kw):
    from mfuwatch.agent.flops.cli import build_model

    cfg = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                                   num_key_value_heads=8, **kw)
    return build_model(cfg, "meta")


def _arch_per_token(model, convention, seq):
    from mfuwatch.agent.flops import architectures as A

    arch = A.from_model(model, causal=convention == "megatron")
    return arch.step_flops(A.Lengths(seq), 1.0)[0] / seq


LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


@pytest.mark.parametrize("shape,wps,mfu", [
    (LLAMA3_8B, 2904, 0.568),   # selective layer AC
    (LLAMA3_8B, 2973, 0.582),   # selective op AC
    (LLAMA3_70B, 331, 0.517),   # full AC
])
def test_torchtitan_published_mfu_of_llama3_on_a100(shape, wps, mfu):
    """torchtitan docs/performance.md at commit 1ea476e9f (2024-04-24), "Llama 3 performance numbers": WPS
    (tokens/s per GPU) and MFU of Llama 3 8B / 70B, FSDP2 on 64 A100 80GB, local batch 1, seq_len 8192
    (train_configs/llama3_*.toml). Its train.py at that commit: mfu = num_flop_per_token * wps / peak with
    num_flop_per_token = 6 * get_num_params(model) + 12 * L * H * Q * T (every parameter, embeddings
    included, at that commit: palm's attention term with N = all parameters) and an A100 peak of 312e12."""
    model = _meta_llama(**shape)
    n_all = sum(p.numel() for p in model.parameters())
    L, d = shape["num_hidden_layers"], shape["hidden_size"]
    per_token = dense_flops_per_token("palm", n_all, L, d, 8192)
    # the attention term of palm is also what the architecture reader counts (its N is matmul weights only)
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and p.dim() == 2)
    assert _arch_per_token(model, "palm", 8192) == pytest.approx(dense_flops_per_token("palm", n_matmul, L, d, 8192),
                                                                 rel=1e-9)
    assert per_token * wps / 312e12 == pytest.approx(mfu, rel=0.01)


@pytest.mark.parametrize("shape,tps,tflops", [
    (LLAMA3_8B, 14451, 744),
    (LLAMA3_70B, 1602, 719),
])
def test_megatron_published_model_tflops_of_llama3_on_h100(shape, tps, tflops):
    """NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, "25.11 NeMo Container", DGX-H100 table:
    LLAMA3_8B 14451 tokens/s/GPU and 744 model TFLOP/s/GPU; LLAMA3_70B 1602 and 719 (seq 8192). Their model
    FLOPs are Megatron-Core's num_floating_point_operations: causal attention halved, embeddings excluded,
    the output layer included: our "megatron" convention on the architecture read from the HF config.
    MFU = TFLOP/s / peak, so matching TFLOP/s within 1% is matching their MFU for any peak."""
    model = _meta_llama(**shape)
    per_token = _arch_per_token(model, "megatron", 8192)
    assert per_token * tps / 1e12 == pytest.approx(tflops, rel=0.01)
    # and the palm count of the same run is the larger one: all pairs of the score matrix
    assert _arch_per_token(model, "palm", 8192) > per_token * 1.05


def test_dense_formulas_by_hand():
    assert dense_flops_per_token("palm", 100, 2, 8, 16) == 600 + 12 * 2 * 8 * 16
    assert dense_flops_per_token("megatron", 100, 2, 8, 16) == 600 + 6 * 2 * 8 * 17
    assert dense_flops_per_token("6n", 100, 2, 8, 16) == 600
    with pytest.raises(ValueError, match="unknown FLOP convention"):
        dense_flops_per_token("chinchilla", 1, 1, 1, 1)


def test_flops_convention_is_validated_with_did_you_mean():
    with pytest.raises(ConfigError, match="flops_convention: expected one of palm, megatron, 6n.*did you mean 'megatron'"):
        Agent(config=dict(BASE, flops_convention="megatorn"))
    with pytest.raises(ConfigError, match="attention_flops: 'causal' contradicts flops_convention 'palm'"):
        Agent(config=dict(BASE, flops_convention="palm", attention_flops="causal"))
    a = Agent(config=dict(BASE, attention_flops="causal"))  # the older setting still picks its convention
    assert a.config.flops_convention == "megatron"
    a.close()


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("convention", ["palm", "megatron", "6n"])
def test_the_agent_reports_its_convention_and_the_inputs_of_its_formula(convention):
    model = _tiny_llama()
    x = torch.randint(0, 64, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=2, flops_convention=convention))
    now = install_fake_clock(a, start=True)
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        now.t += 0.5
        opt.step()
        opt.zero_grad()
    a.close()
    n_matmul = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64) + 32 * 64  # q, k, v, o, gate/up/down; head
    n_6n = sum(p.numel() for p in model.parameters()) - 64 * 32  # all but the embedding table
    assert six_n_parameters(model) == n_6n
    expected = {"palm": 6 * n_matmul + 12 * 2 * 32 * 16, "megatron": 6 * n_matmul + 6 * 2 * 32 * 17,
                "6n": 6 * n_6n}[convention] * 32
    assert a.latest.model_flops == pytest.approx(expected, rel=1e-9)
    ri = a.run_info
    assert ri.flops_convention == convention and ri.flops_source == "analytic"
    want = {"parameters": n_6n if convention == "6n" else n_matmul, "layers": 2, "width": 32, "heads": 4,
            "head_dim": 8, "seq_len": 16}
    assert ri.flops_inputs == want
    text = a.flops_breakdown()
    assert f"flops_convention: {convention}" in text and "tokens_per_step=32" in text and "seq_len=16" in text


def test_hugging_face_total_flos_is_the_6n_convention():
    """The Trainer's total_flos adds floating_point_ops(inputs) per micro-batch (the model's method in
    transformers 4, the Trainer's in 5): 6n's count, to the FLOP."""
    import types

    model = _tiny_llama()
    x = torch.randint(0, 64, (3, 16))
    if hasattr(model, "floating_point_ops"):
        hf = model.floating_point_ops({"input_ids": x})
    else:
        hf = transformers.Trainer.floating_point_ops(types.SimpleNamespace(model=model), {"input_ids": x})
    assert hf == 6 * six_n_parameters(model) * x.numel()


def test_mfuwatch_flops_prints_the_three_conventions(tmp_path, capsys):
    import json

    from mfuwatch.agent.flops import cli as flops_cli

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)))
    assert flops_cli.main([str(cfg), "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    n_matmul = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64) + 32 * 64
    rows = {line.split()[0]: float(line.split()[2]) for line in out.splitlines()
            if line.split() and line.split()[0] in ("palm", "megatron", "6n")}
    assert rows["palm"] == pytest.approx(6 * n_matmul + 12 * 2 * 32 * 16, rel=1e-3)
    assert rows["megatron"] == pytest.approx(6 * n_matmul + 6 * 2 * 32 * 17, rel=1e-3)
    assert rows["6n"] == pytest.approx(6 * (n_matmul + 5 * 32), rel=1e-3)  # + 2 norms per layer and the final one
