"""The per-rollout sample cap (``max_samples_per_rollout``): a harness that makes one rollout into
hundreds of samples (the same call repeated, a fresh context at every call so nothing merges) keeps its
weight of one rollout, and now a bounded cost to the update too. Real Parquet traces throughout."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from fixtures_traces import rollout, span

from lightning_harness.trainer.samples import build_samples


def _unmergeable(rollout_id: str, n: int, **kw) -> list[dict]:
    """``n`` calls of which none continues the previous one (each starts a new conversation)."""
    return [span(rollout_id, i, [1000 + i, 2], [3 + i % 5, 4], **kw) for i in range(n)]


def _traces(make_traces, big: int = 300):
    spans = [*_unmergeable("big", big),
             span("small", 0, [1, 2], [10]), span("small", 1, [1, 2, 10, 20], [11]),  # merges into one
             span("small", 2, [7, 8], [12]),  # a new conversation: a second sample
             *_unmergeable("mid", 40)]
    return make_traces(spans=spans, rollouts=[rollout("big", reward=1.0), rollout("small", reward=0.0),
                                              rollout("mid", reward=0.5)])


def _rows(table, rollout_id: str) -> list[dict]:
    return [r for r in table.to_pylist() if r["rollout_id"] == rollout_id]


def _weight_sum(rows: list[dict]) -> float:
    """What a rollout weighs in the loss: its samples' weight times their model tokens."""
    return sum(r["loss_weight"] * sum(r["response_mask"]) for r in rows)


def test_a_rollout_over_the_cap_keeps_a_random_subset_of_256_and_weighs_one(make_traces, caplog):
    d = _traces(make_traces)
    with caplog.at_level(logging.WARNING, logger="lightning_harness.trainer.samples"):
        table, stats = build_samples(d)
    big = _rows(table, "big")
    assert len(big) == 256  # before the cap: 300
    assert _weight_sum(big) == pytest.approx(1.0, rel=1e-5)
    index = [r["index_in_rollout"] for r in big]
    assert index == sorted(index) and len(set(index)) == 256  # in their original order, each once
    assert index != list(range(256)) and max(index) > 256  # drawn over all 300, not the first ones
    assert stats["rollouts_capped"] == 1 and stats["samples_capped"] == 44
    warned = [r.getMessage() for r in caplog.records if "max_samples_per_rollout" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("1 rollout(s)") and "big~0 (300)" in warned[0]

    # the other rollouts are untouched: the same samples as with no cap at all
    whole, whole_stats = build_samples(d, max_samples_per_rollout=0)
    for rid in ("small", "mid"):
        assert _rows(table, rid) == _rows(whole, rid)
    assert len(_rows(whole, "big")) == 300 and whole_stats["rollouts_capped"] == whole_stats["samples_capped"] == 0
    assert len(_rows(table, "small")) == 2 and len(_rows(table, "mid")) == 40


def test_a_rebuild_keeps_the_same_subset_in_another_process(make_traces):
    """Seeded from the rollout's key, not from Python's per-process hash or a global generator."""
    d = _traces(make_traces)
    first = [r["sample_id"] for r in _rows(build_samples(d)[0], "big")]
    assert len(first) == 256
    np.random.seed(12345)  # no effect: the draw has its own generator
    assert [r["sample_id"] for r in _rows(build_samples(d)[0], "big")] == first
    code = ("import json, sys; from lightning_harness.trainer.samples import build_samples; "
            "t, _ = build_samples(sys.argv[1]); "
            "print(json.dumps([r['sample_id'] for r in t.to_pylist() if r['rollout_id'] == 'big']))")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "7", "PATH": "/usr/bin:/bin"})
    assert json.loads(out.stdout) == first


@pytest.mark.parametrize("cap", [0, None])
def test_no_cap_keeps_every_sample(make_traces, cap):
    table, stats = build_samples(_traces(make_traces), max_samples_per_rollout=cap)
    assert len(_rows(table, "big")) == 300 and stats["rollouts_capped"] == 0
    assert _weight_sum(_rows(table, "big")) == pytest.approx(1.0, rel=1e-5)


def test_a_smaller_cap_and_the_limits_count_first(make_traces):
    """The cap counts the samples the limits left: 300 calls of which 60 have a prompt too long leave
    240, under a cap of 250 (nothing capped); under a cap of 100 the rollout keeps 100 of those 240."""
    spans = [span("big", i, [1000 + i, 2] + ([5] * 10 if i % 5 == 0 else []), [3, 4]) for i in range(300)]
    d = make_traces(spans=spans, rollouts=[rollout("big", reward=1.0), rollout("other", reward=0.0)])
    table, stats = build_samples(d, max_prompt_len=5, max_samples_per_rollout=250)
    assert table.num_rows == 240 and stats["rollouts_capped"] == 0
    table, stats = build_samples(d, max_prompt_len=5, max_samples_per_rollout=100, weight_mode="seq-mean")
    assert table.num_rows == 100 and (stats["rollouts_capped"], stats["samples_capped"]) == (1, 140)
    assert all(len(r["prompt_token_ids"]) <= 5 for r in table.to_pylist())
    assert stats["n_units"] == 100  # seq-mean: the units are the samples kept


@pytest.mark.parametrize("bad", [-1, 2.5, True, "many"])
def test_a_bad_cap_is_refused_before_reading(tmp_path, bad):
    with pytest.raises(ValueError, match="max_samples_per_rollout"):
        build_samples(tmp_path / "absent", max_samples_per_rollout=bad)


def test_the_build_command_reports_and_sets_the_cap(make_traces, tmp_path):
    from lightning_harness.trainer.build import build_command

    d = _traces(make_traces)
    shown = CliRunner().invoke(build_command, [str(d), "--out", str(tmp_path / "a")])
    assert shown.exit_code == 0, shown.output
    line = next(ln for ln in shown.output.splitlines() if "rollouts capped" in ln)
    assert "44 samples left out" in line
    got = CliRunner().invoke(build_command, [str(d), "--out", str(tmp_path / "b"), "--json",
                                             "--max-samples-per-rollout", "10"])
    stats = json.loads(got.stdout)
    assert (stats["rollouts_capped"], stats["samples_capped"]) == (2, 290 + 30)
    assert stats["samples"] == 10 + 2 + 10
    whole = CliRunner().invoke(build_command, [str(d), "--out", str(tmp_path / "c"), "--json",
                                               "--max-samples-per-rollout", "0"])
    assert json.loads(whole.stdout)["samples"] == 342
    refused = CliRunner().invoke(build_command, [str(d), "--out", str(tmp_path / "d"),
                                                 "--max-samples-per-rollout", "-3"])
    assert refused.exit_code != 0 and "max-samples-per-rollout" in refused.output


def test_the_loop_takes_the_cap_from_the_config_and_logs_the_counts(make_traces, tmp_path):
    """``--set samples.extra.max_samples_per_rollout=...`` reaches the loop's build, and the counts its
    metrics (``samples/rollouts_capped``, ``samples/samples_capped``)."""
    from lightning_harness.trainer import config as C
    from lightning_harness.trainer.loop import TrainingRun
    from lightning_harness.trainer.scheduler import Schedule

    (tmp_path / "model").mkdir()
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text('model: model\nharness: {command: ["python", "h.py"]}\ntasks: {train: train.jsonl}\n')
    d = _traces(make_traces)
    for cap, expected in ((8, (2, 292 + 32)), (None, (1, 44))):
        cfg = C.load_config(cfg_file, [f"samples.extra.max_samples_per_rollout={cap}"] if cap else [])
        run = object.__new__(TrainingRun)
        run.cfg, run.traces, run.engine_defaults, run.capture_state = cfg, d, {}, None
        run.schedule = Schedule.from_rollout(cfg.rollout)
        quiet = SimpleNamespace(update=lambda **k: None, flush=lambda: {}, print=lambda *a, **k: None)
        run.progress, run.runner, run.proxy, run.console = quiet, quiet, SimpleNamespace(control=quiet), quiet
        groups = [SimpleNamespace(rollouts=[SimpleNamespace(rollout_id=r) for r in ("big", "small", "mid")])]
        rep: dict = {}
        run.step_samples(1, groups, 0, rep)
        assert (rep["samples/rollouts_capped"], rep["samples/samples_capped"]) == expected, cap
