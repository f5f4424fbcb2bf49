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
  `--die-with-parent`, pid namespace).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SANDBOX_UID = 65534
DEFAULT_MEMORY_BYTES = 1 << 30      # address space per command
DEFAULT_FILE_BYTES = 64 << 20       # largest file a command may write
DEFAULT_OPEN_FILES = 256
TMP_BYTES = 256 << 20           # the private /tmp (memory-backed) holds at most this
MAX_OUTPUT_BYTES = 1 << 20      # of a command's output kept (observation and trajectory)
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
            "--proc", "/proc", "--dev", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
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
                                                 "--chdir", inside, "--", *command]


def run(command: list[str], workdir: str | Path, timeout: float, python: str | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES, writable: bool = True, stdin: str | None = None,
        bind_at: str | None = None) -> subprocess.CompletedProcess:
    """Run command in the sandbox (see argv). Raises TimeoutExpired (bubblewrap and all inside are killed)."""
    # (errors="replace": what the model or its module prints need not be UTF-8)
    return subprocess.run(argv(command, workdir, python, memory_bytes, writable, bind_at), input=stdin,
                          capture_output=True, text=True, errors="replace", timeout=timeout, check=False)


def run_capped(argv: list[str], timeout: float, max_bytes: int = MAX_OUTPUT_BYTES) -> tuple[str, int | None]:
    """(output, exit status; None past timeout) of a sandboxed argv, stdout and stderr together.

    The output goes to a temporary file, not to memory, and only its first ``max_bytes`` are read:
    a command that prints gigabytes costs the harness what a megabyte does (the sandbox's file-size
    limit ends it at ``DEFAULT_FILE_BYTES``), and neither the observation nor the saved trajectory
    carries more. Stdin is empty."""
    with tempfile.TemporaryFile() as out:
        try:
            code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = None
        size = out.tell()
        out.seek(0)
        text = out.read(max_bytes).decode("utf-8", errors="replace")
    if size > max_bytes:
        text += f"\n[output cut: {size - max_bytes} more bytes of {size} not shown]\n"
    return text, code


def check() -> None:
    """Raise SandboxUnavailable unless a trivial command runs in the sandbox."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = run(["true"], tmp, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"bubblewrap did not run: {exc}") from exc
        if proc.returncode != 0:
            raise SandboxUnavailable(f"bubblewrap failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
