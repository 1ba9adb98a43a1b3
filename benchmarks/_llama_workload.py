"""The Llama-style training step of the H200 fixture traces, for the profiler benchmarks.

Same configuration as ``llama_bf16_eager`` in ``tests/fixtures/traces`` (V=32000, d=2048,
4 layers, 16 heads, SwiGLU ff=5632, RMSNorm written out in PyTorch ops, SDPA, bf16 autocast,
batch 4 × 1024, AdamW with foreach kernels), with the model of :mod:`mfuwatch.agent.llama`
(the demo's): a step whose memory-bound ops the suggestions name (RMSNorm chain, silu × mul,
foreach AdamW) sit next to cuBLAS/cuDNN kernels.
"""

from __future__ import annotations

from typing import Callable

import torch

from mfuwatch.agent.llama import LlamaLM, LlamaShape


def make_step(layers: int = 4, batch: int = 4, seq: int = 1024, device: str = "cuda", *, d: int = 2048,
              ff: int = 5632, vocab: int = 32000, heads: int = 16) -> Callable[[], None]:
    """Build the model, optimizer and a fixed batch; return ``step()`` (forward, backward, AdamW step).
    The defaults are the fixture's; smaller ``d``/``ff``/``vocab`` give a CPU smoke-test size."""
    torch.manual_seed(0)
    model = LlamaLM(LlamaShape(vocab=vocab, d_model=d, n_layers=layers, n_heads=heads, d_ff=ff)).to(device)
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
