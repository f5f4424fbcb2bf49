"""`lightning-sql` and `lightning-train build` as a user runs them (installed console scripts)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures_traces import reward, rollout, span, write_traces

from lightning_harness.proxy.locate import proxy_python
from lightning_harness.trainer.sql import CANNED

BIN = Path(sys.executable).parent


def _run(*args, input=None, check=True):
    p = subprocess.run([str(BIN / args[0]), *map(str, args[1:])], input=input, capture_output=True, text=True,
                       timeout=180)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture
def traces(tmp_path):
    return write_traces(
        tmp_path / "traces",
        spans=[
            span("a", 0, [1, 2], [10, 11], latency_ms=100, model_version=0),
            span("a", 1, [1, 2, 10, 11, 5], [12], latency_ms=300, model_version=1),
            span("a", 2, [7, 7], [13], latency_ms=200, model_version=1),
            span("b", 0, [1, 2], [14], latency_ms=50, upstream="http://other/v1"),
            span("b", 1, [1, 2, 14, 5], None, error_kind="upstream_status", upstream="http://other/v1"),
        ],
        rollouts=[rollout("a", task_id="t1", reward=1.0), rollout("b", task_id="t2", reward=0.0)],
        rewards=[reward("b", 0.25, at_s=6, source="api")],  # the operator re-scores b after it ended
    )


def test_build_then_canned_queries(traces, tmp_path):
    p = _run("lightning-train", "build", traces)
    assert "samples per rollout" in p.stdout and "break: other" in p.stdout
    parts = list((traces / "samples").rglob("*.parquet"))
    assert len(parts) == 1 and pq.read_table(parts[0]).num_rows == 3
    # a second build without --replace refuses (and loses nothing); with it, replaces
    p = _run("lightning-train", "build", traces, check=False)
    assert p.returncode != 0 and "--replace" in p.stderr
    _run("lightning-train", "build", traces, "--replace", "--json")
    assert len(list((traces / "samples").rglob("*.parquet"))) == 1

    out = json.loads(_run("lightning-sql", traces, "-q", "merge_breaks", "--format", "json").stdout)
    assert {r["reason"]: r["samples"] for r in out} == {"(first sample of rollout)": 2, "other": 1}

    out = json.loads(_run("lightning-sql", traces, "-q", "tokens_per_rollout", "--format", "json").stdout)
    assert [(r["rollout_id"], r["generated_tokens"], r["max_context"]) for r in out] == [("a", 4, 6), ("b", 1, 4)]

    out = json.loads(_run("lightning-sql", traces, "-q", "latency_by_version", "--format", "json").stdout)
    assert [(r["model_version"], r["calls"], r["p50_ms"]) for r in out] == [(0, 2, 75.0), (1, 2, 250.0)]

    out = json.loads(_run("lightning-sql", traces, "-q", "reward_by_task", "--format", "json").stdout)
    assert {r["task_id"]: r["mean_reward"] for r in out} == {"t1": 1.0, "t2": 0.25}  # the operator's later reward wins

    rows = list(csv.DictReader(io.StringIO(_run("lightning-sql", traces, "-q", "error_rate_by_upstream", "--format",
                                                "csv").stdout)))
    by = {r["upstream"]: r for r in rows}
    assert by["http://other/v1"]["errors"] == "1" and float(by["http://other/v1"]["error_pct"]) == 50.0
    assert by["http://127.0.0.1:9/v1"]["errors"] == "0"


def test_every_canned_query_runs_on_an_empty_directory(tmp_path):
    for name in CANNED:
        out = json.loads(_run("lightning-sql", tmp_path, "-q", name, "--format", "json").stdout)
        assert out == [] or name == "reward_by_step", (name, out)


def test_query_formats_and_errors(traces, tmp_path):
    p = _run("lightning-sql", traces, "SELECT rollout_id, count(*) AS n FROM calls GROUP BY 1 ORDER BY 1")
    assert "rollout_id" in p.stdout and "2 row(s)" in p.stdout
    target = tmp_path / "out.parquet"
    _run("lightning-sql", traces, "SELECT * FROM spans", "--format", "parquet", "-o", target)
    assert pq.read_table(target).num_rows == 5
    p = _run("lightning-sql", traces, "SELECT * FROM nowhere", check=False)
    assert p.returncode == 1 and "query failed" in p.stderr and "Traceback" not in p.stderr
    p = _run("lightning-sql", tmp_path / "missing", "SELECT 1", check=False)
    assert p.returncode != 0 and "does not exist" in p.stderr
    p = _run("lightning-sql", traces, "-q", "nope", check=False)
    assert p.returncode != 0 and "tokens_per_rollout" in p.stderr
    assert "latency_by_version" in _run("lightning-sql", "--list").stdout


def test_proxy_only_install_queries_its_traces(traces):
    """A capture-only user has just the proxy's environment: its `lightning-sql` must work there
    (no torch, no vLLM), on the same views as the training environment's."""
    proxy_bin = Path(proxy_python()).parent
    if proxy_bin == BIN:
        pytest.skip("the proxy runs from the training environment here; nothing separate to check")
    p = subprocess.run([str(proxy_bin / "lightning-sql"), str(traces), "-q", "tokens_per_rollout", "--format", "json"],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    assert [(r["rollout_id"], r["generated_tokens"]) for r in json.loads(p.stdout)] == [("a", 4), ("b", 1)]
    probe = "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('vllm') is None)"
    assert subprocess.run([str(proxy_bin / "python"), "-c", probe], capture_output=True,
                          text=True).stdout.split() == ["True", "True"]


def test_shell_reads_statements_from_stdin(traces):
    script = (".tables\nSELECT count(*) AS n\n  FROM calls;\n.q reward_by_task\n"
              "SELECT * FROM nowhere;\nSELECT 41 + 1 AS answer;\n")
    p = _run("lightning-sql", traces, "--format", "csv", input=script)
    assert "calls,5" in p.stdout and "n\n5" in p.stdout.replace("\r", "")
    assert "t1,1,1,1.0" in p.stdout
    assert "error:" in p.stdout and "answer\n42" in p.stdout.replace("\r", "")


def test_shell_names_are_identifiers_never_sql(traces):
    """``.schema NAME`` quotes NAME: a name with SQL in it is an unknown view, not a statement."""
    import io

    from lightning_harness.trainer.sql import shell
    from lightning_harness.trainer.views import connect

    out = io.StringIO()
    con = connect(traces)
    shell(con, str(traces), "csv", stdin=io.StringIO(".schema calls;\n.schema calls;DROP/**/VIEW/**/calls\n.tables\n"),
          out=out)
    text = out.getvalue()
    assert "prompt_len" in text  # the columns of calls
    assert "error:" in text and "calls,5" in text  # the second name failed; the view is still there


def test_build_replace_removes_the_old_samples_even_when_the_new_build_has_none(traces):
    _run("lightning-train", "build", traces)
    assert pq.read_table(next((traces / "samples").rglob("*.parquet"))).num_rows == 3
    p = _run("lightning-train", "build", traces, "--replace", "--step", "7")  # selects no rollout
    assert list((traces / "samples").rglob("*.parquet")) == []  # `lightning-train step` must not train on them
    assert json.loads(_run("lightning-sql", traces, "SELECT count(*) AS n FROM samples", "--format", "json").stdout) \
        == [{"n": 0}]
    assert "no samples built" in p.stdout and "removed" in p.stdout


@pytest.mark.parametrize("fmt", ["csv", "json", "table"])
def test_output_file_is_written_in_every_format(traces, tmp_path, fmt):
    target = tmp_path / f"out.{fmt}"
    p = _run("lightning-sql", traces, "SELECT rollout_id, count(*) AS n FROM calls GROUP BY 1 ORDER BY 1",
             "--format", fmt, "-o", target)
    assert target.is_file(), p.stdout
    text = target.read_text()
    if fmt == "csv":
        assert list(csv.DictReader(io.StringIO(text))) == [{"rollout_id": "a", "n": "3"}, {"rollout_id": "b", "n": "2"}]
    elif fmt == "json":
        assert json.loads(text) == [{"rollout_id": "a", "n": 3}, {"rollout_id": "b", "n": 2}]
    else:
        assert "rollout_id" in text and "2 row(s)" in text
    assert "a" not in p.stdout.split() and f"wrote 2 rows to {target}" in p.stderr  # the result went to the file


def test_show_sql_without_a_canned_query_is_a_usage_error(traces):
    p = _run("lightning-sql", traces, "SELECT 2 AS two", "--show-sql", "--format", "csv", check=False)
    assert p.returncode == 2 and "-q NAME" in p.stderr and "two" not in p.stdout
    p = _run("lightning-sql", "-q", "reward_by_task", "--show-sql")
    assert p.stdout.strip() == CANNED["reward_by_task"][1].strip()
