"""The trace store's readers and compaction against odd stores, odd paths and hostile contents.

Real Parquet parts (schemas.PartWriter, write_part), real DuckDB views, `lightning-sql` as a user runs
it (the installed console script, argv as bytes where the path is not UTF-8), compaction in this
process and in others (two at once, one as another user).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_traces import span, write_traces

from lightning_harness.schemas import TABLES, PartWriter, compact_table, finished_parts, read_table
from lightning_harness.schemas.checked import replaced_parts
from lightning_harness.schemas.parts import RAW_BYTES, write_part
from lightning_harness.trainer.views import connect, define_views, past_damaged_parts

pytestmark = pytest.mark.timeout(240)
BIN = Path(sys.executable).parent


def _sql(root, query: str, *args) -> subprocess.CompletedProcess:
    """`lightning-sql ROOT QUERY --format json ...`; ROOT may be bytes (a path that is not UTF-8)."""
    return subprocess.run([str(BIN / "lightning-sql"), os.fsencode(root), query, "--format", "json", *args],
                          capture_output=True, timeout=180)


def _rows(p: subprocess.CompletedProcess) -> list[dict]:
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return json.loads(p.stdout)


def store(root: Path, parts: int = 4, rows: int = 2) -> Path:
    """``parts`` spans parts of ``rows`` rows each (one part per flush, as a proxy writes them)."""
    for i in range(parts):
        write_traces(root, spans=[span(f"r{i}", k, [1, 2], [3]) for k in range(rows)])
    return root


def span_ids(root: Path) -> list[str]:
    return sorted(read_table(root, "spans")["span_id"].to_pylist())


def spans_folder(root: Path) -> Path:
    (day,) = [p for p in (root / "spans").iterdir() if p.is_dir()]
    return day


def damage_data_pages(path: Path) -> None:
    """Flip bytes in the middle of a part: its footer still reads, its data pages do not."""
    data = bytearray(path.read_bytes())
    for k in range(len(data) // 3, len(data) // 3 + 20_000):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))


def incompressible_part(root: Path, tag: str) -> Path:
    """A spans part of 200 rows with 2 KB of random text each (160 KB of data pages)."""
    with PartWriter(root, "spans", background=False, fsync=False) as w:
        w.extend([span(f"{tag}{j % 3}", j, [1], [2], request_json=os.urandom(1000).hex()) for j in range(200)])
    return max((root / "spans").rglob("*.parquet"), key=lambda p: p.stat().st_mtime_ns)


# -- compaction -------------------------------------------------------------------------------------------


def test_a_part_named_unlike_a_written_one_is_read_but_never_compacted(tmp_path):
    """A copy a file manager made ("part-1 copy.parquet") went into a compacted part whose footer named
    it; readers took that part for corrupt, so each round wrote another full copy of the batch."""
    root = store(tmp_path / "t")
    ids = span_ids(root)
    first = sorted(spans_folder(root).glob("*.parquet"))[0]
    first.rename(first.with_name("part-1 copy.parquet"))
    counts = []
    for _ in range(3):
        rep = compact_table(root, "spans", grace_s=0)
        counts.append(len(list(spans_folder(root).glob("*.parquet"))))
        assert finished_parts(root, "spans")[1] == []  # nothing a reader skips as corrupt
    assert counts == [2, 2, 2] and rep.parts_written == 0  # the copy and one compacted part, every round
    assert span_ids(root) == ids
    assert (spans_folder(root) / "part-1 copy.parquet").exists()


def test_a_footer_with_an_unreadable_size_does_not_stop_compaction(tmp_path):
    """``lightning.raw_bytes`` is read from each part's footer; a store from elsewhere may hold anything
    there: 'lots' stopped the compaction of every table (ValueError), every round."""
    root = store(tmp_path / "t", parts=3)
    odd = spans_folder(root) / "part-0000000000001-1-000000.parquet"
    table = pa.Table.from_pylist([span("odd", 0, [1], [2])], schema=TABLES["spans"])
    write_part(table, odd, {}, fsync=False)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, RAW_BYTES: b"lots"}), odd)
    ids = span_ids(root)
    rep = compact_table(root, "spans", grace_s=0)
    assert rep.skipped is None and rep.parts_written == 1 and rep.parts_removed == 4
    assert span_ids(root) == ids and len(finished_parts(root, "spans")[0]) == 1


def test_a_footer_claiming_few_bytes_does_not_raise_the_memory_bound(tmp_path):
    """A batch is read whole; its bound is the rows' size in memory. A footer that understates it is
    not believed over the Parquet column sizes."""
    root = tmp_path / "t"
    for r in range(4):
        write_traces(root, spans=[span(f"big{r}", 0, [1], [2], request_json=os.urandom(200_000).hex())])
    for p in spans_folder(root).glob("*.parquet"):
        t = pq.read_table(p)
        pq.write_table(t.replace_schema_metadata({**t.schema.metadata, RAW_BYTES: b"1"}), p)
    rep = compact_table(root, "spans", raw_bytes=1_000_000, grace_s=0)  # about two parts' rows
    assert rep.parts_written == 2 and rep.rows_compacted == 4
    assert len(span_ids(root)) == 4


def test_a_part_damaged_past_its_footer_leaves_the_rest_of_its_batch_compacted(tmp_path, caplog):
    """A damaged part kept its whole batch (up to 64 MiB of parts) from ever being compacted, with a
    warning every round; it is now skipped like readers skip it, and left on disk."""
    root = tmp_path / "t"
    good = [incompressible_part(root, t) for t in "abc"]
    bad = incompressible_part(root, "x")
    damage_data_pages(bad)
    ids = sorted(i for p in good for i in pq.read_table(p)["span_id"].to_pylist())
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        rep = compact_table(root, "spans", grace_s=0)
        again = compact_table(root, "spans", grace_s=0)
    assert rep.parts_written == 1 and rep.parts_removed == 3 and rep.rows_compacted == 600
    assert again.parts_written == 0
    assert bad.exists() and finished_parts(root, "spans") == ([p for p in spans_folder(root).glob("*.parquet")
                                                                if p != bad], [bad])
    assert sum(str(bad) in r.getMessage() for r in caplog.records) == 1  # one warning, not one a round
    assert span_ids(root) == ids


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _compacted(root: Path) -> Path:
    (part,) = [p for p in spans_folder(root).glob("*.parquet") if replaced_parts(p)]
    return part


def test_a_compacted_part_has_its_inputs_access_not_the_compactors_umask(tmp_path):
    """A proxy keeping its traces private (umask 077) had them made world-readable by an operator's
    compaction (umask 022); one compacting with umask 077 made a shared store's parts private."""
    old = os.umask(0o077)
    try:
        private = store(tmp_path / "private")
        os.umask(0o022)
        assert {_mode(p) for p in spans_folder(private).glob("*.parquet")} == {0o600}
        compact_table(private, "spans", grace_s=0)
        shared = store(tmp_path / "shared")
        os.umask(0o077)
        compact_table(shared, "spans", grace_s=0)
    finally:
        os.umask(old)
    assert _mode(_compacted(private)) == 0o600
    assert _mode(_compacted(shared)) == 0o644
    assert len(span_ids(private)) == len(span_ids(shared)) == 8


NOBODY = """
import os, pwd, sys
from lightning_harness.schemas import compact_table, read_table
user = pwd.getpwnam("nobody")  # everything imported: now the proxy's user, who is not root
os.setgroups([])
os.setgid(user.pw_gid)
os.setuid(user.pw_uid)
print(read_table(sys.argv[1], "spans").num_rows)
rep = compact_table(sys.argv[1], "spans", grace_s=0)
print(rep.skipped, read_table(sys.argv[1], "spans").num_rows)
"""


@pytest.fixture
def open_dir():
    """A world-traversable folder (pytest's own is root's, 0700), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="lh-hostile-store-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_store_compacted_by_root_stays_readable_and_compactable_by_its_writer(open_dir):
    """`sudo lightning-train compact` (umask 077) on a store the proxy's user writes: the compacted part
    was root's and 0600, so that user read none of its rows once the inputs were gone, and its own
    compaction failed every round opening root's lock file for writing."""
    if os.geteuid() != 0:
        pytest.skip("needs root (to act as two users)")
    root = store(open_dir / "t")
    nobody = pwd.getpwnam("nobody")
    for p in [root, *root.rglob("*")]:
        os.chown(p, nobody.pw_uid, nobody.pw_gid)
    old = os.umask(0o077)
    try:
        compact_table(root, "spans", grace_s=0)  # root, with a private umask
    finally:
        os.umask(old)
    compacted = _compacted(root)
    owner = compacted.stat().st_uid
    for p in store(root).rglob("*.parquet"):  # the writer goes on: four more parts, its own
        if p != compacted:
            os.chown(p, nobody.pw_uid, nobody.pw_gid)
    p = subprocess.run([sys.executable, "-c", NOBODY, str(root)], capture_output=True, text=True, timeout=120)
    assert p.stdout.split()[:1] == ["16"], p.stdout + p.stderr  # the compacted part's 8 rows too
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["16", "None", "16"], p.stdout + p.stderr
    assert owner == nobody.pw_uid and (root / "spans" / ".compact.lock").stat().st_uid == 0


COMPACTOR = """
import sys, time
from lightning_harness.schemas import compact_table
end = time.monotonic() + float(sys.argv[2])
skipped = 0
while time.monotonic() < end:
    skipped += compact_table(sys.argv[1], "spans", grace_s=0, fsync=False).skipped is not None
print(skipped)
"""


def test_two_processes_compacting_beside_a_writer_lose_and_double_nothing(tmp_path):
    """The loop and `lightning-train compact` at once: the lock lets one at a time, and every row
    written is read exactly once during and after."""
    root = tmp_path / "t"
    writer = PartWriter(root, "spans", background=False, fsync=False)
    writer.extend([span("first", 0, [1], [2])])
    writer.flush()
    procs = [subprocess.Popen([sys.executable, "-c", COMPACTOR, str(root), "4"], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    written = 1
    while any(p.poll() is None for p in procs):
        writer.extend([span(f"w{written}", 0, [1], [2])])
        writer.flush()
        written += 1
        con = connect(root)
        total, distinct = past_damaged_parts(
            lambda con=con: con.sql("SELECT count(*), count(DISTINCT span_id) FROM spans").fetchall()[0],
            lambda con=con: define_views(con, root))
        assert total == distinct and total >= written - 1  # a part removed under this reader is re-listed
        time.sleep(0.01)
    skipped = [int(p.communicate()[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(skipped) > 0  # they did meet at the lock
    assert len(span_ids(root)) == written and len(set(span_ids(root))) == written


def test_readers_never_miss_rows_while_compaction_removes_inputs_at_once(tmp_path):
    """With no grace period (the loop at exit, `--grace-s 0`) a listing running while a compaction
    committed and removed its inputs saw neither: read_table returned fewer rows, silently."""
    root = store(tmp_path / "t", parts=1)
    writer = PartWriter(root, "spans", background=False, fsync=False)
    written, stop, errors = [2], threading.Event(), []

    def churn():
        try:
            i = 0
            while not stop.is_set():
                writer.extend([span(f"c{i}", 0, [1], [2])])
                writer.flush()
                written[0] += 1
                i += 1
                compact_table(root, "spans", grace_s=0, fsync=False)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=churn)
    thread.start()
    short = []
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not errors:
            floor = written[0]
            ids = read_table(root, "spans")["span_id"].to_pylist()
            assert len(ids) == len(set(ids)), "a row read twice"
            if len(ids) < floor:
                short.append((len(ids), floor))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert short == [], f"{len(short)} reads missed rows, e.g. {short[:3]}"
    assert len(span_ids(root)) == written[0]


def test_parts_of_an_older_schema_compact_and_read_with_newer_ones(tmp_path):
    """Schema drift: a part written before a column existed reads (NULL there) and compacts with
    parts that have it; no row is lost either way."""
    root = store(tmp_path / "t", parts=2)
    old_schema = TABLES["spans"].remove(TABLES["spans"].get_field_index("salvaged"))
    old = pa.Table.from_pylist([span("old", 0, [1], [2])], schema=old_schema)
    write_part(old, spans_folder(root) / "part-0000000000001-1-000000.parquet", {}, fsync=False)
    query = "SELECT rollout_id, salvaged FROM spans WHERE rollout_id = 'old'"
    assert _rows(_sql(root, query)) == [{"rollout_id": "old", "salvaged": None}]
    rep = compact_table(root, "spans", grace_s=0)
    assert rep.parts_written == 1 and rep.rows_compacted == 5
    assert _rows(_sql(root, query)) == [{"rollout_id": "old", "salvaged": None}]
    assert _rows(_sql(root, "SELECT count(*) AS n FROM spans")) == [{"n": 5}]


def test_a_part_with_a_column_of_another_type_does_not_block_its_batch(tmp_path, caplog):
    """A part whose column has another type (another version, another tool) failed its whole batch
    ("schemas differ") every round: none of up to 64 MiB of parts beside it was ever compacted."""
    root = store(tmp_path / "t", parts=3)
    schema = TABLES["spans"]
    odd_schema = schema.set(schema.get_field_index("attempt"), pa.field("attempt", pa.int64()))
    odd = spans_folder(root) / "part-0000000000001-1-000000.parquet"
    write_part(pa.Table.from_pylist([span("odd", 0, [1], [2])], schema=odd_schema), odd, {}, fsync=False)
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        rep = compact_table(root, "spans", grace_s=0)
        assert compact_table(root, "spans", grace_s=0).parts_written == 0
    assert rep.parts_written == 1 and rep.rows_compacted == 6 and odd.exists()
    assert sum(str(odd) in r.getMessage() for r in caplog.records) == 1
    assert _rows(_sql(root, "SELECT count(*) AS n FROM spans")) == [{"n": 7}]


# -- readers: paths and names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,twin", [("exp[1]", "exp1"), ("run*", "runs"), ("q?", "qz")])
def test_glob_characters_in_a_traces_path_read_that_store_and_no_other(tmp_path, name, twin):
    """DuckDB expands * ? [ in every path it is given: `runs/exp[1]` read the parts of `runs/exp1`."""
    mine = write_traces(tmp_path / name, spans=[span("mine", 0, [1], [2])])
    other = tmp_path / twin
    shutil.copytree(mine, other)  # the same part names, other rows
    (part,) = other.rglob("*.parquet")
    t = pq.read_table(part)
    pq.write_table(t.set_column(t.schema.get_field_index("rollout_id"), "rollout_id",
                                pa.array(["other"], pa.string())), part)
    assert _rows(_sql(mine, "SELECT rollout_id FROM spans")) == [{"rollout_id": "mine"}]
    assert connect(mine).sql("SELECT rollout_id FROM spans").fetchall() == [("mine",)]


def test_a_file_named_with_a_wildcard_reads_only_itself(tmp_path):
    """A part called `*.parquet` (dropped into a store by hand) read every part of its folder, those
    a compacted part replaces included: rows twice."""
    root = store(tmp_path / "t", parts=2, rows=1)
    compact_table(root, "spans", grace_s=3600)  # the replaced inputs stay on disk, left out by readers
    write_traces(tmp_path / "x", spans=[span("star", 0, [1], [2])])
    (extra,) = (tmp_path / "x").rglob("*.parquet")
    extra.rename(spans_folder(root) / "*.parquet")
    rows = _rows(_sql(root, "SELECT rollout_id FROM spans ORDER BY rollout_id"))
    assert [r["rollout_id"] for r in rows] == ["r0", "r1", "star"]


def test_a_traces_path_that_is_not_utf8_is_read_and_compacted(tmp_path):
    """A proxy writes into `runs/\\xff` fine; readers read it as empty (every part "corrupt":
    pyarrow and DuckDB take UTF-8 paths) and compaction never merged a part of it."""
    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/traces-\xff"))
    store(root)
    p = _sql(root, "SELECT count(*) AS n FROM spans")
    assert _rows(p) == [{"n": 8}] and b"corrupt" not in p.stderr, p.stderr
    assert len(span_ids(root)) == 8
    rep = compact_table(root, "spans", grace_s=0)
    assert rep.parts_written == 1 and rep.parts_removed == 4
    assert len(list(spans_folder(root).glob("*.parquet"))) == 1
    assert _rows(_sql(root, "SELECT count(*) AS n, count(DISTINCT span_id) AS d FROM spans")) == [{"n": 8, "d": 8}]


def test_a_damaged_part_under_a_path_with_quotes_is_skipped_not_fatal(tmp_path):
    """The damaged part's name was taken from DuckDB's error between quotes of either kind: under
    `bob's traces` it came out wrong, and the query failed instead of skipping the part."""
    root = tmp_path / "bob's traces"
    incompressible_part(root, "a")
    bad = incompressible_part(root, "b")
    damage_data_pages(bad)
    p = _sql(root, "SELECT count(*) AS n, sum(length(request_json)) AS chars FROM spans")
    assert _rows(p) == [{"n": 200, "chars": 400_000}]
    lines = [line for line in p.stderr.decode().splitlines() if str(bad) in line]
    assert len(lines) == 1 and "corrupt" in lines[0]


# -- lightning-sql output ----------------------------------------------------------------------------------

HOSTILE = "[/] [bold]b[/bold] \x1b]0;owned\x07\x1b[2J \u202etxt"  # markup, a title, a clear, bidi


def test_table_output_shows_what_a_harness_wrote_as_text(tmp_path):
    """Cells are what harnesses and models wrote: rich took them for markup (`[/]` ended the query with
    MarkupError) and passed escape sequences through to the operator's terminal."""
    root = write_traces(tmp_path / "t", spans=[span("\r\x1b[31mred", 0, [1], [2], error_kind="x", error=HOSTILE)])
    p = subprocess.run([str(BIN / "lightning-sql"), str(root), 'SELECT rollout_id, error AS "[/]\x1b[8m" FROM spans'],
                       capture_output=True, timeout=180)  # bytes: text mode would turn a CR into a newline
    assert p.returncode == 0, p.stderr
    p.stdout = p.stdout.decode()
    assert "[/] [bold]b[/bold] \\x1b]0;owned\\x07\\x1b[2J \\u202etxt" in p.stdout
    assert "\\r\\x1b[31mred" in p.stdout and "[/]\\x1b[8m" in p.stdout  # another column, the column's name
    assert not any(c in p.stdout for c in "\x1b\x07\r\u202e")
    failed = subprocess.run([str(BIN / "lightning-sql"), str(root), "SELECT error::INTEGER FROM spans"],
                            capture_output=True, timeout=180)
    failed.stderr = failed.stderr.decode()
    assert failed.returncode == 1 and "query failed" in failed.stderr and "\\x1b]0;owned" in failed.stderr
    assert "\x1b" not in failed.stderr


def test_json_output_stays_json_with_numbers_json_cannot_hold(tmp_path):
    """A NaN loss in `metrics` came out as the token NaN, which JSON parsers refuse."""
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))

    p = _sql(tmp_path, "SELECT 'nan'::DOUBLE AS x, 'inf'::DOUBLE AS y, ['-inf'::DOUBLE, 1.5] AS z, 2.5 AS w")
    assert p.returncode == 0, p.stderr
    assert strict(p.stdout) == [{"x": "nan", "y": "inf", "z": ["-inf", 1.5], "w": 2.5}]


def test_a_fifo_named_like_a_part_is_skipped_not_read(tmp_path):
    """A FIFO (or device) named ``*.parquet`` in a store: opening it blocks until a writer comes, so
    every reader and every compaction hung on it. It is skipped like a damaged part."""
    import multiprocessing

    from lightning_harness.schemas.checked import finished_parts

    folder = tmp_path / "spans" / "day=2026-01-01"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"a": [1]}), folder / "part-1.parquet")
    os.mkfifo(folder / "part-2.parquet")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        res = pool.apply_async(finished_parts, (tmp_path, "spans"))
        good, bad = res.get(timeout=20)  # before the fix: a hang (TimeoutError)
    assert [p.name for p in good] == ["part-1.parquet"] and [p.name for p in bad] == ["part-2.parquet"]


def test_a_part_the_system_refuses_for_now_is_read_once_it_can_be(tmp_path, monkeypatch):
    """Too many open files (or EIO) while a footer is read says nothing about the part: it must not be
    remembered as corrupt, or a long-running reader hides it for good (its rows lost to every query)."""
    import errno

    from lightning_harness.schemas import checked

    folder = tmp_path / "spans" / "day=2026-01-01"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"a": [1]}), folder / "part-1.parquet")
    real = checked.pq.read_metadata

    def refused(path):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(checked.pq, "read_metadata", refused)
    good, bad = checked.finished_parts(tmp_path, "spans")
    assert good == [] and len(bad) == 1
    monkeypatch.setattr(checked.pq, "read_metadata", real)
    good, bad = checked.finished_parts(tmp_path, "spans")
    assert [p.name for p in good] == ["part-1.parquet"] and bad == []  # before the fix: still skipped as corrupt


def test_writers_with_one_pid_in_one_millisecond_never_share_a_part_name(tmp_path):
    """Writers in separate containers share a store and often a pid (1): a part named by time, pid
    and a counter alone was replaced by the other writer's part of the same name, rows lost."""
    import subprocess
    import sys

    code = ("import os, time; from lightning_harness.schemas import parts as P; time.time = lambda: 1.0; "
            "os.getpid = lambda: 1; "
            "import pyarrow as pa; w = P.PartWriter(__import__('sys').argv[1], 'rewards', background=False); "
            "print(w._write_arrow(P.TABLES['rewards'].empty_table()).name)")
    names = {subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                            check=True).stdout.strip() for _ in range(2)}
    assert len(names) == 2, names  # before the fix: one name, so the second write replaced the first
