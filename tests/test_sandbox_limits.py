"""examples/swe/sandbox.py where no cgroup can be made (a review's findings, reproduced in real bubblewrap).

R1: the only bound on a command tree's processes was the cgroup ``confined`` makes; a harness run
``--run-as`` a user, or on a cgroup-v2 host whose leaf group delegates nothing, has none, and one model
command kept 1,205 processes alive. Each sandbox's command now runs under ``RLIMIT_NPROC`` set inside
its own user namespace (``with_process_cap``); its memory cannot be bounded there, and ``check`` says so.

R3: ``settle`` (run as root by the scorer and by ``launch``) checked an entry with lstat and then
chmodded it by name, following a symlink swapped in between: root made a host file 0777. It now
changes an entry only through a descriptor that cannot be a link's target.

Cgroups are made unavailable in-process (``cgroup_parents`` returns nothing, as it does for an
unprivileged harness); the harness-path test patches the same function in the harness's process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWE = ROOT / "examples" / "swe"
sys.path.insert(0, str(SWE))
import sandbox  # noqa: E402

SWE_PY = Path(os.environ.get("LIGHTNING_SWE_PYTHON") or ROOT / ".venv-swe" / "bin" / "python")
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap missing (scripts/setup_envs.sh swe installs it)")
pytestmark = pytest.mark.timeout(300)

# starts 1,200 sleeps (each marked by its argument), then reports how many started and how many
# processes the sandbox's /proc shows alive; the sleeps are left running for the sandbox's end to reap
FLOOD = '''
import os, subprocess, sys
started = refused = 0
for _ in range(1200):
    try:
        subprocess.Popen(["sleep", sys.argv[1]])
        started += 1
    except OSError:
        refused += 1
alive = sum(name.isdigit() for name in os.listdir("/proc"))
print(f"started={started} refused={refused} alive={alive}", flush=True)
'''


@pytest.fixture
def no_cgroups(monkeypatch):
    """The sandbox as an unprivileged harness (or a pure cgroup-v2 leaf) gets it: no cgroup to make."""
    monkeypatch.setattr(sandbox, "cgroup_parents", lambda: ())


def _left(marker: str) -> str:
    """The pids of host processes still running ``sleep marker``, after waiting up to 10 s for them to go."""
    deadline, left = time.monotonic() + 10, "?"
    while left and time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-x", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout.strip()
        time.sleep(0.2)
    return left


def _harness_shaped(workdir: Path, command: str) -> list[str]:
    """The argv harness.CancellableEnvironment.execute builds: the wrapper arguments, the folder's bind, the
    seal, then ``bash -c command`` with no ``--`` between bubblewrap's options and the command."""
    config = sandbox.environment_config(workdir, 20)
    wd = config["cwd"]
    return [config["executable"], *config["wrapper_args"], "--bind", wd, wd, "--chdir", wd, *sandbox.SEAL,
            "bash", "-c", command]


def _flood_counts(text: str) -> dict[str, int]:
    line = next(line for line in text.splitlines() if line.startswith("started="))
    return {key: int(value) for key, value in (part.split("=") for part in line.split())}


@needs_bwrap
@pytest.mark.parametrize("shape", ["argv", "harness"])
def test_a_fork_flood_is_stopped_without_any_cgroup(tmp_path, no_cgroups, shape):
    """1,200 sleeps, no cgroup: at most SANDBOX_PROCESSES start, the rest are refused, and none outlives the
    command (before: all 1,200 ran, 1,205 processes alive in one sandbox)."""
    marker = f"4{os.getpid() % 1000}.{'12' if shape == 'argv' else '34'}"
    (tmp_path / "flood.py").write_text(FLOOD)
    if shape == "argv":
        argv = sandbox.argv([sandbox.interpreter(), "flood.py", marker], tmp_path)
    else:
        argv = _harness_shaped(tmp_path, f"python flood.py {marker}")
    text, code = sandbox.run_capped(argv, 60, workdir=tmp_path)
    counts = _flood_counts(text)
    assert counts["alive"] <= sandbox.SANDBOX_PROCESSES and counts["started"] < sandbox.SANDBOX_PROCESSES, text
    assert counts["refused"] >= 1200 - sandbox.SANDBOX_PROCESSES, text
    assert code == 0, text
    assert _left(marker) == ""


@needs_bwrap
def test_ordinary_commands_run_under_the_cap_without_any_cgroup(tmp_path, no_cgroups):
    """A one-liner and a make -j-like fan-out of 20 processes still run."""
    text, code = sandbox.run_capped(sandbox.argv([sandbox.interpreter(), "-c", "print(1)"], tmp_path), 60)
    assert (text, code) == ("1\n", 0)
    fan_out = "for i in $(seq 20); do (sleep 0.3; echo job$i) & done; wait; echo all-done"
    text, code = sandbox.run_capped(_harness_shaped(tmp_path, fan_out), 60, workdir=tmp_path)
    assert code == 0 and text.count("job") == 20 and text.endswith("all-done\n"), text


@needs_bwrap
def test_the_cap_is_set_inside_the_sandbox_not_on_bubblewrap(tmp_path):
    """RLIMIT_NPROC on bubblewrap would count every sandbox of the host uid together; inside, its user
    namespace's own count is what it bounds. The limit the command sees is the cap; bubblewrap's is not."""
    with sandbox.launch(sandbox.argv(["true"], tmp_path)) as full:
        bwrap = next(i for i, a in enumerate(full) if Path(a).name == "bwrap")
        assert not any(a.startswith("--nproc") for a in full[:bwrap])
        assert f"--nproc={sandbox.SANDBOX_PROCESSES}" in full[bwrap:]
    text, code = sandbox.run_capped(sandbox.argv(["bash", "-c", "ulimit -u; ulimit -Hu"], tmp_path), 60)
    assert (text, code) == (f"{sandbox.SANDBOX_PROCESSES}\n{sandbox.SANDBOX_PROCESSES}\n", 0)


DRIVE = ROOT / "tests" / "support" / "swe_drive.py"  # the harness's own command path


@needs_bwrap
@pytest.mark.skipif(not SWE_PY.exists(), reason=f"swe environment not found at {SWE_PY}")
def test_the_harness_commands_are_capped_without_any_cgroup(tmp_path):
    """mini-swe-agent's command through the harness's own execute, no cgroup: the flood is stopped and the
    next command runs."""
    work = tmp_path / "repo"
    work.mkdir()
    (work / "flood.py").write_text(FLOOD)
    marker = f"5{os.getpid() % 1000}.56"
    proc = subprocess.run([str(SWE_PY), "-B", str(DRIVE), str(SWE), str(work), str(tmp_path / "cfg"), "--no-cgroup"],
                          input=json.dumps([f"python flood.py {marker}", "echo next-ran"]), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    flood, after = (json.loads(line) for line in proc.stdout.splitlines()[-2:])
    assert _flood_counts(flood["output"])["alive"] <= sandbox.SANDBOX_PROCESSES, flood
    assert after["output"] == "next-ran\n", after
    assert _left(marker) == ""


@needs_bwrap
def test_check_warns_loudly_when_memory_is_not_bounded(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "cgroup_parents", lambda: (("pids", "/nonexistent"),))
    with caplog.at_level(logging.WARNING, logger="lightning.swe.sandbox"):
        sandbox.check()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("memory" in m and "NOT bounded" in m and "exhaust the host" in m for m in warned), warned


def test_the_warnings_name_what_this_host_cannot_bound(monkeypatch):
    monkeypatch.setattr(sandbox, "cgroup_parents", lambda: (("memory", "/m"), ("pids", "/p")))
    assert sandbox.limit_warnings("6.1.0-13-amd64") == []
    assert sandbox.limit_warnings("5.14.0") == []
    (old,) = sandbox.limit_warnings("5.10.0-28-cloud-amd64")
    assert "5.10" in old and "per host uid" in old and "shared by every sandbox" in old
    monkeypatch.setattr(sandbox, "cgroup_parents", lambda: ())
    memory, old = sandbox.limit_warnings("4.19.0")
    assert "memory" in memory and "no pids cgroup" in old


# ---------------------------------------------------------------- R3: settle follows no symlink

def _swap_on_lstat(monkeypatch, name: str, swap) -> list[str]:
    """os.lstat, patched: around the lstat of an entry called ``name`` (once), ``swap()`` runs (before the
    lstat when it returns "before", else after): the race a command running meanwhile can win."""
    real, done = os.lstat, []

    def lstat(path, *args, **kwargs):
        if os.path.basename(os.fsdecode(path)) != name or done:
            return real(path, *args, **kwargs)
        done.append(name)
        if swap.when == "before":
            swap()
            return real(path, *args, **kwargs)
        result = real(path, *args, **kwargs)
        swap()
        return result

    monkeypatch.setattr(os, "lstat", lstat)
    return done


def _ids() -> tuple[int, int] | None:
    return (65534, 65534) if os.geteuid() == 0 else None


def test_settle_never_chmods_the_target_of_a_file_swapped_for_a_symlink(tmp_path, monkeypatch):
    """A `chmod 4777` file, swapped for a link to a host file between settle's lstat and its chmod: the host
    file keeps its 0600 (before: root chmodded it to 0777) and its owner."""
    work, victim = tmp_path / "work", tmp_path / "victim"
    work.mkdir()
    victim.write_text("root-only\n")
    os.chmod(victim, 0o600)
    (work / "x").write_text("")
    os.chmod(work / "x", 0o4777)
    before = os.stat(victim)

    def swap():
        os.unlink(work / "x")
        os.symlink(victim, work / "x")
    swap.when = "after"
    done = _swap_on_lstat(monkeypatch, "x", swap)
    sandbox.settle(work, _ids())
    monkeypatch.undo()
    assert done and (work / "x").is_symlink()
    after = os.stat(victim)
    assert stat.S_IMODE(after.st_mode) == 0o600 and (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)


def test_settle_never_walks_through_a_folder_swapped_for_a_symlink(tmp_path, monkeypatch):
    """work/a/b/x is listed, then `a` becomes a link to a host folder holding b/x (a setuid host binary):
    walked by the path a/b/x, root chowned and chmodded the host's file. Now the walk goes on from b's own
    descriptor: the host file keeps its owner and bits, and the sandbox's x loses its setuid bit."""
    work, host = tmp_path / "work", tmp_path / "host"
    (work / "a" / "b").mkdir(parents=True)
    (host / "b").mkdir(parents=True)
    for folder in (work, host):
        target = folder / ("a/b/x" if folder == work else "b/x")
        target.write_text("")
        os.chmod(target, 0o6755)
    before = os.stat(host / "b" / "x")

    def swap():
        os.rename(work / "a", work / "moved")
        os.symlink(host, work / "a")
    swap.when = "before"
    done = _swap_on_lstat(monkeypatch, "x", swap)
    sandbox.settle(work, _ids())
    monkeypatch.undo()
    assert done
    after = os.stat(host / "b" / "x")
    assert stat.S_IMODE(after.st_mode) == 0o6755 and (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
    assert not os.stat(work / "moved" / "b" / "x").st_mode & (stat.S_ISUID | stat.S_ISGID)


def test_settle_still_clears_setid_bits_and_gives_everything_to_the_user(tmp_path):
    """What settle did before, kept: setuid/setgid bits cleared on files and folders (other bits, world-write
    included, as they were), every entry given to ``ids`` when root, a symlink's target untouched."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    (work / "sub").mkdir(parents=True)
    outside.write_text("")
    os.chmod(outside, 0o4755)
    (work / "f").write_text("")
    os.chmod(work / "f", 0o6777)
    os.chmod(work / "sub", 0o2777)
    (work / "sub" / "g").write_text("")
    os.chmod(work / "sub" / "g", 0o4700)
    (work / "link").symlink_to(outside)
    ids = _ids()
    assert sandbox.settle(work, ids) >= 3
    assert stat.S_IMODE(os.stat(work / "f").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(work / "sub").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(work / "sub" / "g").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o4755 and os.stat(outside).st_uid == os.geteuid()
    if ids is not None:
        for entry in (work, work / "f", work / "sub", work / "sub" / "g", work / "link"):
            assert (os.lstat(entry).st_uid, os.lstat(entry).st_gid) == ids, entry
    assert sandbox.settle(work, ids) == 0
