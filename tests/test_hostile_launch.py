"""A hostile harness (issue 10): its whole process tree ends with the rollout, and the verifier's reward
outranks whatever it says about itself.

Real processes throughout: the escaping processes are started by tests/support/harness_escape.py
(a ``setsid`` grandchild and a double-forked daemon, both ignoring SIGTERM); the reward tests run the
real ``lightning-launch`` CLI with its own proxy against the stub upstream and read the Parquet
tables through the DuckDB views.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fixtures_launch import pid_alive, wait_dead, wait_for

from lightning_harness.launcher.local import AttemptJob, LocalRunner
from lightning_harness.launcher.proctree import ProcessTree
from lightning_harness.launcher.rewards import RewardError, run_reward_cmd
from lightning_harness.trainer.views import connect

pytestmark = pytest.mark.timeout(300)
ESCAPE = Path(__file__).parent / "support" / "harness_escape.py"


@pytest.fixture(params=["cgroup", "cgroup-freeze", "scan"])
def mechanism(request, monkeypatch):
    """Each test runs with each mechanism: cgroup v2 with cgroup.kill, with freeze + SIGKILL (older
    kernels), both skipped where cgroup v2 is not usable, and the subreaper + /proc scan."""
    monkeypatch.setattr(ProcessTree, "_mechanism", None)
    if request.param == "scan":
        monkeypatch.setenv("LIGHTNING_PROCESS_TREE", "scan")
    else:
        monkeypatch.delenv("LIGHTNING_PROCESS_TREE", raising=False)
    got = ProcessTree.mechanism()
    if got != request.param.split("-")[0]:
        pytest.skip(f"cgroup v2 is not usable here (mechanism: {got})")
    if request.param == "cgroup-freeze":
        monkeypatch.setattr(ProcessTree, "_cgroup_kill", False)
    yield got
    monkeypatch.setattr(ProcessTree, "_mechanism", None)  # the next test probes again


def _job(tmp_path, task: dict, timeout=None) -> AttemptJob:
    out = tmp_path / "out"
    env = {"LIGHTNING_TASK": json.dumps(task), "LIGHTNING_OUTPUT_DIR": str(out)}
    return AttemptJob("r-t-0", 0, [sys.executable, str(ESCAPE)], env, tmp_path, tmp_path / "harness.log",
                      timeout=timeout)


def _escapees(out: Path) -> dict[str, int]:
    return {name: int((out / f"{name}.txt").read_text().split()[0]) for name in ("setsid", "daemon")}


def _assert_stopped(out: Path, pids: dict[str, int]) -> None:
    """Every escapee is dead and its file stopped growing."""
    assert wait_dead(pids.values(), timeout=5) == [], {n: pid_alive(p) for n, p in pids.items()}
    sizes = {n: (out / f"{n}.txt").stat().st_size for n in pids}
    time.sleep(0.3)  # they wrote a line every 50 ms while alive
    assert {n: (out / f"{n}.txt").stat().st_size for n in pids} == sizes


def test_setsid_and_double_forked_children_end_when_the_harness_exits(tmp_path, mechanism):
    out = LocalRunner(kill_grace=0.5).run(_job(tmp_path, {"escape": True}), threading.Event())
    assert out.exit_code == 0 and out.error is None, (tmp_path / "harness.log").read_text()
    pids = _escapees(tmp_path / "out")
    _assert_stopped(tmp_path / "out", pids)
    assert "killed 2 process(es) the harness left running" in (tmp_path / "harness.log").read_text()


def test_timeout_ends_the_whole_tree(tmp_path, mechanism):
    t0 = time.monotonic()
    out = LocalRunner(kill_grace=0.5).run(_job(tmp_path, {"escape": True, "then": "hang"}, timeout=3),
                                          threading.Event())
    assert out.timed_out and "process tree killed" in out.error
    assert time.monotonic() - t0 < 30
    _assert_stopped(tmp_path / "out", _escapees(tmp_path / "out"))


def test_cancel_ends_the_whole_tree(tmp_path, mechanism):
    cancel, result = threading.Event(), {}
    runner = LocalRunner(kill_grace=0.5)
    job = _job(tmp_path, {"escape": True, "then": "hang"})
    th = threading.Thread(target=lambda: result.update(out=runner.run(job, cancel)))
    th.start()
    log = tmp_path / "harness.log"
    wait_for(lambda: "READY" in log.read_text() if log.exists() else False, 30)
    pids = _escapees(tmp_path / "out")
    assert all(pid_alive(p) for p in pids.values())
    cancel.set()
    th.join(30)
    assert result["out"].cancelled
    _assert_stopped(tmp_path / "out", pids)


def test_processes_moved_to_other_cgroups_end_too_and_no_cgroup_is_left_behind(tmp_path, mechanism):
    """A root harness nests a cgroup in its own, and moves a process out of its tree altogether."""
    if mechanism != "cgroup":
        pytest.skip("cgroup only (the harness moves processes between cgroups)")
    out = LocalRunner(kill_grace=0.5).run(_job(tmp_path, {"escape": True, "nest": True, "jump": True}),
                                          threading.Event())
    assert out.exit_code == 0, (tmp_path / "harness.log").read_text()
    pids = _escapees(tmp_path / "out")
    for name in ("nested", "jumped"):
        pids[name] = int((tmp_path / "out" / f"{name}.txt").read_text().split()[0])
    _assert_stopped(tmp_path / "out", pids)
    assert not list(ProcessTree._root.glob(f"lightning-{os.getpid()}-*"))


def test_the_reward_commands_leftovers_end_too_and_void_its_verdict(tmp_path, mechanism):
    """Found by review: a process the scorer's tests left behind kept printing 1.0 into the stdout it
    inherited, after the scorer's 0.0, and the last line won (a verifier-rank reward). A scorer that
    exits leaving processes has no verdict now; they are ended as before."""
    pid_file = tmp_path / "pid"
    cmd = f"setsid sleep 1000 >/dev/null 2>&1 & echo $! > {pid_file}; echo 0.5"
    with pytest.raises(RewardError, match="leaving 1 process"):
        run_reward_cmd(cmd, {})
    assert wait_dead([int(pid_file.read_text())], timeout=5) == []
    hijack = "(while :; do echo 1.0; sleep 0.01; done) & sleep 0.3; echo 0.0; sleep 0.1"
    with pytest.raises(RewardError, match="not trusted"):
        run_reward_cmd(hijack, {})
    assert run_reward_cmd("(echo 0.2) & wait; echo 0.7", {}).value == 0.7  # one that waits is judged
    # found by review: processes that end just after the scorer (multiprocessing's helpers, a server
    # stopped without a wait) are no leftovers; what they write after it exited is not its output
    assert run_reward_cmd("(sleep 0.3; echo 1.0) & echo 0.4", {}).value == 0.4
    mp = f"{sys.executable} -c 'import multiprocessing.shared_memory as s; m = s.SharedMemory(create=True, size=8)'"
    assert run_reward_cmd(f"{mp}; echo 0.6", {}).value == 0.6
    with pytest.raises(RewardError, match="could not start"):
        run_reward_cmd("true", {}, cwd=str(tmp_path / "missing"))


@pytest.mark.parametrize("kind", ["fifo", "zero", "gone"])
def test_trap_files_in_the_attempt_folder_neither_hang_the_launcher_nor_lose_the_log(tmp_path, kind):
    """The harness swaps its log and reward file for a FIFO or a link to /dev/zero, or removes its
    whole attempt folder, before it exits."""
    from lightning_harness.launcher.batch import run_batch

    t0 = time.monotonic()
    (res,) = run_batch([{"id": "trap", "plant": kind}], [sys.executable, str(ESCAPE)], traces_dir=tmp_path, run_id="r",
                       timeout=60)
    assert time.monotonic() - t0 < 30
    assert res.state == "no_reward" and ("not a regular file" if kind != "gone" else "no reward reported") in res.error
    log = Path(res.log_path)
    assert log.is_file() and not log.is_symlink()
    text = log.read_text()
    assert "READY" in text and "[lightning] attempt ended: exit=0 ok" in text


def test_a_hard_linked_reward_file_is_not_read(tmp_path):
    """With --run-as the launcher reads files another user made; a hard link to a file of the
    launcher's (where fs.protected_hardlinks is off) must not be read as the reward."""
    from lightning_harness.launcher.rewards import read_reward_file

    secret = tmp_path / "secret"
    secret.write_text("0.5\n")
    os.link(secret, tmp_path / "reward.json")
    with pytest.raises(RewardError, match="hard links"):
        read_reward_file(tmp_path / "reward.json")


# -- reward precedence through the real CLI ---------------------------------------------------------
def launch(tasks, traces, stub_upstream, proxy_confdir, *args):
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", str(tasks), "--traces", str(traces),
           "--upstream", stub_upstream, "--proxy-confdir", str(proxy_confdir), "--no-progress", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})


def view(traces) -> dict[str, tuple]:
    con = connect(traces)
    return {r[0]: r[1:] for r in con.sql("SELECT task_id, state, reward, reward_source FROM rollouts").fetchall()}


def test_the_verifier_outranks_a_self_report_and_a_late_one_changes_nothing(tmp_path, write_tasks, stub_upstream,
                                                                            proxy_confdir, rows):
    # the harness claims 1.0 now, and leaves a process that claims 0.9 after it exited (and after scoring)
    tasks = write_tasks([{"id": "cheat", "claim": 1.0, "late": 0.9, "late_delay": 1.0}])
    traces = tmp_path / "traces"
    res = launch(tasks, traces, stub_upstream, proxy_confdir, "--reward-cmd", "echo 0.0", "--", sys.executable, ESCAPE)
    assert res.returncode == 0, res.stderr
    assert "process trees:" in res.stderr
    (row,) = rows(traces, "rollouts")
    assert (row["state"], row["reward"], row["reward_source"]) == ("succeeded", 0.0, "command")
    late_pid = int(Path(row["log_path"]).with_name("out").joinpath("late.txt").read_text())
    assert not pid_alive(late_pid)  # the late poster died with the harness's tree
    assert view(traces) == {"cheat": ("succeeded", 0.0, "command")}
    sources = sorted(r["source"] for r in rows(traces, "rewards"))
    assert sources == ["command", "proxy"]  # the claim is kept as data, it just does not count


def test_self_reports_after_judging_never_change_the_reward_but_the_operator_can(tmp_path, write_tasks, stub_upstream,
                                                                                 proxy_confdir, make_proxy):
    """Direct posts to a running proxy: a harness's (its reward URL) and the operator's (control API)."""
    from lightning_harness.launcher.batch import run_batch

    traces = tmp_path / "traces"
    proxy = make_proxy(traces_dir=traces)
    tasks = [{"id": "v", "claim": 1.0}, {"id": "s", "claim": 0.5}]
    with_cmd = run_batch(tasks[:1], [sys.executable, str(ESCAPE)], traces_dir=traces, proxy=proxy, run_id="cmd",
                         reward_cmd="echo 0.0")
    selfish = run_batch(tasks[1:], [sys.executable, str(ESCAPE)], traces_dir=traces, proxy=proxy, run_id="self")
    assert [(r.reward, r.reward_source) for r in with_cmd + selfish] == [(0.0, "command"), (0.5, "proxy")]
    for r in with_cmd + selfish:  # after judging, the harness's credentials post again (through the proxy)
        proxy_post_self_report(proxy, r.rollout_id, r.attempt, 0.99)
    proxy.control.flush()
    assert view(traces) == {"v": ("succeeded", 0.0, "command"), "s": ("succeeded", 0.5, "proxy")}
    # the operator's word ranks with the verifier: it re-scores a judged attempt
    proxy.control.reward(selfish[0].rollout_id, selfish[0].attempt, 0.25)
    proxy.control.flush()
    assert view(traces)["s"] == ("succeeded", 0.25, "api")


def proxy_post_self_report(proxy, rollout_id: str, attempt: int, value: float) -> None:
    """What a leftover process holding the harness's LIGHTNING_REWARD_URL would send."""
    import urllib.request

    from lightning_harness.launcher.proxy_link import ProxyLink

    url = ProxyLink.from_process(proxy).env_for(rollout_id, attempt)["LIGHTNING_REWARD_URL"]
    req = urllib.request.Request(url, data=json.dumps({"reward": value}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10).read()
    except OSError:
        pass  # a proxy that revokes a judged attempt's credential refuses it: fine, it must not count either way


def test_a_harness_cannot_use_the_control_api_to_pose_as_the_verifier(tmp_path, write_tasks, stub_upstream,
                                                                      proxy_confdir, rows):
    """The proxy the launcher starts has a control token of its own, which no harness gets."""
    tasks = write_tasks([{"id": "forger", "forge": 1.0}])
    traces = tmp_path / "traces"
    res = launch(tasks, traces, stub_upstream, proxy_confdir, "--no-self-reward", "--", sys.executable, ESCAPE)
    assert res.returncode == 0, res.stderr
    (row,) = rows(traces, "rollouts")
    assert "FORGE REFUSED" in Path(row["log_path"]).read_text()
    assert (row["state"], row["reward"]) == ("no_reward", None)
    assert view(traces) == {"forger": ("no_reward", None, None)}


def test_no_self_reward_gives_no_reward_instead_of_the_harness_claim(tmp_path, write_tasks, stub_upstream,
                                                                     proxy_confdir, rows):
    tasks = write_tasks([{"id": "claims", "claim": 1.0}, {"id": "silent"}])
    traces = tmp_path / "traces"
    res = launch(tasks, traces, stub_upstream, proxy_confdir, "--no-self-reward", "--", sys.executable, ESCAPE)
    assert res.returncode == 0, res.stderr
    got = {r["task_id"]: (r["state"], r["reward"], r["error"]) for r in rows(traces, "rollouts")}
    assert got["claims"][:2] == ("no_reward", None) and "--no-self-reward" in got["claims"][2]
    assert "own report was ignored" in got["claims"][2] and "own report" not in got["silent"][2]
    assert view(traces) == {"claims": ("no_reward", None, None), "silent": ("no_reward", None, None)}
    # the same harness with self-reports on (the default) is taken at its word
    res = launch(tasks, traces, stub_upstream, proxy_confdir, "--run-id", "trusting", "--", sys.executable, ESCAPE)
    assert res.returncode == 0, res.stderr
    trusting = {r["task_id"]: (r["state"], r["reward"]) for r in rows(traces, "rollouts") if r["run_id"] == "trusting"}
    assert trusting == {"claims": ("succeeded", 1.0), "silent": ("no_reward", None)}


def test_the_trainer_config_key_turns_self_reports_off(tmp_path):
    from lightning_harness.trainer import config as C

    p = tmp_path / "cfg.yaml"
    p.write_text("model: model\nharness: {command: [h]}\ntasks: {train: t.jsonl}\n")
    (tmp_path / "model").mkdir()
    assert C.load_config(p).harness.self_reward is True
    assert C.load_config(p, ["harness.self_reward=false"]).harness.self_reward is False
    with pytest.raises(C.ConfigError, match="harness.self_reward"):
        C.load_config(p, ["harness.self_reward=maybe"])


def test_the_view_ranks_hand_written_reports(tmp_path):
    """The view's rule on Parquet written directly (no launcher run): ranks, judged attempts, unlabelled rows."""
    from fixtures_traces import reward, rollout, write_traces

    unlabelled = {**reward("U", 0.7), "source": None}
    write_traces(
        tmp_path,
        rollouts=[rollout("J", reward=0.3, task_id="judged"),  # launcher rows end at T0+5 s
                  rollout("Q", state="no_reward", task_id="quiet")],  # e.g. --no-self-reward ignored a claim
        rewards=[reward("J", 1.0, at_s=9), reward("J", 0.9, at_s=9, source="file"),  # self-reports after judging
                 reward("J", 0.1, at_s=1, source="api"),  # the operator, before the launcher judged: weighed then
                 reward("Q", 1.0, at_s=2),
                 reward("P", 0.2, at_s=1, source="api"), reward("P", 1.0, at_s=2),  # proxy alone: rank beats time
                 reward("S", 0.4, at_s=1), reward("S", 0.6, at_s=2, source="file"),  # same rank: the latest
                 unlabelled, reward("U", 0.1, at_s=-1, source="command")],
    )
    got = {r[0]: r[1:]
           for r in connect(tmp_path).sql("SELECT rollout_id, state, reward, reward_source FROM rollouts").fetchall()}
    assert got == {"J": ("succeeded", 0.3, "file"), "Q": ("no_reward", None, None), "P": ("succeeded", 0.2, "api"),
                   "S": ("succeeded", 0.6, "file"), "U": ("succeeded", 0.1, "command")}


def test_a_killed_launchers_trees_are_ended_by_the_next_one(tmp_path):
    """A launcher killed with SIGKILL leaves ``lightning-<pid>-<n>`` cgroups with live processes; the
    next launcher ends them when it probes (what `lightning-train run --resume` relies on)."""
    from lightning_harness.launcher import proctree

    own = proctree._own_cgroup_dir()
    if ProcessTree.mechanism() != "cgroup" or own is None:
        pytest.skip("cgroup only")
    gone = subprocess.Popen(["/bin/true"])
    gone.wait()  # a pid that no longer runs: the "killed launcher"
    stale = own / f"lightning-{gone.pid}-0"
    stale.mkdir()
    sleeper = subprocess.Popen(["sleep", "300"], preexec_fn=proctree._join(str(stale / "cgroup.procs")),
                               start_new_session=True)
    try:
        assert (stale / "cgroup.procs").read_text().split() == [str(sleeper.pid)]
        ProcessTree._reap_stale(own)
        assert sleeper.wait(timeout=10) == -9
        assert not stale.exists()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


def test_an_attempt_whose_credential_could_not_be_revoked_is_not_judged(tmp_path, stub_upstream, proxy_confdir,
                                                                         make_proxy):
    """The launcher revokes an attempt's credential before judging it; when the proxy refuses that
    (twice), whatever the harness left running could still record calls or post a reward: the
    attempt ends failed, not scored. One refusal followed by success is retried and judged as usual."""
    import dataclasses

    from lightning_harness.launcher.batch import run_batch
    from lightning_harness.launcher.proxy_link import ProxyLink

    refusals = [0]

    class Refusing(ProxyLink):
        """A real link to the running proxy whose next ``refusals`` revocations go to a closed port."""

        def end_attempt(self, rollout_id, attempt):
            target = self
            if refusals[0] > 0:
                refusals[0] -= 1
                target = dataclasses.replace(self, reverse_url="http://127.0.0.1:9")
            return ProxyLink.end_attempt(target, rollout_id, attempt)

    traces = tmp_path / "traces"
    proxy = make_proxy(traces_dir=traces)
    link = Refusing(**vars(ProxyLink.from_process(proxy)))
    for n, expected in ((2, ("failed", None)), (1, ("succeeded", 0.5))):
        refusals[0] = n
        (row,) = run_batch([{"id": f"claims{n}", "claim": 0.5}], [sys.executable, str(ESCAPE)],
                           traces_dir=traces, proxy=link, run_id=f"r{n}")
        assert (row.state, row.reward) == expected, row.error  # before the fix: ("succeeded", 0.5) both times
        assert refusals == [0]
        assert ("not judged" in (row.error or "")) == (n == 2)



DEEP_LOG = """
import json, os, sys
print("READY", flush=True)
log = os.path.join(os.environ["LIGHTNING_OUTPUT_DIR"], "..", "harness.log")
os.unlink(log)
os.mkdir(log)
fd = os.open(log, os.O_RDONLY)
for _ in range(1200):
    os.mkdir("d", dir_fd=fd)
    fd, above = os.open("d", os.O_RDONLY, dir_fd=fd), fd
    os.close(above)
sys.exit(json.loads(os.environ["LIGHTNING_TASK"])["exit"])
"""


@pytest.fixture
def ending_link(tmp_path, make_proxy):
    """(proxy, a real link to it that records each attempt it ends, that record)."""
    from lightning_harness.launcher.proxy_link import ProxyLink

    ended = []

    class Recording(ProxyLink):
        def end_attempt(self, rollout_id, attempt):
            ended.append((rollout_id, attempt))
            return ProxyLink.end_attempt(self, rollout_id, attempt)

    proxy = make_proxy(traces_dir=tmp_path / "traces")
    return proxy, Recording(**vars(ProxyLink.from_process(proxy))), ended


def reward_post_status(proxy, rollout_id: str, attempt: int) -> int:
    """The proxy's answer to a self-report sent with the attempt's credential (what a leftover would send)."""
    import urllib.error
    import urllib.request

    from lightning_harness.launcher.proxy_link import ProxyLink

    url = ProxyLink.from_process(proxy).env_for(rollout_id, attempt)["LIGHTNING_REWARD_URL"]
    req = urllib.request.Request(url, data=b'{"reward": 1.0}', method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("code,state", [(0, "no_reward"), (3, "failed")])
def test_a_log_swapped_for_a_deep_directory_keeps_the_outcome_and_the_credential_ends(tmp_path, ending_link,
                                                                                     code, state):
    """The harness replaces its log by a directory 1,200 levels deep before it exits. Removing that tree
    raised RecursionError in the launcher: the attempt became a 'launcher error', its credential was never
    revoked, its log was lost and a ``.log-*`` file left. The tree is now moved aside, never walked."""
    from lightning_harness.launcher.batch import WORK_DIR, run_batch

    proxy, link, ended = ending_link
    harness = tmp_path / "deep_log.py"
    harness.write_text(DEEP_LOG)
    traces = tmp_path / "traces"
    (row,) = run_batch([{"id": "deep", "exit": code}], [sys.executable, str(harness)], traces_dir=traces,
                       proxy=link, run_id="r")
    work = traces / WORK_DIR / "r" / row.rollout_id / str(row.attempt)
    try:
        assert (row.state, row.exit_code) == (state, code), row.error  # before the fix: failed, launcher error
        assert "launcher error" not in (row.error or "")
        assert ended == [(row.rollout_id, row.attempt)]
        assert reward_post_status(proxy, row.rollout_id, row.attempt) in (401, 403)  # the credential is dead
        text = (work / "harness.log").read_text()
        assert "READY" in text and f"[lightning] attempt ended: exit={code}" in text and "moved aside" in text
        assert list(work.glob(".log-*")) == [] and len(list(work.glob("harness.log.planted-*"))) == 1
    finally:  # (rm walks it without recursion; pytest's own clean-up of old tmp folders would not)
        subprocess.run(["rm", "-rf", *map(str, work.glob("harness.log*"))], check=False)


def test_a_runner_that_raises_still_ends_the_attempts_credential(tmp_path, ending_link):
    """Any launcher error after the harness started (here: the runner raising once the harness ran) is
    recorded as such, and the attempt's credential is ended all the same: it no longer outlives the attempt."""
    from lightning_harness.launcher.batch import run_batch

    class Failing(LocalRunner):
        def run(self, job, cancel):
            super().run(job, cancel)
            raise RuntimeError("a launcher bug")

    proxy, link, ended = ending_link
    (row,) = run_batch([{"id": "bug"}], [sys.executable, str(ESCAPE)], traces_dir=tmp_path / "traces", proxy=link,
                       run_id="r", runner=Failing())
    assert row.state == "failed" and "a launcher bug" in row.error
    assert ended == [(row.rollout_id, row.attempt)]  # before the fix: [] (and the credential still valid)
    assert reward_post_status(proxy, row.rollout_id, row.attempt) in (401, 403)
