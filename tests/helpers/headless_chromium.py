"""Open a local HTML file in headless Chromium: screenshot, DOM after scripts ran, console messages.

One Chromium run (``--screenshot`` and ``--dump-dom`` together) with networking
features off and a throw-away profile. Console messages are read from
Chromium's own log on stderr (``--enable-logging=stderr``), where every
``console.*`` call and every uncaught exception appears as a ``CONSOLE`` line.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from .debian_tools import ensure_binary

#: ``[pid:tid:date:INFO:CONSOLE:12] "message", source: file:///... (12)`` (new headless) or
#: ``INFO:CONSOLE(12)] "message"`` (older builds).
_CONSOLE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\]\s*(.*)$")


@dataclass
class PageResult:
    dom: str  # serialized DOM after the page's scripts ran
    console: List[str]  # console messages and uncaught errors, in order
    screenshot: Path
    stderr: str


def chromium_binary() -> str:
    """Path of Debian's chromium (installed with fonts when missing; see :func:`ensure_binary`)."""
    return ensure_binary(("chromium", "chromium-browser"), "chromium", "fonts-liberation")


def console_messages(stderr: str) -> List[str]:
    """The console lines of a Chromium log."""
    out = []
    for line in stderr.splitlines():
        m = _CONSOLE.search(line)
        if m:
            out.append(m.group(1))
    return out


def open_page(html_path: Path, screenshot: Path, size: Tuple[int, int] = (1400, 2400),
              timeout: float = 120.0) -> PageResult:
    """Load ``html_path`` (a local file) and return its DOM, console messages and a PNG screenshot.

    Raises:
        AssertionError: if Chromium exits non-zero or writes no screenshot.
    """
    binary = chromium_binary()
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    if screenshot.exists():
        screenshot.unlink()
    with tempfile.TemporaryDirectory(prefix="mfuwatch-chromium-") as profile:
        cmd = [
            binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
            "--enable-logging=stderr", "--v=0",
            # Resolve no host name: a page that tried to fetch anything would log a console error.
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--virtual-time-budget=5000", f"--window-size={size[0]},{size[1]}",
            f"--screenshot={screenshot}", "--dump-dom", html_path.resolve().as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
    assert screenshot.is_file(), f"chromium wrote no screenshot: {proc.stderr[-2000:]}"
    return PageResult(dom=proc.stdout, console=console_messages(proc.stderr), screenshot=screenshot,
                      stderr=proc.stderr)
