"""Rollout results in memory and in the ``rollouts`` table; what a re-run may skip.

Why: the trainer consumes results as Python objects and the table as Parquet; both come from one
dataclass so they cannot drift. A rollout is *finished* (skipped by a re-run) when an attempt
succeeded or ended without reward, or when its failures used up the retry budget; cancelled
attempts never finish a rollout (the states and what each counts as: ``schemas/states.py``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_harness.schemas import ROLLOUTS, read_table
from lightning_harness.schemas.states import FINISHED, RETRY_FAILURES, RolloutState


@dataclass
class RolloutResult:
    """One attempt of one rollout; field names are the ``rollouts`` table's columns."""

    rollout_id: str
    attempt: int
    run_id: str | None
    task_id: str | None
    group_id: str | None
    sample_index: int | None
    step: int | None
    split: str | None
    state: str
    exit_code: int | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    duration_s: float | None
    reward: float | None
    reward_source: str | None
    error: str | None
    log_path: str | None
    model_version: int | None
    runner: str | None
    task_json: str | None
    # not columns:
    skipped: bool = field(default=False, compare=False)  # loaded from an earlier run, not run now
    attempts_run: int = field(default=1, compare=False)  # attempts this process made for the rollout

    def row(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in ROLLOUTS.names}

    @classmethod
    def from_row(cls, row: dict[str, Any], *, skipped: bool = False) -> RolloutResult:
        values = {name: row.get(name) for name in ROLLOUTS.names}
        return cls(**values, skipped=skipped, attempts_run=0)

    @property
    def ok(self) -> bool:
        return self.state == RolloutState.SUCCEEDED


@dataclass
class GroupResult:
    """All rollouts of one advantage group, each at its final attempt."""

    group_id: str
    rollouts: list[RolloutResult]

    @property
    def rewards(self) -> list[float | None]:
        return [r.reward for r in self.rollouts]

    @property
    def complete(self) -> bool:
        """Every rollout of the group finished with a reward."""
        return all(r.state == RolloutState.SUCCEEDED for r in self.rollouts)


@dataclass
class History:
    """What earlier runs left for one rollout id."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last_attempt(self) -> int:
        return max((int(r["attempt"]) for r in self.rows), default=-1)

    @property
    def failures(self) -> int:
        return sum(1 for r in self.rows if r["state"] in RETRY_FAILURES)

    def final(self, retries: int) -> dict[str, Any] | None:
        """The row that finished this rollout, or None if it must (still) run."""
        done = [r for r in self.rows if r["state"] in FINISHED]
        if done:
            return max(done, key=lambda r: int(r["attempt"]))
        if self.failures >= retries + 1:
            return max((r for r in self.rows if r["state"] in RETRY_FAILURES), key=lambda r: int(r["attempt"]))
        return None


def load_history(traces_dir: str | Path, *, run_id: str | None = None) -> dict[str, History]:
    """Rows already in ``TRACES/rollouts`` grouped by rollout id (optionally of one run only)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = read_table(traces_dir, "rollouts")
    out: dict[str, History] = {}
    if table.num_rows == 0:
        return out
    if run_id is not None:
        table = table.filter(pc.equal(table["run_id"], pa.scalar(run_id, pa.string())))
    for row in table.to_pylist():
        out.setdefault(row["rollout_id"], History()).rows.append(row)
    return out
