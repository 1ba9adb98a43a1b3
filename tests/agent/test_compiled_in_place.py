"""A model compiled in place (``module.compile()``) is counted like ``torch.compile(module)``: the whole step.

The step's FLOPs are derived by hand for ``Linear(64, 128) -> ReLU -> Linear(128, 64)`` on a batch of 32
whose input needs no gradient: forward ``2*32*(64*128 + 128*64) = 1,048,576``; backward: both weight
gradients (``1,048,576``) and the input gradient of the second layer only (``2*32*128*64 = 524,288``);
``2,621,440`` in all. Biases, ReLU and the loss are not matmuls (FlopCounterMode counts none of them).
"""

import json

import pytest
import torch
import torch.nn as nn

import mfuwatch.agent as A

STEP_FLOPS = 2 * 32 * (64 * 128 + 128 * 64) + 2 * 32 * (64 * 128 + 128 * 64) + 2 * 32 * 128 * 64


def _run(tmp_path, compile_at):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    if compile_at == "before":
        model.compile(backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "timeline.jsonl"
    agent = A.watch(model, opt, peak_flops=1e12, report_every_steps=4, exporter=False, timeline=str(path))
    try:
        for i in range(12):
            if compile_at == "after" and i == 3:
                model.compile(backend="aot_eager")
            loss = model(torch.randn(32, 64)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        agent.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return model, [r for r in records if "model_flops" in r]


@pytest.mark.parametrize("compile_at", ["before", "after"])
def test_in_place_compile_counts_the_whole_step(tmp_path, compile_at):
    model, reports = _run(tmp_path, compile_at)
    assert [r["step"] for r in reports] == [4, 8, 12]
    for r in reports[1:]:  # the first report may hold the compiling step (warm-up)
        assert r["model_flops"] == pytest.approx(STEP_FLOPS, rel=1e-12)
    # close() gives the module its own compiled call back
    assert type(model._compiled_call_impl).__name__ != "Call"
    assert model._compiled_call_impl is not None
