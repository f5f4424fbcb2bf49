"""The gradient update.py takes, from recorded calls, against a plain reference of docs/TRAINING.md.

The reference never sees a sample: for every recorded call it runs the model on that call's own
prompt + response (a batch of one, no padding, full logits), takes the log-softmax at the position
before each response token, and adds the documented per-token loss

    loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) * min(pi_prox / mu, tis_cap)  (+ kl_coef k3)

with ``A`` the rollout's group-normalised advantage (grpo: ``(r - mean) / (std + 1e-6)``, std
unbiased; a group of one: mean 0, std 1; equal rewards: 0), weighted ``1 / (model tokens of the
rollout)`` and divided by the rollouts of the mini-batch (``rollout`` mode; ``token-mean``: weight
1, divided by the tokens; ``seq-mean``: ``1 / (tokens of the sample)``, divided by the samples).
A call's prompt is exactly the prefix its response tokens see in a merged sample, so this is the
same objective whatever the merge did, and it is written without any helper of the trainer.

The system under test runs the whole path: spans on disk -> ``build_samples`` -> ``staleness_filter``
-> ``PolicyUpdater.update``; its gradient is read where the optimizer would step.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import pyarrow as pa
import pytest
import torch
from fixtures_traces import rollout, span, write_traces

from lightning_harness.trainer import update as U
from lightning_harness.trainer.samples import build_samples
from lightning_harness.trainer.scheduler import staleness_filter

VOCAB = 48
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Qwen2 small enough that a per-token reference runs in well under a second."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    d = tmp_path_factory.mktemp("ref-tiny")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                      num_hidden_layers=2, intermediate_size=64, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


# -- the recorded calls -----------------------------------------------------------------------------
@dataclass
class Call:
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    version: int = 0


@dataclass
class Rollout:
    rid: str
    group: str
    reward: float
    calls: list[Call] = field(default_factory=list)


def _rng_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def _lps(gen: torch.Generator, n: int) -> list[float]:
    """Behaviour logprobs around the random model's (about -log 48 = -3.9): TIS weights above and below 1."""
    return (-3.9 + 0.6 * torch.randn(n, generator=gen)).tolist()


def conversation(gen: torch.Generator, rid: str, group: str, reward: float, turns: list[tuple[int, int]],
                 version: int = 0, prompt_len: int = 5) -> Rollout:
    """A chat that merges: call i's prompt = call i-1's prompt + response + a tool output of the
    given length (masked context in the merged sample); ``turns``: (tool tokens before, response length)."""
    out, prompt = Rollout(rid, group, reward), _rng_ids(gen, prompt_len)
    for tool, n in turns:
        prompt = prompt + _rng_ids(gen, tool)
        resp = _rng_ids(gen, n)
        out.calls.append(Call(list(prompt), resp, _lps(gen, n), version))
        prompt = prompt + resp
    return out


def traces_of(tmp_path, rollouts: list[Rollout]):
    spans, rows = [], []
    for r in rollouts:
        rows.append(rollout(r.rid, group_id=r.group, task_id=r.group, reward=r.reward))
        for seq, c in enumerate(r.calls):
            spans.append(span(r.rid, seq, c.prompt, c.response, logprobs=c.logprobs, model_version=c.version))
    return write_traces(tmp_path / "traces", spans, rows)


# -- the reference ----------------------------------------------------------------------------------
def ref_advantages(rollouts: list[Rollout]) -> dict[str, float]:
    """GRPO as documented (advantages.py docstring, verl 0.9): per group, written out."""
    groups: dict[str, list[float]] = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(r.reward)
    out = {}
    for r in rollouts:
        rs = groups[r.group]
        if len(rs) == 1:
            out[r.rid] = r.reward / (1.0 + 1e-6)
        elif max(rs) == min(rs):
            out[r.rid] = 0.0
        else:
            mean = sum(rs) / len(rs)
            std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (len(rs) - 1))
            out[r.rid] = (r.reward - mean) / (std + 1e-6)
    return out


def call_logprobs(model, call: Call, temperature: float = 1.0) -> list[torch.Tensor]:
    """log pi(response[j] | prompt + response[:j]), one full forward of this call alone."""
    ids = torch.tensor([call.prompt + call.response])
    logits = model(input_ids=ids).logits[0].float() / temperature
    out = []
    for j, token in enumerate(call.response):
        t = len(call.prompt) + j - 1  # the logit at position t predicts the token at t + 1
        out.append(torch.log_softmax(logits[t], dim=-1)[token])
    return out


def tis_weight(prox: float, mu: float, cap: float) -> float:
    if math.isnan(mu):  # no captured logprob: weight 1
        return 1.0
    if cap > 0 and prox - mu > math.log(cap):
        return cap
    return math.exp(prox - mu)


def token_loss(lp, prox: float, mu: float, A: float, cfg, ref: float | None) -> torch.Tensor:
    ratio = torch.exp(lp - prox)
    loss = torch.maximum(-A * ratio, -A * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high))
    loss = loss * tis_weight(prox, mu, cfg.tis_cap)
    if ref is not None and cfg.kl_coef > 0:
        d = torch.clamp(ref - lp, -20.0, 20.0)  # clamped as verl's low_var_kl
        loss = loss + cfg.kl_coef * torch.clamp(torch.exp(d) - d - 1, max=10.0)
    return loss


def reference_loss(model, rollouts: list[Rollout], cfg, *, mode: str = "rollout", adv: dict | None = None,
                   prox_model=None, ref_model=None, max_seq_len: int | None = None) -> torch.Tensor:
    """The documented objective over ``rollouts`` (one mini-batch; ``adv`` defaults to their own
    group advantages). A call token at position >= max_seq_len is cut; ``seq-mean``: a call is a sample."""
    adv = ref_advantages(rollouts) if adv is None else adv
    kept = {id(c): [j for j in range(len(c.response)) if max_seq_len is None or len(c.prompt) + j < max_seq_len]
            for r in rollouts for c in r.calls}
    per_rollout = {r.rid: sum(len(kept[id(c)]) for c in r.calls) for r in rollouts}
    n = {"rollout": sum(1 for t in per_rollout.values() if t),
         "token-mean": sum(per_rollout.values()),
         "seq-mean": sum(1 for r in rollouts for c in r.calls if kept[id(c)])}[mode]
    total = torch.zeros(())
    temperature = cfg.temperature or 1.0  # (None: the loop fills in the rollout's; alone, the update uses 1)
    for r in rollouts:
        for c in r.calls:
            if not kept[id(c)]:
                continue
            w = {"rollout": 1 / max(per_rollout[r.rid], 1), "token-mean": 1.0, "seq-mean": 1 / len(kept[id(c)])}[mode]
            lps = call_logprobs(model, c, temperature)
            with torch.no_grad():  # pi_prox and the reference are numbers here, never differentiated
                prox = lps if prox_model is None else call_logprobs(prox_model, c, temperature)
                refs = call_logprobs(ref_model, c, temperature) if ref_model is not None else None
            for j in kept[id(c)]:
                ref = None if refs is None else float(refs[j])
                total = total + w * token_loss(lps[j], float(prox[j].detach()), c.logprobs[j], adv[r.rid], cfg, ref)
    return total / n


def grad_of(model, loss) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


# -- the system under test --------------------------------------------------------------------------
def recorded_steps(up: U.PolicyUpdater, lr: float) -> list[tuple[list[str], torch.Tensor]]:
    """Swap the updater's AdamW for plain SGD (the reference can repeat its step) and record, at
    every optimizer step, the rollouts trained and the gradient before clipping."""
    up.optimizer = torch.optim.SGD(up.model.parameters(), lr=lr)
    steps, seen, accumulate, step = [], [], up.accumulate_gradients, up._clip_and_step

    def accumulate_and_note(group, **kw):
        seen.extend(s.rollout_id for s in group)
        return accumulate(group, **kw)

    def note_and_step():
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                       for p in up.model.parameters()])
        steps.append((sorted({k.split("~")[0] for k in seen}), g.clone()))
        seen.clear()
        return step()

    up.accumulate_gradients, up._clip_and_step = accumulate_and_note, note_and_step
    return steps


def trainer_gradient(model_dir, table: pa.Table, **cfg) -> tuple[torch.Tensor, dict]:
    up = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu", max_grad_norm=0, **cfg))
    steps = recorded_steps(up, lr=0.0)
    m = up.update(table)
    assert len(steps) == 1, steps
    return steps[0][1], m


def samples_of(tmp_path, rollouts: list[Rollout], **options) -> pa.Table:
    table, _ = build_samples(traces_of(tmp_path, rollouts), **options)
    return table


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert want.abs().max() > 1e-3  # a real gradient
    diff = float((got - want).abs().max())
    assert diff < 1e-6 * max(1.0, float(want.abs().max())), f"max |diff| {diff:.3g} (max |grad| {want.abs().max():.3g})"


def uneven_rollouts(seed: int = 0) -> list[Rollout]:
    """Group g1: a 1-call short answer, a 5-call merged chat with tool outputs, a long answer; g2: a
    group of one; g3: equal rewards (no signal, still in the divisor)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        conversation(gen, "a-one", "g1", 1.0, [(0, 3)]),
        conversation(gen, "b-five", "g1", 0.0, [(0, 4), (3, 2), (5, 6), (1, 1), (4, 3)]),
        conversation(gen, "c-long", "g1", 0.5, [(0, 40)]),
        conversation(gen, "d-alone", "g2", 0.7, [(0, 5), (2, 5)]),
        conversation(gen, "e-equal", "g3", 1.0, [(0, 6)]),
        conversation(gen, "f-equal", "g3", 1.0, [(0, 2), (2, 7)]),
    ]


# -- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("micro_batch_size", [1, 3, 64])
@pytest.mark.parametrize("sample_mode", ["trajectory", "transition"])
def test_rollout_mode_gradient_equals_the_reference(model_dir, tmp_path, micro_batch_size, sample_mode):
    rollouts = uneven_rollouts()
    table = samples_of(tmp_path, rollouts, mode=sample_mode)
    if sample_mode == "trajectory":  # the merge made one sample per rollout, tool outputs masked
        assert table.num_rows == len(rollouts) and sum(table["merged"].to_pylist()) == 3
    cfg = dict(micro_batch_size=micro_batch_size, tis_cap=2.0, logprob_chunk_tokens=7)
    got, m = trainer_gradient(model_dir, table, **cfg)
    model = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu")).model
    assert_same(got, grad_of(model, reference_loss(model, rollouts, U.UpdateConfig(**cfg))))
    assert m["update/samples_used"] < m["update/samples_in"]  # the equal-reward group was skipped


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean"])
def test_other_weight_modes_equal_the_reference(model_dir, tmp_path, mode):
    rollouts = uneven_rollouts(seed=1)
    table = samples_of(tmp_path, rollouts, mode="transition", weight_mode=mode)
    cfg = dict(micro_batch_size=2, loss_mode=mode, temperature=0.7)
    got, _ = trainer_gradient(model_dir, table, **cfg)
    model = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu")).model
    assert_same(got, grad_of(model, reference_loss(model, rollouts, U.UpdateConfig(**cfg), mode=mode)))


def test_recorded_nan_and_inf_logprobs_follow_the_documented_weights(model_dir, tmp_path):
    """NaN = not captured (weight 1); -inf (mu = 0) and far-off values are capped at tis_cap; +inf
    (impossible, mu > 1) gives weight 0. The gradient stays finite and equals the reference."""
    rollouts = uneven_rollouts(seed=2)
    rollouts[1].calls[2].logprobs[1] = NAN
    rollouts[1].calls[4].logprobs[0] = -INF
    rollouts[2].calls[0].logprobs[3:6] = [INF, -50.0, NAN]
    table = samples_of(tmp_path, rollouts)
    got, m = trainer_gradient(model_dir, table, micro_batch_size=2, tis_cap=2.0)
    assert m["update/skipped_nonfinite"] == 0 and torch.isfinite(got).all()
    model = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu")).model
    assert_same(got, grad_of(model, reference_loss(model, rollouts, U.UpdateConfig(tis_cap=2.0))))


@pytest.mark.parametrize("staleness_mode", ["tis", "drop"])
def test_stale_rollouts_are_kept_with_tis_or_dropped_whole(model_dir, tmp_path, staleness_mode):
    """Rollouts of versions 3 and 4 trained at version 5 with max_staleness 1: ``tis`` keeps them
    (capped importance weights do the correcting), ``drop`` leaves out the version-3 ones whole."""
    gen = torch.Generator().manual_seed(3)
    rollouts = [
        conversation(gen, "fresh-1", "g1", 1.0, [(0, 5), (2, 3)], version=4),
        conversation(gen, "fresh-2", "g1", 0.0, [(0, 7)], version=4),
        conversation(gen, "stale-1", "g2", 1.0, [(0, 4), (3, 4)], version=3),
        conversation(gen, "stale-2", "g2", 0.2, [(0, 6)], version=3),
    ]
    rollouts[0].calls[1].version = 5  # a rollout's oldest call decides
    for r in rollouts:
        for c in r.calls:
            c.logprobs = [x - 1.5 * (5 - c.version) for x in c.logprobs]  # older policy, further off
    table, rep = staleness_filter(samples_of(tmp_path, rollouts), 5, 1, staleness_mode)
    trained = rollouts if staleness_mode == "tis" else rollouts[:2]
    assert rep["async/dropped_rollouts"] == len(rollouts) - len(trained)
    cfg = dict(micro_batch_size=3, tis_cap=1.5)
    got, _ = trainer_gradient(model_dir, table, **cfg)
    model = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu")).model
    want = reference_loss(model, trained, U.UpdateConfig(**cfg), adv=ref_advantages(rollouts))
    assert_same(got, grad_of(model, want))


@pytest.mark.parametrize("max_seq_len", [30, 12, 9])
def test_a_sample_cut_at_max_seq_len_equals_the_reference_cut(model_dir, tmp_path, max_seq_len):
    """Tokens past max_seq_len leave the loss and the kept tokens carry their rollout's weight.
    At 9 the 5-call chat's later calls start beyond the limit (a new sample with such a prompt
    is cut whole, not an error that stops the update)."""
    gen = torch.Generator().manual_seed(4)
    rollouts = uneven_rollouts(seed=4)
    rollouts.append(conversation(gen, "g-restart", "g1", 0.3, [(0, 3)]))
    rollouts[-1].calls.append(Call(_rng_ids(gen, 11), _rng_ids(gen, 3), _lps(gen, 3)))  # breaks the merge
    table = samples_of(tmp_path, rollouts)
    got, m = trainer_gradient(model_dir, table, micro_batch_size=2, max_seq_len=max_seq_len)
    assert m["update/truncated"] > 0 and (m["update/prompt_too_long"] > 0) == (max_seq_len == 9)
    model = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu")).model
    assert_same(got, grad_of(model, reference_loss(model, rollouts, U.UpdateConfig(), max_seq_len=max_seq_len)))


def test_several_mini_batches_step_from_the_proximal_policy(model_dir, tmp_path):
    """mini_batches=3, epochs=2, plain SGD: every step's gradient equals the reference over the
    rollouts of that mini-batch, at the weights the previous steps left, with pi_prox = the policy
    before the update and the KL to the frozen start."""
    rollouts = uneven_rollouts(seed=5)
    rollouts[4].reward = 0.0  # g3 gets a signal, so every dealt mini-batch trains
    cfg = dict(mini_batches=3, epochs=2, micro_batch_size=2, tis_cap=2.0, kl_coef=0.1, clip_low=0.05, clip_high=0.05)
    up = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu", max_grad_norm=0, **cfg))
    lr = 0.3
    steps = recorded_steps(up, lr)
    m = up.update(samples_of(tmp_path, rollouts))
    assert len(steps) == 6 and m["update/clip_frac"] > 0.1 and m["update/kl"] > 0  # later steps clip
    start = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu")).model
    model = copy.deepcopy(start)
    adv, by_id = ref_advantages(rollouts), {r.rid: r for r in rollouts}
    for rids, got in steps:
        loss = reference_loss(model, [by_id[r] for r in rids], U.UpdateConfig(**cfg), adv=adv,
                              prox_model=start, ref_model=start)
        want = grad_of(model, loss)
        assert_same(got, want)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    assert sorted(r for rids, _ in steps for r in rids) == sorted(2 * [r.rid for r in rollouts])


def test_a_rollout_cannot_weigh_more_by_repeating_its_calls(model_dir, tmp_path):
    """A harness that resends the same call five times (the prompt does not extend the history, so
    every call starts a new sample) gets five samples, each worth a fifth: the step's gradient is
    that of the one call."""
    once = uneven_rollouts(seed=6)
    greedy = copy.deepcopy(once)
    greedy[0].calls = greedy[0].calls * 5
    tables = [samples_of(tmp_path / name, rs) for name, rs in (("once", once), ("greedy", greedy))]
    assert tables[1].num_rows == tables[0].num_rows + 4
    weights: dict[str, float] = {}
    for row in tables[1].to_pylist():
        rid = row["rollout_id"]
        weights[rid] = weights.get(rid, 0.0) + row["loss_weight"] * sum(row["response_mask"])
    assert weights == pytest.approx(dict.fromkeys(weights, 1.0))
    g_once, _ = trainer_gradient(model_dir, tables[0], micro_batch_size=4)
    g_greedy, _ = trainer_gradient(model_dir, tables[1], micro_batch_size=4)
    assert_same(g_greedy, g_once)


def test_right_padding_does_not_change_a_samples_logprobs(model_dir):
    """A short and a long sample in one micro-batch: each response token's logprob equals the one
    of the sample run alone (the logit before it, no attention to padding)."""
    gen = torch.Generator().manual_seed(7)
    calls = [Call(_rng_ids(gen, 3), _rng_ids(gen, 2), [0.0] * 2), Call(_rng_ids(gen, 17), _rng_ids(gen, 9), [0.0] * 9)]
    up = U.PolicyUpdater(model_dir, U.UpdateConfig(device="cpu"))
    rows = [U.Sample(f"r{i}~0", c.prompt, c.response, [1] * len(c.response), c.logprobs, 1.0, 1.0)
            for i, c in enumerate(calls)]
    for chunk in (0, 4):
        up.cfg.logprob_chunk_tokens = chunk
        got = up.frozen_logprobs(up.model, rows)
        with torch.no_grad():
            for i, c in enumerate(calls):
                want = torch.stack(call_logprobs(up.model, c))
                assert float((got[i] - want).abs().max()) < 1e-5


def test_table_weights_sum_per_rollout_as_documented(tmp_path):
    """Per rollout, the loss weights of its model tokens sum to 1 (rollout), to its sample count
    (seq-mean) or to its token count (token-mean), also when a broken merge split it."""
    rollouts = uneven_rollouts(seed=8)
    rollouts[1].calls[3].prompt = rollouts[1].calls[3].prompt[:-2]  # calls 3 and 4 each start a sample
    for mode in ("rollout", "seq-mean", "token-mean"):
        table = samples_of(tmp_path / mode, rollouts, weight_mode=mode)
        rows = table.to_pylist()
        assert len(rows) == len(rollouts) + 2
        for r in rollouts:
            mine = [x for x in rows if x["rollout_id"] == r.rid]
            total = sum(x["loss_weight"] * sum(x["response_mask"]) for x in mine)
            tokens = sum(len(c.response) for c in r.calls)
            expected = {"rollout": 1.0, "seq-mean": float(len(mine)), "token-mean": float(tokens)}[mode]
            assert total == pytest.approx(expected, rel=1e-6), (mode, r.rid)


def decimal_advantages(rewards: list[float], groups: list[str], method: str = "grpo") -> list[float]:
    """GRPO / RLOO in 60-digit decimals (no overflow at any float reward), written out."""
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 60
        out = []
        for r, g in zip(rewards, groups):
            rs = [Decimal(x) for x, h in zip(rewards, groups) if h == g]
            n = len(rs)
            if n > 1 and max(rs) == min(rs):
                out.append(0.0)
                continue
            mean = sum(rs) / n if n > 1 else Decimal(0)
            if method == "rloo":
                out.append(float((Decimal(r) - mean) * (Decimal(n) / (n - 1) if n > 1 else 1)))
                continue
            std = (sum((x - mean) ** 2 for x in rs) / (n - 1)).sqrt() if n > 1 else Decimal(1)
            out.append(float((Decimal(r) - mean) / (std + Decimal(1e-6))))
        return out


def test_group_advantages_equal_the_reference_at_any_reward_scale():
    """Ordinary rewards, and rewards a self-reporting harness may send (any finite float): a group
    with 1e200 in it kept its std from overflowing to inf (every advantage silently 0), one with
    1e308 twice produced NaN advantages (the update refuses the table, the step fails)."""
    import numpy as np

    from lightning_harness.trainer.advantages import group_advantages

    gen = torch.Generator().manual_seed(9)
    cases = [([1.0, 0.0, 0.5, 0.5], "gggg"), ([0.3, 0.3], "gg"), ([0.7], "g"), ([1.0, 0.0, 2.0, 2.0], "gghh"),
             ([3e154, 0.0], "gg"), ([1e200, 0.0, 1.0], "ggg"), ([1e308, 1e308, 0.0], "ggg"),
             ([-1.7e308, 1.7e308, 0.0, 5.0], "gghh"), ([1e-300, 0.0, 2e-300], "ggg")]
    cases += [((torch.randn(8, generator=gen) * 10.0 ** k).tolist(), "aabbbccd") for k in (-3, 0, 4)]
    for rewards, groups in cases:
        got, _ = group_advantages(np.array(rewards), np.array(list(groups)))
        assert np.allclose(got, decimal_advantages(rewards, list(groups)), rtol=1e-9, atol=1e-12), (rewards, got)
        if max(abs(x) for x in rewards) < 1e150:  # rloo is r - mean: finite while the answer is
            got, _ = group_advantages(np.array(rewards), np.array(list(groups)), method="rloo")
            assert np.allclose(got, decimal_advantages(rewards, list(groups), "rloo"), rtol=1e-9, atol=1e-12)
