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
2. temporaries of a compaction that was killed (``.compact-*.tmp``) are removed;
3. readable parts under ``target_bytes / 2`` (and ``raw_bytes / 2`` in memory) that are neither
   replaced nor waiting for their own inputs to go are taken in name (= time) order, in batches of
   about ``target_bytes`` (at most ``raw_bytes`` in memory); each batch
   of two or more becomes one part: rows sorted by ``rollout_id`` (stable, so time order within a
   rollout; row-group statistics then prune a query for a few rollouts), written under a hidden
   temporary name, row count checked against the inputs, fsynced, renamed, folder fsynced. Its
   footer names the parts it replaces (``lightning.compacted_from``);
4. with ``grace_s == 0`` the inputs go at once, else at a later run after ``grace_s``.

Readers (``schemas.checked.finished_parts``) leave out a part as soon as a compacted part naming it
exists, so a row is never seen twice; inputs stay readable for ``grace_s`` for readers that listed
them before; a crash at any point leaves either the inputs alone (temporary removed later) or the
compacted part plus inputs that every reader already ignores (removed later): no row lost or doubled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .checked import COMPACTED_FROM, finished_parts, part_error, replaced_parts
from .parts import RAW_BYTES, write_part
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
    base = Path(root) / table
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
    base = Path(root) / table
    if not base.is_dir():
        rep.skipped = "no such table folder"
        return rep
    step = on_step or (lambda stage: None)
    with _locked(base / LOCK_NAME) as locked:
        if not locked:
            rep.skipped = "another compaction holds the lock"
            return rep
        rep.files_before = len(finished_parts(root, table)[0])
        for folder in sorted({p.parent for p in base.glob("**/*.parquet")}):
            _compact_folder(folder, table, rep, (target_bytes, raw_bytes), grace_s, fsync, step)
        rep.files_after = len(finished_parts(root, table)[0])
    rep.seconds = round(time.monotonic() - t0, 4)
    return rep


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """A non-blocking exclusive ``flock``: ``with _locked(path) as locked`` (False when busy)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except BlockingIOError:
        locked = False
    try:
        yield locked
    finally:
        os.close(fd)  # closing releases the lock


def _visible_parts(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.parquet") if not p.name.startswith("."))


def _fsync_dir(folder: Path, fsync: bool) -> None:
    if not fsync:
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _fsync_dir(folder, fsync)
        rep.parts_removed += removed
        step("removed")
    return pending


def _compact_folder(folder: Path, table: str, rep: CompactReport, budget: tuple[int, int], grace_s: float,
                    fsync: bool, step) -> None:
    for tmp in folder.glob(f"{_TMP_PREFIX}*.tmp"):  # a killed compaction's leftovers (we hold the lock)
        tmp.unlink(missing_ok=True)
    pending = _remove_replaced(folder, grace_s, rep, fsync, step)
    replaced = {folder / n for p in pending for n in replaced_parts(p)}
    on_disk = {p: p.stat().st_size for p in _visible_parts(folder)
               if p not in replaced and p not in pending and not part_error(p)}
    small = [(p, (n, raw)) for p, n in on_disk.items()  # the footer read only for parts small on disk
             if n < budget[0] // 2 and (raw := _raw_size(p)) < budget[1] // 2]
    for batch in _batches(small, *budget):
        if len(batch) >= 2:
            _write_compacted(folder, table, batch, rep, fsync, step)
    _remove_replaced(folder, grace_s, rep, fsync, step)


def _batches(parts: list[tuple[Path, tuple[int, int]]], target_bytes: int, raw_bytes: int) -> list[list[Path]]:
    """Consecutive parts (each with its bytes on disk and in memory), each batch within
    ``target_bytes`` on disk and ``raw_bytes`` in memory."""
    out: list[list[Path]] = [[]]
    size = raw = 0
    for p, (n, r) in parts:
        if out[-1] and (size + n > target_bytes or raw + r > raw_bytes):
            out.append([])
            size = raw = 0
        out[-1].append(p)
        size, raw = size + n, raw + r
    return out


def _raw_size(part: Path) -> int:
    """The part's rows in memory, as its writer recorded them; for a part written before the footer
    said so, its uncompressed column data (a repeated dictionary value counted once)."""
    md = pq.read_metadata(part)
    recorded = (md.metadata or {}).get(RAW_BYTES)
    return int(recorded) if recorded else sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))


def _read_inputs(batch: list[Path], table: str) -> pa.Table | None:
    """The rows of ``batch`` as one table (schemas unified by name); None if they do not unify."""
    tables = [pq.read_table(p) for p in batch]
    try:
        data = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        log.warning("not compacting %s parts in %s: schemas differ (%s)", table, batch[0].parent, exc)
        return None
    if "rollout_id" in data.column_names and data.num_rows:
        data = data.take(pc.sort_indices(data, sort_keys=[("rollout_id", "ascending")]))
    return data


def _write_compacted(folder: Path, table: str, batch: list[Path], rep: CompactReport, fsync: bool, step) -> None:
    try:
        data = _read_inputs(batch, table)
    except Exception as exc:  # a part damaged past its footer: leave the batch as it is
        log.warning("not compacting %s parts in %s: %s: %s", table, folder, type(exc).__name__, exc)
        return
    if data is None:
        return
    expected = sum(pq.read_metadata(p).num_rows for p in batch)
    in_bytes = sum(p.stat().st_size for p in batch)
    rows_per_group = max(256, int(data.num_rows * ROW_GROUP_BYTES / max(in_bytes, 1)))
    # the first input's name (without an earlier compaction's suffix) keeps the folder in time
    # order; the suffix makes it unique
    name = f"{batch[0].stem.split('-c', 1)[0]}-c{int(time.time() * 1000)}-{os.getpid()}.parquet"

    def check(tmp: Path) -> None:
        written = pq.read_metadata(tmp).num_rows
        if written != expected:
            raise RuntimeError(f"compacted part holds {written} rows, its inputs {expected}")
        step("written")

    meta = {**(data.schema.metadata or {}), COMPACTED_FROM: json.dumps([p.name for p in batch]).encode()}
    write_part(data, folder / name, meta, fsync=fsync, tmp=folder / f"{_TMP_PREFIX}{name}.tmp", check=check,
               row_group_size=rows_per_group)
    _fsync_dir(folder, fsync)
    rep.parts_written += 1
    rep.parts_replaced += len(batch)
    rep.rows_compacted += expected
    step("committed")


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
