"""The verl path under awkward recorded data and configs: the same training data as the local path.

Pure parts only (no verl, no harness): ``samples_to_tensors`` and ``LauncherRollout`` with the launcher
and proxy replaced by stand-ins over a hand-written traces directory.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from fixtures_traces import rollout, span, write_traces
from test_update_core import make_samples

from lightning_harness.trainer import verl_agent_loop as VA
from lightning_harness.trainer import verl_backend as VB


def with_unlogged_tokens(table: pa.Table) -> pa.Table:
    """Every other sample's logprobs missing (NaN), as a retokenised call or partial logprobs give."""
    lps = [[math.nan] * len(x) if i % 2 == 0 else x for i, x in enumerate(table["response_logprobs"].to_pylist())]
    col = table.schema.get_field_index("response_logprobs")
    return table.set_column(col, "response_logprobs", pa.array(lps, pa.list_(pa.float32())))


def test_tokens_without_a_captured_logprob_leave_the_verl_loss():
    """A NaN behaviour logprob used to enter verl as log mu = 0 (bypass ratio pi / 1) on a trained token."""
    table = with_unlogged_tokens(make_samples(seed=41))
    t, _, meta = VB.samples_to_tensors(table)
    trained = t["response_mask"] > 0
    rows = table.to_pylist()
    for b, row in enumerate(rows):
        for j, lp in enumerate(row["response_logprobs"]):
            assert not (trained[b, j] and math.isnan(lp))  # every trained token has its captured mu
    assert meta["lightning_tokens_without_logprobs"] == sum(
        sum(r["response_mask"]) for i, r in enumerate(rows) if i % 2 == 0)
    # each rollout with a trained token still counts once: its weights sum to 1 over what is trained
    per_rollout: dict[str, float] = {}
    for b, row in enumerate(rows):
        per_rollout[row["rollout_id"]] = per_rollout.get(row["rollout_id"], 0.0) + float(t["loss_weights"][b].sum())
    assert all(v == pytest.approx(1.0, abs=1e-5) or v == 0.0 for v in per_rollout.values())
    assert meta["lightning_units"] == sum(v > 0 for v in per_rollout.values())


def fake_launcher(monkeypatch, traces, mine: list[str]) -> list[dict]:
    """Stand-ins for the proxy and run_batch: the batch 'runs' the rollouts ``mine`` (already in
    ``traces``); returns the run_batch calls' keywords."""
    from lightning_harness.launcher import batch
    from lightning_harness.proxy import client

    calls: list[dict] = []
    proxy = SimpleNamespace(control=SimpleNamespace(set_model_version=lambda v: None), stop=lambda: None)
    monkeypatch.setattr(client, "ProxyProcess", lambda *a, **k: SimpleNamespace(start=lambda: proxy))

    def run_batch(tasks, harness, **kw):
        calls.append(kw)
        return [SimpleNamespace(rollout_id=r) for r in mine]

    monkeypatch.setattr(batch, "run_batch", run_batch)
    return calls


def store(tmp_path, others: bool = True):
    """Step 3 of this run (r-s3-t-0/1, one failed without reward) and, with ``others``, of an older
    run (old-s3-t-0/1)."""
    spans, rollouts = [], []
    older = (("old-s3-t-0", 0.0, "succeeded"), ("old-s3-t-1", 1.0, "succeeded")) if others else ()
    for rid, reward, state in (("r-s3-t-0", 1.0, "succeeded"), ("r-s3-t-1", None, "failed"), *older):
        spans.append(span(rid, 0, [1, 2, 3], [4, 5]))
        rollouts.append(rollout(rid, task_id="t", group_id=f"{rid[:3]}t@3", step=3, state=state, reward=reward))
    write_traces(tmp_path, spans=spans, rollouts=rollouts)
    return str(tmp_path)


class Config(dict):
    """What the manager reads of verl's config, with OmegaConf's attribute access."""

    __getattr__ = dict.__getitem__


def launcher_rollout(settings: dict, monkeypatch) -> VA.LauncherRollout:
    """The manager's default rollout for ``+lightning.*`` = ``settings`` (verl's registrations skipped)."""
    monkeypatch.setattr(VB, "register", lambda: None)
    config = Config(lightning={"harness": "h", "group_size": 2, **settings},
                    actor_rollout_ref=Config(rollout=Config(n=2), actor=Config(loss_agg_mode="token-mean")),
                    data=Config(max_prompt_length=8, max_response_length=8))
    return VA.LightningAgentLoopManager(config).rollout_fn


def test_launcher_rollout_trains_on_its_own_batch_only(tmp_path, monkeypatch):
    """Selecting by step alone took another run's step-3 rollouts of the same traces directory."""
    traces = store(tmp_path)
    fake_launcher(monkeypatch, traces, ["r-s3-t-0", "r-s3-t-1"])
    table = launcher_rollout({"traces": traces, "run_id": "r"}, monkeypatch)([{"id": "t"}], 3, ["http://u"])
    assert table["rollout_id"].to_pylist() == ["r-s3-t-0"]  # the failed one dropped (default policy)


def test_sample_options_in_the_verl_config_are_applied(tmp_path, monkeypatch):
    """+lightning.failed_policy / failed_reward used to be ignored silently (the failed rollout dropped)."""
    traces = store(tmp_path, others=False)
    fake_launcher(monkeypatch, traces, ["r-s3-t-0", "r-s3-t-1"])
    settings = {"traces": traces, "run_id": "r", "failed_policy": "penalize", "failed_reward": -1.0}
    run = launcher_rollout(settings, monkeypatch)
    table = run([{"id": "t"}], 3, ["http://u"])
    assert sorted(table["rollout_id"].to_pylist()) == ["r-s3-t-0", "r-s3-t-1"]
    assert sorted(table["reward"].to_pylist()) == [-1.0, 1.0]
    with pytest.raises(ValueError, match="failed_plicy"):
        launcher_rollout({"traces": traces, "failed_plicy": "keep"}, monkeypatch)


def test_each_verl_run_launches_under_its_own_run_id(tmp_path, monkeypatch):
    """A shared default run id ('verl') made a new run skip, and so train on, an older run's finished
    rollouts of the same step (the launcher resumes rollouts by id)."""
    traces = store(tmp_path)
    calls = fake_launcher(monkeypatch, traces, [])
    for _ in range(2):
        launcher_rollout({"traces": traces}, monkeypatch)([{"id": "t"}], 3, ["http://u"])
    ids = [c["run_id"] for c in calls]
    assert len(set(ids)) == 2 and "verl" not in ids
    assert np.all([i.startswith("verl-") for i in ids])


def test_a_recorded_infinite_logprob_leaves_the_verl_loss():
    """A -inf behaviour logprob (the engine gave the token probability 0) became -3.4e38 in verl's
    ``old_log_probs`` (nan_to_num), an infinite bypass ratio and a NaN loss where the advantage is
    negative; update.py caps such a token's weight, which verl cannot express: it leaves the loss."""
    table = make_samples(seed=43)
    lps = table["response_logprobs"].to_pylist()
    lps[0] = [-math.inf] + lps[0][1:]
    lps[1] = [math.inf] + lps[1][1:]
    table = table.set_column(table.schema.get_field_index("response_logprobs"), "response_logprobs",
                             pa.array(lps, pa.list_(pa.float32())))
    t, _, meta = VB.samples_to_tensors(table)
    assert bool(torch_finite(t["rollout_log_probs"]))  # before the fix: -3.4e38 on a trained token
    assert meta["lightning_tokens_without_logprobs"] == 2


def torch_finite(x) -> bool:
    import torch

    return bool(torch.isfinite(x).all()) and float(x.abs().max()) < 1e30
