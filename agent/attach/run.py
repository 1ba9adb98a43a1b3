"""``mfuwatch run [--config FILE] [--print-env] [--] COMMAND...``: run a command with the agent injected.

    mfuwatch run python train.py --lr 3e-4
    mfuwatch run --config mfuwatch.yaml -- torchrun --nproc-per-node 8 train.py
    mfuwatch run -- accelerate launch train.py
    eval "$(mfuwatch run --print-env)"      # the same for every later command of a shell (shell-quoted;
                                            # a Slurm TaskProlog: docs/examples/slurm/mfuwatch-task-prolog.sh)

The command replaces this process (``exec``): signals reach it directly and its exit code is
the exit code of ``mfuwatch run``. A bad config (``--config``, else ``$MFUWATCH_CONFIG``) fails
here, before the job starts (exit 2), naming the field. ``MFUWATCH_DISABLE=1`` in the environment
keeps the agent out: the command runs as it would without mfuwatch (its config is not read).
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import List, Optional, Sequence

from . import DISABLE_ENV, attach_env, bootstrap_dir

USAGE = "usage: mfuwatch run [--config FILE] [--print-env] [--] COMMAND [ARGS...]"


def _parse(argv: Sequence[str]):
    config: Optional[str] = None
    print_env = False
    i = 0
    args = list(argv)
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if a in ("-h", "--help"):
            return "help", None, False, []
        if a == "--print-env":
            print_env = True
        elif a == "--config" or a.startswith("--config="):
            if a == "--config":
                if i + 1 >= len(args):
                    raise ValueError("--config: expected a file name")
                i += 1
                config = args[i]
            else:
                config = a.split("=", 1)[1]
        elif a.startswith("-"):
            raise ValueError(f"unknown option {a!r} (options go before the command; '--' ends them)")
        else:
            break
        i += 1
    return "run", config, print_env, args[i:]


def _check_config(path: str, source: str) -> Optional[str]:
    """The agent's start-up validation of the config file ``path``: ``None`` when it loads, else the message
    (``source``: where the path came from, ``--config`` or ``MFUWATCH_CONFIG``)."""
    from ..config import ConfigError, load_config

    if not os.path.exists(path):
        return f"{source}: file not found: {path}"
    if not os.path.isfile(path):
        return f"{source}: not a file: {path}"
    try:
        load_config(path)
    except ConfigError as exc:
        return f"{path}: {exc}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Validate the config (``--config``, else ``$MFUWATCH_CONFIG``; not when ``MFUWATCH_DISABLE`` is set), then
    ``exec`` the command with the bootstrap in its environment.

    Returns (only when the command could not be started): 2 for a usage or configuration error,
    127 for a command not found, 126 for one that cannot be executed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        what, config, print_env, cmd = _parse(argv)
    except ValueError as exc:
        print(f"mfuwatch run: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if what == "help":
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n", 1)[1])
        return 0
    if config == "":
        print(f"mfuwatch run: --config: expected a file name\n{USAGE}", file=sys.stderr)
        return 2
    if print_env and cmd:
        print(f"mfuwatch run: --print-env takes no command (got {cmd[0]!r})\n{USAGE}", file=sys.stderr)
        return 2
    if not print_env and not cmd:
        print(f"mfuwatch run: no command given\n{USAGE}", file=sys.stderr)
        return 2
    disabled = os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if disabled and not print_env:
        env = dict(os.environ)  # opted out: the command runs exactly as without mfuwatch, config unread
    else:
        if config is None and os.environ.get("MFUWATCH_CONFIG"):
            config, source = os.environ["MFUWATCH_CONFIG"], "MFUWATCH_CONFIG"  # what the agent would read
        else:
            source = "--config"
        if config is not None:
            bad = _check_config(config, source)
            if bad:
                print(f"mfuwatch run: {bad}", file=sys.stderr)
                return 2
        env = attach_env(os.environ, config)
    if print_env:
        keys = ["PYTHONPATH"] + (["MFUWATCH_CONFIG"] if config else [])
        for k in keys:
            print(f"export {k}={shlex.quote(env[k])}")
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        print(f"mfuwatch run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"mfuwatch run: cannot execute {cmd[0]} (permission denied)", file=sys.stderr)
        return 126
    except OSError as exc:
        print(f"mfuwatch run: cannot execute {cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 126
    return 0  # pragma: no cover - exec does not return


__all__ = ["main", "bootstrap_dir"]
