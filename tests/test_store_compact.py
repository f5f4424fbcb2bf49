"""Compaction of the trace store (schemas/compact.py): every row exactly once, through crashes,
beside concurrent readers and writers; the CLI, the proxy and the loop compact; samples unchanged.

Real Parquet parts (schemas.PartWriter), real DuckDB views, real subprocesses killed mid-way.
"""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from click.testing import CliRunner
from fixtures_traces import reward, rollout, span, write_traces
from rich.console import Console

from lightning_harness.schemas import PartWriter, compact_store, compact_table, finished_parts, read_table
from lightning_harness.schemas.checked import replaced_parts
from lightning_harness.trainer.samples import build_samples
from lightning_harness.trainer.views import connect, define_views, past_damaged_parts

pytestmark = pytest.mark.timeout(180)


def small_store(root: Path, rollouts: int = 12, calls: int = 3, groups: int = 3) -> Path:
    """One part per rollout per table (like a proxy flushing every second): many small parts."""
    for r in range(rollouts):
        rid = f"run-s{r % groups}-t{r}-0"
        prompt = [1, 2, 3]
        rows = []
        for seq in range(calls):
            resp = [10 + r, 20 + seq]
            rows.append(span(rid, seq, list(prompt), resp, model_version=r % groups))
            prompt = prompt + resp + [7]
        write_traces(root, spans=rows,
                     rollouts=[rollout(rid, group_id=f"g{r % groups}", step=r % groups, reward=float(r % 2))],
                     rewards=[reward(rid, float(r % 2))])
    return root


def span_ids(root: Path) -> list[str]:
    con = connect(root)
    return sorted(r[0] for r in con.sql("SELECT span_id FROM spans").fetchall())


def files(root: Path, table: str) -> int:
    return len([p for p in (root / table).glob("**/*.parquet")])


def test_compaction_keeps_every_row_exactly_once(tmp_path):
    root = small_store(tmp_path / "t")
    before = {t: read_table(root, t) for t in ("spans", "rollouts", "rewards")}
    ids = span_ids(root)
    assert files(root, "spans") == 12 and len(ids) == 36
    reports = compact_store(root, grace_s=0)
    assert reports["spans"].files_before == 12 and reports["spans"].files_after == 1
    assert reports["spans"].rows_compacted == 36 and reports["spans"].parts_removed == 12
    for t, table in before.items():
        assert files(root, t) == 1
        after = read_table(root, t)
        assert after.num_rows == table.num_rows
        key = "span_id" if t == "spans" else ("reward_id" if t == "rewards" else "rollout_id")
        assert sorted(after[key].to_pylist()) == sorted(table[key].to_pylist())
        assert after.sort_by(key).equals(table.sort_by(key).select(after.column_names))
    assert span_ids(root) == ids
    # more parts arrive; a second round merges them with the compacted part
    late = span("late", 0, [1], [2])
    write_traces(root, spans=[late])
    compact_store(root, grace_s=0)
    assert files(root, "spans") == 1 and span_ids(root) == sorted(ids + [late["span_id"]])
    # names do not grow (one compaction suffix; a writer tag may start with "c" itself)
    assert [len(re.findall(r"-c\d{13}-", p.name)) for p in (root / "spans").glob("**/*.parquet")] == [1]


def test_a_batch_is_bounded_by_its_uncompressed_size_not_only_its_file_size(tmp_path):
    """Agent contexts compress a hundredfold: batches sized by file alone read gigabytes at once."""
    root = tmp_path / "t"
    request = json.dumps({"messages": [{"content": "the same long context " * 25_000}]})  # 550 KB
    for r in range(6):  # three equal rows a part: Parquet's own sizes count the value once
        write_traces(root, spans=[{**span(f"big-{r}", seq, [1, 2], [3]), "request_json": request}
                                  for seq in range(3)])
    parts = sorted((root / "spans").glob("**/*.parquet"))
    assert sum(p.stat().st_size for p in parts) < 200_000  # all six fit one batch by file size
    rep = compact_table(root, "spans", raw_bytes=3_500_000, grace_s=0)  # about two parts' rows
    assert rep.parts_written == 3 and rep.rows_compacted == 18 and files(root, "spans") == 3
    assert len(span_ids(root)) == 18
    assert compact_table(root, "spans", grace_s=0).parts_written == 1  # the default budget takes them all


def test_replaced_parts_stay_for_the_grace_period_but_are_never_read_twice(tmp_path):
    root = small_store(tmp_path / "t")
    ids = span_ids(root)
    stale = connect(root)  # listed the small parts before the compaction
    rep = compact_table(root, "spans", grace_s=60)
    assert rep.parts_replaced == 12 and rep.parts_removed == 0
    assert files(root, "spans") == 13  # inputs still on disk ...
    assert len(finished_parts(root, "spans")[0]) == 1  # ... but left out by every new reader
    assert span_ids(root) == ids
    assert sorted(r[0] for r in stale.sql("SELECT span_id FROM spans").fetchall()) == ids  # old listing still reads
    assert compact_table(root, "spans", grace_s=60).parts_removed == 0  # not yet
    assert compact_table(root, "spans", grace_s=0).parts_removed == 12
    assert files(root, "spans") == 1 and span_ids(root) == ids
    # a connection whose listing lost its files redefines and retries
    assert past_damaged_parts(lambda: stale.sql("SELECT count(*) FROM spans").fetchall(),
                              lambda: define_views(stale, root)) == [(36,)]



def test_a_plain_reader_handed_the_listed_parts_reads_no_row_twice_in_the_grace_period(tmp_path):
    """docs/SQL.md's recipe for DuckDB, pandas or polars without the views: a glob counts the compacted
    rows twice while the replaced parts wait out their grace period; the listed parts do not."""
    import duckdb

    from lightning_harness.schemas import listed_parts

    root = small_store(tmp_path / "t")
    compact_table(root, "spans", grace_s=60)
    glob = duckdb.sql(f"SELECT count(*) FROM read_parquet('{root}/spans/**/*.parquet')").fetchall()[0][0]
    listed = [str(p) for p in listed_parts(root, "spans")[0]]
    assert glob == 72 and duckdb.sql(f"SELECT count(*) FROM read_parquet({listed})").fetchall()[0][0] == 36


@pytest.mark.parametrize("stage", ["written", "committed", "removed"])
def test_an_injected_failure_at_any_step_loses_and_duplicates_nothing(tmp_path, stage):
    root = small_store(tmp_path / "t")
    ids = span_ids(root)

    def fail(at):
        if at == stage:
            raise RuntimeError(f"crash at {at}")

    with pytest.raises(RuntimeError, match="crash"):
        compact_table(root, "spans", grace_s=0, on_step=fail)
    assert span_ids(root) == ids
    assert not list((root / "spans").glob("**/.compact-*"))  # no temporary left visible or behind
    compact_table(root, "spans", grace_s=0)  # the next run finishes the job
    assert span_ids(root) == ids and files(root, "spans") == 1


KILLER = """
import os, signal, sys
from lightning_harness.schemas import compact_table
def die(at):
    if at == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
compact_table(sys.argv[1], "spans", grace_s=0, on_step=die)
"""


@pytest.mark.parametrize("stage", ["written", "committed", "removed"])
def test_a_compaction_killed_mid_way_loses_and_duplicates_nothing(tmp_path, stage):
    root = small_store(tmp_path / "t")
    ids = span_ids(root)
    proc = subprocess.run([sys.executable, "-c", KILLER, str(root), stage], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert span_ids(root) == ids  # what a reader sees right after the crash
    if stage == "written":
        assert list((root / "spans").glob("**/.compact-*.tmp"))  # the killed run's temporary, hidden
    rep = compact_table(root, "spans", grace_s=0)  # the lock died with the process
    assert rep.skipped is None
    assert span_ids(root) == ids and files(root, "spans") == 1
    assert not list((root / "spans").glob("**/.compact-*"))


def test_readers_see_consistent_counts_while_writers_and_compaction_run(tmp_path):
    root = tmp_path / "t"
    writer = PartWriter(root, "spans", background=False, fsync=False)
    written, stop, errors = [0], threading.Event(), []

    def write():
        i = 0
        while not stop.is_set():
            writer.extend([span(f"r{i}", k, [1, 2], [3]) for k in range(5)])
            writer.flush()
            written[0] += 5
            i += 1
            time.sleep(0.005)

    def compact():
        while not stop.is_set():
            compact_table(root, "spans", grace_s=0.5, target_bytes=1 << 20, fsync=False)
            time.sleep(0.05)

    def reporting(work):  # a writer or compactor that dies must fail the test, not leave it reading a still store
        def run():
            try:
                work()
            except BaseException as e:
                errors.append(e)
                stop.set()
        return run

    threads = [threading.Thread(target=reporting(write)), threading.Thread(target=reporting(compact))]
    for t in threads:
        t.start()
    try:
        last, checks, deadline = 0, 0, time.monotonic() + 8
        while time.monotonic() < deadline:
            floor = written[0]  # rows written before this read started: all must be seen
            con = connect(root) if (root / "spans").exists() else None
            if con is None:
                continue
            total, distinct = past_damaged_parts(
                lambda con=con: con.sql("SELECT count(*), count(DISTINCT span_id) FROM spans").fetchall()[0],
                lambda con=con: define_views(con, root))
            assert total == distinct, "a row was read twice"
            assert total >= max(last, floor - 0), "a row was missed"
            last, checks = total, checks + 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert checks >= 5
    assert len(span_ids(root)) == written[0]
    compact_table(root, "spans", grace_s=0)
    assert len(span_ids(root)) == written[0] and files(root, "spans") <= 2


def test_samples_are_identical_before_and_after_compaction(tmp_path):
    root = small_store(tmp_path / "t")
    where = "group_id IN ('g1', 'g2')"
    before, stats = build_samples(root, where=where)
    assert before.num_rows == 8 and stats["rollouts_selected"] == 8
    pruned, _ = build_samples(root, where=where, rollouts=[f"run-s{r % 3}-t{r}-0" for r in range(12) if r % 3])
    compact_store(root, grace_s=0)
    after, _ = build_samples(root, where=where)
    assert files(root, "spans") == 1
    assert after.equals(before) and pruned.equals(before)
    # only the rollouts named are read, and only they can be selected
    one, st = build_samples(root, where=where, rollouts=["run-s1-t1-0"])
    assert one["rollout_id"].to_pylist() == ["run-s1-t1-0"] and st["spans_read"] == 3


def test_the_cli_compacts_a_store(tmp_path):
    from lightning_harness.trainer.cli import main

    root = small_store(tmp_path / "t")
    ids = span_ids(root)
    out = CliRunner().invoke(main, ["compact", str(root), "--grace-s", "0"])
    assert out.exit_code == 0, out.output
    assert "spans: 12 -> 1 files (36 rows" in out.output
    assert all(files(root, t) == 1 for t in ("spans", "rollouts", "rewards"))
    assert span_ids(root) == ids
    # with a grace period the command waits it out, then removes the replaced parts itself
    other = small_store(tmp_path / "u")
    waited = CliRunner().invoke(main, ["compact", str(other), "--grace-s", "0.5", "--table", "spans"])
    assert waited.exit_code == 0 and "12 replaced part(s) removed" in waited.output, waited.output
    assert files(other, "spans") == 1 and files(other, "rollouts") == 12
    helped = CliRunner().invoke(main, ["compact", "--help"])
    assert "Example:" in helped.output and "lightning-train compact" in helped.output
    bad = CliRunner().invoke(main, ["compact", str(root), "--grace-s", "-1"])
    assert bad.exit_code != 0 and "grace" in bad.output


def test_the_proxy_compacts_its_tables(make_proxy, tmp_path):
    proxy = make_proxy(flush_seconds=0.05, extra_args=["--compact-seconds", "1"])
    url = proxy.env_for("r")["OPENAI_BASE_URL"] + "/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(12):
        assert httpx.post(url, json=body, timeout=60, trust_env=False).status_code == 200
        time.sleep(0.15)  # one part per call
    proxy.control.flush()
    root = Path(proxy.traces_dir)
    assert files(root, "spans") >= 12  # one part per call as written
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(finished_parts(root, "spans")[0]) > 3:
        time.sleep(0.5)
    # each round merges what is new; a compacted part joins the next round once its inputs are gone
    parts = finished_parts(root, "spans")[0]
    assert len(parts) <= 3 and any(replaced_parts(p) for p in parts)
    assert len(span_ids(root)) == 12


def test_the_loop_compacts_and_builds_samples_outside_the_hold(make_proxy, tmp_path):
    from lightning_harness.trainer import config as C
    from lightning_harness.trainer.loop import TrainingRun

    class Recorder:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return lambda *a, **k: self.calls.append(name)

    cfg_path = tmp_path / "cfg.yaml"
    (tmp_path / "model").mkdir()
    cfg_path.write_text('model: model\nharness: {command: ["x"]}\ntasks: {train: t.jsonl}\nupdate: {lr: 1.0e-5}\n'
                        f'run_dir: {tmp_path / "run"}\n')
    run = TrainingRun(C.load_config(cfg_path), console=Console(file=io.StringIO()))
    small_store(run.traces)
    run.proxy = make_proxy(traces_dir=run.traces)
    run.engine, run.runner, run.progress = Recorder(), Recorder(), Recorder()
    run.state = {"model_version": 2}
    groups = [SimpleNamespace(group_id=f"g{g}", rollouts=[SimpleNamespace(rollout_id=f"run-s{g}-t{r}-0")
                                                            for r in range(12) if r % 3 == g]) for g in (1, 2)]
    rep: dict = {}
    table = run.step_samples(3, groups, 2, rep)
    assert table.num_rows == 8 and set(table["step"].to_pylist()) == {3}
    assert "pause" not in run.engine.calls and "flush" in run.runner.calls  # before any hold
    # compacted (the replaced parts stay on disk for the grace period, left out by every reader)
    assert len(finished_parts(run.traces, "spans")[0]) == 1 and len(finished_parts(run.traces, "rollouts")[0]) == 1
    assert rep["store/files"] <= 5 and rep["time/samples_s"] >= rep["time/build_s"]
    assert read_table(run.traces, "samples").num_rows == 8


@pytest.mark.parametrize("how", ["compact_store", "cli"])
def test_a_footer_naming_files_outside_its_folder_never_gets_them_deleted(tmp_path, how):
    """A part (a store received from elsewhere) claiming to replace '../..' paths is corrupt: compaction
    deletes neither the file outside the store nor another table's part, and readers keep both."""
    import os

    import pyarrow as pa

    from lightning_harness.schemas import TABLES
    from lightning_harness.schemas.checked import COMPACTED_FROM
    from lightning_harness.schemas.parts import write_part
    from lightning_harness.trainer.cli import main

    victim = tmp_path / "victim.txt"
    victim.write_text("precious, outside the store\n")
    root = write_traces(tmp_path / "traces", spans=[span("a", 0, [1], [2])], rollouts=[rollout("a", reward=1.0)])
    (rpart,) = (root / "rollouts").rglob("*.parquet")
    day = next((root / "spans").iterdir())
    hostile = day / "part-0000000000001-1-000000.parquet"
    names = [os.path.relpath(victim, day), os.path.relpath(rpart, day)]
    write_part(pa.Table.from_pylist([span("b", 0, [1], [2])], schema=TABLES["spans"]), hostile,
               {COMPACTED_FROM: json.dumps(names).encode()}, fsync=False)
    os.utime(hostile, (time.time() - 3600, time.time() - 3600))  # long past any grace period
    if how == "cli":
        out = CliRunner().invoke(main, ["compact", str(root), "--grace-s", "0"])
        assert out.exit_code == 0, out.output
    else:
        compact_store(root, grace_s=0)
    assert victim.read_text() == "precious, outside the store\n" and rpart.exists()
    assert hostile in finished_parts(root, "spans")[1]  # skipped as corrupt, left on disk
    assert read_table(root, "rollouts")["rollout_id"].to_pylist() == ["a"]
    assert connect(root).sql("SELECT rollout_id FROM spans").fetchall() == [("a",)]


def test_build_replace_leaves_no_old_sample_behind_a_compaction_running_meanwhile(tmp_path, monkeypatch):
    """`lightning-train build --replace` lists the old sample parts, builds, then removes them. A
    compaction (the CLI's, another process's) that folded them into a new part in between left that
    part behind: the old samples stayed beside the new ones and were trained on twice."""
    from lightning_harness.trainer import build as B
    from lightning_harness.trainer.cli import main

    root = small_store(tmp_path / "t")
    for _ in range(3):  # three sample parts, as three earlier builds (or loop steps) wrote them
        PartWriter(root, "samples", background=False).write_table(build_samples(root)[0])
    real = B.build_samples

    def build_while_compacting(*args, **kwargs):
        compact_table(root, "samples", grace_s=0)  # what another process may do at this moment
        return real(*args, **kwargs)

    monkeypatch.setattr(B, "build_samples", build_while_compacting)
    out = CliRunner().invoke(main, ["build", str(root), "--replace"])
    assert out.exit_code == 0, out.output
    assert read_table(root, "samples").num_rows == 12  # before the fix: 48, the 36 old samples survived
