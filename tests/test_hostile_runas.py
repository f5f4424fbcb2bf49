"""``--run-as USER`` (issue 10): a harness holds only its own rollout's rights.

Real processes: the launcher CLI with its own capture proxy against the stub upstream, and a hostile
harness (tests/support/harness_runas.py) running as ``nobody`` under the system interpreter, which
tries to read the proxy's environment and control-token file, write into the traces, signal the
proxy, and read a sibling attempt's folder, and reports what it got in a JSON file read here.

Skipped unless the tests run as root with a usable ``nobody`` and a system python it may run (a
venv under /root is not readable by other users: docs/LAUNCH.md). Everything the harness must reach
lives in a world-traversable temporary folder (pytest's own tmp folder is root's, 0700).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from fixtures_launch import wait_dead

from lightning_harness.launcher.local import AttemptJob, LocalRunner
from lightning_harness.launcher.proctree import ProcessTree
from lightning_harness.launcher.runas import RunAs, RunAsError
from lightning_harness.trainer.views import connect

pytestmark = pytest.mark.timeout(300)
SUPPORT = Path(__file__).parent / "support"
PYTHON = "/usr/bin/python3"  # the system interpreter: readable by every user


def _nobody_usable() -> str | None:
    """Why the tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (only root can run harnesses as another user)"
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return "no user 'nobody'"
    try:
        subprocess.run([PYTHON, "-c", "pass"], user="nobody", group=pwd.getpwnam("nobody").pw_gid, extra_groups=[],
                       check=True, timeout=30, cwd="/")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"'nobody' cannot run {PYTHON}: {exc}"
    return None


pytestmark = [pytestmark, pytest.mark.skipif(bool(_nobody_usable()), reason=str(_nobody_usable()))]


@pytest.fixture
def open_dir():
    """A temporary folder other users may traverse (0711) holding world-readable copies of the harnesses."""
    base = Path(tempfile.mkdtemp(prefix="lh-runas-"))
    os.chmod(base, 0o711)
    for name in ("harness_runas.py", "harness_escape.py"):
        shutil.copy(SUPPORT / name, base / name)
        os.chmod(base / name, 0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _mode(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_uid, stat.S_IMODE(st.st_mode)


def test_refusals(monkeypatch):
    with pytest.raises(RunAsError, match="refusing to run harnesses as root"):
        RunAs.resolve("root")
    with pytest.raises(RunAsError, match="refusing"):
        RunAs.resolve("nobody:0")
    with pytest.raises(RunAsError, match="no such user"):
        RunAs.resolve("no-such-user-lh")
    with pytest.raises(RunAsError, match="no such group"):
        RunAs.resolve("nobody:no-such-group-lh")
    who = RunAs.resolve("65534")
    assert (who.user, who.uid) == ("nobody", 65534)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a non-root launcher may not switch users
    with pytest.raises(RunAsError, match="only root"):
        RunAs.resolve("nobody")


@pytest.mark.parametrize("tree", ["cgroup", "scan"])
def test_the_harness_runs_as_the_user_inside_its_tree(open_dir, tree, monkeypatch):
    """The child joins its cgroup before dropping root (the order preexec_fn keeps); its escapees,
    now another user's, still end with the attempt; its folder is the launcher's afterwards."""
    monkeypatch.setattr(ProcessTree, "_mechanism", None)
    monkeypatch.setenv("LIGHTNING_PROCESS_TREE",
                       tree) if tree == "scan" else monkeypatch.delenv("LIGHTNING_PROCESS_TREE", raising=False)
    if ProcessTree.mechanism() != tree:
        pytest.skip(f"cgroup v2 is not usable here ({ProcessTree.mechanism()})")
    work = open_dir / "attempt"
    (work / "out").mkdir(parents=True)
    env = {"LIGHTNING_TASK": json.dumps({"escape": True}), "LIGHTNING_OUTPUT_DIR": str(work / "out")}
    probe = ("import os; print('ID', os.getuid(), os.getgid(), os.getgroups(), os.getcwd(), "
             "open('/proc/self/cgroup').read().split())")
    cmd = f"{PYTHON} -c \"{probe}\" && exec {PYTHON} {open_dir / 'harness_escape.py'}"
    out = LocalRunner(kill_grace=0.5, run_as="nobody").run(AttemptJob("r-t-0", 0, cmd, env, work, work / "harness.log"),
                                                           threading.Event())
    log = (work / "harness.log").read_text()
    assert out.exit_code == 0, log
    ident = next(ln for ln in log.splitlines() if ln.startswith("ID "))
    assert ident.startswith(f"ID 65534 {pwd.getpwnam('nobody').pw_gid} [] {work} ")
    if tree == "cgroup":
        assert "lightning-" in ident  # it joined the tree's cgroup, then dropped root
    pids = [int((work / "out" / f"{n}.txt").read_text().split()[0]) for n in ("setsid", "daemon")]
    assert wait_dead(pids, timeout=5) == []
    assert "killed 2 process(es)" in log
    assert _mode(work) == (0, 0o700)
    monkeypatch.setattr(ProcessTree, "_mechanism", None)


def launch(traces: Path, tasks: Path, stub: str, confdir: Path, *args):
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", str(tasks), "--traces", str(traces),
           "--upstream", stub, "--proxy-confdir", str(confdir), "--no-progress", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})


def test_the_cli_refuses_root_and_unknown_users(open_dir, stub_upstream):
    (open_dir / "t.jsonl").write_text('{"id": "a"}\n')
    for who, why in (("root", "refusing to run harnesses as root"), ("no-such-user-lh", "no such user")):
        res = launch(open_dir / "traces", open_dir / "t.jsonl", stub_upstream, open_dir / "conf", "--run-as", who, "--",
                     PYTHON, "-c", "pass")
        assert res.returncode == 2 and why in res.stderr, res.stderr
    assert not (open_dir / "traces").exists()  # refused before anything started


def test_a_hostile_harness_as_nobody_reaches_only_its_own_rollout(open_dir, stub_upstream, rows):
    confdir, traces = open_dir / "conf", open_dir / "traces"
    confdir.mkdir(mode=0o755)
    token_file = confdir / "control-token-1"  # as `lightning-proxy serve` writes it: 0600
    os.close(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600))
    tasks = open_dir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in (
        {"id": "first", "confdir": str(confdir), "reward": 0.5},
        {"id": "second", "confdir": str(confdir), "reward": 0.25, "sibling": "ra-first-0"},
    )))
    res = launch(traces, tasks, stub_upstream, confdir, "--run-as", "nobody", "--run-id", "ra", "-j", "1",
                 "--api-key", "sk-test", "--reward-cmd", 'cat "$LIGHTNING_REWARD_FILE"', "--", PYTHON,
                 open_dir / "harness_runas.py")
    assert res.returncode == 0, res.stderr
    assert "harnesses run as nobody" in res.stderr
    assert "--api-key on the command line is readable by every user" in res.stderr
    got = {r["task_id"]: r for r in rows(traces, "rollouts")}
    # the verifier (root) read each harness's reward file from the folder taken back after the run
    assert {t: (r["state"], r["reward"], r["reward_source"]) for t, r in got.items()} == {
        "first": ("succeeded", 0.5, "command"), "second": ("succeeded", 0.25, "command")}
    calls = {(s["rollout_id"], s["attempt"]) for s in rows(traces, "spans")}
    assert calls == {("ra-first-0", 0), ("ra-second-0", 0)}  # both calls went through the proxy
    reports = {t: json.loads(Path(r["log_path"]).with_name("out").joinpath("probe.json").read_text()) for t,
               r in got.items()}
    for report in reports.values():
        assert (report["uid"], report["groups"], report["model_call"]) == (65534, [], 200), report
        assert report["proxy_pid"], report
        denied = {k: report[k] for k in ("proxy_environ", "launcher_environ", "ca_key", "traces_create", "spans_create",
                                         "rewards_create", "traces_list", "proxy_log")}
        assert set(denied.values()) == {"EACCES"}, report
        assert report["control_token_file"] == {str(token_file): "EACCES"}, report
        assert (report["kill_proxy"], report["kill_launcher"]) == ("EPERM", "EPERM"), report
        assert (report["own_task_file"], report["own_out_write"]) == ("ok", "ok"), report
    sibling = {k: v for k, v in reports["second"].items() if k.startswith("sibling_")}
    assert sibling == {"sibling_list": "EACCES", "sibling_task_file": "EACCES", "sibling_log": "EACCES"}
    assert _mode(traces) == (0, 0o711) and _mode(traces / "spans") == (0, 0o700)
    assert {_mode(Path(r["log_path"]).parent) for r in got.values()} == {(0, 0o700)}
    assert [p.parent.name for p in traces.rglob("forged-*")] == ["out", "out"]  # only in their own folders
    con = connect(traces)
    assert con.sql("SELECT count(*) FROM samples").fetchall() == [(0,)]  # made empty by lock_traces: reads as empty
    assert sorted(con.sql("SELECT task_id, state, reward_source FROM rollouts").fetchall()) == [
        ("first", "succeeded", "command"), ("second", "succeeded", "command")]


def test_the_trainer_config_key_and_the_python_api(tmp_path):
    from lightning_harness.launcher.batch import BatchRunner
    from lightning_harness.trainer import config as C

    p = tmp_path / "cfg.yaml"
    p.write_text("model: model\nharness: {command: [h]}\ntasks: {train: t.jsonl}\n")
    (tmp_path / "model").mkdir()
    assert C.load_config(p).harness.run_as is None
    assert C.load_config(p, ["harness.run_as=nobody"]).harness.run_as == "nobody"
    with pytest.raises(RunAsError, match="root"):
        BatchRunner(["h"], traces_dir=tmp_path / "t", run_id="r", run_as="root")
    with pytest.raises(ValueError, match="local runner"):
        BatchRunner(["h"], traces_dir=tmp_path / "t", run_id="r", run_as="nobody", runner=LocalRunner())



def test_attempts_running_at_once_run_as_different_users_of_the_pool(open_dir, stub_upstream, rows):
    """Two users, two harnesses at once: each finds the other running and cannot read its environment
    (its credential), signal it or list its folder."""
    try:
        RunAs.resolve("daemon")
        subprocess.run([PYTHON, "-c", "pass"], user="daemon", check=True, timeout=30, cwd="/")
    except (RunAsError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no second usable user 'daemon': {exc}")
    confdir, traces = open_dir / "conf", open_dir / "traces"
    tasks = open_dir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": me, "confdir": str(confdir), "peer": f"pp-{peer}-0"}) + "\n"
                             for me, peer in (("a", "b"), ("b", "a"))))
    res = launch(traces, tasks, stub_upstream, confdir, "--run-as", "nobody", "--run-as", "daemon", "--run-id", "pp",
                 "-j", "2", "--", PYTHON, open_dir / "harness_runas.py")
    assert res.returncode == 0, res.stderr
    got = {r["task_id"]: r for r in rows(traces, "rollouts")}
    assert {t: r["state"] for t, r in got.items()} == {"a": "succeeded", "b": "succeeded"}
    reports = [json.loads(Path(r["log_path"]).with_name("out").joinpath("probe.json").read_text())
               for r in got.values()]
    assert sorted(r["uid"] for r in reports) == sorted([65534, pwd.getpwnam("daemon").pw_uid])
    for report in reports:
        assert report["peer_pid"], report
        assert (report["peer_environ"], report["peer_signal"], report["peer_list"]) == ("EACCES", "EPERM",
                                                                                        "EACCES"), report


def test_one_user_runs_one_attempt_at_a_time(open_dir):
    """The pool: with one user, a second attempt waits until the first one's tree is gone."""
    runner = LocalRunner(run_as="nobody")
    spans = []

    def one(name: str) -> None:
        work = open_dir / name
        work.mkdir()
        t0 = time.monotonic()
        runner.run(AttemptJob(name, 0, [PYTHON, "-c", "import time; time.sleep(1)"], {}, work, work / "harness.log"),
                   threading.Event())
        spans.append((t0, time.monotonic()))

    threads = [threading.Thread(target=one, args=(n,)) for n in ("x", "y")]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    (s1, e1), (s2, e2) = sorted(spans, key=lambda s: s[1])
    assert e2 - min(s1, s2) >= 2.0  # one after the other, not side by side
    cancel = threading.Event()
    cancel.set()
    assert runner.users.take(cancel) is None  # cancelled: no attempt starts
    assert runner.users.take(threading.Event()) is not None  # and the user was given back after each run


def test_an_interpreter_the_user_cannot_read_fails_with_a_hint(open_dir):
    """A harness environment inside root's 0700 folder is the usual mistake: the attempt fails and says why."""
    private = Path(tempfile.mkdtemp(prefix="lh-private-"))  # 0700, like /root
    try:
        exe = private / "python"
        exe.symlink_to(PYTHON)
        work = open_dir / "w"
        work.mkdir()
        out = LocalRunner(run_as="nobody").run(AttemptJob("r", 0, [str(exe), "-c", "pass"], {}, work,
                                                          work / "harness.log"), threading.Event())
        assert out.error and "Permission denied" in out.error and "--run-as nobody" in out.error
        assert "must be able to read the interpreter" in (work / "harness.log").read_text()
    finally:
        shutil.rmtree(private)
