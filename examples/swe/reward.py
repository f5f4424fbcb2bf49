#!/usr/bin/env python
"""Score one swe episode: the task's hidden tests against the module the agent left, in the sandbox.

The launcher's reward step (``reward.command``), run after the harness's whole process tree is gone.
Its answer outranks anything the harness reports (launcher/rewards.py). What the agent left is
model-written code, so it is treated as hostile:

* only the task's module (``<project>.py``) is taken from the folder, read without following a
  symlink, and only when it is a regular file of at most 256 KiB; visible tests, ``conftest.py``,
  ``sitecustomize.py``, ``.pth`` files or a reward file in the folder are never read;
* the hidden tests come from the task record, never from the folder;
* they run with ``python -I -S -B`` in the bubblewrap sandbox (``sandbox.py``: no network, empty
  environment, uid 65534, everything read-only, time and memory limits) in a fresh folder;
* a pass needs the runner's exit 0 *and* its last line carrying a one-time nonce handed over on
  stdin, so a module that calls ``os._exit(0)`` while being imported or tested does not pass; a
  killed, crashed or timed-out run scores 0.0.

Prints the reward (1.0 or 0.0) as the last stdout line; details go to stderr (the attempt log).
Exits non-zero, printing no reward, only when the task cannot be read or the sandbox cannot run:
the attempt is then ``no_reward`` with the reason, never a score computed outside the sandbox.

    python examples/swe/reward.py                       # LIGHTNING_TASK_FILE, LIGHTNING_OUTPUT_DIR/repo
    python examples/swe/reward.py --task task.json --folder path/to/repo
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sandbox  # noqa: E402

MAX_MODULE_BYTES = 256 << 10
TIMEOUT_S = 60.0

# Runs inside the sandbox: reads the nonce first, then imports the agent's module and runs each test.
_RUNNER = r'''
import sys
nonce = sys.stdin.readline().strip()
sys.path.insert(0, "/score/module")
ns = {"__name__": "hidden_tests"}
exec(compile(open("/score/hidden_tests.py").read(), "hidden_tests.py", "exec"), ns)
tests = [(k, v) for k, v in list(ns.items()) if k.startswith("test_") and callable(v)]
failed = 0
for name, fn in tests:
    try:
        fn()
    except Exception as exc:
        failed += 1
        print("FAILED", name, type(exc).__name__, str(exc)[:200], file=sys.stderr)
if tests and not failed:
    sys.stdout.write("\nHIDDEN-TESTS-PASSED " + nonce + "\n")
    sys.stdout.flush()
sys.exit(1 if failed or not tests else 0)
'''


class ScoreError(RuntimeError):
    """The task or the sandbox is unusable: no reward, rather than a wrong one."""


def read_module(folder: Path, name: str) -> bytes | None:
    """The module's bytes, or None when it is missing, not a regular file, a symlink, or too large."""
    try:
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MODULE_BYTES:
            return None
        return os.read(fd, MAX_MODULE_BYTES + 1)[:MAX_MODULE_BYTES]
    finally:
        os.close(fd)


def score(task: dict, folder: str | Path, timeout: float = TIMEOUT_S) -> tuple[float, str]:
    """(reward, why): the hidden tests of task against folder's module, run in the sandbox."""
    name = f"{task['project']}.py"
    source = read_module(Path(folder), name)
    if source is None:
        return 0.0, f"{name} missing, not a regular file, or over {MAX_MODULE_BYTES} bytes"
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="swe-score-") as tmp:
        root = Path(tmp) / "score"
        (root / "module").mkdir(parents=True)
        (root / "module" / name).write_bytes(source)
        (root / "hidden_tests.py").write_text(task["hidden_tests"])
        (root / "runner.py").write_text(_RUNNER)
        os.chmod(tmp, 0o755)
        argv = [sandbox.interpreter(), "-I", "-S", "-B", "/score/runner.py"]
        try:
            proc = sandbox.run(argv, root, timeout, writable=False, stdin=nonce + "\n", bind_at="/score")
        except subprocess.TimeoutExpired:
            return 0.0, f"hidden tests ran past {timeout:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    passed = proc.returncode == 0 and bool(lines) and lines[-1].strip() == f"HIDDEN-TESTS-PASSED {nonce}"
    if proc.returncode == 0 and not passed:
        return 0.0, "exit 0 without the runner's pass line (the module ended the process early?)"
    return (1.0, "hidden tests passed") if passed else (0.0, f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")


def read_task(arg: str | None) -> dict:
    raw = arg or os.environ.get("LIGHTNING_TASK")
    if raw is None and os.environ.get("LIGHTNING_TASK_FILE"):
        raw = Path(os.environ["LIGHTNING_TASK_FILE"]).read_text()
    if raw is None:
        raise ScoreError("no task (pass --task or set LIGHTNING_TASK / LIGHTNING_TASK_FILE)")
    task = json.loads(raw if raw.lstrip().startswith("{") else Path(raw).read_text())
    missing = [k for k in ("project", "hidden_tests") if k not in task]
    if missing:
        raise ScoreError(f"the task lacks {missing}")
    return task


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", help="task JSON or a path to it (default: LIGHTNING_TASK[_FILE])")
    parser.add_argument("--folder", help="the agent's final folder (default: $LIGHTNING_OUTPUT_DIR/repo)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    args = parser.parse_args()
    try:
        task = read_task(args.task)
        if not args.folder and not os.environ.get("LIGHTNING_OUTPUT_DIR"):
            raise ScoreError("no folder (pass --folder or set LIGHTNING_OUTPUT_DIR)")
        folder = Path(args.folder or Path(os.environ["LIGHTNING_OUTPUT_DIR"]) / "repo")
        sandbox.check()
        reward, why = score(task, folder, args.timeout)
    except (ScoreError, sandbox.SandboxUnavailable, ValueError, OSError) as exc:
        print(f"swe reward: {exc}", file=sys.stderr)
        return 2
    print(f"swe reward {reward}: {why}", file=sys.stderr)
    print(reward)
    return 0


if __name__ == "__main__":
    sys.exit(main())
