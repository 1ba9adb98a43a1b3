"""Shared pieces of the framework integration tests: a tiny Llama built from a config, its hand-counted FLOPs,
a token dataset, and a fake step clock.

The tiny model is ``LlamaForCausalLM`` from a ``LlamaConfig`` (no download): 2 layers, width 32, 4 heads of 8,
2 key/value heads (grouped-query attention), SwiGLU width 64, vocabulary 64, untied output projection.
"""

from __future__ import annotations

import torch

from tests.helpers.fake_clock import FakeClock

VOCAB, D, LAYERS, HEADS, KV_HEADS, FF, SEQ = 64, 32, 2, 4, 2, 64, 16


def make_tiny_llama(seed: int = 0):
    """The tiny ``LlamaForCausalLM`` (needs transformers), weights from ``torch.manual_seed(seed)``."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def llama_matmul_params() -> int:
    """N of the tiny Llama, by hand: per layer q, k, v, o, gate, up, down; plus the output projection."""
    head_dim = D // HEADS  # 8
    kv = KV_HEADS * head_dim  # 16
    per_layer = D * D + D * kv + D * kv + D * D + D * FF + D * FF + FF * D  # 1024+512+512+1024+2048*3 = 9216
    return LAYERS * per_layer + D * VOCAB  # 18432 + 2048 = 20480


def llama_flops_per_token() -> float:
    """PaLM appendix B, written out independently of mfuwatch.agent.flops: 6 N + 12 L d T."""
    return 6.0 * llama_matmul_params() + 12.0 * LAYERS * D * SEQ  # 122880 + 12288 = 135168


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random sequences of SEQ token ids, as ``{"input_ids", "labels"}`` dicts (int64)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def install_fake_clock(agent, start: bool = False) -> FakeClock:
    """Give ``agent`` a step clock on fake time (before its first forward, which starts the clock;
    ``start=True`` starts it now, for tests that call the agent's step hooks directly)."""
    from mfuwatch.agent.clock import StepClock

    now = FakeClock()
    agent.clock = StepClock(agent.device, now=now)
    if start:
        agent.clock.start()
    return now


def expected_tokens(first: int, last: int, per_step: dict) -> int:
    """Tokens of optimizer steps ``first..last`` (1-based, inclusive) given each step's tokens."""
    return sum(per_step[s] for s in range(first, last + 1))
