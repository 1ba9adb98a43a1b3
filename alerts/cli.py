"""``mfuwatch alerts …``: check, show, render and test the alert configuration.

::

    mfuwatch alerts check [--config FILE]                 # validate; list the rules and notifiers
    mfuwatch alerts show-config [--config FILE]           # the effective config as YAML (no secrets)
    mfuwatch alerts render-prometheus [--config FILE] [--output FILE]
    mfuwatch alerts test-notify [--config FILE] [--run NAME]   # a test alert, firing then resolved, per route

``FILE`` is an alert config, or an agent config whose ``alerts:`` key holds one (an agent
config without that key, such as the README's ``bind: …`` file, means the built-in rules).
Without ``--config`` the file named by ``$MFUWATCH_CONFIG`` is read, as the agent does.
``check`` also reads every notifier's secret (never printing it), so an unset
``url_env`` variable fails here rather than when the agent starts; run as ``mfuwatch alerts``
it validates an agent config's own settings too, with the agent's validation (handed in as
:class:`AgentSide` by ``mfuwatch.agent.cli``: this package never imports the agent).
A top-level key that is close to ``alerts`` (``alert:``) is an error that says so.
Exit status: 0 on success, 2 for an invalid config, 1 when a test notification
could not be delivered. Starts fast: imports neither torch nor the agent.
"""

from __future__ import annotations

import argparse
import difflib
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, Collection, List, Optional

import yaml

from .config import load_config, near_alerts_key
from .validation import AlertConfigError, format_duration


@dataclass(frozen=True)
class AgentSide:
    """What ``mfuwatch alerts`` needs of the agent's configuration, handed in by the ``mfuwatch`` command
    (``mfuwatch.agent.cli``, which may import both packages), so ``mfuwatch.alerts`` never imports the agent.

    Attributes:
        setting_names: returns the agent's top-level setting names (``alerts`` among them).
        validate: validates the agent config file at the path it is given, as the agent does at start-up;
            raises ``ValueError`` naming the field and the accepted values (the nearest key for an unknown one).
    """

    setting_names: Callable[[], Collection[str]]
    validate: Callable[[str], None]


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


def main(argv: Optional[List[str]] = None, agent: Optional[AgentSide] = None) -> int:
    """Entry point of ``mfuwatch alerts``; returns the exit status.

    ``agent``: the agent's settings and validation (``mfuwatch.agent.cli`` passes them); without it an
    agent config's own settings are not checked, only its ``alerts:`` key.
    """
    args = _parser().parse_args(argv)
    try:
        source = _source(args.config, agent, validate_agent=args.command == "check")
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


def _source(path: Optional[str], agent: Optional[AgentSide] = None, validate_agent: bool = False):
    """The alert config source for ``--config`` (else ``$MFUWATCH_CONFIG``); ``None`` = the built-ins.

    A file whose top-level keys include alert settings (:data:`~.config.TOP_KEYS`) is an alert config;
    one without is an agent config, whose alert rules sit under ``alerts:`` (none: the built-ins). With
    ``agent`` and ``validate_agent`` an agent config's settings are validated by ``agent.validate``.

    Raises:
        AlertConfigError: alert settings beside agent settings (or beside ``alerts:``), a top-level key close
            to ``alerts``, or (``validate_agent``) an invalid agent setting.
    """
    import os
    from pathlib import Path

    from .config import TOP_KEYS

    path = path or os.environ.get("MFUWATCH_CONFIG") or None
    if path is None:
        return None
    try:
        doc = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return path  # load_config reports it with the field and file
    if not isinstance(doc, dict) or not doc:
        return path
    keys = {str(k) for k in doc}
    alert_keys = keys & set(TOP_KEYS)
    agent_names = set(agent.setting_names()) if agent is not None else set()
    other = sorted(keys - alert_keys)
    if alert_keys:
        if other and ("alerts" in keys or keys & agent_names):
            raise AlertConfigError(
                f"{path}: alert settings ({', '.join(sorted(alert_keys))}) beside agent settings "
                f"({', '.join(other)}): in an agent config they go under `alerts:`")
        return path  # an alert config: load_config names an unknown key and its nearest valid one
    unchecked = [k for k in other if k not in agent_names]
    if agent is not None and (validate_agent or unchecked):
        try:  # the agent's own validation: an unknown key with its nearest valid one ('alert' -> 'alerts'), values
            agent.validate(path)
        except ValueError as exc:
            raise AlertConfigError(f"{path}: agent settings: {exc}") from None
        print(f"{path}: agent settings OK", file=sys.stderr)
    if "alerts" in keys:
        return path  # read_document takes the `alerts:` key
    if agent is None and any(near_alerts_key(k) for k in other):
        return path  # read_document says "did you mean 'alerts'"
    note = "" if agent is not None else " (its agent settings are checked by `mfuwatch alerts check`)"
    print(f"{path}: an agent config without an `alerts:` key: the built-in rules apply{note}", file=sys.stderr)
    return None


def _check(cfg) -> int:
    from .notifiers import build_notifier
    from .prometheus import rule_expr
    from .secrets import SecretError

    url_warnings = []
    for n in cfg.notifiers:  # read every secret now, as the agent will at start (the value is never printed)
        try:
            notifier = build_notifier(n)
            url_warnings += getattr(notifier, "url_warnings", list)()  # a Teams/Discord URL without its credential
            notifier.close()
        except (SecretError, ValueError) as exc:
            raise AlertConfigError(str(exc)) from None

    w = max([22] + [len(r.name) for r in cfg.rules])  # the longest name (MfuFarBelowTensorActivity is 25)
    print(f"{'rule':<{w}} {'severity':<9} {'for':>6} {'cooldown':>8}  path        expression")
    for r in cfg.rules:
        path = "both" if r.in_process else "prometheus"
        state = "" if r.enabled else "  (disabled)"
        print(f"{r.name:<{w}} {r.severity:<9} {format_duration(r.for_seconds):>6} "
              f"{format_duration(r.cooldown_seconds):>8}  {path:<10}  {rule_expr(r)}{state}")
    print()
    for n in cfg.notifiers:
        print(f"notifier {n.name} ({n.type}) {', '.join(x for x in (_endpoint(n), _secret_sources(n)) if x)}"
              .rstrip())
    if cfg.routes:
        from .routing import route_warnings

        for i, r in enumerate(cfg.routes):
            when = ", ".join(str(m) for m in r.matchers) or ("every alert" if i == 0 else "every other alert")
            print(f"route[{i}] {when} -> {', '.join(r.notifiers)}{' (continue)' if r.continue_ else ''}")
        for w in route_warnings(cfg.routes, [n.name for n in cfg.notifiers]):
            print(f"warning: {w}", file=sys.stderr)
    from .routing import severity_warnings

    for w in severity_warnings(cfg.routes, cfg.notifiers) + url_warnings:
        print(f"warning: {w}", file=sys.stderr)
    for w in _placeholder_warnings(cfg.rules):
        print(f"warning: {w}", file=sys.stderr)
    print(f"silences: {len(cfg.silences)}, inhibit rules: {len(cfg.inhibit_rules)}, routes: {len(cfg.routes)}; "
          "config OK")
    return 0


def _placeholder_warnings(rules) -> List[str]:
    """``{labels.NAME}`` placeholders in a rule's annotations that name a label no alert of that rule carries
    (they render empty): the base labels, the rule's own ``labels`` and Prometheus's target labels count."""
    from .routing import BASE_LABELS

    out = []
    for r in rules:
        known = set(BASE_LABELS) | set(getattr(r, "labels", {}) or {}) | {"instance", "job"}
        for key, template in (getattr(r, "annotations", {}) or {}).items():
            for kind, item in getattr(template, "parts", ()):
                name = item[0][len("labels."):] if kind == "ph" and item[0].startswith("labels.") else None
                if name is not None and name not in known:
                    near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    out.append(f"rules.{r.name}.annotations.{key}: {{labels.{name}}} names a label no alert of "
                               f"this rule has{hint}; it renders empty (labels: {', '.join(sorted(known))})")
    return out


def _endpoint(n) -> str:
    """Where a notifier sends, when that is not a secret: ``smtp.example.org:587 starttls to a@x, b@y`` for
    email, ``api_url https://…`` for an override (PagerDuty, Opsgenie, Teams, Discord), Opsgenie's region."""
    from .notifiers.mail import DEFAULT_PORTS

    if n.type == "email":
        return f"{n.smtp_host}:{n.smtp_port or DEFAULT_PORTS[n.tls]} {n.tls} from {n.sender} to {', '.join(n.to)}"
    out = []
    if n.type == "opsgenie":
        out.append(f"region {n.region}")
    if getattr(n, "api_url", None):
        import urllib.parse

        u = urllib.parse.urlsplit(n.api_url)
        host = u.hostname or ""
        host = f"[{host}]" if ":" in host else host
        shown = urllib.parse.urlunsplit((u.scheme, host + (f":{u.port}" if u.port else ""), u.path, "", ""))
        out.append(f"api_url {shown}")  # without userinfo or query, which may hold a credential
    return ", ".join(out)


def _secret_sources(n) -> str:
    """Where a notifier's secrets come from (``url from $MFUWATCH_SLACK_WEBHOOK_URL``), never their values."""
    from .config import TYPE_SECRETS

    out = []
    for secret, _ in TYPE_SECRETS[n.type]:
        env, file = getattr(n, f"{secret}_env"), getattr(n, f"{secret}_file")
        if env or file:
            out.append(f"{secret.replace('_', ' ')} from {'$' + env if env else file}")
    return ", ".join(out)


def _test_cases(cfg, run: str, host: str):
    """``(what, labels)`` of the synthetic test alerts: one per route, labelled so that it matches the route and
    reaches it past the routes before it (a severity, else an alert name, that no earlier route without
    ``continue`` takes; label values chosen by :func:`~.routing.sample_labels`), or
    one ``info`` alert when there are no routes. ``labels`` is ``None`` for a route no test alert can reach."""
    from .routing import route, sample_labels
    from .rules import SEVERITIES

    base = {"alertname": "MfuwatchTest", "severity": "info", "run": run, "rank": "0", "host": host}
    if not cfg.routes:
        return [("every notifier", base)]
    values = {"severity": SEVERITIES, "alertname": [r.name for r in cfg.rules]}
    out = []
    names = [base["alertname"]] + list(values["alertname"])  # another name when an earlier route takes the test one
    for i, r in enumerate(cfg.routes):
        found = None
        for name in names:
            for severity in SEVERITIES[::-1]:
                labels = sample_labels(r, {**base, "alertname": name, "severity": severity, "test_route": str(i)},
                                       values)
                if labels is not None and i in route(cfg.routes, labels)[1]:
                    found = labels
                    break
            if found is not None:
                break
        out.append((f"route[{i}] {', '.join(str(m) for m in r.matchers) or '(catch-all)'}", found))
    return out


def _test_notify(cfg, run: str, timeout: float) -> int:
    """Send a test alert (firing, then resolved) through the routes; with ``routes``, one per route, labelled
    so that it matches the route, and report where each went and how many messages each notifier delivered."""
    from mfuwatch.agent.schema import RunInfo

    from .engine import AlertEngine
    from .model import AlertSnapshot, Notification
    from .routing import route
    from .rules import SEVERITIES

    info = RunInfo(run=run, rank=0, host=socket.gethostname())
    engine = AlertEngine(cfg, run_info=info)
    now = time.time()
    expected = {w.name: 0 for w in engine.workers}
    ok = True
    cases = []
    started = time.monotonic()
    for what, labels in _test_cases(cfg, run, info.host):
        if labels is None:
            print(f"{what}: no test alert reaches it (earlier routes take every alert it matches, or a regular "
                  "expression too general to invert); not tested")
            ok = False
            continue
        severity = labels.get("severity") if labels.get("severity") in SEVERITIES else "info"
        annotations = {"summary": f"Test notification from `mfuwatch alerts test-notify` (run {run}, {what})",
                       "description": "If you can read this, the notifier is configured correctly."}
        names = set(route(cfg.routes, labels)[0]) if cfg.routes else set(expected)
        takers = [w for w in engine.workers if w.notifier.accepts(Notification({"run": run}, (AlertSnapshot(
            name=labels["alertname"], status="firing", severity=severity, labels=labels, annotations={},
            starts_at=now, ends_at=None, value=None, threshold=0.0, op=">", unit="count"),))) is not None]
        if cfg.routes:
            print(f"{what}: test alert {', '.join(f'{k}={v}' for k, v in labels.items() if k != 'test_route')} "
                  f"-> {', '.join(w.name for w in takers) or 'no notifier'}"
                  + ("" if {w.name for w in takers} >= names else " (some notifiers filter its severity)"))
        for w in takers:
            expected[w.name] += 2
        cases.append((labels, severity, annotations))

    def states(status: str):
        for labels, severity, annotations in cases:
            alert = AlertSnapshot(name=labels["alertname"], status=status, severity=severity, labels=labels,
                                  annotations=annotations, starts_at=now,
                                  ends_at=now if status == "resolved" else None,
                                  value=None, threshold=0.0, op=">", unit="count")
            yield Notification({"run": run, "test_route": labels.get("test_route", "")}, (alert,))

    def outcomes(w) -> float:
        return sum(engine.registry.get_sample_value("mfuwatch_notifications_total", {
            "run": run, "rank": "0", "sink": w.name, "outcome": o}) or 0 for o in ("sent", "failed"))

    for n in states("firing"):
        for w in engine.workers:
            w.submit(n)
    for w in engine.workers:
        w.start()
    # The resolved states go once the firing ones are delivered (or failed), so a retried firing state is not
    # superseded by its resolved one (reported as a failure before) and a receiver sees firing, then resolved.
    until = time.monotonic() + timeout / 2
    while time.monotonic() < until and any(outcomes(w) < expected[w.name] / 2 for w in engine.workers):
        time.sleep(0.05)
    if any(w.notifier.config.type == "opsgenie" for w in engine.workers):
        time.sleep(min(2.0, max(0.0, until - time.monotonic())))  # Opsgenie creates asynchronously (202)
    for n in states("resolved"):
        for w in engine.workers:
            w.submit(n)
    engine.close(timeout=max(1.0, timeout - (time.monotonic() - started)))
    for w in engine.workers:
        sent = engine.registry.get_sample_value("mfuwatch_notifications_total",
                                                {"run": run, "rank": "0", "sink": w.name, "outcome": "sent"}) or 0
        print(f"{w.name}: {int(sent)} of {expected[w.name]} test notifications delivered")
        ok = ok and sent >= expected[w.name]
        if expected[w.name] == 0:
            print(f"{w.name}: no route sends it anything", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":  # python -m mfuwatch.alerts.cli
    sys.exit(main())
