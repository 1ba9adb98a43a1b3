"""Zero-code attach: ``mfuwatch run [--config FILE] [--] COMMAND...`` measures a job nobody edited.

* :mod:`.run` — the command: puts :func:`bootstrap_dir` first on ``PYTHONPATH`` (and
  ``MFUWATCH_CONFIG``) and ``exec``\\ s the command, so its exit code is the command's own;
* ``boot/sitecustomize.py`` — runs at start-up in every Python process of the job (launcher
  children and spawned ranks inherit the environment), chains to the ``sitecustomize`` it
  shadows, and does nothing until the process imports torch;
* :mod:`.attacher` — torch's global optimizer and module hooks; the agent attaches at the first
  optimizer step (see there for how the model is found and what the first measured step is).

This package imports torch only in :mod:`.attacher`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Mapping, Optional

#: environment variables of the bootstrap: MFUWATCH_DISABLE=1 turns it off in a job (or one process)
DISABLE_ENV = "MFUWATCH_DISABLE"


def bootstrap_dir() -> str:
    """The directory to put first on ``PYTHONPATH``: it holds only mfuwatch's ``sitecustomize.py``."""
    return str(Path(__file__).resolve().parent / "boot")


def attach_env(environ: Mapping[str, str], config: Optional[str] = None) -> Dict[str, str]:
    """``environ`` plus what injects the agent: :func:`bootstrap_dir` prepended to ``PYTHONPATH`` (once; the other
    entries, empty ones included, unchanged), ``MFUWATCH_CONFIG`` (an absolute path) when ``config`` is given."""
    env = dict(environ)
    boot = bootstrap_dir()
    old = env.get("PYTHONPATH", "")
    # an empty entry of a non-empty PYTHONPATH (":/x", "/x:", what `export PYTHONPATH=$PYTHONPATH:/x` makes of
    # an unset one) is Python's working directory: kept, or the job's local modules would stop importing
    parts = [p for p in old.split(os.pathsep) if p != boot] if old else []
    env["PYTHONPATH"] = os.pathsep.join([boot] + parts)
    if config:
        env["MFUWATCH_CONFIG"] = str(Path(config).resolve())
    return env
