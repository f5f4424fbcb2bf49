"""Which task groups run, which finished groups an update trains on, which are too stale to train.

Why one place: the groups in flight, the finished groups waiting and the staleness rule decide together
how far rollouts run ahead of the policy. Sync is async with only the step's groups in flight
(:meth:`Schedule.from_rollout`, the one reader of ``rollout.mode``). Pure bookkeeping: the loop
submits what :meth:`Scheduler.launches` returns and hands back what the launcher reports finished.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from lightning_harness.launcher.identity import default_group

from .config import ConfigError


class TaskStream:
    """Deterministic endless stream of training tasks: epoch ``e`` is the task list shuffled with
    ``seed + e``. A position (an int) is all ``state.json`` needs to continue it after a crash."""

    def __init__(self, tasks: list, seed: int, pos: int = 0) -> None:
        if not tasks:
            raise ConfigError("tasks.train has no tasks")
        self.tasks, self.seed, self.pos = tasks, seed, pos
        self._perm: dict[int, list[int]] = {}

    def _at(self, pos: int):
        epoch, i = divmod(pos, len(self.tasks))
        if epoch not in self._perm:
            order = list(range(len(self.tasks)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._perm = {epoch: order}
        return self.tasks[self._perm[epoch][i]]

    def take(self, n: int, exclude: set[str]) -> list:
        """Next ``n`` tasks whose ids are not in ``exclude`` (ids already used in this launch step)."""
        out, skipped = [], 0
        while len(out) < n:
            if skipped > len(self.tasks):
                raise ConfigError(f"not enough distinct train tasks: need {n} for one step, have {len(self.tasks)}")
            task = self._at(self.pos)
            self.pos += 1
            if task.id in exclude:
                skipped += 1
                continue
            exclude.add(task.id)
            out.append(task)
        return out


@dataclass(frozen=True)
class Schedule:
    """Settings and the staleness rule (staleness: versions a rollout's oldest call lags the trained policy)."""

    groups_per_step: int  # finished groups one update consumes
    groups_in_flight: int  # groups launched and not yet consumed (a finished one keeps its slot)
    max_staleness: int
    staleness_mode: str  # 'drop': too stale is discarded (a fresh group replaces it); 'tis': kept, TIS corrects

    @classmethod
    def from_rollout(cls, r) -> Schedule:
        """``rollout.mode`` translated. Sync: only the step's groups in flight, so nothing runs through an
        update and nothing can go stale (staleness 0, and nothing is ever dropped for it)."""
        if r.mode == "async":
            return cls(r.groups_per_step, r.groups_in_flight, r.max_staleness, r.staleness_mode)
        return cls(r.groups_per_step, r.groups_per_step, 0, "tis")

    def too_stale(self, group, version: int) -> bool:
        """A finished group an update at ``version`` may not consume (dropped whole, never in part)."""
        started = [r.model_version for r in group.rollouts if r.model_version is not None]
        return self.staleness_mode == "drop" and bool(started) and version - min(started) > self.max_staleness


class Scheduler:
    """The task stream, the groups in flight (by the launcher's group id, ``task@label``, the label
    being the launching step; the values are what ``state.json`` keeps) and the finished ones waiting."""

    def __init__(self, schedule: Schedule, tasks: list, seed: int, stream_pos: int = 0) -> None:
        self.schedule = schedule
        self.stream = TaskStream(tasks, seed, stream_pos)
        self._by_id = {t.id: t for t in tasks}
        self.in_flight: dict[str, dict[str, Any]] = {}  # group id -> {"task": id, "label": step}
        self.backlog: list = []  # finished groups (launcher GroupResults) not yet consumed
        self.discarded = 0  # finished too stale to train, cumulative
        self._used: dict[int, set[str]] = {}  # label -> task ids launched with it (group ids stay distinct)

    def _launched(self, task, label: int) -> None:
        self._used.setdefault(label, set()).add(task.id)
        self.in_flight[default_group(task, label)] = {"task": task.id, "label": label}

    def resume(self, entries: list[dict]) -> list[tuple[int, list]]:
        """The groups saved as in flight, to submit again as ``(label, tasks)`` in label order (rollout
        ids are deterministic: the launcher skips every rollout that had already finished)."""
        by_label: dict[int, list] = {}
        for e in entries:
            task, label = self._by_id[e["task"]], int(e["label"])
            by_label.setdefault(label, []).append(task)
            self._launched(task, label)
        return sorted(by_label.items())

    def launches(self, label: int) -> list:
        """Tasks to launch now with ``label``: the free slots, filled from the stream. Finished groups
        not yet consumed keep their slot: that bounds how stale they can get."""
        room = self.schedule.groups_in_flight - len(self.in_flight)
        if room <= 0:
            return []
        tasks = self.stream.take(room, self._used.setdefault(label, set()))
        for t in tasks:
            self._launched(t, label)
        return tasks

    def finished(self, groups: list, version: int) -> None:
        """Groups the launcher reports finished. One already too stale is discarded now (its slot is
        refilled) instead of counting towards the update, so every update trains as many groups."""
        for g in groups:
            if self.schedule.too_stale(g, version):
                self._discard(g)
            else:
                self.backlog.append(g)

    def expire(self, version: int) -> None:
        """Discard the waiting groups that became too stale through the last update."""
        for g in [g for g in self.backlog if self.schedule.too_stale(g, version)]:
            self.backlog.remove(g)
            self._discard(g)

    def _discard(self, group) -> None:
        self.in_flight.pop(group.group_id, None)
        self.discarded += 1

    @property
    def ready(self) -> bool:
        """Enough finished groups for an update."""
        return len(self.backlog) >= self.schedule.groups_per_step

    def take(self) -> list:
        """The groups an update consumes, oldest launch first (no group waits forever); their slots free up."""
        self.backlog.sort(key=lambda g: self.in_flight.get(g.group_id, {}).get("label", 0))
        n = self.schedule.groups_per_step
        taken, self.backlog = self.backlog[:n], self.backlog[n:]
        for g in taken:
            self.in_flight.pop(g.group_id, None)
        return taken


def staleness_filter(table, version: int, max_staleness: int, mode: str):
    """Drop rollouts whose oldest call is more than ``max_staleness`` versions behind ``version``
    (``mode='drop'``), or keep them and let the truncated importance weights correct (``'tis'``).
    Whole rollouts go, so per-rollout loss weights stay valid."""
    import pyarrow as pa

    rep = {"async/staleness_max": 0.0, "async/staleness_mean": 0.0, "async/staleness_seen_max": 0.0,
           "async/dropped_rollouts": 0, "async/dropped_samples": 0}
    if table.num_rows == 0:
        return table, rep
    vmin = table["model_version_min"].to_pylist()
    stale = [version - (v if v is not None else version) for v in vmin]
    rep["async/staleness_seen_max"] = float(max(stale))
    rids = table["rollout_id"].to_pylist()
    if mode == "drop":
        too_old = {r for r, s in zip(rids, stale) if s > max_staleness}
        if too_old:
            keep = [r not in too_old for r in rids]
            rep["async/dropped_rollouts"] = len(too_old)
            rep["async/dropped_samples"] = keep.count(False)
            table = table.filter(pa.array(keep))
            stale = [s for s, k in zip(stale, keep) if k]
    if stale:  # staleness of what is actually trained on
        rep["async/staleness_max"] = float(max(stale))
        rep["async/staleness_mean"] = float(sum(stale) / len(stale))
    return table, rep
