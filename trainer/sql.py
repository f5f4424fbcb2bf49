"""`lightning-sql TRACES_DIR [QUERY]`: ad hoc SQL over the trace views (DuckDB).

With a QUERY (or ``-q NAME`` for a canned one) it prints the result as a table, CSV, JSON, or writes
Parquet. Without one it opens a small interactive shell (readline line editing; statements end
with ``;``; dot commands ``.help``). DuckDB's Python package has no shell of its own and the
``duckdb`` CLI is often not installed, so the shell is ours: it always has the views defined.
Views: see ``views.py`` (``spans``, ``rewards``, ``rollouts_raw``, ``calls``, ``rollouts``,
``samples``, ``metrics``). The canned queries are documented in docs/SQL.md.
"""

from __future__ import annotations

import csv
import decimal
import json
import math
import re
import sys
from typing import Any

import click
import duckdb
import pyarrow as pa
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .views import VIEW_NAMES, connect, define_views, past_damaged_parts

CANNED: dict[str, tuple[str, str]] = {
    "tokens_per_rollout": (
        "Calls and tokens per rollout attempt: generated tokens, longest context, prompt tokens sent.",
        """SELECT c.rollout_id, c.attempt, count(*) AS calls,
       sum(c.response_len) AS generated_tokens,
       max(c.total_tokens) AS max_context,
       sum(c.prompt_len) AS prompt_tokens_sent,
       any_value(r.reward) AS reward, any_value(r.state) AS state
FROM calls c LEFT JOIN rollouts r USING (rollout_id, attempt)
WHERE c.rollout_id IS NOT NULL
GROUP BY ALL ORDER BY generated_tokens DESC""",
    ),
    "latency_by_version": (
        "Latency percentiles (ms) of successful calls per policy version.",
        """SELECT model_version, count(*) AS calls,
       round(quantile_cont(latency_ms, 0.5), 1)  AS p50_ms,
       round(quantile_cont(latency_ms, 0.9), 1)  AS p90_ms,
       round(quantile_cont(latency_ms, 0.99), 1) AS p99_ms,
       round(max(latency_ms), 1) AS max_ms,
       round(avg(ttft_ms), 1) AS mean_ttft_ms,
       round(sum(response_len) / nullif(sum(latency_ms) / 1000, 0), 1) AS tokens_per_s_per_call
FROM calls WHERE NOT is_error
GROUP BY model_version ORDER BY model_version""",
    ),
    "reward_by_task": (
        "Reward per task: rollouts, how many were rewarded, mean / std / min / max, success share.",
        """SELECT coalesce(task_id, '(none)') AS task_id, count(*) AS rollouts, count(reward) AS rewarded,
       round(avg(reward), 4) AS mean_reward, round(stddev_samp(reward), 4) AS std_reward,
       min(reward) AS min_reward, max(reward) AS max_reward,
       round(avg(CASE WHEN state = 'succeeded' THEN 1.0 ELSE 0.0 END), 3) AS succeeded_share
FROM rollouts GROUP BY ALL ORDER BY mean_reward NULLS LAST, task_id""",
    ),
    "merge_breaks": (
        "Why samples did not continue the previous one (from the samples table; run `lightning-train build` first).",
        """SELECT coalesce(break_reason, '(first sample of rollout)') AS reason, count(*) AS samples,
       count(DISTINCT rollout_id || '~' || attempt) AS rollouts, sum(n_calls) AS calls,
       round(avg(n_calls), 2) AS calls_per_sample, sum(CASE WHEN retokenized THEN 1 ELSE 0 END) AS retokenized
FROM samples GROUP BY ALL ORDER BY samples DESC""",
    ),
    "error_rate_by_upstream": (
        "Calls, errors and error rate per upstream, with the most common error kind.",
        """SELECT coalesce(upstream, '(unrouted)') AS upstream, count(*) AS calls,
       count(*) FILTER (WHERE is_error) AS errors,
       round(100.0 * count(*) FILTER (WHERE is_error) / count(*), 2) AS error_pct,
       mode(error_kind) AS top_error_kind,
       count(*) FILTER (WHERE NOT has_token_ids AND NOT is_error) AS calls_without_token_ids
FROM calls GROUP BY ALL ORDER BY error_pct DESC, calls DESC""",
    ),
    "reward_by_step": (
        "Mean reward and rollout states per training step.",
        """SELECT step, count(*) AS rollouts, round(avg(reward), 4) AS mean_reward,
       count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE state IN ('failed', 'timed_out')) AS failed_or_timed_out,
       count(*) FILTER (WHERE reward IS NULL) AS without_reward
FROM rollouts GROUP BY step ORDER BY step NULLS FIRST""",
    ),
}

FORMATS = ("table", "csv", "json", "parquet")


# control characters (ESC, CR, backspace, C1) and bidi overrides: shown as escapes, never sent to a terminal
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _cell(v: Any, width: int = 60) -> Text:
    """A table cell as plain text: no rich markup, no terminal control sequence.

    Why: cells hold what harnesses and models wrote. As a string, rich parsed it as markup (a
    ``[/]`` in a prompt ended the query with MarkupError) and passed ESC through to the terminal
    (a model-written escape sequence could retitle, hide or rewrite what the operator saw).
    """
    if v is None:
        return Text("NULL")
    if isinstance(v, (list, dict)):
        v = json.dumps(v, default=str)
    s = _printable(str(v))
    return Text(s if len(s) <= width else s[: width - 1] + "…")


def _printable(s: str) -> str:
    """``s`` with control characters as escapes (``\\x1b``): for a terminal (cells, names, error texts,
    which quote the values DuckDB failed on)."""
    return _CONTROL.sub(lambda m: ascii(m.group(0))[1:-1], s)


def _csv_cell(v: Any) -> Any:
    """A CSV cell: empty for null, JSON for lists and structs, the value otherwise."""
    if v is None:
        return ""
    return json.dumps(_jsonable(v)) if isinstance(v, (list, dict)) else _jsonable(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # 'nan', 'inf': JSON has no such numbers (json.dumps wrote NaN, which parsers refuse)
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, decimal.Decimal):  # DuckDB sums of integers are HUGEINT -> decimal
        return int(v) if v == v.to_integral_value() else float(v)
    return str(v)


def render(table: pa.Table, fmt: str, *, out=None, max_rows: int = 100, output: str | None = None) -> None:
    """Print (or write to ``output``) an Arrow result in the chosen format."""
    if output and fmt != "parquet":
        with open(output, "w", newline="", encoding="utf-8") as fh:
            render(table, fmt, out=fh, max_rows=max_rows)
        click.echo(f"wrote {table.num_rows:,} rows to {output}", err=True)
        return
    out = out or sys.stdout
    if fmt == "parquet":
        if not output:
            raise click.UsageError("--format parquet needs --output FILE")
        import pyarrow.parquet as pq

        pq.write_table(table, output)
        click.echo(f"wrote {table.num_rows:,} rows to {output}", err=True)
        return
    rows = table.to_pylist()
    if fmt == "json":
        out.write(json.dumps([_jsonable(r) for r in rows]) + "\n")
    elif fmt == "csv":
        w = csv.writer(out)
        w.writerow(table.column_names)
        for r in rows:
            w.writerow([_csv_cell(v) for v in r.values()])
    else:
        t = Table(show_header=True, header_style="bold", show_lines=False)
        for name in table.column_names:  # a column name may come from a part's footer: plain text too
            t.add_column(Text(_printable(name)), overflow="fold")
        for r in rows[:max_rows]:
            t.add_row(*(_cell(v) for v in r.values()))
        console = Console(file=out, width=max(120, Console().width))
        console.print(t)
        more = f", showing {max_rows}" if len(rows) > max_rows else ""
        console.print(f"[dim]{len(rows):,} row(s){more}[/]")


def run_query(con: duckdb.DuckDBPyConnection, query: str) -> pa.Table | None:
    """Run SQL (one or more statements); the last statement's result as Arrow (None if it has none)."""
    rel = con.sql(query)
    return None if rel is None else rel.to_arrow_table()


def _run_skipping(con: duckdb.DuckDBPyConnection, query: str, traces_dir: str | None) -> pa.Table | None:
    """:func:`run_query`, going on past a part whose data turns out damaged (views.past_damaged_parts)."""
    if traces_dir is None:
        return run_query(con, query)
    return past_damaged_parts(lambda: run_query(con, query), lambda: define_views(con, traces_dir))


def quote_identifier(name: str) -> str:
    """``name`` (``view`` or ``schema.view``) as quoted DuckDB identifiers. Why: names cannot be
    bound as parameters, and a shell argument must not become SQL of its own."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split("."))


def list_queries(out=None) -> None:
    t = Table(title="canned queries (-q NAME)", show_header=True, header_style="bold")
    t.add_column("name")
    t.add_column("what it shows")
    for name, (doc, _) in CANNED.items():
        t.add_row(name, doc)
    Console(file=out or sys.stdout).print(t)


SHELL_HELP = """\
Statements end with ';' (they may span lines). Views: {views}.
  .tables              list the views and their row counts
  .schema NAME         columns of a view (also: DESCRIBE NAME;)
  .queries             list the canned queries;   .q NAME   run one
  .format FMT          table | csv | json (output of the next queries)
  .help                this text;   .quit / .exit / Ctrl-D   leave"""


def shell(con: duckdb.DuckDBPyConnection, traces_dir: str, fmt: str = "table", max_rows: int = 100,
          stdin=None, out=None) -> None:
    """A small SQL shell over the views; reads statements until EOF."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        out.write(f"lightning-sql on {traces_dir}  (.help for help, Ctrl-D to leave)\n")

    def read(prompt: str) -> str | None:
        if interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = stdin.readline()
        return None if line == "" else line.rstrip("\n")

    buf: list[str] = []
    while True:
        line = read("lightning> " if not buf else "      ...> ")
        if line is None:
            if buf and "".join(buf).strip():
                _shell_exec(con, "\n".join(buf), fmt, max_rows, out, traces_dir)
            if interactive:
                out.write("\n")
            return
        stripped = line.strip()
        if not buf and stripped.startswith("."):
            parts = stripped.split()
            cmd, args = parts[0], parts[1:]
            if cmd in (".quit", ".exit"):
                return
            if cmd == ".help":
                out.write(SHELL_HELP.format(views=", ".join(VIEW_NAMES)) + "\n")
            elif cmd == ".tables":
                _shell_tables(con, traces_dir, fmt, out)
            elif cmd == ".schema" and args:
                _shell_exec(con, f"DESCRIBE {quote_identifier(args[0].rstrip(';'))}", fmt, max_rows, out)
            elif cmd == ".queries":
                list_queries(out)
            elif cmd == ".q" and args:
                if args[0] not in CANNED:
                    out.write(f"unknown query {args[0]!r}; .queries lists them\n")
                else:
                    _shell_exec(con, CANNED[args[0]][1], fmt, max_rows, out, traces_dir)
            elif cmd == ".format" and args and args[0] in ("table", "csv", "json"):
                fmt = args[0]
            else:
                out.write(f"unknown or incomplete command {stripped!r}; .help lists them\n")
            continue
        buf.append(line)
        if stripped.endswith(";"):
            _shell_exec(con, "\n".join(buf), fmt, max_rows, out, traces_dir)
            buf = []


def _shell_tables(con: duckdb.DuckDBPyConnection, traces_dir: str, fmt: str, out) -> None:
    """``.tables``: every view's row count, past damaged parts like any statement (one bad part made it
    end the shell with a traceback); an error is printed as one."""

    def counts() -> list[int]:
        return [con.sql(f"SELECT count(*) FROM {quote_identifier(v)}").fetchall()[0][0] for v in VIEW_NAMES]

    try:
        define_views(con, traces_dir)
        rows = past_damaged_parts(counts, lambda: define_views(con, traces_dir))
    except duckdb.Error as exc:
        out.write(f"error: {_printable(str(exc))}\n")
        return
    render(pa.table({"view": list(VIEW_NAMES), "rows": rows}), fmt, out=out)


def _shell_exec(con, sql: str, fmt: str, max_rows: int, out, traces_dir: str | None = None) -> None:
    try:
        if traces_dir is not None:  # parts written or compacted since the last statement
            define_views(con, traces_dir)
        result = _run_skipping(con, sql, traces_dir)
    except duckdb.Error as exc:
        out.write(f"error: {_printable(str(exc))}\n")
        return
    if result is not None:
        render(result, fmt, out=out, max_rows=max_rows)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("traces_dir", type=click.Path(file_okay=False), required=False)
@click.argument("query", required=False)
@click.option("-q", "--query-name", "name", type=click.Choice(list(CANNED)), default=None,
              help="Run a canned query by name (see --list).")
@click.option("--list", "list_", is_flag=True, help="List the canned queries and exit.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True, help="Output format.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the result to this file (needed by --format parquet).")
@click.option("--max-rows", default=100, show_default=True, help="Rows shown by --format table.")
@click.option("--show-sql", is_flag=True, help="Print the SQL of a canned query instead of running it.")
def main(traces_dir, query, name, list_, fmt, output, max_rows, show_sql) -> None:
    """Query the traces in TRACES_DIR with SQL (DuckDB), or open a shell when no QUERY is given.

    \b
    Views: spans, rewards, rollouts_raw, calls (one row per model call), rollouts (one row per
    rollout attempt, with reward and state), samples, metrics.
    \b
    Examples:
      lightning-sql traces "SELECT state, count(*) FROM rollouts GROUP BY state"
      lightning-sql traces -q latency_by_version --format csv
      lightning-sql traces -q tokens_per_rollout --format parquet -o tokens.parquet
      lightning-sql traces              # interactive shell
    """
    if list_:
        list_queries()
        return
    if show_sql:
        if not name:
            raise click.UsageError("--show-sql prints a canned query's SQL: give -q NAME")
        click.echo(CANNED[name][1])
        return
    if not traces_dir:
        raise click.UsageError("TRACES_DIR is required (the folder holding spans/, rewards/, rollouts/)")
    if fmt == "parquet" and not output:
        raise click.UsageError("--format parquet needs --output FILE")
    if name and query:
        raise click.UsageError("give either QUERY or -q NAME, not both")
    try:
        con = connect(traces_dir)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    if name:
        query = CANNED[name][1]
    if query is None:
        shell(con, traces_dir, "table" if fmt == "parquet" else fmt, max_rows)
        return
    try:
        result = _run_skipping(con, query, traces_dir)
    except duckdb.Error as exc:
        raise click.ClickException(f"query failed: {_printable(str(exc))}") from exc
    if result is not None:
        render(result, fmt, max_rows=max_rows, output=output)


if __name__ == "__main__":
    main()
