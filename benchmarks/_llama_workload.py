"""The Llama-style training step of the H200 fixture traces, for the profiler benchmarks.

Same configuration as ``llama_bf16_eager`` in ``../shared/fixtures/traces`` (V=32000, d=2048,
4 layers, 16 heads, SwiGLU ff=5632, RMSNorm written out in PyTorch ops, SDPA, bf16 autocast,
batch 4 × 1024, AdamW with foreach kernels): a model whose step has the memory-bound ops the
suggestions name (RMSNorm chain, silu × mul, foreach AdamW) next to cuBLAS/cuDNN kernels.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """RMSNorm spelled out as pow / mean / add / rsqrt / mul, in fp32 (the pattern the registry matches)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, ff, bias=False)
        self.up = nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).contiguous().view(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaStyle(nn.Module):
    def __init__(self, vocab: int = 32000, d: int = 2048, layers: int = 4, heads: int = 16, ff: int = 5632) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def make_step(layers: int = 4, batch: int = 4, seq: int = 1024, device: str = "cuda", *, d: int = 2048,
              ff: int = 5632, vocab: int = 32000, heads: int = 16) -> Callable[[], None]:
    """Build the model, optimizer and a fixed batch; return ``step()`` (forward, backward, AdamW step).
    The defaults are the fixture's; smaller ``d``/``ff``/``vocab`` give a CPU smoke-test size."""
    torch.manual_seed(0)
    model = LlamaStyle(vocab=vocab, d=d, layers=layers, heads=heads, ff=ff).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    tgt = torch.randint(0, vocab, (batch, seq), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
