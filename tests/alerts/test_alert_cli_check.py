"""``mfuwatch alerts check``: accepts the README's agent config, reads $MFUWATCH_CONFIG, and fails when a
notifier's secret cannot be read (instead of "config OK" and a traceback when the agent starts)."""

from __future__ import annotations

import yaml

from mfuwatch.alerts.cli import main


def test_check_accepts_the_readme_agent_config(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("bind: 172.17.0.1\n")  # README, "See the dashboards"
    assert main(["check", "--config", str(cfg)]) == 0
    captured = capsys.readouterr()
    assert "config OK" in captured.out and "built-in rules" in captured.err


def test_check_reads_mfuwatch_config(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"port": 9500, "alerts": {"rules": {"MfuLow": {"threshold": 0.31}}}}))
    monkeypatch.setenv("MFUWATCH_CONFIG", str(cfg))
    assert main(["show-config"]) == 0
    assert "threshold: 0.31" in capsys.readouterr().out
    cfg.write_text(yaml.safe_dump({"alerts": {"rules": {"MfuLow": {"treshold": 0.31}}}}))
    assert main(["check"]) == 2
    assert "treshold" in capsys.readouterr().err


def test_check_fails_when_the_webhook_variable_is_unset(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    monkeypatch.delenv("MFUWATCH_TEST_UNSET_HOOK", raising=False)
    cfg = tmp_path / "alerts.yaml"
    cfg.write_text(yaml.safe_dump({"notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_UNSET_HOOK"}]}))
    assert main(["check", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "MFUWATCH_TEST_UNSET_HOOK is not set" in err and "Traceback" not in err
    monkeypatch.setenv("MFUWATCH_TEST_UNSET_HOOK", "https://hooks.example/T/B/SECRET42")
    assert main(["check", "--config", str(cfg)]) == 0
    out = capsys.readouterr()
    assert "config OK" in out.out and "SECRET42" not in out.out + out.err
