"""The SWE bug-fix task generator: deterministic, committed splits match, tasks are real bugs.

Full generation is in-process and takes a few seconds, so the committed JSONL is regenerated in full;
the subprocess checks (score, pytest on a task folder) run on a fixed sample.
"""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_swe import SWE, needs_bwrap, reward
from fixtures_swe import generate as gen

FAMILY_WORDS = ("operator", "off-by-one", "off by one", "swap", "constant", "invert", "condition",
                "return", "family")



def score(task: dict, folder: Path, **kw) -> float:
    """The one hidden-test scorer (examples/swe/reward.py, sandboxed): the reward step's."""
    return reward.score(task, folder, **kw)[0]


def committed(split: str) -> list[dict]:
    return [json.loads(line) for line in (SWE / f"tasks_{split}.jsonl").read_text().splitlines()]


def sample(n: int) -> list[dict]:
    tasks = committed("train") + committed("eval")
    return random.Random(1234).sample(tasks, n)


def test_committed_splits_match_regeneration():
    seed = committed("train")[0]["seed"]
    splits = gen.build(seed)
    for split in ("train", "eval"):
        assert gen.dump(splits[split]) == (SWE / f"tasks_{split}.jsonl").read_text(), split


def test_same_seed_same_bytes_and_subset_agrees(tmp_path):
    names = "stats,roman,rle,ledger"
    for run in ("a", "b"):
        assert gen.main(["--seed", "3", "--out", str(tmp_path / run), "--projects", names]) == 0
    for split in ("train", "eval"):
        first = (tmp_path / "a" / f"tasks_{split}.jsonl").read_bytes()
        assert first == (tmp_path / "b" / f"tasks_{split}.jsonl").read_bytes()
    other = gen.build(4, names.split(","))
    assert gen.dump(other["train"] + other["eval"]) != (
        (tmp_path / "a" / "tasks_train.jsonl").read_text() + (tmp_path / "a" / "tasks_eval.jsonl").read_text())


def test_splits_share_no_project_or_function_and_sizes():
    train, held_out = committed("train"), committed("eval")
    assert len(train) >= 200 and len(held_out) >= 50
    assert not {t["project"] for t in train} & {t["project"] for t in held_out}
    assert not {t["function"] for t in train} & {t["function"] for t in held_out}
    ids = [t["id"] for t in train + held_out]
    assert len(ids) == len(set(ids))
    assert {t["family"] for t in train} == set(gen.FAMILIES)


def test_practice_set_is_train_tasks_under_their_own_ids():
    """`scripts/demo.sh swe-practice`: the practice tasks are train tasks as committed, its evaluation the
    same tasks under new ids (the loop refuses train and eval files sharing an id), none held out."""
    train = {t["id"]: t for t in committed("train")}
    practice = committed("practice")
    assert practice and all(train.get(t["id"]) == t for t in practice)
    assert committed("practice_eval") == [{**t, "id": "again-" + t["id"]} for t in practice]
    assert not {t["project"] for t in practice} & {t["project"] for t in committed("eval")}


def _defined_names(source: str) -> set[str]:
    return {n.name.lower() for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_train_only_projects_never_enter_the_held_out_draw():
    """projects_train.py only adds train tasks: the held-out draw is made from projects.py alone, the
    tasks that existed before keep their place, and no train-only project shares a name with any project
    or function of projects.py (so none can shadow a held-out one, whatever the seed)."""
    assert len(gen.TRAIN_ONLY) >= 40 and not gen.TRAIN_ONLY.keys() & gen.PROJECTS.keys()
    for seed in range(5):
        train, held_out = gen.split_projects(seed)
        assert set(held_out) <= gen.PROJECTS.keys() and len(held_out) == gen.EVAL_PROJECTS
        assert train[-len(gen.TRAIN_ONLY):] == sorted(gen.TRAIN_ONLY)
        assert set(train) | set(held_out) == gen.CATALOGUE.keys()
    original = set(gen.PROJECTS) | {f for spec in gen.PROJECTS.values() for f in _defined_names(spec["module"])}
    for name, spec in gen.TRAIN_ONLY.items():
        assert not ({name} | _defined_names(spec["module"])) & original, name
    train = committed("train")
    first_extra = next(i for i, t in enumerate(train) if t["project"] in gen.TRAIN_ONLY)
    assert all(t["project"] in gen.TRAIN_ONLY for t in train[first_extra:])
    assert len({t["project"] for t in train[first_extra:]}) == len(gen.TRAIN_ONLY)  # every one gives tasks
    with pytest.raises(ValueError, match="unknown projects"):
        gen.split_projects(0, ["stats", "no_such_project"])


def test_train_only_rewards_also_run_the_visible_checks():
    """A train-only task's reward runs its visible test functions too, so no module that fails a visible
    test can score: every single-site mutant of a train-only project that fails a visible test fails
    the reward's suite."""
    by_project = {t["project"]: t for t in committed("train") if t["project"] in gen.TRAIN_ONLY}
    for name, task in by_project.items():
        visible = task["files"][f"test_{name}.py"]
        assert set(re.findall(r"def (test_\w+)", visible)) <= set(re.findall(r"def (test_\w+)", task["hidden_tests"]))
        for _, _, buggy in gen.mutants(task["solution"]):
            failing = gen.run_suite(name, buggy, visible)
            if failing and failing != ["<collection>"]:
                assert gen.run_suite(name, buggy, task["hidden_tests"]) != [], (name, buggy)  # fails or hangs


def test_bug_is_inside_the_named_function_only():
    for task in committed("train") + committed("eval"):
        buggy = dict(gen.functions(ast.parse(task["files"][f"{task['project']}.py"])))
        fixed = dict(gen.functions(ast.parse(task["solution"])))
        assert buggy.keys() == fixed.keys()
        changed = [name for name in fixed if ast.dump(buggy[name]) != ast.dump(fixed[name])]
        assert changed == [task["function"]], task["id"]


def test_prompts_name_a_failing_test_and_the_file_but_not_the_family():
    for task in committed("train") + committed("eval"):
        prompt = task["prompt"]
        assert f"{task['project']}.py" in prompt
        named = set(re.findall(r"test_\w+(?<!\.py)\b", prompt)) - {f"test_{task['project']}"}
        assert named and named <= set(task["failing_visible_tests"]), task["id"]
        assert not any(word in prompt.lower() for word in FAMILY_WORDS), prompt


@needs_bwrap
@pytest.mark.parametrize("task", sample(20), ids=lambda t: t["id"])
def test_buggy_folder_scores_zero_and_original_scores_one(task, tmp_path):
    folder = gen.write_task(task, tmp_path / "task")
    module = folder / f"{task['project']}.py"
    visible = (folder / f"test_{task['project']}.py").read_text()
    failing = gen.run_suite(task["project"], module.read_text(), visible)
    assert failing == task["failing_visible_tests"]
    assert score(task, folder) == 0.0
    module.write_text(task["solution"])
    assert gen.run_suite(task["project"], module.read_text(), visible) == []
    assert score(task, folder) == 1.0


@pytest.mark.parametrize("task", sample(3), ids=lambda t: t["id"])
def test_pytest_in_the_task_folder_sees_the_same_failures(task, tmp_path):
    folder = gen.write_task(task, tmp_path / "task")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider"],
                          cwd=folder, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout
    reported = sorted(re.findall(r"^FAILED \S+::(test_\w+)", proc.stdout, re.MULTILINE))
    assert reported == sorted(task["failing_visible_tests"])


@needs_bwrap
def test_score_ignores_edited_visible_tests_and_times_out(tmp_path):
    task = sample(1)[0]
    folder = gen.write_task(task, tmp_path / "task")
    (folder / f"test_{task['project']}.py").write_text("def test_nothing():\n    pass\n")
    assert score(task, folder) == 0.0
    (folder / f"{task['project']}.py").write_text("while True:\n    pass\n")
    assert score(task, folder, timeout=2) == 0.0


class _CyclicFinalizer:
    """Garbage only the cycle collector frees, running Python code (and so letting threads switch)
    in the middle of whatever allocation triggered the collection."""

    def __del__(self):
        sum(range(50))


def test_mutants_can_be_enumerated_from_many_threads_at_once():
    """The solver's threaded server enumerates mutants concurrently. CPython 3.11's AST builder keeps
    its recursion depth per interpreter: parses interleaved by a thread switch inside a collection
    failed with "AST constructor recursion depth mismatch" (seen once in CI)."""
    import gc
    import threading
    source = committed("train")[0]["solution"]
    errors: list[BaseException] = []

    def enumerate_mutants():
        for _ in range(15):
            try:
                assert list(gen.mutants(source))
            except SystemError as e:
                errors.append(e)
                return
            for _ in range(20):
                junk = _CyclicFinalizer()
                junk.me = junk

    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        threads = [threading.Thread(target=enumerate_mutants) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*threshold)
    assert not errors, errors[0]
