"""Which part files of a table a reader can trust: a corrupt part is skipped with one warning.

Why: parts are written atomically, but a traces directory can still hold a damaged file (copied
half-way, truncated by a full disk on another machine, edited by hand). DuckDB's
``read_parquet(glob)`` and pyarrow fail the whole read on it, so one bad file made every query,
even ``SELECT 1``, and every sample build fail. Readers list parts through :func:`finished_parts`
instead: each file's Parquet footer is read once (pyarrow), and a file whose footer cannot be read
is left out with one warning line naming it. Policy: *skip, never move or delete* (a reader must
not change the data it reads; the file stays for inspection or repair).

Every per-file verdict of the readers (this footer check, :func:`.parts.not_of_table`, the views' whole
read of a part after a DuckDB error naming no file) is kept in one cache here, keyed by (path, size,
mtime) (:func:`recall`, :func:`remember`): listing a large directory again costs one ``stat`` per file,
and a file that is replaced is judged again by every check.

Compaction (``schemas.compact``): a compacted part names the parts it replaces in its footer
(``lightning.compacted_from``, names in the same folder). Those inputs stay on disk for a grace
period after the compacted part appears (a reader that listed them earlier can still read them),
but :func:`finished_parts` leaves them out from that moment on: a reader never sees a row twice.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

log = logging.getLogger("lightning.schemas")

_PART_NAME = re.compile(r"[A-Za-z0-9_.-]+\.parquet")  # a file in the part's own folder (no "/", not "..")
COMPACTED_FROM = b"lightning.compacted_from"  # footer key: JSON list of the part names a compacted part replaces

# path -> (size, mtime_ns, {check: its verdict on that version of the file})
_cache: dict[str, tuple[int, int, dict[str, Any]]] = {}
_cache_lock = threading.Lock()
_MAX_CACHE = 1_000_000
UNKNOWN = object()  # recall()'s answer for a check not made on this version of the file
_refused: set[tuple[str, int | str]] = set()  # (path, errno or error type) warned of: a refusal is said once


def part_files(root: str | os.PathLike, table: str) -> list[Path]:
    """Every finished part of ``table`` (``*.parquet``, hidden temporary files excluded), sorted."""
    return sorted(p for p in (Path(root) / table).glob("**/*.parquet") if not p.name.startswith("."))


def recall(key: str, st: os.stat_result, check: str) -> Any:
    """What ``check`` said of the file at ``key`` as ``st`` finds it (same size and mtime), else UNKNOWN."""
    with _cache_lock:
        hit = _cache.get(key)
    if hit is None or hit[:2] != (st.st_size, st.st_mtime_ns):
        return UNKNOWN
    return hit[2].get(check, UNKNOWN)


def remember(key: str, st: os.stat_result, check: str, verdict: Any) -> Any:
    """Keep ``check``'s verdict on this version of the file (a changed file drops every earlier one)."""
    with _cache_lock:
        hit = _cache.get(key)
        if hit is None or hit[:2] != (st.st_size, st.st_mtime_ns):
            if len(_cache) > _MAX_CACHE:
                _cache.clear()
            hit = _cache[key] = (st.st_size, st.st_mtime_ns, {})
        hit[2][check] = verdict
    return verdict


def _footer(path: str | os.PathLike) -> tuple[str | None, tuple[str, ...]]:
    """(why unreadable or None, names of the parts it replaces) of one part; cached, warns once."""
    key = str(path)
    try:
        st = os.stat(key)
    except OSError as exc:  # removed meanwhile: not a part any more
        return f"{type(exc).__name__}: {exc}", ()
    known = recall(key, st, "footer")
    if known is not UNKNOWN:
        return known
    replaces: tuple[str, ...] = ()
    try:
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device named *.parquet: opening it would hang every reader
            raise ValueError("not a regular file")
        meta = pq.read_metadata(key).metadata or {}
        error = None
        if COMPACTED_FROM in meta:
            replaces = tuple(str(n) for n in json.loads(meta[COMPACTED_FROM]))
            if not all(_PART_NAME.fullmatch(n) for n in replaces):  # compaction deletes these: plain names only
                raise ValueError(f"{COMPACTED_FROM.decode()} names something other than parts of its folder")
    except Exception as exc:  # pyarrow raises ArrowInvalid...; any failure but the system's means unreadable
        if not_the_files_fault(exc):  # not remembered: tried again next listing
            _refuse(key, exc)
            return f"{type(exc).__name__}: {exc}", ()
        return _remember_footer(key, st, f"{type(exc).__name__}: {exc}", ())
    return _remember_footer(key, st, error, replaces)


# what the C library says of each errno ("Too many open files"...): DuckDB ends an error of the system with it
_SYSTEM_ERRORS = tuple(f": {os.strerror(n)}" for n in errno.errorcode if n)


def not_the_files_fault(exc: BaseException) -> bool:
    """Whether reading a part failed for a reason of this process or system, not of the file's content:
    an OSError with an errno (too many open files, EIO, ESTALE, permissions), a lack of memory (MemoryError,
    pyarrow.ArrowMemoryError, DuckDB's OutOfMemoryException), or a DuckDB IO error that ends with the system's
    error text (``Cannot open file "...": Too many open files``). pyarrow's own IO errors on a file's bytes
    have no errno, DuckDB's on them no system text ("not a parquet file", "Invalid Input").

    Why it matters: a verdict of "corrupt" is remembered for the file's (size, mtime), so a part the system
    refused once stayed hidden for the rest of the process (its rows missing from every later read), and a
    compacted part hidden so made its inputs compactable again: their rows were stored twice.
    """
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryException":
        return True
    if isinstance(exc, OSError):
        return exc.errno is not None
    if "duckdb" not in type(exc).__module__ or type(exc).__name__ != "IOException":
        return False
    first = (str(exc).strip().splitlines() or [""])[0]
    return first.endswith(_SYSTEM_ERRORS)


def _refuse(key: str, exc: BaseException) -> None:
    """Warn once per (file, error kind) that the system refused to read it now (nothing remembered)."""
    kind = (key, getattr(exc, "errno", None) or type(exc).__name__)
    if kind not in _refused:
        _refused.add(kind)
        log.warning("cannot read Parquet part %s now (%s: %s); not taken for damaged: read again next time",
                    key, type(exc).__name__, " ".join(str(exc).split())[:300])


def _remember_footer(key: str, st: os.stat_result, error: str | None,
                     replaces: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """Cache what a part's footer said (a damaged part warns once: when first found)."""
    if error:
        log.warning("skipping corrupt Parquet part %s (%s)", key, error)
    return remember(key, st, "footer", (error, replaces))


def part_error(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a readable Parquet file (None when its footer reads); cached, warns once."""
    return _footer(path)[0]


def replaced_parts(path: str | os.PathLike, *, even_if_damaged: bool = False) -> tuple[str, ...]:
    """Names (same folder) of the parts a compacted part replaces; () for a part as written.
    ``even_if_damaged``: also those of a part whose footer read but whose data did not (:func:`mark_bad`):
    compaction never takes them again (a second copy of their rows), readers still read them."""
    error, replaces = _footer(path)
    return () if error and not even_if_damaged else replaces


def finished_parts(root: str | os.PathLike, table: str) -> tuple[list[Path], list[Path]]:
    """``(readable, skipped)`` part files of ``table`` under ``root``; parts a readable compacted
    part replaces are neither (they are on their way out and their rows are in the compacted part)."""
    good, bad = [], []
    replaced: set[str] = set()
    for path in part_files(root, table):
        error, replaces = _footer(path)
        (bad if error else good).append(path)
        if replaces and not error:
            folder = str(path.parent)
            replaced.update(os.path.join(folder, name) for name in replaces)
    if replaced:
        good = [p for p in good if str(p) not in replaced]
        bad = [p for p in bad if str(p) not in replaced]
    return good, bad


def mark_bad(path: str | os.PathLike, error: str | BaseException) -> bool:
    """Remember that ``path`` failed to read past its footer (a damaged data page), warning once; True when
    remembered. An ``error`` that is not the file's fault (:func:`not_the_files_fault`) is not: the part is
    skipped by this read only (one warning), else it stayed hidden for the rest of the process.

    The names its footer says it replaces are kept: forgotten, a compacted part marked bad made its inputs
    (on disk for the grace period) compactable again, and their rows were stored twice."""
    key = str(path)
    if isinstance(error, BaseException):
        if not_the_files_fault(error):
            _refuse(key, error)
            return False
        error = f"{type(error).__name__}: {error}"
    try:
        st = os.stat(key)
    except OSError:
        return False
    known = recall(key, st, "footer")
    if known is UNKNOWN:
        known = _footer(key)  # an unreadable footer warns there
    remember(key, st, "footer", (error, known[1]))
    if known[0] is None:
        log.warning("skipping corrupt Parquet part %s (%s)", key, error)
    return True
