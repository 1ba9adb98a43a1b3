"""Fixtures for the alert tests: a fake clock, a run, a local HTTP receiver, and Debian's Prometheus tools.

``promtool`` (Debian package ``prometheus``) and ``amtool`` / ``prometheus-alertmanager``
(package ``prometheus-alertmanager``) are installed with apt-get when missing
(``tests/helpers/debian_tools.py``), with service start-up forbidden meanwhile. Where
that is impossible the tests that need them skip, except under ``CI=true``, where
they fail: CI must run them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from helpers.debian_tools import ensure_binary  # noqa: E402
from helpers.fake_clock import FakeClock  # noqa: E402
from helpers.receiver import AlertReceiver  # noqa: E402

from mfuwatch.agent.schema import RunInfo  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clock() -> FakeClock:
    """Unix seconds that move only when the test says so."""
    return FakeClock(1_700_000_000.0)


@pytest.fixture
def run_info() -> RunInfo:
    return RunInfo(run="run-a", rank=0, world_size=1, host="node7", exporter_url="http://127.0.0.1:9478/metrics")


@pytest.fixture
def receiver():
    with AlertReceiver() as rx:
        yield rx


def _tool(names, package: str) -> str:
    return ensure_binary(names, package)  # installs with service starts forbidden


@pytest.fixture(scope="session")
def promtool() -> str:
    return _tool(["promtool"], "prometheus")


@pytest.fixture(scope="session")
def amtool() -> str:
    return _tool(["amtool"], "prometheus-alertmanager")


@pytest.fixture(scope="session")
def alertmanager_bin(amtool) -> str:
    path = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if not path:
        pytest.fail("the prometheus-alertmanager package is installed but its server binary is not on PATH")
    return path
