"""A model run through ``torch.compile(model)`` (the ``OptimizedModule`` wrapper) is measured like an eager one.

torch 2.13 traces a module's own hooks into the compiled graph: the agent's hooks read clocks and thread ids,
which made ``torch.compile(model, fullgraph=True)`` fail in the job (and without ``fullgraph`` counted only the
forward's FLOPs). The step's FLOPs are derived by hand as in ``test_compiled_in_place.py``:
``Linear(64, 128) -> ReLU -> Linear(128, 64)``, batch 32, input without gradient: forward
``2*32*(64*128 + 128*64)``, backward both weight gradients plus the second layer's input gradient
``2*32*128*64``: 2,621,440 per step. Tokens: a (32, 64) float input counts 32 samples per step.
"""

import json
import logging
import warnings

import pytest
import torch
import torch.nn as nn

import mfuwatch.agent as A
from torch.nn.modules import module as module_mod

STEP_FLOPS = 2 * 32 * (64 * 128 + 128 * 64) + 2 * 32 * (64 * 128 + 128 * 64) + 2 * 32 * 128 * 64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _global_hooks():
    """Entries of every global module-hook table (torch keeps a with_kwargs flag in a table of its own)."""
    return {k: len(v) for k, v in vars(module_mod).items() if k.startswith("_global_") and isinstance(v, dict)}


def _run(tmp_path, kind, compile_at, fullgraph):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)) if kind == "sequential" else MLP()
    run = model
    if compile_at == "before":
        run = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "timeline.jsonl"
    hooks_before = _global_hooks()
    agent = A.watch(model, opt, peak_flops=1e12, report_every_steps=4, exporter=False, timeline=str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i in range(12):
                if compile_at == "after" and i == 3:  # the counted step (2) ran eagerly
                    run = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
                loss = run(torch.randn(32, 64)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        finally:
            agent.close()
    hooks_after = _global_hooks()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if "model_flops" in r], [str(w.message) for w in caught], hooks_before, hooks_after


@pytest.mark.parametrize("kind", ["sequential", "user_class"])
@pytest.mark.parametrize("compile_at", ["before", "after"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_wrapper_is_measured_and_never_breaks_the_compile(tmp_path, caplog, kind, compile_at, fullgraph):
    caplog.set_level(logging.INFO, logger="mfuwatch")
    reports, caught, before, after = _run(tmp_path, kind, compile_at, fullgraph)
    assert [r["step"] for r in reports] == [4, 8, 12]
    # compiled before the first step: step 1's forward ran inside the graph, unseen (no earlier step to
    # carry from); every later step counts its 32 samples once
    assert reports[0]["tokens"] == (3 * 32 if compile_at == "before" else 4 * 32)
    assert [r["tokens"] for r in reports[1:]] == [4 * 32, 4 * 32]
    if compile_at == "before" and fullgraph:
        # FlopCounterMode cannot run around a fullgraph compile: no count, said once
        assert all(r["model_flops"] == 0 for r in reports)
        assert sum("fullgraph=True" in m for m in caplog.messages) == 1
    else:
        assert all(r["model_flops"] == pytest.approx(STEP_FLOPS, rel=1e-12) for r in reports)
    assert not [m for m in caught if "Dynamo does not know how to trace" in m or "global hooks" in m], caught
    assert after == before  # no global hook left behind (torch would warn at every wrapper call)
    assert not module_mod._has_any_global_hook()
