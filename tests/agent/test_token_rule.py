"""Which forwards are training tokens: autograd on and the model in train mode. A metric pass in
``model.eval()`` without ``no_grad`` is not counted; a dict batch with ``input_ids`` is."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mfuwatch.agent import Agent
from mfuwatch.agent.core import count_tokens
from tests.agent.test_core import BASE, _tiny
from tests.helpers.integration_fixtures import install_fake_clock


def test_eval_forward_without_no_grad_is_not_training_tokens():
    s, model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=4,
                                      model_shape={"n_layers": 1, "d_model": 16}))
    now = install_fake_clock(a, start=True)
    for _ in range(4):
        x = torch.randint(0, s.vocab, (s.batch, s.seq))
        model.train()
        F.cross_entropy(model(x).view(-1, s.vocab), x.view(-1)).backward()
        model.eval()
        model(x)  # a metric pass: eval mode, autograd still on
        model(x)
        now.t += 0.5
        opt.step()
        opt.zero_grad()
    a.close()
    m = a.latest
    assert m.steps == 4 and m.tokens == 4 * s.batch * s.seq  # only the training forward of each step
    assert m.tokens_per_second == s.batch * s.seq / 0.5


def test_dict_batch_with_input_ids_is_counted():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert count_tokens(({"input_ids": ids, "attention_mask": torch.ones(3, 7)},), {}) == (21, 7)
    from collections import UserDict  # BatchEncoding is a UserDict

    assert count_tokens((UserDict(input_ids=ids),), {}) == (21, 7)
    assert count_tokens((), {"input_ids": ids}) == (21, 7)


def test_zero_tokens_are_blamed_on_the_tokens_not_the_flops(caplog):
    """A batch object the token rule cannot read: the warning names the tokens and how to give them."""
    import logging

    from mfuwatch.agent import Agent

    class Batch:
        def __init__(self, x):
            self.x = x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, batch):
            return self.lin(batch.x)

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="mfuwatch"):
        agent = Agent(model, opt, exporter=False, alerts=False, profile_every="off", nvml=False, peak_flops=1e11)
        for _ in range(3):
            model(Batch(torch.randn(4, 8))).sum().backward()
            opt.step()
            opt.zero_grad()
        agent.close()
    text = caplog.text
    assert "0 training tokens" in text and "tokens_per_step" in text
    assert "counted 0 FLOPs" not in text
