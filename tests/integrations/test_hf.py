"""The Hugging Face Trainer callback: a tiny LlamaForCausalLM trained a few steps on the CPU.

Step time comes from a fake clock advanced by 0.5 s in ``on_pre_optimizer_step`` (after every micro-batch's
forward and backward, before the boundary), so MFU has an exact expected value:
``(6 N + 12 L d T) x tokens per step / 0.5 s / peak``, with N counted by hand from the config (conftest).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from helpers.integration_fixtures import (SEQ, TokenDataset, expected_tokens, install_fake_clock,
                                          llama_flops_per_token)

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from mfuwatch.agent import Agent  # noqa: E402
from mfuwatch.agent.integrations.hf import MFUWatchCallback  # noqa: E402
from mfuwatch.agent.timeline import read_timeline  # noqa: E402

PEAK = 1e12
STEP_SECONDS = 0.5
AGENT = dict(nvml=False, profile_every="off", alerts=False, report_every_steps=1000, peak_flops=PEAK)


class FakeTime(TrainerCallback):
    """Runs after MFUWatchCallback: fake step clock, 0.5 s per optimizer step, ``eval_seconds`` per eval batch."""

    def __init__(self, mfu_cb: MFUWatchCallback, eval_seconds: float = 0.0, scrape_at_step: int = 0) -> None:
        self.mfu_cb, self.eval_seconds, self.scrape_at_step = mfu_cb, eval_seconds, scrape_at_step
        self.now = None
        self.scraped = ""
        self.micro_batches = []  # micro-batches of each optimizer step, as the Trainer ran them
        self._n = 0

    def on_train_begin(self, args, state, control, **kw):
        self.now = install_fake_clock(self.mfu_cb.agent)

    def on_step_begin(self, args, state, control, **kw):
        self._n = 1

    def on_substep_end(self, args, state, control, **kw):
        self._n += 1

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.now.t += STEP_SECONDS
        self.micro_batches.append(self._n)

    def on_prediction_step(self, args, state, control, **kw):
        self.now.t += self.eval_seconds

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.scrape_at_step:  # the agent's thread absorbs boundaries every 0.2 s
            deadline = time.monotonic() + 20
            while 'rank="0",run="hf-test"} 2.0' not in self.scraped and time.monotonic() < deadline:
                time.sleep(0.05)
                self.scraped = urllib.request.urlopen(self.mfu_cb.agent.exporter_url, timeout=5).read().decode()


def _train(tmp_path, model, n_samples, callbacks, **args):
    targs = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=1, learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0, **args)
    trainer = Trainer(model=model, args=targs, train_dataset=TokenDataset(n_samples), callbacks=callbacks,
                      eval_dataset=TokenDataset(4, seed=1) if args.get("eval_strategy") else None)
    trainer.train()
    return trainer


def _steps(timeline):
    return [r for r in read_timeline(timeline) if r["kind"] == "step"]


def test_trainer_gradient_accumulation_tokens_and_mfu(tmp_path, tiny_llama):
    # 10 samples, 2 per micro-batch, 2 micro-batches per step: steps of 2, 2 and 1 micro-batches
    # (the epoch's last step is short), i.e. 2*2*16 = 64, 64 and 32 tokens.
    timeline = tmp_path / "timeline.jsonl"
    cb = MFUWatchCallback(run="hf-test", port=0, timeline=str(timeline), **AGENT)
    fake = FakeTime(cb, scrape_at_step=2)
    _train(tmp_path, tiny_llama, 10, [cb, fake])

    assert fake.micro_batches == [2, 2, 1]
    per_step = {1: 2 * 2 * SEQ, 2: 2 * 2 * SEQ, 3: 1 * 2 * SEQ}
    agent = cb.agent
    assert agent.run_info.flops_source == "analytic"
    assert agent.run_info.run == "hf-test" and agent.run_info.rank == 0 and agent.run_info.world_size == 1
    lab = {"run": "hf-test", "rank": "0"}
    assert agent.registry.get_sample_value("mfuwatch_steps_total", lab) == 3
    assert agent.registry.get_sample_value("mfuwatch_tokens_total", lab) == 160
    assert agent.registry.get_sample_value("mfuwatch_step_duration_seconds_count", lab) == 3
    assert agent.registry.get_sample_value("mfuwatch_step_duration_seconds_sum", lab) == pytest.approx(1.5)

    records = _steps(timeline)
    assert sum(r["steps"] for r in records) == 3 and records[-1]["step"] == 3
    per_tok = llama_flops_per_token()
    for r in records:  # however the agent grouped the steps into reports
        first = r["step"] - r["steps"] + 1
        assert r["tokens"] == expected_tokens(first, r["step"], per_step)
        assert r["step_time_seconds"] == pytest.approx(STEP_SECONDS)
        assert r["model_flops"] == pytest.approx(per_tok * r["tokens"] / r["steps"])
        assert r["mfu"] == pytest.approx(per_tok * r["tokens"] / r["steps"] / STEP_SECONDS / PEAK)
    assert agent.registry.get_sample_value("mfuwatch_mfu_ratio", lab) == pytest.approx(records[-1]["mfu"])

    # scraped over HTTP while training ran (after step 2)
    assert 'mfuwatch_steps_total{job="hf-test",rank="0",run="hf-test"} 2.0' in fake.scraped
    assert 'mfuwatch_tokens_total{job="hf-test",rank="0",run="hf-test"} 128.0' in fake.scraped


def test_even_steps_give_exactly_b_times_t_times_accumulation(tmp_path, tiny_llama):
    timeline = tmp_path / "timeline.jsonl"
    cb = MFUWatchCallback(run="hf-even", exporter=False, timeline=str(timeline), **AGENT)
    fake = FakeTime(cb)
    _train(tmp_path, tiny_llama, 8, [cb, fake])
    assert fake.micro_batches == [2, 2]
    m = cb.agent.latest
    assert m is not None and m.step == 2
    assert m.tokens == 2 * (2 * 2 * SEQ)  # per_device_train_batch_size * accumulation * seq per step
    assert m.tokens_per_second == pytest.approx(2 * 2 * SEQ / STEP_SECONDS)
    assert m.mfu == pytest.approx(llama_flops_per_token() * 64 / STEP_SECONDS / PEAK)


def test_evaluation_time_is_not_training_time(tmp_path, tiny_llama):
    # every step is followed by an evaluation of 2 batches that takes 10 s of fake time each
    timeline = tmp_path / "timeline.jsonl"
    cb = MFUWatchCallback(run="hf-eval", exporter=False, timeline=str(timeline), **AGENT)
    fake = FakeTime(cb, eval_seconds=10.0)
    _train(tmp_path, tiny_llama, 8, [cb, fake], eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2)
    lab = {"run": "hf-eval", "rank": "0"}
    assert cb.agent.registry.get_sample_value("mfuwatch_tokens_total", lab) == 128  # eval forwards not counted
    assert cb.agent.registry.get_sample_value("mfuwatch_step_duration_seconds_sum", lab) == pytest.approx(1.0)
    assert cb.agent.latest.mfu == pytest.approx(llama_flops_per_token() * 64 / STEP_SECONDS / PEAK)


def test_patch_kernels_runs_at_init_before_the_optimizer(tmp_path, tiny_llama, monkeypatch):
    import mfuwatch.kernels

    calls = []

    class Report:
        swapped = {"recorded": 0}

    def recording_patch(model, **kwargs):
        calls.append((model, kwargs))
        return Report()

    monkeypatch.setattr(mfuwatch.kernels, "patch", recording_patch, raising=False)
    cb = MFUWatchCallback(patch_kernels={"kernels": ["rms_norm"]}, exporter=False, **AGENT)
    trainer = Trainer(model=tiny_llama, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                               report_to="none", max_steps=1),
                      train_dataset=TokenDataset(2), callbacks=[cb])
    # patched while the Trainer was built (on_init_end), before train() creates the optimizer
    assert calls == [(tiny_llama, {"kernels": ["rms_norm"]})]
    assert trainer.optimizer is None
    assert isinstance(cb.patch_report, Report)
    trainer.train()
    assert len(calls) == 1  # not patched twice


def test_patch_failure_leaves_training_running(tmp_path, tiny_llama, monkeypatch, caplog):
    import mfuwatch.kernels

    def broken_patch(model, **kwargs):
        raise RuntimeError("no triton here")

    monkeypatch.setattr(mfuwatch.kernels, "patch", broken_patch, raising=False)
    cb = MFUWatchCallback(patch_kernels=True, exporter=False, **AGENT)
    with caplog.at_level("WARNING", logger="mfuwatch"):
        _train(tmp_path, tiny_llama, 4, [cb])
    assert cb.patch_report is None
    assert any("mfuwatch.kernels.patch failed" in r.getMessage() for r in caplog.records)
    assert cb.agent.latest is not None and cb.agent.latest.step == 1


def test_rank_and_dtype_come_from_training_arguments(tmp_path, tiny_llama):
    cb = MFUWatchCallback(exporter=False, **{k: v for k, v in AGENT.items() if k != "peak_flops"})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=True,
                             run_name="my-run", max_steps=1)
    facts = cb._framework_facts(args)
    assert facts["dtype"] == "bf16" and facts["run"] == "my-run"
    assert (facts["rank"], facts["local_rank"], facts["world_size"]) == (0, 0, 1)
    # the user's setting wins over the Trainer's fact
    cb2 = MFUWatchCallback(exporter=False, dtype="fp32", run="mine", **AGENT)
    from mfuwatch.agent.integrations._common import build_config

    cfg = build_config(cb2.config, cb2.overrides, facts)
    assert cfg.dtype == "fp32" and cfg.run == "mine"


def test_callback_file_sd_target_lives_while_training(tmp_path, tiny_llama):
    sd = tmp_path / "sd"
    cb = MFUWatchCallback(run="hf-sd", port=0, file_sd_dir=str(sd), **AGENT)

    class Peek(TrainerCallback):
        seen = None

        def on_step_end(self, args, state, control, **kw):
            Peek.seen = json.loads((sd / "hf-sd-rank0.json").read_text())

    _train(tmp_path, tiny_llama, 4, [cb, Peek()])
    port = cb.agent.exporter_url.rsplit(":", 1)[1].split("/")[0]
    assert Peek.seen == [{"targets": [f"127.0.0.1:{port}"], "labels": {"__metrics_path__": "/metrics"}}]
    assert not (sd / "hf-sd-rank0.json").exists()  # removed when training ended


def test_late_patch_that_replaces_parameters_is_reported(tmp_path, tiny_llama, monkeypatch, caplog):
    # The callback is added after the Trainer was built, so it can only patch at on_train_begin, when the
    # optimizer already exists. A patch that swaps in a module with new parameters must be flagged.
    import mfuwatch.kernels
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def swapping_patch(model, **kwargs):
        model.model.norm = LlamaRMSNorm(model.config.hidden_size)  # fresh nn.Parameter, unknown to the optimizer
        return "swapped"

    monkeypatch.setattr(mfuwatch.kernels, "patch", swapping_patch, raising=False)
    cb = MFUWatchCallback(patch_kernels=True, exporter=False, **AGENT)
    trainer = Trainer(model=tiny_llama, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                               report_to="none", max_steps=1),
                      train_dataset=TokenDataset(2))
    trainer.add_callback(cb)
    with caplog.at_level("ERROR", logger="mfuwatch"):
        trainer.train()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert cb.patch_report == "swapped"
    assert any("optimizer does not hold 1 parameter(s) (e.g. model.norm.weight)" in e for e in errors), errors


_PATCHED_RUN = r'''
import json, sys, torch, transformers
sys.path.insert(0, sys.argv[1])
from helpers.integration_fixtures import TokenDataset, make_tiny_llama
from transformers import Trainer, TrainingArguments
from mfuwatch.agent.integrations.hf import MFUWatchCallback

def train(patch):
    model = make_tiny_llama()
    cb = MFUWatchCallback(patch_kernels=patch, exporter=False, nvml=False, alerts=False, profile_every="off",
                          peak_flops=1e12, run="patched")
    args = TrainingArguments(output_dir=sys.argv[2], per_device_train_batch_size=2, use_cpu=True, report_to="none",
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, max_steps=2, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(4), callbacks=[cb])
    loss = trainer.train().training_loss
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    report = cb.patch_report
    return {"swapped": sorted([s.name, s.kernel] for s in report.swapped) if report else None, "loss": loss,
            "all_params_in_optimizer": all(id(p) in held for p in model.parameters()),
            "tokens": cb.agent.registry.get_sample_value("mfuwatch_tokens_total", {"run": "patched", "rank": "0"}),
            "step": cb.agent.latest.step, "mfu": cb.agent.latest.mfu}

print(json.dumps({"patched": train({"kernels": ["rms_norm", "swiglu"]}), "plain": train(False)}))
'''


@pytest.mark.slow
def test_real_kernel_patch_trains_the_same_model(tmp_path):
    # mfuwatch.kernels.patch with the Triton kernels run by the interpreter on the CPU (TRITON_INTERPRET=1 is read
    # when the kernels are imported, hence a fresh process)
    import os
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, "-c", _PATCHED_RUN, str(Path(__file__).parents[1]), str(tmp_path)],
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    p, plain = out["patched"], out["plain"]
    norms = [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    assert p["swapped"] == sorted([[n, "rms_norm"] for n in norms + ["model.norm"]]
                                  + [[f"model.layers.{i}.mlp", "swiglu"] for i in range(2)])
    assert p["all_params_in_optimizer"]
    assert p["loss"] == pytest.approx(plain["loss"], rel=1e-4)  # fp32: the fused kernels compute the same model
    assert p["step"] == plain["step"] == 2 and p["tokens"] == plain["tokens"] == 2 * (2 * SEQ)
    assert p["mfu"] > 0


class SlowEval(TrainerCallback):
    """Each evaluation batch takes ``seconds`` of real time (the alert engine's clock is the real one)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_prediction_step(self, args, state, control, **kw):
        time.sleep(self.seconds)


#: TrainingStalled pages after 2 s without a step; the watchdog looks every second.
STALL_ALERTS = {"watchdog_interval": "1s", "evaluation_interval": "1s", "notifiers": [],
                "rules": {"TrainingStalled": {"threshold": 2, "for": "0s"}}}


def _stall_alerts(timeline):
    return [r for r in read_timeline(timeline)
            if r["kind"] == "alert" and r["alertname"] == "TrainingStalled" and r["status"] == "firing"]


def test_evaluation_does_not_page_training_stalled(tmp_path, tiny_llama):
    """Issue 16: the callback's mark_gap() came only after the eval, so a 4 s eval paged TrainingStalled."""
    timeline = tmp_path / "timeline.jsonl"
    agent_cfg = dict(AGENT, alerts=STALL_ALERTS, report_every_steps=1)
    cb = MFUWatchCallback(run="hf-stall", exporter=False, timeline=str(timeline), hang_floor_seconds=1.0, **agent_cfg)
    # 3 optimizer steps; after steps 2 and 3 (the last) an evaluation of 2 batches x 2 s (> the 2 s threshold)
    _train(tmp_path, tiny_llama, 16, [cb, SlowEval(2.0)], eval_strategy="steps", eval_steps=2,
           per_device_eval_batch_size=2, max_steps=3)
    assert _stall_alerts(timeline) == []
    phases = [r for r in read_timeline(timeline) if r["kind"] == "phase"]
    assert [(p["name"], p["step"]) for p in phases] == [("eval", 2), ("eval", 3)]
    assert all(p["seconds"] >= 4.0 for p in phases)
    evals = cb.agent.registry.get_sample_value("mfuwatch_goodput_seconds_total",
                                               {"run": "hf-stall", "rank": "0", "bucket": "eval"})
    assert evals == pytest.approx(sum(p["seconds"] for p in phases), abs=0.05)
    assert not [r for r in read_timeline(timeline) if r["kind"] == "hang"]  # the hang watchdog was paused too


def test_the_same_pause_without_a_phase_does_page(tmp_path):
    """Control for the test above: a 4 s pause between steps that is not a phase pages TrainingStalled."""
    timeline = tmp_path / "timeline.jsonl"
    agent = Agent(config=dict(AGENT, alerts=STALL_ALERTS, report_every_steps=1, exporter=False, run="hf-stall-ctl",
                              timeline=str(timeline), flops_per_step=1e9, hang_watchdog=False))
    for _ in range(3):
        agent.step(tokens=10)
        time.sleep(0.1)
    time.sleep(4.0)
    agent.step(tokens=10)
    agent.close()
    assert len(_stall_alerts(timeline)) == 1
