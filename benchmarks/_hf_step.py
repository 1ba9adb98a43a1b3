"""The training step and the step timing shared by the Hugging Face benchmarks (hf_llama_e2e, gain_truth)."""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple


def train_step(fwd, ids, opt, autocast, before: Optional[Callable[[], None]] = None) -> Callable[[], object]:
    """``step()``: a causal-LM forward on ``ids`` (labels = inputs) under ``autocast``, backward, ``opt.step()``,
    gradients set to None; returns the loss tensor. ``before`` runs first in each step (e.g.
    ``torch.compiler.cudagraph_mark_step_begin`` for CUDA graphs)."""

    def step():
        if before is not None:
            before()
        with autocast:
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def time_steps(step, sync, warmup: int, steps: int,
               after_warmup: Optional[Callable[[], None]] = None) -> Tuple[float, float, List[float]]:
    """Run ``warmup`` untimed steps (at least one), ``after_warmup()`` (e.g. reset the peak-memory counter),
    then ``steps`` steps each between two ``sync()`` calls.

    Returns ``(first loss, warm-up seconds, ms of each timed step)``; the first loss is the same in every
    configuration up to rounding when they start from the same weights and batch.
    """
    t0 = time.perf_counter()
    first = float(step().detach())
    for _ in range(max(0, warmup - 1)):
        step()
    sync()
    warm_s = time.perf_counter() - t0
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return first, warm_s, times
