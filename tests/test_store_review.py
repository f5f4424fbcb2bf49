"""The trace store's readers and compaction after a review: errors of the system taken for damage,
parts typed in another family, roots pyarrow took for URIs, names too long, memory errors while encoding.

Real Parquet parts, real DuckDB views, a real low file-descriptor limit (resource.setrlimit, in a
subprocess), real paths past NAME_MAX and PATH_MAX; only a lack of memory is patched (narrowly).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_traces import reward, span, write_traces

from lightning_harness.schemas import TABLES, PartWriter, compact_store, compact_table, read_table, salvage
from lightning_harness.schemas.checked import replaced_parts
from lightning_harness.schemas.parts import write_part
from lightning_harness.trainer.views import connect

pytestmark = pytest.mark.timeout(180)
TESTS = str(Path(__file__).parent)


def _run(code: str, *args) -> str:
    """``code`` in a fresh interpreter (a file-descriptor limit there leaves this process alone); its stdout."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                       text=True, timeout=150, env={**os.environ, "PYTHONPATH": TESTS})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _day(root: Path, table: str) -> Path:
    (day,) = [p for p in (root / table).iterdir() if p.is_dir()]
    return day


# -- 1. the system refusing a part is not damage ---------------------------------------------------------


def test_a_query_under_too_many_open_files_hides_no_part_for_the_rest_of_the_process(tmp_path):
    """DuckDB's "Cannot open file ...: Too many open files" named an existing part, so past_damaged_parts
    marked it corrupt for good: once the limit was back the process still read 1 row of 60."""
    out = _run("""
        import os, resource, sys
        from pathlib import Path
        import duckdb
        from fixtures_traces import span, write_traces
        from lightning_harness.trainer.views import connect, define_views, past_damaged_parts
        root = Path(sys.argv[1])
        for i in range(60):
            write_traces(root, spans=[span(f"r{i}", 0, [1], [2])])
        con = connect(root)
        count = lambda: con.sql("SELECT count(*) FROM spans").fetchall()[0][0]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
        try:
            print("under", past_damaged_parts(count, lambda: define_views(con, root)))
        except duckdb.IOException as exc:
            print("under raised", "Too many open files" in str(exc))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        define_views(con, root)
        print("after", count())
    """, tmp_path / "t")
    assert out.splitlines()[-1] == "after 60", out  # before the fix: after 1
    assert out.splitlines()[0] in ("under 60", "under raised True"), out


def test_a_part_read_under_too_many_open_files_is_read_again_once_it_can_be(tmp_path):
    """parts.read_table marked a part whose data read failed with EMFILE corrupt for the rest of the process.
    The limit is lowered right after the parts are listed (a hook around listed_parts): the error is real."""
    out = _run("""
        import os, resource, sys
        from pathlib import Path
        from fixtures_traces import span, write_traces
        from lightning_harness.schemas import parts, read_table
        root = Path(sys.argv[1])
        for i in range(5):
            write_traces(root, spans=[span(f"r{i}", 0, [1], [2])])
        print("before", read_table(root, "spans").num_rows)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        listed, filler = parts.listed_parts, []

        def then_no_fd_left(*a, **k):
            found = listed(*a, **k)
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
            while True:  # every descriptor under the limit taken
                try:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    return found

        parts.listed_parts = then_no_fd_left
        print("under", read_table(root, "spans").num_rows)
        parts.listed_parts = listed
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("after", read_table(root, "spans").num_rows)
    """, tmp_path / "t")
    before, under, after = out.splitlines()
    assert before == "before 5" and int(under.split()[1]) < 5, out  # the condition was made: a part refused
    assert after == "after 5", out  # before the fix: the refused parts stayed hidden


def test_a_compaction_under_too_many_open_files_hides_no_part_and_compacts_later(tmp_path):
    """compact._read_parts marked a part whose data read failed with EMFILE corrupt: hidden from every later
    read of the process and never compacted. The limit is lowered while the batch is read (a hook)."""
    out = _run("""
        import os, resource, sys
        from pathlib import Path
        from fixtures_traces import span, write_traces
        from lightning_harness.schemas import compact, compact_table, read_table
        root = Path(sys.argv[1])
        for i in range(4):
            write_traces(root, spans=[span(f"r{i}", 0, [1], [2])])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        read_parts = compact._read_parts

        def with_no_fd_left(batch):
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
            filler = []
            try:
                while True:  # every descriptor under the limit taken
                    filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            try:
                return read_parts(batch)
            finally:
                for fd in filler:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

        compact._read_parts = with_no_fd_left
        print("under", compact_table(root, "spans", grace_s=0).parts_written)
        compact._read_parts = read_parts
        print("read", read_table(root, "spans").num_rows)
        print("again", compact_table(root, "spans", grace_s=0).parts_written, read_table(root, "spans").num_rows)
    """, tmp_path / "t")
    assert out.splitlines() == ["under 0", "read 4", "again 1 4"], out  # before the fix: read 0, again 0 0


def _damage_data(path: Path) -> None:
    """Flip every byte between the magic and the footer: the footer reads, the data does not."""
    data = bytearray(path.read_bytes())
    footer = struct.unpack("<I", data[-8:-4])[0]
    for k in range(4, len(data) - footer - 8):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_damaged_compacted_part_never_makes_its_inputs_compactable_again(tmp_path):
    """mark_bad forgot the names a compacted part's footer gives: its inputs, on disk for the grace period,
    were compacted a second time (their rows stored twice for every reader that reads both)."""
    root = tmp_path / "t"
    for i in range(2):
        write_traces(root, spans=[span(f"r{i}", k, [1], [2], request_json=os.urandom(200).hex()) for k in range(3)])
    assert compact_table(root, "spans", grace_s=300).parts_written == 1
    (compacted,) = [p for p in _day(root, "spans").glob("*.parquet") if replaced_parts(p)]
    _damage_data(compacted)
    assert read_table(root, "spans").num_rows == 6  # the compacted part is skipped, its inputs read instead
    again = compact_table(root, "spans", grace_s=300)
    assert again.parts_written == 0, again  # before the fix: 1 (the inputs compacted a second time)
    assert len(list(_day(root, "spans").glob("*.parquet"))) == 3  # inputs kept: the only good copy
    assert read_table(root, "spans").num_rows == 6


# -- 2. a part typed in another family ---------------------------------------------------------------------


def test_a_part_with_a_column_of_another_type_family_is_left_out_and_the_store_reads(tmp_path, caplog):
    """A rewards part whose created_at is text (rows round-tripped through JSON) made every query of the
    store fail, SELECT 1 included; int32 for int64 and a timestamp without time zone still read."""
    root = write_traces(tmp_path / "t", spans=[span("r0", k, [1, 2], [3]) for k in range(2)],
                        rewards=[reward("r0", 1.0)])
    row = reward("odd", 0.5)
    text = pa.Table.from_pylist([{**row, "created_at": str(row["created_at"])}])
    pq.write_table(text, _day(root, "rewards") / "restored.parquet")
    spans = TABLES["spans"]
    narrow = spans.set(spans.get_field_index("attempt"), pa.field("attempt", pa.int32()))
    narrow = narrow.set(narrow.get_field_index("started_at"), pa.field("started_at", pa.timestamp("us")))
    old = {**span("old", 0, [1], [2]), "started_at": dt.datetime(2026, 1, 1)}
    write_part(pa.Table.from_pylist([old], schema=narrow), _day(root, "spans") / "part-1-old.parquet", {},
               fsync=False)
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        con = connect(root)  # before the fix: BinderException (VARCHAR vs TIMESTAMP WITH TIME ZONE)
        assert con.sql("SELECT 1").fetchall() == [(1,)]
        assert con.sql("SELECT rollout_id, reward FROM rollouts ORDER BY 1").fetchall() == [
            ("old", None), ("r0", 1.0)]
        assert con.sql("SELECT count(*) FROM spans").fetchall() == [(3,)]
        assert read_table(root, "rewards")["rollout_id"].to_pylist() == ["r0"]
        connect(root)
    warned = [r.getMessage() for r in caplog.records if "restored.parquet" in r.getMessage()]
    assert len(warned) == 1 and "created_at" in warned[0], warned
    assert (_day(root, "rewards") / "restored.parquet").exists()


# -- 3. a relative root pyarrow takes for a URI --------------------------------------------------------------


@pytest.mark.parametrize("name", ["exp:2/traces", "s3:tmp", "file:rel"])
def test_a_relative_root_that_looks_like_a_uri_reads_and_compacts(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    for i in range(3):
        write_traces(name, spans=[span(f"r{i}", 0, [1], [2])])
    assert read_table(name, "spans").num_rows == 3  # before the fix: 0 (every part "corrupt")
    assert compact_table(name, "spans", grace_s=0).parts_written == 1
    assert connect(name).sql("SELECT count(*) FROM spans").fetchall() == [(3,)]
    assert len(list(Path(name).rglob("*.parquet"))) == 1


# -- 4. names too long for a compacted part ----------------------------------------------------------------


def test_a_long_part_name_is_compacted_and_later_tables_too(tmp_path):
    """A legal part name of 242 characters made the compacted name exceed NAME_MAX: the OSError stopped
    compact_store at spans every round, and rewards (and the tables after it) were never compacted."""
    root = tmp_path / "t"
    for i in range(2):
        write_traces(root, spans=[span(f"r{i}", 0, [1], [2])], rewards=[reward(f"r{i}", 1.0)])
    first = sorted(_day(root, "spans").glob("*.parquet"))[0]
    first.rename(first.with_name("part-0000000000000-" + "a" * 215 + ".parquet"))
    reports = compact_store(root, grace_s=0)  # before the fix: OSError (File name too long)
    assert reports["spans"].parts_written == 1 and reports["rewards"].parts_written == 1
    (part,) = _day(root, "spans").glob("*.parquet")
    assert len(part.name) < 255 - len(".compact-.tmp")
    assert read_table(root, "spans").num_rows == 2 and read_table(root, "rewards").num_rows == 2


def test_a_folder_whose_compacted_part_cannot_be_named_leaves_the_others_compacted(tmp_path, caplog):
    """Any OSError of one folder (here a path past PATH_MAX for the compacted part's temporary only) stopped
    compact_store: the other folders of the table and every later table were never compacted."""
    root = tmp_path / "t"
    for i in range(2):
        write_traces(root, spans=[span(f"r{i}", 0, [1], [2])], rewards=[reward(f"r{i}", 1.0)])
    day = _day(root, "spans")
    deep = root / "spans"  # sorted before day=...: compacted first
    while len(str(deep)) < 4060 - 250:
        deep = deep / ("a" * 240)
    deep = deep / ("a" * (4060 - len(str(deep)) - 1))
    deep.mkdir(parents=True)
    for i, src in enumerate(sorted(day.glob("*.parquet"))):
        pq.write_table(pq.read_table(src), deep / f"p-{i}.parquet")
        write_traces(root, spans=[span(f"s{i}", 0, [1], [2])])
    assert len(str(deep / "p-0.parquet")) < 4095 < len(str(deep / ".compact-p-0-c0000000000000-1-1.parquet.tmp"))
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        reports = compact_store(root, grace_s=0)  # before the fix: OSError (File name too long)
        compact_store(root, grace_s=0)
    assert reports["spans"].parts_written == 1 and reports["rewards"].parts_written == 1
    assert len(list(day.glob("*.parquet"))) == 1 and len(list(deep.glob("*.parquet"))) == 2
    assert sum("not compacting" in r.getMessage() and "p-0.parquet" in r.getMessage() for r in caplog.records) == 1
    assert read_table(root, "spans").num_rows == 6


# -- 5. a lack of memory while encoding is no bad data -------------------------------------------------------


def test_a_memory_error_while_encoding_keeps_the_rows_for_a_retry(tmp_path, monkeypatch):
    """ENCODE_ERRORS caught MemoryError: the batch was salvaged row by row and rows were dropped as lost."""
    real, calls = salvage._table, []

    def tight(rows, schema):  # memory is short for the first attempts only (what a patch alone can make)
        calls.append(len(rows))
        if len(calls) <= 60:
            raise pa.ArrowMemoryError("malloc of size 67108864 failed")
        return real(rows, schema=schema)

    monkeypatch.setattr(salvage, "_table", tight)
    w = PartWriter(tmp_path, "spans", background=False, fsync=False)
    w.extend([span(f"r{i}", 0, [1], [2]) for i in range(40)])
    with pytest.raises(MemoryError):
        w.flush()
    h = w.health()
    assert (h["rows_lost"], h["rows_salvaged"], h["rows_pending"]) == (0, 0, 40), h  # before: 20 lost
    assert not w.healthy and w.retry_in > 0
    calls.extend([0] * 60)
    w.flush()
    t = read_table(tmp_path, "spans")
    assert t.num_rows == 40 and not any(t["salvaged"].to_pylist())
    assert w.health()["rows_lost"] == 0


# -- 6. an extra column typed two ways -----------------------------------------------------------------------


def test_parts_disagreeing_on_an_extra_columns_type_no_longer_block_their_batch(tmp_path, caplog):
    """Two parts with the same column the table lacks, typed differently, joined one batch: it failed to unify
    ("schemas differ") every round, so none of the parts around them was ever compacted."""
    root = tmp_path / "t"
    for i in range(5):
        write_traces(root, spans=[span(f"r{i}", 0, [1], [2])])
    day = _day(root, "spans")
    for k, typ, value in ((1, pa.int64(), 1), (2, pa.string(), "a")):
        schema = TABLES["spans"].append(pa.field("extra", typ))
        write_part(pa.Table.from_pylist([{**span("new", k, [1], [2]), "extra": value}], schema=schema),
                   day / f"part-000000000000{k}-1-x-{k}.parquet", {}, fsync=False)
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        first = compact_table(root, "spans", grace_s=0)  # before the fix: 0 parts written, every round
        for _ in range(2):
            compact_table(root, "spans", grace_s=0)
    assert first.parts_written == 1 and first.parts_replaced == 6 and len(list(day.glob("*.parquet"))) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "schemas differ" in m]
    apart = [m for m in messages if "apart from the parts before it" in m]
    assert len(apart) == len(set(apart)) >= 1  # one warning per part, not one a round
    assert sorted(read_table(root, "spans")["rollout_id"].to_pylist()) == ["new", "new", "r0", "r1", "r2", "r3", "r4"]


# -- 7. a fraction in an integer column ---------------------------------------------------------------------


def test_a_fraction_or_a_bool_in_an_integer_column_is_not_truncated_into_a_real_looking_value(tmp_path):
    """pyarrow truncated seq=1.5 to 1 without a word (the row looked like the call of seq 1)."""
    with PartWriter(tmp_path, "spans", background=False, fsync=False) as w:
        w.extend([{**span("flt", 0, [1], [2]), "seq": 1.5}, {**span("whole", 0, [1], [2]), "seq": 2.0},
                  {**span("ok", 3, [1], [2])}])
        w.append({**span("bool", 0, [1], [2]), "seq": True})
    rows = {r["rollout_id"]: r for r in read_table(tmp_path, "spans").to_pylist()}
    assert (rows["flt"]["seq"], rows["flt"]["salvaged"]) == (None, True)  # before the fix: (1, None)
    assert (rows["bool"]["seq"], rows["bool"]["salvaged"]) == (None, True)  # before the fix: (1, True)
    assert (rows["whole"]["seq"], rows["whole"]["salvaged"]) == (2, None)  # a whole float is an integer
    assert rows["ok"]["seq"] == 3 and w.health()["rows_lost"] == 0


def test_a_written_part_has_its_rename_made_durable_too(tmp_path, monkeypatch):
    """Found by review: the writer fsynced a part's data but not its folder after the rename; after a
    power cut the rename could be lost while the fsynced temporary survived, and compaction deletes such a
    temporary as a killed writer's. The folder is fsynced after the rename now (not with fsync off)."""
    import stat

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real(fd))[1])
    writer = PartWriter(tmp_path, "rewards", flush_seconds=3600)
    writer.append(reward("r", 1.0))
    writer.flush()
    assert synced == [False, True]  # the data, then the folder holding its new name
    synced.clear()
    unsynced = PartWriter(tmp_path / "off", "rewards", flush_seconds=3600, fsync=False)
    unsynced.append(reward("r", 1.0))
    unsynced.flush()
    assert synced == [] and len(read_table(tmp_path / "off", "rewards")) == 1


def test_a_folder_fsync_that_fails_after_the_rename_stores_the_rows_once(tmp_path, monkeypatch):
    """Found by review of the fsync above: a folder fsync that raised after the rename (EIO, a file
    system refusing it) made the writer put the stored rows back and write them again: twice."""
    import lightning_harness.schemas.parts as parts_module

    def refuse(folder, fsync):
        raise OSError(5, "Input/output error")

    writer = PartWriter(tmp_path, "rewards", flush_seconds=3600)
    writer.append(reward("r1", 1.0))
    monkeypatch.setattr(parts_module, "fsync_dir", refuse)
    writer.flush()
    monkeypatch.undo()
    writer.flush()
    assert read_table(tmp_path, "rewards")["rollout_id"].to_pylist() == ["r1"]
