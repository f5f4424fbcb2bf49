"""Hostile model output against the examples: the swe sandbox's memory, process and disk bounds, and
the calculator agent fed model text or endpoint replies that used to crash it.

The swe tests need bubblewrap and skip without it; the cgroup ones also skip where this process
cannot make a cgroup (there the sandbox has only its rlimits)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "swe"))
import sandbox  # noqa: E402

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap missing (scripts/setup_envs.sh swe installs it)")


def needs_cgroups():
    if not sandbox.cgroup_parents():
        pytest.skip("no writable cgroup here: the sandbox's total limits are not available")


def sh(command: str, workdir: Path, timeout: float = 30, watch: bool = False) -> tuple[str, int | None]:
    return sandbox.run_capped(sandbox.argv(["bash", "-c", command], workdir), timeout,
                              workdir=workdir if watch else None)


# ---------------------------------------------------------------- swe sandbox

@needs_bwrap
def test_sandbox_root_and_dev_are_not_writable_memory(tmp_path):
    """bubblewrap's root and /dev are tmpfs of half the RAM, writable by the sandbox user: 1 GiB parked
    there in one command before (past the 256 MiB /tmp bound); now read-only, /dev/shm bounded."""
    probe = ("for d in / /dev; do head -c 8M /dev/zero > $d/f 2>/dev/null; echo \"$d rc=$?\"; done; "
             f"head -c {2 * sandbox.SHM_BYTES} /dev/zero > /dev/shm/f 2>/dev/null; "
             "echo shm=$(df -B1 --output=size /dev/shm | tail -1); echo x > /dev/null && echo null-ok")
    out, code = sh(probe, tmp_path)
    assert code == 0, out
    assert "/ rc=1" in out and "/dev rc=1" in out, out
    assert int(out.split("shm=")[1].split()[0]) == sandbox.SHM_BYTES, out
    assert "null-ok" in out


@needs_bwrap
def test_sandbox_limits_the_processes_of_a_command(tmp_path, monkeypatch):
    """No process limit before (1,500 sleeps started in one command; a fork bomb takes the host's pid
    space, and RLIMIT_NPROC is not enforced for host uid 0)."""
    needs_cgroups()
    monkeypatch.setattr(sandbox, "DEFAULT_PROCESSES", 64)
    spawn = ("import os, subprocess\nstarted = []\nfor _ in range(200):\n    try:\n"
             "        started.append(subprocess.Popen(['sleep', '5']))\n    except OSError:\n        break\n"
             "print('n=%d' % len(started), flush=True)\nos.kill(-1, 9)\n")
    out, _ = sh(f"{sandbox.interpreter()} - <<'EOF'\n{spawn}EOF", tmp_path)
    count = int(out.split("n=")[1].split()[0])
    assert count <= 64, out


@needs_bwrap
def test_sandbox_limits_the_total_memory_of_a_command(tmp_path, monkeypatch):
    """Each process had 1 GiB of address space and nothing bounded their sum: three processes of 200 MiB
    all lived under a 384 MiB total before."""
    needs_cgroups()
    monkeypatch.setattr(sandbox, "TOTAL_MEMORY_BYTES", 384 << 20)
    python = sandbox.interpreter()
    hog = f"{python} -c 'import time; x = bytearray(200 << 20); time.sleep(2); print(\"alive\")'"
    out, _ = sh(f"for i in 1 2 3; do {hog} & done; wait", tmp_path)
    assert out.splitlines().count("alive") < 3, out


@needs_bwrap
def test_sandbox_cgroups_are_removed_after_the_command(tmp_path):
    needs_cgroups()
    sh("sleep 30 & echo started", tmp_path)
    for _, parent in sandbox.cgroup_parents():
        assert not list(Path(parent).glob(f"lightning-sandbox-{os.getpid()}-*")), parent


@needs_bwrap
def test_sandbox_bounds_the_growth_of_the_work_folder(tmp_path, monkeypatch):
    """--fsize bounds one file, not how many: one command wrote 1 GB to the host disk in a second
    (~20 GB in its 20 s). Now it is killed once the folder passes WORK_BYTES or WORK_FILES."""
    monkeypatch.setattr(sandbox, "WORK_BYTES", 32 << 20)
    out, code = sh("for i in $(seq 60); do head -c 8M /dev/zero > f$i; sleep 0.05; done; echo finished",
                   tmp_path, watch=True)
    used, _ = sandbox.folder_usage(tmp_path, 10_000)
    assert "finished" not in out and "work folder grew past" in out and code is not None, out
    assert used < 128 << 20
    monkeypatch.setattr(sandbox, "WORK_FILES", 500)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    out, _ = sh("for i in $(seq 100000); do : > g$i; done; echo finished", fresh, watch=True)
    assert "finished" not in out and "work folder grew past" in out, out
    # a folder past the bounds runs no further command (tests/test_hostile_sandbox.py)
    out, code = sh("rm -f g*; echo cleaned", fresh, watch=True)
    assert "cleaned" not in out and "not run" in out and code == sandbox.REFUSED, out


# ---------------------------------------------------------------- calc

CALC = ROOT / "examples" / "calc"


def load_calc(name: str):
    spec = importlib.util.spec_from_file_location(f"hostile_calc_{name}", CALC / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("expression", ["1" + "0" * 400 + "/3", "9" * 400 + "/1", "1" * 20 + "*" + "1" * 300 + "/7",
                                        "1" * 5000])
def test_calculator_answers_error_to_numbers_past_a_float(expression):
    """Model text reached float(): OverflowError crashed the harness (the rollout failed, no reward)."""
    assert load_calc("harness").calculate(expression) == "error"


def test_calculator_keeps_exact_integers():
    calc = load_calc("harness")
    assert calc.calculate("9" * 40 + "+1") == "1" + "0" * 40
    assert calc.calculate("9" * 400) == "9" * 400 and calc.calculate("6/2") == "3"


class _Fixed(http.server.BaseHTTPRequestHandler):
    body = b"{}"

    def do_POST(self):  # noqa: N802 - the http.server name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("body", [{"choices": []}, {"choices": None}, {}])
def test_calc_harness_reports_a_malformed_reply_in_one_line(body, tmp_path):
    """A 200 without choices was an IndexError/TypeError traceback; now one line that says what."""
    pytest.importorskip("openai")
    handler = type("Handler", (_Fixed,), {"body": json.dumps(body).encode()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}/v1",
               "OPENAI_API_KEY": "sk-hostile-calc"}
        for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, str(CALC / "harness.py"), "--question", "What is 1 plus 2?"],
                              capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    finally:
        server.shutdown()
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "MalformedReply" in proc.stderr, proc.stderr[-2000:]
    assert "sk-hostile-calc" not in proc.stderr + proc.stdout
