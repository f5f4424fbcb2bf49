"""The managed-process helper (lightning_harness/process.py) with real child processes and ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_harness.process import (
    PROXY_VARS,
    StartupError,
    direct_env,
    free_port,
    log_tail,
    start_in_session,
    stop_group,
    wait_ready,
)


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def start_with_grandchild(tmp_path, trap_term: bool) -> tuple[subprocess.Popen, int]:
    """A bash group leader with a ``sleep`` grandchild; both ignore SIGTERM when ``trap_term``."""
    trap = "trap '' TERM; " if trap_term else ""
    proc = start_in_session(["bash", "-c", f"{trap}sleep 300 & echo $! > {tmp_path}/child; wait"],
                            tmp_path / "log", os.environ)
    deadline = time.monotonic() + 30
    while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text().strip():
        assert time.monotonic() < deadline, "the grandchild did not start"
        time.sleep(0.05)
    return proc, int((tmp_path / "child").read_text())


def test_stop_group_ends_the_leader_and_its_grandchild(tmp_path):
    proc, child = start_with_grandchild(tmp_path, trap_term=False)
    assert os.getpgid(child) == proc.pid  # same group: start_in_session made the leader
    t0 = time.monotonic()
    rc = stop_group(proc, grace=20)
    assert time.monotonic() - t0 < 15, "a child that obeys SIGTERM is not held for the whole grace"
    assert rc == proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "grandchild survived stop_group()"
        time.sleep(0.05)


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    proc, child = start_with_grandchild(tmp_path, trap_term=True)
    t0 = time.monotonic()
    rc = stop_group(proc, grace=1.0)
    took = time.monotonic() - t0
    assert rc == -signal.SIGKILL
    assert 1.0 <= took < 15, took
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "grandchild survived the SIGKILL"
        time.sleep(0.05)


def test_stop_group_by_pid_waits_on_proc_and_sees_a_zombie_as_gone(tmp_path):
    """The leftover of an earlier run is only a pid; here our own child, whose exit leaves a zombie."""
    sleeper = start_in_session(["sleep", "300"], tmp_path / "log", os.environ)
    t0 = time.monotonic()
    assert stop_group(sleeper.pid, grace=20) is None
    assert time.monotonic() - t0 < 15
    assert sleeper.wait(10) == -signal.SIGTERM


def test_a_child_reaped_before_is_not_signalled_again(tmp_path):
    proc = start_in_session(["true"], tmp_path / "log", os.environ)
    proc.wait(30)
    t0 = time.monotonic()
    assert stop_group(proc, grace=20) == 0
    assert time.monotonic() - t0 < 1


def test_wait_ready_returns_once_a_real_port_listens(tmp_path):
    port = free_port()
    server = ("import socket, time; time.sleep(1.0); s = socket.socket(); "
              f"s.bind(('127.0.0.1', {port})); s.listen(); print('listening', flush=True); time.sleep(300)")
    proc = start_in_session([sys.executable, "-c", server], tmp_path / "log", os.environ)
    probes = []

    def listening() -> bool:
        probes.append(time.monotonic())
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # refused until it listens
        return True

    try:
        wait_ready(listening, 60, what="toy server", proc=proc, log_path=tmp_path / "log")
        assert len(probes) > 1  # the first probes were refused, and that was not an error
        assert "listening" in (tmp_path / "log").read_text()
    finally:
        stop_group(proc, grace=5)


def test_a_child_that_dies_during_startup_fails_fast_with_its_log_tail(tmp_path):
    script = "import sys; print('loading'); print('boom: no such model', file=sys.stderr); sys.exit(3)"
    proc = start_in_session([sys.executable, "-c", script], tmp_path / "log", os.environ)
    t0 = time.monotonic()
    with pytest.raises(StartupError, match="toy server exited with code 3 during startup") as err:
        wait_ready(lambda: False, 300, what="toy server", proc=proc, log_path=tmp_path / "log")
    assert time.monotonic() - t0 < 60
    assert str(err.value).endswith("loading\nboom: no such model")


def test_a_child_never_ready_times_out_with_its_log_tail(tmp_path):
    proc = start_in_session([sys.executable, "-c",
                             "print('still warming up', flush=True); import time; time.sleep(300)"],
                            tmp_path / "log", os.environ)
    port = free_port()  # nothing listens there

    def listening() -> bool:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True

    try:
        with pytest.raises(StartupError, match=r"toy server not ready after 2s \(last check: ConnectionRefused") as err:
            wait_ready(listening, 2, what="toy server", proc=proc, log_path=tmp_path / "log")
        assert "still warming up" in str(err.value)
    finally:
        stop_group(proc, grace=5)


def test_log_tail_reads_the_end_of_a_large_log(tmp_path):
    log = tmp_path / "big.log"
    log.write_text("".join(f"line {i}\n" for i in range(200_000)))  # ~2.5 MB
    assert log_tail(log, lines=3) == "line 199997\nline 199998\nline 199999"
    assert log_tail(tmp_path / "missing.log") == "(no log)" == log_tail(None)


def test_direct_env_drops_every_proxy_variable():
    env = {**{k: "http://u:p@proxy:1" for k in PROXY_VARS}, "PATH": "/bin", "NO_PROXY": "", "SSL_CERT_FILE": "x"}
    assert direct_env(env) == {"PATH": "/bin", "NO_PROXY": "", "SSL_CERT_FILE": "x"}
    assert {"HTTP_PROXY", "https_proxy", "all_proxy"} <= set(PROXY_VARS)


# -- a harness service (launcher/service.py) on the same helper ---------------------------------------
ECHO_SERVICE = Path(__file__).parent / "support" / "echo_service.py"


def test_a_harness_service_listens_where_its_variable_says_and_is_gone_after_stop(tmp_path, monkeypatch):
    from lightning_harness.launcher.service import SERVICE_VAR, HarnessService

    monkeypatch.setenv("HTTPS_PROXY", "http://user:secret@127.0.0.1:9")  # never the service's
    service = HarnessService([sys.executable, str(ECHO_SERVICE)], cwd=tmp_path, log_path=tmp_path / "svc.log")
    service.start(timeout=30)
    try:
        assert service.env == {SERVICE_VAR: service.socket_path}
        assert oct(os.stat(os.path.dirname(service.socket_path)).st_mode & 0o777) == "0o700"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(service.socket_path)
            assert s.recv(100) == f"hello from {service.pid}".encode()
        assert f"cwd {tmp_path} proxy []" in (tmp_path / "svc.log").read_text()
    finally:
        service.stop(grace=2)
    assert not alive(service.pid) and not os.path.exists(os.path.dirname(service.socket_path))


def test_a_harness_service_that_dies_at_start_is_reported_with_its_log(tmp_path):
    from lightning_harness.launcher.service import HarnessService

    service = HarnessService("echo no model here >&2; exit 3", cwd=tmp_path, log_path=tmp_path / "svc.log")
    with pytest.raises(StartupError, match="(?s)exited with code 3.*no model here"):
        service.start(timeout=30)
    assert not os.path.exists(os.path.dirname(service.socket_path))
