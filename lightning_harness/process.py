"""A managed child process: started in its own session, waited for until ready, its group ended.

The vLLM server and the proxy are long-lived children of the trainer or launcher. Each runs as a
session (and process-group) leader, so its workers share its group, terminal signals meant for the
parent do not reach it, and one ``killpg`` ends it with everything it started. A failed start is
reported with the tail of its log, because that is where the child said why.

Why here, in the base package and not in a layer: ``ProxyProcess`` (``proxy/client.py``) needs it
and must import in the proxy's own environment (mitmproxy, no torch, no vLLM), where only
``schemas`` lies below the proxy; the launcher and trainer need it too. It is not a schema and uses
the standard library only, so it sits in the package root that every layer and environment has.
Harness attempts and reward commands need more than a process group (a hostile harness can leave
it); they run in a process tree (``launcher/proctree.py``), which uses the same TERM/grace/KILL rule.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping

# Every variable that sends a client through a proxy: a child that must reach its peers directly
# (the engine, the proxy itself) gets none of them.
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


class StartupError(RuntimeError):
    """The child exited or did not become ready in time; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel reports free on ``host`` now (another process may take it before we bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def direct_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without :data:`PROXY_VARS`."""
    return {k: v for k, v in env.items() if k not in PROXY_VARS}


def log_tail(path: str | os.PathLike | None, lines: int = 40, max_bytes: int = 64 << 10) -> str:
    """The last ``lines`` lines of a log (read from at most its last ``max_bytes``: logs grow large)."""
    try:
        with open(path, "rb") as fh:  # type: ignore[arg-type]
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - max_bytes))
            data = fh.read()
    except (OSError, TypeError):
        return "(no log)"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def start_in_session(argv: list[str], log_path: str | os.PathLike, env: Mapping[str, str],
                     cwd: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start ``argv`` as a session leader, stdout and stderr appended to ``log_path``, no stdin."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env), cwd=cwd, start_new_session=True)


def wait_ready(ready: Callable[[], bool], timeout: float, *, what: str, proc: subprocess.Popen | None = None,
               log_path: str | os.PathLike | None = None) -> None:
    """Poll ``ready()`` (a port, a health URL) until it is true; an exception counts as not ready yet
    (a refused connection, a half-started server) and the last one is named if time runs out.

    Raises :class:`StartupError` with the log's tail as soon as ``proc`` exits, or after ``timeout``
    seconds. The poll interval grows from 0.1 s to 0.5 s: quick for a fast child, cheap for a slow one.
    """
    deadline = time.monotonic() + timeout
    delay, last = 0.1, None
    while True:
        if proc is not None and (code := exit_code(proc)) is not None:
            raise StartupError(f"{what} exited with code {code} during startup; "
                               f"log {log_path}:\n{log_tail(log_path)}")
        try:
            if ready():
                return
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            check = f" (last check: {last!r})" if last else ""
            raise StartupError(f"{what} not ready after {timeout:.0f}s{check}; log {log_path}:\n{log_tail(log_path)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def exit_code(proc: subprocess.Popen) -> int | None:
    """``proc``'s exit code once it has exited (minus the signal that ended it), else None, like
    ``poll()`` but without reaping it: an unreaped child keeps its pid, so its process-group id
    cannot be reused and :func:`stop_group` can still end the workers it left in the group."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere (Popen.wait in another thread)
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start time)`` of a pid from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0].decode(), int(fields[19])


def stop_group(leader: subprocess.Popen | int, grace: float) -> int | None:
    """End the process group ``leader`` leads: SIGTERM, up to ``grace`` s for the leader to exit, SIGKILL.

    The SIGKILL goes to the group even when the leader exited in time: workers can outlive it. With
    ``grace`` 0 only SIGKILL is sent (what a crash looks like). ``leader`` is our child (reaped here,
    its exit code returned) or the pid of a group a previous process left behind (returns None).
    A child reaped before this call is not signalled: its pid may already belong to someone else
    (health checks use :func:`exit_code`, which does not reap, so the group can still be ended).
    """
    if isinstance(leader, subprocess.Popen) and leader.returncode is not None:
        return leader.returncode
    pid = leader.pid if isinstance(leader, subprocess.Popen) else leader
    if grace > 0:
        _signal_group(pid, signal.SIGTERM)
        if isinstance(leader, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                leader.wait(grace)
        else:
            deadline = time.monotonic() + grace
            while (stat := proc_stat(pid)) and stat[1] != "Z" and time.monotonic() < deadline:  # Z: exited
                time.sleep(0.05)
    _signal_group(pid, signal.SIGKILL)
    return leader.wait() if isinstance(leader, subprocess.Popen) else None
