"""DuckDB views over a traces directory: the one place that knows how the Parquet tables join.

``connect(TRACES)`` returns an in-memory DuckDB connection with these views:

``spans``, ``rewards``, ``rollouts_raw``, ``samples``, ``metrics``
    the Parquet tables as written (``TRACES/<table>/**/*.parquet``). A table with no part file
    yet is an empty view with the schema's columns, so every query works on a fresh directory.
``calls``
    one row per model call, flattened for analysis (token counts, latency, error, version).
``rollouts``
    one row per rollout attempt ``(rollout_id, attempt)`` seen in *any* table: launcher rows,
    spans of a proxy used alone, or rewards POSTed for it. ``reward`` follows the precedence of
    schemas/rewards.py (``precedence_sql``): a verifier report (``command``, ``api``) outranks a
    self-report (``proxy``, ``file``), the latest wins within a rank. An attempt the launcher judged keeps
    the launcher's reward (it already weighed the self-reports, or was told to ignore them with --no-self-reward)
    unless a verifier-rank report came after it ended (the operator re-scoring); so a self-report
    posted after scoring never changes it. ``state`` is the launcher's (``no_reward`` becomes
    ``succeeded`` when such a later verifier reward exists), or derived (``succeeded`` with a reward,
    ``no_reward`` without) when there is no launcher row.

Views read the list of readable parts found at ``connect``/``define_views`` time (not a glob):
compaction (``schemas.compact``) may put a compacted part beside the parts it replaces, and a glob
bound later would read both. A long-lived connection calls ``define_views`` again to see new parts
(``lightning-sql``'s shell does before every statement); replaced parts stay on disk for a grace
period, and :func:`past_damaged_parts` redefines and retries once a listed part is gone.
A corrupt part file (truncated, damaged footer) is skipped with one warning line naming it
(``schemas.checked``: checks cached by path, size and mtime), and so is a Parquet file that is no part
of its table (``schemas.parts.not_of_table``: a saved query result, another tool's export).

``connect(TRACES, rollouts=IDS)`` restricts ``spans``, ``rewards`` and ``rollouts_raw`` (and so
``calls`` and ``rollouts``) to those rollout ids: the filter reaches the Parquet scans, whose
row-group statistics skip what holds none of them, so a query about a few rollouts costs what they
weigh, not what the store weighs (sample building for one update uses it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from ..schemas import TABLES
from ..schemas.checked import mark_bad, part_error, recall, remember
from ..schemas.parts import listed_parts, plain_root
from ..schemas.rewards import VERIFIER, precedence_sql, rank_sql
from ..schemas.states import NO_REWARD, SUCCEEDED

T = TypeVar("T")

RAW_VIEWS = {"spans": "spans", "rewards": "rewards", "rollouts": "rollouts_raw", "samples": "samples",
             "metrics": "metrics"}


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


_GLOB = re.compile(r"[*?\[]")


def _part_source(path: Path) -> str | None:
    """``path`` as DuckDB's ``read_parquet`` names exactly that file, None where it cannot.

    Why: DuckDB expands ``* ? [`` in every path of the list. A store under ``runs/exp[1]`` read the parts
    of ``runs/exp1`` instead, ``x*`` read ``x`` and ``xy`` both, and a file named ``*.parquet`` read its
    whole folder, replaced parts included (rows twice). Each such character becomes a one-character
    class (``[*]``). DuckDB cannot match one beside a backslash (a separator to it), so such a name
    (never written here; roots with one are aliased by ``plain_root``) is left out.
    """
    text = str(path)
    if not _GLOB.search(text):
        return text
    if "\\" in text:
        return None
    return _GLOB.sub(lambda m: f"[{m.group(0)}]", text)


ROLLOUT_KEYED = ("spans", "rewards", "rollouts")  # tables with a rollout_id column to prune on


def _create_raw_view(con: duckdb.DuckDBPyConnection, root: Path, table: str, view: str,
                     rollouts: list[str] | None = None) -> None:
    schema: pa.Schema = TABLES[table]
    good, _bad = listed_parts(root, table)  # corrupt, replaced or foreign parts: left out
    _remember_listing(root, table, good)
    sources = []
    for f in good:
        name = _part_source(f)
        if name is None:
            mark_bad(f, "a backslash beside * ? or [ in its path: DuckDB cannot name it; rename it to read it")
        else:
            sources.append(name)
    if sources:
        source = "[" + ", ".join(_sql_str(n) for n in sources) + "]"
        only = ""
        if rollouts is not None and table in ROLLOUT_KEYED:
            only = " WHERE rollout_id IN (" + (", ".join(_sql_str(r) for r in rollouts) or "NULL") + ")"
        # union_by_name: parts written by an older schema version still read; hive columns (day=)
        # are not added so the view has exactly the schema's columns (plus any newer ones).
        con.execute(
            f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM read_parquet({source}, "
            f"union_by_name = true, hive_partitioning = false){only}"
        )
    else:
        empty = f"_empty_{table}"
        con.register(empty, schema.empty_table())
        con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM {empty}")


CALLS_SQL = """
CREATE OR REPLACE VIEW calls AS
SELECT
    span_id, rollout_id, attempt, seq, model_version,
    started_at, ended_at, latency_ms, ttft_ms,
    mode, endpoint, upstream, model, served_model, stream, status_code, finish_reason,
    coalesce(len(prompt_token_ids), prompt_tokens)          AS prompt_len,
    coalesce(len(response_token_ids), completion_tokens)    AS response_len,
    coalesce(len(prompt_token_ids), prompt_tokens, 0)
      + coalesce(len(response_token_ids), completion_tokens, 0) AS total_tokens,
    prompt_token_ids IS NOT NULL AND response_token_ids IS NOT NULL AS has_token_ids,
    response_logprobs IS NOT NULL                            AS has_logprobs,
    token_ids_injected,
    error_kind IS NOT NULL                                   AS is_error,
    error_kind, error
FROM spans
"""

ROLLOUTS_SQL = """
CREATE OR REPLACE VIEW rollouts AS
WITH
launcher AS (
    SELECT * FROM rollouts_raw
    QUALIFY row_number() OVER (PARTITION BY rollout_id, attempt ORDER BY ended_at DESC NULLS LAST) = 1
),
ranked_reward AS (
    SELECT w.rollout_id, coalesce(w.attempt, 0) AS attempt, w.reward, w.source AS reward_source,
           w.created_at AS reward_at, w.reward_id,
           {rank} = {verifier} AS verifier,
           l.rollout_id IS NOT NULL AS judged, l.ended_at AS judged_at
    FROM rewards w
    LEFT JOIN launcher l ON l.rollout_id = w.rollout_id AND l.attempt = coalesce(w.attempt, 0)
),
latest_reward AS (
    -- a judged attempt: only a verifier report newer than its end (the launcher weighed the rest)
    SELECT rollout_id, attempt, reward, reward_source, reward_at
    FROM ranked_reward
    WHERE NOT judged OR (verifier AND reward_at > judged_at)
    QUALIFY row_number() OVER (PARTITION BY rollout_id, attempt
                               ORDER BY {precedence}, reward_id DESC) = 1
),
span_agg AS (
    SELECT rollout_id, coalesce(attempt, 0) AS attempt,
           count(*)                                        AS n_calls,
           count(*) FILTER (WHERE error_kind IS NOT NULL)  AS n_errors,
           sum(coalesce(len(prompt_token_ids), prompt_tokens, 0))::BIGINT       AS prompt_tokens,
           sum(coalesce(len(response_token_ids), completion_tokens, 0))::BIGINT AS response_tokens,
           min(model_version) AS model_version_min, max(model_version) AS model_version_max,
           min(started_at) AS first_call_at, max(ended_at) AS last_call_at
    FROM spans WHERE rollout_id IS NOT NULL
    GROUP BY ALL
),
keys AS (
    SELECT rollout_id, attempt FROM launcher
    UNION SELECT rollout_id, attempt FROM latest_reward
    UNION SELECT rollout_id, attempt FROM span_agg
)
SELECT
    k.rollout_id, k.attempt,
    l.run_id, l.task_id, l.group_id, l.sample_index, l.step, l.split,
    CASE
        WHEN l.state IS NULL
            THEN (CASE WHEN coalesce(r.reward, l.reward) IS NULL THEN '{no_reward}' ELSE '{succeeded}' END)
        WHEN l.state = '{no_reward}' AND r.reward IS NOT NULL THEN '{succeeded}'
        ELSE l.state
    END AS state,
    coalesce(r.reward, l.reward)               AS reward,
    coalesce(r.reward_source, l.reward_source) AS reward_source,
    l.state IS NOT NULL                        AS has_launcher_row,
    l.exit_code, l.duration_s, l.error, l.runner, l.task_json,
    coalesce(l.model_version, s.model_version_min) AS model_version,
    coalesce(s.n_calls, 0)         AS n_calls,
    coalesce(s.n_errors, 0)        AS n_errors,
    coalesce(s.prompt_tokens, 0)   AS prompt_tokens,
    coalesce(s.response_tokens, 0) AS response_tokens,
    s.model_version_min, s.model_version_max,
    coalesce(l.started_at, s.first_call_at) AS started_at,
    coalesce(l.ended_at, s.last_call_at)    AS ended_at
FROM keys k
LEFT JOIN launcher l      USING (rollout_id, attempt)
LEFT JOIN latest_reward r USING (rollout_id, attempt)
LEFT JOIN span_agg s      USING (rollout_id, attempt)
"""


def _rollouts_sql() -> str:
    """The ``rollouts`` view with the reward precedence and the state names filled in from schemas."""
    return ROLLOUTS_SQL.format(rank=rank_sql("w.source"), verifier=VERIFIER, no_reward=NO_REWARD, succeeded=SUCCEEDED,
                               precedence=precedence_sql("reward_source", "reward_at"))


def define_views(con: duckdb.DuckDBPyConnection, traces_dir: str | os.PathLike,
                 rollouts: Iterable[str] | None = None, *, attempts: int = 20) -> duckdb.DuckDBPyConnection:
    """(Re)define every view of ``traces_dir`` on an existing connection (``rollouts``: see module doc).

    Listed again when a listed part is gone before DuckDB bound the views (it opens every part then):
    a compaction without grace period (the loop at its exit, ``lightning-train compact --grace-s 0``)
    made ``connect`` itself fail with "No files found" when it removed a part in between.
    """
    root = plain_root(traces_dir)  # a folder named in bytes that are not UTF-8 read as empty
    only = None if rollouts is None else sorted({str(r) for r in rollouts})
    for left in range(attempts, 0, -1):
        try:
            for table, view in RAW_VIEWS.items():
                _create_raw_view(con, root, table, view, only)
            con.execute(CALLS_SQL)
            con.execute(_rollouts_sql())
            return con
        except duckdb.Error as exc:
            path = _part_in_error(str(exc))
            if left == 1 or path is None or os.path.lexists(path):
                raise
    return con


def connect(traces_dir: str | os.PathLike, *, threads: int | None = None,
            rollouts: Iterable[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the trace views of ``traces_dir`` defined.

    Raises ``FileNotFoundError`` for a missing directory (a typo should not look like empty traces).
    """
    root = Path(traces_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"traces directory {str(root)!r} does not exist")
    con = duckdb.connect(":memory:")
    con.execute("SET enable_progress_bar = false")  # library use: callers show their own progress
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    return define_views(con, root, rollouts)


_PART_END = re.compile(r"""\.parquet(["'])""")


def _part_in_error(message: str) -> str | None:
    """The Parquet file a DuckDB error names: between a quote and ``.parquet`` + the same quote.

    The path may hold quotes itself (``bob's traces``, a single-quote-only pattern missed it and the
    query failed instead of skipping the damaged part): every opening quote is tried, nearest first,
    and an existing file wins.
    """
    first = None
    for m in _PART_END.finditer(message):
        quote, end = m.group(1), m.end() - 1
        start = message.rfind(quote, 0, m.start())
        while start >= 0:
            path = message[start + 1:end]
            if os.path.isfile(path):
                return path
            first = first or path
            start = message.rfind(quote, 0, start)
    return first


def past_damaged_parts(run: Callable[[], T], redefine: Callable[[], object], *, attempts: int = 100) -> T:
    """``run()``; when DuckDB fails on a part whose footer read fine but whose data is damaged, mark it
    corrupt (one warning), ``redefine()`` the views and run again. The part is the file the error names;
    an error naming none ("Out of buffer", "dictionary offset out of range") has the parts the views were
    last defined on read whole with pyarrow (:func:`_damaged_listed_parts`, slow: only then).

    Why: :func:`finished_parts` checks footers only (cheap); a damaged data page shows up only
    when a query reads it. Same policy then: skip the file, keep it on disk, go on. An error of the system
    (``Cannot open file ...: Too many open files``; ``checked.not_the_files_fault``) is raised instead: taken
    for damage, it hid a sound part from every later query of the process.
    """
    seen: set[str] = set()
    while True:
        try:
            return run()
        except duckdb.Error as exc:
            path = _part_in_error(str(exc))
            if path is None and len(seen) < attempts:
                found = _damaged_listed_parts(exc)
                if found:
                    seen.update(found)
                    redefine()
                    continue
            if path is None or path in seen or len(seen) >= attempts:
                raise
            seen.add(path)
            # the system refusing the file now (too many open files, EIO): the query fails, nothing is remembered
            if os.path.isfile(path) and not mark_bad(path, exc):
                raise
            # else: removed since the views were defined (compaction replaced it): list again
            redefine()


VIEW_NAMES = ("spans", "rewards", "rollouts_raw", "calls", "rollouts", "samples", "metrics")


# (root, table) -> the parts its views were last defined on (any connection of this process); bounded
_listings: dict[tuple[str, str], tuple[Path, ...]] = {}
_MAX_LISTINGS = 64
# errors of the statement itself, not of the data it read: reading every part would find nothing
_NOT_DATA = (duckdb.ParserException, duckdb.SyntaxException, duckdb.BinderException, duckdb.CatalogException,
             duckdb.InterruptException, duckdb.OutOfMemoryException, duckdb.TransactionException,
             duckdb.ConstraintException, duckdb.PermissionException)


def _remember_listing(root: Path, table: str, parts: list[Path]) -> None:
    key = (str(root), table)
    _listings.pop(key, None)
    _listings[key] = tuple(parts)
    while len(_listings) > _MAX_LISTINGS:
        _listings.pop(next(iter(_listings)))


def _damaged_listed_parts(exc: duckdb.Error) -> list[str]:
    """The parts the views were last defined on that pyarrow cannot read whole, each marked corrupt (one
    warning naming it and DuckDB's error). Parts read whole before (same size and mtime) are not read again.

    Why: DuckDB fails on some damaged data pages with an error naming no file ("Out of buffer", "Parquet
    file is likely corrupted, dictionary offset out of range", "don't know what type"), so the part could
    not be skipped and one damaged file failed every query and sample build of the store.
    """
    if isinstance(exc, _NOT_DATA):
        return []
    found = []
    for parts in list(_listings.values()):
        for part in parts:
            key = str(part)
            try:
                st = os.stat(key)
            except OSError:  # gone since (compaction): the retry lists again
                continue
            if recall(key, st, "read whole") is True or part_error(key):
                continue
            why = _read_whole(key)
            if why is None:
                remember(key, st, "read whole", True)
            elif why:  # one line, control characters escaped: the texts quote the damaged bytes
                text = " ".join(f"{type(exc).__name__}: {str(exc)[:200]}; reading it whole: {why}".split())
                mark_bad(key, ascii(text)[1:-1])
                found.append(key)
    return found


def _read_whole(path: str) -> str | None:
    """Why pyarrow cannot read every row group of ``path`` ('' when the system refused it for now:
    not the file's fault), None when it reads."""
    try:
        with pq.ParquetFile(path) as pf:
            for i in range(pf.num_row_groups):
                pf.read_row_group(i)
    except MemoryError:
        raise
    except OSError as exc:
        if exc.errno is not None:  # EMFILE, EACCES, EIO...: tried again another time
            return ""
        return f"{type(exc).__name__}: {exc}"[:300]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return None
