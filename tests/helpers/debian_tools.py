"""Find a Debian-packaged tool (prometheus, promtool, chromium), installing it with apt-get when missing.

CI runs as root on a fresh Debian machine, so a test set-up may install what it
needs. When the install is impossible (not root, no apt-get, no registry), the
test fails under CI (``CI=true``) and is skipped elsewhere, naming the package.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Iterator, Sequence

import pytest

_LOCK = threading.Lock()
_updated = False


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _apt(args: Sequence[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Another process may hold the dpkg lock (a parallel installer): wait for it rather than fail.
    return subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", *args], env=env, capture_output=True,
                          text=True, timeout=900)


@contextlib.contextmanager
def no_service_start() -> Iterator[None]:
    """Forbid package scripts to start services while apt-get runs (``/usr/sbin/policy-rc.d`` exiting 101).

    Debian's prometheus and prometheus-alertmanager packages would otherwise start system services
    listening on every interface (:9090, :9093); the tests run the binaries themselves, on 127.0.0.1.
    """
    policy = Path("/usr/sbin/policy-rc.d")
    ours = False
    try:
        if os.geteuid() == 0 and not policy.exists():
            policy.write_text("#!/bin/sh\n# written by mfuwatch tests/helpers/debian_tools.py\nexit 101\n")
            policy.chmod(0o755)
            ours = True
    except OSError:
        pass
    try:
        yield
    finally:
        if ours:
            policy.unlink(missing_ok=True)


def ensure_binary(names: Sequence[str], package: str, *extra_packages: str) -> str:
    """Return the path of the first of ``names`` on PATH, installing Debian ``package`` if none is.

    ``extra_packages`` are installed with it (recommended packages are not, to keep CI fast:
    e.g. chromium needs ``fonts-liberation`` named here to draw text).

    Fails the test under CI, skips it elsewhere, when the tool cannot be had.
    """
    global _updated
    for name in names:
        if shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    why = f"none of {list(names)} on PATH"
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        with _LOCK:
            if not _updated:
                _apt(["update", "-qq"])
                _updated = True
            with no_service_start():
                res = _apt(["install", "-y", "-qq", "--no-install-recommends", package, *extra_packages])
        for name in names:
            if shutil.which(name):
                return shutil.which(name)  # type: ignore[return-value]
        why += f"; `apt-get install {package}` exited {res.returncode}: {res.stderr.strip()[-500:]}"
    else:
        why += f"; install the Debian package {package!r} (needs root and apt-get)"
    if _in_ci():
        pytest.fail(why)
    pytest.skip(why)
