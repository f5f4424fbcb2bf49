"""The DuckDB views over a traces directory: empty tables, proxy-only rollouts, reward precedence."""

from __future__ import annotations

import pytest
from fixtures_traces import reward, rollout, span, write_traces

from lightning_harness.schemas import TABLES
from lightning_harness.trainer.views import VIEW_NAMES, connect, define_views


def test_fresh_directory_has_every_view_with_its_columns(tmp_path):
    con = connect(tmp_path)
    for v in VIEW_NAMES:
        assert con.sql(f"SELECT count(*) FROM {v}").fetchall() == [(0,)]
    assert con.sql("SELECT * FROM spans").columns == TABLES["spans"].names
    assert con.sql("SELECT * FROM rollouts_raw").columns == TABLES["rollouts"].names
    assert con.sql("SELECT * FROM samples").columns == TABLES["samples"].names
    assert {"rollout_id", "attempt", "reward", "state", "task_id", "group_id",
            "step"} <= set(con.sql("SELECT * FROM rollouts").columns)
    assert {"rollout_id", "attempt", "seq", "model_version", "latency_ms", "total_tokens",
            "is_error"} <= set(con.sql("SELECT * FROM calls").columns)


def test_missing_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        connect(tmp_path / "nope")


def test_rollouts_view_joins_launcher_rewards_and_proxy_only(tmp_path):
    write_traces(
        tmp_path,
        spans=[
            span("L", 0, [1], [2, 3]),
            span("L", 1, [1, 2, 3, 4], None, error_kind="timeout"),
            span("P", 0, [1], [2]),  # proxy used alone: no launcher row
            span("P", 0, [5], [6], attempt=1),
            span(None, 0, [1], [2]),  # unattributed: not a rollout
        ],
        rollouts=[
            rollout("L", reward=0.2, task_id="t1", group_id="t1@3", step=3),
            rollout("N", state="no_reward", task_id="t2"),  # the operator scores it later (control API)
        ],
        # launcher rows end at T0+5 s: verifier-rank reports after that re-score them (the latest wins)
        rewards=[reward("L", 0.5, at_s=6, source="api"), reward("L", 0.9, at_s=7, source="api"),
                 reward("N", 1.0, at_s=6, source="api"), reward("P", 0.0, attempt=1)],
    )
    con = connect(tmp_path)
    rows = {
        (r[0], r[1]): r[2:]
        for r in con.sql(
            "SELECT rollout_id, attempt, reward, state, task_id, group_id, step, n_calls, n_errors, has_launcher_row "
            "FROM rollouts ORDER BY ALL"
        ).fetchall()
    }
    assert rows[("L", 0)] == (0.9, "succeeded", "t1", "t1@3", 3, 2, 1, True)  # latest operator reward wins
    assert rows[("N", 0)] == (1.0, "succeeded", "t2", "g0", 0, 0, 0, True)
    assert rows[("P", 0)] == (None, "no_reward", None, None, None, 1, 0, False)
    assert rows[("P", 1)] == (0.0, "succeeded", None, None, None, 1, 0, False)
    assert len(rows) == 4
    calls = con.sql("SELECT rollout_id, seq, prompt_len, response_len, is_error, has_token_ids FROM calls "
                    "WHERE rollout_id = 'L' ORDER BY seq").fetchall()
    assert calls == [("L", 0, 1, 2, False, True), ("L", 1, 4, None, True, False)]


def test_views_are_a_snapshot_until_defined_again(tmp_path):
    # a snapshot, not a glob: a glob bound during a compaction would read a compacted part and the
    # parts it replaces (rows twice); define_views again (the sql shell does per statement) sees more
    write_traces(tmp_path, spans=[span("a", 0, [1], [2])])
    con = connect(tmp_path)
    assert con.sql("SELECT count(*) FROM calls").fetchall() == [(1,)]
    write_traces(tmp_path, spans=[span("b", 0, [1], [2])])
    assert con.sql("SELECT count(*) FROM calls").fetchall() == [(1,)]
    define_views(con, tmp_path)
    assert con.sql("SELECT count(*) FROM calls").fetchall() == [(2,)]


def test_quotes_in_paths_and_rollout_ids_select_exactly_their_rows(tmp_path):
    """DuckDB binds no parameters inside CREATE VIEW, so the views quote part paths and the selected
    rollout ids themselves: hostile ids and a folder with quotes in its name must still select exactly."""
    root = tmp_path / "it's a \"traces\"; DROP TABLE x --"
    hostile = ["a'b", "x') OR 1=1 --", "c\\'d", "plain"]
    write_traces(root, spans=[span(r, 0, [1], [2]) for r in hostile] + [span("other", 0, [1], [2])])
    assert connect(root).sql("SELECT count(*) FROM spans").fetchall() == [(5,)]
    for picked in ([hostile[1]], hostile[:2], [hostile[2]], []):
        con = connect(root, rollouts=picked)
        assert sorted(r for (r,) in con.sql("SELECT rollout_id FROM spans").fetchall()) == sorted(picked)
