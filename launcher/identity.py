"""Rollout identities: ``<run>-<task>-<sample>`` (``<run>-s<step>-<task>-<sample>`` in training), groups, attempts.

Why: the rollout id travels inside proxy credentials (``<rollout_id>~<attempt>:<credential>@``) and
URL paths (``/lh/<rollout_id>~<attempt>/<credential>``), so it must follow the one rule the proxy
enforces (``lightning_harness.proxy.credentials``: [A-Za-z0-9._-], at most 255 characters, never
``~``), and an attempt must fit 0..2**31-1; ids are built to fit and refused otherwise. It must be
deterministic, so re-running the same batch finds the rollouts it already finished.
A retry keeps the rollout id and takes the next attempt number. Splits other than 'train' are
part of the id, so an evaluation of the same task at the same step never collides with training.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_harness.proxy.credentials import check_rollout_id, rollout_user

from .tasks import Task

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_id(text: str, *, max_len: int = 80) -> str:
    """A URL- and credential-safe form of ``text``; a short hash keeps altered ids distinct."""
    cleaned = _UNSAFE.sub("_", text).strip("._-") or "x"
    if cleaned != text or len(cleaned) > max_len:
        digest = hashlib.sha1(text.encode()).hexdigest()[:8]
        cleaned = f"{cleaned[: max_len - 9]}_{digest}"
    return cleaned


def rollout_id(run_id: str, task_id: str, sample_index: int, step: int | None = None, split: str = "train") -> str:
    """``<run>[-<split>][-s<step>]-<task>-<sample>``; the split appears only when it is not 'train'."""
    parts = [safe_id(run_id)]
    if split and split != "train":
        parts.append(safe_id(split, max_len=20))
    if step is not None:
        parts.append(f"s{step}")
    parts += [safe_id(task_id), str(sample_index)]
    return check_rollout_id("-".join(parts))


def default_group(task: Task, step: int | None, split: str = "train") -> str:
    """Advantage group: the task id, plus ``@step`` when there is one, prefixed ``split:`` unless 'train'."""
    group = task.id if step is None else f"{task.id}@{step}"
    return group if not split or split == "train" else f"{split}:{group}"


GroupFn = Callable[..., str]  # (task, step) or (task, step, split) -> group id


@dataclass(frozen=True)
class RolloutSpec:
    """Everything that identifies one rollout before it runs (attempts come later)."""

    rollout_id: str
    run_id: str
    task: Task
    group_id: str
    sample_index: int
    step: int | None = None
    split: str = "train"

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)  # InvalidId (a ValueError) naming the rule

    def credential(self, attempt: int) -> str:
        """The ``<rollout_id>~<attempt>`` string used as proxy username and URL segment."""
        return rollout_user(self.rollout_id, attempt)  # checks the attempt (the id was checked at init)


def check_run_id(run_id: str) -> None:
    """A run id names a folder under ``TRACES/launch`` and starts every rollout id (``~`` separates)."""
    if "~" in run_id or "/" in run_id or run_id in ("", ".", ".."):
        raise ValueError(f"run id {run_id!r} may not be empty, '.' or '..', nor contain '~' or '/'")


def plan_rollouts(
    tasks: Sequence[Task],
    *,
    run_id: str,
    samples: int,
    step: int | None = None,
    split: str = "train",
    group_fn: GroupFn | None = None,
) -> list[RolloutSpec]:
    """tasks x samples -> specs, group by group (all samples of a task adjacent, so groups finish early)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    check_run_id(run_id)
    specs: list[RolloutSpec] = []
    seen: set[str] = set()
    for task in tasks:
        group = group_fn(task, step) if group_fn else default_group(task, step, split)
        for i in range(samples):
            rid = rollout_id(run_id, task.id, i, step, split)
            if rid in seen:
                raise ValueError(f"two tasks map to rollout id {rid!r}; use distinct task ids")
            seen.add(rid)
            specs.append(RolloutSpec(rid, run_id, task, group, i, step, split))
    return specs


def batch_run_id(name: str, *key_parts: str) -> str:
    """A deterministic run id: the same batch gets the same id, so a re-run resumes it."""
    digest = hashlib.sha1("\x1f".join(key_parts).encode()).hexdigest()[:8]
    return f"{safe_id(name, max_len=40)}-{digest}"
