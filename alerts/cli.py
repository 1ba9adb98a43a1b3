"""``mfuwatch alerts …``: check, show, render and test the alert configuration.

::

    mfuwatch alerts check [--config FILE]                 # validate; list the rules and notifiers
    mfuwatch alerts show-config [--config FILE]           # the effective config as YAML (no secrets)
    mfuwatch alerts render-prometheus [--config FILE] [--output FILE]
    mfuwatch alerts test-notify [--config FILE] [--run NAME]   # send a test alert, firing then resolved

``FILE`` is an alert config, or an agent config whose ``alerts:`` key holds one (an agent
config without that key, such as the README's ``bind: …`` file, means the built-in rules).
Without ``--config`` the file named by ``$MFUWATCH_CONFIG`` is read, as the agent does.
``check`` also reads every notifier's secret (never printing it), so an unset
``url_env`` variable fails here rather than when the agent starts.
Exit status: 0 on success, 2 for an invalid config, 1 when a test notification
could not be delivered. Starts fast: imports neither torch nor the agent.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import List, Optional

import yaml

from .config import load_config
from .validation import AlertConfigError, format_duration


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mfuwatch alerts", description="Alert rules: check, render for Prometheus, "
                                "test notifiers. Secrets (webhook URLs, tokens) come from the environment or a file.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("check", help="validate the config; list rules and notifiers")
    s = sub.add_parser("show-config", help="print the effective config (defaults merged; secrets by reference)")
    r = sub.add_parser("render-prometheus", help="write Prometheus alerting rules equivalent to the config")
    r.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    t = sub.add_parser("test-notify", help="send a synthetic alert (firing, then resolved) to every notifier")
    t.add_argument("--run", default="mfuwatch-test", help="run label of the test alert (default: %(default)s)")
    t.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for delivery (default: 30)")
    for sp in (c, s, r, t):
        sp.add_argument("--config", "-c", metavar="FILE",
                        help="alert config YAML (or an agent config with an `alerts:` key); default: built-ins")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``mfuwatch alerts``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        source = _source(args.config)
        cfg = load_config(source)
        if args.command == "check":
            return _check(cfg)
        if args.command == "show-config":
            sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False, width=120, allow_unicode=True))
            return 0
        if args.command == "render-prometheus":
            from .prometheus import render_prometheus

            text = render_prometheus(cfg)
            if args.output:
                from pathlib import Path

                Path(args.output).parent.mkdir(parents=True, exist_ok=True)
                Path(args.output).write_text(text, encoding="utf-8")
                print(f"wrote {sum(1 for r in cfg.rules if r.enabled)} rules to {args.output}", file=sys.stderr)
            else:
                sys.stdout.write(text)
            return 0
        return _test_notify(cfg, args.run, args.timeout)
    except AlertConfigError as exc:
        print(f"mfuwatch alerts: invalid config: {exc}", file=sys.stderr)
        return 2


def _source(path: Optional[str]):
    """The alert config source for ``--config`` (else ``$MFUWATCH_CONFIG``); ``None`` = the built-ins.

    An agent config (its keys are agent settings) without an ``alerts:`` key yields ``None``.
    """
    import os
    from pathlib import Path

    path = path or os.environ.get("MFUWATCH_CONFIG") or None
    if path is None:
        return None
    try:
        doc = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return path  # load_config reports it with the field and file
    if isinstance(doc, dict) and "alerts" not in doc and doc:
        from .config import TOP_KEYS

        agent_keys = _agent_setting_names()
        if not set(doc) & set(TOP_KEYS) and set(doc) <= agent_keys:
            print(f"{path}: an agent config without an `alerts:` key: the built-in rules apply", file=sys.stderr)
            return None
    return path


def _agent_setting_names() -> set:
    """The agent's setting names (dataclass fields of ``AgentConfig``; importing it loads no torch)."""
    import dataclasses

    from mfuwatch.agent.config import AgentConfig

    return {f.name for f in dataclasses.fields(AgentConfig)}


def _check(cfg) -> int:
    from .notifiers import build_notifier
    from .prometheus import rule_expr
    from .secrets import SecretError

    for n in cfg.notifiers:  # read every secret now, as the agent will at start (the value is never printed)
        try:
            notifier = build_notifier(n)
            notifier.close()
        except (SecretError, ValueError) as exc:
            raise AlertConfigError(str(exc)) from None

    print(f"{'rule':<22} {'severity':<9} {'for':>6} {'cooldown':>8}  path        expression")
    for r in cfg.rules:
        path = "both" if r.in_process else "prometheus"
        state = "" if r.enabled else "  (disabled)"
        print(f"{r.name:<22} {r.severity:<9} {format_duration(r.for_seconds):>6} "
              f"{format_duration(r.cooldown_seconds):>8}  {path:<10}  {rule_expr(r)}{state}")
    print()
    for n in cfg.notifiers:
        where = n.url_env and f"url from ${n.url_env}" or n.url_file and f"url from {n.url_file}" or ""
        print(f"notifier {n.name} ({n.type}) {where}".rstrip())
    print(f"silences: {len(cfg.silences)}, inhibit rules: {len(cfg.inhibit_rules)}; config OK")
    return 0


def _test_notify(cfg, run: str, timeout: float) -> int:
    from mfuwatch.agent.schema import RunInfo

    from .model import AlertSnapshot, Notification
    from .engine import AlertEngine

    info = RunInfo(run=run, rank=0, host=socket.gethostname())
    engine = AlertEngine(cfg, run_info=info)
    now = time.time()
    labels = {"alertname": "MfuwatchTest", "severity": "info", "run": run, "rank": "0", "host": info.host}
    annotations = {"summary": f"Test notification from `mfuwatch alerts test-notify` (run {run})",
                   "description": "If you can read this, the notifier is configured correctly."}
    outcomes = []
    for status in ("firing", "resolved"):
        alert = AlertSnapshot(name="MfuwatchTest", status=status, severity="info", labels=labels,
                              annotations=annotations, starts_at=now, ends_at=now if status == "resolved" else None,
                              value=None, threshold=0.0, op=">", unit="count")
        for w in engine.workers:
            w.submit(Notification({"run": run}, (alert,)))
    for w in engine.workers:
        w.start()
    engine.close(timeout=timeout)
    for w in engine.workers:
        sent = engine.registry.get_sample_value("mfuwatch_notifications_total",
                                                {"run": run, "rank": "0", "sink": w.name, "outcome": "sent"}) or 0
        outcomes.append(sent)
        print(f"{w.name}: {int(sent)} of 2 test notifications delivered")
    return 0 if all(s >= 2 for s in outcomes) else 1


if __name__ == "__main__":  # python -m mfuwatch.alerts.cli
    sys.exit(main())
