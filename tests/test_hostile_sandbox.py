"""examples/swe/sandbox.py against a hostile command (an audit's findings, each reproduced for real in
bubblewrap): a harness run as root must never run model-written code as host root (F1: kernel uid 0
could write /proc/sys; F2: it left setuid-root binaries in the traces), no nested user namespace (F4: a
cgroup2 mount in which to kill other rollouts' processes; F5: a tmpfs past the /tmp bound), and the work
folder's bounds hold: no ratchet, no command in a folder over them, no uncounted unlistable folder (F3).

Needs bubblewrap; the host-uid tests need root (the launcher's and the demo's case), the harness test
the swe environment (``$LIGHTNING_SWE_PYTHON``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWE = ROOT / "examples" / "swe"
sys.path.insert(0, str(SWE))
import reward  # noqa: E402
import sandbox  # noqa: E402

SWE_PY = Path(os.environ.get("LIGHTNING_SWE_PYTHON") or ROOT / ".venv-swe" / "bin" / "python")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap missing (scripts/setup_envs.sh swe installs it)")]
NOBODY = 65534  # the default host user of a root-run sandbox (sandbox.HOST_UID)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the harness-as-root case needs root")

# opens host-global kernel files for writing (opening changes nothing), writes vm.swappiness's own value back
PROBE = '''
import os
for p in ["/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/proc/sys/kernel/panic",
          "/proc/sysrq-trigger"]:
    try:
        os.close(os.open(p, os.O_WRONLY))
        print("OPEN-FOR-WRITE", p)
    except OSError as e:
        print("refused", p, e.strerror)
v = open("/proc/sys/vm/swappiness").read()
try:
    with open("/proc/sys/vm/swappiness", "w") as f:
        f.write(v)
    print("WROTE swappiness")
except OSError as e:
    print("refused swappiness", e.strerror)
'''


def sh(command: str, workdir: Path, timeout: float = 60, watch: bool = True) -> tuple[str, int | None]:
    return sandbox.run_capped(sandbox.argv(["bash", "-c", command], workdir), timeout,
                              workdir=workdir if watch else None)


# ---------------------------------------------------------------- F1: never host root

@needs_root
def test_a_root_caller_runs_the_command_as_an_unprivileged_host_user(tmp_path):
    """Run as root, bubblewrap mapped the sandbox user to host uid 0: /proc/sys/kernel/core_pattern (a
    pipe there runs a program as host root), vm/drop_caches and kernel/panic opened for writing and
    vm.swappiness written. Now bubblewrap runs as host uid 65534: every one refused, its files are its."""
    (tmp_path / "probe.py").write_text(PROBE)
    out, code = sh(f"{sandbox.interpreter()} probe.py; touch made", tmp_path)
    assert code == 0, out
    assert "OPEN-FOR-WRITE" not in out and "WROTE" not in out and out.count("refused") == 5, out
    st = os.lstat(tmp_path / "made")
    assert (st.st_uid, st.st_gid) == sandbox.host_ids() == (sandbox.HOST_UID, sandbox.HOST_UID)


@needs_root
def test_the_host_user_is_configurable_and_never_root(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SANDBOX_UID", "65533:65532")
    assert sandbox.host_ids() == (65533, 65532)
    out, code = sh("touch made; stat -c %u:%g made", tmp_path)
    assert code == 0 and os.lstat(tmp_path / "made").st_uid == 65533, out
    for bad in ("0", "0:0", "65534:0", "nobody"):
        monkeypatch.setenv("LIGHTNING_SANDBOX_UID", bad)
        with pytest.raises(sandbox.SandboxUnavailable):
            sandbox.host_ids()


def test_proc_sys_is_read_only_whoever_runs_it(tmp_path):
    out, code = sh("echo 1 > /proc/sys/vm/swappiness; echo rc=$?; grep ' /proc/sys ' /proc/self/mounts", tmp_path)
    assert "rc=1" in out and " ro," in out, out


@needs_root
def test_the_scored_module_is_not_host_root_either(tmp_path):
    """The scorer's serve half imports the agent's module: it opened core_pattern for writing at import.
    This module answers right only if it could."""
    module = ("import os\ntry:\n    os.close(os.open('/proc/sys/kernel/core_pattern', os.O_WRONLY))\n    SIGN = 1\n"
              "except OSError:\n    SIGN = -1\n\n\ndef add(a, b):\n    return a + SIGN * b\n")
    (tmp_path / "demo.py").write_text(module)
    tests = "from demo import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    assert reward.score({"project": "demo", "hidden_tests": tests}, tmp_path, timeout=60)[0] == 0.0


# ---------------------------------------------------------------- F2: no setuid binary left behind

def test_a_setuid_binary_left_in_the_work_folder_gives_nothing(tmp_path):
    """`cp /usr/bin/python3 rootpy; chmod 4755 rootpy` left `-rwsr-xr-x root root` under the traces, which
    any local user could run to become root. Now the file is the unprivileged user's and loses the bit
    when the command ends; the scorer clears such bits too."""
    out, code = sh("cp /usr/bin/python3 rootpy && chmod 4755 rootpy && cp rootpy gidpy && chmod 2755 gidpy "
                   "&& mkdir d && chmod 2775 d && stat -c '%A %n' rootpy gidpy d", tmp_path)
    assert code == 0 and "rws" in out and "r-s" in out, out  # the command set them ...
    for name in ("rootpy", "gidpy", "d"):
        st = os.lstat(tmp_path / name)
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), name  # ... none is left
        if os.geteuid() == 0:
            assert st.st_uid != 0, name
    planted = tmp_path / "planted"
    shutil.copy("/usr/bin/true", planted)
    os.chmod(planted, 0o4755)
    (tmp_path / "demo.py").write_text("def add(a, b):\n    return a + b\n")
    reward.score({"project": "demo", "hidden_tests": "def test_x():\n    pass\n"}, tmp_path, timeout=60)
    assert not os.lstat(planted).st_mode & stat.S_ISUID


NEST = ('for i in $(seq 24); do mkdir {name} && cd {name} || exit 1; done; '
        'cp /usr/bin/true deep && chmod 6755 deep && mkdir sg && chmod 2775 sg && stat -c %A deep')


def _deep(folder: Path, name: str, levels: int = 24) -> int:
    """A descriptor of the folder NEST left ``levels`` deep in folder (past the kernel's path bound)."""
    return reward.open_folder(folder.joinpath(*[name] * levels), owned=levels)


def test_a_setuid_file_nested_past_the_path_bound_loses_its_bit_too(tmp_path):
    """24 folders of 200 characters (a 4.8 KB path, past PATH_MAX): settle walked by full paths, failed
    there with ENAMETOOLONG and left a `chmod 6755` file (and a setgid folder) with its bits under the
    traces, after the command and after the scorer."""
    name = "d" * 200
    out, code = sh(NEST.format(name=name), tmp_path, watch=False)
    assert code == 0 and "rws" in out, out  # the command set them ...
    fd = _deep(tmp_path, name)
    try:
        for entry in ("deep", "sg"):
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), entry  # ... none is left
        os.chmod("deep", 0o4755, dir_fd=fd)  # and the scorer clears one planted afterwards
    finally:
        os.close(fd)
    (tmp_path / "demo.py").write_text("def add(a, b):\n    return a + b\n")
    reward.score({"project": "demo", "hidden_tests": "def test_x():\n    pass\n"}, tmp_path, timeout=60)
    fd = _deep(tmp_path, name)
    try:
        assert not os.stat("deep", dir_fd=fd, follow_symlinks=False).st_mode & stat.S_ISUID
    finally:
        os.close(fd)
    assert sandbox.settle(tmp_path) == 0  # (and nothing is left to change)


# ---------------------------------------------------------------- F4, F5: no nested user namespace

def test_no_nested_user_namespace_so_no_own_tmpfs_past_the_bounds(tmp_path):
    """`unshare -Urm` then a tmpfs of its own: 1.7 GB in memory past the /tmp and /dev/shm bounds."""
    fill = f"for i in $(seq {(sandbox.TMP_BYTES >> 23) + 8}); do head -c 8M /dev/zero > /tmp/b$i || exit 1; done"
    out, _ = sh(f"unshare -Urm sh -c 'mount -t tmpfs none /tmp && {fill} && echo WROTE'; echo rc=$?", tmp_path)
    assert "WROTE" not in out and "rc=0" not in out, out


@needs_root
def test_no_cgroup2_mount_from_which_to_kill_other_rollouts(tmp_path):
    """Service mode: `unshare -Urm --cgroup` + mount cgroup2 reached the launcher's cgroups and killed
    another rollout's processes through cgroup.kill. A stand-in victim in a v2 group of its own lives on."""
    unified = next((p for p in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
                    if Path(p, "cgroup.procs").exists() and Path(p, "cgroup.subtree_control").exists()), None)
    victim_group = Path(unified) / f"lightning-{os.getpid()}-victim" if unified else None
    victim = subprocess.Popen(["sleep", "600"])
    try:
        if victim_group is not None:
            with pytest.MonkeyPatch.context():
                try:
                    victim_group.mkdir()
                    (victim_group / "cgroup.procs").write_text(str(victim.pid))
                except OSError:
                    victim_group = None
        out, _ = sh("unshare -Urm --cgroup sh -c 'mkdir -p /tmp/cg && mount -t cgroup2 none /tmp/cg && echo MOUNTED; "
                    "for d in /tmp/cg/lightning-*; do echo 1 > $d/cgroup.kill && echo killed $d; done'", tmp_path)
        assert "MOUNTED" not in out and "killed" not in out, out
        time.sleep(0.3)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
        if victim_group is not None:
            for _ in range(50):
                try:
                    victim_group.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


# ---------------------------------------------------------------- F3: the work folder's bounds

def test_a_folder_over_its_bounds_runs_no_further_command(tmp_path, monkeypatch):
    """The bound was raised to what the folder already held before each command, so each command could
    add as much again. Now the bound is fixed and a folder past it runs nothing more (the agent is told)."""
    monkeypatch.setattr(sandbox, "WORK_BYTES", 4 << 20)
    (tmp_path / "big").write_bytes(os.urandom(6 << 20))
    out, code = sh("touch ran", tmp_path)
    assert not (tmp_path / "ran").exists(), out
    assert code == sandbox.REFUSED and "not run" in out and "grew past" in out, out


def test_one_file_is_bounded_tighter(tmp_path):
    """60 x `fallocate -l 63M` made 3.7 GB between two polls: a file now stops at DEFAULT_FILE_BYTES."""
    out, _ = sh("fallocate -l 63M f; echo rc=$?; head -c 20M /dev/zero > g; stat -c %s g", tmp_path)
    assert "rc=0" not in out and int(out.split()[-1]) <= sandbox.DEFAULT_FILE_BYTES, out


def test_no_disk_blocks_past_a_files_end(tmp_path):
    """`fallocate --keep-size -l 1G f` reserved 1 GiB of the host disk in one call (any size asked): the file-size limit
    bounds a file's size, which a kept-size allocation leaves at 0, and the folder's poll came after. Now
    the call is refused (a seccomp filter); a plain allocation is still bounded by the file-size limit."""
    out, code = sh("touch kept && fallocate --keep-size -l 512M kept; fallocate -l 1M plain && echo plain-ok; "
                   "python -c \"import ctypes, os; fd = os.open('x32', os.O_CREAT | os.O_WRONLY); "
                   "print('x32', ctypes.CDLL(None).syscall(0x40000000 | 285, fd, 1, ctypes.c_long(0), "
                   "ctypes.c_long(512 << 20)))\"", tmp_path)
    held = sum(f.stat().st_blocks * 512 for f in tmp_path.iterdir())
    assert held < 8 << 20, (held, out)
    assert "plain-ok" in out, out
    if os.uname().machine in sandbox.ABIS:
        assert "unsupported" in out or "not supported" in out, out


@pytest.mark.skipif(os.uname().machine not in sandbox.ABIS, reason="no seccomp filter known for this machine")
def test_no_io_uring_and_no_keyring(tmp_path):
    """An io_uring request reserved 512 MiB past a file's end in one call (``IORING_OP_FALLOCATE``:
    the seccomp filter sees system calls, not the ring's requests), and the launcher's session
    keyring was the sandbox's: a command read its keys and left keys the next rollout read. Both
    are refused as a kernel without them does (ENOSYS)."""
    keyctl = sandbox.ABIS[os.uname().machine][0][3][2]
    out, _ = sh("python -c \"import ctypes, os\n"
                "libc = ctypes.CDLL(None, use_errno=True)\n"
                "params = ctypes.create_string_buffer(120)\n"
                "print('uring', libc.syscall(425, 4, params), ctypes.get_errno())\n"
                f"print('keyctl', libc.syscall({keyctl}, 0, -3, 0), ctypes.get_errno())\"", tmp_path)
    assert f"uring -1 {errno.ENOSYS}" in out and f"keyctl -1 {errno.ENOSYS}" in out, out


def test_the_folder_watch_follows_no_folder_swapped_for_a_symlink(tmp_path):
    """The watch (run as the harness's user: root) listed a folder, then opened what it found by path:
    a command swapping that folder for a symlink in between had the watch count a host folder the
    sandbox cannot see (its size said to the agent). Swapped as fast as a thread can, 3 s."""
    host, work = tmp_path / "host", tmp_path / "work"
    host.mkdir()
    work.mkdir()
    (host / "blob").write_bytes(b"\1" * (32 << 20))
    (work / "real").mkdir()
    (work / "link").symlink_to(host)
    stop = time.monotonic() + 3

    def swap() -> None:
        while time.monotonic() < stop:
            os.rename(work / "real", work / "d")
            os.rename(work / "d", work / "real")
            os.rename(work / "link", work / "d")
            os.rename(work / "d", work / "link")

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen = []
    while swapper.is_alive():
        seen.append(sandbox.folder_usage(work, 1000)[0])
    assert len(seen) > 100 and max(seen) < 1 << 20, (len(seen), max(seen))  # before the fix: 32 MiB seen


def test_no_pseudo_terminal_or_inotify_instance_the_host_counts(tmp_path):
    """A command opened 60 ptys (each counted in the host's kernel.pty.nr, against kernel.pty.max
    4,096 for the whole machine) and 60 inotify instances (counted per host user, 128, shared by every
    rollout's commands): both are now refused, and the command runs on."""
    out, code = sh("python -c \"import ctypes, os\n"
                   "try: os.openpty(); print('pty opened')\n"
                   "except OSError as e: print('pty refused', e.errno)\n"
                   "libc = ctypes.CDLL(None, use_errno=True)\n"
                   "print('inotify', libc.inotify_init(), libc.inotify_init1(0), ctypes.get_errno())\"; echo on",
                   tmp_path)
    assert "pty refused" in out and out.rstrip().endswith("on"), out
    if os.uname().machine in sandbox.ABIS:
        assert f"inotify -1 -1 {errno.EMFILE}" in out, out


@needs_root
def test_a_folder_the_harness_cannot_list_counts_as_over_its_bounds():
    """A harness run as the sandbox's own user (``--run-as``) could not list a `chmod 300` folder the
    command made, and skipped it: 3 GB went uncounted. Now such a folder counts as past the bounds."""
    base = Path(tempfile.mkdtemp(prefix="lh-sbx-"))
    try:
        os.chmod(base, 0o711)
        work = base / "w"
        (work / "h").mkdir(parents=True)
        (work / "h" / "f").write_bytes(b"x" * 4096)
        for path in (work, work / "h", work / "h" / "f"):
            os.chown(path, NOBODY, NOBODY)
        os.chmod(work / "h", 0o300)
        lib = base / "lib"  # the module where that user can read it (a checkout may sit in a private folder)
        lib.mkdir(mode=0o755)
        shutil.copy(SWE / "sandbox.py", lib / "sandbox.py")
        code = (f"import sys; sys.path.insert(0, {str(lib)!r}); import sandbox; "
                f"print(sandbox.folder_usage({str(work)!r}, 100)[1]); print(repr(sandbox._over({str(work)!r})))")
        proc = subprocess.run(["/usr/bin/python3", "-I", "-B", "-c", code], user=NOBODY,
                              group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=60,
                              cwd="/")
        assert proc.stdout.split("\n")[0].strip() not in ("0", "1"), proc.stdout  # (h uncounted: 1 entry)
        assert proc.returncode == 0, proc.stderr
        entries, over = proc.stdout.splitlines()
        assert int(entries) > 100 and "cannot be listed" in over, proc.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- through the harness's own path

DRIVE = ROOT / "tests" / "support" / "swe_drive.py"  # the harness's own command path


@needs_root
@pytest.mark.skipif(not SWE_PY.exists(), reason=f"swe environment not found at {SWE_PY}")
def test_the_harness_commands_are_unprivileged_and_bounded(tmp_path):
    """mini-swe-agent's commands through the harness (CancellableEnvironment.execute, as the audit drove
    them): root-written task files editable, sysctls refused, no setuid file kept, no nested namespace,
    and once a command overfills the folder the next is not run and the observation says why."""
    work = tmp_path / "repo"
    work.mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    shutil.copy(tmp_path / "probe.py", work / "probe.py")
    (work / "demo.py").write_text("x = 1\n")
    commands = ["echo 'y = 2' >> demo.py && python probe.py && cp /usr/bin/python3 rootpy && chmod 4755 rootpy; "
                "unshare -Ur true; echo unshare=$?",
                "for i in $(seq 24); do fallocate -l 15M big$i || break; done; echo done",
                "echo still-running"]
    proc = subprocess.run([str(SWE_PY), "-B", str(DRIVE), str(SWE), str(work), str(tmp_path / "cfg")],
                          input=json.dumps(commands), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second, third = (json.loads(line) for line in proc.stdout.splitlines()[-3:])
    assert (work / "demo.py").read_text() == "x = 1\ny = 2\n"
    assert "OPEN-FOR-WRITE" not in first["output"] and "WROTE" not in first["output"], first
    assert "unshare=0" not in first["output"], first
    st = os.lstat(work / "rootpy")
    assert st.st_uid != 0 and not st.st_mode & stat.S_ISUID
    assert "work folder grew past" in second["output"] or second["returncode"] == 0, second
    if "work folder grew past" not in second["output"]:  # (a slow disk: the next command sees it)
        assert sum(f.stat().st_blocks * 512 for f in work.iterdir()) > sandbox.WORK_BYTES
    assert "still-running" not in third["output"] and "not run" in third["output"], third
    assert third["returncode"] == sandbox.REFUSED
