"""Live progress and the end-of-batch summary (rich).

Why separate: the batch runner only reports events; how they are shown (a live bar on a terminal,
plain lines in CI logs, nothing inside the trainer) is this module's concern.
"""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import fmean

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from lightning_harness.schemas.states import CANCELLED, NO_REWARD, RETRY_FAILURES, SUCCEEDED, TIMED_OUT

from .results import RolloutResult


@dataclass
class BatchStats:
    """Counters of one batch, updated by the runner's worker threads."""

    total: int = 0
    finished: int = 0
    running: int = 0
    failed: int = 0
    no_reward: int = 0
    retried: int = 0
    skipped: int = 0
    reward_sum: float = 0.0
    reward_n: int = 0
    ran: int = 0  # rollouts finished by this process (for the rate)
    t0: float = field(default_factory=time.monotonic)

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.reward_n if self.reward_n else None

    @property
    def rate(self) -> float:
        dt = time.monotonic() - self.t0
        return self.ran / dt if dt > 0 else 0.0

    def line(self) -> str:
        mean = "-" if self.mean_reward is None else f"{self.mean_reward:.3f}"
        return (
            f"running {self.running} · failed {self.failed} · no reward {self.no_reward} · retried {self.retried}"
            f" · mean reward {mean} · {self.rate:.2f} rollouts/s"
        )


class _StatsColumn(ProgressColumn):
    """Reads the counters at every refresh, so running/rate are live between events."""

    def __init__(self, stats: BatchStats) -> None:
        super().__init__()
        self.stats = stats

    def render(self, task) -> Text:
        return Text(self.stats.line())


class BatchProgress:
    """A rich live bar (terminal) or periodic plain lines (no terminal) driven by :class:`BatchStats`."""

    def __init__(self, stats: BatchStats, console: Console | None = None, label: str = "rollouts") -> None:
        self.stats = stats
        self.console = console or Console(stderr=True)
        self.label = label
        self._progress: Progress | None = None
        self._task = None
        self._last_plain = 0.0

    def start(self) -> None:
        if self.console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                _StatsColumn(self.stats),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.stats.total or None)

    def update(self, force: bool = False) -> None:
        s = self.stats
        if self._progress is not None:
            self._progress.update(self._task, completed=s.finished, total=s.total or None)
        elif force or time.monotonic() - self._last_plain >= 5.0:
            self._last_plain = time.monotonic()
            self.console.print(f"{self.label}: {s.finished}/{s.total} finished · {s.line()}", highlight=False)

    def stop(self) -> None:
        self.update(force=self._progress is None)
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


_NUM = re.compile(r"\d+(\.\d+)?s")


def failure_cause(r: RolloutResult) -> str:
    """A short, groupable cause: 'exit code 3', 'timed out', 'no reward: reward file ... not a number'."""
    if r.state == TIMED_OUT:
        return "timed out"
    if r.state == CANCELLED:
        return "cancelled"
    err = (r.error or "").split(";")[0].strip()
    if r.state == NO_REWARD:
        if not err or err.startswith("no reward reported"):
            return "no reward reported"
        return f"no reward: {err}"
    return _NUM.sub("Ns", err) or r.state


def summary_tables(results: Iterable[RolloutResult]) -> list[Table]:
    """Reward by task and failures by cause, over each rollout's final attempt."""
    results = list(results)
    by_task: dict[str, list[RolloutResult]] = defaultdict(list)
    for r in results:
        by_task[r.task_id or "?"].append(r)
    t1 = Table(title="Reward by task", show_lines=False)
    for col, just in (("task", "left"), ("rollouts", "right"), ("succeeded", "right"), ("mean reward", "right"),
                      ("min", "right"), ("max", "right"), ("no reward", "right"), ("failed", "right")):
        t1.add_column(col, justify=just)
    for task_id in sorted(by_task):
        rs = by_task[task_id]
        vals = [r.reward for r in rs if r.reward is not None]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        t1.add_row(
            escape(task_id), str(len(rs)), str(sum(r.state == SUCCEEDED for r in rs)),
            fmt(fmean(vals) if vals else None), fmt(min(vals) if vals else None), fmt(max(vals) if vals else None),
            str(sum(r.state == NO_REWARD for r in rs)), str(sum(r.state in RETRY_FAILURES for r in rs)),
        )
    failures = [r for r in results if r.state != SUCCEEDED]
    causes = Counter(failure_cause(r) for r in failures)
    example = {failure_cause(r): r.log_path or "" for r in reversed(failures)}  # the first of each cause
    t2 = Table(title="Failures by cause")
    t2.add_column("cause")
    t2.add_column("rollouts", justify="right")
    t2.add_column("example log")
    for cause, n in causes.most_common():
        t2.add_row(escape(cause), str(n), escape(example[cause]))  # a harness's words: text, not markup
    if not causes:
        t2.add_row("none", "0", "")
    return [t1, t2]
