"""Step clock on the CPU path with an injected clock."""

import math

import torch

from mfuwatch.agent.live.clock import StepClock
from tests.helpers.fake_clock import FakeClock


def test_intervals_from_boundaries():
    now = FakeClock(100.0)
    c = StepClock(torch.device("cpu"), now=now, wall=lambda: 1e9)
    c.start()
    for step, dt, tok in ((1, 0.5, 10), (2, 0.25, 20), (3, 1.0, 30)):
        now.t += dt
        c.mark(step, tok)
    ivs = c.poll()
    assert [(i.first_step, i.last_step, i.tokens) for i in ivs] == [(1, 1, 10), (2, 2, 20), (3, 3, 30)]
    assert [i.seconds for i in ivs] == [0.5, 0.25, 1.0]
    assert c.poll() == [] and c.pending == 0


def test_first_boundary_without_start_is_untimed_but_counted():
    now = FakeClock(100.0)
    c = StepClock(torch.device("cpu"), now=now)
    c.mark(1, 7)
    now.t += 2.0
    c.mark(2, 8)
    a, b = c.poll()
    assert math.isnan(a.seconds) and a.tokens == 7
    assert b.seconds == 2.0 and b.tokens == 8


def test_overflow_merges_tokens_not_drops():
    now = FakeClock(100.0)
    c = StepClock(torch.device("cpu"), now=now, max_pending=3)
    c.start()
    for s in range(1, 7):
        now.t += 1.0
        c.mark(s, 10)
    ivs = c.poll()
    # 6 steps x 10 tokens recorded; none may be lost even though boundaries were merged
    assert sum(i.tokens for i in ivs) == 60
    assert ivs[-1].last_step == 6
    assert sum(i.steps for i in ivs) + ivs[0].first_step - 1 == 6


def test_gap_leaves_its_time_out_and_keeps_steps_and_tokens():
    now = FakeClock(100.0)
    c = StepClock(torch.device("cpu"), now=now)
    c.start()
    now.t += 0.5
    c.mark(1, 10)
    now.t += 30.0  # evaluation
    c.mark_gap(1)
    now.t += 0.25
    c.mark(2, 20)
    ivs = c.poll()
    assert [(i.first_step, i.last_step, i.steps, i.seconds, i.tokens) for i in ivs] == [(1, 1, 1, 0.5, 10),
                                                                                         (2, 2, 1, 0.25, 20)]


def test_gap_after_merged_boundaries_counts_their_steps_untimed():
    now = FakeClock(100.0)
    c = StepClock(torch.device("cpu"), now=now, max_pending=2)
    c.start()
    for step in (1, 2):
        now.t += 1.0
        c.mark(step, 5)  # the start mark and step 1 are merged away (max_pending=2)
    c.mark_gap(2)
    now.t += 1.0
    c.mark(3, 7)
    ivs = c.poll()
    assert sum(i.steps for i in ivs) == 3 and sum(i.tokens for i in ivs) == 17
    assert ivs[-1].first_step == 3 and ivs[-1].seconds == 1.0


def test_start_after_steps_done_elsewhere_counts_only_its_own_steps():
    """``start(step=1)`` (``mfuwatch run`` attaches after the job's step 1): the start mark closes no step.

    Hand-built: marks 2, 3, 4 after a start at step 1 are three timed one-step intervals; step 1 is in none.
    """
    now = FakeClock(100.0)
    c = StepClock(torch.device("cpu"), now=now, wall=lambda: 1e9)
    c.start(step=1)
    for step, dt, tok in ((2, 0.5, 10), (3, 0.25, 20), (4, 1.0, 30)):
        now.t += dt
        c.mark(step, tok)
    ivs = c.poll()
    assert [(i.first_step, i.last_step, i.steps, i.seconds, i.tokens) for i in ivs] == [
        (2, 2, 1, 0.5, 10), (3, 3, 1, 0.25, 20), (4, 4, 1, 1.0, 30)]


def test_start_after_steps_done_elsewhere_then_merged_away_counts_from_the_next_step():
    now = FakeClock(100.0)
    c = StepClock(torch.device("cpu"), now=now, max_pending=2)
    c.start(step=1)
    for step in (2, 3):
        now.t += 1.0
        c.mark(step, 5)  # the start mark is merged away (max_pending=2): step 2 is the untimed first interval
    ivs = c.poll()
    assert [(i.first_step, i.last_step, i.steps, i.tokens) for i in ivs] == [(2, 2, 1, 5), (3, 3, 1, 5)]
    assert math.isnan(ivs[0].seconds) and ivs[1].seconds == 1.0
