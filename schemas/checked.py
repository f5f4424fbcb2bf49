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
_refused: set[tuple[str, int]] = set()  # (path, errno) already warned of: a refusal is said once


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
    except OSError as exc:
        if exc.errno is None:  # pyarrow's own IO errors on the file's content: damaged
            return _remember_footer(key, st, f"{type(exc).__name__}: {exc}", ())
        # the system refused (too many open files, EIO, permissions): not remembered, tried again next listing
        if (key, exc.errno) not in _refused:
            _refused.add((key, exc.errno))
            log.warning("cannot read Parquet part %s now (%s); skipped until it can be read", key, exc)
        return f"{type(exc).__name__}: {exc}", ()
    except Exception as exc:  # pyarrow raises ArrowInvalid...; any other failure means unreadable
        return _remember_footer(key, st, f"{type(exc).__name__}: {exc}", ())
    return _remember_footer(key, st, error, replaces)


def _remember_footer(key: str, st: os.stat_result, error: str | None,
                     replaces: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """Cache what a part's footer said (a damaged part warns once: when first found)."""
    if error:
        log.warning("skipping corrupt Parquet part %s (%s)", key, error)
    return remember(key, st, "footer", (error, replaces))


def part_error(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a readable Parquet file (None when its footer reads); cached, warns once."""
    return _footer(path)[0]


def replaced_parts(path: str | os.PathLike) -> tuple[str, ...]:
    """Names (same folder) of the parts a compacted part replaces; () for a part as written."""
    error, replaces = _footer(path)
    return () if error else replaces


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


def mark_bad(path: str | os.PathLike, error: str) -> None:
    """Remember that ``path`` failed to read past its footer (a damaged data page), warning once."""
    key = str(path)
    try:
        st = os.stat(key)
    except OSError:
        return
    known = recall(key, st, "footer")
    remember(key, st, "footer", (error, ()))
    if known is UNKNOWN or known[0] is None:
        log.warning("skipping corrupt Parquet part %s (%s)", key, error)
