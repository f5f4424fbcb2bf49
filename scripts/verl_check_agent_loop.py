"""Drive LightningAgentLoopManager through the CPU part of verl 0.9.1's RayPPOTrainer.fit step.

Run under .venv-verl: ``python scripts/verl_check_agent_loop.py SAMPLES.parquet``. It composes the
verl config with our overrides (Hydra, verl's own ppo_trainer.yaml), resolves the manager class the
way verl does, builds verl's prompt batch (tasks x rollout.n rows), then runs the trainer's own
functions in fit() order: _get_gen_batch, repeat, generate_sequences (our manager, with the samples
table standing in for the harness rollout), union, extract_reward, apply_bypass_mode,
compute_advantage, and finally the policy loss the actor would call. Prints ``RESULT <json>``
with the facts tests/test_verl_agent_loop.py asserts. Not run: Ray workers, vLLM, FSDP.

``verl.trainer.ppo.ray_trainer`` itself does not import in a CPU-only env (it pulls in torchtitan,
torchdata, datasets, ...), so its two small driver-side helpers are restated here line for line:
``_get_gen_batch`` and the registry branch of ``compute_advantage`` (non-GAE/GRPO estimators).
"""

from __future__ import annotations

import json
import sys
import uuid

import numpy as np
import pyarrow.parquet as pq
import torch


def get_gen_batch(batch):
    """RayPPOTrainer._get_gen_batch (verl 0.9.1), restated."""
    reward_keys = {"data_source", "reward_model", "extra_info", "uid"} & batch.non_tensor_batch.keys()
    gen_batch = batch.pop(batch_keys=[], non_tensor_batch_keys=list(set(batch.non_tensor_batch.keys()) - reward_keys))
    gen_batch.non_tensor_batch.update(batch.non_tensor_batch)
    return gen_batch


def main(path: str) -> dict:
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.reward import extract_reward
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    from lightning_harness.trainer import verl_agent_loop as VA
    from lightning_harness.trainer import verl_backend as VB
    from lightning_harness.trainer.config import RunConfig
    from lightning_harness.trainer.update import UpdateConfig, ppo_token_loss
    from lightning_harness.trainer.weights import aggregate_loss

    table = pq.read_table(path)
    group_size, slots, P, R = 2, 3, 16, 20
    tasks = [{"id": t} for t in dict.fromkeys(table.column("task_id").to_pylist())]
    out: dict = {}

    # 1. config: our overrides on verl's ppo_trainer.yaml; the manager class resolved as verl does
    rc = RunConfig()
    rc.rollout.group_size = group_size
    ov = VB.verl_overrides(rc, model_path="/models/qwen", train_batch_size=len(tasks), n_gpus_per_node=2, nnodes=1,
                           max_prompt_length=P, max_response_length=R)
    ov += VA.agent_loop_overrides(train_files="/data/tasks.parquet", harness="python agent.py --task {task_id}",
                                  traces="/data/traces", group_size=group_size, slots=slots)
    cfg = VB.compose_verl_config(ov)
    from verl.utils.config import validate_config

    VB.register()  # as the entry point does before verl's main validates
    validate_config(cfg, use_reference_policy=bool(cfg.actor_rollout_ref.actor.use_kl_loss), use_critic=False)
    agent = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.agent)
    cls = load_class_from_fqn(agent.agent_loop_manager_class, "AgentLoopManager")
    n = int(cfg.actor_rollout_ref.rollout.n)
    out["config"] = {"cls": f"{cls.__module__}.{cls.__name__}", "n": n, "use_v1": bool(cfg.trainer.use_v1),
                     "harness": cfg.lightning.harness, "group_size": int(cfg.lightning.group_size),
                     "bypass": bool(cfg.algorithm.rollout_correction.bypass_mode)}

    # 2. the prompt batch fit() builds from RLHFDataset rows (write_task_dataset), a uid per row
    seen = []

    def rollout_fn(tasks_, step, upstreams):
        seen.append({"tasks": [t["id"] for t in tasks_], "step": step, "upstreams": upstreams})
        return table

    manager = cls.create(config=cfg, llm_client=None, rollout_fn=rollout_fn, upstreams=["http://10.0.0.1:8000"])
    batch = DataProto.from_single_dict({
        "dummy_tensor": torch.zeros(len(tasks), 1, dtype=torch.uint8),  # RLHFDataset's row layout
        "index": np.arange(len(tasks)),
        "tools_kwargs": np.array([{} for _ in tasks], dtype=object),
        "interaction_kwargs": np.array([{} for _ in tasks], dtype=object),
        "data_source": np.array(["lightning"] * len(tasks), dtype=object),
        "extra_info": np.array([{VA.TASK_KEY: json.dumps(t), "index": i} for i, t in enumerate(tasks)], dtype=object),
        "raw_prompt": np.array([[{"role": "user", "content": t["id"]}] for t in tasks], dtype=object),
    })
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    gen_batch = get_gen_batch(batch)
    gen_batch.meta_info["global_steps"] = 7
    gen_out = manager.generate_sequences(gen_batch.repeat(repeat_times=n, interleave=True))
    out["rollout_calls"] = seen
    out["timing_keys"] = sorted(gen_out.meta_info["timing"])
    batch = batch.repeat(repeat_times=n, interleave=True).union(gen_out)  # fails on any row/key mismatch
    batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
    _ = [m for m in batch.non_tensor_batch["multi_modal_inputs"]]
    reward, _extra = extract_reward(batch)
    apply_bypass_mode(batch=batch, rollout_corr_config=cfg.algorithm.rollout_correction,
                      policy_loss_config=cfg.actor_rollout_ref.actor.policy_loss)
    batch.batch["token_level_scores"] = reward
    batch.batch["token_level_rewards"] = reward
    adv_fn = core_algos.get_adv_estimator_fn(cfg.algorithm.adv_estimator)  # compute_advantage, registry branch
    adv, ret = adv_fn(token_level_rewards=batch.batch["token_level_rewards"],
                      response_mask=batch.batch["response_mask"],
                      config=cfg.algorithm, index=batch.non_tensor_batch["uid"])
    batch.batch["advantages"], batch.batch["returns"] = adv, ret

    # 3. what the actor would consume, per row
    b = batch.batch
    sid = list(batch.non_tensor_batch["lightning_sample_id"])
    rows = {r["sample_id"]: r for r in table.to_pylist()}
    ref, _, ref_meta = VB.samples_to_tensors(table)  # unpadded reference layout
    ref_idx = {s: i for i, s in enumerate(table.column("sample_id").to_pylist())}
    exact = True
    for i, s in enumerate(sid):
        if not s:  # padding row
            exact &= int(b["response_mask"][i].sum()) == 0 and float(b["advantages"][i].abs().sum()) == 0.0
            exact &= int(b["attention_mask"][i].sum()) == 1
            continue
        r, j = rows[s], ref_idx[s]
        p, resp, L = r["prompt_token_ids"], r["response_token_ids"], len(r["response_token_ids"])
        exact &= b["prompts"][i, P - len(p):].tolist() == p and b["prompts"][i, : P - len(p)].eq(0).all().item()
        exact &= b["responses"][i, :L].tolist() == resp and b["responses"][i, L:].eq(0).all().item()
        exact &= b["response_mask"][i, :L].tolist() == r["response_mask"] and int(b["response_mask"][i, L:].sum()) == 0
        exact &= int(b["attention_mask"][i].sum()) == len(p) + L
        exact &= int(b["position_ids"][i, P - len(p)]) == 0 and int(b["position_ids"][i, P + L - 1]) == len(p) + L - 1
        exact &= torch.equal(b["old_log_probs"][i, :L], ref["old_log_probs"][j, :L])
        exact &= torch.equal(b["advantages"][i, :L], ref["advantages"][j, :L])
    out["rows"] = len(batch)
    out["samples"] = int(gen_out.meta_info["lightning_samples"])
    out["shapes"] = {k: list(b[k].shape) for k in ("prompts", "responses", "input_ids", "response_mask", "advantages")}
    out["exact"] = bool(exact)
    out["loss_mode_after_bypass"] = cfg.actor_rollout_ref.actor.policy_loss.loss_mode

    # 4. the loss the actor computes on this batch (bypass_mode, PPO-clip, token-mean) vs update.py
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    mask = b["response_mask"]
    torch.manual_seed(0)
    new = (b["old_log_probs"] + 0.3 * torch.randn(mask.shape)).requires_grad_(True)
    loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    theirs, _m = loss_fn(old_log_prob=b["old_log_probs"], log_prob=new, advantages=b["advantages"],
                         response_mask=mask, loss_agg_mode=actor.loss_agg_mode, config=actor)
    g_theirs, = torch.autograd.grad(theirs, new)
    keep = [i for i, s in enumerate(sid) if s]
    adv_rows = torch.tensor([rows[sid[i]]["advantage"] for i in keep])
    ucfg = UpdateConfig(clip_low=actor.clip_ratio_low, clip_high=actor.clip_ratio_high, tis_cap=rc.update.tis_cap)
    old_k, new_k, mask_k = b["old_log_probs"][keep], new[keep], mask[keep].float()
    tok, _ = ppo_token_loss(new_k, old_k, old_k, adv_rows, ucfg)  # prox = behaviour: one step per batch
    w = torch.tensor([rows[sid[i]]["loss_weight"] for i in keep])[:, None] * mask_k
    ours = aggregate_loss(tok, mask_k, w, ref_meta["lightning_units"], "rollout")
    g_ours_k, = torch.autograd.grad(ours, new)
    out["loss_verl"], out["loss_ours"] = theirs.item(), ours.item()
    out["grad_max"] = float(g_ours_k.abs().max())
    out["grad_maxdiff"] = float((g_theirs - g_ours_k).abs().max())
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])))
