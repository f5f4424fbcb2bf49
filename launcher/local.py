"""Run one harness attempt as a local process; its whole process tree ends with it.

Why a process tree (:mod:`.proctree`) and not just a process group: harnesses spawn children
(shells, tool subprocesses, language servers), and a hostile one can ``setsid`` or double-fork out of
its group. A timeout, a cancel, and also a normal exit of the harness end every process it started
(SIGTERM, a grace period, SIGKILL), so nothing keeps running after the attempt is judged. The
harness is still a session leader (``start_new_session=True``) so terminal signals of the launcher
do not reach it directly. Output goes straight to a log file (no pipe to drain, nothing lost if the
launcher dies) and is cut to its tail when the attempt ends.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from .proctree import ProcessTree


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass
class AttemptJob:
    """What a runner needs to start one attempt: command, environment, files, limits."""

    rollout_id: str
    attempt: int
    command: Sequence[str] | str  # argv, or a shell command line
    env: Mapping[str, str]  # the harness variables (added to the launcher's own environment locally)
    workdir: Path  # per-attempt folder (task.json, reward.json, harness.log, out/)
    log_path: Path
    timeout: float | None = None
    cwd: str | None = None
    task_json: str = "{}"
    labels: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, Path] = field(default_factory=dict)  # local files a remote runner must ship (task.json, CA)


@dataclass
class AttemptOutcome:
    """How the attempt ended, before rewards are looked at."""

    exit_code: int | None
    started_at: dt.datetime
    ended_at: dt.datetime
    timed_out: bool = False
    cancelled: bool = False
    error: str | None = None
    reward_file_local: bool = True  # False when the reward file lived elsewhere (a pod)

    @property
    def duration_s(self) -> float:
        return (self.ended_at - self.started_at).total_seconds()


def trim_to_tail(path: Path, max_bytes: int) -> None:
    """Keep only the last ``max_bytes`` of a log (marking the cut) so logs stay small."""
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size <= max_bytes:
        return
    with open(path, "rb") as fh:
        fh.seek(size - max_bytes)
        tail = fh.read()
    nl = tail.find(b"\n")
    if 0 <= nl < 4096:
        tail = tail[nl + 1 :]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"[lightning: %d earlier bytes cut]\n" % (size - len(tail)) + tail)
    os.replace(tmp, path)


class LocalRunner:
    """Runs attempts as local processes. Thread-safe: one call of :meth:`run` per worker thread."""

    name = "local"

    def __init__(self, *, kill_grace: float = 3.0, max_log_bytes: int = 1 << 20, inherit_env: bool = True) -> None:
        self.kill_grace = kill_grace
        self.max_log_bytes = max_log_bytes
        self.inherit_env = inherit_env
        self._live: dict[int, ProcessTree] = {}
        self._lock = threading.Lock()

    def _environ(self, job: AttemptJob) -> dict[str, str]:
        """The launcher's environment minus its own LIGHTNING_* (control tokens stay with us), plus the job's."""
        base = os.environ if self.inherit_env else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env = {k: v for k, v in base.items() if not k.startswith("LIGHTNING_")}
        env.update(job.env)
        return env

    def run(self, job: AttemptJob, cancel: threading.Event) -> AttemptOutcome:
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = utcnow()
        shell = isinstance(job.command, str)
        tree = None
        try:
            tree = ProcessTree()
            with open(job.log_path, "ab") as log:
                proc = tree.popen(
                    job.command if shell else list(job.command), shell=shell,
                    executable="/bin/sh" if shell else None, env=self._environ(job), cwd=job.cwd,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
        except (OSError, subprocess.SubprocessError) as exc:
            if tree is not None:
                tree.close()
            with open(job.log_path, "ab") as log:
                log.write(f"[lightning] could not start harness: {exc}\n".encode())
            return AttemptOutcome(None, started, utcnow(), error=f"could not start harness: {exc}")
        with self._lock:
            self._live[proc.pid] = tree
        leftovers = 0
        try:
            timed_out, cancelled = self._wait(proc, tree, job.timeout, cancel)
        finally:
            # the leader is gone; whatever it left running (daemons included) goes too
            leftovers = len(tree.pids())
            tree.kill(grace=0.0)
            tree.close()
            proc.wait()
            with self._lock:
                self._live.pop(proc.pid, None)
        if leftovers:
            with open(job.log_path, "ab") as log:
                log.write(f"[lightning] killed {leftovers} process(es) the harness left running\n".encode())
        return self._outcome(job, proc, started, timed_out, cancelled)

    def _wait(self, proc: subprocess.Popen, tree: ProcessTree, timeout: float | None,
              cancel: threading.Event) -> tuple[bool, bool]:
        """Wait for the leader; on timeout or cancel end the whole tree. Returns (timed_out, cancelled)."""
        deadline = None if not timeout else time.monotonic() + timeout
        while True:
            try:
                proc.wait(0.1)
                return False, False
            except subprocess.TimeoutExpired:
                pass
            tree.poll()
            cancelled = cancel.is_set()
            timed_out = not cancelled and deadline is not None and time.monotonic() >= deadline
            if cancelled or timed_out:
                tree.kill(grace=self.kill_grace)
                return timed_out, cancelled

    def _outcome(self, job: AttemptJob, proc: subprocess.Popen, started: dt.datetime, timed_out: bool,
                 cancelled: bool) -> AttemptOutcome:
        ended = utcnow()
        error = None
        if timed_out:
            error = f"timed out after {job.timeout:g}s; process tree killed"
        elif cancelled:
            error = "cancelled; process tree killed"
        elif proc.returncode != 0:
            rc = proc.returncode
            error = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        with open(job.log_path, "ab") as log:
            log.write(f"[lightning] attempt ended: exit={proc.returncode} {error or 'ok'}\n".encode())
        trim_to_tail(job.log_path, self.max_log_bytes)
        return AttemptOutcome(proc.returncode, started, ended, timed_out=timed_out, cancelled=cancelled, error=error)

    def kill_all(self) -> None:
        """Emergency stop of every live attempt (the normal path is the cancel event)."""
        with self._lock:
            live = list(self._live.values())
        for tree in live:
            tree.kill(grace=0.0)
