"""Readers survive a corrupt part, and the launcher stops on a proxy that cannot record.

`lightning-sql` and `lightning-train build` run as a user runs them (installed console scripts)
on traces holding one truncated part; the launcher runs the real test harness through a real proxy
whose disk is full.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_traces import reward, rollout, span, write_traces

from lightning_harness.launcher.batch import BatchAborted, run_batch
from lightning_harness.launcher.tasks import tasks_from_rows
from lightning_harness.trainer.views import connect

pytestmark = pytest.mark.timeout(300)
BIN = Path(sys.executable).parent


def _run(*args) -> subprocess.CompletedProcess:
    p = subprocess.run([str(BIN / args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture
def damaged(tmp_path) -> tuple[Path, Path]:
    """Traces with two good rollouts plus one truncated spans part of a third; (root, bad part)."""
    root = write_traces(
        tmp_path / "traces",
        spans=[span("a", 0, [1, 2], [10, 11]), span("b", 0, [1, 2], [14])],
        rollouts=[rollout("a", task_id="t1", reward=1.0), rollout("b", task_id="t1", reward=0.0)],
        rewards=[reward("b", 0.25)],
    )
    extra = write_traces(tmp_path / "extra", spans=[span("c", 0, [3], [4])])
    (part,) = (extra / "spans").rglob("*.parquet")
    data = part.read_bytes()
    bad = next((root / "spans").rglob("*.parquet")).parent / "part-truncated.parquet"
    bad.write_bytes(data[: len(data) // 2])
    return root, bad


def _one_warning(stderr: str, bad: Path) -> None:
    lines = [line for line in stderr.splitlines() if str(bad) in line]
    assert len(lines) == 1 and "corrupt" in lines[0], stderr
    assert "Traceback" not in stderr


def test_lightning_sql_skips_a_truncated_part_with_one_warning(damaged):
    root, bad = damaged
    p = _run("lightning-sql", root, "SELECT 1 AS one", "--format", "json")
    assert json.loads(p.stdout) == [{"one": 1}]
    _one_warning(p.stderr, bad)
    p = _run("lightning-sql", root, "SELECT rollout_id, response_len FROM calls ORDER BY rollout_id", "--format",
             "json")
    assert [(r["rollout_id"], r["response_len"]) for r in json.loads(p.stdout)] == [("a", 2), ("b", 1)]
    _one_warning(p.stderr, bad)


def test_lightning_train_build_goes_past_a_truncated_part(damaged):
    root, bad = damaged
    p = _run("lightning-train", "build", root, "--json")
    _one_warning(p.stderr, bad)
    con = connect(root)
    assert sorted(r[0] for r in con.sql("SELECT rollout_id FROM samples").fetchall()) == ["a", "b"]


def test_the_sql_shell_stays_live(tmp_path):
    # views are a listing (compaction-safe), so the shell lists again before every statement
    import io

    from lightning_harness.trainer.sql import shell

    root = write_traces(tmp_path / "t", spans=[span("a", 0, [1], [2])])
    con = connect(root)
    write_traces(root, spans=[span("b", 0, [1], [2])])
    out = io.StringIO()
    shell(con, str(root), "csv", stdin=io.StringIO("SELECT count(*) AS n FROM calls;\n"), out=out)
    assert out.getvalue().split() == ["n", "2"]


def test_launcher_batch_stops_when_the_proxy_cannot_record(make_proxy, harness_cmd, small_disk, tmp_path):
    p = make_proxy(traces_dir=small_disk.path / "traces", flush_seconds=0.2, extra_args=["--capture-failure", "serve"])
    tasks = tasks_from_rows([{"id": "t", "turns": 1, "behave": "none"}])
    results = run_batch(tasks, harness_cmd, traces_dir=tmp_path / "launch", run_id="ok", proxy=p, timeout=120)
    assert [r.state for r in results] == ["no_reward"]  # healthy capture: the batch passes
    small_disk.fill()
    with pytest.raises(BatchAborted, match="capture proxy incomplete: spans cannot be written .*No space"):
        run_batch(tasks, harness_cmd, traces_dir=tmp_path / "launch", run_id="full", proxy=p, timeout=120)


def test_lightning_sql_goes_past_a_part_whose_data_pages_are_damaged(tmp_path):
    import os

    from lightning_harness.schemas import PartWriter

    w = PartWriter(tmp_path, "spans", background=False)
    for i in range(2):
        w.extend([{"span_id": f"{i}-{j}", "seq": j, "request_json": os.urandom(1000).hex()} for j in range(200)])
        w.flush()
    bad = sorted((tmp_path / "spans").rglob("*.parquet"))[0]
    data = bytearray(bad.read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + 5000):  # mid-file: the footer still reads
        data[k] ^= 0x5A
    bad.write_bytes(bytes(data))
    p = _run("lightning-sql", tmp_path, "SELECT count(*) AS n, sum(length(request_json)) AS chars FROM spans",
             "--format", "json")
    assert json.loads(p.stdout) == [{"n": 200, "chars": 400_000}]
    _one_warning(p.stderr, bad)


@pytest.fixture
def damaged_rewards(tmp_path) -> tuple[Path, Path]:
    """Traces of rollouts a (reward 1) and b (reward 0) plus a part of later rewards of theirs whose data
    pages are damaged (its footer reads: only a query reading its rows fails); (root, bad part)."""
    import os

    from lightning_harness.schemas import PartWriter

    root = write_traces(tmp_path / "traces", spans=[span("a", 0, [1, 2], [10, 11]), span("b", 0, [1, 2], [14])],
                        rollouts=[rollout("a", reward=1.0), rollout("b", reward=0.0)])
    with PartWriter(root, "rewards", background=False, fsync=False) as w:  # incompressible: 160 KB of data pages
        w.extend([{**reward("ab"[j % 2], 0.5), "reward_id": os.urandom(200).hex()} for j in range(400)])
    (bad,) = (root / "rewards").rglob("*.parquet")
    data = bytearray(bad.read_bytes())
    for k in range(len(data) // 3, len(data) // 3 + 20_000):
        data[k] ^= 0x5A
    bad.write_bytes(bytes(data))
    return root, bad


def test_build_goes_past_a_rewards_part_whose_data_pages_are_damaged(damaged_rewards):
    """The rollout selection reads the rewards: a damaged part there is skipped, not reported as a
    'bad rollout selection'."""
    root, bad = damaged_rewards
    p = _run("lightning-train", "build", root, "--json")
    _one_warning(p.stderr, bad)
    assert json.loads(p.stdout)["rollouts_selected"] == 2
    assert sorted(r[0] for r in connect(root).sql("SELECT rollout_id FROM samples").fetchall()) == ["a", "b"]


def test_report_goes_past_a_rewards_part_whose_data_pages_are_damaged(damaged_rewards, tmp_path):
    from lightning_harness.trainer.report import collect

    root, bad = damaged_rewards
    data = collect(root)
    assert sorted(r["rollout_id"] for r in data["rollouts"]) == ["a", "b"] and data["run"]["rollouts_total"] == 2
    p = _run("lightning-train", "report", root, "-o", tmp_path / "report.html")
    _one_warning(p.stderr, bad)
    assert (tmp_path / "report.html").is_file()


def test_the_loops_sample_step_goes_past_a_rewards_part_whose_data_pages_are_damaged(damaged_rewards, tmp_path):
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from lightning_harness.trainer import config as C
    from lightning_harness.trainer.loop import TrainingRun

    root, bad = damaged_rewards  # tmp_path / "traces": the run folder's traces
    cfg_path = tmp_path / "cfg.yaml"
    (tmp_path / "model").mkdir()
    cfg_path.write_text('model: model\nharness: {command: ["x"]}\ntasks: {train: t.jsonl}\nupdate: {lr: 1.0e-5}\n'
                        f"run_dir: {tmp_path}\n")
    run = TrainingRun(C.load_config(cfg_path), console=Console(file=io.StringIO()))
    assert run.traces == root
    idle = SimpleNamespace(flush=lambda *a, **k: {}, update=lambda *a, **k: None)  # a healthy proxy, a runner
    run.proxy, run.runner, run.progress = SimpleNamespace(control=idle), idle, idle
    groups = [SimpleNamespace(group_id="g0", rollouts=[SimpleNamespace(rollout_id=r) for r in "ab"])]
    table = run.step_samples(1, groups, 0, {})
    assert sorted(table["rollout_id"].to_pylist()) == ["a", "b"] and bad.exists()
