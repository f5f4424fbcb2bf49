#!/usr/bin/env python3
"""A hostile harness for ``--run-as``: it tries what a same-user harness could do, and reports what it got.

Standard library only: it runs as another user under the system interpreter, which must be able to
read it (the test copies it into a world-readable folder). The task row gives ``confdir`` (the
proxy's, to find the proxy process by its command line and its control-token file) and optionally
``sibling`` (the rollout id of an attempt that ran before this one, in the same run) or ``peer``
(the rollout id of one running at the same time: it waits for that process, probes it, and stays
alive a second for the peer's probes).

Each probe records ``"ok"`` (it worked: a hole) or the errno name it failed with. Then it makes a
model call through the proxy (OPENAI_BASE_URL) and writes its reward file, as a well-behaved harness
would. The report is ``OUT/probe.json`` (OUT = LIGHTNING_OUTPUT_DIR) and the last line of stdout.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import signal
import time
import urllib.request


def attempt(fn) -> str:
    """'ok' when ``fn`` succeeded, else the errno name (EACCES, EPERM, ...) it failed with."""
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def read(path: str) -> None:
    with open(path, "rb") as fh:
        fh.read(1)


def create_in(folder: str) -> None:
    with open(os.path.join(folder, f"forged-{os.getpid()}.parquet"), "wb") as fh:
        fh.write(b"PAR1")


def proxy_pid(confdir: str) -> int | None:
    """The capture proxy: the process whose command line names this run's confdir (cmdline is public)."""
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"--confdir" in argv and confdir.encode() in argv:
            return int(path.split("/")[2])
    return None


def model_call() -> int:
    """One chat call in reverse mode, straight to the proxy's listener (as the openai client would)."""
    body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'x')}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as resp:
        resp.read()
        return resp.status


def peer_pid(timeout: float = 20.0) -> int | None:
    """The other harness_runas.py running now (both are started at once), found by its public cmdline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in glob.glob("/proc/[0-9]*/cmdline"):
            pid = int(path.split("/")[2])
            try:
                with open(path, "rb") as fh:
                    argv = fh.read().split(b"\0")
            except OSError:
                continue
            if pid != os.getpid() and any(a.endswith(b"harness_runas.py") for a in argv):
                return pid
        time.sleep(0.05)
    return None


def peer_probes(folder: str) -> dict:
    """What a harness can do to one running at the same time (another user from the --run-as pool)."""
    pid = peer_pid()
    report = {
        "peer_pid": pid,
        "peer_environ": attempt(lambda: read(f"/proc/{pid}/environ")),
        "peer_signal": attempt(lambda: os.kill(pid, 0)),
        "peer_list": attempt(lambda: os.listdir(folder)),
    }
    time.sleep(1.0)  # stay alive while the peer probes this one
    return report


def probes(task: dict, out: str) -> dict:
    work = os.path.dirname(out)  # TRACES/launch/<run>/<rollout>/<attempt>
    traces = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(work))))
    pid = proxy_pid(task["confdir"])
    report = {
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "proxy_pid": pid, "cwd": os.getcwd(),
        "proxy_environ": attempt(lambda: read(f"/proc/{pid}/environ")),
        "launcher_environ": attempt(lambda: read(f"/proc/{os.getppid()}/environ")),
        "control_token_file": {p: attempt(lambda p=p: read(p)) for p in glob.glob(os.path.join(task["confdir"],
                                                                                               "control-token-*"))},
        "ca_key": attempt(lambda: read(os.path.join(task["confdir"], "mitmproxy-ca.pem"))),
        "traces_create": attempt(lambda: create_in(traces)),
        "spans_create": attempt(lambda: create_in(os.path.join(traces, "spans"))),
        "rewards_create": attempt(lambda: create_in(os.path.join(traces, "rewards"))),
        "traces_list": attempt(lambda: os.listdir(traces)),
        "kill_proxy": attempt(lambda: os.kill(pid, signal.SIGTERM)),  # the hole would end the run: the test sees it
        "kill_launcher": attempt(lambda: os.kill(os.getppid(), 0)),  # signal 0: the same permission check
        "proxy_log": attempt(lambda: read(os.path.join(traces, "launch", "proxy.log"))),
        "own_task_file": attempt(lambda: read(os.environ["LIGHTNING_TASK_FILE"])),
        "own_out_write": attempt(lambda: create_in(out)),
    }
    if task.get("peer"):
        report.update(peer_probes(os.path.join(os.path.dirname(os.path.dirname(work)), task["peer"], "0")))
    if task.get("sibling"):
        sib = os.path.join(os.path.dirname(os.path.dirname(work)), task["sibling"], "0")
        report["sibling_list"] = attempt(lambda: os.listdir(sib))
        report["sibling_task_file"] = attempt(lambda: read(os.path.join(sib, "task.json")))
        report["sibling_log"] = attempt(lambda: read(os.path.join(sib, "harness.log")))
    return report


def main() -> int:
    task = json.loads(os.environ["LIGHTNING_TASK"])
    out = os.environ["LIGHTNING_OUTPUT_DIR"]
    report = probes(task, out)
    try:
        report["model_call"] = model_call()
    except OSError as exc:  # recorded, not raised: the report is what the test reads
        report["model_call"] = repr(exc)
    with open(os.environ["LIGHTNING_REWARD_FILE"], "w") as fh:
        json.dump({"reward": float(task.get("reward", 0.5))}, fh)
    with open(os.path.join(out, "probe.json"), "w") as fh:
        json.dump(report, fh)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
