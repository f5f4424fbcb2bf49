"""Which part files of a table a reader can trust: a corrupt part is skipped with one warning.

Why: parts are written atomically, but a traces directory can still hold a damaged file (copied
half-way, truncated by a full disk on another machine, edited by hand). DuckDB's
``read_parquet(glob)`` and pyarrow fail the whole read on it, so one bad file made every query,
even ``SELECT 1``, and every sample build fail. Readers list parts through :func:`finished_parts`
instead: each file's Parquet footer is read once (pyarrow), and a file whose footer cannot be read
is left out with one warning line naming it. Policy: *skip, never move or delete* (a reader must
not change the data it reads; the file stays for inspection or repair).

Checks are cached by (path, size, mtime), so listing a large directory again costs one ``stat`` per
file; a file that is replaced is checked again.

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

import pyarrow.parquet as pq

log = logging.getLogger("lightning.schemas")

_PART_NAME = re.compile(r"[A-Za-z0-9_.-]+\.parquet")  # a file in the part's own folder (no "/", not "..")
COMPACTED_FROM = b"lightning.compacted_from"  # footer key: JSON list of the part names a compacted part replaces

# path -> (size, mtime_ns, error or None, names of the parts it replaces)
_cache: dict[str, tuple[int, int, str | None, tuple[str, ...]]] = {}
_cache_lock = threading.Lock()
_MAX_CACHE = 1_000_000
_refused: set[tuple[str, int]] = set()  # (path, errno) already warned of: a refusal is said once


def part_files(root: str | os.PathLike, table: str) -> list[Path]:
    """Every finished part of ``table`` (``*.parquet``, hidden temporary files excluded), sorted."""
    return sorted(p for p in (Path(root) / table).glob("**/*.parquet") if not p.name.startswith("."))


def _footer(path: str | os.PathLike) -> tuple[str | None, tuple[str, ...]]:
    """(why unreadable or None, names of the parts it replaces) of one part; cached, warns once."""
    key = str(path)
    try:
        st = os.stat(key)
    except OSError as exc:  # removed meanwhile: not a part any more
        return f"{type(exc).__name__}: {exc}", ()
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None and hit[:2] == (st.st_size, st.st_mtime_ns):
        return hit[2], hit[3]
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
            return _remember(key, st, f"{type(exc).__name__}: {exc}", ())
        # the system refused (too many open files, EIO, permissions): not remembered, tried again next listing
        if (key, exc.errno) not in _refused:
            _refused.add((key, exc.errno))
            log.warning("cannot read Parquet part %s now (%s); skipped until it can be read", key, exc)
        return f"{type(exc).__name__}: {exc}", ()
    except Exception as exc:  # pyarrow raises ArrowInvalid...; any other failure means unreadable
        return _remember(key, st, f"{type(exc).__name__}: {exc}", ())
    return _remember(key, st, error, replaces)


def _remember(key: str, st: os.stat_result, error: str | None,
              replaces: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """Cache what a part's footer said (a damaged part warns once: when first found)."""
    if error:
        log.warning("skipping corrupt Parquet part %s (%s)", key, error)
    with _cache_lock:
        if len(_cache) > _MAX_CACHE:
            _cache.clear()
        _cache[key] = (st.st_size, st.st_mtime_ns, error, replaces)
    return error, replaces


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
    with _cache_lock:
        known = _cache.get(key)
        _cache[key] = (st.st_size, st.st_mtime_ns, error, ())
    if known is None or known[2] is None:
        log.warning("skipping corrupt Parquet part %s (%s)", key, error)
