"""Agent core: MFU arithmetic with a fake clock, token counting, gradient accumulation, containment."""

import logging
import socket
import urllib.request

import pytest
import torch
import torch.nn.functional as F

from mfuwatch.agent import Agent, watch
from mfuwatch.agent.core import count_tokens
from mfuwatch.agent.demo import DemoLM, DemoShape
from mfuwatch.agent.flops import analytic_flops_per_token, count_matmul_params
from tests.helpers.integration_fixtures import install_fake_clock
from tests.helpers.net import free_port, scrape

BASE = dict(exporter=False, nvml=False, alerts=False, profile_every="off", run="t")



def test_mfu_hfu_arithmetic_with_fake_clock():
    # 5 steps of 0.25 s, 4096 tokens each, 2e12 model FLOPs and 2.5e12 executed FLOPs per step, peak 1e13:
    # MFU = 2e12 / 0.25 / 1e13 = 0.8 ; HFU = 2.5e12 / 0.25 / 1e13 = 1.0 ; tokens/s = 4096 / 0.25 = 16384
    a = Agent(config=dict(BASE, flops_per_step=2e12, hardware_flops_per_step=2.5e12, peak_flops=1e13,
                          report_every_steps=5))
    now = install_fake_clock(a, start=True)
    for _ in range(5):
        now.t += 0.25
        a.step(tokens=4096)
    a.close()
    m = a.latest
    assert m.steps == 5 and m.step == 5 and m.tokens == 5 * 4096
    assert m.step_time_seconds == pytest.approx(0.25)
    assert m.mfu == pytest.approx(0.8)
    assert m.hfu == pytest.approx(1.0)
    assert m.tokens_per_second == pytest.approx(16384.0)
    assert m.model_flops_per_second == pytest.approx(8e12)


def test_unknown_peak_gives_no_mfu():
    a = Agent(config=dict(BASE, flops_per_step=1e9))
    now = install_fake_clock(a, start=True)
    for _ in range(3):
        now.t += 0.1
        a.step(tokens=10)
    a.close()
    assert a.latest.mfu is None and a.latest.hfu is None
    assert a.latest.model_flops_per_second == pytest.approx(1e10)


@pytest.mark.parametrize("args, kwargs, expected", [
    ((torch.zeros(4, 16, dtype=torch.long),), {}, (64, 16)),
    ((), {"input_ids": torch.zeros(2, 7, dtype=torch.long), "attention_mask": torch.ones(2, 7)}, (14, 7)),
    ((torch.zeros(3, 5, 8),), {}, (15, 5)),  # (B, T, C) embeddings
    ((torch.zeros(6, 3, 32, 32),), {}, (6, None)),  # images: samples
    ((), {}, (0, None)),
])
def test_count_tokens(args, kwargs, expected):
    assert count_tokens(args, kwargs) == expected


def _tiny():
    s = DemoShape(vocab=32, d_model=16, n_layers=1, n_heads=2, d_ff=24, seq=6, batch=2)
    torch.manual_seed(0)
    return s, DemoLM(s)


def test_gradient_accumulation_counts_every_micro_batch():
    s, model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=4,
                                      model_shape={"n_layers": 1, "d_model": 16}))
    now = install_fake_clock(a, start=True)
    accum, steps = 3, 4
    for _ in range(steps):
        for _ in range(accum):
            x = torch.randint(0, s.vocab, (s.batch, s.seq))
            F.cross_entropy(model(x).view(-1, s.vocab), x.view(-1)).backward()
        with torch.no_grad():
            model(torch.randint(0, s.vocab, (5, s.seq)))  # an eval forward: not training tokens
        now.t += 0.5
        opt.step()
        opt.zero_grad()
    a.close()
    m = a.latest
    tokens_per_step = accum * s.batch * s.seq  # 36
    assert m.steps == steps and m.tokens == steps * tokens_per_step
    assert m.tokens_per_second == pytest.approx(tokens_per_step / 0.5)
    per_tok = analytic_flops_per_token(count_matmul_params(model), 1, 16, s.seq)
    assert m.model_flops == pytest.approx(per_tok * tokens_per_step)
    assert m.mfu == pytest.approx(per_tok * tokens_per_step / 0.5 / 1e12)
    assert a.exporter.tokens.labels("t", "0")._value.get() == steps * tokens_per_step


def test_flop_counter_path_measures_one_step():
    s, model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, report_every_steps=3))
    assert a.run_info.flops_source == "flop_counter"
    now = install_fake_clock(a, start=True)
    for _ in range(3):
        x = torch.randint(0, s.vocab, (s.batch, s.seq))
        F.cross_entropy(model(x).view(-1, s.vocab), x.view(-1)).backward()
        now.t += 1.0
        opt.step()
        opt.zero_grad()
    a.close()
    expected = analytic_flops_per_token(count_matmul_params(model), 1, 16, s.seq) * s.batch * s.seq
    assert a.latest.model_flops == pytest.approx(expected, rel=0.02)


def test_injected_failure_does_not_reach_training_loop(monkeypatch, caplog):
    s, model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = Agent(model, opt, config=dict(BASE, peak_flops=1e12, flops_per_step=1e6, report_every_steps=1))

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr("mfuwatch.agent.hooks.count_tokens", boom)
    monkeypatch.setattr(a.exporter, "observe_steps", boom)
    with caplog.at_level(logging.WARNING, logger="mfuwatch"):
        for _ in range(4):
            x = torch.randint(0, s.vocab, (s.batch, s.seq))
            F.cross_entropy(model(x).view(-1, s.vocab), x.view(-1)).backward()
            opt.step()
            opt.zero_grad()
        a.close()
    assert a.errors.get("hooks") == 4
    assert a.errors.get("exporter") >= 1  # counted under its own component; the tick goes on
    assert a.latest is not None and a.latest.step == 4  # measurements still made past the failing exporter
    assert a.exporter.errors.labels("t", "0", "hooks")._value.get() == 4
    # logged once per component, not once per failure
    assert sum("hooks failed" in r.getMessage() for r in caplog.records) == 1


def test_exporter_scraped_over_http():
    a = Agent(config=dict(BASE, exporter=True, port=0, flops_per_step=2e12, peak_flops=1e13,
                          report_every_steps=2, run="scrape"))
    now = install_fake_clock(a, start=True)
    for _ in range(4):
        now.t += 0.5
        a.step(tokens=100)
    a._tick(final=False)
    samples = scrape(a.exporter_url)
    a.close()
    lab = (("job", "scrape"), ("rank", "0"), ("run", "scrape"))  # job: the run's name when no job is known
    assert samples[("mfuwatch_steps_total", lab)] == 4
    # 3 timed steps of 0.5 s (the first is untimed), 4 steps of 2e12 model FLOPs each
    assert samples[("mfuwatch_model_flops_total", lab)] == pytest.approx(4 * 2e12)
    assert samples[("mfuwatch_step_seconds_total", lab)] == pytest.approx(2.0)
    assert samples[("mfuwatch_tokens_total", lab)] == 400
    assert samples[("mfuwatch_mfu_ratio", lab)] == pytest.approx(2e12 / 0.5 / 1e13)
    assert samples[("mfuwatch_peak_flops_per_second", lab)] == 1e13
    assert samples[("mfuwatch_step_duration_seconds_count", lab)] == 4
    assert samples[("mfuwatch_step_duration_seconds_sum", lab)] == pytest.approx(2.0)
    info = [k for k in samples if k[0] == "mfuwatch_run_info"]
    assert info and dict(info[0][1])["peak_source"] == "user (peak_flops)"


def test_busy_port_takes_next_and_reports_it():
    port = free_port()
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    try:
        a = Agent(config=dict(BASE, exporter=True, port=port))
        try:
            used = int(a.exporter_url.rsplit(":", 1)[1].split("/")[0])
            assert used != port and port < used <= port + 100
            assert a.run_info.exporter_url == a.exporter_url
            samples = scrape(a.exporter_url)
            info = [dict(k[1]) for k in samples if k[0] == "mfuwatch_run_info"]
            assert info[0]["exporter_url"] == a.exporter_url
        finally:
            a.close()
    finally:
        blocker.close()


def test_repeated_start_stop_leaks_nothing():
    import threading

    before = {t.name for t in threading.enumerate()}
    for _ in range(3):
        with watch(torch.nn.Linear(2, 2), None, **dict(BASE, exporter=True, port=0)) as a:
            url = a.exporter_url
        with pytest.raises(OSError):
            urllib.request.urlopen(url, timeout=1)
    after = {t.name for t in threading.enumerate()}
    assert not {n for n in after - before if "mfuwatch" in n}


def test_nvml_off_on_cpu():
    a = Agent(config=dict(BASE, nvml=True))
    assert a.nvml is None  # no GPU: sampler off
    a.close()


def test_step_is_ignored_when_optimizer_hook_marks_steps(caplog):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = Agent(model, opt, config=BASE)
    with caplog.at_level(logging.WARNING, logger="mfuwatch"):
        a.step(tokens=5)
        a.step(tokens=5)
    assert a._step == 0
    assert sum("agent.step() ignored" in r.getMessage() for r in caplog.records) == 1
    a.close()


def test_file_sd_target_written_while_the_agent_runs(tmp_path):
    import json

    a = Agent(config=dict(BASE, exporter=True, port=0, run="sd", file_sd_dir=str(tmp_path)))
    port = int(a.exporter_url.rsplit(":", 1)[1].split("/")[0])
    doc = json.loads((tmp_path / "sd-rank0.json").read_text())
    a.close()
    assert doc == [{"targets": [f"127.0.0.1:{port}"], "labels": {"__metrics_path__": "/metrics"}}]
    assert not (tmp_path / "sd-rank0.json").exists()


def test_unwritable_file_sd_dir_fails_at_start_up_and_frees_the_port(tmp_path):
    from mfuwatch.agent.config import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"file_sd_dir: cannot write target files in .*a-file.*expected a "
                                          r"writable directory or null"):
        Agent(config=dict(BASE, exporter=True, port=0, run="sd", file_sd_dir=str(blocker / "targets")))
    a = Agent(config=dict(BASE, exporter=True, port=0, run="sd", file_sd_dir=str(tmp_path / "new" / "dir")))
    try:  # a directory that does not exist yet is created
        assert (tmp_path / "new" / "dir" / "sd-rank0.json").exists()
        assert not list((tmp_path / "new" / "dir").glob(".mfuwatch-probe-*"))
    finally:
        a.close()


def test_a_second_agent_in_the_process_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="mfuwatch"):
        a = Agent(config=dict(BASE, run="one"))
        b = Agent(config=dict(BASE, run="two"))
        b.close()
        a.close()
        c = Agent(config=dict(BASE, run="three"))  # the first two are closed: no warning
        c.close()
    warned = [r.getMessage() for r in caplog.records if "another agent is already running" in r.getMessage()]
    assert len(warned) == 1 and "run=one" in warned[0]


def test_mark_gap_leaves_evaluation_out_of_step_time():
    a = Agent(config=dict(BASE, flops_per_step=1e12, peak_flops=1e13, report_every_steps=2))
    now = install_fake_clock(a, start=True)
    now.t += 0.5
    a.step(tokens=8)
    now.t += 60.0  # evaluation between the steps
    a.mark_gap()
    now.t += 0.5
    a.step(tokens=8)
    a.close()
    assert a.latest.steps == 2 and a.latest.tokens == 16
    assert a.latest.step_time_seconds == pytest.approx(0.5)
    assert a.latest.mfu == pytest.approx(1e12 / 0.5 / 1e13)


def test_one_measurement_per_report_interval_even_when_one_poll_finds_many_steps():
    a = Agent(config=dict(BASE, flops_per_step=1e9, peak_flops=1e12, report_every_steps=10))
    now = install_fake_clock(a, start=True)
    seen = []
    a.timeline.write_in_order = lambda rec: seen.append(rec) if rec.get("kind") == "step" else None
    for _ in range(35):  # all 35 boundaries are resolved by a single poll
        now.t += 0.01
        a.step(tokens=8)
    a.close()
    assert [r["step"] for r in seen] == [10, 20, 30, 35]
    assert [r["steps"] for r in seen] == [10, 10, 10, 5]


def test_mfu_above_one_is_reported_with_one_warning(caplog):
    a = Agent(config=dict(BASE, flops_per_step=2e12, peak_flops=1e12, report_every_steps=1))
    now = install_fake_clock(a, start=True)
    with caplog.at_level(logging.WARNING, logger="mfuwatch"):
        for _ in range(3):
            now.t += 1.0
            a.step(tokens=8)
        a.close()
    assert a.latest.mfu == pytest.approx(2.0)  # reported as measured, not clipped
    assert sum("above 100%" in r.getMessage() for r in caplog.records) == 1
