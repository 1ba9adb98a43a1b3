"""The counted FLOP path (FlopCounterMode over one real step) on state-space and hybrid families.

Zamba and Zamba2 are not here: their small configs do not build under transformers 5.24 (shared-layer
weight tying and layer-type validation reject them). These models have no analytic rule (Mamba mixers: ``A_log``, depthwise ``conv1d``), so the agent counts
them. The reference is independent of mfuwatch's formulas: FlopCounterMode with torch's own formulas
over the model with **eager** experts (plain ``F.linear`` per expert, which torch counts; torch has no
formula for ``aten._grouped_mm``), with the depthwise convolution's backward taken as twice the forward
convolution (input and weight gradients, each as many FLOPs as the forward): torch's weight-gradient
formula forms it as an ungrouped convolution and counts ``C`` times too much for a depthwise one.

Jamba (Mamba + attention + MoE) is trained under every experts implementation the installed
transformers has (eager, grouped_mm, batched_mm): the routed experts must count the same in each.
"""

from __future__ import annotations

import pytest
import torch

from mfuwatch.agent import Agent
from mfuwatch.agent.flops import architectures as A

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2)
FAMILIES = {
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
        mamba_d_conv=2, mamba_expand=2)),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(state_size=4, expand=2, conv_kernel=2, time_step_rank=4)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(state_size=8, expand=2, conv_kernel=2, num_heads=8,
                                                         head_dim=8, n_groups=1, chunk_size=4)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8,
        mamba_d_head=8, mamba_d_state=8, mamba_d_conv=2, mamba_expand=2, mamba_chunk_size=4)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8,
        mamba_d_state=8, mamba_d_conv=2, mamba_expand=2, mamba_chunk_size=4, attn_layer_indices=[1])),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8,
        mamba_d_conv=2, mamba_expand=2, mamba_chunk_size=4, layer_types=["mamba", "attention"])),
}


def _build(family, experts=None):
    cfg_name, model_name, kw = FAMILIES[family]
    if not hasattr(transformers, cfg_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cfg_name}")
    kw = dict(SMALL, **kw)
    if experts is not None:
        kw["experts_implementation"] = experts
    cfg = getattr(transformers, cfg_name)(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg)


def _reference(model, x):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        model(input_ids=x, labels=x).loss.backward()
    model.zero_grad()
    c = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    return sum(c.values()) - c.get("aten.convolution_backward", 0) + 2 * c.get("aten.convolution", 0)


def _counted(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, exporter=False, nvml=False, alerts=False, profile_every="off", report_every_steps=2,
              peak_flops=1e12, progress=False, run="t")
    for _ in range(2):  # the 2nd step is the counted one
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    a.close()
    return a


X = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_jamba_counted_path_counts_routed_experts_alike_under_every_experts_implementation():
    ref = _reference(_build("jamba", "eager"), X)
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            model = _build("jamba", impl)
        except (ValueError, KeyError) as exc:  # an implementation this transformers lacks
            assert impl != "eager", exc
            continue
        a = _counted(model, X)
        assert a.run_info.flops_source == "flop_counter"
        # no recomputation: model FLOPs = hardware FLOPs = the count (backward = 2 x forward, also for conv1d)
        assert a.latest.model_flops == pytest.approx(ref, rel=1e-6), impl
        assert a.latest.hardware_flops == pytest.approx(ref, rel=1e-6), impl


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_h1", "bamba", "granitemoehybrid"])
def test_state_space_and_hybrid_families_on_the_counted_path(family):
    model = _build(family)
    with pytest.raises(A.UnknownArchitecture):  # no analytic rule: the agent must count
        A.from_model(model)
    ref = _reference(_build(family, "eager") if family == "granitemoehybrid" else model, X)
    a = _counted(model, X)
    assert a.run_info.flops_source == "flop_counter"
    assert a.latest.model_flops == pytest.approx(ref, rel=1e-6)
    assert a.latest.hardware_flops == pytest.approx(ref, rel=1e-6)


def test_depthwise_conv_backward_formula_by_hand():
    from mfuwatch.agent.flops.op_flops import conv_backward_flops

    # conv1d over 64 channels, groups 64, kernel 2, batch 2, length 9: the forward is 2*2*64*9*(1*2) FLOPs
    fwd = 2 * (2 * 64 * 9) * (1 * 2)
    assert conv_backward_flops((2, 64, 9), (2, 64, 8), (64, 1, 2), False, [True, True, False]) == 2 * fwd
    assert conv_backward_flops((2, 64, 9), (2, 64, 8), (64, 1, 2), False, [False, True, False]) == fwd
    # a plain conv2d 3 -> 8 channels, 3x3 kernel, 4x4 output
    fwd2 = 2 * (1 * 8 * 4 * 4) * (3 * 3 * 3)
    assert conv_backward_flops((1, 8, 4, 4), (1, 3, 6, 6), (8, 3, 3, 3), False, [True, True, True]) == 2 * fwd2
    # as a profiler trace records it: bools as strings (the trace analysis reads the same formula)
    from mfuwatch.agent.flops.op_flops import trace_op_flops

    dims = [[1, 8, 4, 4], [1, 3, 6, 6], [8, 3, 3, 3], [], [], [], [], "False", [], "1", "[False, True, False]"]
    assert trace_op_flops("aten::convolution_backward", dims) == fwd2
