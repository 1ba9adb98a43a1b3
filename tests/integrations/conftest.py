"""Fixtures for the framework integration tests (shared pieces: tests/helpers/integration_fixtures.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def tiny_llama():
    pytest.importorskip("transformers")
    from helpers.integration_fixtures import make_tiny_llama

    return make_tiny_llama()
