"""Durable, append-only Parquet part files that any reader can open at any moment.

Layout: ``ROOT/<table>/day=YYYY-MM-DD/part-<ms>-<pid>-<tag>-<n>.parquet`` (hive partitioning, so
``read_parquet('ROOT/spans/**/*.parquet', hive_partitioning=true)`` just works). Each part is
written under a hidden temporary name, fsynced, then renamed: a reader never sees half a file,
and a process killed mid-write leaves at most a ``.*.tmp`` file that no ``*.parquet`` glob matches.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset  # noqa: F401  (pq.read_table imports it on first use; a proxy that dropped its
import pyarrow.parquet as pq  # privileges or lost its environment since would take every part for corrupt)

from .checked import UNKNOWN, finished_parts, mark_bad, recall, remember, replaced_parts
from .salvage import encode_rows
from .tables import SCHEMA_VERSION, TABLES

log = logging.getLogger("lightning.schemas")

_counter = itertools.count()
# part names carry a random tag of the writing process besides its pid: writers in separate containers
# share a store and often a pid (1), and a rename onto a taken name would replace a part without a word
_WRITER_TAG = secrets.token_hex(4)


def _row_bytes(row: dict[str, Any]) -> int:
    n = 64
    for v in row.values():
        if isinstance(v, (str, bytes)):
            n += len(v)
        elif isinstance(v, (list, tuple)):
            n += 8 * len(v)
        else:
            n += 8
    return n


class BufferFull(RuntimeError):
    """The writer already holds ``max_buffer_bytes`` of rows it could not write: new rows are refused.

    Why a refusal and not an ever-growing buffer: while the disk is full every accepted row stays
    in memory; past the bound the owner must stop accepting work (the proxy answers 503) or count
    what it drops, instead of the process running out of memory and losing everything.
    """


class PartWriter:
    """Buffers rows of one table and writes them as Parquet parts, flushing by rows, bytes and age.

    Thread-safe. ``flush_seconds`` bounds how long a row may sit in memory (what a SIGKILL can
    lose); a daemon thread enforces it when ``background=True``. ``close()`` flushes everything.

    Hostile input and failing disks (see ``health()``):

    - a row whose values do not fit the schema is salvaged or counted lost (``schemas.salvage``);
      it never blocks the rows behind it;
    - a part that cannot be stored (disk full, permissions) leaves no temporary file; its rows stay
      buffered, first in line, and are retried with exponential backoff (``retry_min_seconds`` ..
      ``retry_max_seconds``), at most ``flush_rows`` rows / ``flush_bytes`` bytes per part, so a
      retry never grows; the writer heals by itself once a write succeeds;
    - buffered rows are bounded by ``max_buffer_bytes``: past it ``extend`` raises
      :class:`BufferFull` (or calls ``on_full(rows, exc)`` when given) and keeps nothing of them.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        table: str,
        *,
        flush_rows: int = 5000,
        flush_bytes: int = 16 << 20,
        flush_seconds: float = 1.0,
        background: bool = True,
        fsync: bool = True,
        max_buffer_bytes: int = 256 << 20,
        retry_min_seconds: float = 0.5,
        retry_max_seconds: float = 30.0,
        on_full: Callable[[list[dict[str, Any]], BufferFull], None] | None = None,
    ) -> None:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; known: {sorted(TABLES)}")
        self.root = Path(root)
        self.table = table
        self.schema = TABLES[table]
        self.flush_rows = max(1, flush_rows)
        self.flush_bytes = flush_bytes
        self.flush_seconds = flush_seconds
        self.fsync = fsync
        self.max_buffer_bytes = max_buffer_bytes
        self.retry_min_seconds = retry_min_seconds
        self.retry_max_seconds = retry_max_seconds
        self.on_full = on_full
        self.rows_written = 0
        self.parts_written = 0
        self.rows_salvaged = 0  # rows written with some value repaired (salvaged=True where the table has it)
        self.rows_lost = 0  # rows that could not be encoded even after salvage (logged)
        self.rows_refused = 0  # rows refused because the buffer was full (BufferFull)
        self.write_failures = 0  # failed attempts to store a part
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # time.time()
        self._write_ok = True
        self._backoff = 0.0
        self._retry_at = 0.0  # time.monotonic() before which automatic flushes do not retry
        self._rows: list[dict[str, Any]] = []
        self._bytes = 0
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if background and flush_seconds > 0:
            self._thread = threading.Thread(target=self._ticker, name=f"flush-{table}", daemon=True)
            self._thread.start()

    # -- public API -------------------------------------------------------------------------
    def append(self, row: dict[str, Any]) -> None:
        self.extend([row])

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        """Buffer ``rows`` (all or none); raises ``BufferFull`` past ``max_buffer_bytes``."""
        rows = list(rows)
        for row in rows:
            unknown = set(row) - set(self.schema.names)
            if unknown:
                raise ValueError(f"{self.table}: unknown columns {sorted(unknown)}")
        size = sum(_row_bytes(r) for r in rows)
        with self._lock:
            full = bool(self._rows) and self._bytes + size > self.max_buffer_bytes
            if full:
                self.rows_refused += len(rows)
            else:
                self._rows.extend(rows)
                self._bytes += size
                if self._oldest is None and rows:
                    self._oldest = time.monotonic()
            due = len(self._rows) >= self.flush_rows or self._bytes >= self.flush_bytes
        if full:
            self._refuse(rows)
        elif due:
            self._auto_flush()

    @property
    def buffered(self) -> int:
        with self._lock:
            return len(self._rows)

    @property
    def healthy(self) -> bool:
        """The last attempt to store a part succeeded and the buffer has room."""
        return self._write_ok and self._bytes < self.max_buffer_bytes

    @property
    def retry_in(self) -> float:
        """Seconds until automatic flushes retry a failed write (0 when not backing off)."""
        return max(0.0, self._retry_at - time.monotonic())

    def health(self) -> dict[str, Any]:
        """Counters and the last storage error, for ``/_lh/state`` and logs."""
        with self._lock:
            pending, pending_bytes = len(self._rows), self._bytes
        return {
            "healthy": self.healthy, "rows_written": self.rows_written, "rows_pending": pending,
            "bytes_pending": pending_bytes, "rows_salvaged": self.rows_salvaged, "rows_lost": self.rows_lost,
            "rows_refused": self.rows_refused, "write_failures": self.write_failures,
            "last_error": self.last_error, "last_error_at": self.last_error_at,
        }

    def flush(self) -> Path | None:
        """Write everything buffered now (parts of at most ``flush_rows``/``flush_bytes``), ignoring
        the retry backoff; returns the last part written. A storage error is recorded in
        ``health()``, the rows stay buffered, and the error is raised."""
        last = None
        with self._write_lock:
            left = self.buffered  # rows arriving meanwhile wait for the next flush: this one ends
            while left > 0:
                chunk, oldest = self._take_chunk(left)
                if not chunk:
                    break
                left -= len(chunk)
                try:
                    last = self._write_rows(chunk) or last
                except BaseException as exc:
                    self._requeue(chunk, oldest)
                    self._failed(exc)
                    raise
                self._succeeded()
        return last

    def write_table(self, table: pa.Table) -> Path:
        """Write an already-built Arrow table as one part (bypasses the buffer)."""
        with self._write_lock:
            return self._write_arrow(table.cast(self.schema) if table.schema != self.schema else table)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- buffer -----------------------------------------------------------------------------
    def _take_chunk(self, at_most: int) -> tuple[list[dict[str, Any]], float | None]:
        """The oldest rows, at most one part's worth (a retry never grows past it)."""
        with self._lock:
            n, size, limit = 0, 0, min(len(self._rows), self.flush_rows, at_most)
            while n < limit and (n == 0 or size < self.flush_bytes):
                size += _row_bytes(self._rows[n])
                n += 1
            chunk, self._rows = self._rows[:n], self._rows[n:]
            oldest = self._oldest
            self._bytes -= size
            if not self._rows:
                self._bytes, self._oldest = 0, None
            return chunk, oldest

    def _requeue(self, rows: list[dict[str, Any]], oldest: float | None) -> None:
        with self._lock:
            self._rows[:0] = rows
            self._bytes += sum(_row_bytes(r) for r in rows)
            self._oldest = oldest if oldest is not None else (self._oldest or time.monotonic())

    def _refuse(self, rows: list[dict[str, Any]]) -> None:
        exc = BufferFull(
            f"{self.table}: {self._bytes:,} bytes already wait to be written (max_buffer_bytes="
            f"{self.max_buffer_bytes:,}); {len(rows)} new row(s) refused; last error: {self.last_error}"
        )
        if self.on_full is None:
            raise exc
        self.on_full(rows, exc)

    # -- health -----------------------------------------------------------------------------
    def _failed(self, exc: BaseException) -> None:
        self.write_failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:1000]
        self.last_error_at = time.time()
        self._write_ok = False
        self._backoff = min(self.retry_max_seconds, max(self.retry_min_seconds, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff
        log.warning("writing %s under %s failed (%s rows kept, retry in %.1f s): %s",
                    self.table, self.root, self.buffered, self._backoff, self.last_error)

    def _succeeded(self) -> None:
        if not self._write_ok:
            log.warning("writing %s under %s works again", self.table, self.root)
        self._write_ok, self._backoff, self._retry_at = True, 0.0, 0.0

    def _auto_flush(self) -> None:
        """A flush that respects the retry backoff and never raises (the error is in health())."""
        if time.monotonic() < self._retry_at:
            return
        with contextlib.suppress(Exception):  # recorded and logged by _failed
            self.flush()

    def _ticker(self) -> None:
        # A row is flushed at the last check before it turns flush_seconds old, never after: what a
        # SIGKILL can lose is then at most flush_seconds of rows (plus the write in progress).
        period = max(0.05, self.flush_seconds / 4)
        while not self._closed.wait(period):
            with self._lock:
                old = self._oldest is not None and time.monotonic() - self._oldest >= self.flush_seconds - period
            if old:
                self._auto_flush()

    # -- storage ----------------------------------------------------------------------------
    def _write_rows(self, rows: list[dict[str, Any]]) -> Path | None:
        """Encode (salvaging bad rows, counting lost ones) then store one part."""
        enc = encode_rows(rows, self.schema)
        if enc.lost:
            self.rows_lost += len(enc.lost)
            log.warning("%s: %d row(s) could not be encoded and are lost; first error: %s",
                        self.table, len(enc.lost), enc.lost[0])
        if enc.salvaged:
            self.rows_salvaged += enc.salvaged
            log.warning("%s: %d row(s) held values the schema cannot store; written with replacements",
                        self.table, enc.salvaged)
        rows[:] = enc.rows  # a retry after a storage failure re-encodes nothing
        if enc.table.num_rows == 0:
            return None
        return self._write_arrow(enc.table)

    def _write_arrow(self, table: pa.Table) -> Path:
        day = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
        folder = self.root / self.table / f"day={day}"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{int(time.time() * 1000)}-{os.getpid()}-{_WRITER_TAG}-{next(_counter):06d}.parquet"
        final = write_part(table, folder / name, self.schema.metadata or {}, fsync=self.fsync)
        self.rows_written += table.num_rows
        self.parts_written += 1
        return final


# footer key: the part's rows in memory (Arrow bytes). Compaction sizes its batches by it: the Parquet
# footer's own sizes count a dictionary-encoded value once, however many rows repeat it
RAW_BYTES = b"lightning.raw_bytes"


def write_part(table: pa.Table, final: Path, metadata: dict, *, fsync: bool, tmp: Path | None = None,
               check: Callable[[Path], None] | None = None, mode: int | None = None, **options: Any) -> Path:
    """Write ``table`` (``metadata`` + the schema version in its footer) under a hidden temporary name
    (``tmp``), fsync it, ``check(tmp)`` it, rename it to ``final``: a reader never sees half a file,
    and a failed write leaves nothing behind (disk full: frees the space). ``mode``: the file's permission
    bits instead of the umask's (created 0600, so it is never wider meanwhile). ``options``: pq.write_table's."""
    tmp = tmp or final.with_name(f".{final.name}.tmp")
    table = table.replace_schema_metadata({**metadata, b"lightning.schema_version": str(SCHEMA_VERSION).encode(),
                                           RAW_BYTES: str(table.nbytes).encode()})
    opener = None if mode is None else (lambda path, flags: os.open(path, flags, 0o600))
    try:
        with open(tmp, "wb", opener=opener) as fh:
            pq.write_table(table, fh, compression="zstd", **options)
            fh.flush()
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            if fsync:
                os.fsync(fh.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    try:  # the rename too: lost in a power cut, the fsynced rows sat in a temporary compaction deletes
        fsync_dir(final.parent, fsync)
    except OSError as exc:  # the part is in place: raising here made the writer store its rows again
        log.warning("part %s written, but its folder could not be fsynced: %s", final, exc)
    return final


def fsync_dir(folder: Path, fsync: bool) -> None:
    """Make the folder's entries (a rename, removals) durable."""
    if not fsync:
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# what pyarrow and DuckDB cannot be handed in a path: bytes that are not UTF-8 (Python holds them as lone
# surrogates) and the backslash, which DuckDB reads as a separator when it expands a pattern
_UNNAMEABLE = re.compile(r"[\\\ud800-\udfff]")
_aliases: dict[str, Path] = {}
_alias_lock = threading.Lock()


def plain_root(root: str | os.PathLike) -> Path:
    """``root``, or a symlink to it whose path every reader can be handed.

    Why: a traces folder whose name is not UTF-8 was written fine (Python passes bytes to the OS) but
    read as empty: pyarrow and DuckDB take UTF-8 text, so every part was skipped as "corrupt" and
    compaction never ran. Such a root (or one with a backslash) is reached through a symlink in a
    private temporary folder (mode 0700, removed at exit), named like the original with the odd bytes
    replaced, so warnings still say which store it is. Any other root is returned absolute: pyarrow takes a
    relative path whose first segment looks like a URI scheme (``exp:2/traces``, ``s3:tmp``) for a URI, so
    such a store read as empty (every part "corrupt") and was never compacted.
    """
    text = os.fsdecode(os.fspath(root))
    try:
        target = os.path.abspath(text)
    except OSError:  # the working directory was removed: a relative root names nothing anyway
        target = text
    if not _UNNAMEABLE.search(text):
        return Path(target)
    with _alias_lock:
        link = _aliases.get(target)
        if link is not None and os.path.islink(link):
            return link
        name = os.fsencode(os.path.basename(target)).decode("utf-8", "replace").replace("\\", "_") or "store"
        try:
            folder = tempfile.mkdtemp(prefix="lightning-store-")
            link = Path(folder) / name
            os.symlink(target, link)
        except OSError as exc:  # no usable temporary folder: the root as given (read as before)
            log.warning("cannot make a readable alias of %r (%s); its parts may read as corrupt", target, exc)
            return Path(text)
        atexit.register(shutil.rmtree, folder, True)
        _aliases[target] = link
        return link


def listed_parts(root: str | os.PathLike, table: str, *, attempts: int = 20) -> tuple[list[Path], list[Path]]:
    """:func:`finished_parts`, listed again while a part it found had vanished before its footer was read.

    Why: a compaction that commits its part and removes the inputs while a listing runs (grace 0) can
    leave that listing with the inputs gone (skipped) and the compacted part not yet seen: a reader
    silently missed their rows. A vanished part means the folder changed under the listing. A Parquet
    file that is not a part of ``table`` (:func:`not_of_table`) is skipped too.
    """
    for _ in range(attempts):
        good, bad = finished_parts(root, table)
        if all(os.path.lexists(p) for p in bad):
            break
    foreign = [p for p in good if not_of_table(p, table)]  # another table's or tool's file: its rows are not ours
    if foreign:
        left_out = set(foreign)
        good, bad = [p for p in good if p not in left_out], bad + foreign
    return good, bad


def not_of_table(part: str | os.PathLike, table: str) -> str | None:
    """Why the Parquet file ``part`` is not a part of ``table`` (None when it is, or when its footer does not
    read: :mod:`.checked` says why then): it shares no column with the table, or lacks a column the table
    never leaves null (``span_id``, ``reward_id``...). Cached by (path, size, mtime); one warning per file.

    Why: such a file in a table's folder (a query result saved with ``lightning-sql -o``, another tool's
    export) was read as rows of the table with every column NULL, and compacting it raised ArrowInvalid
    (a non-nullable column holding nulls) every round, which stopped the compaction of every later table
    and the training step that compacts before each update. It is left out and left in place.

    A column of the table typed in another family (:func:`typed_unlike`: text where the table has a timestamp
    or a number, rows round-tripped through JSON) makes a file no part either: DuckDB's ``union_by_name``
    typed the whole view column by it, and every query of the store failed, ``SELECT 1`` included.
    """
    key, check = str(part), f"part of {table}"
    try:
        st = os.stat(key)
        known = recall(key, st, check)
        if known is not UNKNOWN:
            return known
        found = pq.read_schema(key)
    except Exception:  # gone, or unreadable: the footer check (checked.part_error) decides about it
        return None
    schema, names = TABLES[table], set(found.names)
    missing = [f.name for f in schema if not f.nullable and f.name not in names]
    odd = typed_unlike(found, table, exact=False)
    why = None
    if not names & set(schema.names):
        why = f"no column in common with the {table} table"
    elif missing:
        why = f"lacks column(s) {', '.join(missing)} that every {table} row has"
    elif odd:
        why = f"column(s) {', '.join(odd)} of another type than the {table} table's"
    if why:
        log.warning("leaving out Parquet file %s: not a %s part (%s); left in place", key, table, why)
    return remember(key, st, check, why)


def typed_unlike(schema: pa.Schema, table: str, *, exact: bool) -> list[str]:
    """The columns of ``table`` that ``schema`` (a part's) types otherwise: any other type when ``exact``
    (compaction writes the table's types), else only another family (:func:`_family`: readers take an int32
    for an int64, a float for an int, a timestamp without time zone for one with, as DuckDB and pyarrow do)."""
    want = TABLES[table]
    return [f.name for f in schema if f.name in want.names and (
        f.type != want.field(f.name).type if exact else not _same_family(f.type, want.field(f.name).type))]


def _family(typ: pa.DataType) -> Any:
    """What a reader can take one type for another within: numbers, times, texts, bytes, lists."""
    if pa.types.is_dictionary(typ):
        return _family(typ.value_type)
    if pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ):
        return "number"
    if pa.types.is_timestamp(typ) or pa.types.is_date(typ):
        return "time"
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "text"
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
        return "bytes"
    if _is_list(typ):
        return "list"  # of what: _same_family
    return str(typ)  # bool, struct...: only itself


def _is_list(typ: pa.DataType) -> bool:
    return pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)


def _same_family(found: pa.DataType, want: pa.DataType) -> bool:
    if pa.types.is_null(found):  # a column (or lists) of nulls only: fits any
        return True
    if _is_list(found) and _is_list(want):
        return _same_family(found.value_type, want.value_type)
    return _family(found) == _family(want)


def read_table(root: str | os.PathLike, table: str, *, attempts: int = 20) -> pa.Table:
    """Read every finished part of a table (an empty table with the schema if there is none).

    A corrupt part is skipped with one warning naming it (``schemas.checked``), so one damaged
    file does not hide all the others. A part removed after it was listed (compaction put its rows
    in another part) makes the table listed and read again: its rows are never silently missing.
    """
    schema = TABLES[table]
    root = plain_root(root)
    for _ in range(attempts):
        parts = _read_listed(root, table, schema)
        if parts is not None:
            return pa.concat_tables(parts) if parts else schema.empty_table()
    raise RuntimeError(f"the parts of {table} under {root} kept changing while they were read ({attempts} tries)")


def _read_listed(root: Path, table: str, schema: pa.Schema) -> list[pa.Table] | None:
    """The listed parts' rows, or None when one vanished before it was read (list again)."""
    files, _skipped = listed_parts(root, table)
    parts = []
    for f in files:
        try:
            parts.append(pq.read_table(f, schema=schema))
        except MemoryError:  # not the part's fault, and a read without its rows would look complete
            raise
        except Exception as exc:  # footer fine, data damaged: same policy as an unreadable footer
            if not os.path.lexists(f):
                return None
            # the system refusing it now (EMFILE, EIO): skipped by this read only. A damaged compacted part:
            # list again, its inputs (still on disk) are read instead of it
            if mark_bad(f, exc) and replaced_parts(f, even_if_damaged=True):
                return None
    return parts
