"""Task files: JSONL, JSON or Parquet rows, each with a task id and free fields.

Why a module of its own: a bad task file is the most common user error, and it must fail before any
harness starts, with the file, line and field named, and without touching existing traces.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Columns tried, in order, when no id field is named.
ID_FIELDS = ("task_id", "id")


class TaskFileError(ValueError):
    """The task file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Task:
    """One task row: ``id`` (a string) and every field of the row, id included, in ``fields``;
    ``private``: fields only the reward command sees (launcher/attempt.py keeps them from the harness)."""

    id: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    private: frozenset[str] = frozenset()

    def to_json(self) -> str:
        return json.dumps(dict(self.fields), sort_keys=True, default=str)

    @property
    def public(self) -> dict[str, Any]:
        """The row without its private fields: what the harness gets and what the traces keep."""
        return {k: v for k, v in self.fields.items() if k not in self.private}

    def public_json(self) -> str:
        return json.dumps(self.public, sort_keys=True, default=str)


def _task_from_row(row: Any, where: str, id_field: str | None) -> Task:
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: a task must be a JSON object, got {type(row).__name__}")
    names = (id_field,) if id_field else ID_FIELDS
    for name in names:
        if name in row and row[name] is not None:
            value = row[name]
            break
    else:
        wanted = repr(id_field) if id_field else " or ".join(repr(n) for n in ID_FIELDS)
        raise TaskFileError(f"{where}: missing task id field {wanted} (fields: {sorted(row)})")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TaskFileError(f"{where}: task id must be a string or integer, got {value!r}")
    task_id = str(value).strip()
    if not task_id:
        raise TaskFileError(f"{where}: task id is empty")
    fields = dict(row)
    fields.setdefault("task_id", task_id)
    return Task(task_id, fields)


def tasks_from_rows(rows: Iterable[Any], *, source: str = "<rows>", id_field: str | None = None) -> list[Task]:
    """Validate rows (dicts or Task) into Tasks; ids must be unique."""
    return _unique_tasks(((f"{source}: row {i}", row) for i, row in enumerate(rows, 1)), id_field)


def _unique_tasks(located: Iterable[tuple[str, Any]], id_field: str | None) -> list[Task]:
    """Tasks of ``(where, row)`` pairs; a repeated id is an error naming both places."""
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for where, row in located:
        task = row if isinstance(row, Task) else _task_from_row(row, where, id_field)
        if task.id in seen:
            raise TaskFileError(f"{where}: duplicate task id {task.id!r} (first at {seen[task.id]})")
        seen[task.id] = where
        tasks.append(task)
    return tasks


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip() or line.lstrip().startswith("//"):
                continue
            try:
                rows.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    return rows


def _read_json(path: Path) -> list[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("tasks"), list):
        data = data["tasks"]
    if not isinstance(data, list):
        raise TaskFileError(f"{path}: a JSON task file holds a list of objects (or {{\"tasks\": [...]}})")
    return [(f"{path}: item {i}", row) for i, row in enumerate(data, 1)]


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise TaskFileError(f"{path}: cannot read Parquet ({exc})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]


def load_tasks(path: str | os.PathLike, *, id_field: str | None = None, limit: int | None = None,
               private_fields: Iterable[str] = ()) -> list[Task]:
    """Load and validate a task file (``.jsonl``/``.ndjson``, ``.json`` or ``.parquet``).

    The id comes from ``id_field`` or else the first of ``task_id``/``id`` present. ``private_fields``
    are kept from the harness (see :class:`Task`); one that no row has is an error (a typo would
    otherwise hand the harness the field it was meant to hide). Raises :class:`TaskFileError` naming
    the file and line for any problem; an empty file is an error too.
    """
    p = Path(path)
    if not p.exists():
        raise TaskFileError(f"{p}: task file not found")
    if p.is_dir():
        raise TaskFileError(f"{p}: is a directory, expected a .jsonl, .json or .parquet file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        located = _read_jsonl(p)
    elif suffix == ".json":
        located = _read_json(p)
    elif suffix in (".parquet", ".pq"):
        located = _read_parquet(p)
    else:
        raise TaskFileError(f"{p}: unknown task file type {suffix!r} (use .jsonl, .json or .parquet)")
    if not located:
        raise TaskFileError(f"{p}: no tasks in file")
    tasks = _unique_tasks(located, id_field)
    private = frozenset(private_fields)
    if unknown := private.difference(*(t.fields for t in tasks)):
        raise TaskFileError(f"{p}: private field(s) {sorted(unknown)} are in no task (fields: "
                            f"{sorted(tasks[0].fields)})")
    tasks = [Task(t.id, t.fields, private) for t in tasks] if private else tasks
    return tasks[:limit] if limit else tasks
