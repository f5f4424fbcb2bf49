"""Rewards: what counts as a reward, where it is read from, and that a missing one stays missing."""

from __future__ import annotations

import datetime as dt
import math
import os
import uuid

import pytest

from lightning_harness.launcher.local import passed_env
from lightning_harness.launcher.rewards import RewardError, RewardsTable, parse_reward, read_reward_file, run_reward_cmd
from lightning_harness.schemas import PartWriter


@pytest.mark.parametrize("text, value, info", [("1", 1.0, None), (" -0.5\n", -0.5, None),
                                               ('{"reward": 2, "info": {"a": 1}}', 2.0, {"a": 1}), ("0", 0.0, None)])
def test_parse_reward_accepts_numbers_and_json(text, value, info):
    assert parse_reward(text) == (value, info)


@pytest.mark.parametrize("text",
                         ["", "abc", "true", '"1"', '{"score": 1}', "NaN", "Infinity", "[1]", '{"reward": null}',
                          "1e300", "-2e15", "1" + "0" * 400, '{"reward": ' + "9" * 5000 + "}"])
def test_parse_reward_refuses_what_is_not_a_finite_number(text):
    with pytest.raises(RewardError):
        parse_reward(text)


def test_reward_file(tmp_path):
    p = tmp_path / "reward.json"
    assert read_reward_file(p) is None
    p.write_text('{"reward": 0.25}')
    r = read_reward_file(p)
    assert (r.value, r.source) == (0.25, "file")
    p.write_text("oops")
    with pytest.raises(RewardError, match="not a number"):
        read_reward_file(p)


def test_reward_cmd_reads_last_line_and_reports_failures(tmp_path):
    env = {"LIGHTNING_TASK": '{"answer": 4}'}
    score = "import json,os; print(json.loads(os.environ['LIGHTNING_TASK'])['answer'] / 8)"
    ok = run_reward_cmd(f'echo scoring >&2; echo noise; python3 -c "{score}"', env, log_path=tmp_path / "log")
    assert (ok.value, ok.source) == (0.5, "command")
    assert "scoring" in (tmp_path / "log").read_text()
    with pytest.raises(RewardError, match="exited with 2"):
        run_reward_cmd("exit 2", env)
    with pytest.raises(RewardError, match="printed nothing"):
        run_reward_cmd("true", env)
    with pytest.raises(RewardError, match="timed out"):
        run_reward_cmd("sleep 30", env, timeout=0.5)


def test_reward_cmd_gets_of_the_launcher_environment_only_what_a_harness_does(tmp_path, monkeypatch):
    """The scorer (which runs model-written code: the patch's tests) gets PATH, HOME and the variables
    it is given, never the launcher's own LIGHTNING_* (the proxy's control token) or its other
    variables (credentials) unless passed by name (launcher/local.py launcher_env, passed_env)."""
    monkeypatch.setenv("LIGHTNING_PROXY_CONTROL_TOKEN", "secret-control")
    monkeypatch.setenv("LH_FROM_LAUNCHER", "kept")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    names = ('LIGHTNING_PROXY_CONTROL_TOKEN', 'LH_FROM_LAUNCHER', 'AWS_SECRET_ACCESS_KEY', 'LIGHTNING_TASK', 'HOME')
    show = f"import json,os; print(json.dumps({{'reward': 1, 'info': {{k: os.environ.get(k) for k in {names}}}}}))"
    got = run_reward_cmd(f'python3 -c "{show}"', {"LIGHTNING_TASK": "{}"})
    assert got.info == {"LIGHTNING_PROXY_CONTROL_TOKEN": None, "LH_FROM_LAUNCHER": None,
                        "AWS_SECRET_ACCESS_KEY": None, "LIGHTNING_TASK": "{}", "HOME": os.environ["HOME"]}
    passed = passed_env(["LH_*", "*_FROM_LAUNCHER"])
    assert passed == {"LH_FROM_LAUNCHER": "kept"}
    got = run_reward_cmd(f'python3 -c "{show}"', {"LIGHTNING_TASK": "{}", **passed})
    assert got.info["LH_FROM_LAUNCHER"] == "kept" and got.info["AWS_SECRET_ACCESS_KEY"] is None
    with pytest.raises(ValueError, match="NO_SUCH_VAR"):
        passed_env(["LH_*", "NO_SUCH_VAR"])
    with pytest.raises(ValueError, match="never passed"):
        passed_env(["LIGHTNING_PROXY_CONTROL_TOKEN"])


def _reward_row(rid, attempt, value, source="proxy", at=None):
    return {"reward_id": uuid.uuid4().hex, "rollout_id": rid, "attempt": attempt, "reward": value,
            "created_at": at or dt.datetime.now(dt.UTC), "source": source, "info_json": '{"k": 1}'}


def test_rewards_table_latest_wins_reads_new_parts_and_flushes_once(tmp_path):
    flushes = []
    writer = PartWriter(tmp_path, "rewards", background=False)
    table = RewardsTable(tmp_path, flush=lambda: flushes.append(1))
    assert table.lookup("r-a-0", 0) is None
    assert len(flushes) == 1
    t0 = dt.datetime.now(dt.UTC)
    writer.extend([_reward_row("r-a-0", 0, 1.0, at=t0), _reward_row("r-a-0", 0, 0.0, at=t0 + dt.timedelta(seconds=1)),
                   _reward_row("r-a-0", 1, 0.5)])
    writer.flush()
    r = table.lookup("r-a-0", 0)
    assert r.value == 0.0 and r.info == {"k": 1}  # the latest report wins, and 0.0 is a real reward
    assert table.lookup("r-a-0", 1).value == 0.5
    assert table.lookup("r-a-0", 1, sources=("file",)) is None
    # an attempt that ended before the last flush started does not flush again
    n = len(flushes)
    table.lookup("r-b-0", 0, ended_mono=-math.inf)
    assert len(flushes) == n


def test_a_reward_no_float_holds_is_a_clear_error_not_a_crashed_batch(tmp_path):
    """A harness's reward file holding a 400-digit integer raised OverflowError out of the reader (not a
    RewardError), and one of 1e300 overflowed the group's advantages. Both are refused: no reward."""
    import sys

    from lightning_harness.launcher.batch import run_batch

    write = "import os; open(os.environ['LIGHTNING_REWARD_FILE'], 'w').write('1' + '0' * 400)"
    (row,) = run_batch([{"id": "huge"}], [sys.executable, "-c", write], traces_dir=tmp_path / "traces",
                       run_id="r")
    assert (row.state, row.reward) == ("no_reward", None)
    assert "within +-1e+15" in row.error


def test_a_reward_nested_deep_fails_no_other_rollout(tmp_path):
    """Found by review: a reward file whose info nested ~980 deep passed the reader of the file, was stored,
    and then broke the launcher's parse of the stored row (two frames deeper: RecursionError): the attempt
    being judged at that moment, another rollout's, failed, in this batch and in every later one reading
    the row. Info past ``MAX_INFO_DEPTH`` is now refused (no reward, a clear error), and a stored row of
    any nesting is read without breaking the scan."""
    import sys

    from lightning_harness.launcher.batch import run_batch
    from lightning_harness.schemas.rewards import MAX_INFO_DEPTH

    deep = ("import json, os; d = json.loads(os.environ['LIGHTNING_TASK']).get('depth', 0)\n"
            "open(os.environ['LIGHTNING_REWARD_FILE'], 'w').write("
            "'{\"reward\": 1.0, \"info\": {\"x\": ' + '[' * d + ']' * d + '}}' if d else '0.5')")
    tasks = [{"id": "deep", "depth": 984}, {"id": "ok", "depth": MAX_INFO_DEPTH - 1}, {"id": "victim"}]
    rows = {r.task_id: r for r in run_batch(tasks, [sys.executable, "-c", deep], traces_dir=tmp_path / "traces",
                                            run_id="r", concurrency=1)}
    assert (rows["deep"].state, rows["deep"].reward) == ("no_reward", None) and "nests deeper" in rows["deep"].error
    assert (rows["ok"].state, rows["ok"].reward) == ("succeeded", 1.0)
    assert (rows["victim"].state, rows["victim"].reward) == ("succeeded", 0.5)

    # a row stored deeper than the parser goes (an older writer): skipped as info, the scan goes on
    writer = PartWriter(tmp_path / "t2", "rewards", background=False)
    writer.extend([{**_reward_row("r-a-0", 0, 1.0), "info_json": '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"},
                   _reward_row("r-b-0", 0, 0.25)])
    writer.flush()
    table = RewardsTable(tmp_path / "t2")
    assert table.lookup("r-b-0", 0).value == 0.25
    got = table.lookup("r-a-0", 0)
    assert got.value == 1.0 and list(got.info) == ["raw"]
