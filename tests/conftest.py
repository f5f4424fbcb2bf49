"""Shared pytest setup: fixtures live in tests/fixtures_*.py, one file per area, loaded here."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))

pytest_plugins = sorted(p.stem for p in TESTS.glob("fixtures_*.py"))


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (tests never use fixed ports: helpers run in parallel)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
