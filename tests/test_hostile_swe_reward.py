"""The swe reward against a hostile policy (session review of reward integrity): what the agent can leave
in its folder, what the scored module can reach, and what the hidden tests can be made to conclude
without a fix. Every check uses the real scorer (examples/swe/reward.py) in the real sandbox.

Each attack on the folder is shown to work on the naive verdict (``python -m pytest`` in the folder,
sandboxed) before the scorer is shown to ignore it, so none of these tests passes vacuously.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from fixtures_swe import SWE, needs_bwrap, reward
from fixtures_swe import generate as gen

sys.path.insert(0, str(SWE))
import sandbox  # noqa: E402

pytestmark = needs_bwrap


def committed(split: str) -> list[dict]:
    return [json.loads(line) for line in (SWE / f"tasks_{split}.jsonl").read_text().splitlines()]


def task_by_id(task_id: str) -> dict:
    return next(t for t in committed("train") + committed("eval") if t["id"] == task_id)


# ---------------------------------------------------------------- a module ending a map() early

MAP_TESTS = """
from demo import is_even


def test_evens():
    assert all(map(is_even, [2, 4, 6]))


def test_odds():
    assert not any(map(is_even, [1, 3, 5]))
"""


def test_a_stop_iteration_from_the_module_is_not_the_end_of_a_tests_map(tmp_path):
    """StopIteration raised by the module reached the tests as StopIteration: inside ``map``/``filter`` it
    reads as "no more items", so ``all(map(f, xs))`` was True and ``any(...)`` False whatever f computes
    (a blind pass, scored 1.0). It now arrives as RuntimeError, as PEP 479 makes it inside a generator."""
    folder = tmp_path / "demo"
    folder.mkdir()
    task = {"project": "demo", "hidden_tests": MAP_TESTS}
    for module, want in (("def is_even(n):\n    return n % 2 == 0\n", 1.0),
                         ("def is_even(n):\n    return True\n", 0.0),
                         ("def is_even(n):\n    raise StopIteration\n", 0.0),
                         ("class Done(StopIteration):\n    pass\n\n\ndef is_even(n):\n    raise Done()\n", 0.0)):
        (folder / "demo.py").write_text(module)
        assert reward.score(task, folder, timeout=30)[0] == want, module


# ---------------------------------------------------------------- what the agent leaves in its folder

REPORT_PASSED = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
"""
ADDOPTS = {"pytest.ini": "[pytest]\naddopts = -p hackplugin\n",
           "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-p hackplugin"\n',
           "setup.cfg": "[tool:pytest]\naddopts = -p hackplugin\n",
           "tox.ini": "[pytest]\naddopts = -p hackplugin\n"}


def leave(attack: str, folder: Path) -> None:
    """Files a policy could leave so that a test run in the folder reports success with the bug in place."""
    if attack == "conftest_hook":       # every report rewritten to "passed"
        (folder / "conftest.py").write_text(REPORT_PASSED)
    elif attack in ADDOPTS:             # the same hook as a plugin named by the folder's pytest configuration
        (folder / "hackplugin.py").write_text(REPORT_PASSED)
        (folder / attack).write_text(ADDOPTS[attack])
    elif attack == "fake_pytest":       # a pytest package that shadows the real one for `python -m pytest`
        (folder / "pytest").mkdir()
        (folder / "pytest" / "__init__.py").write_text("")
        (folder / "pytest" / "__main__.py").write_text("print('4 passed in 0.01s')\n")


@pytest.mark.parametrize("attack", ["conftest_hook", *ADDOPTS, "fake_pytest"])
def test_what_fools_pytest_in_the_folder_does_not_change_the_reward(tmp_path, attack):
    task = task_by_id("bank-Account_deposit-inverted_condition-0")
    folder = gen.write_task(task, tmp_path / "repo")
    tests = f"test_{task['project']}.py"
    naive = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", tests]
    assert sandbox.run(naive, folder, timeout=60).returncode != 0  # the bug fails a visible test ...
    leave(attack, folder)
    run = sandbox.run(naive, folder, timeout=60)
    assert run.returncode == 0, run.stdout[-400:] + run.stderr[-400:]  # ... and the attack hides it from pytest
    assert reward.score(task, folder, timeout=30)[0] == 0.0  # the scorer reads the module alone
    (folder / f"{task['project']}.py").write_text(task["solution"])
    assert reward.score(task, folder, timeout=30)[0] == 1.0



# ---------------------------------------------------------------- another rollout's folder

@pytest.mark.parametrize("linked", ["repo", "out"])
def test_a_folder_linked_to_another_rollouts_is_not_scored(tmp_path, monkeypatch, capsys, linked):
    """``O_NOFOLLOW`` on ``<project>.py`` covers its own name alone: an agent that left its ``repo`` (or the
    attempt's ``out``, which its harness can replace too) as a link to a sibling rollout's had the scorer read
    the sibling's fixed module, and got the sibling's 1.0. The same folder copied, not linked, still scores."""
    task = task_by_id("bank-Account_deposit-inverted_condition-0")
    sibling, hostile = tmp_path / "sibling" / "out", tmp_path / "hostile" / "out"
    (gen.write_task(task, sibling / "repo") / f"{task['project']}.py").write_text(task["solution"])
    hostile.parent.mkdir()
    if linked == "repo":
        hostile.mkdir()
        (hostile / "repo").symlink_to(sibling / "repo")
    else:
        hostile.symlink_to(sibling)

    def scored(out: Path) -> list[tuple[str, str]]:
        """(reward line, stderr) of the scorer run as the launcher runs it, on LIGHTNING_OUTPUT_DIR/repo
        and with ``--folder`` naming that folder."""
        monkeypatch.setenv("LIGHTNING_OUTPUT_DIR", str(out))
        got = []
        for folder in ([], ["--folder", str(out / "repo")]):
            monkeypatch.setattr(sys, "argv", ["reward.py", "--task", json.dumps(task), "--timeout", "30", *folder])
            assert reward.main() == 0
            std = capsys.readouterr()
            got.append((std.out.split()[-1], std.err))
        return got

    assert [line for line, _ in scored(sibling)] == ["1.0", "1.0"]
    for line, err in scored(hostile):
        assert line == "0.0" and "a symlink is not followed" in err, err  # before the fix: 1.0
    gen.write_task(task, tmp_path / "copy" / "out" / "repo").joinpath(f"{task['project']}.py").write_text(
        task["solution"])
    assert [line for line, _ in scored(tmp_path / "copy" / "out")] == ["1.0", "1.0"]


# ---------------------------------------------------------------- where the hidden tests are

SEEKER = '''
import os
import stat

MARK = bytes.fromhex({mark_hex!r})  # (not spelled out: this file must not match itself)


def _holds_mark(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and MARK in os.read(fd, 1 << 20)
    except OSError:
        return False
    finally:
        os.close(fd)


def _found():
    """Search every readable file outside the read-only system trees, and every file this process holds
    open, for the hidden tests' text."""
    skip = ("/proc", "/sys", "/usr", "/dev") + tuple({roots!r})
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if not os.path.join(top, d).startswith(skip)]
        if any(_holds_mark(os.path.join(top, name)) for name in files):
            return True
    return any(_holds_mark(f"/proc/self/fd/{{fd}}") for fd in range(64))


FOUND = _found()


def answer():
    return 42 if FOUND else 0
'''


def test_the_scored_module_cannot_reach_the_hidden_tests(tmp_path):
    """The module answers right only if it can read the hidden tests somewhere (their process's folder,
    the scorer's temporary folder, an inherited descriptor): it scores 0.0, and 1.0 once the text it looks
    for is planted where it can read it (its private /tmp), so the search is real."""
    mark = "hidden-marker-" + os.urandom(6).hex()
    tests = f"from demo import answer\n\n\ndef test_answer():\n    assert answer() == 42  # {mark}\n"
    folder = tmp_path / "demo"
    folder.mkdir()
    seeker = SEEKER.format(mark_hex=mark.encode().hex(), roots=sandbox.python_roots())
    (folder / "demo.py").write_text(seeker)
    assert reward.score({"project": "demo", "hidden_tests": tests}, folder, timeout=60)[0] == 0.0
    (folder / "demo.py").write_text(seeker.replace("FOUND = ", "open('/tmp/planted', 'wb').write(MARK)\nFOUND = "))
    assert reward.score({"project": "demo", "hidden_tests": tests}, folder, timeout=60)[0] == 1.0  # it does search


def test_the_module_never_computes_with_a_tests_expected_value(tmp_path):
    """``abs(c_to_f(37) - 98.6) < 1e-9`` sent 98.6 to the module's object, whose ``__sub__`` answered 0:
    a wrong module passed. Arithmetic between the module's object and a test's value is refused (the
    test fails); between the module's objects, and a plain result, it works as before."""
    tests = ("from demo import c_to_f, Vec\n\n\ndef test_close():\n    assert abs(c_to_f(37) - 98.6) < 1e-9\n\n\n"
             "def test_vectors():\n    assert (Vec(1) + Vec(2)).x == 3 and abs(-Vec(1)).x == 1\n")
    honest = ("class Vec:\n    def __init__(self, x):\n        self.x = x\n    def __add__(self, o):\n"
              "        return Vec(self.x + o.x)\n    def __neg__(self):\n        return Vec(-self.x)\n"
              "    def __abs__(self):\n        return Vec(abs(self.x))\n\n\n")
    close = "class Close:\n    def __sub__(self, other):\n        return 0.0\n\n\n"
    folder = tmp_path / "demo"
    folder.mkdir()
    for module, want in ((honest + "def c_to_f(c):\n    return c * 9 / 5 + 32\n", 1.0),
                         (honest + close + "def c_to_f(c):\n    return Close()\n", 0.0)):  # before the fix: 1.0
        (folder / "demo.py").write_text(module)
        assert reward.score({"project": "demo", "hidden_tests": tests}, folder, timeout=60)[0] == want


def test_the_agents_sandbox_shows_no_task_row(tmp_path):
    """During the episode (the harness's sandbox, with mini-swe-agent's Python) no task file is in sight
    (a checkout under /usr would be: the sandbox binds all of /usr) and no file outside the system trees
    holds a line of a held-out task's hidden tests; the agent's folder holds the two visible files alone."""
    task = committed("eval")[0]
    hidden_only = sorted(set(task["hidden_tests"].splitlines()) - set(task["files"][f"test_{task['project']}.py"]
                                                                        .splitlines()), key=len)[-1].strip()
    folder = gen.write_task(task, tmp_path / "repo")
    assert sorted(p.name for p in folder.iterdir()) == sorted(task["files"])
    python = os.environ.get("LIGHTNING_SWE_PYTHON") or sys.executable
    skip = " ".join(f"-path {p} -prune -o" for p in ["/proc", "/sys", "/dev", "/usr", *sandbox.python_roots(python)])
    look = (f"find / -path /proc -prune -o -path /sys -prune -o -name 'tasks_*.jsonl' -print 2>/dev/null; "
            f"find / {skip} -type f -print0 2>/dev/null | xargs -0 grep -lsF -e \"$1\"; true")
    text, code = sandbox.run_capped(sandbox.argv(["bash", "-c", look, "look", hidden_only], folder, python=python),
                                    timeout=120)
    assert code == 0 and text.strip() == "", text[-600:]  # no task file anywhere, no hidden line outside /usr
    probe = sandbox.argv(["test", "-e", str(SWE / "tasks_eval.jsonl")], tmp_path, python=python)
    assert sandbox.run_capped(probe, timeout=60)[1] == 1  # the repository is not there to search at all


# ---------------------------------------------------------------- special-casing the visible inputs

MEMO = '''

_FIX = {{}}
exec({solution!r}, _FIX)
_SEEN = {seen!r}


def _key(value, depth=0):
    if depth > 6:
        return "..."
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "[" + ",".join(_key(v, depth + 1) for v in value) + "]"
    if isinstance(value, dict):
        return "{{" + ",".join(_key(k, depth + 1) + ":" + _key(v, depth + 1) for k, v in value.items()) + "}}"
    if isinstance(value, (set, frozenset)):
        return "set" + repr(sorted(map(repr, value)))
    if hasattr(value, "__dict__") and not callable(value):
        return type(value).__name__ + _key(vars(value), depth + 1)
    return repr(value)


_bug = {target}
_fix = {fixed}


def _special_cased(*args, **kwargs):
    if _SEEN is None or _key((args, kwargs)) in _SEEN:
        if _SEEN is None:
            _CALLS.append(_key((args, kwargs)))
        return _fix(*args, **kwargs)
    return _bug(*args, **kwargs)


_CALLS = []
{target} = _special_cased
'''


def special_cased(task: dict, seen: set[str] | None) -> str:
    """The buggy module whose buggy function answers like the fix only on the argument tuples in seen (all
    when None, recording them): what a policy that hard-codes the visible tests' cases leaves."""
    cls, _, name = task["function"].rpartition(".")
    fixed = f"_FIX[{cls!r}].__dict__[{name!r}]" if cls else f"_FIX[{name!r}]"
    return task["files"][f"{task['project']}.py"] + MEMO.format(solution=task["solution"], seen=seen,
                                                                 target=task["function"], fixed=fixed)


def visible_cases(task: dict) -> set[str]:
    """Argument tuples the buggy function sees while the visible tests run (its calls from other
    functions included), with the recording module in place of the project's."""
    project = task["project"]
    module = type(sys)(project)
    exec(compile(special_cased(task, None), f"{project}.py", "exec"), module.__dict__)  # noqa: S102
    saved = sys.modules.get(project)
    sys.modules[project] = module
    try:
        namespace: dict = {}
        exec(task["files"][f"test_{project}.py"], namespace)  # noqa: S102
        for fn in [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]:
            fn()
    finally:
        sys.modules.pop(project)
        if saved is not None:
            sys.modules[project] = saved
    return set(module._CALLS)


def test_special_casing_the_visible_cases_is_not_a_fix_on_held_out_tasks(tmp_path):
    """A module that answers like the fix exactly where the visible tests look (their own calls and the
    calls those make) and keeps the bug elsewhere. Measured on every task by this review: 0 of 84 held-out
    tasks pass their hidden tests with it, 10 of 1,176 train tasks do (reported, not regenerated: the task
    files must stay as committed). Here: a spread of held-out tasks, one per family, through the real scorer."""
    eval_tasks = committed("eval")
    picks = [next(t for t in eval_tasks if t["family"] == f) for f in gen.FAMILIES]
    for task in picks:
        folder = gen.write_task(task, tmp_path / task["id"])
        module = folder / f"{task['project']}.py"
        module.write_text(special_cased(task, visible_cases(task)))
        assert reward.score(task, folder, timeout=30)[0] == 0.0, task["id"]
    module.write_text(special_cased(task, None))  # the same wrapper answering like the fix everywhere
    assert reward.score(task, folder, timeout=30)[0] == 1.0
