"""alerts/cli.py (``mfuwatch alerts …``) and the package's import boundary."""

from __future__ import annotations

import subprocess
import sys

import yaml

from mfuwatch.alerts import render_prometheus
from mfuwatch.alerts.cli import main


def test_render_prometheus_to_stdout_and_file(capsys, tmp_path):
    assert main(["render-prometheus"]) == 0
    assert capsys.readouterr().out == render_prometheus(None)
    cfg = tmp_path / "alerts.yaml"
    cfg.write_text(yaml.safe_dump({"rules": {"MfuLow": {"threshold": 0.33}}}))
    out = tmp_path / "rules" / "x.yml"
    assert main(["render-prometheus", "--config", str(cfg), "-o", str(out)]) == 0
    rules = {r["alert"]: r for r in yaml.safe_load(out.read_text())["groups"][0]["rules"]}
    assert rules["MfuLow"]["expr"] == "mfuwatch_mfu_ratio < 0.33"


def test_check_lists_rules_and_rejects_bad_config(capsys, tmp_path):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    for name in ("MfuLow", "TrainingStalled", "StragglerRank"):
        assert name in out
    assert "prometheus" in out and "config OK" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  MfuLow:\n    severty: critical\n")
    assert main(["check", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "rules.MfuLow" in err and "did you mean 'severity'" in err


def test_test_notify_sends_firing_then_resolved(receiver, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MFUWATCH_TEST_NOTIFY_URL", receiver.url)
    cfg = tmp_path / "alerts.yaml"
    cfg.write_text(yaml.safe_dump({"notifiers": [{"type": "webhook", "url_env": "MFUWATCH_TEST_NOTIFY_URL"}]}))
    assert main(["test-notify", "--config", str(cfg), "--run", "smoke"]) == 0
    bodies = [r.json for r in receiver.delivered]
    assert [b["status"] for b in bodies] == ["firing", "resolved"]
    assert bodies[0]["alerts"][0]["labels"]["run"] == "smoke"
    assert "webhook: 2 of 2 test notifications delivered" in capsys.readouterr().out


def test_importing_alerts_loads_neither_torch_nor_agent_internals():
    code = ("import sys, mfuwatch.alerts, mfuwatch.alerts.cli, mfuwatch.alerts.notifiers.slack, "
            "mfuwatch.alerts.notifiers.webhook, mfuwatch.alerts.notifiers.console\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or "
            "m.startswith('mfuwatch.agent') or m == 'triton'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['mfuwatch.agent', 'mfuwatch.agent.schema']"
