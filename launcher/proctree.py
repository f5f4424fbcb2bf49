"""Every process a harness starts, found and ended together, even the ones that ``setsid`` away.

Why not a process group alone: a process group is a label the harness can drop. A grandchild that
calls ``setsid`` (or double-forks into a daemon) leaves the group, survives ``killpg`` and can go on
writing files or posting a reward after the rollout was scored. The harness runs model-written shell
commands, so it has to be treated as hostile.

:class:`ProcessTree` holds one attempt's processes with one of two mechanisms, picked once per
launcher process and logged once (``ProcessTree.mechanism()``):

``cgroup``
    A cgroup v2 directory per tree, a child of the launcher's own cgroup (the only place a
    delegated, non-root launcher may create one). The child joins it in ``preexec_fn``, i.e. after
    ``fork`` and before ``exec``: nothing the harness starts can be born outside it, and no process
    can leave it without write access to another cgroup. A harness running as root has that, so
    ending a tree also SIGKILLs every process still carrying its ``LIGHTNING_TREE`` marker (one that
    moved out *and* exec'd with a clean environment escapes: only a separate user or container
    stops a root harness). Ending the tree writes ``cgroup.kill``
    (Linux >= 5.14), or freezes the cgroup and SIGKILLs each pid of ``cgroup.procs``. The preexec
    function only makes raw syscalls (open/write/close of bytes prepared before the fork, then, with
    ``--run-as``, setgroups/setresgid/setresuid: the join needs the launcher's rights), so the
    "preexec_fn is unsafe with threads" hazard (locks held by other threads) does not apply.
``scan``
    Without a usable cgroup v2 (not mounted, not writable, controllers in the way) the launcher
    becomes a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): orphans reparent to it instead
    of init. The tree is then the leader, its descendants by parent pid in ``/proc``, and orphans
    adopted by the launcher whose environment carries this tree's ``LIGHTNING_TREE`` marker;
    :meth:`poll` records members while the harness runs; every kill round rescans first and keeps
    only pids with the start time first seen (pid reuse), and the adopted ones are reaped. Weaker:
    an orphan that escapes within one scan interval *and* clears its environment is missed, and
    orphans of the launcher's other children (vLLM workers) are adopted too and stay zombies until
    it exits (reaping unknown pids could steal a harness's exit status from ``Popen.wait``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lightning_harness.process import proc_stat

log = logging.getLogger("lightning_harness.launcher")

TREE_ENV = "LIGHTNING_TREE"  # marker in the harness environment; the scan fallback finds orphans by it
_PR_SET_CHILD_SUBREAPER = 36
_SCAN_INTERVAL = 0.25  # seconds between /proc scans in the fallback (each reads every /proc/<pid>/stat)


def _own_cgroup_dir() -> Path | None:
    """The launcher's own cgroup v2 directory (``0::/path`` in /proc/self/cgroup on the v2 mount)."""
    mount = None
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                mount = left.split()[4]
                break
    if mount is None:
        return None
    with open("/proc/self/cgroup") as fh:
        rel = next((ln.strip()[3:] for ln in fh if ln.startswith("0::")), None)
    if rel is None or rel.endswith("(deleted)"):
        return None
    return Path(mount) / rel.lstrip("/")


def _join(procs_file: str) -> Callable[[], None]:
    """A ``preexec_fn`` moving the forked child into the cgroup before it execs (raw syscalls only)."""
    path = procs_file.encode()

    def join() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")  # "0" = the writing process itself
        finally:
            os.close(fd)

    return join


class ProcessTree:
    """One attempt's processes: spawn into it, list them, end them all (see the module doc).

    Usage: ``tree = ProcessTree(); proc = tree.popen(argv, ...)``; call :meth:`poll` while waiting,
    :meth:`kill` to end every member (SIGTERM, ``grace`` seconds, SIGKILL), :meth:`close` at the end.
    """

    _mechanism: str | None = None
    _root: Path | None = None
    _cgroup_kill = False  # the kernel has cgroup.kill (5.14+); else freeze + SIGKILL each pid
    _class_lock = threading.Lock()
    _seq = itertools.count()

    @classmethod
    def mechanism(cls) -> str:
        """'cgroup' or 'scan', decided (and logged) once per process; see the module doc."""
        with cls._class_lock:
            if cls._mechanism is None:
                cls._mechanism, why = cls._probe()
                libc = ctypes.CDLL(None, use_errno=True)
                if cls._mechanism == "scan" and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
                    why += (f"; not a subreaper (errno {ctypes.get_errno()}): orphans go to init, "
                            "only the scan finds them")
                log.info("process trees: %s (%s)", cls._mechanism, why)
            return cls._mechanism

    @classmethod
    def _probe(cls) -> tuple[str, str]:
        """Try the cgroup way for real: create a cgroup, start /bin/true in it, remove it."""
        if os.environ.get("LIGHTNING_PROCESS_TREE") == "scan":
            return "scan", "LIGHTNING_PROCESS_TREE=scan"
        try:
            own = _own_cgroup_dir()
            if own is None:
                return "scan", "no cgroup v2 mount"
            probe = own / f"lightning-{os.getpid()}-probe"
            probe.mkdir(exist_ok=True)
            try:
                subprocess.run(["/bin/true"], preexec_fn=_join(str(probe / "cgroup.procs")), check=True)
                cls._cgroup_kill = (probe / "cgroup.kill").exists()
            finally:
                probe.rmdir()
        except (OSError, subprocess.SubprocessError) as exc:
            return "scan", f"cgroup v2 not usable: {exc}"
        cls._root = own
        cls._reap_stale(own)
        return "cgroup", f"cgroup v2 under {own}, {'cgroup.kill' if cls._cgroup_kill else 'freeze + SIGKILL'}"

    @staticmethod
    def _reap_stale(own: Path) -> None:
        """End trees a killed launcher left behind (``lightning-<pid>-<n>`` with that pid gone)."""
        for d in own.glob("lightning-*-*"):
            pid = d.name.split("-")[1]
            if pid.isdigit() and proc_stat(int(pid)) is None:
                tree = ProcessTree.__new__(ProcessTree)
                tree._init_state("cgroup", d, d.name)
                tree.kill(grace=0.0)
                tree.close()

    def __init__(self) -> None:
        kind = self.mechanism()
        name = f"lightning-{os.getpid()}-{next(self._seq)}"
        self._init_state(kind, self._root / name if kind == "cgroup" else None, name)
        if self.cgroup is not None:
            self.cgroup.mkdir()

    def _init_state(self, kind: str, cgroup: Path | None, marker: str) -> None:
        self.kind, self.cgroup, self.marker = kind, cgroup, marker  # marker: the cgroup's name
        self.leader: int | None = None
        self._known: dict[int, int] = {}  # scan: pid -> start time
        self._adopted: set[int] = set()  # scan: members whose parent is now the launcher (we reap them)
        self._last_scan = 0.0

    def popen(self, args, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen`` with the child inside this tree (and the marker in its environment).

        ``privileges``: a function making the preexec function from the cgroup join (or None), e.g.
        ``RunAs.preexec``: the child must join while it still has the launcher's rights, and only
        then drop them (subprocess's own ``user=`` would switch before any ``preexec_fn``)."""
        env = kwargs.pop("env", None)
        privileges = kwargs.pop("privileges", None)
        env = dict(os.environ if env is None else env)
        env[TREE_ENV] = self.marker
        join = _join(str(self.cgroup / "cgroup.procs")) if self.cgroup is not None else None
        preexec = privileges(join) if privileges is not None else join
        if preexec is not None:
            kwargs["preexec_fn"] = preexec
        proc = subprocess.Popen(args, env=env, **kwargs)
        self.leader = proc.pid
        st = proc_stat(proc.pid)
        if st:
            self._known[proc.pid] = st[2]
        return proc

    def pids(self) -> list[int]:
        """Live (non-zombie) members now."""
        if self.cgroup is not None:  # cgroups the harness created inside its own count too
            pids = []
            for procs in self.cgroup.rglob("cgroup.procs"):
                try:
                    pids += [int(p) for p in procs.read_text().split()]
                except FileNotFoundError:
                    pass
            return pids
        self._scan()
        return list(self._known)

    def poll(self) -> None:
        """Record new members (scan fallback only; a cgroup needs no watching)."""
        if self.cgroup is None and time.monotonic() - self._last_scan >= _SCAN_INTERVAL:
            self._scan()

    def _scan(self) -> None:
        """One /proc pass: keep known pids still alive, add their children and marked orphans."""
        self._last_scan = time.monotonic()
        me = os.getpid()
        table = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = proc_stat(int(name))
                if st and st[1] != "Z":
                    table[int(name)] = st
        live = {p: t for p, t in self._known.items() if p in table and table[p][2] == t}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _, start) in table.items():
                if pid not in live and (ppid in live or (ppid == me and self._marked(pid))):
                    live[pid] = start
                    grew = True
        self._adopted.update(p for p in live if table[p][0] == me and p != self.leader)
        self._known = live

    def _marked(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                return f"{TREE_ENV}={self.marker}".encode() in fh.read().split(b"\0")
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every member (a pid that just exited is skipped)."""
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self, *, grace: float = 3.0) -> bool:
        """SIGTERM every member, wait up to ``grace`` s for the tree to empty, SIGKILL the rest.

        Returns True when the tree is empty afterwards (it may take the kernel a moment).
        """
        if grace > 0:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        self._sweep_marked()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if not self.pids():
                return True
            self._kill_round()
            self._reap_adopted()
            time.sleep(0.02)
        return not self.pids()

    def _sweep_marked(self) -> None:
        """SIGKILL any process carrying this tree's marker that is no longer a member: defence in
        depth against one that left the tree (a root harness can write itself into another cgroup)."""
        members = set(self.pids())
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in members and self._marked(int(name)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(name), signal.SIGKILL)

    def _kill_round(self) -> None:
        """SIGKILL everything: ``cgroup.kill``, else a frozen cgroup pid by pid, else the scan's pids."""
        if self.cgroup is None:
            self.signal(signal.SIGKILL)
            return
        try:
            if self._cgroup_kill:
                (self.cgroup / "cgroup.kill").write_text("1")
                return
            freeze = self.cgroup / "cgroup.freeze"
            freeze.write_text("1")  # nothing forks while we read cgroup.procs and kill
            try:
                self.signal(signal.SIGKILL)
            finally:
                freeze.write_text("0")
        except FileNotFoundError:  # the tree was ended and removed meanwhile
            pass

    def _reap_adopted(self) -> None:
        """Collect orphans the subreaper launcher adopted (Popen reaps its own child, the leader)."""
        for pid in list(self._adopted):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue  # not exited yet
            except ChildProcessError:
                pass
            self._adopted.discard(pid)

    def close(self) -> None:
        """Remove the cgroup directory once it is empty (it is, after :meth:`kill`); reap adopted orphans."""
        if self.cgroup is None:
            deadline = time.monotonic() + 1.0
            while self._adopted and time.monotonic() < deadline:
                self._reap_adopted()
                time.sleep(0.01)
            return
        for _ in range(50):
            try:
                dirs = sorted((d for d in self.cgroup.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts))
                for d in dirs + [self.cgroup]:  # the deepest first: a cgroup with children is busy
                    with contextlib.suppress(FileNotFoundError):
                        d.rmdir()
                return
            except OSError:
                time.sleep(0.02)  # EBUSY: the last member is still exiting
        log.warning("could not remove cgroup %s (still busy)", self.cgroup)


def start_tree(args, **popen) -> tuple[ProcessTree, subprocess.Popen]:
    """Start ``args`` in a new tree as a session leader without stdin (``popen`` as for
    :meth:`ProcessTree.popen`). Raises OSError or SubprocessError, leaving nothing behind, when it
    cannot start; then pair it with :func:`finish_tree`."""
    tree = ProcessTree()
    try:
        return tree, tree.popen(args, stdin=subprocess.DEVNULL, start_new_session=True, **popen)
    except BaseException:
        tree.close()
        raise


def finish_tree(tree: ProcessTree, proc: subprocess.Popen, *, timeout: float | None, kill_grace: float,
                cancel: threading.Event | None = None, linger: float = 0.0,
                on_exit: Callable[[], None] | None = None) -> tuple[bool, bool, int]:
    """Wait for the leader; on timeout or ``cancel`` end the tree with ``kill_grace``; then end whatever
    the leader left running (daemons included) and remove the tree.

    Returns ``(timed_out, cancelled, leftovers)``, leftovers being the processes still running when
    the leader exited by itself (they are killed), or ``linger`` seconds later: helpers that end just
    after their parent (multiprocessing's resource tracker, a server stopped without a wait) are not
    leftovers then. ``on_exit`` runs the moment the leader is seen to have exited by itself."""
    deadline = None if not timeout else time.monotonic() + timeout
    timed_out = cancelled = False
    try:
        while True:
            try:
                proc.wait(0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            tree.poll()
            cancelled = cancel is not None and cancel.is_set()
            timed_out = not cancelled and deadline is not None and time.monotonic() >= deadline
            if cancelled or timed_out:
                tree.kill(grace=kill_grace)
                break
        if not (cancelled or timed_out):
            if on_exit is not None:
                on_exit()
            end = time.monotonic() + linger
            while tree.pids() and time.monotonic() < end:
                time.sleep(0.05)
                tree.poll()
    finally:
        leftovers = len(tree.pids())
        tree.kill(grace=0.0)
        tree.close()
        proc.wait()
    return timed_out, cancelled, leftovers
