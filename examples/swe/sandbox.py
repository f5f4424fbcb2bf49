"""The bubblewrap sandbox the swe example runs model-written code in (the agent's commands and the scorer).

mini-swe-agent's own bubblewrap environment keeps the network and the parent's environment (its
commands could read OPENAI_API_KEY or the proxy credentials, and reach the proxy). This module builds
the argument list that closes both, handed to that environment through its public config fields
(`executable`, `wrapper_args`, `cwd`, `timeout`, `env`): nothing in the package is patched.

What a command in the sandbox gets:
* no network: a network namespace of its own with only a private loopback (`--unshare-all`), so
  neither the capture proxy nor any other host port is reachable;
* no inherited environment: bubblewrap itself is started through `env -i` (its pid 1 inside the
  namespace would otherwise expose the harness's variables in `/proc/1/environ`), and the command
  gets `--clearenv` plus PATH/HOME/LANG only;
* its own pid, ipc, uts and user namespaces, running as uid/gid 65534 (nobody) inside, with no
  capabilities; `/proc` shows only its own processes;
* a read-only view of `/usr` and of the Python installation that runs the tests, an empty private
  `/tmp` of at most `TMP_BYTES`, and exactly one writable folder: the private copy of the task
  (bound by the caller);
* limits: address space (`prlimit --as`), file size (`--fsize`), open files, output kept
  (`run_capped`), and the caller's wall-clock timeout (killing bubblewrap ends everything inside:
  `--die-with-parent`, pid namespace);
* nothing else writable: bubblewrap's own root and `/dev` are memory-backed filesystems of half the
  machine's RAM each, writable by the sandbox user, so they are remounted read-only and `/dev/shm`
  is a bounded tmpfs (without this, a command parked gigabytes in memory past the `/tmp` bound);
* the whole command tree's processes and memory (tmpfs pages included) in a cgroup of its own
  (`confined`) where one is writable: per-process rlimits bound neither a fork bomb nor many
  processes of 1 GiB each, and `RLIMIT_NPROC` is never enforced for host uid 0, which a harness
  run as root maps the sandbox user to;
* the work folder's growth (`run_capped(..., workdir=)`: bytes and entries, polled while the command
  runs): `--fsize` bounds one file, not how many a command writes to the host disk.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SANDBOX_UID = 65534
DEFAULT_MEMORY_BYTES = 1 << 30      # address space per command
DEFAULT_FILE_BYTES = 64 << 20       # largest file a command may write
DEFAULT_OPEN_FILES = 256
TMP_BYTES = 256 << 20           # the private /tmp (memory-backed) holds at most this
MAX_OUTPUT_BYTES = 1 << 20      # of a command's output kept (observation and trajectory)
SHM_BYTES = 64 << 20            # the private /dev/shm (memory-backed) holds at most this
DEFAULT_PROCESSES = 512         # tasks (processes and threads) of one command tree (cgroup pids.max)
TOTAL_MEMORY_BYTES = 2 << 30    # memory of one command tree, its tmpfs pages included (cgroup memory)
WORK_BYTES = 256 << 20          # the work folder may grow to this many bytes during a command ...
WORK_FILES = 20_000             # ... and to this many entries
WATCH_INTERVAL_S = 0.2          # how often run_capped looks at the work folder
# after every mount (the work folder's bind included): bubblewrap's root tmpfs, writable by the
# sandbox user and as large as half the RAM, becomes read-only
SEAL = ["--remount-ro", "/"]
SANDBOX_PATH_TAIL = "/usr/local/bin:/usr/bin:/bin"


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
            "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
            "--proc", "/proc", "--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
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
    with confined() as join:
        return subprocess.run(join + argv(command, workdir, python, memory_bytes, writable, bind_at), input=stdin,
                              capture_output=True, text=True, errors="replace", timeout=timeout, check=False)


def run_capped(argv: list[str], timeout: float, max_bytes: int = MAX_OUTPUT_BYTES,
               workdir: str | Path | None = None) -> tuple[str, int | None]:
    """(output, exit status; None past timeout) of a sandboxed argv, stdout and stderr together.

    The output goes to a temporary file, not to memory, and only its first ``max_bytes`` are read:
    a command that prints gigabytes costs the harness what a megabyte does (the sandbox's file-size
    limit ends it at ``DEFAULT_FILE_BYTES``), and neither the observation nor the saved trajectory
    carries more. Stdin is empty. The command runs in cgroups of its own where possible
    (``confined``); with ``workdir`` (the writable folder) it is killed once that folder grows past
    ``WORK_BYTES`` or ``WORK_FILES`` (a note says so in the output)."""
    with tempfile.TemporaryFile() as out, confined() as join:
        proc = subprocess.Popen(join + argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        code, over = _wait_watching(proc, timeout, workdir)
        size = out.tell()
        out.seek(0)
        text = out.read(max_bytes).decode("utf-8", errors="replace")
    if size > max_bytes:
        text += f"\n[output cut: {size - max_bytes} more bytes of {size} not shown]\n"
    if over:
        text += f"\n[killed: {over}]\n"
    return text, code


def _wait_watching(proc: subprocess.Popen, timeout: float, workdir: str | Path | None) -> tuple[int | None, str]:
    """(exit status or None past timeout, why it was killed for its folder or ""), killing proc (bubblewrap:
    its pid namespace goes with it) on timeout or when workdir grew past its bounds."""
    deadline = time.monotonic() + timeout
    allowed = _allowance(workdir) if workdir is not None else None
    over = ""
    while True:
        try:
            code = proc.wait(min(WATCH_INTERVAL_S, max(0.0, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            pass
        if allowed is not None:
            over = _over(workdir, *allowed)
        if over or time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            code = None if not over else -signal.SIGKILL
            break
    if allowed is not None and not over:
        over = _over(workdir, *allowed)
    return code, over


def _allowance(workdir: str | Path) -> tuple[int, int]:
    """(bytes, entries) the folder may reach: the bounds, or what it already holds when that is more
    (a folder over them may still be cleaned up by the next command)."""
    used, entries = folder_usage(workdir, WORK_FILES + 1)
    return max(WORK_BYTES, used), max(WORK_FILES, entries)


def _over(workdir: str | Path, max_bytes: int, max_entries: int) -> str:
    used, entries = folder_usage(workdir, max_entries + 1)
    if used > max_bytes or entries > max_entries:
        return (f"the work folder grew past {max_bytes} bytes or {max_entries} entries "
                f"(it holds {used} bytes in {entries} entries)")
    return ""


def folder_usage(folder: str | Path, max_entries: int) -> tuple[int, int]:
    """(bytes allocated, entries) under folder, following no symlink; the walk stops after max_entries."""
    used, entries, stack = 0, 0, [str(folder)]
    while stack and entries <= max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        used += entry.stat(follow_symlinks=False).st_blocks * 512
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                    except OSError:  # gone meanwhile
                        continue
                    if entries > max_entries:
                        break
        except OSError:
            continue
    return used, entries


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
            raise SandboxUnavailable(f"bubblewrap failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
