#!/usr/bin/env python
"""Write swe tasks again under made-up names: the same bug and fix, every name the model could have
memorised changed (project, file, functions, parameters, variables, test names).

Why: a practice run lifts the tasks it practised (examples/swe/README.md, "Practice"); scoring the
same tasks renamed asks whether what it learnt is the fix or the text it practised on. Each copy is
checked the way the generator checks a task (the buggy module scores 0.0 with the sandboxed hidden
tests, the renamed solution 1.0) and drawn again otherwise; deterministic for a seed.

    .venv/bin/python scripts/rename_swe_tasks.py examples/swe/tasks_practice_eval.jsonl renamed_eval.jsonl
    .venv/bin/python scripts/rename_swe_tasks.py examples/swe/tasks_practice.jsonl renamed_train.jsonl \\
        --copies 8 --seed near-transfer-train --avoid renamed_eval.jsonl
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import build_swe_model as build
import click

DRAWS = 50  # renamings tried per copy before giving up on a task


def names_of(task: dict) -> set[str]:
    """The names a renamed task is known by: its project and the parts of its function's name."""
    return {task["project"], *task["function"].split(".")}


def read(path: Path) -> list[dict]:
    """A task file's records (JSONL, or gzip-compressed ``.gz``), read as the model build reads them."""
    return [json.loads(line) for line in build._lines(path) if line.strip()]


def valid(task: dict) -> bool:
    """The buggy module fails the hidden tests and the solution passes them (sandboxed scorer)."""
    with tempfile.TemporaryDirectory() as folder:
        build.swe_tasks.write_task(task, folder)
        buggy, _ = build.swe_reward.score(task, folder)
        (Path(folder) / build.module_name(task)).write_text(task["solution"])
        fixed, _ = build.swe_reward.score(task, folder)
    return buggy == 0.0 and fixed == 1.0


def renamed_copies(tasks: list[dict], copies: int, seed: str, avoid: set[str], prefix: str) -> list[dict]:
    """``copies`` renamed copies of each task, in order, none named by a name in ``avoid``."""
    rng = random.Random(seed)
    out = []
    for task in tasks:
        base = task["id"].removeprefix("again-")
        for k in range(copies):
            for _ in range(DRAWS):
                copy = build.renamed_task(task, rng)
                if not names_of(copy) & avoid and valid(copy):
                    break
            else:
                raise click.ClickException(f"no valid renaming of {task['id']} in {DRAWS} draws")
            copy["id"] = f"{prefix}{k if copies > 1 else ''}-{base}"
            out.append(copy)
    return out


@click.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("dest", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--copies", default=1, show_default=True, help="renamed copies of each task")
@click.option("--seed", default="near-transfer-0", show_default=True, help="seed of the names drawn")
@click.option("--avoid", type=click.Path(exists=True, dir_okay=False, path_type=Path), multiple=True,
              help="a task file whose projects and function names no copy may use (repeatable)")
@click.option("--prefix", default="renamed", show_default=True, help="of each copy's id")
def main(src: Path, dest: Path, copies: int, seed: str, avoid: tuple[Path, ...], prefix: str) -> None:
    taken = {name for f in avoid for task in read(f) for name in names_of(task)}
    out = renamed_copies(read(src), copies, seed, taken, prefix)
    dest.write_text("".join(json.dumps(t, sort_keys=True) + "\n" for t in out))
    click.echo(f"{len(out)} renamed tasks ({len({t['project'] for t in out})} projects) -> {dest}")


if __name__ == "__main__":
    main()
