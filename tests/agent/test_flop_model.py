"""The agent's FLOP model end to end: HF families through Agent, counter failures, and the two H200 bugs."""

import logging
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _python_dispatch
from torch.utils.flop_counter import FlopCounterMode

from mfuwatch.agent import Agent
from mfuwatch.agent.flops import op_flops
from mfuwatch.agent.demo import DemoLM, DemoShape
from mfuwatch.agent.schema import GpuHealth
from tests.helpers.integration_fixtures import install_fake_clock

BASE = dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="t")
transformers = pytest.importorskip("transformers")



def _train(agent, model, opt, batches, now):
    for kw in batches:
        model(**kw).loss.backward()
        now.t += 0.5
        opt.step()
        opt.zero_grad()


def _truth(model, kw):
    with FlopCounterMode(display=False, custom_mapping=op_flops.flop_counter_mapping()) as fc:
        model(**kw).loss.backward()
    model.zero_grad()
    return fc.get_total_flops()


def test_mixtral_through_the_agent_within_2_percent_and_breakdown():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    x = torch.randint(0, 64, (2, 10))
    truth = _truth(model, dict(input_ids=x, labels=x))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=3))
    assert a.run_info.flops_source == "analytic"
    now = install_fake_clock(a, start=True)
    _train(a, model, opt, [dict(input_ids=x, labels=x)] * 3, now)
    a.close()
    assert a.latest.model_flops == pytest.approx(truth, rel=0.02)
    text = a.flops_breakdown(print_it=False)
    assert "experts (routed)" in text and "router" in text and "attention scores" in text
    # the lengths in words (2 sequences of 10 tokens per step), no dataclass repr
    assert "; 2 sequences of 10 tokens" in text and "Lengths(" not in text, text
    counted = a.flops_breakdown(print_it=False, count=True)  # a rebuild from the config, counted
    assert "ratio 1.000" in counted and "untracked ops (counted 0): none" in counted, counted


def test_vit_through_the_agent_counts_images_and_patch_tokens():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
                                 image_size=16, patch_size=4, num_labels=3, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg)
    kw = dict(pixel_values=torch.randn(3, 3, 16, 16), labels=torch.tensor([0, 1, 2]))
    truth = _truth(model, kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=2))
    now = install_fake_clock(a, start=True)
    _train(a, model, opt, [kw] * 2, now)
    a.close()
    assert a.latest.tokens == 2 * 3  # images: the first dimension of pixel_values
    assert a.latest.model_flops == pytest.approx(truth, rel=0.02)  # 17 tokens per image inside the formula


def test_lora_merge_is_re_read_off_the_hot_path():
    peft = pytest.importorskip("peft", reason="peft is in the dev extra")
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager"))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    x = torch.randint(0, 64, (2, 12))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=1))
    a.hooks.seq_len = 12
    lora = a.flops_per_step(24)[0]
    assert lora == pytest.approx(_truth(model, dict(input_ids=x, labels=x)), rel=0.02)
    model.merge_adapter()
    base.lm_head.weight.requires_grad_(True)
    merged = a.flops_per_step(24)[0]  # the agent thread's call notices the new trainable set
    a.close()
    assert merged != lora and merged == pytest.approx(_truth(model, dict(input_ids=x, labels=x)), rel=0.02)


def _demo():
    s = DemoShape(vocab=32, d_model=16, n_layers=1, n_heads=2, d_ff=24, seq=6, batch=2)
    torch.manual_seed(0)
    return s, DemoLM(s)


def _plain_steps(model, opt, s, n, now, a_step_done=None):
    for _ in range(n):
        x = torch.randint(0, s.vocab, (s.batch, s.seq))
        F.cross_entropy(model(x).view(-1, s.vocab), x.view(-1)).backward()
        now.t += 0.5
        opt.step()
        opt.zero_grad()
        assert not _python_dispatch._get_current_dispatch_mode_stack()  # the counter never stays on
        if a_step_done is not None:
            a_step_done()


def test_a_formula_that_raises_in_the_counted_step_does_not_reach_training(monkeypatch, caplog):
    from torch.utils import flop_counter

    def boom(*args, **kwargs):
        raise RuntimeError("formula exploded")

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, boom)
    s, model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=1))
    assert a.run_info.flops_source == "flop_counter"
    now = install_fake_clock(a, start=True)
    with caplog.at_level(logging.WARNING, logger="mfuwatch"):
        _plain_steps(model, opt, s, 4, now)  # step 2 is the counted one: it must not raise
    a.close()
    assert a.errors.get("flops") == 1
    assert sum("flops failed" in r.getMessage() for r in caplog.records) == 1
    assert a.latest is not None and a.latest.mfu is None and a.latest.steps == 1  # training went on


def test_a_finish_that_fails_still_switches_the_counter_off(monkeypatch):
    from mfuwatch.agent.flops import counter as flops

    real = flops._safe_flop_counter_mode

    def failing_exit_mode():
        mode = real()
        inner_exit = type(mode).__exit__

        def bad_exit(*exc):
            raise RuntimeError("exit failed")

        mode.__exit__ = bad_exit  # the mode stays entered: finish() must take it off the stack
        mode._inner_exit = inner_exit
        return mode

    monkeypatch.setattr(flops, "_safe_flop_counter_mode", failing_exit_mode)
    s, model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=1))
    now = install_fake_clock(a, start=True)
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    n_hooks = len(hooks)
    grew = []
    # asserts an empty dispatch-mode stack after every step; the module tracker's global hooks go too
    _plain_steps(model, opt, s, 5, now, lambda: grew.append(len(hooks) > n_hooks))
    a.close()
    assert grew == [False] * 5
    assert a.errors.get("flops") == 1 and a.flop_model.counter is None


def test_nvml_sample_during_construction_is_handled(monkeypatch, tmp_path):
    # the NVML thread may deliver its first sample before Agent.__init__ returns (seen on the H200)
    def start_nvml(self):
        self.reporter.on_gpu_sample(GpuHealth(timestamp=time.time(), utilization=0.5))

    monkeypatch.setattr(Agent, "_start_nvml", start_nvml)
    a = Agent(config=dict(BASE, flops_per_step=1.0, timeline=str(tmp_path / "t.jsonl")))
    a.close()
    assert a.errors.snapshot() == {}
    assert '"kind":"gpu"' in (tmp_path / "t.jsonl").read_text()


def test_profile_window_outcomes_other_than_ok_are_counted():
    s, model = _demo()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = Agent(model, opt, config=dict(BASE, flops_per_step=1.0, profile_every="2 steps", profile_warmup_steps=0,
                                      profile_active_steps=1))
    now = install_fake_clock(a, start=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):  # the user's own profiler
        _plain_steps(model, opt, s, 5, now)
    a.close()
    skipped = a.registry.get_sample_value("mfuwatch_profile_windows_total",
                                          {"run": "t", "rank": "0", "outcome": "skipped_other_profiler"})
    assert a.profiler.windows["skipped_other_profiler"] >= 1
    assert skipped == a.profiler.windows["skipped_other_profiler"]


def test_bad_flop_settings_fail_at_start_naming_the_field():
    from mfuwatch.agent.config import ConfigError

    with pytest.raises(ConfigError, match="attention_flops: expected one of full, causal"):
        Agent(config=dict(BASE, attention_flops="half"))
    with pytest.raises(ConfigError, match="context_parallel_size: expected a positive integer"):
        Agent(config=dict(BASE, context_parallel_size=0))


def test_causal_option_and_breakdown_of_an_unknown_model():
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4))
    full = Agent(m, config=dict(BASE, flops_per_step=None))
    causal = Agent(m, config=dict(BASE, attention_flops="causal"))
    full.hooks.seq_len = causal.hooks.seq_len = 8
    d, T = 32, 8
    assert full.flops_per_step(T)[0] - causal.flops_per_step(T)[0] == 12 * d * (T * T - T * (T + 1) // 2)
    full.close()
    causal.close()
    m.model.layers[0].mlp.mystery = torch.nn.Parameter(torch.zeros(3, 3))
    a = Agent(m, config=BASE)
    text = a.flops_breakdown(print_it=False)
    a.close()
    assert a.run_info.flops_source == "flop_counter" and "mystery" in text and "not used" in text


def test_an_architecture_read_before_wrapping_is_adopted():
    # the framework integrations read the model before FSDP (1) flattens it, then hand the reading over
    from mfuwatch.agent.flops import architectures as A

    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4))
    before = A.from_model(m)
    m.model.layers[0].mlp.flat = torch.nn.Parameter(torch.zeros(3, 3))  # stands in for shapes the wrapper hid
    a = Agent(m, config=BASE)
    assert a.flop_model.source == "flop_counter"
    assert a.flop_model.adopt(before) and a.flop_model.source == "analytic" and a.flop_model.counter is None
    a.hooks.seq_len = 8
    expected = before.step_flops(A.Lengths(8), 2)[0]
    assert a.flops_per_step(16)[0] == expected  # and no re-read of the live (wrapped) model
    a.close()


def test_flops_breakdown_returns_without_printing_unless_asked(capsys):
    a = Agent(config=dict(BASE, flops_per_step=3e9))
    a.close()
    text = a.flops_breakdown()
    assert text == "flops_source: user\nflops_per_step = 3e+09 (given)"
    assert capsys.readouterr().out == ""
    assert a.flops_breakdown(print_it=True) == text
    assert capsys.readouterr().out == text + "\n"
