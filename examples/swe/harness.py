#!/usr/bin/env python
"""One mini-swe-agent episode on one swe task: the harness command the launcher runs per rollout.

It writes a private copy of the task's project into ``$LIGHTNING_OUTPUT_DIR/repo`` (or ``--workdir``),
and runs mini-swe-agent (pinned, unmodified, in its own environment ``.venv-swe``) on the task text
through its public Python API: ``DefaultAgent(LitellmModel(...), BubblewrapEnvironment(...))``,
configured by ``mini.yaml``. The model is reached through litellm (``openai/<name>``) at
``OPENAI_BASE_URL`` with ``OPENAI_API_KEY`` (the launcher hands both, pointing at this rollout's
proxy URL). Every command the model writes runs in the sandbox of ``sandbox.py``: no network, no
inherited environment, uid 65534 (never host root: a root harness starts bubblewrap as an unprivileged
host user and hands it the task folder), only the task folder writable, time and memory limits.

It prints one JSON line (exit status, model calls) and leaves ``trajectory.json`` next to the repo.
It never scores itself: the reward is the hidden tests on the final folder, run by the launcher's
reward step (``reward.py``), which outranks anything a harness reports.

Importing mini-swe-agent costs ~5 s of CPU (mostly litellm), more than a whole episode of the tiny
model on two cores. So the same file is also a harness service (``--serve``, the config's
``harness.service``): one process keeps mini-swe-agent imported and runs each episode in a thread.
When ``LIGHTNING_HARNESS_SERVICE`` names its socket, the per-rollout command only hands over its
task, folder, ``OPENAI_BASE_URL`` and key, and waits: still one attributed process per rollout,
whose exit (timeout, kill) cancels its episode: its running command is killed, and it makes no further
command or model call (whose credential the launcher has ended, or is about to).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generate  # noqa: E402
import sandbox  # noqa: E402

DEFAULT_CONFIG = HERE / "mini.yaml"


def load_config(path: str | Path = DEFAULT_CONFIG) -> dict:
    import yaml
    return yaml.safe_load(Path(path).read_text())


def load_task(arg: str | None) -> dict:
    """The task row: argv (JSON or a path), else LIGHTNING_TASK, else LIGHTNING_TASK_FILE."""
    raw = arg or os.environ.get("LIGHTNING_TASK")
    if raw is None and os.environ.get("LIGHTNING_TASK_FILE"):
        raw = Path(os.environ["LIGHTNING_TASK_FILE"]).read_text()
    if raw is None:
        sys.exit("harness.py: no task (pass one, or set LIGHTNING_TASK / LIGHTNING_TASK_FILE)")
    if not raw.lstrip().startswith("{"):
        raw = Path(raw).read_text()
    task = json.loads(raw)
    missing = [k for k in ("files", "prompt", "project") if k not in task]
    if missing:
        sys.exit(f"harness.py: the task lacks {missing}: is it a row of examples/swe/tasks_*.jsonl?")
    return task


def model_name(config: dict, override: str | None) -> str:
    name = override or os.environ.get("OPENAI_MODEL") or config["model"]["model_name"]
    return name if "/" in name else f"openai/{name}"


def build_agent(config: dict, workdir: Path, name: str, output_path: Path | None = None,
                base_url: str | None = None, temperature: float | None = None, api_key: str | None = None,
                cancel: threading.Event | None = None):
    """mini-swe-agent's DefaultAgent with its litellm model and its bubblewrap environment, sandboxed.
    ``cancel`` (service mode): once set, the episode ends before its next command."""
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment
    from minisweagent.exceptions import InterruptAgentFlow, LimitsExceeded, TimeExceeded
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True  # its "Provider List" banner on every unpriced call

    def check_cancel() -> None:
        if cancel is not None and cancel.is_set():  # the rollout's process is gone
            raise InterruptAgentFlow(_exit("Cancelled"))

    class CancellableEnvironment(BubblewrapEnvironment):
        def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
            """The package's bubblewrap command line, sealed (``sandbox.SEAL``, after the folder's bind), run
            with its output, its cgroup and its folder's growth capped (``sandbox.run_capped``: the
            package's own execute keeps all output in memory and in the trajectory, and bounds neither)."""
            check_cancel()
            command = action.get("command", "")
            if why := unrunnable(command):  # (raised, it ended the episode as a failure)
                return {"output": "", "returncode": -1, "exception_info": f"the command was not run: {why}"}
            cwd = cwd or self.config.cwd or str(self.working_dir)
            argv = [self.config.executable, *self.config.wrapper_args, "--bind", cwd, cwd, "--chdir", cwd,
                    *sandbox.SEAL]
            for key, value in self.config.env.items():
                argv += ["--setenv", key, value]
            limit = timeout or self.config.timeout
            text, code = sandbox.run_capped([*argv, "bash", "-c", command], limit, workdir=cwd)
            output = {"output": text, "returncode": -1 if code is None else code,
                      "exception_info": f"the command ran past {limit} s and was killed" if code is None else ""}
            self._check_finished(output)
            return output

    class UnrecordedCredentials(LitellmModel):
        abort_exceptions = [*LitellmModel.abort_exceptions, InterruptAgentFlow]  # a cancel is never retried

        def _query(self, messages: list[dict], **kwargs):
            """No model call once the rollout's process is gone (service mode): neither the next one (a reply
            without a tool call is followed by another call, no command in between) nor a retry of this one
            (mini-swe-agent retries errors for minutes). Each would go out with the ended attempt's credential.
            A conversation past the engine's context window ends the episode as a limit does: the engine's
            400 was raised out of the episode, so the attempt failed and was never scored (a policy could
            dodge its 0.0 by printing enough)."""
            check_cancel()
            try:
                return super()._query(messages, **kwargs)
            except litellm.exceptions.ContextWindowExceededError as exc:
                raise LimitsExceeded(_exit("ContextWindowExceeded")) from exc

    class WallTimedAgent(DefaultAgent):
        def execute_actions(self, message: dict) -> list[dict]:
            """Each command of a reply within the episode's wall time: mini-swe-agent checks it only before a
            model call, so ten ``sleep 99`` in one reply ran the episode past the launcher's timeout (timed
            out, never scored: another way to dodge a 0.0). Past the time, the episode ends as mini's does."""
            outputs = [self.env.execute(action, timeout=self._time_left())
                       for action in message.get("extra", {}).get("actions", [])]
            observed = self.model.format_observation_messages(message, outputs, self.get_template_vars())
            return self.add_messages(*observed)

        def _time_left(self) -> int | None:
            limit = self.config.wall_time_limit_seconds
            if limit <= 0:
                return None
            left = limit - int(time.time() - self._start_time)
            if left <= 0:
                raise TimeExceeded(_exit("TimeExceeded"))
            return min(left, self.env.config.timeout)

        def serialize(self) -> dict:
            """The config as saved in trajectory.json, without the key and the base URL (which
            carries the attempt's proxy credential): the saved trajectory is no place for secrets."""
            data = super().serialize()
            kwargs = data["info"]["config"]["model"].get("model_kwargs") or {}
            for secret in ("api_key", "api_base"):
                kwargs.pop(secret, None)
            return data

    model_cfg = dict(config["model"], model_name=name)
    kwargs = dict(model_cfg.get("model_kwargs") or {})
    if base_url:
        kwargs["api_base"] = base_url
    if api_key:
        kwargs["api_key"] = api_key
    if temperature is not None:
        kwargs["temperature"] = temperature
    model_cfg["model_kwargs"] = kwargs
    env_cfg = config.get("environment") or {}
    env = CancellableEnvironment(**sandbox.environment_config(workdir, env_cfg.get("timeout", 20), env_cfg.get("env")))
    agent_cfg = {k: v for k, v in config["agent"].items() if k != "mode"}
    if output_path is not None:
        agent_cfg["output_path"] = output_path
    return WallTimedAgent(UnrecordedCredentials(**model_cfg), env, **agent_cfg)


def _exit(status: str) -> dict:
    """The message mini-swe-agent ends an episode with (its own limits' shape)."""
    return {"role": "exit", "content": status, "extra": {"exit_status": status, "submission": ""}}


MAX_COMMAND_BYTES = 128 << 10  # the kernel's bound on one argument (MAX_ARG_STRLEN), its final NUL included


def unrunnable(command) -> str:
    """Why the model's command cannot be handed to ``bash -c`` as one argument, or "". Each of these
    raised out of the episode (a NUL: ValueError; a lone surrogate such as JSON's ``\\ud800``: not
    encodable, UnicodeEncodeError; past ``MAX_COMMAND_BYTES``: E2BIG), so the harness exited non-zero
    and the attempt was never scored: a policy could dodge its 0.0 by writing one. The model hears why."""
    if not isinstance(command, str) or "\0" in command:
        return "it must be one string without NUL characters"
    try:
        size = len(os.fsencode(command))
    except UnicodeEncodeError:
        return "it holds a character that has no encoding (a lone surrogate)"
    if size >= MAX_COMMAND_BYTES:
        return f"it is {size} bytes long; a command must be shorter than {MAX_COMMAND_BYTES} bytes"
    return ""


def run_episode(task: dict, workdir: Path, config: dict, name: str, output_path: Path | None = None,
                base_url: str | None = None, temperature: float | None = None, api_key: str | None = None,
                cancel: threading.Event | None = None) -> dict:
    """Write the task into workdir (a fresh folder) and run one episode; returns mini's exit info."""
    workdir.mkdir(parents=True, exist_ok=True)
    generate.write_task(task, workdir)
    agent = build_agent(config, workdir, name, output_path, base_url, temperature, api_key, cancel)
    try:
        info = agent.run(task["prompt"])
    finally:
        agent.env.cleanup()
    return {"exit_status": info.get("exit_status", ""), "model_calls": agent.n_calls}


# -- the harness service: mini-swe-agent imported once, an episode per connection ----------------------
MAX_REQUEST = 1 << 22  # one JSON line: the task row and where to run it
MAX_ANSWER = 1 << 20  # one JSON line: the episode's exit status and model calls, or why it failed
# mini-swe-agent's limits over every episode of a process: in the service, all rollouts' episodes together
SHARED_LIMITS = ("MSWEA_GLOBAL_COST_LIMIT", "MSWEA_GLOBAL_CALL_LIMIT")


def serve(socket_path: str) -> None:
    """Listen on ``socket_path``; each connection sends one request line (:func:`ask_service`) and
    gets one answer line. Episodes run in threads, one per connection."""
    import socketserver

    if shared := [v for v in SHARED_LIMITS if os.environ.get(v, "0").strip() not in ("", "0", "0.0")]:
        sys.exit(f"harness.py --serve: {', '.join(shared)} would count the calls of every rollout's episode "
                 "together (one rollout's calls would fail later ones); limit each episode with step_limit or "
                 "cost_limit in the agent config instead")
    quiet_mini(Path(socket_path).parent / "mini-swe-agent-config")
    sandbox.check()
    import litellm  # noqa: F401  (what costs the seconds: imported once, here)
    import minisweagent.agents.default  # noqa: F401

    class Episode(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline(MAX_REQUEST + 1)
            if not line.strip():  # a readiness probe
                return
            try:
                req = parse_request(line)
            except ValueError as exc:
                req, answer = None, {"error": f"bad request: {exc}"}
                print(f"harness service: {answer['error']}", flush=True)
            if req is not None:
                answer = serve_episode(req, self.connection)
            try:
                self.wfile.write(json.dumps(answer).encode() + b"\n")
            except OSError:  # the rollout's process is gone: nobody to answer
                pass

    class Server(socketserver.ThreadingUnixStreamServer):
        daemon_threads = True

    with Server(socket_path, Episode) as server:
        print(f"harness service: mini-swe-agent ready at {socket_path}", flush=True)
        server.serve_forever()


# base_url is required: an episode without it would reach litellm's default host from the service,
# whose environment has no proxy variables (a call the proxy never sees)
REQUEST_FIELDS = {"task": dict, "workdir": str, "output_path": str, "config": str, "model": str, "base_url": str}
OPTIONAL_FIELDS = {"api_key": str, "temperature": (int, float)}


def parse_request(line: bytes) -> dict:
    """One request line (:func:`ask_service`) as a checked dict; ValueError says what is wrong, so a
    bad request is answered with its reason and the service serves on."""
    if len(line) > MAX_REQUEST:
        raise ValueError(f"longer than {MAX_REQUEST} bytes")
    try:
        req = json.loads(line)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(req, dict):
        raise ValueError("not a JSON object")
    for key, kind in REQUEST_FIELDS.items():
        if not isinstance(req.get(key), kind):
            raise ValueError(f"{key!r} missing or not a {kind.__name__}")
    for key, kinds in OPTIONAL_FIELDS.items():
        if req.get(key) is not None and (not isinstance(req[key], kinds) or isinstance(req[key], bool)):
            raise ValueError(f"{key!r} has the wrong type")
    if not isinstance(req["task"].get("prompt"), str) or not Path(req["workdir"]).is_absolute():
        raise ValueError("the task has no prompt text, or workdir is not an absolute path")
    return req


def serve_episode(req: dict, conn: socket.socket) -> dict:
    """Run one request's episode in a thread; if the rollout's process goes away meanwhile (its
    timeout, a kill), cancel it: its running command is killed, and it ends before its next command
    or model call (its credential is dead), as a per-process harness ends with its process tree."""
    cancel, out = threading.Event(), {}

    def episode() -> None:
        try:
            out.update(run_episode(req["task"], Path(req["workdir"]), load_config(req["config"]), req["model"],
                                   Path(req["output_path"]), req["base_url"], req.get("temperature"),
                                   req.get("api_key"), cancel))
        except BaseException as exc:  # noqa: BLE001 - the rollout's process reports it and exits non-zero
            out["error"] = f"{type(exc).__name__}: {exc}"

    worker = threading.Thread(target=episode, daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.25)
        if not cancel.is_set() and peer_gone(conn):
            cancel.set()
        if cancel.is_set():  # (again each round: a command may have started just as the rollout went)
            kill_commands(str(Path(req["workdir"]).resolve()))  # (as the sandbox binds it)
    return {"task_id": req["task"].get("id"), **out}


def peer_gone(conn: socket.socket) -> bool:
    """True once the rollout's process hung up (or its connection failed). It sends nothing after its
    request line, so whatever else arrives is read and dropped: left unread, it would hide the hang-up.
    (poll, not select: select fails on a descriptor numbered past 1023.)"""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    for _ in range(64):
        if not poller.poll(0):
            return False
        try:
            if not conn.recv(1 << 16, socket.MSG_DONTWAIT):
                return True
        except BlockingIOError:
            return False
        except OSError:
            return True
    return False


def kill_commands(workdir: str) -> int:
    """SIGKILL this process's children that run a sandboxed command bound to ``workdir`` (bubblewrap, or
    the cgroup-joining shell about to become it; its sandbox dies with it): a cancelled episode's command
    must not run on to its timeout, writing into a folder whose attempt has ended. A pidfd opened before
    the check makes sure the process checked is the one signalled. Returns how many were signalled."""
    # (``--bind SOURCE workdir --chdir workdir``: the source is a staging folder when the caller is root)
    me, needle, killed = os.getpid(), f"\0{workdir}\0--chdir\0{workdir}\0".encode(), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or _parent(entry.path) != me:
            continue
        try:
            fd = os.pidfd_open(int(entry.name))
        except OSError:  # gone meanwhile
            continue
        try:
            if _parent(entry.path) == me and needle in Path(entry.path, "cmdline").read_bytes():
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return killed


def _parent(proc_dir: str) -> int | None:
    try:
        return int(Path(proc_dir, "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def ask_service(socket_path: str, task: dict, workdir: Path, output_path: Path, config: str, name: str,
                temperature: float | None) -> dict:
    """The per-rollout side: hand the episode to the service and wait for its answer."""
    base_url = os.environ.get("OPENAI_BASE_URL")
    if not base_url:
        sys.exit("harness.py: OPENAI_BASE_URL is not set; the harness service only runs episodes against "
                 "the URL its rollout was given (the proxy)")
    req = {"task": task, "workdir": str(workdir.resolve()), "output_path": str(output_path.resolve()),
           "config": str(Path(config).resolve()), "model": name, "temperature": temperature,
           "base_url": base_url, "api_key": os.environ.get("OPENAI_API_KEY")}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(socket_path)
        except OSError as exc:
            sys.exit(f"harness.py: cannot reach the harness service at {socket_path} ({exc.strerror or exc}): "
                     "it is not running (see its log, harness-service.log)")
        s.sendall(json.dumps(req).encode() + b"\n")
        answer = s.makefile("rb").readline(MAX_ANSWER + 1)
    if not answer:
        sys.exit("harness.py: the harness service closed the connection without an answer")
    return read_answer(answer)


def read_answer(line: bytes) -> dict:
    """The service's answer, or exit non-zero: an answer that reports neither the episode's exit status
    nor its error says nothing of the episode, and exiting 0 on it would have the launcher judge
    whatever the folder holds."""
    try:
        info = json.loads(line) if len(line) <= MAX_ANSWER else None
    except (ValueError, RecursionError):
        info = None
    if not isinstance(info, dict) or not isinstance(info.get("exit_status", info.get("error")), str):
        sys.exit(f"harness.py: the harness service's answer is not understood: {line[:200]!r}")
    return info


def quiet_mini(config_dir: Path) -> None:
    """mini-swe-agent loads ``<config dir>/.env`` into the environment at import: use an empty one of
    this attempt (or service), not whatever the user's ~/.config/mini-swe-agent holds."""
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(config_dir.resolve()))
    os.environ.setdefault("MSWEA_CONFIGURED", "true")
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", nargs="?", help="task as JSON or a path to it (default: LIGHTNING_TASK[_FILE])")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--model", help="served model name (default: OPENAI_MODEL, else mini.yaml)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--workdir", help="task folder (default: $LIGHTNING_OUTPUT_DIR/repo)")
    parser.add_argument("--serve", action="store_true",
                        help="be the harness service: listen on $LIGHTNING_HARNESS_SERVICE (a Unix socket)")
    args = parser.parse_args()
    service = os.environ.get("LIGHTNING_HARNESS_SERVICE")
    if args.serve:
        return serve(service or sys.exit("harness.py --serve: LIGHTNING_HARNESS_SERVICE (the socket path) is not set"))
    task = load_task(args.task)
    out = Path(os.environ.get("LIGHTNING_OUTPUT_DIR") or ".")
    workdir = Path(args.workdir) if args.workdir else out / "repo"
    if workdir.exists() and any(workdir.iterdir()):
        sys.exit(f"harness.py: {workdir} is not empty; every episode needs a fresh private copy")
    config = load_config(args.config)
    name = model_name(config, args.model)
    if service:
        info = ask_service(service, task, workdir, out / "trajectory.json", args.config, name, args.temperature)
        if "error" in info:
            sys.exit(f"harness.py: the episode failed in the harness service: {info['error']}")
    else:
        quiet_mini(out / "mini-swe-agent-config")
        sandbox.check()
        info = {"task_id": task.get("id"), **run_episode(task, workdir, config, name, out / "trajectory.json",
                                                          temperature=args.temperature)}
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
