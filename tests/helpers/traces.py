"""Where the real H200 profiler traces the tests read live: ``tests/fixtures/traces/`` (see its README)."""

from pathlib import Path

#: The folder of the real traces; inside the repository, so a bare clone runs every test.
TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
