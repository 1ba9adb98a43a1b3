"""The Lightning callback: a small LightningModule around the tiny Llama, trained a few steps on the CPU.

As in test_hf.py, a fake clock advances 0.5 s per optimizer step (in ``on_before_optimizer_step``), so MFU
has an exact expected value from the hand-counted FLOPs of conftest.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers.integration_fixtures import (SEQ, TokenDataset, expected_tokens, install_fake_clock,
                                          llama_flops_per_token)

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

from mfuwatch.agent import Agent  # noqa: E402
from mfuwatch.agent.integrations.lightning import MFUWatchCallback, find_transformer  # noqa: E402
from mfuwatch.agent.timeline import read_timeline  # noqa: E402

PEAK = 1e12
STEP_SECONDS = 0.5
AGENT = dict(nvml=False, profile_every="off", alerts=False, report_every_steps=1000, peak_flops=PEAK)


class LlamaModule(L.LightningModule):
    """``training_step`` calls the wrapped Hugging Face model, not ``self(...)``."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def validation_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class FakeTime(L.Callback):
    """After MFUWatchCallback: fake step clock; 0.5 s per optimizer step; ``val_seconds`` per validation batch."""

    def __init__(self, mfu_cb, val_seconds: float = 0.0) -> None:
        self.mfu_cb, self.val_seconds = mfu_cb, val_seconds
        self.now = None
        self.batches_per_step = []
        self._n = 0

    def on_train_start(self, trainer, pl_module):
        self.now = install_fake_clock(self.mfu_cb.agent)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._n += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.now.t += STEP_SECONDS
        self.batches_per_step.append(self._n)
        self._n = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.now.t += self.val_seconds


def _fit(module, n, callbacks, val_every=None):
    loader = torch.utils.data.DataLoader(TokenDataset(n), batch_size=2)
    val = torch.utils.data.DataLoader(TokenDataset(4, seed=1), batch_size=2) if val_every else None
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=callbacks,
                        val_check_interval=val_every, limit_val_batches=2 if val_every else 0)
    trainer.fit(module, loader, val)
    return trainer


def test_lightning_accumulation_tokens_and_mfu(tmp_path, tiny_llama):
    timeline = tmp_path / "timeline.jsonl"
    cb = MFUWatchCallback(run="pl-test", exporter=False, timeline=str(timeline), **AGENT)
    fake = FakeTime(cb)
    _fit(LlamaModule(tiny_llama), 10, [cb, fake])

    # 5 batches of 2 with accumulate_grad_batches=2: steps of 2, 2 and 1 batches (the epoch's end steps)
    assert fake.batches_per_step == [2, 2, 1]
    per_step = {1: 2 * 2 * SEQ, 2: 2 * 2 * SEQ, 3: 2 * SEQ}
    agent = cb.agent
    assert agent.model is tiny_llama  # the Hugging Face model inside the LightningModule is what is watched
    assert agent.run_info.flops_source == "analytic"
    lab = {"run": "pl-test", "rank": "0"}
    assert agent.registry.get_sample_value("mfuwatch_steps_total", lab) == 3
    assert agent.registry.get_sample_value("mfuwatch_tokens_total", lab) == 160
    assert agent.registry.get_sample_value("mfuwatch_step_duration_seconds_sum", lab) == pytest.approx(1.5)
    records = [r for r in read_timeline(timeline) if r["kind"] == "step"]
    assert sum(r["steps"] for r in records) == 3
    per_tok = llama_flops_per_token()
    for r in records:
        assert r["tokens"] == expected_tokens(r["step"] - r["steps"] + 1, r["step"], per_step)
        assert r["mfu"] == pytest.approx(per_tok * r["tokens"] / r["steps"] / STEP_SECONDS / PEAK)
    assert agent.registry.get_sample_value("mfuwatch_mfu_ratio", lab) == pytest.approx(records[-1]["mfu"])


class TupleModule(L.LightningModule):
    """A plain-PyTorch module fed (x, y) tuples, with its shape given to the agent (model_shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, x):
        return self.head(self.emb(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_tuple_batches_and_user_model_shape(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (8, SEQ), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=4)
    cb = MFUWatchCallback(run="pl-tuple", exporter=False, model_shape={"n_layers": 1, "d_model": 32}, **AGENT)
    fake = FakeTime(cb)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb, fake])
    module = TupleModule()
    trainer.fit(module, loader)
    m = cb.agent.latest
    assert fake.batches_per_step == [1, 1]
    assert m.tokens == 2 * 4 * SEQ
    n = 32 * 64  # the head is the only matmul
    assert m.mfu == pytest.approx((6 * n + 12 * 1 * 32 * SEQ) * 4 * SEQ / STEP_SECONDS / PEAK)


def test_validation_time_is_not_training_time(tmp_path, tiny_llama):
    cb = MFUWatchCallback(run="pl-val", exporter=False, **AGENT)
    fake = FakeTime(cb, val_seconds=10.0)
    _fit(LlamaModule(tiny_llama), 8, [cb, fake], val_every=2)  # validation after every optimizer step
    lab = {"run": "pl-val", "rank": "0"}
    assert cb.agent.registry.get_sample_value("mfuwatch_tokens_total", lab) == 128
    assert cb.agent.registry.get_sample_value("mfuwatch_step_duration_seconds_sum", lab) == pytest.approx(1.0)


def test_find_transformer_and_precision_facts(tiny_llama):
    module = LlamaModule(tiny_llama)
    assert find_transformer(module) is tiny_llama
    plain = TupleModule()
    assert find_transformer(plain) is plain
    from mfuwatch.agent.integrations.lightning import PRECISION_DTYPES

    assert PRECISION_DTYPES["bf16-mixed"] == "bf16" and PRECISION_DTYPES["16-mixed"] == "fp16"
    assert "32-true" not in PRECISION_DTYPES  # fp32 vs tf32 is left to the agent's detection


def test_rank_facts_from_the_trainer(tmp_path, tiny_llama):
    cb = MFUWatchCallback(exporter=False, **AGENT)
    trainer = _fit(LlamaModule(tiny_llama), 4, [cb])
    info = cb.agent.run_info
    assert (info.rank, info.local_rank, info.world_size) == (trainer.global_rank, trainer.local_rank, 1)
    assert info.dtype == "fp32"
    assert info.run  # a default run name was filled in


class SleepyValidation(L.Callback):
    """Each validation batch takes ``seconds`` of real time; counts the validations Lightning ran."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.validations = seconds, 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        time.sleep(self.seconds)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations += 1


def test_validation_is_an_eval_phase_in_goodput(tmp_path, tiny_llama):
    timeline = tmp_path / "timeline.jsonl"
    cb = MFUWatchCallback(run="pl-phase", exporter=False, timeline=str(timeline), **AGENT)
    sleepy = SleepyValidation(0.3)
    _fit(LlamaModule(tiny_llama), 8, [cb, sleepy], val_every=2)
    phases = [r for r in read_timeline(timeline) if r["kind"] == "phase"]
    assert sleepy.validations >= 1
    assert [p["name"] for p in phases] == ["eval"] * sleepy.validations
    assert all(p["seconds"] >= 2 * 0.3 for p in phases)  # 2 validation batches of 0.3 s each
    evals = cb.agent.registry.get_sample_value("mfuwatch_goodput_seconds_total",
                                               {"run": "pl-phase", "rank": "0", "bucket": "eval"})
    assert evals == pytest.approx(sum(p["seconds"] for p in phases), abs=0.05)
