"""Spans the proxy found a secret in are left out of training by default (issue 10).

Real Parquet traces (fixtures_traces); the secret span has no token ids (the proxy emptied them),
so including it means retokenising its masked text.
"""

from __future__ import annotations

import pyarrow.compute as pc
from fixtures_traces import chat_bodies, drop_column, rollout, span, tiny_ids

from lightning_harness.trainer.samples import build_samples


def _traces(make_traces):
    """Rollout r1: a clean call, then a call with a masked secret (no ids); r2: one clean call."""
    p1, r1 = tiny_ids("hello"), tiny_ids("hi", "there")
    clean = span("r1", 0, p1, r1, secret_detected=False)
    secret = span("r1", 1, None, None, logprobs=None, secret_detected=True,
                  **chat_bodies([{"role": "user", "content": "what is [REDACTED]"}], "ok thanks"))
    other = span("r2", 0, tiny_ids("hello"), tiny_ids("ok"), secret_detected=False)
    return make_traces(spans=[clean, secret, other],
                       rollouts=[rollout("r1", reward=1.0), rollout("r2", reward=0.0)])


def test_secret_spans_are_left_out_by_default(make_traces):
    table, stats = build_samples(_traces(make_traces))
    assert stats["calls_secret_detected"] == 1 and stats["calls_dropped_secret"] == 1
    assert stats["calls_used"] == 2 and stats["calls_without_token_ids"] == 0
    assert sorted(table["rollout_id"].to_pylist()) == ["r1", "r2"]
    r1 = table.filter(pc.equal(table["rollout_id"], "r1"))
    assert r1["response_token_ids"].to_pylist() == [tiny_ids("hi", "there")]


def test_included_secret_spans_are_retokenised_from_the_masked_text(make_traces, tiny_tokenizer_dir):
    table, stats = build_samples(_traces(make_traces), tokenizer=str(tiny_tokenizer_dir), include_secret_spans=True)
    assert stats["calls_secret_detected"] == 1 and stats["calls_dropped_secret"] == 0
    assert stats["calls_used"] == 3 and stats["retokenized_calls"] == 1
    assert any(table["retokenized"].to_pylist())


def test_traces_without_the_column_still_build(make_traces, tmp_path):
    """Parts written before ``secret_detected`` existed: nothing is left out."""
    root = make_traces(spans=[span("r1", 0, tiny_ids("hello"), tiny_ids("hi"))], rollouts=[rollout("r1", reward=1.0)])
    drop_column(root, "spans", "secret_detected")
    table, stats = build_samples(root)
    assert table.num_rows == 1 and stats["calls_secret_detected"] == 0


def test_config_key_reaches_the_builder(tmp_path):
    """``samples.include_secret_spans`` is a typed config key (default off) the loop passes on."""
    import inspect

    from lightning_harness.trainer import config as C
    from lightning_harness.trainer import loop

    (tmp_path / "model").mkdir()
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text('model: model\nharness: {command: ["h"]}\ntasks: {train: train.jsonl}\n')
    assert C.load_config(cfg_file).samples.include_secret_spans is False
    assert C.load_config(cfg_file, ["samples.include_secret_spans=true"]).samples.include_secret_spans is True
    on = C.load_config(cfg_file, ["samples.include_secret_spans=true"])
    assert on.sample_options(["r"])["include_secret_spans"] is True  # what the loop passes build_samples
    assert C.load_config(cfg_file).sample_options(["r"])["include_secret_spans"] is False
    assert "cfg.sample_options(" in inspect.getsource(loop.TrainingRun.step_samples)


def test_build_cli_reports_and_includes_on_request(make_traces, tiny_tokenizer_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from lightning_harness.trainer.build import build_command

    root = _traces(make_traces)
    table = CliRunner().invoke(build_command, [str(root), "--out", str(tmp_path / "a")])
    assert table.exit_code == 0 and "calls with a secret" in table.output and "--include-secret-spans" in table.output
    got = CliRunner().invoke(build_command,
                             [str(root), "--out", str(tmp_path / "b"), "--json", "--include-secret-spans",
                                             "--tokenizer", str(tiny_tokenizer_dir)])
    stats = json.loads(got.stdout)
    assert got.exit_code == 0 and stats["calls_dropped_secret"] == 0 and stats["retokenized_calls"] == 1
