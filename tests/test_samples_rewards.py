"""Rewards, failure policy, group advantages and loss weights of built samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures_traces import reward, rollout, span

from lightning_harness.trainer import advantages as A
from lightning_harness.trainer import weights as W
from lightning_harness.trainer.samples import build_samples


def _one_call(rid, n_tokens=2, **kw):
    return span(rid, 0, [1, 2], list(range(10, 10 + n_tokens)), **kw)


def test_rollout_without_reward_is_dropped_by_default_and_penalized_explicitly(make_traces):
    d = make_traces(
        spans=[_one_call("a"), _one_call("b"), _one_call("c"), _one_call("f")],
        rollouts=[
            rollout("a", reward=1.0),
            rollout("b", reward=0.0),
            rollout("c", state="no_reward"),
            rollout("f", state="failed", reward=0.5),
        ],
    )
    table, stats = build_samples(d)
    assert sorted(table["rollout_id"].to_pylist()) == ["a", "b"]
    assert stats["rollouts_dropped"] == 2
    assert stats["rollouts_by_state"]["no_reward"] == 1 and stats["rollouts_by_state"]["failed"] == 1

    table, stats = build_samples(d, failed_policy="keep")  # failed but rewarded: kept; reward-less: still dropped
    assert sorted(table["rollout_id"].to_pylist()) == ["a", "b", "f"]

    table, stats = build_samples(d, failed_policy="penalize", failed_reward=-1.0)
    rew = dict(zip(table["rollout_id"].to_pylist(), table["reward"].to_pylist()))
    assert rew == {"a": 1.0, "b": 0.0, "c": -1.0, "f": -1.0}
    assert stats["rollouts_by_state"]["penalized"] == 2
    r = np.array([1.0, 0.0, -1.0, -1.0])
    expect = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert [adv[k] for k in "abcf"] == pytest.approx(expect.tolist(), rel=1e-5)


def test_a_group_the_failure_policy_cut_to_one_member_carries_no_signal(make_traces):
    """Found by review: a group of four whose other three failed left its survivor under the rule for
    a group of one (mean 0, std 1): its advantage was its raw reward (~80 here, where the same reward
    in a whole group got -0.39), and one such rollout set the step's gradient. With no baseline left
    it gets 0, counted; a group of one by design (and one the policy kept whole) is as before."""
    d = make_traces(
        spans=[_one_call(r) for r in "abcdefgh"],
        rollouts=[rollout("a", group_id="g1", reward=80.0), rollout("b", group_id="g1", state="failed"),
                  rollout("c", group_id="g1", state="no_reward"), rollout("d", group_id="g1", state="timed_out"),
                  rollout("e", group_id="g2", reward=80.0), rollout("f", group_id="g2", reward=100.0),
                  rollout("g", group_id="g2", reward=90.0), rollout("h", group_id="g3", reward=0.5)],
    )
    table, stats = build_samples(d)
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert adv["a"] == 0.0 and stats["adv_groups_cut_to_one"] == 1
    assert adv["e"] == pytest.approx(-1.0, rel=1e-5) and adv["h"] == pytest.approx(0.5 / (1 + 1e-6))
    table, stats = build_samples(d, failed_policy="penalize", failed_reward=0.0)  # the group kept whole
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert adv["a"] > 1 and stats["adv_groups_cut_to_one"] == 0


def test_a_retried_attempt_is_no_group_member_whatever_the_failure_policy(make_traces):
    """A rollout whose attempt 0 failed and was retried is one member of its group (attempt 1): under
    keep or penalize the failed try must not join the group beside its retry."""
    d = make_traces(
        spans=[_one_call("a"), _one_call("b"), span("b", 0, [1, 2], [10, 11], attempt=1)],
        rollouts=[rollout("a", reward=1.0), rollout("b", state="failed", reward=0.5),
                  rollout("b", attempt=1, reward=0.0)],
    )
    for kw in ({}, {"failed_policy": "keep"}, {"failed_policy": "penalize", "failed_reward": -1.0}):
        table, stats = build_samples(d, **kw)
        got = sorted(zip(table["rollout_id"].to_pylist(), table["attempt"].to_pylist(), table["reward"].to_pylist()))
        assert got == [("a", 0, 1.0), ("b", 1, 0.0)], kw
        assert stats["rollouts_superseded"] == 1 and stats["adv_n_rollouts"] == 2


def test_group_with_equal_rewards_is_reported_and_carries_no_signal(make_traces):
    d = make_traces(
        spans=[_one_call(x) for x in ("a", "b", "c", "d", "e")],
        rollouts=[
            rollout("a", group_id="same", reward=1.0),
            rollout("b", group_id="same", reward=1.0),
            rollout("c", group_id="same", reward=1.0),
            rollout("d", group_id="mixed", reward=1.0),
            rollout("e", group_id="mixed", reward=0.0),
        ],
    )
    table, stats = build_samples(d)
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert adv["a"] == adv["b"] == adv["c"] == 0.0
    assert adv["d"] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-6) and adv["e"] == pytest.approx(-adv["d"])
    assert stats["adv_equal_reward_groups"] == 1 and stats["adv_equal_reward_group_ids"] == ["same"]
    assert stats["adv_rollouts_in_equal_groups"] == 3 and stats["adv_n_groups"] == 2


def test_latest_reward_wins_and_proxy_only_rollouts_are_singletons(make_traces):
    d = make_traces(
        spans=[_one_call("p"), _one_call("q")],  # proxy used alone: no launcher rows
        rewards=[reward("p", 0.0, at_s=1), reward("p", 1.0, at_s=2), reward("q", 0.25)],
    )
    table, stats = build_samples(d)
    got = dict(zip(table["rollout_id"].to_pylist(),
                   zip(table["reward"].to_pylist(), table["advantage"].to_pylist(), table["group_id"].to_pylist())))
    assert got["p"][0] == 1.0 and got["q"][0] == 0.25
    # a group of one: verl's convention (mean 0, std 1)
    assert got["p"][1] == pytest.approx(1.0 / (1 + 1e-6)) and got["p"][2] == "rollout:p~0"
    assert stats["adv_singleton_groups"] == 2 and stats["rollouts_without_group"] == 2

    table, _ = build_samples(d, group_by="'all'")  # any SQL expression over the rollouts view
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert adv["p"] > 0 > adv["q"]


def test_steps_filter_selects_rollouts(make_traces):
    d = make_traces(
        spans=[_one_call("s0"), _one_call("s1")],
        rollouts=[rollout("s0", step=0, reward=1.0), rollout("s1", step=1, reward=1.0)],
    )
    assert build_samples(d, steps=1)[0]["rollout_id"].to_pylist() == ["s1"]
    assert sorted(build_samples(d, steps=[0, 1])[0]["rollout_id"].to_pylist()) == ["s0", "s1"]
    assert build_samples(d, where="task_id = 'nope'")[0].num_rows == 0


def _mixed_traces(make_traces):
    spans = [
        span("a", 0, [1, 2], [10, 11, 12]),
        span("a", 1, [1, 2, 10, 11, 12, 5], [13]),
        span("a", 2, [7], [14, 15]),  # break: second sample of a
        span("b", 0, [1], [20]),
        span("c", 0, [1], [30, 31, 32, 33, 34]),
        span("c", 1, [9], [35]),
    ]
    rollouts = [rollout("a", reward=1.0), rollout("b", reward=0.0), rollout("c", group_id="g1", reward=0.3),
                rollout("d", group_id="g1", reward=0.1)]
    return make_traces(spans=spans, rollouts=rollouts)


@pytest.mark.parametrize("mode", ["trajectory", "transition"])
def test_rollout_weights_sum_to_one_per_rollout(make_traces, mode):
    table, stats = build_samples(_mixed_traces(make_traces), mode=mode)
    per = {}
    for r in table.to_pylist():
        per[r["rollout_id"]] = per.get(r["rollout_id"], 0.0) + r["loss_weight"] * sum(r["response_mask"])
    assert per == {"a": pytest.approx(1.0), "b": pytest.approx(1.0), "c": pytest.approx(1.0)}
    assert stats["n_units"] == 3


def test_token_and_seq_mean_weights(make_traces):
    d = _mixed_traces(make_traces)
    t, st = build_samples(d, weight_mode="token-mean")
    assert set(t["loss_weight"].to_pylist()) == {1.0} and st["n_units"] == st["model_tokens"] == 13
    t, st = build_samples(d, weight_mode="seq-mean")
    for r in t.to_pylist():
        assert r["loss_weight"] * sum(r["response_mask"]) == pytest.approx(1.0)
    assert st["n_units"] == t.num_rows == 5


def test_group_advantages_match_hand_computation():
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    g = np.array(["x", "x", "x", "x", "y", "y", "z"])
    adv, rep = A.group_advantages(r, g)
    sx = np.std([1, 0, 0, 1], ddof=1)
    assert adv[:4] == pytest.approx([0.5 / (sx + 1e-6), -0.5 / (sx + 1e-6)] * 1 + [-0.5 / (sx + 1e-6),
                                                                                   0.5 / (sx + 1e-6)])
    assert adv[4:6].tolist() == [0.0, 0.0] and adv[6] == pytest.approx(2.0 / (1 + 1e-6))
    assert (rep.n_groups, rep.singleton_groups, rep.equal_reward_groups) == (3, 1, 1)
    adv, _ = A.group_advantages(r, g, method="rloo")
    assert adv[0] == pytest.approx(1.0 - 1 / 3) and adv[1] == pytest.approx(0.0 - 2 / 3) and adv[6] == 2.0
    adv, _ = A.group_advantages(r, g, norm_by_std=False)
    assert adv[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="NaN"):
        A.group_advantages(np.array([1.0, np.nan]), np.array(["x", "x"]))


def _padded(table):
    rows = table.to_pylist()
    T = max(len(r["response_mask"]) for r in rows)
    mask = np.zeros((len(rows), T), np.float64)
    for i, r in enumerate(rows):
        mask[i, : len(r["response_mask"])] = r["response_mask"]
    rid = np.unique(table["rollout_id"].to_numpy(zero_copy_only=False), return_inverse=True)[1]
    return mask, np.array(table["loss_weight"].to_pylist()), rid


@pytest.mark.parametrize("mode", ["rollout", "token-mean", "seq-mean"])
def test_aggregate_loss_is_invariant_to_micro_batching(make_traces, mode):
    torch = pytest.importorskip("torch")
    table, stats = build_samples(_mixed_traces(make_traces), weight_mode=mode)
    mask, w, rid = _padded(table)
    n = W.n_units(rid, mask.sum(1), mode)
    assert n == stats["n_units"]
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(size=mask.shape), requires_grad=True)
    M, Wt = torch.tensor(mask), torch.tensor(w)

    def loss_of(rows):
        return W.aggregate_loss(logits[rows] ** 2, M[rows], Wt[rows], n, mode)

    full = loss_of(list(range(len(w))))
    full.backward()
    g_full = logits.grad.clone()
    for size in (1, 2, 3):
        logits.grad = None
        perm = rng.permutation(len(w))
        total = 0.0
        for k in range(0, len(w), size):
            part = loss_of(perm[k : k + size].tolist())
            part.backward()
            total += float(part.detach())
        assert total == pytest.approx(float(full.detach()), rel=1e-12)
        assert torch.allclose(logits.grad, g_full, rtol=1e-12, atol=1e-15)
    # rollout mode: every rollout counts once; check against a direct formula
    if mode == "rollout":
        per_tok = (logits.detach().numpy() ** 2) * mask
        expect = np.mean([per_tok[rid == k].sum() / mask[rid == k].sum() for k in np.unique(rid)])
        assert float(full.detach()) == pytest.approx(expect, rel=1e-6)  # weights are stored as float32


def test_group_labels_differing_only_by_a_trailing_nul_stay_separate_groups(make_traces):
    d = make_traces(spans=[_one_call(x) for x in "abcd"],
                    rollouts=[rollout("a", group_id="g", reward=1.0), rollout("b", group_id="g", reward=0.0),
                              rollout("c", group_id="g\x00", reward=1.0), rollout("d", group_id="g\x00", reward=1.0)])
    table, stats = build_samples(d)
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert stats["adv_n_groups"] == 2 and stats["adv_equal_reward_groups"] == 1
    assert adv["c"] == adv["d"] == 0.0 and adv["a"] == pytest.approx(-adv["b"]) and adv["a"] > 0
    groups = dict(zip(table["rollout_id"].to_pylist(), table["group_id"].to_pylist()))
    assert groups == {"a": "g", "b": "g", "c": "g\x00", "d": "g\x00"}


def test_group_advantages_keep_labels_differing_only_by_a_trailing_nul_apart():
    adv, rep = A.group_advantages(np.array([1.0, 0.0, 1.0, 1.0]), ["g", "g", "g\x00", "g\x00"])
    assert rep.n_groups == 2 and adv[2:].tolist() == [0.0, 0.0]


def test_a_call_with_several_choices_is_not_trained_on(make_traces):
    """With ``n > 1`` the span holds choice 0, but a best-of-n harness may go on with another choice:
    the rollout's reward was credited to tokens it never used. Such calls leave the samples (counted);
    the rollout's other calls, and its group membership, stay."""
    d = make_traces(
        spans=[span("a", 0, [1, 2], [10, 11], n_choices=3), span("a", 1, [1, 2, 12, 13, 3], [14, 15]),
               _one_call("b")],
        rollouts=[rollout("a", reward=1.0), rollout("b", reward=0.0)],
    )
    table, stats = build_samples(d)
    assert stats["calls_multi_choice"] == 1
    got = {(r, tuple(p)) for r, p in zip(table["rollout_id"].to_pylist(), table["prompt_token_ids"].to_pylist())}
    assert got == {("a", (1, 2, 12, 13, 3)), ("b", (1, 2))}  # before the fix: a's choice-0 call was a sample too


def test_a_call_to_a_server_the_harness_chose_is_not_trained_on(make_traces):
    """A harness can run its own OpenAI-shaped server and call it through the forward proxy: its
    answer (tokens, logprobs, hence importance weights) is whatever the harness wanted the policy
    pushed towards. Such spans (``routed`` false) leave the samples, counted; traces written before
    the column (null) read as routed."""
    d = make_traces(
        spans=[span("a", 0, [1, 2], [10, 11]),
               span("a", 1, [1, 2, 10, 11, 3], [666, 667], routed=False, upstream="http://127.0.0.1:4444"),
               span("a", 2, [1, 2, 10, 11, 3, 4], [14, 15], routed=None), _one_call("b")],
        rollouts=[rollout("a", reward=1.0), rollout("b", reward=0.0)],
    )
    table, stats = build_samples(d)
    assert stats["calls_unrouted"] == 1
    responses = [t for r in table["response_token_ids"].to_pylist() for t in r]
    assert 666 not in responses and 14 in responses  # before the fix: the forged tokens were trained on


def test_reward_clip_bounds_what_one_rollout_does_to_its_group(make_traces):
    """A self-report of 1e15 in a group of 0/1 rewards: unclipped, the others' advantages are all
    equal (the outlier takes the whole spread); clipped into [0, 1] it is one success among them,
    counted, and a penalty outside the range is clipped too."""
    d = make_traces(
        spans=[_one_call(r) for r in "abcdf"],
        rollouts=[rollout("a", group_id="g", reward=1e15), rollout("b", group_id="g", reward=1.0),
                  rollout("c", group_id="g", reward=0.0), rollout("d", group_id="g", reward=0.0),
                  rollout("f", group_id="g", state="failed")],
    )
    table, stats = build_samples(d)
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert adv["b"] == pytest.approx(adv["c"], abs=1e-6) and stats["rollouts_reward_clipped"] == 0

    table, stats = build_samples(d, reward_clip=[0, 1], failed_policy="penalize", failed_reward=-5.0)
    rew = dict(zip(table["rollout_id"].to_pylist(), table["reward"].to_pylist()))
    assert rew == {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0, "f": 0.0}
    r = np.array([1.0, 1.0, 0.0, 0.0, 0.0])
    expect = dict(zip("abcdf", ((r - r.mean()) / (r.std(ddof=1) + 1e-6)).tolist()))
    adv = dict(zip(table["rollout_id"].to_pylist(), table["advantage"].to_pylist()))
    assert adv == pytest.approx(expect, rel=1e-5)
    assert stats["rollouts_reward_clipped"] == 2  # a (1e15) and f's penalty (-5)


@pytest.mark.parametrize("clip", [[1, 0], [0, float("inf")], [0], "ab", "01", [True, 2], 5, {0: 1},
                                  [float("nan"), 1]])
def test_reward_clip_refuses_what_is_not_a_range(make_traces, clip):
    d = make_traces(spans=[_one_call("a")], rollouts=[rollout("a", reward=1.0)])
    with pytest.raises(ValueError, match="reward_clip"):
        build_samples(d, reward_clip=clip)


def test_the_build_command_clips_and_reports(make_traces, tmp_path):
    import json

    from click.testing import CliRunner

    from lightning_harness.trainer.build import build_command

    d = make_traces(spans=[_one_call(r) for r in "abc"],
                    rollouts=[rollout("a", group_id="g", reward=50.0), rollout("b", group_id="g", reward=1.0),
                              rollout("c", group_id="g", reward=0.0)])
    shown = CliRunner().invoke(build_command, [str(d), "--out", str(tmp_path / "a"), "--reward-clip", "0", "1"])
    assert shown.exit_code == 0, shown.output
    assert any("rewards clipped" in ln and " 1 " in ln for ln in shown.output.splitlines()), shown.output
    got = CliRunner().invoke(build_command, [str(d), "--out", str(tmp_path / "b"), "--json", "--reward-clip", "0", "1"])
    assert json.loads(got.stdout)["rollouts_reward_clipped"] == 1
    refused = CliRunner().invoke(build_command, [str(d), "--out", str(tmp_path / "c"), "--reward-clip", "1", "0"])
    assert refused.exit_code != 0 and "low < high" in refused.output, refused.output
