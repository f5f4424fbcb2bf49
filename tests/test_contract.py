"""The product's contract with a harness, each rule once: rollout states, what a reward is, which
reward wins (the same in Python and in the SQL view), and task fields the harness must not see."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import subprocess
import sys
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest

from lightning_harness.launcher.results import History, RolloutResult
from lightning_harness.launcher.rewards import Reward, RewardsTable, winner
from lightning_harness.launcher.tasks import TaskFileError, load_tasks
from lightning_harness.schemas import ROLLOUTS, PartWriter
from lightning_harness.schemas.rewards import RewardError, parse_reward, reward_from_object
from lightning_harness.schemas.states import ABORTED, FINISHED, RETRY_FAILURES, RolloutState
from lightning_harness.trainer.advantages import apply_failure_policy
from lightning_harness.trainer.views import connect

pytestmark = pytest.mark.timeout(300)


# -- rollout states -----------------------------------------------------------------------------------
def test_states_are_stored_as_their_plain_strings(tmp_path):
    writer = PartWriter(tmp_path, "rollouts", background=False)
    writer.extend([{"rollout_id": f"r{i}", "attempt": 0, "state": s} for i, s in enumerate(RolloutState)])
    writer.flush()
    [part] = (tmp_path / "rollouts").glob("**/*.parquet")
    stored = pq.read_table(part, columns=["state"]).column("state").to_pylist()
    assert stored == ["succeeded", "no_reward", "failed", "timed_out", "cancelled"]
    assert all(type(s) is str for s in stored)
    assert all(f"'{s.value}'" in ROLLOUTS.field("state").metadata[b"doc"].decode() for s in RolloutState)


def test_cancelled_uses_no_retry_but_is_not_trained_on():
    """RETRY_FAILURES: what uses a retry; ABORTED: what the training failure policy drops."""
    assert RETRY_FAILURES == {"failed", "timed_out"} and ABORTED == RETRY_FAILURES | {"cancelled"}
    assert FINISHED.isdisjoint(ABORTED) and FINISHED | ABORTED == set(RolloutState)
    rows = [{"attempt": 0, "state": "cancelled"}, {"attempt": 1, "state": "failed"}]
    assert History(rows).failures == 1 and History(rows).final(retries=1) is None
    keep, _, counts = apply_failure_policy(np.array([1.0, 1.0, 1.0]),
                                           np.array(["cancelled", "timed_out", "succeeded"], dtype=object))
    assert keep.tolist() == [False, False, True]
    assert counts == {"failed": 0, "timed_out": 1, "cancelled": 1, "no_reward": 0, "dropped": 2}


# -- what a reward is ------------------------------------------------------------------------------------
@pytest.mark.parametrize("obj", [{"reward": "1"}, {"reward": True}, {"reward": None}, {"reward": float("nan")},
                                 {"reward": 1, "info": "text"}, {"reward": 1, "info": [1]}, {"score": 1}, [1]])
def test_one_rule_refuses_what_is_not_a_finite_number_with_an_object_info(obj):
    with pytest.raises(RewardError):
        reward_from_object(obj)
    with pytest.raises(RewardError):  # the same rule for a reward file or a scorer's last line
        parse_reward(json.dumps(obj))


def test_one_rule_accepts_numbers_and_objects():
    assert reward_from_object({"reward": 0, "info": {"a": 1}}) == (0.0, {"a": 1})
    assert parse_reward("-2.5") == (-2.5, None) and parse_reward('{"reward": 1e3}') == (1000.0, None)


# -- which reward wins: Python and the SQL view agree ------------------------------------------------------
SOURCES = ["command", "api", "proxy", "file", "grader", None]  # 'grader': an unknown source, ranks as a self-report


def _random_reports(rng: random.Random, n_attempts: int) -> list[dict]:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    seconds = rng.sample(range(100_000), n_attempts * 6)  # distinct times: no ties to break
    rows = []
    for a in range(n_attempts):
        for k in range(rng.randint(1, 6)):
            at = None if k == 0 and rng.random() < 0.3 else t0 + dt.timedelta(seconds=seconds.pop())
            rows.append({"reward_id": uuid.uuid4().hex, "rollout_id": f"r{a}", "attempt": a % 2,
                         "reward": float(rng.randint(0, 1000)), "created_at": at, "source": rng.choice(SOURCES),
                         "info_json": None})
    return rows


def test_the_view_and_python_pick_the_same_reward(tmp_path):
    rows = _random_reports(random.Random(13), 300)
    writer = PartWriter(tmp_path, "rewards", background=False)
    writer.extend(rows)
    writer.flush()
    expected: dict = {}
    for r in rows:
        key = (r["rollout_id"], r["attempt"])
        expected[key] = winner(expected.get(key), Reward(r["reward"], r["source"], None, r["created_at"]))
    got = {(rid, att): (reward, source) for rid, att, reward, source in
           connect(tmp_path).sql("SELECT rollout_id, attempt, reward, reward_source FROM rollouts").fetchall()}
    assert got == {k: (w.value, w.source) for k, w in expected.items()}
    assert len({w.source for w in expected.values()}) == len(SOURCES)  # every rank and source took part
    table = RewardsTable(tmp_path)  # the launcher's reader applies the same rule
    assert all(table.lookup(rid, att).value == w.value for (rid, att), w in expected.items())


# -- private task fields -----------------------------------------------------------------------------------------
HARNESS = """\
import json, os, pathlib, sys
work = pathlib.Path(os.environ["LIGHTNING_TASK_FILE"]).parent
seen = {"argv": sys.argv, "env": dict(os.environ),
        "files": {p.name: p.read_text() for p in work.iterdir() if p.is_file() and p.name != "harness.log"}}
pathlib.Path(os.environ["LIGHTNING_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
print("harness task:", os.environ["LIGHTNING_TASK"])
"""
SCORER = """\
import json, os
whole = json.loads(os.environ["LIGHTNING_TASK"])
from_file = json.loads(open(os.environ["LIGHTNING_TASK_FILE"]).read())
print(float(whole["solution"] == from_file["solution"] == "SECRET-fix-8c1f" and whole["hidden_tests"] == "assert 1"))
"""


def test_a_harness_never_sees_a_private_field_while_the_reward_does(tmp_path, stub_upstream, proxy_confdir):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "prompt": "fix it", "solution": "SECRET-fix-8c1f",
                                 "hidden_tests": "assert 1"}) + "\n")
    (tmp_path / "harness.py").write_text(HARNESS)
    (tmp_path / "scorer.py").write_text(SCORER)
    traces = tmp_path / "traces"
    cmd = [sys.executable, "-m", "lightning_harness.launcher.cli", "run", str(tasks), "--traces", str(traces),
           "--upstream", stub_upstream, "--proxy-confdir", str(proxy_confdir), "--no-progress",
           "--private-field", "solution", "--private-field", "hidden_tests",
           "--reward-cmd", f"{sys.executable} {tmp_path / 'scorer.py'}",
           "--", sys.executable, str(tmp_path / "harness.py"), "{prompt}", "{solution}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    [row] = [RolloutResult.from_row(r) for r in pq.read_table(traces / "rollouts").to_pylist()]
    assert (row.state, row.reward, row.reward_source) == ("succeeded", 1.0, "command"), row.error
    seen_text = next(traces.glob("launch/**/out/seen.json")).read_text()
    seen = json.loads(seen_text)
    assert json.loads(seen["env"]["LIGHTNING_TASK"]) == {"id": "t1", "task_id": "t1", "prompt": "fix it"}
    assert seen["argv"][1:] == ["fix it", "{solution}"]  # a private field is no placeholder of the harness
    assert "SECRET-fix-8c1f" not in seen_text and "assert 1" not in seen_text
    assert "SECRET" not in open(row.log_path).read()
    assert json.loads(row.task_json) == {"id": "t1", "task_id": "t1", "prompt": "fix it"}  # nor do the traces
    left = [f for f in traces.rglob("*") if f.is_file() and b"SECRET-fix-8c1f" in f.read_bytes()]
    assert left == []  # the scorer's task.json went back to the public row


def test_a_private_field_that_no_task_has_is_an_error(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "solution": "x"}\n')
    assert load_tasks(tasks, private_fields=["solution"])[0].private == {"solution"}
    with pytest.raises(TaskFileError, match="soluton"):
        load_tasks(tasks, private_fields=["soluton"])


def test_the_proxy_clis_rewards_file_follows_the_same_rule(tmp_path):
    """`lightning-proxy ctl rewards FILE` checks every line with the one rule before posting any."""
    import click

    from lightning_harness.proxy.cli import read_rewards_file

    good = tmp_path / "good.jsonl"
    good.write_text('{"rollout_id": "a", "reward": 0.5, "attempt": 2}\n'
                    '{"rollout_id": "b", "reward": 1, "info": {"g": 1}}\n')
    assert read_rewards_file(str(good)) == [("a", 2, 0.5, {}), ("b", 0, 1.0, {"g": 1})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"rollout_id": "a", "reward": 1}\n{"rollout_id": "b", "reward": "1"}\n[1]\n'
                   '{"rollout_id": "c", "reward": 1, "info": "s"}\n')
    with pytest.raises(click.ClickException, match="3 bad line") as err:
        read_rewards_file(str(bad))
    assert all(f"line {n}:" in err.value.message for n in (2, 3, 4))
