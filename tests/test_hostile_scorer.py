"""The launcher against a hostile harness and a scorer that prints what model-written code printed:
bounded memory and logs, cancel reaches the scorer, private fields never under the traces, recorded
text masked and shown as text, attempt numbers never reused, command lines that quote placeholders
refused. Each test failed on the launcher before its fix (session 24's review)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from lightning_harness.launcher.attempt import WORK_DIR
from lightning_harness.launcher.batch import BatchRunner, clean_work_dirs, run_batch
from lightning_harness.launcher.command import render_command, substitute
from lightning_harness.launcher.identity import plan_rollouts
from lightning_harness.launcher.progress import summary_tables
from lightning_harness.launcher.rewards import run_reward_cmd
from lightning_harness.launcher.tasks import Task, tasks_from_rows
from lightning_harness.process import exit_code, start_in_session, stop_group
from lightning_harness.schemas import read_table
from lightning_harness.schemas.states import CANCELLED, NO_REWARD, SUCCEEDED

PY = sys.executable


def test_only_the_end_of_a_scorers_output_is_read(tmp_path):
    """64 MiB of test output before the reward: the launcher holds a 64 KiB tail, not the output."""
    flood = f"{PY} -c \"import sys; [sys.stdout.write('x' * 1023 + chr(10)) for _ in range(65536)]\"; echo 0.5"
    tracemalloc.start()
    try:
        got = run_reward_cmd(flood, {}, timeout=120)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.value == 0.5
    assert peak < 8 << 20, f"peak {peak / 2**20:.0f} MiB while reading the scorer's output"


def test_the_scorers_stderr_leaves_the_attempt_log_bounded(tmp_path):
    log = tmp_path / "harness.log"
    cmd = f"{PY} -c \"import sys; sys.stderr.write('e' * (3 << 20))\"; echo 1"
    assert run_reward_cmd(cmd, {}, log_path=log, max_log_bytes=1 << 20).value == 1.0
    assert log.stat().st_size <= (1 << 20) + 200


def test_a_cancel_stops_a_running_scorer_and_the_attempt_is_cancelled(tmp_path):
    started = tmp_path / "scoring"
    batch = BatchRunner(["true"], traces_dir=tmp_path / "t", run_id="c", concurrency=1, flush_seconds=0,
                        reward_cmd=f"touch {started}; sleep 60; echo 1")
    batch.submit([{"id": "t"}])
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists()
    t0 = time.monotonic()
    batch.cancel()
    took = time.monotonic() - t0
    batch.close()
    assert took < 10, f"cancel waited {took:.0f}s for the scorer"
    rows = read_table(tmp_path / "t", "rollouts").select(["state", "reward"]).to_pylist()
    assert rows == [{"state": CANCELLED, "reward": None}]
    out = subprocess.run(["pgrep", "-f", f"touch {started}; sleep 60"], capture_output=True, text=True).stdout
    assert not out.strip(), "the scorer outlived the cancel"


def test_the_scorer_reads_private_fields_from_a_file_outside_the_traces(tmp_path):
    """While the scorer runs, the attempt folder's task.json is still the public row (a launcher
    killed now leaves no private field there); the scorer's own task file has the whole row."""
    check = ('import json, os, sys; work = os.path.dirname(os.environ["LIGHTNING_OUTPUT_DIR"]); '
             'public = open(os.path.join(work, "task.json")).read(); '
             'mine = json.load(open(os.environ["LIGHTNING_TASK_FILE"])); '
             'print(1 if "SECRET-42" not in public and mine["solution"] == "SECRET-42" '
             'and not os.environ["LIGHTNING_TASK_FILE"].startswith(work) else 0)')
    tasks = [Task("t", {"id": "t", "solution": "SECRET-42"}, frozenset({"solution"}))]
    (r,) = run_batch(tasks, ["true"], traces_dir=tmp_path / "t", run_id="p", reward_cmd=f"{PY} -c '{check}'")
    assert (r.state, r.reward) == (SUCCEEDED, 1.0), r.error
    found = subprocess.run(["grep", "-rl", "SECRET-42", str(tmp_path / "t" / "launch")], capture_output=True, text=True)
    assert found.stdout == ""


def test_what_a_harness_wrote_is_recorded_masked(tmp_path, monkeypatch):
    key = "sk-proj-" + "Zq3vT9xW2kLm8Np4Rs7Yb1Hc6Fd0Gj5E"
    monkeypatch.setenv("OPENAI_API_KEY", key)  # the launcher's key, which its harnesses get only when passed
    given = {"OPENAI_API_KEY": key}
    (bad,) = run_batch([{"id": "t"}], 'echo "$OPENAI_API_KEY" > "$LIGHTNING_REWARD_FILE"', traces_dir=tmp_path / "a",
                       run_id="a", extra_env=given)
    assert bad.state == NO_REWARD and key not in bad.error and "[REDACTED]" in bad.error
    (good,) = run_batch([{"id": "t"}], 'printf \'{"reward": 1, "info": {"k": "%s"}}\' "$OPENAI_API_KEY" '
                        '> "$LIGHTNING_REWARD_FILE"', traces_dir=tmp_path / "b", run_id="b", extra_env=given)
    assert good.reward == 1.0
    for table, column in (("rollouts", "error"), ("rewards", "info_json")):
        assert key not in str(read_table(tmp_path / ("a" if table == "rollouts" else "b"), table)[column].to_pylist())


def test_a_harness_cannot_record_its_own_credential_through_what_the_launcher_reads(tmp_path, make_proxy):
    """Found by review: the launcher masked the proxy's tokens and API keys in a reward file's info and
    in the error, but not the attempt's own credential, which its harness holds (in the base URL and
    HTTPS_PROXY): a reward file quoting it was recorded in clear."""
    from lightning_harness.proxy.credentials import attempt_credential

    p = make_proxy()
    quote = '{"reward": 1, "info": {"u": "%s"}}'
    (good,) = run_batch([{"id": "t"}], f'printf \'{quote}\' "$OPENAI_BASE_URL" > "$LIGHTNING_REWARD_FILE"',
                        traces_dir=tmp_path / "t", run_id="a", proxy=p)
    (bad,) = run_batch([{"id": "t"}], 'echo "$HTTPS_PROXY" > "$LIGHTNING_REWARD_FILE"', traces_dir=tmp_path / "t",
                       run_id="b", proxy=p)
    assert good.reward == 1.0 and bad.state == NO_REWARD
    p.control.flush()
    recorded = str(read_table(tmp_path / "t", "rewards")["info_json"].to_pylist())
    errors = str(read_table(tmp_path / "t", "rollouts")["error"].to_pylist())
    assert "/lh/" in recorded and "[REDACTED]" in recorded and "[REDACTED]" in errors
    for r in (good, bad):
        credential = attempt_credential(p.token, r.rollout_id, r.attempt)
        assert credential not in recorded and credential not in errors


def test_a_harness_error_is_shown_as_text_not_markup(tmp_path):
    (r,) = run_batch([{"id": "[bold]t"}], 'echo "[/oops] not a reward" > "$LIGHTNING_REWARD_FILE"',
                     traces_dir=tmp_path, run_id="m")
    from rich.console import Console

    console = Console(file=open(os.devnull, "w"), width=200)
    for table in summary_tables([r]):
        console.print(table)  # MarkupError before


def test_a_run_whose_harness_left_a_deep_tree_is_cleaned(tmp_path):
    """``shutil.rmtree`` raised RecursionError on a folder 1,200 levels deep (not an OSError, so
    ``ignore_errors`` let it out)."""
    run_batch([{"id": "t"}], ["sh", "-c", 'mkdir -p "$LIGHTNING_OUTPUT_DIR/$(printf "d/%.0s" $(seq 1200))"'],
              traces_dir=tmp_path, run_id="deep")
    folder = tmp_path / WORK_DIR / "deep"
    try:
        assert any(p.name == "d" for p in folder.rglob("out/d"))  # the tree is there
        clean_work_dirs(tmp_path, "deep")
        assert not folder.exists()
    finally:  # pytest's own clean-up of old temporary folders would hit the same RecursionError
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_attempt_numbers_are_not_reused_without_resume(tmp_path):
    run_batch([{"id": "t"}], ["true"], traces_dir=tmp_path, run_id="n", skip_finished=False)
    clean_work_dirs(tmp_path, "n")  # attempt folders gone: only the rows remember attempt 0
    (again,) = run_batch([{"id": "t"}], ["true"], traces_dir=tmp_path, run_id="n", skip_finished=False)
    assert again.attempt == 1
    rows = read_table(tmp_path, "rollouts").select(["attempt"]).to_pylist()
    assert sorted(r["attempt"] for r in rows) == [0, 1]


def test_a_flush_that_fails_after_a_cancel_leaves_one_row(tmp_path):
    import errno

    batch = BatchRunner(["sleep", "30"], traces_dir=tmp_path, run_id="f", concurrency=1, flush_seconds=0)
    batch.submit([{"id": "t"}])
    time.sleep(1.5)
    real = batch._rollouts._write_rows

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    batch._rollouts._write_rows = disk_full
    batch._cancel.set()
    batch._join_workers()
    batch._rollouts._write_rows = real
    batch.close()
    rows = read_table(tmp_path, "rollouts").select(["attempt", "state"]).to_pylist()
    assert rows == [{"attempt": 0, "state": CANCELLED}]


@pytest.mark.parametrize("line", ['echo "question: {question}"', "echo '{question}'", 'sh -c "agent {task_id}"'])
def test_a_placeholder_inside_quotes_is_refused(line):
    values = {"question": "what is $(echo INJECTED; id -un)?", "task_id": "t"}
    with pytest.raises(ValueError, match="inside quotes"):
        render_command(line, values)
    assert substitute(line, values) == line.replace("{question}", values["question"]).replace("{task_id}", "t")


def test_a_bare_placeholder_stays_one_word_and_a_quoted_one_in_the_scorer_gives_no_reward(tmp_path):
    line = render_command("echo {question}", {"question": "what is $(echo INJECTED)?"})
    said = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True).stdout
    assert said == "what is $(echo INJECTED)?\n"
    (r,) = run_batch([{"id": "t", "question": "q"}], ["true"], traces_dir=tmp_path, run_id="q",
                     reward_cmd='echo "{question}" >/dev/null; echo 1')
    assert r.state == NO_REWARD and "inside quotes" in r.error


@pytest.mark.parametrize("run_id", ["..", ".", ""])
def test_a_run_id_cannot_name_a_folder_outside_the_attempts(tmp_path, run_id):
    with pytest.raises(ValueError, match="run id"):
        plan_rollouts(tasks_from_rows([{"id": "t"}]), run_id=run_id, samples=1)
    (tmp_path / "rollouts").mkdir()
    with pytest.raises(ValueError):
        clean_work_dirs(tmp_path, run_id)
    assert (tmp_path / "rollouts").is_dir()


def test_a_health_check_does_not_reap_so_stopping_ends_the_group(tmp_path):
    """A server whose leader died (a crashed API server with its engine worker): the health check sees
    the exit, and stopping it afterwards still ends the worker left in its group."""
    log = tmp_path / "log"
    proc = start_in_session(["/bin/sh", "-c", "sleep 60 & echo $!; exit 3"], log, os.environ)
    deadline = time.monotonic() + 10
    while exit_code(proc) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exit_code(proc) == 3 and proc.returncode is None
    worker = int(log.read_text().split()[0])
    assert stop_group(proc, grace=1.0) == 3
    time.sleep(0.2)
    stat = f"/proc/{worker}/stat"
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"


def test_exit_code_reports_a_signal_as_poll_does():
    proc = subprocess.Popen(["sh", "-c", "kill -9 $$"])
    done = threading.Event()
    deadline = time.monotonic() + 10
    while exit_code(proc) is None and time.monotonic() < deadline:
        done.wait(0.05)
    assert exit_code(proc) == -9 == proc.wait()


@pytest.mark.timeout(120)
def test_a_failing_result_callback_does_not_stop_the_batch(tmp_path):
    def on_result(result):
        raise RuntimeError("the caller's bug")

    results = run_batch([{"id": "a"}, {"id": "b"}], ["true"], traces_dir=tmp_path, run_id="cb", concurrency=1,
                        on_result=on_result)
    assert [r.task_id for r in results] == ["a", "b"]  # the worker went on (wait() hung with one worker)
