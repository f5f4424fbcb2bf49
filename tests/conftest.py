"""Shared pytest setup: fixtures live in tests/fixtures_*.py, one file per area, loaded here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_harness.process import free_port  # tests import it from here too

TESTS = Path(__file__).parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))

pytest_plugins = sorted(p.stem for p in TESTS.glob("fixtures_*.py"))


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
