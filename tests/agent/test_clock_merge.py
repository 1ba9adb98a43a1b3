"""The step clock never loses steps when its bounded queue merges boundaries before the first poll."""

import torch

from mfuwatch.agent.live.clock import StepClock


def test_merged_start_boundary_still_counts_every_step():
    now = [0.0]
    c = StepClock(torch.device("cpu"), now=lambda: now[0], max_pending=8)
    c.start()
    for step in range(1, 101):  # 100 steps before the agent thread polls once: the start mark is merged away
        now[0] += 0.01
        c.mark(step, tokens=5)
    ivs = c.poll()
    assert sum(iv.steps for iv in ivs) == 100
    assert sum(iv.tokens for iv in ivs) == 500
    assert ivs[-1].last_step == 100
