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


# ---- `mfuwatch alerts check` through the `mfuwatch` command: the agent's own settings are validated too


def _mfuwatch(argv):
    from mfuwatch.agent.cli import main as mfuwatch_main

    return mfuwatch_main(argv)


def test_check_validates_the_agent_settings_with_the_agents_validation(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("bind: 127.0.0.1\nport: abc\n")
    assert _mfuwatch(["alerts", "check", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "agent settings: port: expected an integer port 0..65535" in err and "config OK" not in err
    cfg.write_text("bind: 127.0.0.1\nreport_every_steps: 0\n")
    assert _mfuwatch(["alerts", "check", "--config", str(cfg)]) == 2
    assert "report_every_steps: expected a positive integer, got 0" in capsys.readouterr().err
    cfg.write_text("bind: 127.0.0.1\nport: 9500\n")
    assert _mfuwatch(["alerts", "check", "--config", str(cfg)]) == 0
    out = capsys.readouterr()
    assert "agent settings OK" in out.err and "config OK" in out.out


def test_a_top_level_alert_typo_suggests_alerts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "agent.yaml"
    for text in ("bind: 127.0.0.1\nalert:\n  rules: {MfuLow: {threshold: 0.2}}\n",
                 "alert:\n  rules: {MfuLow: {threshold: 0.2}}\n"):
        cfg.write_text(text)
        assert _mfuwatch(["alerts", "check", "--config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "alert: unknown setting (did you mean 'alerts'?)" in err, err
    # run as `python -m mfuwatch.alerts.cli` (no agent validation handed in): still named, not the built-ins
    assert main(["check", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown top-level key 'alert' (did you mean 'alerts'?)" in err and "built-in rules" not in err
    # a misspelt agent key gets the agent's nearest valid key
    cfg.write_text("bnid: 127.0.0.1\n")
    assert _mfuwatch(["alerts", "show-config", "--config", str(cfg)]) == 2
    assert "bnid: unknown setting (did you mean 'bind'?)" in capsys.readouterr().err


def test_alert_settings_beside_agent_settings_are_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("bind: 127.0.0.1\nrules: {MfuLow: {threshold: 0.2}}\n")  # would be silently dropped
    assert _mfuwatch(["alerts", "check", "--config", str(cfg)]) == 2
    assert "alert settings (rules) beside agent settings (bind): in an agent config they go under `alerts:`" \
        in capsys.readouterr().err


def test_the_alerts_cli_does_not_import_the_agent_config():
    # the combined check lives in mfuwatch.agent.cli; alerts/ reaches the agent only through what it is handed
    import ast
    from pathlib import Path

    import mfuwatch.alerts

    for path in Path(mfuwatch.alerts.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module not in ("mfuwatch.agent.config", "mfuwatch.agent.core"), path


def test_check_warns_about_a_placeholder_for_a_label_no_alert_has(tmp_path, capsys, monkeypatch):
    """Finding 14: `summary: "{labels.nosuch}"` passed check and rendered empty."""
    from mfuwatch.alerts.cli import main

    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "p.yaml"
    cfg.write_text("rules:\n  MfuLow:\n    annotations:\n      summary: 'MFU low on {labels.rnk} / {labels.run} / "
                   "{labels.team}'\n    labels: {team: ml}\n")
    assert main(["check", "--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "rules.MfuLow.annotations.summary: {labels.rnk} names a label no alert of this rule has (did you mean " \
        "'rank'?)" in err
    assert "{labels.run}" not in err and "{labels.team}" not in err  # a base label and the rule's own label


def test_check_table_columns_line_up_for_every_built_in_rule(tmp_path, capsys, monkeypatch):
    # fresh-user pass (issue 24): MfuFarBelowTensorActivity (25 characters) overflowed the 22-wide name
    # column, so its severity, for and cool-down sat one column to the right of every other row's
    monkeypatch.delenv("MFUWATCH_CONFIG", raising=False)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("port: 9500\n")
    assert main(["check", "--config", str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(ln for ln in lines if ln.startswith("rule "))
    rows = [ln for ln in lines[lines.index(header) + 1:lines.index("")]]
    assert any(r.startswith("MfuFarBelowTensorActivity ") for r in rows)
    for col in ("severity", "path"):  # left-aligned columns start where their header does
        at = header.index(col)
        assert all(r[at - 1] == " " and r[at] != " " for r in rows), (col, rows)
    at = header.index("cooldown") + len("cooldown")  # right-aligned: ends where its header ends
    assert all(r[at - 1] != " " and r[at] == " " for r in rows), rows
