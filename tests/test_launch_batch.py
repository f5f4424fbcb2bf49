"""The batch runner with real harness processes, the real proxy and a stub upstream.

Every harness is tests/support/harness_chat.py: the official openai client, several turns, its
reward reported to the proxy or a file (or not at all), crashing or hanging on request.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import duckdb
import pytest
from fixtures_launch import pid_alive, wait_dead, wait_for

from lightning_harness.launcher.batch import WORK_DIR, BatchAborted, BatchRunner, run_batch
from lightning_harness.launcher.tasks import tasks_from_rows

pytestmark = pytest.mark.timeout(300)


def _sql(traces: Path, query: str) -> list[tuple]:
    con = duckdb.connect()
    for table in ("spans", "rollouts", "rewards"):
        if list((traces / table).glob("**/*.parquet")):
            con.execute(f"create view {table} as select * from read_parquet('{traces}/{table}/**/*.parquet', "
                        "hive_partitioning=true, union_by_name=true)")
    return con.execute(query).fetchall()


def test_mixed_batch_is_recorded_attributed_rewarded_and_joins(make_proxy, harness_cmd, tmp_path, rows):
    proxy = make_proxy(model_version=3)
    traces = proxy.traces_dir
    tasks = tasks_from_rows([
        {"id": "ok", "turns": 3, "reward": 1.0},
        {"id": "zero", "reward": 0.0},
        {"id": "file", "behave": "file", "reward": 0.5},
        {"id": "none", "behave": "none"},
        {"id": "bad", "behave": "bad"},
        {"id": "crash", "behave": "crash"},
        {"id": "flaky", "behave": "flaky", "reward": 0.75},
        {"id": "fwd", "base_url": "https://api.openai.com/v1", "reward": 1.0},
    ])
    results = run_batch(tasks, harness_cmd, traces_dir=traces, run_id="b1", proxy=proxy, samples=2,
                        concurrency=3, retries=1, timeout=120)
    by_task = {}
    for r in results:
        by_task.setdefault(r.task_id, []).append(r)
    assert len(results) == 16 and all(len(v) == 2 for v in by_task.values())
    state = {t: {r.state for r in rs} for t, rs in by_task.items()}
    assert state == {"ok": {"succeeded"}, "zero": {"succeeded"}, "file": {"succeeded"}, "none": {"no_reward"},
                     "bad": {"no_reward"}, "crash": {"failed"}, "flaky": {"succeeded"}, "fwd": {"succeeded"}}
    assert [r.reward for r in by_task["zero"]] == [0.0, 0.0]
    assert {(r.reward, r.reward_source) for r in by_task["file"]} == {(0.5, "file")}
    assert {(r.reward, r.reward_source) for r in by_task["ok"]} == {(1.0, "proxy")}
    assert all(r.reward is None and "no reward" in r.error for r in by_task["none"])
    assert all(r.reward is None and "not a number" in r.error for r in by_task["bad"])
    assert all(r.attempt == 1 and r.exit_code == 3 and r.error == "exit code 3" for r in by_task["crash"])
    assert all(r.attempt == 1 and r.reward == 0.75 and r.attempts_run == 2 for r in by_task["flaky"])
    assert all(r.model_version == 3 and r.runner == "local" for r in results)
    assert "DONE b1-ok-0~0" in Path(by_task["ok"][0].log_path).read_text()

    # every attempt is a row (retries included), with every column filled where it applies
    table = rows(traces, "rollouts")
    assert len(table) == 16 + 2 + 2  # crash and flaky retried once each
    for row in table:
        for col in ("rollout_id", "attempt", "run_id", "task_id", "group_id", "sample_index", "split", "state",
                    "started_at", "ended_at", "duration_s", "log_path", "model_version", "runner", "task_json"):
            assert row[col] is not None, col
        assert (row["reward"] is None) == (row["state"] != "succeeded")
        assert Path(row["log_path"]).exists()
    assert {r["source"] for r in rows(traces, "rewards") if r["rollout_id"].startswith("b1-file")} == {"file"}

    proxy.control.flush()
    # spans join rollouts on (rollout_id, attempt): nothing unattributed, turns counted per attempt
    joined = _sql(traces, """
        select r.task_id, r.state, s.rollout_id, s.attempt, count(*) as calls, min(s.mode), max(s.model_version)
        from spans s join rollouts r using (rollout_id, attempt) group by all order by all""")
    calls = {(t, rid, a): n for t, st, rid, a, n, mode, mv in joined}
    assert calls[("ok", "b1-ok-0", 0)] == 3 and calls[("ok", "b1-ok-1", 0)] == 3
    assert calls[("crash", "b1-crash-0", 0)] == 1 and calls[("crash", "b1-crash-0", 1)] == 1
    assert {mode for t, st, rid, a, n, mode, mv in joined if t == "fwd"} == {"forward"}
    assert {mv for *_, mv in joined} == {3}
    orphans = _sql(traces, "select count(*) from spans s anti join rollouts r using (rollout_id, attempt)")
    assert orphans == [(0,)]
    # each group is complete: one final row per sample of every task
    groups = _sql(traces, """
        select group_id, count(distinct sample_index) from rollouts
        where state in ('succeeded', 'no_reward') or attempt = 1 group by 1 order by 1""")
    assert groups == [(t, 2) for t in sorted(by_task)]


def test_concurrency_limit_is_respected_and_reached(make_proxy, harness_cmd, rows):
    proxy = make_proxy()
    tasks = tasks_from_rows([{"id": f"t{i}", "behave": "slow", "sleep": 1.5, "turns": 1} for i in range(6)])
    run_batch(tasks, harness_cmd, traces_dir=proxy.traces_dir, run_id="c", proxy=proxy, concurrency=2, timeout=120)
    events = []
    for r in rows(proxy.traces_dir, "rollouts"):
        events += [(r["started_at"], 1), (r["ended_at"], -1)]
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        level += delta
        peak = max(peak, level)
    assert peak == 2


def test_timeout_kills_hanging_harness_group_and_retries_with_new_attempts(make_proxy, harness_cmd, rows):
    proxy = make_proxy()
    traces = proxy.traces_dir
    t0 = time.monotonic()
    [result] = run_batch(tasks_from_rows([{"id": "hang", "behave": "hang"}]), harness_cmd, traces_dir=traces,
                         run_id="h", proxy=proxy, timeout=4, retries=1)
    assert time.monotonic() - t0 < 90
    assert result.state == "timed_out" and result.attempt == 1 and result.reward is None
    attempts = sorted((r["attempt"], r["state"]) for r in rows(traces, "rollouts"))
    assert attempts == [(0, "timed_out"), (1, "timed_out")]
    for a in (0, 1):
        pids = json.loads((traces / WORK_DIR / "h" / "h-hang-0" / str(a) / "out" / "pids.json").read_text())
        assert wait_dead(pids.values()) == []


def test_rerun_skips_finished_rollouts_and_only_runs_what_is_missing(make_proxy, harness_cmd, rows):
    proxy = make_proxy()
    traces = proxy.traces_dir
    tasks = tasks_from_rows([{"id": "ok"}, {"id": "crash", "behave": "crash"}])
    kw = dict(traces_dir=traces, run_id="rr", proxy=proxy, timeout=120)
    first = run_batch(tasks, harness_cmd, samples=2, **kw)
    assert sorted(r.state for r in first) == ["failed", "failed", "succeeded", "succeeded"]
    n = len(rows(traces, "rollouts"))

    again = run_batch(tasks, harness_cmd, samples=2, **kw)
    assert all(r.skipped for r in again) and len(rows(traces, "rollouts")) == n
    assert [(r.rollout_id, r.state, r.reward) for r in again] == [(r.rollout_id, r.state, r.reward) for r in first]

    # a larger group only runs the new sample; a larger retry budget retries the failures with new attempts
    more = run_batch(tasks, harness_cmd, samples=3, retries=1, **kw)
    ran = sorted((r.rollout_id, r.attempt) for r in more if not r.skipped)
    assert ran == [("rr-crash-0", 1), ("rr-crash-1", 1), ("rr-crash-2", 1), ("rr-ok-2", 0)]
    # an attempt folder without a row (a launcher killed mid-attempt) is never reused
    (traces / WORK_DIR / "rr" / "rr-crash-0" / "2").mkdir(parents=True)
    last = run_batch(tasks, harness_cmd, samples=3, retries=2, **kw)
    assert {r.rollout_id: r.attempt for r in last if not r.skipped}["rr-crash-0"] == 3


def test_runner_streams_groups_while_others_keep_running(make_proxy, harness_cmd):
    proxy = make_proxy()
    with BatchRunner(harness_cmd, traces_dir=proxy.traces_dir, proxy=proxy, run_id="as", samples=2,
                     concurrency=4, timeout=120, step=0) as runner:
        runner.submit([{"id": "slow", "behave": "slow", "sleep": 8, "turns": 1}, {"id": "fast", "turns": 1}])
        [first] = runner.wait_groups(1, timeout=120)
        assert first.group_id == "fast@0" and first.complete and first.rewards == [1.0, 1.0]
        assert runner.pending == 2  # the slow group is still running
        runner.model_version = 7  # what the trainer does after an update
        runner.submit([{"id": "later", "turns": 1}], step=1)
        rest = runner.wait_groups(timeout=120)
        assert sorted(g.group_id for g in rest) == ["later@1", "slow@0"]
        assert runner.finished_groups() == []
        later = [g for g in rest if g.group_id == "later@1"][0]
        assert [r.model_version for r in later.rollouts] == [7, 7]
        assert [r.rollout_id for r in later.rollouts] == ["as-s1-later-0", "as-s1-later-1"]
        with pytest.raises(ValueError, match="already submitted"):
            runner.submit([{"id": "fast", "turns": 1}])


def test_cancel_kills_every_harness_and_records_cancelled_attempts(make_proxy, harness_cmd, rows):
    proxy = make_proxy()
    traces = proxy.traces_dir
    runner = BatchRunner(harness_cmd, traces_dir=traces, proxy=proxy, run_id="cx", samples=2, concurrency=2,
                         timeout=300)
    runner.submit([{"id": "hang", "behave": "hang"}, {"id": "never", "behave": "hang"}])
    files = [traces / WORK_DIR / "cx" / f"cx-hang-{i}" / "0" / "out" / "pids.json" for i in range(2)]
    wait_for(lambda: all(f.exists() and f.read_text() for f in files), timeout=60)
    pids = [p for f in files for p in json.loads(f.read_text()).values()]
    assert all(pid_alive(p) for p in pids)
    runner.cancel()
    assert wait_dead(pids) == []
    table = rows(traces, "rollouts")  # written and flushed by cancel() itself
    assert sorted((r["rollout_id"], r["state"]) for r in table) == [("cx-hang-0", "cancelled"),
                                                                    ("cx-hang-1", "cancelled")]
    assert runner.results() == []  # cancelled attempts never finish a rollout: a re-run runs them again
    runner.close()


def test_a_dead_proxy_stops_the_batch_instead_of_failing_every_rollout(make_proxy, harness_cmd, rows):
    proxy = make_proxy()
    traces = proxy.traces_dir
    tasks = tasks_from_rows([{"id": "slow", "behave": "slow", "sleep": 6, "turns": 1}] +
                            [{"id": f"t{i}", "turns": 1} for i in range(6)])
    runner = BatchRunner(harness_cmd, traces_dir=traces, proxy=proxy, run_id="dp", concurrency=1, retries=3,
                         timeout=120)
    runner.submit(tasks)
    log = traces / WORK_DIR / "dp" / "dp-slow-0" / "0" / "harness.log"
    wait_for(lambda: log.exists() and "turn 0" in log.read_text(), timeout=60)
    proxy.kill()  # the harness is sleeping; its reward POST will find no proxy
    runner.wait(timeout=120)
    runner.close()
    assert runner.error and "capture proxy exited" in runner.error
    table = rows(traces, "rollouts")
    assert [(r["rollout_id"], r["state"]) for r in table] == [("dp-slow-0", "cancelled")]  # not retried, not 'failed'
    assert "capture proxy exited" in table[0]["error"]
    with pytest.raises(BatchAborted, match="capture proxy exited"):
        run_batch(tasks, harness_cmd, traces_dir=traces, run_id="dp2", proxy=proxy)
