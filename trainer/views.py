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
    launcher/rewards.py: a verifier report (``command``, ``api``) outranks a self-report (``proxy``,
    ``file``), the latest wins within a rank. An attempt the launcher judged keeps the launcher's
    reward (it already weighed the self-reports, or was told to ignore them with --no-self-reward)
    unless a verifier-rank report came after it ended (the operator re-scoring); so a self-report
    posted after scoring never changes it. ``state`` is the launcher's (``no_reward`` becomes
    ``succeeded`` when such a later verifier reward exists), or derived (``succeeded`` with a reward,
    ``no_reward`` without) when there is no launcher row.

Views re-read the directory on every query (DuckDB binds globs per query), so a live traces
directory can be watched from one connection; only a table that had no file at connect time stays
empty until the next ``connect``.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa

from ..launcher.rewards import VERIFIER_SOURCES
from ..schemas import TABLES

RAW_VIEWS = {"spans": "spans", "rewards": "rewards", "rollouts": "rollouts_raw", "samples": "samples", "metrics": "metrics"}


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _has_parts(root: Path, table: str) -> bool:
    base = root / table
    return base.is_dir() and any(not p.name.startswith(".") for p in base.glob("**/*.parquet"))


def _create_raw_view(con: duckdb.DuckDBPyConnection, root: Path, table: str, view: str) -> None:
    schema: pa.Schema = TABLES[table]
    if _has_parts(root, table):
        glob = str(root / table / "**" / "*.parquet")
        # union_by_name: parts written by an older schema version still read; hive columns (day=)
        # are not added so the view has exactly the schema's columns (plus any newer ones).
        con.execute(
            f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM read_parquet({_sql_str(glob)}, "
            "union_by_name = true, hive_partitioning = false)"
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
           coalesce(w.source IN (VERIFIER_SOURCES), false) AS verifier,
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
                               ORDER BY verifier DESC, reward_at DESC NULLS LAST, reward_id DESC) = 1
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
        WHEN l.state IS NULL THEN (CASE WHEN coalesce(r.reward, l.reward) IS NULL THEN 'no_reward' ELSE 'succeeded' END)
        WHEN l.state = 'no_reward' AND r.reward IS NOT NULL THEN 'succeeded'
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
    return ROLLOUTS_SQL.replace("VERIFIER_SOURCES", ", ".join(_sql_str(s) for s in VERIFIER_SOURCES))


def define_views(con: duckdb.DuckDBPyConnection, traces_dir: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """(Re)define every view of ``traces_dir`` on an existing connection."""
    root = Path(traces_dir)
    for table, view in RAW_VIEWS.items():
        _create_raw_view(con, root, table, view)
    con.execute(CALLS_SQL)
    con.execute(_rollouts_sql())
    return con


def connect(traces_dir: str | os.PathLike, *, threads: int | None = None) -> duckdb.DuckDBPyConnection:
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
    return define_views(con, root)


VIEW_NAMES = ("spans", "rewards", "rollouts_raw", "calls", "rollouts", "samples", "metrics")
