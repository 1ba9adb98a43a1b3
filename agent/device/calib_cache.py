"""One calibrated number per job and host: the first rank measures it, the others read it.

Calibration (a large matmul timed on the CPU) depends on what else runs: DDP ranks
that each calibrate at the same moment compete for the cores and get different
peaks. :func:`shared_value` makes the ranks of
one job on one host agree: the first to take the lock file computes the value and
writes it atomically; the others wait for the file (up to ``timeout`` seconds, then
compute their own and say so once). No collective call, so a rank that never builds
an agent cannot hang the others.

Files live in ``$MFUWATCH_CACHE_DIR`` or ``<tmp>/mfuwatch-<uid>``, named from the key
(job/run name, host, device, dtype), so a new job measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("mfuwatch")


def cache_dir() -> Path:
    """The directory of the shared values (created on first use)."""
    base = os.environ.get("MFUWATCH_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"mfuwatch-{os.getuid()}")
    return Path(base)


def shared_value(key: str, compute: Callable[[], float], *, timeout: float = 120.0, poll: float = 0.05) -> float:
    """``compute()`` once per ``key`` on this host; later callers (other ranks) get the same float.

    Raises whatever ``compute`` raises (in the rank that computes). A missing or
    unwritable cache directory falls back to ``compute()`` in every rank.
    """
    d = cache_dir()
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    value_path, lock_path = d / f"{name}.json", d / f"{name}.lock"
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        fd = None
    except OSError:
        return float(compute())
    if fd is not None:  # this rank measures
        os.close(fd)
        value = float(compute())
        tmp = value_path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"key": key, "value": value}))
            os.replace(tmp, value_path)
        except OSError:
            pass
        return value
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return float(json.loads(value_path.read_text())["value"])
        except (OSError, ValueError, KeyError):
            time.sleep(poll)
    log.warning("mfuwatch: no shared calibration after %.0f s; this rank measures its own (ranks may disagree)",
                timeout)
    return float(compute())
