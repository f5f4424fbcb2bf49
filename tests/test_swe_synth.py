"""Generated train-only SWE projects (examples/swe/synth.py): deterministic, disjoint from every hand-written
and held-out name, right by construction, and their kept mutants are real bugs the reward can see.

Everything runs in-process (the generator's own suite runner) except one sandboxed scoring check, so the
file stays well under a minute on a loaded machine.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import subprocess
import sys

import pytest
from fixtures_swe import SWE, load, needs_bwrap, reward
from fixtures_swe import generate as gen

N_PROJECTS = 300  # catalogue-level checks (fast: no mutants)
N_MUTATED = 25    # projects whose mutants are generated and checked


@pytest.fixture(scope="module")
def projects() -> dict:
    return gen.synth_projects(N_PROJECTS, 0, taken=gen.catalogue_names())


@pytest.fixture(scope="module")
def tasks() -> list[dict]:
    return gen.synth_tasks(N_MUTATED, 0, 0)


def defined(source: str) -> set[str]:
    return {n.name.lower() for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_same_seed_same_bytes_other_seed_other_projects():
    first, again = gen.synth_tasks(4, 3, 0), gen.synth_tasks(4, 3, 0)
    assert gen.dump(first) == gen.dump(again) and first
    assert gen.synth_projects(4, 3) != gen.synth_projects(4, 4)


def test_a_taken_name_changes_only_the_project_that_used_it(projects):
    """Project i draws from its own RNG, so avoiding one more name redraws that project, and after it only
    a project whose name an earlier redrawn one has now taken."""
    names = list(projects)
    avoided = names[5]
    again = list(gen.synth_projects(N_PROJECTS, 0, taken=gen.catalogue_names() | {avoided}))
    assert avoided not in again
    changed = [i for i, (a, b) in enumerate(zip(names, again)) if a != b]
    assert changed[0] == 5 and all(names[j] in again[:j] for j in changed[1:])


def test_names_never_hand_written_or_held_out(projects):
    """No generated project or function takes a name of projects.py or projects_train.py (so none of
    the held-out draw's, whatever the seed), a builtin, keyword or stdlib module name."""
    hand_written = gen.catalogue_names()
    for seed in range(5):
        _, held_out = gen.split_projects(seed)
        held = set(held_out) | {f for name in held_out for f in defined(gen.CATALOGUE[name]["module"])}
        assert held <= hand_written
    reserved = set(sys.stdlib_module_names) | set(dir(builtins))
    assert len(projects) == N_PROJECTS
    for name, spec in projects.items():
        names = {name} | {d for d in defined(spec["module"]) if not d.startswith("__")}  # __init__ is Python's
        assert not names & hand_written, name
        assert name not in reserved and re.fullmatch(r"[a-z]+(_[a-z]+)+", name), name


def test_catalogue_shape_matches_projects_train(projects):
    """Same keys and the same reward_extra projects_train.project() builds from the visible file; sizes as
    asked: 3-5 functions in 15-40 lines, 2-4 visible and 3-6 hidden test functions, none sharing a name
    (the reward runs hidden and visible checks in one namespace), every function hidden-tested."""
    train = load("swe_projects_train_shape", SWE / "projects_train.py")
    for name, spec in projects.items():
        assert set(spec) == {"module", "visible", "hidden", "reward_extra"}
        train.project(name, spec["module"], spec["visible"], spec["hidden"])
        assert train.TRAIN_ONLY_PROJECTS[name] == spec, name
        funcs = [n.name for n in ast.parse(spec["module"]).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert 3 <= len(funcs) <= 5 and 15 <= len(spec["module"].strip().splitlines()) <= 40, name
        visible = re.findall(r"^def (test_\w+)\(", spec["visible"], re.M)
        hidden = re.findall(r"^def (test_\w+)\(", spec["hidden"], re.M)
        assert 2 <= len(visible) <= 4 and 3 <= len(hidden) <= 6 and not set(visible) & set(hidden), name
        assert len(set(visible)) == len(visible) and len(set(hidden)) == len(hidden)
        stems = [re.sub(r"(?<!^)([A-Z])", r"_\1", f).lower() for f in funcs]  # ParcelRack: test_parcel_rack_*
        assert all(any(t.startswith(f"test_{f}_") for t in hidden) for f in stems), name
        assert spec["visible"].startswith(f"\nfrom {name} import {', '.join(funcs)}\n\n\ndef test_")


def test_correct_modules_pass_every_suite(projects):
    for name, spec in projects.items():
        module = ast.unparse(ast.parse(spec["module"])) + "\n"
        for suite in (spec["visible"], spec["hidden"], spec["hidden"] + spec["reward_extra"]):
            assert gen.run_suite(name, module, suite) == [], name


def test_kept_mutants_fail_a_visible_test_and_the_reward(tasks):
    """Every kept task: the buggy module fails the visible tests it names and the reward's suite (hidden
    tests plus the visible checks); and any single-site mutant that fails a visible test fails the reward."""
    assert len({t["project"] for t in tasks}) == N_MUTATED and len({t["id"] for t in tasks}) == len(tasks)
    assert {t["family"] for t in tasks} == set(gen.FAMILIES)
    for task in tasks:
        name, buggy = task["project"], task["files"][f"{task['project']}.py"]
        visible = task["files"][f"test_{name}.py"]
        assert gen.run_suite(name, buggy, visible) == task["failing_visible_tests"] != []
        assert gen.run_suite(name, buggy, task["hidden_tests"]) != []
        assert gen.run_suite(name, task["solution"], task["hidden_tests"]) == []
    for task in {t["project"]: t for t in tasks}.values():
        name = task["project"]
        for _, _, buggy in gen.mutants(task["solution"]):
            failing = gen.run_suite(name, buggy, task["files"][f"test_{name}.py"])
            if failing and failing != ["<collection>"]:
                assert gen.run_suite(name, buggy, task["hidden_tests"]) != [], (name, buggy)


def test_generate_writes_synth_file_apart_from_the_splits(tmp_path, tasks):
    """--synth adds tasks_synth.jsonl; the train and eval files are what they are without it."""
    names = "stats,scoreboard"
    assert gen.main(["--seed", "0", "--out", str(tmp_path), "--projects", names, "--synth", "5"]) == 0
    splits = gen.build(0, names.split(","))
    for split in ("train", "eval"):
        assert (tmp_path / f"tasks_{split}.jsonl").read_text() == gen.dump(splits[split])
    synth = [json.loads(line) for line in (tmp_path / "tasks_synth.jsonl").read_text().splitlines()]
    assert synth == tasks[:len(synth)] and synth
    assert not {t["project"] for t in synth} & gen.CATALOGUE.keys()


def test_first_listing_fits_one_observation(tasks, tmp_path):
    """mini.yaml keeps an observation's last 1,500 characters: `cat -n` of a task's module and tests must
    fit, or the top of the module (maybe the bug) never reaches the agent."""
    for task in {t["project"]: t for t in tasks}.values():
        folder = gen.write_task(task, tmp_path / task["project"])
        listing = subprocess.run(["cat", "-n", f"{task['project']}.py", f"test_{task['project']}.py"], cwd=folder,
                                 capture_output=True, text=True, check=True).stdout
        assert len(listing) <= 1500, task["project"]


@needs_bwrap
def test_sandboxed_reward_scores_bug_zero_and_solution_one(tasks, tmp_path):
    for i, task in enumerate(tasks[::len(tasks) // 3][:3]):
        folder = gen.write_task(task, tmp_path / f"t{i}")
        assert reward.score(task, folder)[0] == 0.0, task["id"]
        (folder / f"{task['project']}.py").write_text(task["solution"])
        assert reward.score(task, folder)[0] == 1.0, task["id"]
