"""alerts/secrets.py and the notifiers: no webhook URL or token in logs, metrics, exceptions or the config dump."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import yaml
from helpers.net import free_port
from helpers.receiver import Reply
from prometheus_client import generate_latest

from mfuwatch.agent.schema import GpuHealth, StepMeasurement
from mfuwatch.alerts import AlertConfigError, AlertEngine, load_config
from mfuwatch.alerts.secrets import REDACTED, Secret, redact, resolve_secret

PATH_SECRET = "/services/T0SECRETXX/B0SECRETYY/ZzSecretTokenPart42"
TOKEN = "tok-S3CR3T-abcdef-0123456789"


def assert_clean(text: str, *secrets: str) -> None:
    for s in secrets:
        assert s not in text, f"secret leaked: {s!r}"
    for fragment in ("T0SECRETXX", "ZzSecretTokenPart42", "S3CR3T"):
        assert fragment not in text, f"secret fragment leaked: {fragment!r}"


def test_secret_does_not_print_itself(monkeypatch, tmp_path):
    monkeypatch.setenv("MFUWATCH_TEST_SECRET_A", "https://hooks.example" + PATH_SECRET)
    s = resolve_secret("MFUWATCH_TEST_SECRET_A", None, "notifiers[0].url")
    assert s.reveal().endswith(PATH_SECRET)
    assert_clean(repr(s) + str(s) + f"{s}" + str([s]))
    assert "MFUWATCH_TEST_SECRET_A" in repr(s)
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert resolve_secret(None, str(f), "x").reveal() == TOKEN
    assert redact(f"GET {PATH_SECRET} HTTP/1.1 with {TOKEN}") == f"GET {REDACTED} HTTP/1.1 with {REDACTED}"
    assert isinstance(s, Secret)


def test_secret_errors_name_the_source_not_the_value(tmp_path):
    with pytest.raises(ValueError, match="MFUWATCH_TEST_NOT_SET is not set"):
        resolve_secret("MFUWATCH_TEST_NOT_SET", None, "notifiers[0].url")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_secret(None, str(empty), "notifiers[0].url")


def test_no_secret_in_logs_metrics_exceptions_or_dump(receiver, monkeypatch, caplog, capfd, run_info, clock):
    url = f"http://127.0.0.1:{receiver.port}{PATH_SECRET}"
    down = f"http://127.0.0.1:{free_port()}{PATH_SECRET}"
    monkeypatch.setenv("MFUWATCH_TEST_HOOK_URL", url)
    monkeypatch.setenv("MFUWATCH_TEST_DOWN_URL", down)
    monkeypatch.setenv("MFUWATCH_TEST_HOOK_TOKEN", TOKEN)
    receiver.path = PATH_SECRET
    receiver.script(Reply(500), Reply(404))
    caplog.set_level(logging.DEBUG)  # everything, urllib3's request lines included
    cfg = {"notifiers": [
        {"type": "webhook", "name": "hook", "url_env": "MFUWATCH_TEST_HOOK_URL", "token_env": "MFUWATCH_TEST_HOOK_TOKEN",
         "backoff": "10ms"},
        {"type": "slack", "name": "slack", "url_env": "MFUWATCH_TEST_DOWN_URL", "backoff": "10ms", "max_retries": 2},
        {"type": "console", "stream": "log"}],
        "rules": {"MfuLow": {"for": "0s"}, "GpuMemoryPressure": {"for": "0s"}}}
    engine = AlertEngine.from_config(cfg, run_info=run_info, clock=clock).start()
    engine.observe_step(StepMeasurement(step=1, steps=1, timestamp=0, step_time_seconds=1, tokens=1,
                                        tokens_per_second=1, model_flops=1, hardware_flops=1,
                                        model_flops_per_second=1, mfu=0.1))
    engine.evaluate()  # firing: 500 then 404 (failed) at the webhook; connection refused at "slack"
    assert receiver.wait_for(2, timeout=20)  # both answered before the next state could supersede it
    engine.observe_gpu(GpuHealth(timestamp=0, memory_used_bytes=99.0, memory_total_bytes=100.0))
    engine.evaluate()  # a second notification: delivered, with the bearer token
    assert receiver.wait_for_delivered(1, timeout=20)
    engine.close(timeout=5)
    assert receiver.delivered[0].headers["Authorization"] == "Bearer " + TOKEN  # the token is really used
    sent = engine.registry.get_sample_value("mfuwatch_notifications_total",
                                            {"run": "run-a", "rank": "0", "sink": "hook", "outcome": "failed"})
    assert sent == 1.0
    assert any("urllib3" in r.name for r in caplog.records)  # the HTTP library did log its requests
    out, err = capfd.readouterr()
    assert_clean(caplog.text + out + err, url, down, TOKEN, PATH_SECRET)
    assert_clean(generate_latest(engine.registry).decode(), url, down, TOKEN, PATH_SECRET)
    dump = yaml.safe_dump(load_config(cfg).to_dict())
    assert_clean(dump, url, down, TOKEN, PATH_SECRET)
    assert "MFUWATCH_TEST_HOOK_URL" in dump and "MFUWATCH_TEST_HOOK_TOKEN" in dump


def test_bad_url_error_does_not_echo_it(monkeypatch, run_info):
    monkeypatch.setenv("MFUWATCH_TEST_HOOK_URL", "hooks.example" + PATH_SECRET)  # no scheme
    with pytest.raises(AlertConfigError) as info:
        AlertEngine.from_config({"notifiers": [{"type": "slack", "url_env": "MFUWATCH_TEST_HOOK_URL"}]},
                                run_info=run_info)
    assert_clean(str(info.value) + repr(info.value), PATH_SECRET)
    assert "MFUWATCH_TEST_HOOK_URL" in str(info.value)


def test_cli_show_config_has_no_secret(tmp_path, monkeypatch):
    cfg = tmp_path / "alerts.yaml"
    cfg.write_text(yaml.safe_dump({"notifiers": [{"type": "slack", "url_env": "MFUWATCH_TEST_HOOK_URL"}]}))
    env = {"MFUWATCH_TEST_HOOK_URL": "https://hooks.example" + PATH_SECRET, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "mfuwatch.alerts.cli", "show-config", "--config", str(cfg)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "url_env: MFUWATCH_TEST_HOOK_URL" in out.stdout
    assert_clean(out.stdout + out.stderr, PATH_SECRET)
