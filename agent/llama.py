"""The Llama-style decoder of the demo and the benchmarks: one definition, written in plain PyTorch ops.

RMSNorm is spelled out (pow / mean / add / rsqrt / mul, statistics in fp32), the MLP is SwiGLU with
Llama's projection names and attention is SDPA: the memory-bound patterns the suggestions name sit
next to cuBLAS matmuls, and ``mfuwatch.kernels.patch`` recognises the norm and MLP modules.

    model = LlamaLM(LlamaShape(vocab=32000, d_model=2048, n_layers=4, n_heads=16, d_ff=5632))
    logits = model(idx)                 # idx (B, T) int64 -> (B, T, vocab) in the compute dtype
    loss = model(idx, targets)          # mean cross-entropy over B*T tokens, fp32 scalar
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaShape:
    """Sizes of the decoder; ``d_ff`` about 8/3 ``d_model`` as in Llama's SwiGLU."""

    vocab: int = 256  # byte-level by default (the demo's text)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4  # d_model must divide by it
    d_ff: int = 352


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, statistics in fp32 (Zhang & Sennrich 2019)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases (Shazeer 2020)."""

    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder layer: causal SDPA attention, then the MLP, each with a residual."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        if s.d_model % s.n_heads:
            raise ValueError(f"d_model {s.d_model} is not a multiple of n_heads {s.n_heads}")
        self.n_heads = s.n_heads
        self.input_layernorm = RMSNorm(s.d_model)
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model, bias=False)
        self.o_proj = nn.Linear(s.d_model, s.d_model, bias=False)
        self.post_attention_layernorm = RMSNorm(s.d_model)
        self.mlp = MLP(s.d_model, s.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.input_layernorm(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(nn.Module):
    """Decoder-only LM: embedding, ``n_layers`` blocks, final RMSNorm, untied ``lm_head``.

    ``checkpoint=True`` recomputes each block in the backward (``torch.utils.checkpoint``), so the
    executed FLOPs are about 4/3 of the model FLOPs. Weights start from N(0, 0.02).
    """

    def __init__(self, s: LlamaShape, checkpoint: bool = False) -> None:
        super().__init__()
        self.shape = s
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.n_layers))
        self.norm = RMSNorm(s.d_model)
        self.lm_head = nn.Linear(s.d_model, s.vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``idx`` (B, T) int64 -> logits (B, T, vocab); with ``targets`` (B, T) the fp32 mean cross-entropy."""
        x = self.embed(idx)
        for layer in self.layers:
            if self.checkpoint and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
