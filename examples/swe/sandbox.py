"""The bubblewrap sandbox the swe example runs model-written code in (the agent's commands and the scorer).

mini-swe-agent's own bubblewrap environment keeps the network and the parent's environment (its
commands could read OPENAI_API_KEY or the proxy credentials, and reach the proxy). This module builds
the argument list that closes both, handed to that environment through its public config fields
(`executable`, `wrapper_args`, `cwd`, `timeout`, `env`): nothing in the package is patched.

What a command in the sandbox gets:
* never host root: when the caller is root, bubblewrap itself is started as an unprivileged host user
  (``host_ids``: 65534, nobody, unless ``LIGHTNING_SANDBOX_UID`` names another; ``setpriv``, after
  joining the cgroups). Run as root, bubblewrap maps the sandbox user to host uid 0: without
  capabilities, but the kernel's uid checks (``/proc/sys`` writes, files it creates: a setuid-root
  binary left in the work folder) then see root. The folders it binds are first bound, as root, in a
  private mount namespace of its own under a staging folder it can reach (``launch``), so a work folder
  or a Python installation below a root-only folder (``/root``, pytest's tmp folders, 0700 attempt
  folders) still works; the writable folder is handed over to that user (``settle``);
* no network: a network namespace of its own with only a private loopback (`--unshare-all`), so
  neither the capture proxy nor any other host port is reachable;
* no inherited environment: bubblewrap itself is started through `env -i` (its pid 1 inside the
  namespace would otherwise expose the harness's variables in `/proc/1/environ`), and the command
  gets `--clearenv` plus PATH/HOME/LANG only;
* its own pid, ipc, uts and user namespaces, running as uid/gid 65534 (nobody) inside, with no
  capabilities; `/proc` shows only its own processes and `/proc/sys` is read-only; no further user
  namespace (`--disable-userns`: one would let it mount its own tmpfs past the bounds below, or a
  cgroup2 tree in which to kill other rollouts' processes);
* a read-only view of `/usr` and of the Python installation that runs the tests, an empty private
  `/tmp` of at most `TMP_BYTES`, and exactly one writable folder: the private copy of the task
  (bound by the caller);
* limits: address space (`prlimit --as`), file size (`--fsize`; a seccomp filter refuses `fallocate
  --keep-size`, which reserves disk blocks past a file's end that the size limit never sees), open files, output kept
  (`run_capped`), and the caller's wall-clock timeout (killing bubblewrap ends everything inside:
  `--die-with-parent`, pid namespace);
* nothing the host counts across users: no pseudo-terminal (`/dev/pts` is an empty read-only folder:
  every pty a command opened counted against the host's `kernel.pty.max`, 4,096, that ssh and every
  other rollout draw on) and no inotify instance (the seccomp filter: they are counted per host user,
  and all rollouts' commands run as one);
* nothing else writable: bubblewrap's own root and `/dev` are memory-backed filesystems of half the
  machine's RAM each, writable by the sandbox user, so they are remounted read-only and `/dev/shm`
  is a bounded tmpfs (without this, a command parked gigabytes in memory past the `/tmp` bound);
* the whole command tree's processes and memory (tmpfs pages included) in a cgroup of its own
  (`confined`) where one is writable: per-process rlimits bound neither a fork bomb nor many
  processes of 1 GiB each. Where none is, the processes are still bounded, per sandbox, by
  ``RLIMIT_NPROC`` set inside its user namespace (``with_process_cap``, Linux 5.14 or later), but
  their total memory is not (``check`` warns);
* the work folder's growth (`run_capped(..., workdir=)`: bytes and entries, polled every
  `WATCH_INTERVAL_S` while the command runs): `--fsize` bounds one file, not how many a command
  writes to the host disk. A command is killed once the folder passes `WORK_BYTES` or `WORK_FILES`,
  and no further command runs in a folder over them (or holding a folder the caller cannot list):
  the agent is told so instead. What is left: between two polls a command may still add up to
  ``DEFAULT_FILE_BYTES`` per file times the files it makes in that time (``fallocate`` makes them in
  about a millisecond each), so the folder's bytes on disk are bounded by the bounds plus that one
  overshoot, not by a quota; a hard bound needs a filesystem quota on the traces;
* no setuid or setgid bit survives a command in the work folder (``settle``, also run by the
  scorer): the files are the unprivileged user's anyway, but no bit is left for anyone to use.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import re
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SANDBOX_UID = 65534                 # the command's uid and gid inside the sandbox
HOST_UID = 65534                    # bubblewrap's host uid/gid for a root caller (LIGHTNING_SANDBOX_UID=UID[:GID])
DEFAULT_MEMORY_BYTES = 1 << 30      # address space per command
DEFAULT_FILE_BYTES = 16 << 20       # largest file a command may write
DEFAULT_OPEN_FILES = 256
TMP_BYTES = 256 << 20           # the private /tmp (memory-backed) holds at most this
MAX_OUTPUT_BYTES = 1 << 20      # of a command's output kept (observation and trajectory)
SHM_BYTES = 64 << 20            # the private /dev/shm (memory-backed) holds at most this
DEFAULT_PROCESSES = 512         # tasks (processes and threads) of one command tree (cgroup pids.max)
SANDBOX_PROCESSES = DEFAULT_PROCESSES  # ... and of one sandbox, cgroup or not (RLIMIT_NPROC inside it)
NPROC_PER_NAMESPACE = (5, 14)   # the first Linux counting RLIMIT_NPROC per user namespace, not per host uid
TOTAL_MEMORY_BYTES = 2 << 30    # memory of one command tree, its tmpfs pages included (cgroup memory)
WORK_BYTES = 256 << 20          # the work folder may hold this many bytes (polled; see the docstring) ...
WORK_FILES = 20_000             # ... and this many entries
WATCH_INTERVAL_S = 0.2          # how often run_capped looks at the work folder
REFUSED = 126                   # run_capped's exit status for a command it did not run (its folder is over them)
# after every mount (the work folder's bind included): bubblewrap's root tmpfs, writable by the
# sandbox user and as large as half the RAM, becomes read-only
SEAL = ["--remount-ro", "/"]
SANDBOX_PATH_TAIL = "/usr/local/bin:/usr/bin:/bin"
log = logging.getLogger("lightning.swe.sandbox")


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or env/prlimit) is missing or cannot create namespaces here."""


def _tool(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/bin/{name}") if Path(p).exists()), None)
    if not path:
        hint = " (apt-get install -y bubblewrap; scripts/setup_envs.sh swe does it)" if name == "bwrap" else ""
        raise SandboxUnavailable(f"{name} not found{hint}")
    return path


@functools.lru_cache(maxsize=8)
def _prefixes(python: str) -> tuple[str, str]:
    out = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return out[0], out[1]


def _prefix(python: str) -> str:
    return _prefixes(python)[0]


def python_roots(python: str | None = None) -> list[str]:
    """Folders the sandbox must see read-only for `python` to run: its venv and its base install."""
    roots = []
    for p in _prefixes(python or sys.executable):
        real = str(Path(p).resolve())
        if real and not real.startswith("/usr") and real not in roots:
            roots.append(real)
    return roots


def interpreter(python: str | None = None) -> str:
    """The path of python as seen inside the sandbox (its venv's real path: a symlinked venv folder
    such as .venv -> cache is not bound)."""
    exe = Path(python or sys.executable)
    return str(Path(_prefix(str(exe))).resolve() / "bin" / exe.name)


def bwrap_prefix(python: str | None = None, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 file_bytes: int = DEFAULT_FILE_BYTES) -> list[str]:
    """`env -i prlimit ... bwrap ...` up to (not including) the work-folder bind and the command.

    The python whose installation is exposed also comes first on PATH, so `python -m pytest` works.
    """
    exe = Path(python or sys.executable)
    bindir = Path(_prefix(str(exe))).resolve() / "bin"
    argv = [_tool("env"), "-i", _tool("prlimit"), f"--as={memory_bytes}", f"--fsize={file_bytes}",
            f"--nofile={DEFAULT_OPEN_FILES}", "--", _tool("bwrap"),
            "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--disable-userns", "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
            "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
            "--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
            "--size", "4096", "--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts",
            "--remount-ro", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    for root in python_roots(str(exe)):
        argv += ["--ro-bind", root, root]
    argv += ["--setenv", "PATH", f"{bindir}:{SANDBOX_PATH_TAIL}", "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8"]
    return argv


def environment_config(workdir: str | Path, timeout: int, env: dict | None = None,
                       python: str | None = None, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> dict:
    """Keyword arguments for minisweagent's BubblewrapEnvironment running in workdir."""
    prefix = bwrap_prefix(python, memory_bytes)
    return {"executable": prefix[0], "wrapper_args": prefix[1:], "cwd": str(Path(workdir).resolve()),
            "timeout": int(timeout), "env": dict(env or {})}


def argv(command: list[str], workdir: str | Path, python: str | None = None,
         memory_bytes: int = DEFAULT_MEMORY_BYTES, writable: bool = True, bind_at: str | None = None) -> list[str]:
    """The full argument list that runs command in the sandbox with workdir bound (at bind_at, else
    its own path; read-only unless writable) as the current folder."""
    wd = str(Path(workdir).resolve())
    inside = bind_at or wd
    return bwrap_prefix(python, memory_bytes) + ["--bind" if writable else "--ro-bind", wd, inside,
                                                 "--chdir", inside, *SEAL, "--", *command]


def run(command: list[str], workdir: str | Path, timeout: float, python: str | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES, writable: bool = True, stdin: str | None = None,
        bind_at: str | None = None) -> subprocess.CompletedProcess:
    """Run command in the sandbox (see argv), in cgroups of its own where possible (``confined``).
    Raises TimeoutExpired (bubblewrap and all inside are killed)."""
    # (errors="replace": what the model or its module prints need not be UTF-8)
    with launch(argv(command, workdir, python, memory_bytes, writable, bind_at)) as full:
        return subprocess.run(full, input=stdin, capture_output=True, text=True, errors="replace", timeout=timeout,
                              check=False)


def run_capped(argv: list[str], timeout: float, max_bytes: int = MAX_OUTPUT_BYTES,
               workdir: str | Path | None = None) -> tuple[str, int | None]:
    """(output, exit status; None past timeout) of a sandboxed argv, stdout and stderr together.

    The output goes to a temporary file, not to memory, and only its first ``max_bytes`` are read:
    a command that prints gigabytes costs the harness what a megabyte does (the sandbox's file-size
    limit ends it at ``DEFAULT_FILE_BYTES``), and neither the observation nor the saved trajectory
    carries more. Stdin is empty. The command runs through ``launch`` (its own cgroups, never as host
    root); with ``workdir`` (the writable folder) it is killed once that folder grows past
    ``WORK_BYTES`` or ``WORK_FILES`` (a note says so in the output), and it is not run at all while
    the folder is already past them, or holds a folder this process cannot list (exit status
    ``REFUSED``, the output says why)."""
    if workdir is not None and (over := _over(workdir)):
        return (f"[not run: {over}; no further command runs in this folder]\n", REFUSED)
    with tempfile.TemporaryFile() as out, launch(argv) as full:
        proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        code, over = _wait_watching(proc, timeout, workdir)
        size = out.tell()
        out.seek(0)
        text = out.read(max_bytes).decode("utf-8", errors="replace")
    if size > max_bytes:
        text += f"\n[output cut: {size - max_bytes} more bytes of {size} not shown]\n"
    if over:  # (killed by the watch, or past the bounds by its end, before the next poll)
        text += f"\n[killed: {over}]\n" if code == -signal.SIGKILL else f"\n[{over}: no further command runs]\n"
    return text, code


def _wait_watching(proc: subprocess.Popen, timeout: float, workdir: str | Path | None) -> tuple[int | None, str]:
    """(exit status or None past timeout, why it was killed for its folder or ""), killing proc (bubblewrap:
    its pid namespace goes with it) on timeout or when workdir grew past its bounds. The bounds are fixed
    (``WORK_BYTES``, ``WORK_FILES``): a folder's own size never raises them."""
    deadline = time.monotonic() + timeout
    over = ""
    while True:
        try:
            code = proc.wait(min(WATCH_INTERVAL_S, max(0.0, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            pass
        if workdir is not None:
            over = _over(workdir)
        if over or time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            code = None if not over else -signal.SIGKILL
            break
    if workdir is not None and not over:
        over = _over(workdir)
    return code, over


def _over(workdir: str | Path) -> str:
    """Why the folder is past its bounds (``WORK_BYTES``, ``WORK_FILES``), or "". A folder inside it that
    this process cannot list (the sandbox user's ``chmod 300``, where the caller is that user) counts
    as past them: what it holds cannot be counted."""
    used, entries, hidden = _usage(workdir, WORK_FILES + 1)
    if hidden:
        return f"the work folder holds a folder that cannot be listed ({hidden}), so its size cannot be checked"
    if used > WORK_BYTES or entries > WORK_FILES:
        return (f"the work folder grew past {WORK_BYTES} bytes or {WORK_FILES} entries "
                f"(it holds {used} bytes in {entries} entries)")
    return ""


def folder_usage(folder: str | Path, max_entries: int) -> tuple[int, int]:
    """(bytes allocated, entries) under folder, following no symlink; the walk stops after max_entries.
    A folder that cannot be listed counts as ``max_entries + 1`` entries (see ``_usage``)."""
    used, entries, hidden = _usage(folder, max_entries)
    return used, max(entries, max_entries + 1) if hidden else entries


def _usage(folder: str | Path, max_entries: int) -> tuple[int, int, str]:
    """(bytes allocated, entries, the first folder that could not be listed or "") under folder.

    Each folder is opened from its parent's descriptor, following no symlink (as ``settle`` walks): by
    path, a command swapped a folder for a symlink mid-walk and the walk, run as root, reported a host
    folder's size to it. A folder swapped so counts as gone (the symlink itself is an entry)."""
    used, entries, hidden = 0, 0, ""
    stack = [(_Anchor(None), str(folder), ".")]
    while stack and entries <= max_entries:
        anchor, name, rel = stack.pop()
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=anchor.fd)
        except (FileNotFoundError, NotADirectoryError):  # gone meanwhile
            continue
        except OSError as exc:
            hidden = hidden or ("" if exc.errno == errno.ELOOP else rel)  # (ELOOP: now a symlink)
            continue
        finally:
            anchor.release()
        below = _Anchor(fd)  # held by this scan, and by each subfolder waiting
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    entries += 1
                    try:
                        used += entry.stat(follow_symlinks=False).st_blocks * 512
                        if entry.is_dir(follow_symlinks=False):
                            below.waiting += 1
                            stack.append((below, entry.name, os.path.join(rel, entry.name)))
                    except OSError:  # gone meanwhile
                        continue
                    if entries > max_entries:
                        break
        except OSError:
            hidden = hidden or rel
        below.release()
    for anchor, _, _ in stack:  # (stopped at max_entries)
        anchor.release()
    return used, entries, hidden


# -- never host root: the unprivileged host user, its staged folders -----------------------------------
_STAGE = ('while [ "$1" != -- ]; do mount -n --bind "$1" "$2" || { echo "sandbox: cannot stage $1" >&2; '
          'exit 125; }; shift 2; done; shift; exec "$@"')
_UNSTAGED = ("/usr", "/proc/sys")  # bound as they are: readable by every user
# bubblewrap's options as bwrap_prefix, argv and the harness use them: name -> how many arguments follow
_BWRAP_ARITY = {"--bind": 2, "--ro-bind": 2, "--ro-bind-try": 2, "--symlink": 2, "--setenv": 2, "--uid": 1,
                "--gid": 1, "--proc": 1, "--dev": 1, "--size": 1, "--tmpfs": 1, "--remount-ro": 1, "--chdir": 1,
                "--unshare-all": 0, "--unshare-user": 0, "--disable-userns": 0, "--die-with-parent": 0,
                "--new-session": 0, "--clearenv": 0, "--seccomp": 1}


def host_ids() -> tuple[int, int] | None:
    """(uid, gid) bubblewrap runs as on the host when this process is root, else None (it then runs as
    this process's user, never root). ``LIGHTNING_SANDBOX_UID=UID[:GID]`` picks them (default 65534)."""
    if os.geteuid() != 0:
        return None
    raw = os.environ.get("LIGHTNING_SANDBOX_UID", "").strip()
    try:
        uid, _, gid = raw.partition(":") if raw else (str(HOST_UID), "", str(HOST_UID))
        ids = int(uid), int(gid or uid)
    except ValueError:
        raise SandboxUnavailable(f"LIGHTNING_SANDBOX_UID={raw!r} is not UID or UID:GID") from None
    if 0 in ids:
        raise SandboxUnavailable("LIGHTNING_SANDBOX_UID must name an unprivileged uid and gid, not 0")
    return ids


def _binds(argv: list[str]) -> list[tuple[int, str]]:
    """(index of the source, option) of each bind of bubblewrap's own options in argv."""
    return _bwrap_options(argv)[0]


def _bwrap_options(argv: list[str]) -> tuple[list[tuple[int, str]], int]:
    """(``_binds``, the index of the command's first word) of a sandbox argv: bubblewrap's options end at
    ``--`` (``argv``) or at the first word that is not one (the harness's argv)."""
    start = next(i for i, a in enumerate(argv) if Path(a).name == "bwrap") + 1
    found, i = [], start
    while i < len(argv) and argv[i] != "--" and argv[i].startswith("-"):
        if argv[i] not in _BWRAP_ARITY:
            raise ValueError(f"sandbox: bubblewrap option {argv[i]!r} is not known to the launcher (_BWRAP_ARITY)")
        if argv[i] in ("--bind", "--ro-bind"):
            found.append((i + 1, argv[i]))
        i += 1 + _BWRAP_ARITY[argv[i]]
    return found, i + 1 if i < len(argv) and argv[i] == "--" else i


def with_process_cap(argv: list[str]) -> list[str]:
    """The sandbox argv with ``prlimit --nproc=SANDBOX_PROCESSES`` run inside bubblewrap, just before the
    command (unchanged if it is there already).

    Why inside: a cgroup (``confined``) is the other bound on a command tree's processes, and where none
    is writable (a harness run ``--run-as`` a user, a cgroup-v2 host whose leaf group delegates nothing)
    one command forked 1,200 processes and could have forked until the host failed. Since Linux 5.14
    the kernel counts ``RLIMIT_NPROC`` per user namespace, so set in the sandbox's own namespace it
    bounds this sandbox alone; set on bubblewrap (outside that namespace) it would count every sandbox
    of the host uid together, and concurrent rollouts would starve each other. Older kernels count it
    per host uid wherever it is set (``check`` warns)."""
    _, at = _bwrap_options(argv)
    if at >= len(argv):
        raise ValueError("sandbox: the argv names no command after bubblewrap's options")
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]  # (never raised: the command could not start)
    limit = SANDBOX_PROCESSES if hard == resource.RLIM_INFINITY else min(SANDBOX_PROCESSES, hard)
    cap = [_inside_tool("prlimit"), f"--nproc={limit}", "--"]
    if argv[at:at + len(cap)] == cap:
        return list(argv)
    return [*argv[:at], *cap, *argv[at:]]


def _inside_tool(name: str) -> str:
    """The path of a host tool as the sandbox sees it: only ``/usr`` (with ``/bin`` a link into it) is bound."""
    path = str(Path(_tool(name)).resolve())
    if not path.startswith("/usr/"):
        raise SandboxUnavailable(f"{name} is at {path}, outside /usr: the sandbox cannot run it")
    return path


@contextlib.contextmanager
def launch(argv: list[str]):
    """The full argument list that runs a sandbox argv (``env -i ... bwrap ...``): in fresh cgroups
    (``confined``), its command under the per-sandbox process cap (``with_process_cap``: every sandboxed
    command goes through here) and, when this process is root, as the unprivileged ``host_ids`` user. Its folders
    are then bound, as root, in a private mount namespace (``unshare``) at a staging folder that user
    can reach, and bubblewrap binds them from there. Before and after the command, each writable
    folder it binds is ``settle``d (given to that user; no setuid/setgid bit)."""
    ids = host_ids()
    argv = with_process_cap(argv)
    writable = [argv[i] for i, opt in _binds(argv) if opt == "--bind"]
    stage, pairs, staged = None, [], list(argv)
    try:
        for folder in writable:
            settle(folder, ids)
        if ids is not None:
            stage = Path(tempfile.mkdtemp(prefix="lightning-stage-"))
            os.chmod(stage, 0o711)  # (traversed, never listed; the mounts live only in the private namespace)
            for i, _ in _binds(argv):
                if argv[i] not in _UNSTAGED:
                    point = stage / str(len(pairs) // 2)
                    point.mkdir()
                    pairs += [argv[i], str(point)]
                    staged[i] = str(point)
        with confined() as join, seccomp(staged) as (opener, staged):
            join = opener + join
            if ids is None:
                yield join + staged
            else:
                yield [*join, _tool("unshare"), "--mount", "--propagation", "private", "--", _tool("sh"), "-c",
                       _STAGE, "sandbox-stage", *pairs, "--", _tool("setpriv"), f"--reuid={ids[0]}",
                       f"--regid={ids[1]}", "--clear-groups", "--", *staged]
    finally:
        for folder in writable:
            settle(folder, ids)
        if stage is not None:
            for point in pairs[1::2]:
                with contextlib.suppress(OSError):
                    os.rmdir(point)  # (never a recursive removal: a live mount would take its folder)
            with contextlib.suppress(OSError):
                stage.rmdir()


# -- seccomp: no disk blocks past a file's end, no inotify ---------------------------------------------
FALLOC_FL_KEEP_SIZE = 0x01
X32_SYSCALL_BIT = 0x40000000
# machine -> each system-call ABI a process there can use: (AUDIT_ARCH_*, fallocate's number, the
# numbers of inotify_init and inotify_init1 in it, the numbers of add_key, request_key and keyctl)
ABIS = {"x86_64": ((0xC000003E, 285, (253, 294), (248, 249, 250)), (0x40000003, 324, (291, 332), (286, 287, 288))),
        "aarch64": ((0xC00000B7, 47, (26,), (217, 218, 219)), (0x40000028, 352, (316, 360), (309, 310, 311)))}
IO_URING = (425, 426, 427)  # io_uring_setup, _enter, _register: the same numbers in every ABI above
SECCOMP_FD = 3  # the descriptor bubblewrap reads the filter from (--seccomp)
_OPEN_FILTER = f'exec {SECCOMP_FD}< "$0" || exit 125; exec "$@"'


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """A classic BPF seccomp program refusing ``fallocate`` with ``FALLOC_FL_KEEP_SIZE`` (EOPNOTSUPP),
    a new inotify instance (EMFILE, as when the per-user limit is reached), io_uring, the kernel's
    keyrings and x32 system calls (ENOSYS, as a kernel without them), allowing all else; None on a
    machine not in ``ABIS``.

    Why: the file-size limit (``--fsize``) bounds a file's size, and a kept-size ``fallocate`` reserves
    disk blocks past the end without changing the size: ``fallocate --keep-size -l 1G f`` held 1 GiB of
    the host disk at once (any size asked), before the work folder's next poll (``WORK_BYTES``); an
    io_uring request (``IORING_OP_FALLOCATE``) did the same past this filter, which sees only system
    calls. inotify instances are counted per host user (``fs.inotify.max_user_instances``, 128 here),
    and every rollout's commands run as the same one: a command holding them all left none to the
    others. A keyring the launcher has (a login's or a service's session keyring) was the sandbox's:
    a command read the launcher's keys and left keys the next rollout's commands read."""
    abis = ABIS.get(machine or os.uname().machine)
    if abis is None:
        return None
    load, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | errno.EOPNOTSUPP  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    program = _bpf(load, 4)  # seccomp_data.arch
    for arch, fallocate, inotify, keys in abis:
        block = b""
        if arch == 0xC000003E:  # x86_64: its x32 calls carry the same arch and another number
            block += _bpf(load, 0) + _bpf(jset, X32_SYSCALL_BIT, 0, 1) + _bpf(ret, 0x00050000 | errno.ENOSYS)
        block += _bpf(load, 0)  # nr
        for number in inotify:
            block += _bpf(jeq, number, 0, 1) + _bpf(ret, 0x00050000 | errno.EMFILE)
        for number in (*keys, *IO_URING):
            block += _bpf(jeq, number, 0, 1) + _bpf(ret, 0x00050000 | errno.ENOSYS)
        block += (_bpf(jeq, fallocate, 0, 3) + _bpf(load, 24)  # args[1] (mode), low half
                  + _bpf(jset, FALLOC_FL_KEEP_SIZE, 0, 1) + _bpf(ret, refuse) + _bpf(ret, allow))
        program += _bpf(jeq, arch, 0, len(block) // 8) + block
    return program + _bpf(ret, allow)


@contextlib.contextmanager
def seccomp(argv: list[str]):
    """(prefix, argv with ``--seccomp``): the prefix opens a file holding ``seccomp_filter`` at
    ``SECCOMP_FD`` (as this process's user, before any drop) and bubblewrap loads it for the command.
    Unchanged (empty prefix) where no filter is known for the machine."""
    program = seccomp_filter()
    if program is None:
        yield [], argv
        return
    fd, path = tempfile.mkstemp(prefix="lightning-seccomp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(program)
        at = next(i for i, a in enumerate(argv) if Path(a).name == "bwrap") + 1
        yield ([_tool("sh"), "-c", _OPEN_FILTER, path],
               [*argv[:at], "--seccomp", str(SECCOMP_FD), *argv[at:]])
    finally:
        os.unlink(path)


def settle(folder: str | Path, ids: tuple[int, int] | None = None) -> int:
    """Give everything under folder (itself included, following no symlink) to ``ids`` (uid, gid) when
    given, and clear every setuid/setgid bit there; returns how many entries changed. Run on the
    writable folder before and after each command (``launch``) and by the scorer, as root.

    Each entry is reached by its own name from its folder's open descriptor (``_Anchor``), never by a
    path of several names: a command can nest folders past the kernel's 4,096-byte path bound (a walk by
    full paths then failed there, ENAMETOOLONG, leaving a ``chmod 4755`` file kept), and a folder on a
    longer path swapped for a symlink mid-walk would lead the walk out of the folder onto the host. The
    walk holds one descriptor per folder level it is below. Modes and owners change through a
    descriptor, never by name (``_settle_one``)."""
    changed, stack = 0, [(_Anchor(None), str(folder))]
    while stack:
        anchor, rel = stack.pop()
        try:
            st = os.lstat(rel, dir_fd=anchor.fd)
            changed += _settle_one(anchor.fd, rel, st, ids)
            if stat.S_ISDIR(st.st_mode):
                stack.extend(_children(anchor, rel))
        except OSError:  # gone meanwhile
            pass
        finally:
            anchor.release()
    return changed


class _Anchor:
    """An open folder (``fd``; None: the current folder) that entries waiting in ``settle`` are reached
    from; closed once the last of them is done."""

    def __init__(self, fd: int | None, waiting: int = 1) -> None:
        self.fd, self.waiting = fd, waiting

    def release(self) -> None:
        self.waiting -= 1
        if self.waiting <= 0 and self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _children(anchor: _Anchor, rel: str) -> list[tuple[_Anchor, str]]:
    """(anchor, name) of each entry of the folder ``rel`` (opened without following a symlink), the
    folder's own descriptor their anchor."""
    fd = os.open(rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=anchor.fd)
    try:
        names = os.listdir(fd)
    except BaseException:
        os.close(fd)
        raise
    below = _Anchor(fd, len(names))
    if not names:
        below.release()
    return [(below, name) for name in names]


_SETID = stat.S_ISUID | stat.S_ISGID


def _settle_one(dir_fd: int | None, rel: str, st: os.stat_result, ids: tuple[int, int] | None) -> int:
    """Chown (when ids) and clear the setuid/setgid bits of one entry (``st``: what lstat saw); how many of
    the two changed.

    A regular file or folder is opened (``O_PATH | O_NOFOLLOW``) and changed through that descriptor, as
    what ``fstat`` says it now is: by name, ``chmod`` follows a symlink, and a command that swapped a
    ``chmod 4777`` file for a link to a host file between the lstat and the chmod had root make that host
    file 0777. A symlink (or what became one) is never chmodded; any other entry only gets its own owner."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        if ids is None or (st.st_uid, st.st_gid) == ids:
            return 0
        os.chown(rel, *ids, dir_fd=dir_fd, follow_symlinks=False)
        return 1
    fd = os.open(rel, os.O_PATH | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)  # (O_NOFOLLOW with O_PATH: a symlink there now is opened itself, never its target)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not (stat.S_ISREG(now.st_mode)
                                                                       or stat.S_ISDIR(now.st_mode)):
            return 0  # swapped since the lstat: left to the next settle (launch runs one after the command)
        path, changed = f"/proc/self/fd/{fd}", 0  # (an O_PATH descriptor takes no fchmod: its /proc link does)
        if ids is not None and (now.st_uid, now.st_gid) != ids:
            os.chown(path, *ids)
            changed += 1
        if now.st_mode & _SETID:
            os.chmod(path, stat.S_IMODE(now.st_mode) & ~_SETID)
            changed += 1
        return changed
    finally:
        os.close(fd)


# -- cgroups: the whole command tree's processes and memory -------------------------------------------
_JOIN = ('for f; do [ "$f" = -- ] && break; echo $$ > "$f" || { echo "sandbox: cannot join the cgroup $f" >&2; '
         'exit 125; }; shift; done; shift; exec "$@"')
_serial = itertools.count()


@functools.lru_cache(maxsize=1)
def cgroup_parents() -> tuple[tuple[str, str], ...]:
    """((controller, folder), ...): the cgroups of this process, per controller ("pids", "memory"),
    under which a child may be made (v1 hierarchies, or a v2 group that already delegates the
    controller to its children). Empty where none is writable: the limits are then only rlimits."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            own[name] = path
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        root, mount, fstype, opts = fields[3], fields[4], fields[sep + 1], fields[sep + 3].split(",")
        for ctl in ("pids", "memory"):
            if fstype == "cgroup" and ctl in opts and ctl in own:
                found.append((ctl, _below(mount, root, own[ctl])))
            elif fstype == "cgroup2" and "" in own:
                folder = _below(mount, root, own[""])
                control = Path(folder, "cgroup.subtree_control")
                if control.exists() and ctl in control.read_text().split():
                    found.append((ctl, folder))
    usable = {}
    for ctl, folder in found:
        if ctl not in usable and os.access(folder, os.W_OK):
            usable[ctl] = folder
    return tuple(usable.items())


def _below(mount: str, root: str, path: str) -> str:
    rel = path[len(root):] if path.startswith(root) else path
    return str(Path(mount) / rel.lstrip("/"))


def _limit_files(ctl: str, folder: Path) -> dict[str, int]:
    if ctl == "pids":
        return {"pids.max": DEFAULT_PROCESSES}
    if (folder / "memory.max").exists() or not (folder / "memory.limit_in_bytes").exists():
        return {"memory.max": TOTAL_MEMORY_BYTES, "memory.swap.max": 0}
    return {"memory.limit_in_bytes": TOTAL_MEMORY_BYTES}


def _make_group(ctl: str, parent: str) -> Path | None:
    folder = Path(parent) / f"lightning-sandbox-{os.getpid()}-{next(_serial)}"
    try:
        folder.mkdir()
    except OSError:
        return None
    try:
        for name, value in _limit_files(ctl, folder).items():
            if (folder / name).exists():
                (folder / name).write_text(str(value))
    except OSError:
        _remove_group(folder)
        return None
    return folder


def _remove_group(folder: Path) -> None:
    """Kill whatever is left in folder, then remove it (an emptied cgroup may stay busy a moment)."""
    for _ in range(100):
        if (folder / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (folder / "cgroup.kill").write_text("1")
        with contextlib.suppress(OSError, ValueError):
            for pid in (folder / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


@contextlib.contextmanager
def confined():
    """The argv prefix that moves a command into fresh cgroups (``cgroup_parents``), limited to
    ``DEFAULT_PROCESSES`` tasks and ``TOTAL_MEMORY_BYTES`` together; its processes are killed and the
    groups removed on exit. An empty prefix where no cgroup can be made."""
    groups = [g for g in (_make_group(ctl, parent) for ctl, parent in cgroup_parents()) if g is not None]
    try:
        yield ([_tool("sh"), "-c", _JOIN, "sandbox-join", *(str(g / "cgroup.procs") for g in groups), "--"]
               if groups else [])
    finally:
        for group in groups:
            _remove_group(group)


def check(secrets: tuple[Path, ...] = (Path(__file__).resolve().parent,)) -> None:
    """Raise SandboxUnavailable unless a trivial command runs in the sandbox, and unless ``secrets``
    (this folder: its task files hold every solution and hidden test) lie outside what every sandbox
    sees read-only: a checkout under ``/usr`` (``/usr/src/app`` in many images) or inside the Python
    installation would let the agent read them."""
    seen = ["/usr", *python_roots()]
    for folder in secrets:
        real = Path(folder).resolve()
        if any(real.is_relative_to(root) for root in seen):
            raise SandboxUnavailable(f"{real} lies under {', '.join(seen)}, which every sandbox sees read-only: "
                                     "the agent could read its task files (solutions, hidden tests); move it elsewhere")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = run(["true"], tmp, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"bubblewrap did not run: {exc}") from exc
        if proc.returncode != 0:
            ids = host_ids()
            hint = (f" (run as root, bubblewrap runs as host uid {ids[0]}: the Python installation must be readable "
                    "by it, and bubblewrap 0.8 or later is needed for --disable-userns)") if ids else ""
            raise SandboxUnavailable(f"bubblewrap failed ({proc.returncode}): {proc.stderr.strip()[-400:]}{hint}")
    for warning in limit_warnings():
        log.warning("sandbox: %s", warning)


def limit_warnings(release: str | None = None) -> list[str]:
    """What the sandbox cannot bound on this host (kernel ``release``, default this one's), each with its
    consequence: ``check`` logs them. A command tree's total memory needs a writable memory cgroup
    (rlimits bound one process's address space, not how many processes hold it), and the per-sandbox
    process cap needs a kernel counting ``RLIMIT_NPROC`` per user namespace (``with_process_cap``)."""
    warnings, parents = [], dict(cgroup_parents())
    if "memory" not in parents:
        warnings.append(
            f"no writable memory cgroup: a command tree's total memory is NOT bounded (each process gets "
            f"{DEFAULT_MEMORY_BYTES} bytes of address space, and up to {SANDBOX_PROCESSES} processes may hold "
            "that much each), so one model command can exhaust the host's memory; run the harness where it "
            "can make child cgroups (as root with cgroup v1, or in a v2 group that delegates memory)")
    found = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    if found and (int(found[1]), int(found[2])) < NPROC_PER_NAMESPACE:
        warnings.append(
            f"Linux {found[0]} counts RLIMIT_NPROC per host uid, not per user namespace: the cap of "
            f"{SANDBOX_PROCESSES} processes is shared by every sandbox (and every other process) of the host "
            "user bubblewrap runs as, so concurrent rollouts may be refused forks" +
            ("" if "pids" in parents else ", and no pids cgroup bounds one sandbox alone"))
    return warnings
