"""Fixtures for launcher tests: the test harness command, task files, table readers, process checks."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "support" / "harness_chat.py"


@pytest.fixture
def harness_cmd() -> list[str]:
    """argv of the multi-turn openai-client test harness (tests/support/harness_chat.py)."""
    return [sys.executable, str(HARNESS)]


@pytest.fixture
def write_tasks(tmp_path):
    """``write_tasks(rows, name="tasks.jsonl") -> Path`` writes a JSONL task file."""

    def write(rows, name: str = "tasks.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return write


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids, timeout: float = 20.0) -> list[int]:
    """Poll until every pid is gone; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        if alive:
            time.sleep(0.1)
    return alive


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy (returned) or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


@pytest.fixture
def rows():
    """``rows(traces, table) -> list[dict]`` reads a table with the project's reader."""
    from lightning_harness.schemas import read_table

    return lambda traces, table: read_table(traces, table).to_pylist()
