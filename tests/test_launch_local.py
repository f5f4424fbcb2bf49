"""The local runner: own process group, timeout and cancel kill the whole group, logs keep the tail."""

from __future__ import annotations

import json
import sys
import threading
import time

from fixtures_launch import pid_alive, wait_dead, wait_for

from lightning_harness.launcher.local import AttemptJob, LocalRunner, trim_to_tail

# a leader that starts a grandchild in the same group, records both pids, then hangs
HANG = (
    "import json, os, subprocess, sys, time\n"
    "c = subprocess.Popen(['sleep', '1000'])\n"
    "open(sys.argv[1], 'w').write(json.dumps([os.getpid(), c.pid]))\n"
    "time.sleep(1000)\n"
)


def _job(tmp_path, command, timeout=None):
    return AttemptJob("r-t-0", 0, command, {"LH_TEST": "yes"}, tmp_path, tmp_path / "harness.log", timeout=timeout)


def test_exit_code_env_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PROXY_CONTROL_TOKEN", "secret-control")
    code = "import os,sys; print(os.environ['LH_TEST'], os.environ.get('LIGHTNING_PROXY_CONTROL_TOKEN')); sys.exit(4)"
    out = LocalRunner().run(_job(tmp_path, [sys.executable, "-c", code]), threading.Event())
    assert out.exit_code == 4 and not out.timed_out and out.error == "exit code 4"
    log = (tmp_path / "harness.log").read_text()
    assert log.startswith("yes None\n") and "attempt ended: exit=4" in log  # the launcher's own tokens stay with it
    assert out.duration_s >= 0


def test_timeout_kills_the_whole_process_group(tmp_path):
    pids_file = tmp_path / "pids.json"
    t0 = time.monotonic()
    out = LocalRunner(kill_grace=1.0).run(_job(tmp_path, [sys.executable, "-c", HANG, str(pids_file)], timeout=3),
                                          threading.Event())
    assert out.timed_out and out.exit_code is not None and out.exit_code < 0
    assert "timed out after 3s" in out.error
    assert time.monotonic() - t0 < 30
    leader, child = json.loads(pids_file.read_text())
    assert wait_dead([leader, child]) == []


def test_cancel_kills_group_and_stragglers_die_with_the_leader(tmp_path):
    pids_file = tmp_path / "pids.json"
    cancel = threading.Event()
    runner = LocalRunner(kill_grace=1.0)
    result = {}
    job = _job(tmp_path, [sys.executable, "-c", HANG, str(pids_file)])
    th = threading.Thread(target=lambda: result.update(out=runner.run(job, cancel)))
    th.start()
    wait_for(lambda: pids_file.exists() and pids_file.read_text())
    leader, child = json.loads(pids_file.read_text())
    assert pid_alive(child)
    cancel.set()
    th.join(30)
    assert result["out"].cancelled and "cancelled" in result["out"].error
    assert wait_dead([leader, child]) == []
    # a leader that exits normally but leaves a background child: the child is killed too
    pid2 = tmp_path / "bg.pid"
    out = runner.run(_job(tmp_path, f"sleep 1000 & echo $! > {pid2}; exit 0"), threading.Event())
    assert out.exit_code == 0
    assert wait_dead([int(pid2.read_text())]) == []


def test_unstartable_command_is_an_error_not_an_exception(tmp_path):
    out = LocalRunner().run(_job(tmp_path, [str(tmp_path / "does-not-exist")]), threading.Event())
    assert out.exit_code is None and "could not start harness" in out.error


def test_logs_are_cut_to_their_tail(tmp_path):
    log = tmp_path / "big.log"
    log.write_bytes(b"".join(b"line %06d\n" % i for i in range(100_000)))
    trim_to_tail(log, 10_000)
    data = log.read_bytes()
    assert len(data) < 10_100 and data.startswith(b"[lightning: ") and data.endswith(b"line 099999\n")
    chatty = "print('x' * 50 + '\\n', end='') ; [print(i) for i in range(5000)]"
    out = LocalRunner(max_log_bytes=2000).run(_job(tmp_path, [sys.executable, "-c", chatty]), threading.Event())
    assert out.exit_code == 0
    text = (tmp_path / "harness.log").read_text()
    assert len(text) < 2100 and "4999" in text and "attempt ended" in text
