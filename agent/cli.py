"""The ``mfuwatch`` command line: ``demo``, ``analyze``, ``report``, ``alerts``, ``flops`` and ``run``.

Each subcommand lives in its own module with a ``main(argv) -> int``; this
dispatcher imports only the one asked for, so ``mfuwatch analyze`` and
``mfuwatch alerts`` start without importing torch. ``mfuwatch alerts`` is handed the
agent's config validation (:func:`agent_side`): this layer may import both packages,
``mfuwatch.alerts`` never imports the agent.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import List, Optional

COMMANDS = {
    "demo": ("mfuwatch.agent.demo", "run a small real training job with the agent attached"),
    "analyze": ("mfuwatch.agent.analysis.analyze", "time breakdown, top ops and suggestions of a torch.profiler trace"),
    "report": ("mfuwatch.agent.report.html", "a self-contained HTML report from an agent timeline (JSONL)"),
    "alerts": ("mfuwatch.alerts.cli", "alert rules: render Prometheus rules, check a config"),
    "flops": ("mfuwatch.agent.flops.cli", "FLOPs of one training step of a Hugging Face model, per component"),
    "run": ("mfuwatch.agent.attach.run", "run a command with the agent attached to its Python processes"),
}


def _usage() -> str:
    lines = ["usage: mfuwatch <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "'mfuwatch <command> --help' describes a command's options."]
    return "\n".join(lines)


def agent_side():
    """The agent's settings and validation for ``mfuwatch alerts`` (an :class:`~mfuwatch.alerts.cli.AgentSide`).

    ``validate(path)`` is the agent's own start-up validation (:func:`mfuwatch.agent.config.load_config`),
    raising :class:`~mfuwatch.agent.config.ConfigError` (a ``ValueError``); importing it loads no torch.
    """
    from mfuwatch.alerts.cli import AgentSide

    def setting_names() -> set:
        import dataclasses

        from .config import AgentConfig

        return {f.name for f in dataclasses.fields(AgentConfig)}

    def validate(path: str) -> None:
        from .config import load_config

        load_config(path)

    return AgentSide(setting_names=setting_names, validate=validate)


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch to a subcommand; returns its exit code (2 for usage errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"mfuwatch {version('mfuwatch')}")
        except PackageNotFoundError:
            print("mfuwatch (not installed as a package)")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"mfuwatch: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    mod = importlib.import_module(COMMANDS[cmd][0])
    if cmd == "alerts":
        return int(mod.main(rest, agent=agent_side()) or 0)
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
