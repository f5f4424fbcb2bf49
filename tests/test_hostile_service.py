"""The swe harness service (``examples/swe/harness.py --serve``, started by ``launcher/service.py``)
under hostile conditions: what a per-process harness gives for free (one rollout's work ends with its
process, nothing is shared) must hold when one process runs every rollout's episode.

Each test runs the real service process and real per-rollout ``harness.py`` clients over its Unix
socket; the model is a stub upstream that answers per credential (the first path segment of the base
URL stands in for the attempt's proxy credential) and records every call it gets.

Needs bubblewrap and the swe environment; skips without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from fixtures_proxy import read_spans

from lightning_harness.launcher.service import SERVICE_VAR, HarnessService
from lightning_harness.process import StartupError

ROOT = Path(__file__).resolve().parents[1]
SWE = ROOT / "examples" / "swe"
SWE_PY = Path(os.environ.get("LIGHTNING_SWE_PYTHON") or ROOT / ".venv-swe" / "bin" / "python")
TASK = json.loads((SWE / "tasks_train.jsonl").read_text().splitlines()[0])

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing"),
              pytest.mark.skipif(not SWE_PY.exists(), reason=f"swe environment not found at {SWE_PY}")]

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


# -- the model: a stub upstream, one plan of answers per credential -------------------------------------
class Upstream(ThreadingHTTPServer):
    """``plans[cred]``: the answers, in order, to the calls made with base URL ``/<cred>/v1``, or through the
    proxy with ``PLAN-<name>`` in the task text (``plans["PLAN-<name>"]``), then submit.
    An answer is ``{"command": ...}``, ``{"commands": [...]}`` (tool calls in one reply), ``{"text": ...}`` (no
    tool call: a format error) or ``{"status": N, "message": ...}``, each with an optional ``delay`` in seconds.
    ``calls``: (cred, monotonic time, Authorization) of every call."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.plans: dict[str, list[dict]] = {}
        self.calls: list[tuple[str, float, str]] = []
        self.lock = threading.Lock()

    def url(self, cred: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{cred}/v1"

    def times(self, cred: str) -> list[float]:
        with self.lock:
            return [t for c, t, _ in self.calls if c == cred]


class _Handler(BaseHTTPRequestHandler):
    server: Upstream

    def log_message(self, fmt, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        cred = self.path.strip("/").split("/")[0]
        if cred == "v1":  # through the proxy, which strips its credential: the plan named in the task text
            cred = next(iter(re.findall(r"PLAN-\w+", json.dumps(body.get("messages")))), cred)
        with self.server.lock:
            n = sum(1 for c, _, _ in self.server.calls if c == cred)
            self.server.calls.append((cred, time.monotonic(), self.headers.get("Authorization", "")))
        plan = self.server.plans.get(cred, [])
        answer = plan[n] if n < len(plan) else {"command": SUBMIT}
        time.sleep(answer.get("delay", 0))
        if "status" in answer:
            return self._send(answer["status"], {"error": {"message": answer.get("message", "upstream trouble"),
                                                           "type": "server_error"}})
        message = {"role": "assistant", "content": answer.get("text")}
        commands = answer["commands"] if "commands" in answer else [answer["command"]] if "command" in answer else []
        if commands:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": {
                "name": "bash", "arguments": json.dumps({"command": command})}} for command in commands]
        self._send(200, {"id": "chatcmpl-x", "object": "chat.completion", "created": int(time.time()),
                         "model": body.get("model", "m"), "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if commands else "stop"}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def upstream():
    srv = Upstream()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One service for the module (mini-swe-agent imports in seconds); every test checks it still serves."""
    log = tmp_path_factory.mktemp("service") / "service.log"
    svc = HarnessService([str(SWE_PY), str(SWE / "harness.py"), "--serve"], cwd=SWE, log_path=log).start()
    yield svc
    svc.stop()


def client(service_path: str, folder: Path, base_url: str | None, key: str = "x", task: dict = TASK,
           args: tuple[str, ...] = (), **popen) -> subprocess.Popen:
    """A rollout's harness command, as the launcher runs it (its own folder, URL and key)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LIGHTNING_"))}
    env.update({SERVICE_VAR: service_path, "OPENAI_API_KEY": key, "LIGHTNING_OUTPUT_DIR": str(folder),
                "LIGHTNING_TASK": json.dumps(task)})
    if base_url is not None:
        env["OPENAI_BASE_URL"] = base_url
    return subprocess.Popen([str(SWE_PY), str(SWE / "harness.py"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    return predicate()


def exit_status(folder: Path) -> str:
    try:
        return json.loads((folder / "trajectory.json").read_text())["info"]["exit_status"]
    except (OSError, ValueError, KeyError):
        return ""


def commands_in(folder: Path) -> list[int]:
    """Pids of processes running a sandboxed command in folder/repo (bubblewrap's ``--bind SOURCE repo
    --chdir repo``; the source is a staging folder when the harness is root)."""
    repo = (folder / "repo").resolve()
    needle = f"\0{repo}\0--chdir\0{repo}\0".encode()
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and needle in Path(entry.path, "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def assert_serves(service, upstream, folder: Path) -> None:
    """The service is alive and a fresh rollout still runs to its submission."""
    assert service.process.poll() is None, "the harness service died"
    ok = client(service.socket_path, folder, upstream.url(f"ok-{uuid.uuid4().hex[:6]}"))
    out, err = ok.communicate(timeout=120)
    assert ok.returncode == 0 and json.loads(out)["exit_status"] == "Submitted", err[-2000:]


# -- a rollout's process killed: its episode ends there ------------------------------------------------
def test_a_killed_rollouts_running_command_is_killed_with_it(service, upstream, tmp_path):
    """Its command ran on to its own timeout (20 s), writing into the folder after the attempt ended; a
    per-process harness's whole tree dies with the kill."""
    upstream.plans["slow"] = [{"command": "sleep 6; echo late > late.txt"}, {"command": "echo second > second.txt"}]
    folder = tmp_path / "killed"
    proc = client(service.socket_path, folder, upstream.url("slow"))
    assert wait_for(lambda: commands_in(folder), 60), "the first command never started"
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    killed_at = time.monotonic()
    assert wait_for(lambda: not commands_in(folder), 10), "the command outlived its rollout's process"
    gone_after = time.monotonic() - killed_at
    assert wait_for(lambda: exit_status(folder) == "Cancelled", 30)
    time.sleep(max(0.0, killed_at + 7 - time.monotonic()))  # past the moment the command would have written
    assert gone_after < 3, f"the command ran {gone_after:.1f} s past the kill"
    assert not (folder / "repo" / "late.txt").exists() and not (folder / "repo" / "second.txt").exists()
    assert len(upstream.times("slow")) == 1  # no model call after the kill
    assert_serves(service, upstream, tmp_path / "after")


@pytest.mark.parametrize("answer,first", [({"text": "let me think", "delay": 3}, 1), ({"status": 503}, 3)],
                         ids=["format-error", "upstream-error"])
def test_no_model_call_with_a_killed_rollouts_credential(service, upstream, tmp_path, answer, first):
    """A model answer without a tool call (or an upstream error) is followed by another call at once (or
    after mini-swe-agent's retry wait, 4 s) with no command in between: that call went out with the dead
    rollout's credential (the proxy refuses it only once the launcher has ended the attempt)."""
    cred = f"dead-{answer.get('status', 'fmt')}"
    upstream.plans[cred] = [answer] * 20
    folder = tmp_path / "killed"
    proc = client(service.socket_path, folder, upstream.url(cred))
    # the kill: during the first (slow) call, or after the first query's own retries (the SDK's two)
    assert wait_for(lambda: len(upstream.times(cred)) >= first, 60), upstream.times(cred)
    time.sleep(1.0 if first == 1 else 0.5)
    proc.kill()
    proc.wait()
    killed_at = time.monotonic()
    time.sleep(8)  # mini-swe-agent's first retry waits 4 s
    late = [t - killed_at for t in upstream.times(cred) if t > killed_at + 0.5]
    assert not late, f"{len(late)} model calls with the killed rollout's credential, at {late} s after the kill"
    assert_serves(service, upstream, tmp_path / "after")


def test_a_client_that_sends_more_than_its_request_then_hangs_up_is_cancelled(service, upstream, tmp_path):
    """Bytes after the request line hid the hang-up from the service's peek: the episode ran to its end."""
    upstream.plans["chatty"] = [{"command": "sleep 3"}, {"command": "echo late > late.txt"}]
    folder = tmp_path / "chatty"
    req = {"task": TASK, "workdir": str(folder / "repo"), "output_path": str(folder / "trajectory.json"),
           "config": str(SWE / "mini.yaml"), "model": "openai/m", "base_url": upstream.url("chatty"), "api_key": "x"}
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(service.socket_path)
        s.sendall(json.dumps(req).encode() + b"\n")
        time.sleep(0.5)
        s.sendall(b"and more")
        assert wait_for(lambda: commands_in(folder), 60)
    assert wait_for(lambda: exit_status(folder), 60) == "Cancelled"
    assert not (folder / "repo" / "late.txt").exists()


def test_a_model_command_bash_cannot_take_is_an_observation_not_a_failed_rollout(service, upstream, tmp_path):
    """A NUL character (JSON's \\u0000), a lone surrogate (JSON's \\ud800: not encodable), a command past the
    kernel's 128 KiB bound on one argument (E2BIG) or a non-string command raised out of the episode: the
    rollout failed, so the policy that wrote it was never scored for it (failed rollouts are dropped)."""
    upstream.plans["nul"] = [{"command": "echo a\0b > nul.txt"}, {"command": 123}, {"command": ["ls"]},
                             {"command": "echo a\ud800b > sur.txt"},
                             {"command": "echo " + "x" * 140_000 + " > long.txt"}]
    proc = client(service.socket_path, tmp_path / "nul", upstream.url("nul"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and json.loads(out)["exit_status"] == "Submitted", err[-2000:]
    messages = json.loads((tmp_path / "nul" / "trajectory.json").read_text())["messages"]
    seen = [str(m["content"]) for m in messages if m["role"] == "tool"]
    assert len(seen) == 5 and all("was not run" in text for text in seen), seen
    assert not any((tmp_path / "nul" / "repo" / name).exists() for name in ("nul.txt", "sur.txt", "long.txt"))


def test_an_episode_past_the_context_window_or_its_wall_time_is_scored_not_failed(service, upstream, tmp_path):
    """Two more ways a policy dodged its 0.0: a conversation past the engine's context window (its 400
    was raised out of the episode: the harness exited 1, the attempt failed), and many commands in one
    reply (mini-swe-agent checks its wall time only before a model call: ten ``sleep 99`` ran the episode
    past the launcher's timeout). Both now end the episode as mini's own limits do: exit 0, scored."""
    upstream.plans["past-context"] = [{"command": "echo one"}, {"status": 400, "message": (
        "This model's maximum context length is 2048 tokens. However, your request has 2101 input tokens. "
        "Please reduce the length of the input messages.")}]
    proc = client(service.socket_path, tmp_path / "ctx", upstream.url("past-context"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and json.loads(out)["exit_status"] == "ContextWindowExceeded", err[-2000:]
    config = yaml.safe_load((SWE / "mini.yaml").read_text())
    config["agent"]["wall_time_limit_seconds"] = 4
    (tmp_path / "mini.yaml").write_text(yaml.safe_dump(config))
    upstream.plans["many-in-one"] = [{"commands": ["sleep 99"] * 10}]
    start = time.monotonic()
    proc = client(service.socket_path, tmp_path / "many", upstream.url("many-in-one"),
                  args=("--config", str(tmp_path / "mini.yaml")))
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 0 and json.loads(out)["exit_status"] == "TimeExceeded", err[-2000:]
    assert took < 30, took  # before the fix: ten commands of 20 s each (the sandbox's per-command bound)


# -- rollouts side by side: nothing of one reaches another ---------------------------------------------
def test_concurrent_rollouts_keep_their_own_credential_folder_and_answers_and_a_stuck_one_blocks_none(
        service, upstream, tmp_path):
    look = "pwd; ls; env | sort; ls /tmp"
    knock = (f"python -c \"import socket; s = socket.socket(socket.AF_UNIX); s.connect('{service.socket_path}'); "
             "print('CONNECTED')\" 2>&1 | tail -1")  # the service's socket, from a model-written command
    upstream.plans["cred-a"] = [{"command": look}, {"command": knock}, {"command": "echo from-a > mark.txt"}]
    upstream.plans["cred-b"] = [{"command": look, "delay": 0.5}, {"command": "echo from-b > mark.txt"}]
    upstream.plans["cred-stuck"] = [{"command": "sleep 15"}]
    idle = [socket.socket(socket.AF_UNIX) for _ in range(20)]  # connections that never send their request
    for s in idle:
        s.connect(service.socket_path)
    task_b = {**TASK, "id": "task-b", "prompt": TASK["prompt"] + "\nSECRET-OF-B"}
    try:
        stuck = client(service.socket_path, tmp_path / "stuck", upstream.url("cred-stuck"))
        assert wait_for(lambda: commands_in(tmp_path / "stuck"), 60)
        a = client(service.socket_path, tmp_path / "a", upstream.url("cred-a"), key="key-a")
        b = client(service.socket_path, tmp_path / "b", upstream.url("cred-b"), key="key-b", task=task_b)
        (out_a, err_a), (out_b, err_b) = a.communicate(timeout=120), b.communicate(timeout=120)
        assert stuck.poll() is None  # a and b finished while the stuck one still runs
    finally:
        for s in idle:
            s.close()
        stuck.kill()
    assert a.returncode == 0 and b.returncode == 0, (err_a[-2000:], err_b[-2000:])
    assert (json.loads(out_a)["task_id"], json.loads(out_b)["task_id"]) == (TASK["id"], "task-b")
    with upstream.lock:
        auth = {(c, h) for c, _, h in upstream.calls if c in ("cred-a", "cred-b")}
    assert auth == {("cred-a", "Bearer key-a"), ("cred-b", "Bearer key-b")}
    assert (tmp_path / "a" / "repo" / "mark.txt").read_text() == "from-a\n"
    assert (tmp_path / "b" / "repo" / "mark.txt").read_text() == "from-b\n"
    tool = [m for m in json.loads((tmp_path / "a" / "trajectory.json").read_text())["messages"] if m["role"] == "tool"]
    knocked = tool[1]["content"]
    assert "FileNotFoundError" in str(knocked) and "CONNECTED" not in str(knocked), knocked
    for mine, other in (("a", "b"), ("b", "a")):
        text = (tmp_path / mine / "trajectory.json").read_text()
        assert str(tmp_path / other) not in text and f"from-{other}" not in text
        assert ("SECRET-OF-B" in text) == (mine == "b")
        assert "key-" not in text and "cred-" not in text  # the key and the credential-bearing URL
        for name in ("OPENAI", "LIGHTNING", "MSWEA", "PROXY"):
            assert name not in text, name
    assert_serves(service, upstream, tmp_path / "after")


def test_through_the_proxy_an_ended_attempts_calls_are_refused_and_later_rollouts_are_unharmed(
        service, upstream, make_proxy, tmp_path):
    """The launcher ends an attempt (``/_lh/end``) while the service still runs its episode: its next call
    is refused at the proxy, the episode fails (it is not retried for minutes), and the next rollout, through
    the same service and the same cached litellm machinery, is served and recorded as itself."""
    proxy = make_proxy(upstreams=[f"http://127.0.0.1:{upstream.server_address[1]}"])
    upstream.plans["PLAN-A"] = [{"command": "sleep 3"}, {"command": "echo two > two.txt"}]
    env_a, env_b = proxy.env_for("roll-a", 0), proxy.env_for("roll-b", 0)
    a = client(service.socket_path, tmp_path / "a", env_a["OPENAI_BASE_URL"], key=env_a["OPENAI_API_KEY"],
               task={**TASK, "prompt": TASK["prompt"] + "\nPLAN-A"})
    assert wait_for(lambda: commands_in(tmp_path / "a"), 60)
    proxy.control.end("roll-a", 0)  # what the launcher does once it has given up on the attempt
    _, err = a.communicate(timeout=60)
    assert a.returncode != 0 and "AuthenticationError" in err, err[-2000:]
    assert len(upstream.times("PLAN-A")) == 1 and not (tmp_path / "a" / "repo" / "two.txt").exists()
    b = client(service.socket_path, tmp_path / "b", env_b["OPENAI_BASE_URL"], key=env_b["OPENAI_API_KEY"],
               task={**TASK, "prompt": TASK["prompt"] + "\nPLAN-B"})
    out, err = b.communicate(timeout=120)
    assert b.returncode == 0 and json.loads(out)["exit_status"] == "Submitted", err[-2000:]
    spans = [(r["rollout_id"], r["attempt"]) for r in read_spans(proxy)]
    assert spans == [("roll-a", 0)] + [("roll-b", 0)] * len(upstream.times("PLAN-B")), spans


# -- the per-rollout side: a service that is gone or answers nonsense ----------------------------------
def fake_service(path: str, answer: bytes) -> threading.Thread:
    """A socket at path that reads one request line and answers ``answer`` (then hangs up)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            conn.makefile("rb").readline()
            conn.sendall(answer)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("answer,reason", [
    (b'{"task_id": "t"}\n', "not understood"),  # an episode lost in the service: no exit status, no error
    (b"[1, 2]\n", "not understood"),
    (b"\xff not json\n", "not understood"),
    (b"", "closed the connection without an answer"),
])
def test_a_service_answer_without_an_episode_fails_the_rollout_clearly(tmp_path, answer, reason):
    """Exit 0 on an answer that says nothing of the episode had the launcher judge whatever the folder held."""
    path = str(tmp_path / "s.sock")
    fake_service(path, answer)
    proc = client(path, tmp_path / "out", "http://127.0.0.1:9/v1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and reason in err and "Traceback" not in err, err[-2000:]


def test_a_service_that_is_gone_is_named_not_a_traceback(tmp_path):
    proc = client(str(tmp_path / "no-such.sock"), tmp_path / "out", "http://127.0.0.1:9/v1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "cannot reach the harness service" in err and "Traceback" not in err, err


# -- what the service shares across rollouts must not count for one of them --------------------------
def test_a_global_call_limit_is_refused_at_start_not_counted_across_rollouts(tmp_path):
    """MSWEA_GLOBAL_CALL_LIMIT bounds one episode in a harness process, but every episode together in the
    service: once the run's rollouts had made that many calls, every later rollout failed."""
    svc = HarnessService([str(SWE_PY), str(SWE / "harness.py"), "--serve"], cwd=SWE, log_path=tmp_path / "svc.log",
                         env={"MSWEA_GLOBAL_CALL_LIMIT": "3"})
    try:
        with pytest.raises(StartupError, match="MSWEA_GLOBAL_CALL_LIMIT"):
            svc.start(timeout=60)
    finally:
        svc.stop()


def test_a_dead_service_is_reported_by_its_check_with_its_log(tmp_path):
    """A batch's health check: after the service died, every rollout failed at once and nothing said why."""
    echo = Path(__file__).parent / "support" / "echo_service.py"
    svc = HarnessService([sys.executable, str(echo)], cwd=tmp_path, log_path=tmp_path / "svc.log").start(timeout=30)
    try:
        assert svc.check() is None
        os.kill(svc.pid, signal.SIGKILL)
        problem = wait_for(svc.check, 10)
        assert problem and "exited with code -9" in problem and str(tmp_path / "svc.log") in problem, problem
        assert "cwd" in problem  # the log's tail: what the service said before it died
    finally:
        svc.stop(grace=1)


def test_the_service_gets_none_of_the_launchers_secrets(tmp_path, monkeypatch):
    """What it holds, every rollout's episode could reach: only what a harness gets (launcher_env), no
    proxy variables, none of the launcher's own LIGHTNING_* or cloud credentials."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "launcher-secret")
    monkeypatch.setenv("LIGHTNING_PROXY_TOKEN", "launcher-token")
    monkeypatch.setenv("HTTPS_PROXY", "http://u:launcher-proxy@127.0.0.1:9")
    code = ("import json, os, socket; print(json.dumps(dict(os.environ)), flush=True); "
            "s = socket.socket(socket.AF_UNIX); s.bind(os.environ['LIGHTNING_HARNESS_SERVICE']); s.listen(); "
            "[s.accept() for _ in iter(int, 1)]")
    svc = HarnessService([sys.executable, "-c", code], cwd=tmp_path, log_path=tmp_path / "svc.log",
                         env={"OPENAI_MODEL": "m", "PASSED": "yes"}).start(timeout=30)
    try:
        env = json.loads((tmp_path / "svc.log").read_text().splitlines()[0])
        assert oct(os.stat(os.path.dirname(svc.socket_path)).st_mode & 0o777) == "0o700"  # its owner's alone
    finally:
        svc.stop(grace=1)
    assert "launcher-" not in json.dumps(env), env
    assert env[SERVICE_VAR] == svc.socket_path and env["PASSED"] == "yes" and env["OPENAI_MODEL"] == "m"
    assert not [k for k in env if k.startswith("LIGHTNING_") and k != SERVICE_VAR], env
