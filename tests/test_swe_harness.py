"""examples/swe: the sandbox, the sandboxed reward, the teacher solver, and real mini-swe-agent episodes
through ``lightning-launch`` and the real proxy, with the solver standing in for the model.

Needs bubblewrap and the swe environment (``scripts/setup_envs.sh swe`` builds both; the env is found
at ``$LIGHTNING_SWE_PYTHON``, default ``<repo>/.venv-swe/bin/python``); skips without them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWE = ROOT / "examples" / "swe"
sys.path.insert(0, str(SWE))
import generate  # noqa: E402
import reward  # noqa: E402
import sandbox  # noqa: E402
import solver  # noqa: E402

SWE_PY = Path(os.environ.get("LIGHTNING_SWE_PYTHON") or ROOT / ".venv-swe" / "bin" / "python")
TASKS = solver.load_tasks([str(SWE / "tasks_train.jsonl")])

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap missing (scripts/setup_envs.sh swe installs it)")]
needs_swe_env = pytest.mark.skipif(not SWE_PY.exists(),
                                   reason=f"swe environment not found at {SWE_PY} (scripts/setup_envs.sh swe)")


def task_by_family(family: str) -> dict:
    return next(t for t in TASKS if t["family"] == family)


@pytest.fixture
def listener():
    """A TCP server on a host port that records whether anything connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    hits, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                hits.append(1)
                conn.close()
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1], hits
    stop.set()
    t.join()
    srv.close()


# ---------------------------------------------------------------- the sandbox

def test_sandbox_has_no_network_no_inherited_environment_and_runs_as_nobody(tmp_path, listener, monkeypatch):
    port, hits = listener
    monkeypatch.setenv("OPENAI_API_KEY", "sk-sandbox-test-secret")
    monkeypatch.setenv("HTTPS_PROXY", "http://r~0:proxycred@127.0.0.1:1")
    probe = (f"id -u; env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; ls /proc | grep -c '^[0-9]'; "
             f"(echo x > /dev/tcp/127.0.0.1/{port}) 2>&1; echo tcp=$?; touch /usr/x 2>&1; echo usr=$?; "
             f"test -e {ROOT}/README.md; echo repo=$?; echo ok > inside.txt")
    proc = sandbox.run(["bash", "-c", probe], tmp_path, timeout=30)
    out = proc.stdout + proc.stderr
    assert out.splitlines()[0] == str(sandbox.SANDBOX_UID)
    assert "sk-sandbox-test-secret" not in out and "proxycred" not in out and "HTTPS_PROXY" not in out
    assert "tcp=1" in out and not hits  # refused inside its own network namespace: the host port never saw it
    assert "usr=1" in out and "repo=1" in out  # /usr read-only; the checkout (its .venv, keys, traces) absent
    assert (tmp_path / "inside.txt").read_text() == "ok\n"


def test_sandbox_time_and_memory_limits(tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        sandbox.run(["bash", "-c", "sleep 6131 & sleep 6131"], tmp_path, timeout=2)
    assert time.monotonic() - start < 15
    deadline, left = time.monotonic() + 10, "?"
    while left and time.monotonic() < deadline:  # bubblewrap and everything in its pid namespace end
        left = subprocess.run(["pgrep", "-x", "-f", "sleep 6131"], capture_output=True, text=True).stdout.strip()
        time.sleep(0.2)
    assert left == ""
    proc = sandbox.run([sandbox.interpreter(), "-c", "x = bytearray(3 << 30)"], tmp_path, timeout=30,
                       memory_bytes=1 << 30)
    assert proc.returncode != 0 and "MemoryError" in proc.stderr


def test_sandbox_output_is_capped_and_its_tmp_bounded(tmp_path):
    """A command that prints 200 MB costs the harness the first megabyte (read from a file, not memory),
    and its private /tmp (memory) holds TMP_BYTES at most."""
    argv = sandbox.argv(["bash", "-c", "echo start; head -c 200M /dev/zero | tr '\\0' a; echo"], tmp_path)
    text, code = sandbox.run_capped(argv, timeout=60)
    assert code is not None and text.startswith("start\naaaa")
    assert len(text.encode()) < sandbox.MAX_OUTPUT_BYTES + 200 and "more bytes of" in text
    fill = f"head -c {sandbox.TMP_BYTES + (16 << 20)} /dev/zero > /tmp/fill; echo rc=$?; df -B1 --output=size /tmp"
    proc = sandbox.run(["bash", "-c", fill], tmp_path, timeout=60)
    assert "rc=0" not in proc.stdout and int(proc.stdout.split()[-1]) == sandbox.TMP_BYTES


# ---------------------------------------------------------------- the reward

def test_reward_scores_the_fix_and_not_the_bug(tmp_path):
    task = task_by_family("wrong_operator")
    buggy = generate.write_task(task, tmp_path / "buggy")
    fixed = generate.write_task(task, tmp_path / "fixed")
    (fixed / f"{task['project']}.py").write_text(task["solution"])
    assert reward.score(task, buggy)[0] == 0.0
    assert reward.score(task, fixed) == (1.0, "hidden tests passed")


@pytest.mark.parametrize("attack", ["exit_early", "sitecustomize", "symlink", "hang", "fake_pass_line", "kill",
                                    "bad_bytes"])
def test_reward_cannot_be_changed_by_what_the_agent_leaves(tmp_path, attack):
    task = task_by_family("inverted_condition")
    folder = generate.write_task(task, tmp_path / "repo")
    module = folder / f"{task['project']}.py"
    buggy = module.read_text()
    if attack == "exit_early":    # end the scorer with status 0 before any test fails
        module.write_text("import os\nos._exit(0)\n" + buggy)
    elif attack == "sitecustomize":  # code that would patch the test runner at start-up, and a conftest
        (folder / "sitecustomize.py").write_text("import os; os._exit(0)\n")
        (folder / "conftest.py").write_text("import os; os._exit(0)\n")
        (folder / "reward.json").write_text('{"reward": 1.0}')
    elif attack == "symlink":     # the module replaced by a link to the solution somewhere else
        (tmp_path / "good.py").write_text(task["solution"])
        module.unlink()
        module.symlink_to(tmp_path / "good.py")
    elif attack == "hang":
        module.write_text("while True:\n    pass\n" + buggy)
    elif attack == "fake_pass_line":  # print what a pass looks like, then exit 0
        module.write_text("import os, sys\nprint('HIDDEN-TESTS-PASSED 0'); sys.stdout.flush(); os._exit(0)\n" + buggy)
    elif attack == "kill":        # kill everything it can see, the scorer included
        module.write_text("import os, signal\nos.kill(-1, signal.SIGKILL)\n" + buggy)
    elif attack == "bad_bytes":   # output that is not UTF-8, on both streams (it crashed the scorer)
        module.write_text("import os\nos.write(1, b'\\xef\\xff\\n'); os.write(2, b'\\xc3(\\n')\n" + buggy)
    assert reward.score(task, folder, timeout=5)[0] == 0.0


# A made-up task whose tests use what the two-process scorer must carry faithfully: a class and
# its objects, a tuple, an argument changed in place, an exception of the module's own (a ValueError).
DEMO_TESTS = """
from demo import Box, split_even, sort_in_place, take, Empty


def test_values_and_objects():
    b = Box(3)
    assert b.add(4) == 7 and b.total == 7
    assert split_even([1, 2, 3, 4]) == ([2, 4], [1, 3])
    assert Box(1) == Box(1) and Box(1) != Box(2) and len(Box(5)) == 5


def test_in_place_and_exceptions():
    xs = [3, 1, 2]
    assert sort_in_place(xs) is None
    assert xs == [1, 2, 3]
    try:
        take([])
    except ValueError:
        pass
    else:
        raise AssertionError("take([]) should raise")
    assert take([9]) == 9
"""
DEMO = """
print("noise on stdout at import")


class Empty(ValueError):
    pass


class Box:
    def __init__(self, total):
        self.total = total

    def add(self, n):
        self.total += n
        return self.total

    def __eq__(self, other):
        return isinstance(other, Box) and other.total == self.total

    def __len__(self):
        return self.total


def split_even(xs):
    return [x for x in xs if x % 2 == 0], [x for x in xs if x % 2]


def sort_in_place(xs):
    xs.sort()


def take(xs):
    if not xs:
        raise Empty("empty")
    return xs[0]
"""
EQUAL_TO_ALL = """
class Anything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    def __len__(self):
        return 5

    def __iter__(self):
        return iter([])

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self


def __getattr__(name):
    return Anything()
"""


def demo_score(tmp_path: Path, module: str, timeout: float = 30) -> float:
    folder = tmp_path / "demo"
    folder.mkdir(exist_ok=True)
    (folder / "demo.py").write_text(module)
    return reward.score({"project": "demo", "hidden_tests": DEMO_TESTS}, folder, timeout=timeout)


def test_the_two_process_scorer_carries_objects_tuples_in_place_changes_and_exceptions(tmp_path):
    assert demo_score(tmp_path, DEMO) == (1.0, "hidden tests passed")
    assert demo_score(tmp_path, DEMO.replace("xs.sort()", "xs = sorted(xs)"))[0] == 0.0  # not in place
    assert demo_score(tmp_path, DEMO.replace("class Empty(ValueError)", "class Empty(KeyError)"))[0] == 0.0


def test_a_long_integer_crosses_whole(tmp_path):
    """An exact answer past Python's default 4,300-digit str limit is compared, not refused."""
    tests = "import math\nfrom demo import fact\n\n\ndef test_big():\n    assert fact(3000) == math.factorial(3000)\n"
    folder = tmp_path / "demo"
    folder.mkdir()
    for module, want in (("import math\nfact = math.factorial\n", 1.0), ("def fact(n):\n    return 10 ** 9131\n", 0.0)):
        (folder / "demo.py").write_text(module)
        assert reward.score({"project": "demo", "hidden_tests": tests}, folder)[0] == want


ADD_TESTS = "from demo import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n    assert add(0, 0) == 0\n"


@pytest.mark.parametrize("attack", ["equal_to_everything", "read_the_runner", "forge_answers"])
def test_a_module_cannot_decide_its_own_verdict(tmp_path, attack):
    """What a module running in the tests' own process could do (each passed the one-process scorer
    this replaced): compare equal to every expected value; read the runner's state (its nonce, in
    ``__main__``) and print the pass line it looks for, then exit 0; or write answers down every
    pipe it holds before any question."""
    if attack == "equal_to_everything":
        module = EQUAL_TO_ALL
    elif attack == "read_the_runner":
        module = ("import os, sys, __main__\n"
                  "print('\\nHIDDEN-TESTS-PASSED ' + getattr(__main__, 'nonce', '?'), flush=True)\n"
                  "os._exit(0)\n")
    else:
        module = ("import os\n"
                  "for fd in range(1, 10):\n"
                  "    try:\n"
                  "        os.write(fd, b'{\"v\": 5}\\n' * 64)\n"
                  "    except OSError:\n"
                  "        pass\n" + EQUAL_TO_ALL)
    folder = tmp_path / "demo"
    folder.mkdir()
    (folder / "demo.py").write_text(module)
    assert reward.score({"project": "demo", "hidden_tests": ADD_TESTS}, folder, timeout=10)[0] == 0.0
    (folder / "demo.py").write_text("def add(a, b):\n    return a + b\n")
    assert reward.score({"project": "demo", "hidden_tests": ADD_TESTS}, folder, timeout=10)[0] == 1.0


def test_a_task_file_cannot_write_or_read_outside_its_folder(tmp_path):
    """Task rows may come from anywhere: names that leave the folder are refused, nothing is written."""
    task = TASKS[0]
    for name in ("../escaped.py", str(tmp_path / "escaped.py"), "sub/escaped.py", ".."):
        with pytest.raises(ValueError, match="not a plain file name"):
            generate.write_task({**task, "files": {name: "x = 1\n"}}, tmp_path / "repo" / "inner")
    assert not list(tmp_path.rglob("escaped.py"))
    with pytest.raises(reward.ScoreError, match="not a module name"):
        reward.score({**task, "project": "../../etc/passwd"}, tmp_path)


# ---------------------------------------------------------------- the teacher

def _edit_both_ways(i: int, task: dict, root: Path) -> int:
    """Edits one task's module to its solution and to a wrong version, both edit forms; returns how
    many edits were unaddressed."""
    mod, unaddressed = solver.module_name(task), 0
    # the first wrong edit the visible tests catch (each check is a subprocess: stop at the first)
    wrong = next((w for w in solver.wrong_edits(task, task["files"][mod]) if solver.fails_visible_tests(task, w)), None)
    for j, target in enumerate([task["solution"], *([wrong] if wrong is not None else [])]):
        for addressed in (True, False):
            d = root / f"{i}-{j}-{addressed}"
            d.mkdir()
            (d / mod).write_text(task["files"][mod])
            cmd = solver.edit_command(mod, task["files"][mod], target, addressed)
            assert not (addressed and cmd.startswith("sed -i 's/")), cmd  # the default keeps the line number
            unaddressed += cmd.startswith("sed -i 's/")
            subprocess.run(["bash", "-c", cmd], cwd=d, check=True)
            assert (d / mod).read_text() == target, cmd
        # a wrong edit that hangs the hidden tests scores 0 at the timeout: 10 s, not the scorer's 60
        assert target == task["solution"] or reward.score(task, d, timeout=10)[0] == 0.0
    return unaddressed


def test_solver_edits_turn_every_buggy_module_into_its_solution_and_wrong_edits_do_not(tmp_path):
    """Both edit forms (line-addressed, and unaddressed where the span is on one line only) give the
    target module exactly. Tasks run in threads: each is subprocesses (bash, the visible tests, the
    sandboxed scorer), so the suite's time is not one core's."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        unaddressed = sum(pool.map(_edit_both_ways, *zip(*enumerate(TASKS[::7])), [tmp_path] * len(TASKS[::7])))
    assert unaddressed > 0


# ---------------------------------------------------------------- real mini-swe-agent through the launcher

@pytest.fixture
def solver_upstream():
    """``start(noise=0.0, script=None) -> url``: the teacher served on a free port for the test."""
    servers = []

    def start(noise: float = 0.0, script: list[str] | None = None, seed: int = 0) -> str:
        policy = solver.Policy(TASKS, solver.Noise.scaled(noise), seed=seed, script=script)
        srv = solver.SolverServer(("127.0.0.1", 0), policy)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


SERVICE = f"{SWE_PY} {SWE / 'harness.py'} --serve"  # mini-swe-agent imported once (harness.py's docstring)
HARNESS_MODES = pytest.mark.parametrize("via", ["process", "service"])


def launch(tasks: list[dict], tmp_path: Path, upstream: str, proxy_confdir: Path, *extra: str):
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    traces = tmp_path / "traces"
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", str(task_file), "--traces", str(traces),
           "--upstream", upstream, "--served-name", "swe-tiny", "--proxy-confdir", str(proxy_confdir),
           "--no-progress", "--timeout", "240", "-j", "2", *extra,
           "--reward-cmd", f"{sys.executable} {SWE / 'reward.py'}", "--", str(SWE_PY), str(SWE / "harness.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env={**os.environ, "COLUMNS": "200"})
    return res, traces


def spans_per_rollout(traces: Path) -> dict:
    import duckdb
    q = f"select rollout_id, count(*) from read_parquet('{traces}/spans/**/*.parquet') group by 1"
    return dict(duckdb.sql(q).fetchall())


@needs_swe_env
@HARNESS_MODES
def test_episodes_through_the_launcher_and_proxy_are_attributed_and_rewarded(tmp_path, solver_upstream, proxy_confdir,
                                                                             rows, via):
    tasks = [task_by_family("wrong_operator"), task_by_family("missing_return")]
    extra = ("--service", SERVICE) if via == "service" else ()
    res, traces = launch(tasks, tmp_path, solver_upstream(noise=0.0), proxy_confdir, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    if via == "service":
        assert "harness service ready" in res.stdout + res.stderr
        assert "mini-swe-agent ready" in (traces / "launch" / "harness-service.log").read_text()
    got = {r["task_id"]: (r["state"], r["reward"], r["reward_source"]) for r in rows(traces, "rollouts")}
    assert got == {t["id"]: ("succeeded", 1.0, "command") for t in tasks}
    calls = spans_per_rollout(traces)
    assert len(calls) == 2 and all(3 <= n <= 8 for n in calls.values()), calls
    for r in rows(traces, "rollouts"):
        trajectory = json.loads((Path(r["log_path"]).parent / "out" / "trajectory.json").read_text())
        assert trajectory["info"]["exit_status"] == "Submitted"
        assert trajectory["info"]["model_stats"]["api_calls"] == calls[r["rollout_id"]]
        saved_kwargs = trajectory["info"]["config"]["model"]["model_kwargs"]
        assert "api_key" not in saved_kwargs and "api_base" not in saved_kwargs  # (service mode passed both)


SCAN_CODE = """import socket
found = []
for p in range(1, 65536):
    with socket.socket() as s:
        if s.connect_ex(('127.0.0.1', p)) == 0 and s.getsockname() != s.getpeername():
            found.append(p)  # (not a TCP self-connect, which a port in the ephemeral range can make)
with socket.socket() as s:
    print('open', found, 'internet', s.connect_ex(('8.8.8.8', 53)))
"""
SCAN = f"python - <<'EOF'\n{SCAN_CODE}EOF"
HOSTILE = [
    # variable NAMES only: values such as PATH may hold a checkout's path ("lightning-harness/envs/...")
    "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' "
    "| grep -ciE '^[a-z_]*(proxy|openai|lightning|ssl_cert)[a-z_]*='; echo environ-done",
    SCAN,  # every TCP port of 127.0.0.1 (the proxy's listeners, the upstream, the test's listener) and the internet
    "echo '{\"reward\": 1.0}' > reward.json; echo 1.0 > ../reward.json; "
    "echo 'import os; os._exit(0)' > sitecustomize.py",
    "printf 'def test_x():\\n    pass\\n' > test_hidden.py; kill -9 -1; echo survived",
]


@needs_swe_env
@HARNESS_MODES
def test_model_written_commands_cannot_reach_the_proxy_read_credentials_or_change_the_reward(
        tmp_path, solver_upstream, proxy_confdir, rows, listener, via):
    _, hits = listener
    task = task_by_family("inverted_condition")
    extra = ("--service", SERVICE) if via == "service" else ()
    res, traces = launch([task], tmp_path, solver_upstream(script=HOSTILE), proxy_confdir,
                         "--api-key", "sk-hostile-test-secret", *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = rows(traces, "rollouts")
    assert (row["state"], row["reward"], row["reward_source"]) == ("succeeded", 0.0, "command")
    trajectory = json.loads((Path(row["log_path"]).parent / "out" / "trajectory.json").read_text())
    outputs = [str(m.get("content")) for m in trajectory["messages"] if m["role"] == "tool"]
    text = "\n".join(outputs)
    assert "environ-done" in outputs[0] and "\n0\nenviron-done" in outputs[0]  # no such variable in any process
    assert "sk-hostile-test-secret" not in text
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "OPENAI_BASE_URL", "OPENAI_API_KEY", "LIGHTNING_", "SSL_CERT_FILE"):
        assert name not in text, name
    assert "open [] internet 101" in outputs[1] and not hits  # 101 = ENETUNREACH
    # `kill -9 -1` reached only its own sandbox's processes: the agent went on to submit, every call recorded
    assert trajectory["info"]["exit_status"] == "Submitted"
    assert spans_per_rollout(traces) == {row["rollout_id"]: len(HOSTILE) + 1}


@needs_swe_env
def test_a_rollout_whose_process_is_killed_is_cancelled_in_the_service_which_serves_on(tmp_path, solver_upstream):
    from lightning_harness.launcher.service import HarnessService

    task = task_by_family("wrong_operator")
    service = HarnessService([str(SWE_PY), str(SWE / "harness.py"), "--serve"], cwd=SWE,
                             log_path=tmp_path / "service.log").start()
    try:
        def client(name: str, upstream: str) -> subprocess.Popen:
            env = {**os.environ, **service.env, "OPENAI_BASE_URL": upstream + "/v1", "OPENAI_API_KEY": "x",
                   "LIGHTNING_OUTPUT_DIR": str(tmp_path / name), "LIGHTNING_TASK": json.dumps(task)}
            return subprocess.Popen([str(SWE_PY), str(SWE / "harness.py")], env=env, stdout=subprocess.PIPE, text=True)

        slow = client("killed", solver_upstream(script=["sleep 4", "echo after-the-kill > left.txt"]))
        time.sleep(2.5)  # its first command is running in the sandbox
        slow.kill()
        slow.wait()
        trajectory = tmp_path / "killed" / "trajectory.json"
        deadline = time.monotonic() + 60
        saved = lambda: trajectory.read_text() if trajectory.exists() else ""  # noqa: E731
        while time.monotonic() < deadline and '"Cancelled"' not in saved():
            time.sleep(0.5)
        info = json.loads(trajectory.read_text())["info"]
        assert info["exit_status"] == "Cancelled"  # it ended before its next command
        assert not (tmp_path / "killed" / "repo" / "left.txt").exists()

        ok = client("next", solver_upstream(noise=0.0))  # the service goes on serving
        out, _ = ok.communicate(timeout=120)
        assert ok.returncode == 0 and json.loads(out)["exit_status"] == "Submitted", out
        assert reward.score(task, tmp_path / "next" / "repo")[0] == 1.0
    finally:
        service.stop()
    assert not Path(service.socket_path).parent.exists()


BAD_REQUESTS = {  # request line -> what the answer's error says
    b"not json\n": "not JSON", b"\xff\xfe{\n": "not JSON", b"[" * 100_000 + b"\n": "not JSON",
    b"[1, 2]\n": "not a JSON object", b"{}\n": "'task' missing",
    b'{"task": {"prompt": "x"}, "workdir": "/tmp/x", "output_path": "o", "config": "c", "model": "m"}\n':
        "'base_url' missing",  # never litellm's default host, from a process without proxy variables
    b'{"task": {"prompt": "x"}, "workdir": "rel", "output_path": "o", "config": "c", "model": "m", '
    b'"base_url": "http://h/v1"}\n': "absolute",
    b'{"task": {"prompt": "x"}, "workdir": "/tmp/x", "output_path": "o", "config": "c", "model": "m", '
    b'"base_url": "http://h/v1", "temperature": "hot"}\n': "'temperature' has the wrong type",
    b"x" * ((1 << 22) + 10): "longer than",
}


@needs_swe_env
def test_the_service_answers_bad_requests_with_their_reason_and_serves_on(tmp_path, solver_upstream):
    from lightning_harness.launcher.service import HarnessService

    service = HarnessService([str(SWE_PY), str(SWE / "harness.py"), "--serve"], cwd=SWE,
                             log_path=tmp_path / "service.log").start()
    try:
        for line, reason in BAD_REQUESTS.items():
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(service.socket_path)
                try:
                    s.sendall(line)
                except OSError:  # a refused over-long line may be cut off while it is sent
                    pass
                answer = json.loads(s.makefile("rb").readline())
            assert answer["error"].startswith("bad request:") and reason in answer["error"], (line[:80], answer)
        task = task_by_family("missing_return")
        bare = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
        no_url = subprocess.run([str(SWE_PY), str(SWE / "harness.py")], capture_output=True, text=True, timeout=60,
                                env={**bare, **service.env, "LIGHTNING_OUTPUT_DIR": str(tmp_path / "no-url"),
                                     "LIGHTNING_TASK": json.dumps(task)})
        assert no_url.returncode == 1 and "OPENAI_BASE_URL is not set" in no_url.stderr, no_url.stderr
        env = {**os.environ, **service.env, "OPENAI_BASE_URL": solver_upstream(noise=0.0) + "/v1",
               "OPENAI_API_KEY": "x", "LIGHTNING_OUTPUT_DIR": str(tmp_path / "ok"), "LIGHTNING_TASK": json.dumps(task)}
        ok = subprocess.run([str(SWE_PY), str(SWE / "harness.py")], env=env, capture_output=True, text=True,
                            timeout=120)
        assert ok.returncode == 0 and json.loads(ok.stdout)["exit_status"] == "Submitted", ok.stderr[-2000:]
        assert reward.score(task, tmp_path / "ok" / "repo")[0] == 1.0
        assert service.process.poll() is None
    finally:
        service.stop()
    assert "Traceback" not in (tmp_path / "service.log").read_text()


@needs_swe_env
def test_collect_writes_each_call_with_the_request_mini_swe_agent_sent(tmp_path):
    out = tmp_path / "traj.jsonl"
    res = subprocess.run([str(SWE_PY), str(SWE / "collect.py"), "--episodes", "3", "--noise", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    episodes = {}
    for d in lines:
        episodes.setdefault(d["episode"], []).append(d)
    assert sorted(episodes) == [0, 1, 2]
    for calls in episodes.values():
        assert [d["call_index"] for d in calls] == list(range(len(calls))) == list(range(calls[0]["n_calls"]))
        assert calls[0]["reward"] == 1.0 and calls[-1]["reply"]["tool_calls"][0]["function"]["arguments"] == \
            json.dumps({"command": solver.SUBMIT})
        for j, d in enumerate(calls):
            req = d["request"]
            assert [t["function"]["name"] for t in req["tools"]] == ["bash"] and "tool_choice" not in req
            assert req["messages"][0]["role"] == "system" and len(req["messages"]) == 2 + 2 * j
            if j:  # the previous reply comes back verbatim, followed by its tool result
                prev = calls[j - 1]["reply"]["tool_calls"][0]
                assert req["messages"][-2]["tool_calls"][0]["function"] == prev["function"]
                assert req["messages"][-1] == {"content": req["messages"][-1]["content"],
                                               "tool_call_id": prev["id"], "role": "tool"}


def test_the_sandbox_check_refuses_a_checkout_every_sandbox_can_read(tmp_path):
    """Every sandbox binds /usr and the Python installation read-only; a checkout placed there
    (``/usr/src/app`` in many images) let the agent cat tasks_*.jsonl, every solution and hidden test."""
    inside = Path(sandbox.python_roots()[0]) / "lib"
    with pytest.raises(sandbox.SandboxUnavailable, match="could read its task files"):
        sandbox.check(secrets=(inside,))
    sandbox.check(secrets=(tmp_path,))  # elsewhere: fine
    sandbox.check()  # this checkout
