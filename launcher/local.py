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

import contextlib
import datetime as dt
import errno
import fnmatch
import logging
import os
import secrets
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .proctree import finish_tree, start_tree
from .runas import RunAs, UserPool

logger = logging.getLogger("lightning.launcher")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# What a harness or scorer inherits from the launcher's environment unasked: where programs and
# their libraries are, who and where it is, its locale. Nothing else: the launcher's environment
# often holds cloud, hub or CI credentials, and a harness runs model-written commands.
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM",
                 "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")


def launcher_env(extra: Mapping[str, str], inherit: Iterable[str] = INHERITED_ENV) -> dict[str, str]:
    """What a harness or reward command starts from: the launcher's variables named in ``inherit``
    (glob patterns; never its own LIGHTNING_*: control tokens stay with us), plus ``extra``."""
    keep = tuple(inherit)
    return {**{k: v for k, v in os.environ.items()
               if not k.startswith("LIGHTNING_") and any(fnmatch.fnmatchcase(k, p) for p in keep)}, **extra}


def passed_env(patterns: Iterable[str]) -> dict[str, str]:
    """``--pass-env``: the launcher's variables matching ``patterns`` (its LIGHTNING_* never), to add
    to every harness's and scorer's environment like ``--env``. A pattern that names no variable of
    the launcher's environment is an error: a misspelt name would otherwise pass nothing silently."""
    patterns = tuple(patterns)
    if own := [p for p in patterns if p.startswith("LIGHTNING_")]:
        raise ValueError(f"--pass-env: the launcher's LIGHTNING_* variables are never passed ({', '.join(own)})")
    got = launcher_env({}, patterns)
    missing = [p for p in patterns if not any(fnmatch.fnmatchcase(k, p) for k in got)]
    if missing:
        raise ValueError(f"--pass-env: no variable of the launcher's environment matches {', '.join(missing)}")
    return got


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


def open_regular(path: Path, flags: int) -> int:
    """``os.open`` that neither follows a symlink nor blocks on a FIFO; OSError unless a regular file.

    Why: the harness can write its attempt folder, so a file the launcher opens there afterwards
    may have been swapped for a link, a FIFO (an open that never returns) or a device (/dev/zero).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink / a FIFO without a reader
            raise OSError(exc.errno, "not a regular file (a symlink or FIFO; not followed)", str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def open_log(path: Path) -> BinaryIO:
    """The attempt log for appending (and reading back): whatever was planted at ``path`` instead of
    a regular file is removed first, never followed."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT
    try:
        return os.fdopen(open_regular(path, flags), "a+b")
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.EISDIR):
            raise
    set_aside(path)
    return os.fdopen(open_regular(path, flags | os.O_EXCL), "a+b")


def set_aside(path: Path) -> str | None:
    """Clear ``path`` of what a harness put there, never following or walking it: a directory is
    renamed aside (its new name is returned), anything else unlinked.

    Why not remove a directory: the harness made that tree, and one a thousand levels deep makes
    ``shutil.rmtree`` raise RecursionError in the launcher (its log, its outcome were lost). The
    renamed tree stays in the attempt folder, with the harness's other leftovers.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        path.unlink(missing_ok=True)
        return None
    aside = path.with_name(f"{path.name}.planted-{secrets.token_hex(4)}")
    os.rename(path, aside)
    return aside.name


MAX_LOG_BYTES = 1 << 20  # an attempt log keeps its last MiB (harness, pod and scorer output alike)


def trim_to_tail(path: Path, max_bytes: int, log: BinaryIO | None = None) -> None:
    """Keep only the last ``max_bytes`` of a log (marking the cut) so logs stay small.

    With ``log`` (the launcher's own descriptor of it) the text is read from there, and put back at
    ``path`` if the harness replaced or removed the file meanwhile: its log is never lost.
    """
    if log is None:
        try:
            with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as fh:
                return trim_to_tail(path, max_bytes, fh)
        except OSError:
            return
    st = os.fstat(log.fileno())
    try:
        in_place = os.path.samestat(st, os.lstat(path))
    except FileNotFoundError:
        in_place = False
    if in_place and st.st_size <= max_bytes:
        return
    start = max(0, st.st_size - max_bytes)
    tail = os.pread(log.fileno(), st.st_size - start, start)
    nl = tail.find(b"\n")
    if start and 0 <= nl < 4096:
        tail = tail[nl + 1 :]
    head = b"[lightning: %d earlier bytes cut]\n" % (st.st_size - len(tail)) if len(tail) < st.st_size else b""
    path.parent.mkdir(parents=True, exist_ok=True)  # the harness may have removed its whole folder
    moved = None if in_place else set_aside(path)
    if moved:
        tail += f"[lightning] the harness left a directory at {path.name}; moved aside to {moved}\n".encode()
    replace_with(path, head + tail)


def replace_with(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` at once (a ``.log-*`` file beside it, renamed over it); that temporary
    file never outlives a failure, which is raised."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".log-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class LocalRunner:
    """Runs attempts as local processes. Thread-safe: one call of :meth:`run` per worker thread."""

    name = "local"

    def __init__(self, *, kill_grace: float = 3.0, max_log_bytes: int = MAX_LOG_BYTES, run_as=None) -> None:
        """``run_as``: a user (``RunAs`` spec) or several, one per attempt running at once (launcher/runas.py)."""
        self.kill_grace = kill_grace
        self.max_log_bytes = max_log_bytes
        self.users = UserPool(run_as) if run_as is not None else None
        self.run_as: tuple[RunAs, ...] = self.users.users if self.users else ()

    def run(self, job: AttemptJob, cancel: threading.Event) -> AttemptOutcome:
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.users is None:
            return self._run(job, cancel, None)
        user = self.users.take(cancel)
        if user is None:
            return AttemptOutcome(None, utcnow(), utcnow(), cancelled=True, error="cancelled before it started")
        try:
            user.hand_over(job.workdir)
            try:
                return self._run(job, cancel, user)
            finally:  # the tree is gone: no harness of this user can open the folder again
                RunAs.take_back(job.workdir)
        finally:
            self.users.give_back(user)

    def _run(self, job: AttemptJob, cancel: threading.Event, user: RunAs | None) -> AttemptOutcome:
        started = utcnow()
        env = user.environ(launcher_env(job.env), job.workdir) if user else launcher_env(job.env)
        with open_log(job.log_path) as log:  # kept open: the harness may replace the file, not our descriptor
            try:
                tree, proc = start_tree(
                    job.command, shell=isinstance(job.command, str),
                    executable="/bin/sh" if isinstance(job.command, str) else None, env=env,
                    cwd=job.cwd or (job.workdir if user else None), stdout=log, stderr=subprocess.STDOUT,
                    privileges=user and user.preexec,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                if user and isinstance(exc, PermissionError):  # the usual cause: a venv under /root
                    exc = PermissionError(f"{exc} (as --run-as {user.user}: that user must be able to read the "
                                          "interpreter, the harness code and every folder above them; docs/LAUNCH.md)")
                return self._not_started(job, log, started, exc)
            timed_out, cancelled, leftovers = finish_tree(tree, proc, timeout=job.timeout,
                                                          kill_grace=self.kill_grace, cancel=cancel)
            if leftovers:
                log.write(f"[lightning] killed {leftovers} process(es) the harness left running\n".encode())
            return self._outcome(job, log, proc, started, timed_out, cancelled)

    def _trim(self, job: AttemptJob, log: BinaryIO) -> None:
        """Cut the log to its tail and put it back at its path. What the harness did to its folder is its
        own problem: a failure here is logged, never raised, so the attempt keeps its real outcome."""
        try:
            trim_to_tail(job.log_path, self.max_log_bytes, log)
        except OSError as exc:
            logger.warning("%s~%d: the attempt log could not be put back at %s: %s",
                           job.rollout_id, job.attempt, job.log_path, exc)

    def _not_started(self, job: AttemptJob, log: BinaryIO, started: dt.datetime, exc: Exception) -> AttemptOutcome:
        log.write(f"[lightning] could not start harness: {exc}\n".encode())
        log.flush()
        self._trim(job, log)
        return AttemptOutcome(None, started, utcnow(), error=f"could not start harness: {exc}")

    def _outcome(self, job: AttemptJob, log: BinaryIO, proc: subprocess.Popen, started: dt.datetime,
                 timed_out: bool, cancelled: bool) -> AttemptOutcome:
        ended = utcnow()
        error = None
        if timed_out:
            error = f"timed out after {job.timeout:g}s; process tree killed"
        elif cancelled:
            error = "cancelled; process tree killed"
        elif proc.returncode != 0:
            rc = proc.returncode
            error = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        log.write(f"[lightning] attempt ended: exit={proc.returncode} {error or 'ok'}\n".encode())
        log.flush()
        self._trim(job, log)
        return AttemptOutcome(proc.returncode, started, ended, timed_out=timed_out, cancelled=cancelled, error=error)
