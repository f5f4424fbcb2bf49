"""``--run-as USER``: harnesses run as an unprivileged user, so they hold only their own rollout's rights.

Why: a harness running as the launcher's user (root, often) can read ``/proc/<proxy pid>/environ``
(the proxy's control token), the control-token file, write Parquet parts into the traces folder
(forging verifier rewards), signal the proxy or vLLM, and read other attempts' folders. The kernel
already separates users; this module only makes the launcher use that:

* the harness process is started as USER (its primary group, or ``USER:GROUP``) with no
  supplementary groups; :meth:`RunAs.preexec` does it in the forked child *after* it joined its
  process tree's cgroup (joining needs the launcher's rights on the cgroup, so the order matters);
* its attempt folder is handed to USER (0700) while it runs and taken back (root, 0700) when its
  process tree is gone, so finished attempts' folders are closed to every later harness;
* the traces folder is locked (:func:`lock_traces`): traversable, not listable or writable, the
  tables and the proxy/engine logs closed to other users.

The reward command is the run's verifier, trusted: it keeps the launcher's user and reads the
attempt folder after it was taken back.
"""

from __future__ import annotations

import grp
import os
import pwd
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lightning_harness.schemas import TABLES


class RunAsError(ValueError):
    """``--run-as`` cannot be honoured (unknown user, root, or not allowed to switch)."""


def _lookup(kind: str, name: str, by_name, by_id) -> tuple[str, int]:
    try:
        entry = by_id(int(name)) if name.isdigit() else by_name(name)
    except KeyError:
        raise RunAsError(f"--run-as: no such {kind} {name!r}") from None
    return entry[0], entry[2]


@dataclass(frozen=True)
class RunAs:
    """An unprivileged user (and group) harnesses run as; build it with :meth:`resolve`."""

    user: str
    uid: int
    gid: int

    @classmethod
    def resolve(cls, spec: str | int | RunAs) -> RunAs:
        """``USER`` or ``USER:GROUP`` (names or numeric ids) -> RunAs, or RunAsError saying why not.

        Refused: unknown users or groups, uid 0 or gid 0 (no protection at all), and a different
        user when the launcher is not root (only root may switch users)."""
        if isinstance(spec, RunAs):
            return spec
        user_part, _, group_part = str(spec).partition(":")
        user, uid = _lookup("user", user_part, pwd.getpwnam, pwd.getpwuid)
        if group_part:
            gid = _lookup("group", group_part, grp.getgrnam, grp.getgrgid)[1]
        else:
            gid = pwd.getpwuid(uid).pw_gid
        if uid == 0 or gid == 0:
            raise RunAsError(f"--run-as {spec}: refusing to run harnesses as root (user or group): that protects "
                             f"nothing")
        if os.geteuid() != 0 and (uid, gid) != (os.geteuid(), os.getegid()):
            raise RunAsError(f"--run-as {spec}: only root can run harnesses as another user (this launcher is uid "
                             f"{os.geteuid()})")
        return cls(user, uid, gid)

    @property
    def switches(self) -> bool:
        """Whether the child must change identity (False when the launcher already is this user)."""
        return (self.uid, self.gid) != (os.geteuid(), os.getegid())

    def preexec(self, before: Callable[[], None] | None = None) -> Callable[[], None]:
        """A ``preexec_fn``: ``before`` (the cgroup join) with the launcher's rights, then drop to
        this user: no supplementary groups, gid, uid (real, effective and saved, so no way back)."""
        uid, gid, switches = self.uid, self.gid, self.switches

        def run() -> None:
            if before is not None:
                before()
            if switches:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)

        return run

    def environ(self, env: dict[str, str], home: Path) -> dict[str, str]:
        """The harness environment with this user's identity; HOME is its private attempt folder
        (the launcher's own home is not the harness's to read or write)."""
        return {**env, "HOME": str(home), "USER": self.user, "LOGNAME": self.user}

    def hand_over(self, workdir: Path) -> None:
        """Give the attempt folder (and the folders the launcher made in it: out/) to this user, 0700.
        The files the launcher wrote there (task.json) stay the launcher's, readable."""
        for path in [workdir, *(p for p in workdir.iterdir() if p.is_dir() and not p.is_symlink())]:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)
            os.chmod(path, 0o700)

    @staticmethod
    def take_back(workdir: Path) -> None:
        """Once the harness's tree is gone: the folder is the launcher's again (0700), so no later
        harness of the same user can read it. Its parent is the launcher's, so it is still there."""
        if workdir.is_dir() and not workdir.is_symlink():
            os.chown(workdir, os.geteuid(), os.getegid(), follow_symlinks=False)
            os.chmod(workdir, 0o700)


class UserPool:
    """The ``--run-as`` users, one per running attempt: two attempts running at once as the same user
    could signal each other, read each other's ``/proc/<pid>/environ`` (their credentials) and folders.
    With fewer users than ``--concurrency`` an attempt waits for a free user."""

    def __init__(self, specs: str | int | RunAs | Iterable[str | int | RunAs]) -> None:
        specs = [specs] if isinstance(specs, (str, int, RunAs)) else list(specs)
        self.users = tuple(RunAs.resolve(s) for s in specs)
        if not self.users:
            raise RunAsError("--run-as: no user given")
        if len({u.uid for u in self.users}) != len(self.users):
            raise RunAsError("--run-as: a user is named twice (each running attempt needs a user of its own)")
        self._free: queue.Queue[RunAs] = queue.Queue()
        for user in self.users:
            self._free.put(user)

    def take(self, cancel: threading.Event) -> RunAs | None:
        """A free user (waiting for one), or None when ``cancel`` is set meanwhile."""
        while not cancel.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                pass
        return None

    def give_back(self, user: RunAs) -> None:
        """Only once the attempt's whole process tree is gone: none of its processes may meet the next attempt."""
        self._free.put(user)


def lock_traces(traces_dir: Path) -> None:
    """Close the traces folder to harness users: the folder and launch/ 0711 (reach your own attempt
    folder by its path, list nothing, write nothing), the tables 0700, the proxy/engine logs 0600.

    Tables not there yet are created here, closed, so a proxy writing them later writes into them."""
    from .attempt import WORK_DIR  # attempt.py imports the runners, which import this module

    traces_dir = Path(traces_dir)
    for d in (traces_dir, traces_dir / WORK_DIR):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o711)
    for table in TABLES:
        (traces_dir / table).mkdir(exist_ok=True)
        os.chmod(traces_dir / table, 0o700)
    for log in (traces_dir / WORK_DIR).glob("*.log"):
        os.chmod(log, 0o600)
