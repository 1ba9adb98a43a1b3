"""A real Alertmanager (Debian's prometheus-alertmanager) on 127.0.0.1 for a test, fed alerts through its API."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from helpers.net import free_port


def post_alerts(base: str, alerts: list) -> None:
    """POST ``alerts`` (API v2 objects: labels, annotations, startsAt, endsAt, generatorURL) to Alertmanager."""
    req = urllib.request.Request(base + "/api/v2/alerts", data=json.dumps(alerts).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


@contextlib.contextmanager
def alertmanager(binary: str, config_text: str, tmp: Path) -> Iterator[str]:
    """Run ``binary`` with ``config_text`` (clustering off, storage in ``tmp``) until ready; yields its base URL."""
    cfg = tmp / "am.yml"
    cfg.write_text(config_text)
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)
