"""The policy update (trainer/update.py) on a random tiny Qwen2 and hand-built samples tables."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lightning_harness.schemas import SAMPLES
from lightning_harness.trainer import checkpoint as ckpt
from lightning_harness.trainer import update as U
from lightning_harness.trainer.checkpoint import VERSION_FILE
from lightning_harness.trainer.cli import step_command
from lightning_harness.trainer.weights import aggregate_loss

VOCAB = 300


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """Random Qwen2 (hidden 128, 2 heads of 64, 2 layers) plus a real word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                      num_hidden_layers=2, intermediate_size=256, max_position_embeddings=512)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(d)
    return d


def make_samples(seed: int = 0, n_rollouts: int = 6, adv=None) -> pa.Table:
    """Rollouts of 1-3 samples each; masks with harness-inserted (0) tokens; per-rollout weights."""
    rng = random.Random(seed)
    rows = []
    for r in range(n_rollouts):
        n = rng.randint(1, 3)
        samples = []
        for _ in range(n):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))]
            resp = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
            mask = [1 if rng.random() < 0.7 else 0 for _ in resp]
            mask[0] = 1
            samples.append((prompt, resp, mask))
        model_tokens = sum(sum(m) for _, _, m in samples)
        a = adv if adv is not None else rng.choice([-1.0, 0.5, 1.0])
        for k, (prompt, resp, mask) in enumerate(samples):
            rows.append(dict(
                sample_id=f"r{r}-0-{k}", rollout_id=f"r{r}", attempt=0, task_id=f"t{r % 3}",
                group_id=f"t{r % 3}", step=0, index_in_rollout=k,
                prompt_token_ids=prompt, response_token_ids=resp, response_mask=mask,
                response_logprobs=[(-5.0 + rng.random()) if m else 0.0 for m in mask],
                reward=a, advantage=a, loss_weight=1.0 / model_tokens,
                model_version_min=0, model_version_max=0,
            ))
    return pa.Table.from_pylist(rows, schema=SAMPLES)


def grads_after_accumulate(model_dir, table, **cfg):
    up = U.PolicyUpdater(model_dir, U.UpdateConfig(**cfg))
    rows, _ = U.table_to_samples(table, 4096)
    up.optimizer.zero_grad(set_to_none=True)
    stats = up.accumulate_gradients(rows)
    return torch.cat([p.grad.flatten() for p in up.model.parameters()]), stats


@pytest.mark.parametrize("mode", ["rollout", "token-mean"])
def test_gradient_does_not_depend_on_micro_batch_size(tiny_model, mode):
    table = make_samples(seed=1)
    g1, s1 = grads_after_accumulate(tiny_model, table, micro_batch_size=1, loss_mode=mode)
    g4, s4 = grads_after_accumulate(tiny_model, table, micro_batch_size=4, loss_mode=mode)
    gall, _ = grads_after_accumulate(tiny_model, table, micro_batch_size=10_000, loss_mode=mode)
    assert g1.abs().max() > 1e-4  # a real gradient, not zeros
    torch.testing.assert_close(g1, g4, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(g1, gall, atol=1e-6, rtol=1e-4)
    assert s1["loss"] == pytest.approx(s4["loss"], rel=1e-4, abs=1e-7)


def test_rollout_mode_counts_each_rollout_once(tiny_model):
    """Splitting a rollout into more samples (same tokens, weights renormalised) keeps its gradient."""
    row = dict(make_samples(seed=2, n_rollouts=1).to_pylist()[0])
    g_one, _ = grads_after_accumulate(tiny_model, pa.Table.from_pylist([row], schema=SAMPLES), micro_batch_size=1)
    doubled = [dict(row, sample_id="a", loss_weight=row["loss_weight"] / 2),
               dict(row, sample_id="b", loss_weight=row["loss_weight"] / 2)]
    g_two, _ = grads_after_accumulate(tiny_model, pa.Table.from_pylist(doubled, schema=SAMPLES), micro_batch_size=1)
    torch.testing.assert_close(g_one, g_two, atol=1e-6, rtol=1e-4)
    # seq-mean (per-sample normalisation), by contrast, counts the duplicated rollout twice
    g_seq, _ = grads_after_accumulate(tiny_model, pa.Table.from_pylist(doubled, schema=SAMPLES),
                                      micro_batch_size=1, loss_mode="seq-mean")
    assert not torch.allclose(g_one, g_seq, atol=1e-6)


def test_update_moves_logprobs_in_the_direction_of_the_advantage(tiny_model):
    for adv, sign in ((1.0, 1), (-1.0, -1)):
        table = make_samples(seed=3, n_rollouts=4, adv=adv)
        up = U.PolicyUpdater(tiny_model, U.UpdateConfig(lr=1e-3, micro_batch_size=3))
        rows, _ = U.table_to_samples(table, 4096)
        before = up.frozen_logprobs(up.model, rows)
        m = up.update(table)
        after = up.frozen_logprobs(up.model, rows)
        delta = sum(float(((after[i] - before[i]) * torch.tensor(s.mask, dtype=torch.float32)).sum())
                    for i, s in enumerate(rows))
        assert sign * delta > 0, (adv, delta)
        assert m["update/optimizer_steps"] == 1 and m["update/ratio_mean"] == pytest.approx(1.0)
        assert m["update/grad_norm"] > 0


def recording_collate(collate, seen: list):
    """``collate`` that also records every sample it is given (which samples got a forward pass)."""
    def record(chunk, *args, **kwargs):
        seen.extend(chunk)
        return collate(chunk, *args, **kwargs)
    return record


def test_zero_advantage_rollouts_are_skipped_but_still_count_in_the_divisor(tiny_model):
    """A group with no signal dilutes the step (as verl's aggregation does) but costs no forward pass."""
    signal = make_samples(seed=8, n_rollouts=3, adv=1.0)
    silent = make_samples(seed=9, n_rollouts=3, adv=0.0).to_pylist()
    for row in silent:
        row["rollout_id"] = "z" + row["rollout_id"]
        row["sample_id"] = "z" + row["sample_id"]
    both = pa.concat_tables([signal, pa.Table.from_pylist(silent, schema=SAMPLES)])
    grads = {}
    for name, table in (("signal", signal), ("both", both)):
        up = U.PolicyUpdater(tiny_model, U.UpdateConfig(lr=1e-3, max_grad_norm=0))
        seen = []
        orig = U.collate
        U.collate = recording_collate(orig, seen)
        try:
            m = up.update(table)
        finally:
            U.collate = orig
        assert all(s.advantage != 0 for s in seen)  # zero-advantage samples never ran
        grads[name] = m["update/grad_norm"]
    assert grads["both"] == pytest.approx(grads["signal"] * 3 / 6, rel=1e-4)  # N went from 3 to 6


def test_clip_stops_gradient_only_where_the_objective_is_clipped():
    cfg = U.UpdateConfig(clip_low=0.2, clip_high=0.28, tis_cap=0)
    prox = torch.zeros(1, 4)
    new = torch.tensor([[0.5, -0.5, 0.5, -0.5]], requires_grad=True)  # ratios e^.5=1.65, e^-.5=0.61
    beh = torch.zeros(1, 4)
    for a, zero_grad_idx in ((1.0, 0), (-1.0, 1)):
        loss, diag = U.ppo_token_loss(new, prox, beh, torch.tensor([a]), cfg)
        g, = torch.autograd.grad(loss.sum(), new)
        # A>0 and ratio above 1+eps: clipped (no gradient); A<0 and ratio below 1-eps: clipped
        assert g[0, zero_grad_idx] == 0
        assert g[0, 1 - zero_grad_idx] != 0
        assert diag["clipped"][0, zero_grad_idx] == 1


def test_truncated_importance_weight_caps_stale_tokens():
    cfg = U.UpdateConfig(tis_cap=2.0)
    prox = torch.tensor([[-1.0, -1.0, -1.0]])
    beh = torch.tensor([[-1.0, -1.5, -4.0]])  # weights 1, e^.5=1.65, e^3 -> capped at 2
    new = prox.clone().requires_grad_(True)
    loss, diag = U.ppo_token_loss(new, prox, beh, torch.tensor([1.0]), cfg)
    torch.testing.assert_close(diag["tis"], torch.tensor([[1.0, 1.6487213, 2.0]]))
    assert diag["tis_capped"].tolist() == [[0.0, 0.0, 1.0]]
    g, = torch.autograd.grad(loss.sum(), new)
    torch.testing.assert_close(g, -diag["tis"])  # d(-A r w)/d new = -A w at r = 1


def test_missing_behaviour_logprobs_get_weight_one():
    cfg = U.UpdateConfig(tis_cap=2.0)
    prox = torch.tensor([[-1.0, -2.0]])
    beh = torch.tensor([[float("nan"), -2.5]])
    _, diag = U.ppo_token_loss(prox.clone(), prox, beh, torch.tensor([1.0]), cfg)
    torch.testing.assert_close(diag["tis"], torch.tensor([[1.0, 1.6487213]]))


def test_k3_kl_is_zero_at_the_reference_and_pulls_towards_it():
    cfg = U.UpdateConfig(kl_coef=1.0, tis_cap=0)
    ref = torch.tensor([[-1.0, -1.0]])
    new = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    loss, diag = U.ppo_token_loss(new, new.detach(), new.detach(), torch.tensor([0.0]), cfg, ref_lp=ref)
    assert diag["kl"][0, 0] == 0 and diag["kl"][0, 1] > 0
    g, = torch.autograd.grad(loss.sum(), new)
    assert g[0, 1] > 0  # descending the loss lowers new logprob back toward ref


def test_kl_at_an_untrained_context_token_cannot_make_the_loss_nan():
    """Found by review: a context token (mask 0: the harness wrote it) the policy learned to avoid,
    logprob -104 against the reference's -4, made k3's exp overflow; inf * 0 made the mini-batch's
    loss NaN and its step was skipped. Clamped as verl's low_var_kl: finite loss and gradient, and
    the context token adds nothing."""
    cfg = U.UpdateConfig(kl_coef=0.1, tis_cap=0)
    new = torch.tensor([[-1.0, -104.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -4.0, -2.0]])
    mask = torch.tensor([[1, 0, 1]])
    loss, _ = U.ppo_token_loss(new, new.detach(), new.detach(), torch.tensor([0.5]), cfg, ref_lp=ref)
    total = aggregate_loss(loss, mask, torch.tensor([1.0]), 1)
    g, = torch.autograd.grad(total, new)
    assert torch.isfinite(total) and torch.isfinite(g).all() and g[0, 1] == 0
    trained, _ = U.ppo_token_loss(new[:, [0, 2]], new.detach()[:, [0, 2]], new.detach()[:, [0, 2]],
                                  torch.tensor([0.5]), cfg, ref_lp=ref[:, [0, 2]])
    torch.testing.assert_close(total, aggregate_loss(trained, mask[:, [0, 2]], torch.tensor([1.0]), 1))


def test_several_optimizer_steps_and_reference_kl(tiny_model):
    table = make_samples(seed=4)
    up = U.PolicyUpdater(tiny_model, U.UpdateConfig(lr=5e-3, mini_batches=2, epochs=2, kl_coef=0.05))
    m = up.update(table)
    assert m["update/optimizer_steps"] == 4
    assert m["update/kl"] > 0  # the policy moved away from the frozen reference
    assert m["update/ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # later steps see pi != pi_prox


def test_checkpoint_roundtrip_keeps_version_weights_tokenizer_and_optimizer(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    up = U.PolicyUpdater(tiny_model, U.UpdateConfig(lr=1e-3))
    up.update(make_samples(seed=5))
    out = up.save(tmp_path / "ckpt", model_version=1, step=0)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    info = json.loads((out / VERSION_FILE).read_text())
    assert info["model_version"] == 1 and info["step"] == 0 and info["base_model"] == str(tiny_model)
    assert not list(tmp_path.glob(".*.tmp"))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for (n, p), (_, q) in zip(up.model.named_parameters(), reloaded.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=n)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    text = "w5 w7 w9"
    saved, original = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model)
    assert saved(text)["input_ids"] == original(text)["input_ids"]
    up2 = U.PolicyUpdater(out, U.UpdateConfig(lr=1e-3))
    s1, s2 = up.optimizer.state_dict()["state"], up2.optimizer.state_dict()["state"]
    assert len(s2) == len(s1) > 0
    torch.testing.assert_close(s1[0]["exp_avg"], s2[0]["exp_avg"])
    # the saved optimizer state carries lr 1e-3; a checkpoint resumed with another lr uses that one
    up3 = U.PolicyUpdater(out, U.UpdateConfig(lr=2e-4))
    assert {g["lr"] for g in up3.optimizer.param_groups} == {2e-4}


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_scheduled_lr_runs_from_lr_to_the_final_ratio(schedule):
    cfg = U.UpdateConfig(lr=1e-3, lr_schedule=schedule, lr_final_ratio=0.2)
    lrs = [U.scheduled_lr(cfg, s, 12) for s in range(1, 13)]
    assert lrs[0] == pytest.approx(1e-3)
    if schedule == "constant":
        assert lrs == [1e-3] * 12
    else:
        assert lrs[-1] == pytest.approx(2e-4) and all(a > b for a, b in zip(lrs, lrs[1:]))
    if schedule == "linear":
        assert lrs[6] - lrs[5] == pytest.approx(lrs[1] - lrs[0])
    assert U.scheduled_lr(cfg, 1, 1) == pytest.approx(1e-3)  # a one-step run keeps lr
    with pytest.raises(ValueError, match="lr_schedule"):
        U.UpdateConfig.from_dict({"lr_schedule": "step"})


def test_bad_samples_fail_clearly_and_zero_advantage_is_skipped(tiny_model):
    rows = make_samples(seed=6, n_rollouts=1).to_pylist()
    bad = dict(rows[0], response_mask=rows[0]["response_mask"][:-1] or [1, 1])
    with pytest.raises(ValueError, match="lengths differ"):
        U.table_to_samples(pa.Table.from_pylist([bad], schema=SAMPLES), 4096)
    with pytest.raises(ValueError, match="lacks columns"):
        U.table_to_samples(pa.table({"rollout_id": ["x"]}), 4096)
    zero = make_samples(seed=6, n_rollouts=2, adv=0.0)
    up = U.PolicyUpdater(tiny_model, U.UpdateConfig())
    before = [p.detach().clone() for p in up.model.parameters()]
    m = up.update(zero)
    assert m["update/skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, up.model.parameters()))


def test_step_command_writes_a_checkpoint(tiny_model, tmp_path):
    from click.testing import CliRunner

    path = tmp_path / "samples.parquet"
    pq.write_table(make_samples(seed=7), path)
    res = CliRunner().invoke(step_command, [str(path), "--model", str(tiny_model), "--out",
                                              str(tmp_path / "out"), "--set", "lr=1e-4",
                                              "--set", "micro_batch_size=2"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / VERSION_FILE).read_text())["model_version"] == 1
    res = CliRunner().invoke(step_command, [str(path), "--model", str(tiny_model), "--out",
                                              str(tmp_path / "o2"), "--set", "lr_rate=1"])
    assert res.exit_code == 2 and "unknown key 'lr_rate' (did you mean 'lr'?)" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "o2").exists()


def test_checkpoints_after_a_resume_keep_the_tokenizer_and_the_configs_optimizer_settings(tiny_model, tmp_path):
    """Resumed from checkpoints/step-3, whose folder prune removes two steps later: every new
    checkpoint still holds the tokenizer (they lost it from the third step on), and the config's
    optimizer settings win over the saved ones (only lr did)."""
    from transformers import AutoTokenizer

    from lightning_harness.trainer.config import UpdateConfig

    ck = tmp_path / "checkpoints"
    first = U.PolicyUpdater(tiny_model, UpdateConfig(device="cpu", lr=1e-3))
    for step in (1, 2, 3):
        out = first.save(ckpt.step_dir(ck, step), model_version=step, step=step)
        ckpt.prune(ck, 2, protect=(str(out), str(tiny_model)))
    cfg = UpdateConfig(device="cpu", lr=2e-3, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    resumed = U.PolicyUpdater(ckpt.step_dir(ck, 3), cfg)  # --resume
    assert {k: resumed.optimizer.param_groups[0][k] for k in ("lr", "weight_decay", "betas", "eps")} == {
        "lr": 2e-3, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}
    for step in (4, 5, 6):
        resumed.update(make_samples(seed=step))
        out = resumed.save(ckpt.step_dir(ck, step), model_version=step, step=step)
        ckpt.prune(ck, 2, protect=(str(out), str(tiny_model)))
    assert sorted(p.name for p in ck.iterdir()) == ["step-000005", "step-000006"]
    newest = ckpt.step_dir(ck, 6)
    assert (newest / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert len(AutoTokenizer.from_pretrained(newest)) == len(AutoTokenizer.from_pretrained(tiny_model))


def test_a_step_skipped_for_a_non_finite_gradient_is_not_counted(tiny_model):
    from lightning_harness.trainer.config import UpdateConfig

    table = make_samples(seed=1).to_pylist()
    table[0]["response_logprobs"] = [-9999.0] * len(table[0]["response_logprobs"])  # vLLM's -inf stand-in
    updater = U.PolicyUpdater(tiny_model, UpdateConfig(device="cpu", lr=1e-3, tis_cap=0.0))
    before = [p.detach().clone() for p in updater.model.parameters()]
    m = updater.update(pa.Table.from_pylist(table, schema=SAMPLES))
    moved = any(not torch.equal(a, b) for a, b in zip(before, updater.model.parameters()))
    assert m["update/optimizer_steps"] + m["update/skipped_nonfinite"] >= 1
    assert moved == (m["update/optimizer_steps"] > 0)  # reported steps are steps taken


def test_a_response_cut_at_max_seq_len_leaves_its_rollout_counting_once(tiny_model):
    """A sample cut at max_seq_len loses tokens, not weight: the update re-derives the kept tokens'
    weights, so the gradient equals that of the same samples cut before their weights were built."""
    rows = make_samples(seed=3, n_rollouts=3).to_pylist()
    cut = []
    for r in rows:
        room = 16 - len(r["prompt_token_ids"])
        cut.append({**r, **{k: r[k][:room] for k in ("response_token_ids", "response_mask", "response_logprobs")}})
    for rid in {r["rollout_id"] for r in cut}:
        tokens = sum(sum(r["response_mask"]) for r in cut if r["rollout_id"] == rid)
        for r in cut:
            r["loss_weight"] = 1.0 / tokens if r["rollout_id"] == rid else r["loss_weight"]
    up = U.PolicyUpdater(tiny_model, U.UpdateConfig(micro_batch_size=4))
    grads, infos = [], []
    for table, seq_len in ((pa.Table.from_pylist(rows, schema=SAMPLES), 16),
                           (pa.Table.from_pylist(cut, schema=SAMPLES), None)):
        samples, info = U.table_to_samples(table, seq_len, "rollout")
        infos.append(info["truncated"])
        for key in {s.rollout_id for s in samples}:
            assert sum(s.loss_weight * sum(s.mask) for s in samples if s.rollout_id == key) == pytest.approx(1.0)
        up.optimizer.zero_grad(set_to_none=True)
        up.accumulate_gradients(samples)
        grads.append(torch.cat([p.grad.flatten() for p in up.model.parameters()]))
    assert infos[0] > 0 and infos[1] == 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_a_resumed_run_deals_its_mini_batches_as_an_unbroken_run(tiny_model, tmp_path):
    """With several mini-batches the rollouts are shuffled each step; resumed from the step-1
    checkpoint, step 2 must be dealt (and so end in the weights) as in a run that never stopped."""
    cfg = U.UpdateConfig(device="cpu", lr=1e-2, mini_batches=3, seed=7)
    straight = U.PolicyUpdater(tiny_model, cfg)
    straight.update(make_samples(seed=11))
    saved = straight.save(ckpt.step_dir(tmp_path, 1), model_version=1, step=1)
    straight.update(make_samples(seed=12))
    resumed = U.PolicyUpdater(saved, cfg)
    resumed.update(make_samples(seed=12))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
