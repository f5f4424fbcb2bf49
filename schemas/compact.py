"""Compaction: the many small parts of a table become a few large ones, atomic like the writes.

Why: writers make one part per flush (about one a second while a proxy is busy), so a long run
leaves thousands of files per table and every query and sample build pays per file. Compaction
bounds the file count; it runs in the proxy (beside its writers), in the training loop at each
update and from ``lightning-train compact`` for stores written elsewhere. pyarrow only (the proxy
environment has no DuckDB).

Protocol, per day folder of a table, under an exclusive ``flock`` on ``ROOT/<table>/.compact.lock``
(proxy, loop and CLI never compact one table at once; a busy lock means "skip this time"):

1. *finish*: a compacted part whose inputs are still on disk and that is older than ``grace_s``
   has its inputs removed (the step a crash or the grace period left for later);
2. temporaries of a compaction that was killed (``.compact-*.tmp``) are removed, and those of a writer
   killed mid-write (``.part-*.parquet.tmp``) once older than ``WRITER_TMP_AGE_S`` (5 minutes);
3. readable parts under ``target_bytes / 2`` (and ``raw_bytes / 2`` in memory) that are neither
   replaced nor waiting for their own inputs to go, named as a footer may name them (``[A-Za-z0-9_.-]``),
   parts of the table (``parts.not_of_table``) and typed like it, are taken in name (= time) order, in batches of
   about ``target_bytes`` (at most ``raw_bytes`` in memory); each batch
   of two or more becomes one part: rows sorted by ``rollout_id`` (stable, so time order within a
   rollout; row-group statistics then prune a query for a few rollouts), written under a hidden
   temporary name, row count checked against the inputs, fsynced, renamed, folder fsynced. Its
   footer names the parts it replaces (``lightning.compacted_from``);
4. with ``grace_s == 0`` the inputs go at once, else at a later run after ``grace_s``.

A compacted part gets its inputs' access (common permission bits; their owner when run as root), not
the compacting process's umask. A part whose data turns out damaged is marked corrupt (readers skip
it too) and the rest of its batch is compacted; a compacted part so marked keeps its inputs out of every
later batch (they are kept on disk: readers read them instead). A part the system refuses to read now
(too many open files, EIO) is left out of this round only. A batch whose rows pyarrow refuses to write as
the table (ArrowInvalid...), or that fails with an OSError other than a full disk (a name too long), stays
as it is, with one warning; the other batches and tables go on.

Readers (``schemas.checked.finished_parts``) leave out a part as soon as a compacted part naming it
exists, so a row is never seen twice; inputs stay readable for ``grace_s`` for readers that listed
them before; a crash at any point leaves either the inputs alone (temporary removed later) or the
compacted part plus inputs that every reader already ignores (removed later): no row lost or doubled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import itertools
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .checked import _PART_NAME, COMPACTED_FROM, finished_parts, mark_bad, part_error, replaced_parts
from .parts import RAW_BYTES, fsync_dir, not_of_table, plain_root, typed_unlike, write_part
from .tables import TABLES

log = logging.getLogger("lightning.schemas")

TARGET_BYTES = 64 << 20  # compacted part size aimed at (compressed); parts under half of it are "small"
# bytes of rows in memory one batch may hold (writers record them in each part's footer): a batch is
# read, sorted and written whole, and agent contexts repeat themselves, so rows can be a hundred times
# their size on disk (a proxy's RSS reached 3.2 GB compacting 2.9 MB of parts: 4,200 requests of 400 KB)
RAW_BATCH_BYTES = 128 << 20
GRACE_S = 30.0  # seconds replaced inputs stay readable for readers that listed them earlier
ROW_GROUP_BYTES = 1 << 20  # input bytes per row group: small enough that statistics prune well
LOCK_NAME = ".compact.lock"
_TMP_PREFIX = ".compact-"
# a writer's temporary (``.part-*.parquet.tmp``) this old is a killed writer's: a live one renames its
# temporary within seconds, and one removed under a live writer only makes it write that part again
WRITER_TMP_AGE_S = 300.0
_WRITER_TMP = re.compile(r"\.part-[A-Za-z0-9_.-]+\.parquet\.tmp")
# a compacted part's suffix: ``-c`` + 13 digits of milliseconds (a writer's tag is 8 hex characters, so
# ``-c`` + 7 of them never matches), the compacting pid and a counter
_COMPACTED_SUFFIX = re.compile(r"(-c\d{13}-\d+(-\d+)?)+$")
_names = itertools.count()
# characters of the first input's name a compacted part's name keeps: with ``-c<ms>-<pid>-<n>.parquet`` and
# ``.compact-`` .. ``.tmp`` around it, its temporary stays under NAME_MAX (255)
_MAX_BASE = 160


@dataclasses.dataclass
class CompactReport:
    """What one compaction of one table did (all counts are files unless named rows)."""

    table: str
    files_before: int = 0
    files_after: int = 0
    parts_written: int = 0
    parts_replaced: int = 0  # inputs now left out by readers
    parts_removed: int = 0  # inputs deleted (this run, including ones left by an earlier run)
    rows_compacted: int = 0
    skipped: str | None = None  # why nothing was attempted (lock busy, no folder)
    seconds: float = 0.0


def compact_store(root: str | os.PathLike, tables: Iterable[str] | None = None, *, wait: bool = False,
                  **kw) -> dict[str, CompactReport]:
    """:func:`compact_table` for every table (or ``tables``) under ``root``; ``wait``: sleep out the
    grace period once, then remove the replaced parts of every table in this call."""
    reports = {t: compact_table(root, t, **kw) for t in (tables or TABLES)}
    grace_s = kw.get("grace_s", GRACE_S)
    if wait and grace_s > 0 and any(r.parts_replaced for r in reports.values()):
        time.sleep(grace_s)
        for t, rep in reports.items():
            if not rep.skipped:
                _finish_table(root, t, grace_s, rep, kw.get("fsync", True))
    return reports


def _finish_table(root: str | os.PathLike, table: str, grace_s: float, rep: CompactReport, fsync: bool) -> None:
    root = plain_root(root)
    base = root / table
    with _locked(base / LOCK_NAME) as locked:
        if locked:
            for folder in sorted({p.parent for p in base.glob("**/*.parquet")}):
                _remove_replaced(folder, grace_s, rep, fsync, lambda stage: None)
            rep.files_after = len(finished_parts(root, table)[0])


def compact_table(
    root: str | os.PathLike,
    table: str,
    *,
    target_bytes: int = TARGET_BYTES,
    raw_bytes: int = RAW_BATCH_BYTES,
    grace_s: float = GRACE_S,
    fsync: bool = True,
    on_step: Callable[[str], None] | None = None,
) -> CompactReport:
    """Compact the closed parts of ``table`` under ``root`` (see the module doc for the protocol).

    ``on_step(stage)`` is called after each durable step ('written', 'committed', 'removed'): a
    test raises or exits there to play a crash.
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; known: {sorted(TABLES)}")
    if target_bytes <= 0 or raw_bytes <= 0 or grace_s < 0:
        raise ValueError("target_bytes and raw_bytes must be positive and grace_s not negative")
    t0 = time.monotonic()
    rep = CompactReport(table)
    root = plain_root(root)  # a name pyarrow can open (not UTF-8: every part looked corrupt, none compacted)
    base = root / table
    if not base.is_dir():
        rep.skipped = "no such table folder"
        return rep
    step = on_step or (lambda stage: None)
    with _locked(base / LOCK_NAME) as locked:
        if not locked:
            rep.skipped = "another compaction holds the lock"
            return rep
        rep.files_before = len(finished_parts(root, table)[0])
        folders = {p.parent for p in base.glob("**/*") if p.name.endswith(".parquet") or _WRITER_TMP.fullmatch(p.name)}
        for folder in sorted(folders):
            try:
                _compact_folder(folder, table, rep, (target_bytes, raw_bytes), grace_s, fsync, step)
            except OSError as exc:  # one folder's trouble: the other folders and tables go on
                if _store_wide(exc):
                    raise
                _warn_once(("folder", str(folder), str(exc.errno)), "not compacting %s now: %s", folder, exc)
        rep.files_after = len(finished_parts(root, table)[0])
    rep.seconds = round(time.monotonic() - t0, 4)
    return rep


@contextlib.contextmanager
def compaction_held(root: str | os.PathLike, table: str) -> Iterator[None]:
    """No compaction of ``table`` under ``root`` while inside (a running one is waited for). Why: a
    caller that lists parts and removes them later (``lightning-train build --replace``) would leave
    their rows behind in a part compacted from them in between."""
    base = Path(root) / table
    if not base.is_dir():  # no parts yet: nothing a compaction could fold
        yield
        return
    with _locked(base / LOCK_NAME, wait=True):
        yield


@contextlib.contextmanager
def _locked(path: Path, wait: bool = False) -> Iterator[bool]:
    """An exclusive ``flock``: ``with _locked(path) as locked`` (False when busy, unless ``wait``).

    A lock file another user created (an operator's ``sudo lightning-train compact``) is read-only to
    us: ``flock`` needs no write access, so it is opened read-only then, and ours is made readable
    to all whatever the umask (it holds nothing): the proxy's compaction failed every round with
    PermissionError."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except BlockingIOError:
        locked = False
    try:
        yield locked
    finally:
        os.close(fd)  # closing releases the lock


def _visible_parts(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.parquet") if not p.name.startswith("."))


def _remove_replaced(folder: Path, grace_s: float, rep: CompactReport, fsync: bool, step) -> set[Path]:
    """Delete inputs of compacted parts older than ``grace_s``; returns the parts still pending
    (compacted parts whose inputs must stay a while longer: not candidates themselves)."""
    pending, removed = set(), 0
    now = time.time()
    for part in _visible_parts(folder):
        names = replaced_parts(part)
        present = [folder / n for n in names if (folder / n).exists()]
        if not present:
            continue
        if now - part.stat().st_mtime < grace_s:
            pending.add(part)
            continue
        for p in present:
            p.unlink(missing_ok=True)
            removed += 1
    if removed:
        fsync_dir(folder, fsync)
        rep.parts_removed += removed
        step("removed")
    return pending


def _compact_folder(folder: Path, table: str, rep: CompactReport, budget: tuple[int, int], grace_s: float,
                    fsync: bool, step) -> None:
    for tmp in folder.glob(f"{_TMP_PREFIX}*.tmp"):  # a killed compaction's leftovers (we hold the lock)
        tmp.unlink(missing_ok=True)
    _remove_writer_leftovers(folder)
    pending = _remove_replaced(folder, grace_s, rep, fsync, step)
    # a compacted part whose data turned out damaged still names its inputs: never compacted a second time
    replaced = {folder / n for p in _visible_parts(folder) for n in replaced_parts(p, even_if_damaged=True)}
    # only names a compacted part's footer may list: one named otherwise ("part (1).parquet", a copy) made
    # a compacted part every reader took for corrupt, and a new one of it every round
    on_disk = {p: p.stat().st_size for p in _visible_parts(folder)
               if _PART_NAME.fullmatch(p.name) and p not in replaced and p not in pending and not part_error(p)}
    small = []
    for p, n in on_disk.items():
        if n < budget[0] // 2:  # the footer read only for parts small on disk
            raw, extra = _raw_size(p, table)
            if 0 <= raw < budget[1] // 2:
                small.append((p, (n, raw), extra))
    for batch in _batches(small, *budget):
        if len(batch) >= 2:
            try:
                _write_compacted(folder, table, batch, rep, fsync, step)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                # rows the table's schema cannot hold (nulls in a non-nullable column...): this batch stays
                # as it is (its temporary removed by write_part); the other batches and tables go on
                _warn_once(("batch", str(batch[0]), str(exc)), "not compacting %d %s parts from %s on: %s: %s",
                           len(batch), table, batch[0], type(exc).__name__, exc)
            except OSError as exc:
                if _store_wide(exc):
                    raise
                _warn_once(("batch", str(batch[0]), str(exc.errno)), "not compacting %d %s parts from %s now: %s",
                           len(batch), table, batch[0], exc)
    _remove_replaced(folder, grace_s, rep, fsync, step)


def _store_wide(exc: OSError) -> bool:
    """A full disk or quota stops the whole compaction (every later write fails alike; the CLI says so in
    one line). Any other OSError (a name too long, a folder we may not write) is one batch's or folder's:
    it stopped ``compact_store`` at that table every round, and the tables after it were never compacted."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


_warned: set[tuple[str, ...]] = set()  # warnings already given (one per file or batch, not one a round)


def _warn_once(key: tuple[str, ...], msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _remove_writer_leftovers(folder: Path) -> None:
    """Remove writer temporaries (``.part-*.parquet.tmp``) older than :data:`WRITER_TMP_AGE_S`: a writer
    killed mid-write (SIGKILL, OOM) leaves one that nothing renames or removes, and a long run's store
    gathered them for ever. No row is in them: the rows were never acknowledged as written."""
    now = time.time()
    for tmp in folder.glob(".part-*.parquet.tmp"):
        if not _WRITER_TMP.fullmatch(tmp.name):
            continue
        try:
            age = now - tmp.lstat().st_mtime
            if age > WRITER_TMP_AGE_S:
                tmp.unlink()
                log.warning("removed %s: a writer's temporary untouched for %.0f s (a killed writer's)", tmp, age)
        except OSError:  # gone meanwhile, or not ours to remove: left
            continue


def _batches(parts: list[tuple[Path, tuple[int, int], dict[str, pa.DataType]]], target_bytes: int,
             raw_bytes: int) -> list[list[Path]]:
    """Consecutive parts (each with its bytes on disk and in memory, and its columns the table lacks), each
    batch within ``target_bytes`` on disk and ``raw_bytes`` in memory. A part with such a column typed unlike
    the same column of the batch's parts before it starts a new batch (one warning): two parts of a newer
    writer or another tool that disagreed made their whole batch fail to unify, and so stay, every round."""
    out: list[list[Path]] = [[]]
    size = raw = 0
    extra: dict[str, pa.DataType] = {}
    for p, (n, r), cols in parts:
        clash = [c for c, t in cols.items() if c in extra and extra[c] != t]
        if clash:
            _warn_once(("extra", str(p)), "compacting %s apart from the parts before it: column(s) %s typed "
                       "otherwise there", p, ", ".join(clash))
        if out[-1] and (size + n > target_bytes or raw + r > raw_bytes or clash):
            out.append([])
            size, raw, extra = 0, 0, {}
        out[-1].append(p)
        size, raw = size + n, raw + r
        extra.update(cols)
    return out


_odd_parts: set[str] = set()  # parts already warned about as not joining a batch


def _raw_size(part: Path, table: str) -> tuple[int, dict[str, pa.DataType]]:
    """The part's rows in memory, as its writer recorded them (never less than its uncompressed column
    data, which counts a repeated dictionary value once), and its columns the table lacks (their types);
    -1 when it cannot join a batch: a column typed unlike the table's (another version, another tool,
    :func:`.parts.typed_unlike`) failed the whole batch every round, so none of its parts was ever
    compacted. Such a part stays as it is (readers read it), with one warning. A file that is no part of
    the table (``parts.not_of_table``: no column in common, lacking one the table never leaves null, or
    one typed in another family) stopped every later table's compaction (ArrowInvalid); it stays too, unread."""
    if not_of_table(part, table):  # warned once there
        return -1, {}
    md = pq.read_metadata(part)
    schema = md.schema.to_arrow_schema()
    odd = typed_unlike(schema, table, exact=True)
    if odd:
        if str(part) not in _odd_parts:
            _odd_parts.add(str(part))
            log.warning("not compacting %s: column(s) %s typed unlike the %s table's", part, ", ".join(odd), table)
        return -1, {}
    columns = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
    try:  # a footer from elsewhere may say anything: an unreadable figure stopped every table's compaction
        recorded = int((md.metadata or {}).get(RAW_BYTES, b"0"))
    except ValueError:
        recorded = 0
    return max(recorded, columns), {f.name: f.type for f in schema if f.name not in TABLES[table].names}


def _read_parts(batch: list[Path]) -> tuple[list[Path], list[pa.Table]]:
    """The parts of ``batch`` that read whole, and their rows. A part whose data is damaged past its footer
    is marked corrupt (one warning; readers skip it too) and left as it is: it kept its whole batch
    from ever being compacted, with a warning every round."""
    read, tables = [], []
    for p in batch:
        try:
            tables.append(pq.read_table(p))
        except MemoryError:  # not the part's fault: this round fails, the part stays readable
            raise
        except Exception as exc:
            mark_bad(p, exc)  # the system refusing it now (EMFILE, EIO): left out of this round only
            continue
        read.append(p)
    return read, tables


def _read_inputs(tables: list[pa.Table], folder: Path, table: str) -> pa.Table | None:
    """The rows of ``tables`` as one table (schemas unified by name); None if they do not unify."""
    try:
        data = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        log.warning("not compacting %s parts in %s: schemas differ (%s)", table, folder, exc)
        return None
    if "rollout_id" in data.column_names and data.num_rows:
        data = data.take(pc.sort_indices(data, sort_keys=[("rollout_id", "ascending")]))
    return data


def _write_compacted(folder: Path, table: str, batch: list[Path], rep: CompactReport, fsync: bool, step) -> None:
    batch, tables = _read_parts(batch)
    if len(batch) < 2:
        return
    data = _read_inputs(tables, folder, table)
    del tables
    if data is None:
        return
    mode, owner = _access_of(batch)
    expected = sum(pq.read_metadata(p).num_rows for p in batch)
    in_bytes = sum(p.stat().st_size for p in batch)
    rows_per_group = max(256, int(data.num_rows * ROW_GROUP_BYTES / max(in_bytes, 1)))
    # the first input's name (without an earlier compaction's suffix) keeps the folder in time order and
    # is unique among the inputs (a writer's name holds its tag and counter: cutting at the first "-c" cut a
    # tag starting with "c" with them, so two batches compacted in one millisecond shared a name); the suffix
    # makes it unique among compactions
    # capped: a long (legal) input name made the compacted one and its temporary longer than NAME_MAX (255)
    base = (_COMPACTED_SUFFIX.sub("", batch[0].stem) or batch[0].stem)[:_MAX_BASE]
    name = f"{base}-c{int(time.time() * 1000):013d}-{os.getpid()}-{next(_names)}.parquet"

    def check(tmp: Path) -> None:
        written = pq.read_metadata(tmp).num_rows
        if written != expected:
            raise RuntimeError(f"compacted part holds {written} rows, its inputs {expected}")
        if owner is not None:
            os.chown(tmp, *owner)
        step("written")

    meta = {**(data.schema.metadata or {}), COMPACTED_FROM: json.dumps([p.name for p in batch]).encode()}
    write_part(data, folder / name, meta, fsync=fsync, tmp=folder / f"{_TMP_PREFIX}{name}.tmp", check=check,
               mode=mode, row_group_size=rows_per_group)  # (its folder fsynced there)
    rep.parts_written += 1
    rep.parts_replaced += len(batch)
    rep.rows_compacted += expected
    step("committed")


def _access_of(batch: list[Path]) -> tuple[int, tuple[int, int] | None]:
    """The access a compacted part gets from its inputs: their common permission bits (never wider than
    any of them), and their owner when they share one and we may give it (root; None otherwise).

    Why: the part was created with the compacting process's umask. An operator compacting a store a
    proxy kept private (umask 077) made its spans world-readable (0644), and one compacting as root
    with umask 077 made the parts unreadable to the proxy's user, who then saw none of their rows.
    """
    stats = [p.stat() for p in batch]
    mode = 0o777
    for st in stats:
        mode &= stat.S_IMODE(st.st_mode)
    owners = {(st.st_uid, st.st_gid) for st in stats}
    return mode, (next(iter(owners)) if len(owners) == 1 and os.geteuid() == 0 else None)


class PeriodicCompactor:
    """Compacts some tables of a store every ``every_s`` seconds in a daemon thread (the proxy's,
    beside its writers: it compacts only closed parts, so writes never wait for it).

    A failure (disk full, a damaged part) is logged and tried again next period; ``close()`` stops
    the thread without starting a new round.
    """

    def __init__(self, root: str | os.PathLike, tables: Iterable[str], every_s: float, **kw) -> None:
        import threading

        self.root, self.tables, self.every_s, self.kw = Path(root), list(tables), every_s, kw
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="compact", daemon=True)

    def start(self) -> PeriodicCompactor:
        if self.every_s > 0:
            self._thread.start()
        return self

    def run_once(self) -> dict[str, CompactReport]:
        try:
            out = compact_store(self.root, self.tables, **self.kw)
            self.last_error = None
            return out
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("compacting %s under %s failed (next try in %.0f s): %s",
                        self.tables, self.root, self.every_s, self.last_error)
            return {}

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.run_once()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
