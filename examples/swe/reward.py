#!/usr/bin/env python
"""Score one swe episode: the task's hidden tests against the module the agent left, in the sandbox.

The launcher's reward step (``reward.command``), run after the harness's whole process tree is gone.
Its answer outranks anything the harness reports (launcher/rewards.py). What the agent left is
model-written code, so it is treated as hostile:

* only the task's module (``<project>.py``) is taken from the folder, read without following a
  symlink (at its name, nor at ``repo`` or ``out`` above it: the agent's to replace), and only
  when it is a regular file of at most 256 KiB; visible tests, ``conftest.py``,
  ``sitecustomize.py``, ``.pth`` files or a reward file in the folder are never read;
* the hidden tests come from the task record, never from the folder;
* no setuid/setgid bit is left in the folder (``sandbox.settle``): it stays with the traces;
* the module and the tests run in two processes, each with ``python -I -S -B`` in its own
  bubblewrap sandbox (``sandbox.py``: no network, empty environment, uid 65534 and never host root, everything
  read-only, time and memory limits): the tests' process never imports the module, and values
  cross between them as plain data (``remote.py``). So a module that reads the runner's secrets,
  prints a pass line, exits 0, patches the runner or returns an object equal to everything does not
  pass; a killed, crashed or timed-out run scores 0.0.

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
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sandbox  # noqa: E402

MAX_MODULE_BYTES = 256 << 10
TIMEOUT_S = 60.0

REMOTE = Path(__file__).resolve().parent / "remote.py"  # the scorer's two halves
MAX_LOG_BYTES = 64 << 10  # of each half's stderr kept for the reason


class ScoreError(RuntimeError):
    """The task or the sandbox is unusable: no reward, rather than a wrong one."""


def open_folder(folder: Path, owned: int = 1) -> int:
    """A descriptor of ``folder`` whose last ``owned`` path components (those the agent could replace: its
    ``repo``, and the attempt's output folder, in the attempt folder the harness held) are each opened
    relative to the one above without following a symlink. Why: ``O_NOFOLLOW`` on ``folder/name`` checks
    the last component alone, so a ``repo`` (or ``out``) linked to another rollout's scored its module."""
    parts = folder.parts
    fd = os.open(Path(*parts[:-owned]) if len(parts) > owned else Path("."), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in parts[-owned:]:
            fd, above = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd), fd
            os.close(above)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_module(folder_fd: int, name: str) -> bytes | None:
    """The module's bytes (``name`` in the folder ``folder_fd``), or None when it is missing, not a
    regular file, a symlink, or too large."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MODULE_BYTES:
            return None
        return os.read(fd, MAX_MODULE_BYTES + 1)[:MAX_MODULE_BYTES]
    finally:
        os.close(fd)


def score(task: dict, folder: str | Path, timeout: float = TIMEOUT_S, owned: int = 1) -> tuple[float, str]:
    """(reward, why): the hidden tests of task against folder's module, each half in its own sandbox
    (remote.py): the tests' process decides and never imports the module. ``owned``: how many of the
    folder's last path components the agent controls (none of them may be a symlink)."""
    project = task["project"]
    if not isinstance(project, str) or not project.isidentifier():
        raise ScoreError(f"the task's project {project!r} is not a module name")
    try:
        folder_fd = open_folder(Path(folder), owned)
    except OSError as exc:
        return 0.0, f"{folder} is not a folder of the agent's own (a symlink is not followed): {exc.strerror}"
    try:
        sandbox.settle(folder)  # no setuid/setgid bit stays in what the agent left (it is kept with the traces)
        source = read_module(folder_fd, f"{project}.py")
    finally:
        os.close(folder_fd)
    if source is None:
        return 0.0, f"{project}.py missing, not a regular file, or over {MAX_MODULE_BYTES} bytes"
    with tempfile.TemporaryDirectory(prefix="swe-score-") as tmp:
        serve_dir, drive_dir = Path(tmp) / "serve", Path(tmp) / "drive"
        (serve_dir / "module").mkdir(parents=True)
        drive_dir.mkdir()
        (serve_dir / "module" / f"{project}.py").write_bytes(source)
        (drive_dir / "hidden_tests.py").write_text(task["hidden_tests"])
        halves = REMOTE.read_bytes()
        for d in (serve_dir, drive_dir):
            (d / "remote.py").write_bytes(halves)
        for path in (serve_dir, serve_dir / "module", drive_dir):  # (read by the sandbox's unprivileged user;
            os.chmod(path, 0o755)                                 # tmp itself stays 0700: launch stages it)
            for f in path.iterdir():
                if f.is_file():
                    os.chmod(f, 0o644)
        python = [sandbox.interpreter(), "-I", "-S", "-B", "/score/remote.py"]
        code, log = _run_halves(sandbox.argv(python + ["serve", "/score/module", project], serve_dir,
                                             writable=False, bind_at="/score"),
                                sandbox.argv(python + ["drive", "/score/hidden_tests.py", project], drive_dir,
                                             writable=False, bind_at="/score"),
                                Path(tmp), timeout)
    if code is None:
        return 0.0, f"hidden tests ran past {timeout:.0f} s"
    return (1.0, "hidden tests passed") if code == 0 else (0.0, f"exit {code}: {log}")


def _run_halves(serve_argv: list[str], drive_argv: list[str], tmp: Path, timeout: float) -> tuple[int | None, str]:
    """Start both halves joined by two pipes; (drive's exit status or None on timeout, the end of both
    logs). Their stderr goes to files (bounded by the sandbox's file-size limit), not to memory."""
    to_serve, to_drive = os.pipe(), os.pipe()
    procs = []
    with (open(tmp / "serve.log", "wb") as serve_log, open(tmp / "drive.log", "wb") as drive_log,
          sandbox.launch(serve_argv) as serve_full, sandbox.launch(drive_argv) as drive_full):  # (each its cgroups)
        try:
            procs.append(subprocess.Popen(serve_full, stdin=to_serve[0], stdout=to_drive[1], stderr=serve_log))
            procs.append(subprocess.Popen(drive_full, stdin=to_drive[0], stdout=to_serve[1], stderr=drive_log))
        finally:
            for fd in (*to_serve, *to_drive):
                os.close(fd)
        try:
            code = procs[1].wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            for p in procs:
                p.kill()  # (bubblewrap's pid namespace: everything inside goes with it)
                p.wait()
    return code, "\n".join(_tail(tmp / f"{half}.log") for half in ("drive", "serve")).strip()[-600:]


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - MAX_LOG_BYTES))
        return f.read().decode("utf-8", errors="replace").strip()


def owned_parts(folder: Path) -> int:
    """How many of folder's last path components the agent could have replaced: from the attempt's output
    folder down (``LIGHTNING_OUTPUT_DIR``: the harness held the attempt folder around it), else the last."""
    out = os.environ.get("LIGHTNING_OUTPUT_DIR")
    try:
        return max(1, len(folder.relative_to(Path(out).parent).parts)) if out else 1
    except ValueError:  # a --folder elsewhere
        return 1


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
        reward, why = score(task, folder, args.timeout, owned_parts(folder))
    except (ScoreError, sandbox.SandboxUnavailable, ValueError, OSError) as exc:
        print(f"swe reward: {exc}", file=sys.stderr)
        return 2
    print(f"swe reward {reward}: {why}", file=sys.stderr)
    print(reward)
    return 0


if __name__ == "__main__":
    sys.exit(main())
