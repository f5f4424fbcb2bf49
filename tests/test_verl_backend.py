"""verl backend: conversion, folded weights, registrations, parity with update.py, config composition.

The parity and composition checks run a script under .venv-verl (verl 0.9.1 cannot share the
training environment: transformers pins conflict). Not run here: verl's Ray/FSDP trainer (GPU only).
"""

from __future__ import annotations

import pytest
import torch
from fixtures_verl import attribute_without, needs_verl, run_in_verl
from test_update_core import make_samples

from lightning_harness.trainer import verl_backend as VB
from lightning_harness.trainer.update import UpdateConfig, ppo_token_loss
from lightning_harness.trainer.weights import aggregate_loss


def test_module_imports_without_verl():
    assert attribute_without(["verl"], "lightning_harness.trainer.verl_backend", "POLICY_LOSS") == "lightning_rollout"


def test_tensors_layout_matches_the_samples():
    table = make_samples(seed=11)
    t, nt, meta = VB.samples_to_tensors(table, pad_id=0)
    rows = table.to_pylist()
    B, P = t["prompts"].shape
    R = t["responses"].shape[1]
    assert t["input_ids"].shape == (B, P + R) and t["position_ids"].shape == (B, P + R)
    for b, row in enumerate(rows):
        p, r = row["prompt_token_ids"], row["response_token_ids"]
        assert t["prompts"][b, P - len(p):].tolist() == p  # left-padded prompt
        assert t["responses"][b, : len(r)].tolist() == r  # right-padded response
        assert t["response_mask"][b, : len(r)].tolist() == row["response_mask"]
        assert t["attention_mask"][b].sum() == len(p) + len(r)
        assert t["position_ids"][b, P - len(p)] == 0 and t["position_ids"][b, P + len(r) - 1] == len(p) + len(r) - 1
    assert list(nt["uid"]) == [r["group_id"] for r in rows]
    assert meta["lightning_units"] == len({r["rollout_id"] for r in rows})


@pytest.mark.parametrize("mode", ["rollout", "token-mean", "seq-mean"])
def test_folded_advantages_under_token_mean_equal_our_aggregated_loss(mode):
    """verl token-mean over A' = A*w*T/N equals weights.aggregate_loss over A (values and gradients)."""
    table = make_samples(seed=12)
    if mode != "rollout":  # rebuild loss_weight for the other modes
        import numpy as np
        import pyarrow as pa

        from lightning_harness.trainer.weights import loss_weights

        rows = table.to_pylist()
        idx = {r: i for i, r in enumerate(dict.fromkeys(x["rollout_id"] for x in rows))}
        w = loss_weights(np.array([idx[x["rollout_id"]] for x in rows]),
                         np.array([sum(x["response_mask"]) for x in rows]), mode)
        table = table.set_column(table.schema.get_field_index("loss_weight"), "loss_weight", pa.array(w, pa.float32()))
    t, _, meta = VB.samples_to_tensors(table, weight_mode=mode)
    mask = t["response_mask"]
    torch.manual_seed(0)
    old = t["old_log_probs"]
    new = (old + 0.3 * torch.randn_like(old)).requires_grad_(True)
    cfg = UpdateConfig(tis_cap=0)
    adv_rows = torch.tensor(table["advantage"].to_pylist())
    ours_tok, _ = ppo_token_loss(new, old, old, adv_rows, cfg)
    ours = aggregate_loss(ours_tok, mask, t["loss_weights"] if mode != "token-mean" else None,
                          meta["lightning_units"], mode)
    g_ours, = torch.autograd.grad(ours, new)
    # verl's vanilla objective with token-level advantages A', token-mean over T tokens
    ratio = torch.exp(new - old)
    A = t["advantages"]
    pg = torch.maximum(-A * ratio, -A * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high))
    theirs = (pg * mask).sum() / mask.sum()
    g_theirs, = torch.autograd.grad(theirs, new)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_theirs, g_ours, rtol=1e-4, atol=1e-8)


VERL_SCRIPT = r'''
import json, sys, torch
import pyarrow.parquet as pq
from lightning_harness.trainer import verl_backend as VB
from lightning_harness.trainer.update import UpdateConfig, ppo_token_loss
from lightning_harness.trainer.weights import aggregate_loss
from lightning_harness.trainer.config import RunConfig
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

table = pq.read_table(sys.argv[1])
dp = VB.samples_to_dataproto(table)
VB.register(); VB.register()  # idempotent
out = {"len": len(dp), "keys": sorted(dp.batch.keys()), "uid": list(dp.non_tensor_batch["uid"][:2])}
b = dp.batch
mask = b["response_mask"]
torch.manual_seed(0)
new = (b["old_log_probs"] + 0.3 * torch.randn_like(mask)).requires_grad_(True)
# our advantages survive verl's compute_advantage path through the registered estimator
fn = core_algos.get_adv_estimator_fn(VB.ADV_ESTIMATOR)
adv, _ = fn(token_level_rewards=b["token_level_rewards"], response_mask=mask, config=None,
            index=dp.non_tensor_batch["uid"])
out["adv_passthrough"] = bool(torch.equal(adv, b["advantages"]))
cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=len(dp), ppo_micro_batch_size_per_gpu=1,
                  clip_ratio_low=0.2, clip_ratio_high=0.28, use_dynamic_bsz=False, rollout_n=1)
loss_fn = core_algos.get_policy_loss_fn(VB.POLICY_LOSS)
theirs, metrics = loss_fn(old_log_prob=b["old_log_probs"], log_prob=new, advantages=adv, response_mask=mask.bool(),
                          loss_agg_mode="seq-mean-token-sum", config=cfg)  # the registered loss pins token-mean
g_theirs, = torch.autograd.grad(theirs, new)
ucfg = UpdateConfig(clip_low=0.2, clip_high=0.28, tis_cap=0)
ours_tok, _ = ppo_token_loss(new, b["old_log_probs"], b["old_log_probs"], torch.tensor(table["advantage"].to_pylist()),
                             ucfg)
ours = aggregate_loss(ours_tok, mask, b["loss_weights"], dp.meta_info["lightning_units"], "rollout")
g_ours, = torch.autograd.grad(ours, new)
out["loss_verl"], out["loss_ours"] = float(theirs), float(ours)
out["grad_maxdiff"] = float((g_theirs - g_ours).abs().max())
out["grad_max"] = float(g_ours.abs().max())
# config composition against verl's own ppo_trainer.yaml
rc = RunConfig(); rc.update.kl_coef = 0.01; rc.rollout.group_size = 8
try:  # verl's KL term is a token mean: another weight mode is refused
    VB.verl_overrides(rc, model_path="/models/qwen", train_batch_size=256)
    out["kl_refused"] = False
except ValueError as exc:
    out["kl_refused"] = "token-mean" in str(exc)
rc.samples.weight_mode = "token-mean"
ov = VB.verl_overrides(rc, model_path="/models/qwen", train_batch_size=256, n_gpus_per_node=8, nnodes=2)
c = VB.compose_verl_config(ov)
a = c.actor_rollout_ref.actor
out["composed"] = {"loss_mode": a.policy_loss.loss_mode, "agg": a.loss_agg_mode, "mini": a.ppo_mini_batch_size,
                   "kl": a.use_kl_loss, "adv": c.algorithm.adv_estimator,
                   "bypass": c.algorithm.rollout_correction.bypass_mode,
                   "is": c.algorithm.rollout_correction.rollout_is, "n": c.actor_rollout_ref.rollout.n,
                   "gpus": c.trainer.n_gpus_per_node, "nnodes": c.trainer.nnodes}
print("RESULT " + json.dumps(out))
'''


@needs_verl
def test_parity_registration_and_config_composition_inside_verl(tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "samples.parquet"
    pq.write_table(make_samples(seed=13), path)
    script = tmp_path / "verl_check.py"
    script.write_text(VERL_SCRIPT)
    out = run_in_verl(script, path, cwd=tmp_path)
    assert out["len"] == make_samples(seed=13).num_rows
    assert {"input_ids", "attention_mask", "position_ids", "responses", "response_mask", "old_log_probs",
            "advantages"} <= set(out["keys"])
    assert out["adv_passthrough"]
    assert out["loss_verl"] == pytest.approx(out["loss_ours"], rel=1e-5, abs=1e-7)
    assert out["grad_max"] > 0 and out["grad_maxdiff"] <= 1e-6 * max(1.0, out["grad_max"]) * 10
    assert out["composed"] == {"loss_mode": "lightning_rollout", "agg": "token-mean", "mini": 256, "kl": True,
                               "adv": "lightning_precomputed", "bypass": True, "is": "token", "n": 8,
                               "gpus": 8, "nnodes": 2}
    assert out["kl_refused"]
