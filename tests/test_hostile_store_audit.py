"""The trace store against what an audit found: damage DuckDB reports without naming the file, Parquet
files of other tables or tools in a table's folder, a full disk, writer temporaries a crash left behind,
and compacted-part names.

Real Parquet parts (schemas.PartWriter, write_part), real DuckDB views, the installed console scripts
(`lightning-sql`, `lightning-train build` / `compact`) as a user runs them, a real full tmpfs.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_traces import reward, rollout, span, write_traces

from lightning_harness.schemas import TABLES, PartWriter, compact_store, compact_table, finished_parts, read_table
from lightning_harness.schemas import compact as compact_mod
from lightning_harness.schemas.parts import write_part
from lightning_harness.trainer.views import connect, define_views, past_damaged_parts

pytestmark = pytest.mark.timeout(300)
BIN = Path(sys.executable).parent


def _cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=180,
                          input=stdin)


def _files(root: Path, table: str) -> list[Path]:
    return sorted((root / table).rglob("*.parquet"))


def damaged_store(root: Path) -> tuple[Path, Path]:
    """Rollouts r0-* and r1-* (20 each, rewards 0/1), the spans of each in one part with token ids and
    incompressible text; the r0 part's data region is damaged (every byte flipped), its footer intact:
    DuckDB then fails with "don't know what type", naming no file. (root, damaged part)."""
    write_traces(root, rollouts=[rollout(f"r{i}-{j}", reward=float(j % 2)) for i in range(2) for j in range(20)])
    w = PartWriter(root, "spans", background=False, fsync=False)
    for i in range(2):
        w.extend([span(f"r{i}-{j}", 0, [(7 * j + k) % 1000 for k in range(50)], list(range(30)),
                       request_json=os.urandom(300).hex()) for j in range(20)])
        w.flush()
    bad = _files(root, "spans")[0]
    data = bytearray(bad.read_bytes())
    footer = struct.unpack("<I", data[-8:-4])[0]
    for k in range(4, len(data) - footer - 8):
        data[k] ^= 0x5A
    bad.write_bytes(bytes(data))
    with pytest.raises(duckdb.Error) as err:  # what makes this case: DuckDB's error names no file
        duckdb.connect().execute("SELECT sum(length(request_json)) FROM read_parquet(?)", [str(bad)]).fetchall()
    assert str(bad) not in str(err.value) and ".parquet" not in str(err.value)
    return root, bad


def _one_warning(stderr: str, bad: Path) -> None:
    lines = [line for line in stderr.splitlines() if str(bad) in line]
    assert len(lines) == 1 and "corrupt" in lines[0], stderr
    assert "Traceback" not in stderr, stderr


# -- 1. damaged data pages DuckDB does not name -----------------------------------------------------------


def test_lightning_sql_skips_a_damaged_part_duckdbs_error_does_not_name(tmp_path):
    root, bad = damaged_store(tmp_path / "t")
    p = _cli("lightning-sql", root, "SELECT count(*) AS n, sum(length(request_json)) AS chars FROM spans",
             "--format", "json")
    assert p.returncode == 0, p.stderr  # before the fix: "Error: query failed: don't know what type", rc 1
    assert json.loads(p.stdout) == [{"n": 20, "chars": 20 * 600}]
    _one_warning(p.stderr, bad)
    assert bad.exists()  # skipped, never moved or deleted


def test_lightning_train_build_skips_a_damaged_part_duckdbs_error_does_not_name(tmp_path):
    root, bad = damaged_store(tmp_path / "t")
    p = _cli("lightning-train", "build", root, "--json")
    assert p.returncode == 0, p.stderr  # before the fix: a traceback, rc 1
    _one_warning(p.stderr, bad)
    ids = {r[0] for r in connect(root).sql("SELECT rollout_id FROM samples").fetchall()}
    assert ids == {f"r1-{j}" for j in range(20)}


def test_the_shell_tables_command_goes_past_a_damaged_part(tmp_path):
    root, bad = damaged_store(tmp_path / "t")
    p = _cli("lightning-sql", root, "--format", "csv", stdin=".tables\nSELECT count(*) AS n FROM calls;\n")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr  # before the fix: the shell died
    rows = dict(line.split(",") for line in p.stdout.split() if "," in line)
    assert rows["spans"] == "20" and rows["calls"] == "20" and rows["rollouts"] == "40"
    assert p.stdout.split()[-2:] == ["n", "20"]  # the shell went on to the next statement
    _one_warning(p.stderr, bad)


def test_the_shell_tables_command_prints_an_error_instead_of_dying(tmp_path, monkeypatch):
    from lightning_harness.trainer import sql

    root = write_traces(tmp_path / "t", spans=[span("a", 0, [1], [2])])
    con = connect(root)

    def broken(*a, **k):
        raise duckdb.IOException("IO Error: the disk went away")

    monkeypatch.setattr(sql, "define_views", broken)
    out = io.StringIO()
    sql.shell(con, str(root), "csv", stdin=io.StringIO(".tables\nSELECT 1 AS one;\n"), out=out)
    assert out.getvalue().splitlines()[0] == "error: IO Error: the disk went away"


def test_random_damage_is_skipped_or_harmless_never_fatal(tmp_path):
    """Bytes changed at random places of one part's data region (footer intact): a query either reads
    every row (the damage hit nothing read) or skips that part; it never fails, never reads it half."""
    src = tmp_path / "src"
    w = PartWriter(src, "spans", background=False, fsync=False)
    for i in range(2):
        w.extend([span(f"r{i}-{j}", 0, list(range(50)), list(range(30)), request_json=os.urandom(300).hex())
                  for j in range(200)])
        w.flush()
    query = "SELECT count(*), sum(len(prompt_token_ids)), sum(length(request_json)) FROM spans"
    whole, other = [(400, 20_000, 240_000)], [(200, 10_000, 120_000)]
    rng, outcomes = random.Random(0), []
    for trial in range(30):
        root = tmp_path / f"t{trial}"
        shutil.copytree(src, root)
        bad = _files(root, "spans")[0]
        data = bytearray(bad.read_bytes())
        end = len(data) - struct.unpack("<I", data[-8:-4])[0] - 8
        off, n = rng.randrange(4, end - 64), rng.choice([1, 8, 64])
        for k in range(off, off + n):
            data[k] = rng.randrange(256)
        bad.write_bytes(bytes(data))
        con = connect(root)
        got = past_damaged_parts(lambda: con.sql(query).fetchall(), lambda: define_views(con, root))  # noqa: B023
        assert got in (whole, other), (trial, off, n, got)
        outcomes.append(got == other)
    assert 3 <= sum(outcomes) <= 27  # both cases were met (before the fix: 'Out of buffer' raised)


def test_a_statement_error_does_not_read_the_store(tmp_path, monkeypatch):
    """A typo names no file either; it is the statement's error, not the data's: nothing is read whole."""
    from lightning_harness.trainer import views

    root = write_traces(tmp_path / "t", spans=[span("a", 0, [1], [2])])
    con = connect(root)
    read = []
    monkeypatch.setattr(views, "_read_whole", lambda path: read.append(path))
    with pytest.raises(duckdb.BinderException):
        past_damaged_parts(lambda: con.sql("SELECT no_such_column FROM spans").fetchall(), lambda: None)
    assert read == []


# -- 3. Parquet files that are no part of the table ---------------------------------------------------------


def _foreign_store(root: Path) -> tuple[Path, Path, Path]:
    """Three parts per table, plus a query result saved among the spans (no column in common) and an
    operator's rewards export lacking reward_id. (root, foreign spans file, foreign rewards file)."""
    for i in range(3):
        write_traces(root, spans=[span(f"r{i}", 0, [1, 2], [3])], rewards=[reward(f"r{i}", 1.0)],
                     rollouts=[rollout(f"r{i}")])
    tokens = _files(root, "spans")[0].parent / "tokens.parquet"
    pq.write_table(pa.table({"task": ["a", "b", "c", "d", "e"], "score": [1.0, 2, 3, 4, 5]}), tokens)
    fix = _files(root, "rewards")[0].parent / "fix-r0.parquet"
    pq.write_table(pa.table({"rollout_id": ["r0"], "reward": [0.5]}), fix)
    return root, tokens, fix


def test_a_foreign_file_does_not_stop_the_compaction_of_the_store(tmp_path, caplog):
    root, tokens, fix = _foreign_store(tmp_path / "t")
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        reports = compact_store(root, grace_s=0)  # before the fix: ArrowInvalid, rollouts never compacted
        again = compact_store(root, grace_s=0)
    assert all(r.parts_written == 1 and r.rows_compacted == 3 for t, r in reports.items()
               if t in ("spans", "rewards", "rollouts"))
    assert all(r.parts_written == 0 for r in again.values())
    assert tokens.exists() and fix.exists()  # left in place
    for path in (tokens, fix):
        assert sum(str(path) in r.getMessage() for r in caplog.records) == 1  # one warning, not one a round
    assert {len(_files(root, t)) for t in ("spans", "rewards")} == {2} and len(_files(root, "rollouts")) == 1


def test_lightning_train_compact_goes_past_a_foreign_file(tmp_path):
    root, tokens, fix = _foreign_store(tmp_path / "t")
    p = _cli("lightning-train", "compact", root, "--grace-s", "0")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "rollouts: 3 -> 1 files" in p.stdout and tokens.exists() and fix.exists()


def test_readers_do_not_take_a_foreign_file_for_rows_of_the_table(tmp_path):
    root, tokens, fix = _foreign_store(tmp_path / "t")
    p = _cli("lightning-sql", root, "SELECT count(*) AS n, count(span_id) AS ids FROM spans", "--format", "json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [{"n": 3, "ids": 3}]  # before the fix: 8 rows, 5 of them all NULL
    assert "tokens.parquet" in p.stderr and "not a spans part" in p.stderr
    con = connect(root)
    assert "task" not in con.sql("SELECT * FROM spans").columns
    assert con.sql("SELECT count(*) FROM rewards").fetchall() == [(3,)]
    assert read_table(root, "rewards").num_rows == 3
    assert tokens in finished_parts(root, "spans")[0]  # the footer reads: a reader leaves it out by its columns


def test_a_file_replaced_in_place_is_judged_again_by_every_check(tmp_path):
    """The readers keep their per-file verdicts (footer, part of the table, read whole) in one cache keyed
    by size and mtime: a foreign or damaged file replaced by a good part under the same name is read."""
    from lightning_harness.schemas.parts import listed_parts

    root, tokens, _fix = _foreign_store(tmp_path / "t")
    bad = _files(root, "spans")[0]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # truncated: its footer is gone
    good, skipped = listed_parts(root, "spans")
    assert len(good) == 2 and set(skipped) == {bad, tokens}
    for path, rollout_id in ((tokens, "r7"), (bad, "r8")):  # a good part written where each was
        write_part(pa.Table.from_pylist([span(rollout_id, 0, [1, 2], [3])], schema=TABLES["spans"]), path,
                   {}, fsync=False)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new version even on a coarse clock
    good, skipped = listed_parts(root, "spans")
    assert set(good) >= {tokens, bad} and skipped == []
    assert sorted(r for (r,) in connect(root).sql("SELECT rollout_id FROM spans").fetchall()) == [
        "r1", "r2", "r7", "r8"]


def test_a_batch_that_cannot_be_written_leaves_its_parts_and_the_rest_goes_on(tmp_path, monkeypatch, caplog):
    """Rows pyarrow refuses to write as the table (ArrowInvalid: before the foreign-file check, nulls in
    a non-nullable column): that batch's parts stay as they are, other folders and tables are compacted."""
    root = tmp_path / "t"
    for i in range(3):
        write_traces(root, spans=[span(f"r{i}", 0, [1], [2])], rollouts=[rollout(f"r{i}")])
    day = _files(root, "spans")[0].parent
    odd = day.parent / "day=2000-01-01"  # sorts first: before the fix its failure stopped everything after it
    odd.mkdir()
    for k in range(2):
        write_part(pa.Table.from_pylist([span("n", k, [1], [2])], schema=TABLES["spans"]),
                   odd / f"part-000000000000{k}-1-ext-000000.parquet", {}, fsync=False)
    real = compact_mod.write_part

    def refusing(data, final, *a, **k):
        if final.parent == odd:
            raise pa.ArrowInvalid("Column 'span_id' is declared non-nullable but contains nulls")
        return real(data, final, *a, **k)

    monkeypatch.setattr(compact_mod, "write_part", refusing)
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        reports = compact_store(root, grace_s=0)  # before the fix: ArrowInvalid out of compact_store
        compact_store(root, grace_s=0)
    assert reports["spans"].parts_written == 1 and reports["rollouts"].parts_written == 1
    assert sorted(p.name for p in odd.iterdir()) == [f"part-000000000000{k}-1-ext-000000.parquet" for k in range(2)]
    assert len(list(day.glob("*.parquet"))) == 1 and len(_files(root, "rollouts")) == 1
    assert sum("not compacting 2 spans parts" in r.getMessage() for r in caplog.records) == 1  # once, not a round
    assert connect(root).sql("SELECT count(*) FROM spans").fetchall() == [(5,)]


def test_the_loops_sample_step_goes_on_when_compaction_fails(tmp_path, monkeypatch):
    """The loop compacts before each update; a full disk there (OSError out of compact_store) stopped
    the training step although the store is correct uncompacted."""
    from rich.console import Console

    import lightning_harness.schemas as schemas_pkg
    from lightning_harness.trainer import config as C
    from lightning_harness.trainer.loop import TrainingRun

    root = write_traces(tmp_path / "traces", spans=[span("a", 0, [1, 2], [10, 11]), span("b", 0, [1, 2], [14])],
                        rollouts=[rollout("a", reward=1.0), rollout("b", reward=0.0)])
    cfg_path = tmp_path / "cfg.yaml"
    (tmp_path / "model").mkdir()
    cfg_path.write_text('model: model\nharness: {command: ["x"]}\ntasks: {train: t.jsonl}\nupdate: {lr: 1.0e-5}\n'
                        f"run_dir: {tmp_path}\n")
    console = io.StringIO()
    run = TrainingRun(C.load_config(cfg_path), console=Console(file=console, width=300))
    assert run.traces == root

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(schemas_pkg, "compact_store", full)
    idle = SimpleNamespace(flush=lambda *a, **k: {}, update=lambda *a, **k: None)
    run.proxy, run.runner, run.progress = SimpleNamespace(control=idle), idle, idle
    groups = [SimpleNamespace(group_id="g0", rollouts=[SimpleNamespace(rollout_id=r) for r in "ab"])]
    rep: dict = {}
    table = run.step_samples(1, groups, 0, rep)  # before the fix: OSError
    assert sorted(table["rollout_id"].to_pylist()) == ["a", "b"] and "time/compact_s" in rep
    assert "No space left on device" in console.getvalue()


# -- 4. a full disk, writer temporaries ---------------------------------------------------------------------


def test_lightning_train_compact_on_a_full_disk_says_so_in_one_line(small_disk):
    root = small_disk.path / "traces"
    w = PartWriter(root, "spans", background=False, fsync=False)
    for i in range(30):
        w.extend([span(f"r{i}", k, list(range(200)), list(range(100)), span_id=f"s{i}-{k}",
                       request_json=os.urandom(1000).hex()) for k in range(3)])
        w.flush()
    small_disk.fill()
    p = _cli("lightning-train", "compact", root, "--grace-s", "0")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr  # before the fix: a traceback
    assert p.stderr.strip().splitlines() == [p.stderr.strip().splitlines()[-1]]
    assert "compaction stopped" in p.stderr and "No space left" in p.stderr
    assert connect(root).sql("SELECT count(*), count(DISTINCT span_id) FROM spans").fetchall() == [(90, 90)]
    small_disk.free()
    assert compact_table(root, "spans", grace_s=0).files_after == 1
    assert connect(root).sql("SELECT count(*), count(DISTINCT span_id) FROM spans").fetchall() == [(90, 90)]


def test_a_killed_writers_old_temporary_is_removed_a_live_ones_is_not(tmp_path):
    root = write_traces(tmp_path / "t", spans=[span("a", 0, [1], [2])])
    write_traces(root, spans=[span("b", 0, [1], [2])])
    day = _files(root, "spans")[0].parent
    lone = day.parent / "day=2000-01-01"  # a folder whose only file is a killed writer's temporary
    lone.mkdir()
    old = [day / ".part-1-1-deadbeef-000000.parquet.tmp", lone / ".part-2-1-deadbeef-000001.parquet.tmp"]
    young = day / ".part-3-1-deadbeef-000002.parquet.tmp"
    other = day / ".notes.tmp"  # not a writer's: never touched
    for path in (*old, young, other):
        path.write_bytes(b"PAR1 half a part")
    long_ago = time.time() - compact_mod.WRITER_TMP_AGE_S - 60
    for path in (*old, other):
        os.utime(path, (long_ago, long_ago))
    compact_table(root, "spans", grace_s=0)
    assert not any(p.exists() for p in old)  # before the fix: kept for ever
    assert young.exists() and other.exists()
    assert connect(root).sql("SELECT count(*) FROM spans").fetchall() == [(2,)]


# -- compacted-part names ------------------------------------------------------------------------------------


def test_batches_compacted_in_one_millisecond_get_names_of_their_own(tmp_path, monkeypatch):
    """Inputs of one writer whose tag starts with "c", in one millisecond: cutting the name at its first
    "-c" gave every batch one name, so each compacted part replaced the one before."""
    root = tmp_path / "t"
    day = root / "spans" / "day=2026-01-01"
    day.mkdir(parents=True)
    for k in range(6):
        table = pa.Table.from_pylist([span("r", k, [1], [2], span_id=f"s{k}")], schema=TABLES["spans"])
        write_part(table, day / f"part-1700000000000-1-c0ffee00-{k:06d}.parquet", {}, fsync=False)
    size = max(p.stat().st_size for p in day.iterdir())
    frozen = time.time() + 1000
    monkeypatch.setattr(compact_mod, "time", SimpleNamespace(time=lambda: frozen, monotonic=time.monotonic,
                                                             sleep=time.sleep))
    rep = compact_table(root, "spans", grace_s=0, fsync=False, target_bytes=2 * size + 10)  # batches of two
    names = sorted(p.name for p in day.glob("*.parquet"))
    assert rep.parts_written == 3 and len(names) == 3, names  # before the fix: 1 compacted part + 4 inputs
    assert all(n.startswith("part-1700000000000-1-c0ffee00-0000") for n in names)
    assert sorted(r[0] for r in connect(root).sql("SELECT span_id FROM spans").fetchall()) == [f"s{k}" for k in
                                                                                              range(6)]
    monkeypatch.undo()
    compact_table(root, "spans", grace_s=0, fsync=False)
    (final,) = day.glob("*.parquet")
    assert len(re.findall(r"-c\d{13}-", final.name)) == 1  # names do not grow
