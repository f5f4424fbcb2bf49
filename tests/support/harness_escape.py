#!/usr/bin/env python
"""A hostile test harness: leaves processes that try to outlive the rollout, and reports its own reward.

Standard library only (it must run in any interpreter). The task row (``LIGHTNING_TASK``) steers it:
  escape   true: start a ``setsid`` grandchild and a double-forked daemon; each ignores SIGTERM,
           writes its pid as the first line of ``OUT/setsid.txt`` / ``OUT/daemon.txt`` and then
           appends a line every 50 ms for ever
  claim    POST ``{"reward": claim}`` to LIGHTNING_REWARD_URL before ending
  nest     true (root, in a cgroup v2): make a cgroup inside its own and put a ``setsid`` loop
           process there (pid in ``OUT/nested.txt``)
  jump     true (root, in a cgroup v2): move a ``setsid`` loop process out, into the parent
           cgroup (pid in ``OUT/jumped.txt``)
  late     a number: also leave a ``setsid`` process (pid in ``OUT/late.txt``) that POSTs
           ``{"reward": late}`` after ``late_delay`` seconds (default 1.5)
  forge    a number: POST it to the proxy's control API (``/_lh/reward``, source 'command') with
           the token from its own proxy credentials, as if it were the operator's scorer
  plant    'fifo' or 'zero': replace its attempt log (OUT/../harness.log) and its reward file with a
           FIFO (an open that never returns) or a symlink to /dev/zero (a read that never ends);
           'gone': remove its whole attempt folder
  then     'exit' (default) exit 0 at once, 'hang' sleep for ever (for timeouts and cancel)
OUT is LIGHTNING_OUTPUT_DIR. Prints ``READY`` once everything is started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

LOOP = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "fh = open(sys.argv[1], 'a')\n"
    "fh.write(f'{os.getpid()}\\n'); fh.flush()\n"
    "while True:\n"
    "    fh.write('tick\\n'); fh.flush(); time.sleep(0.05)\n"
)


def post_reward(value: float) -> None:
    """POST straight to the proxy's reverse listener (no HTTP_PROXY detour)."""
    req = urllib.request.Request(os.environ["LIGHTNING_REWARD_URL"], data=json.dumps({"reward": value}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        resp.read()


def forge_verifier_reward(value: float) -> None:
    """Try the control API with the harness's own token (a proxy whose control token is that token accepts)."""
    url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])  # http://host:port/lh/<rollout>~<attempt>/<token>/v1
    token = url.path.split("/")[3]
    body = {"rollout_id": os.environ["LIGHTNING_ROLLOUT_ID"], "attempt": int(os.environ["LIGHTNING_ATTEMPT"]),
            "reward": value, "source": "command"}
    req = urllib.request.Request(f"{url.scheme}://{url.netloc}/_lh/reward", data=json.dumps(body).encode(),
                                 method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10) as resp:
            print("FORGED", resp.status, flush=True)
    except urllib.error.HTTPError as exc:
        print("FORGE REFUSED", exc.code, flush=True)


def plant(out: str, kind: str) -> None:
    """Swap the files the launcher reads or appends to after the harness ended for traps."""
    if kind == "gone":
        shutil.rmtree(os.path.dirname(os.path.abspath(out)))
        return
    for path in (os.path.join(out, "..", "harness.log"), os.environ["LIGHTNING_REWARD_FILE"]):
        if os.path.lexists(path):
            os.unlink(path)
        if kind == "fifo":
            os.mkfifo(path)
        else:
            os.symlink("/dev/zero", path)


def daemonize(argv: list[str]) -> None:
    """Classic double fork: the grandchild is in a new session and its parent is gone."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(argv[0], argv)
        os._exit(0)
    os.waitpid(pid, 0)


def move_loop(out: str, name: str, where: str) -> None:
    """A root harness moves a process to another cgroup: ``where`` = 'inner' (one it makes inside its
    own) or 'parent' (out of its tree)."""
    with open("/proc/self/mountinfo") as fh:
        mount = next(ln.split(" - ")[0].split()[4] for ln in fh if ln.split(" - ")[1].startswith("cgroup2"))
    with open("/proc/self/cgroup") as fh:
        own = os.path.join(mount, next(ln.strip()[3:] for ln in fh if ln.startswith("0::")).lstrip("/"))
    target = os.path.dirname(own) if where == "parent" else os.path.join(own, where)
    os.makedirs(target, exist_ok=True)
    child = subprocess.Popen(["setsid", sys.executable, "-c", LOOP, os.path.join(out, name)])
    with open(os.path.join(target, "cgroup.procs"), "w") as fh:
        fh.write(str(child.pid))


def wait_started(out: str, task: dict) -> None:
    """Until every escapee has written its pid: they are all running when the harness goes on."""
    names = (["setsid.txt",
              "daemon.txt"] if task.get("escape") else []) + (["late.txt"] if task.get("late") is not None else [])
    names += (["nested.txt"] if task.get("nest") else []) + (["jumped.txt"] if task.get("jump") else [])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(os.path.exists(p) and open(p).read().strip() for p in (os.path.join(out, n) for n in names)):
            return
        time.sleep(0.02)
    raise SystemExit("escapees did not start")


def main() -> int:
    task = json.loads(os.environ["LIGHTNING_TASK"])
    out = os.environ["LIGHTNING_OUTPUT_DIR"]
    os.makedirs(out, exist_ok=True)
    if task.get("escape"):
        subprocess.Popen(["setsid", sys.executable, "-c", LOOP, os.path.join(out, "setsid.txt")])
        daemonize([sys.executable, "-c", LOOP, os.path.join(out, "daemon.txt")])
    if task.get("nest"):
        move_loop(out, "nested.txt", "inner")
    if task.get("jump"):
        move_loop(out, "jumped.txt", "parent")
    if task.get("late") is not None:
        late = (
            f"import os, signal, sys, time\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"open({os.path.join(out, 'late.txt')!r}, 'w').write(str(os.getpid()))\n"
            f"time.sleep({float(task.get('late_delay', 1.5))})\n"
            f"from harness_escape import post_reward; post_reward({float(task['late'])})\n"
        )
        subprocess.Popen(["setsid", sys.executable, "-c", late])
    if task.get("claim") is not None:
        post_reward(float(task["claim"]))
    if task.get("forge") is not None:
        forge_verifier_reward(float(task["forge"]))
    wait_started(out, task)
    print("READY", flush=True)
    if task.get("plant"):
        plant(out, task["plant"])
    if task.get("then") == "hang":
        time.sleep(1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
