"""verl backend (optional extra): the same samples, advantages and loss weights driving verl's trainer.

Why: one machine trains with ``trainer/update.py``; a cluster trains with verl (FSDP/Megatron,
many GPUs). Both must optimise the same objective from the same ``samples`` table. verl is not a
dependency: this module imports it only inside the functions that need it, so it imports (and its
pure parts run) without verl installed.

How our objective maps onto verl's (exact, not approximate):

* verl's clipped PPO terms are positively homogeneous in the advantage (``max(-A r, -A clip(r))``
  and the dual-clip bound ``-A c`` scale with any positive factor), so a per-token loss weight can
  ride inside the advantage. We hand verl ``A' = A * w * T / N`` where ``w`` is the sample's
  ``loss_weight``, ``T`` the model tokens and ``N`` the units (rollouts, in rollout mode) of the
  global batch. verl's ``token-mean`` aggregation then computes ``sum(pg(A') ) / T``
  ``= sum(pg(A) * w) / N``: our ``weights.aggregate_loss``, whatever the micro-batching.
* ``lightning_rollout`` (registered policy loss) is verl's vanilla clipped loss with aggregation
  pinned to ``token-mean``, so a config that says otherwise cannot silently change the objective.
  With ``rollout_correction.bypass_mode`` verl swaps it for its ``bypass_mode`` loss (the same
  PPO-clip with old = rollout logprobs, under the configured ``loss_agg_mode``); the agent-loop
  manager (``verl_agent_loop.py``) therefore refuses any aggregation but ``token-mean``.
* ``lightning_precomputed`` (registered advantage estimator) passes our precomputed, folded
  advantages through verl's ``compute_advantage`` unchanged (they travel as
  ``token_level_rewards``).
* Behaviour policy: ``old_log_probs`` and ``rollout_log_probs`` are the logprobs the proxy captured
  (a model token without one leaves the loss: ``train_only_logged``). Known gap: with
  ``rollout_correction.loss_type=ppo_clip`` verl applies no importance weights (``tis_cap`` is
  unused) and clips ``pi / mu`` instead of weighting by ``min(pi / mu, tis_cap)`` as update.py
  does, so gradients differ wherever ``pi != mu``; ``loss_type=reinforce`` gives update.py's
  single-step gradient. The KL term is verl's token-mean, not weighted by rollout.

Keep one optimizer step per batch (``ppo_mini_batch_size = train_batch_size``, ``ppo_epochs=1``):
``T`` and ``N`` are totals of the batch verl optimises in one step. ``verl_overrides`` sets this.

What was run here (CPU): conversion to ``DataProto``, both registrations and a loss/gradient parity
check against ``update.py`` (tests/test_verl_backend.py, in ``.venv-verl``), and Hydra composition
of the overrides against verl's own ``ppo_trainer.yaml``. What was not run: verl's Ray/FSDP trainer
itself (it needs GPUs). Feeding our rollouts into it: ``verl_agent_loop.py``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

POLICY_LOSS = "lightning_rollout"
ADV_ESTIMATOR = "lightning_precomputed"


# -- samples -> padded tensors (torch + pyarrow only) -> DataProto ---------------------------------
def samples_to_tensors(table, *, pad_id: int = 0, weight_mode: str = "rollout") -> tuple[dict, dict, dict]:
    """``samples`` table -> (tensors, non_tensors, meta) in verl's layout.

    Prompts are left-padded to ``P``, responses right-padded to ``R``; ``input_ids`` is their
    concatenation, as verl's rollout produces. Response-aligned tensors are ``[B, R]``.
    """
    import numpy as np
    import torch

    from .update import lengths_mask, padded, table_to_samples
    from .weights import n_units, rollout_index

    rows, _ = table_to_samples(table, max_seq_len=None)  # the update's checks: same rows, same errors
    unlogged = train_only_logged(rows, weight_mode)
    B = len(rows)
    if B == 0:
        raise ValueError("no samples to convert")
    prompts, resps, masks, lps = ([getattr(s, k) for s in rows] for k in ("prompt", "response", "mask", "logprobs"))
    P = max(len(p) for p in prompts)
    R = max(max(len(r) for r in resps), 1)
    prompt_t = padded(prompts, P, torch.long, pad_id, left=True)
    prompt_att = lengths_mask([len(p) for p in prompts], P).flip(-1).long()
    resp_t = padded(resps, R, torch.long, pad_id)
    resp_att = lengths_mask([len(r) for r in resps], R).long()
    resp_mask = padded(masks, R, torch.float32)
    old = torch.nan_to_num(padded(lps, R, torch.float32), nan=0.0) * resp_mask
    # a per-sample value on each response token times its mask (x * 0 keeps x's sign on context tokens)
    tokw, adv = (padded([[x * m for m in mk] for x, mk in zip(values, masks)], R, torch.float32)
                 for values in ([s.loss_weight for s in rows], [s.advantage for s in rows]))
    # rollout identity -> the unit count of the whole batch (weights.n_units), model tokens T
    model_tokens = resp_mask.sum(-1).numpy().astype(np.int64)
    N = n_units(rollout_index([s.rollout_id for s in rows]), model_tokens, weight_mode)
    T = int(model_tokens.sum())
    if N <= 0 or T <= 0:
        raise ValueError("no model tokens in the batch")
    w = tokw if weight_mode != "token-mean" else resp_mask
    folded = adv * w * (T / N)
    attention = torch.cat([prompt_att, resp_att], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0)
    tensors = {
        "prompts": prompt_t,
        "responses": resp_t,
        "input_ids": torch.cat([prompt_t, resp_t], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": resp_mask,
        "old_log_probs": old,
        "rollout_log_probs": old.clone(),
        "advantages": folded,
        "returns": folded.clone(),
        "token_level_rewards": folded.clone(),  # lightning_precomputed passes these through
        "token_level_scores": folded.clone(),
        "loss_weights": w,  # unfolded per-token weight, for inspection
    }
    non_tensors = {
        "uid": np.array([str(g) for g in table.column("group_id").to_pylist()], dtype=object),
        "rollout_id": np.array(table.column("rollout_id").to_pylist(), dtype=object),
        "sample_id": np.array(table.column("sample_id").to_pylist(), dtype=object),
    }
    meta = {"lightning_units": int(N), "lightning_model_tokens": T, "lightning_weight_mode": weight_mode,
            "lightning_tokens_without_logprobs": unlogged, "global_token_num": attention.sum(-1).tolist()}
    return tensors, non_tensors, meta


def train_only_logged(rows: list, weight_mode: str) -> int:
    """Take model tokens without a captured logprob (NaN: retokenised calls, partial logprobs) or with
    an infinite one (-inf: probability 0 under the engine, an infinite ratio in verl, where update.py
    caps the weight) out of the loss, re-derive the loss weights over the tokens left, and return
    how many were taken.

    Why: verl's bypass mode uses the captured logprob as the behaviour policy ``mu``; written as 0
    it made ``pi / mu = pi``, a wrong importance ratio (update.py gives such a token weight 1, which
    verl cannot express). Re-deriving keeps every rollout counting once, as a cut response does."""
    from .update import reweigh

    taken = 0
    for s in rows:
        lost = [bool(m) and not math.isfinite(x) for m, x in zip(s.mask, s.logprobs)]
        if any(lost):
            taken += sum(lost)
            s.mask = [0 if gone else m for m, gone in zip(s.mask, lost)]
    if taken:
        reweigh(rows, weight_mode)
        log.warning("verl batch: %d model tokens without a captured logprob left the loss", taken)
    return taken


def samples_to_dataproto(table, **kw):
    """The samples table as a ``verl.DataProto`` (needs verl)."""
    from verl import DataProto

    tensors, non_tensors, meta = samples_to_tensors(table, **kw)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


# -- registrations inside verl ---------------------------------------------------------------------
def lightning_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                          config=None, rollout_is_weights=None):
    """verl's vanilla clipped PPO loss with ``token-mean`` aggregation (weights are folded in A')."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    return compute_policy_loss_vanilla(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                       response_mask=response_mask, loss_agg_mode="token-mean", config=config,
                                       rollout_is_weights=rollout_is_weights)


def lightning_precomputed_advantage(token_level_rewards, response_mask, config=None, index=None, **_: Any):
    """Advantages computed by ``trainer/samples.py`` (rollout-level, weights folded) pass through."""
    adv = token_level_rewards * response_mask
    return adv, adv


def register() -> None:
    """Register ``lightning_rollout`` (policy loss) and ``lightning_precomputed`` (advantage
    estimator) with verl; idempotent. Call it in the process that builds verl's trainer (e.g. from
    a custom ``main_ppo`` entry point or a Ray worker's init)."""
    from verl.trainer.ppo import core_algos

    if core_algos.POLICY_LOSS_REGISTRY.get(POLICY_LOSS) is not lightning_policy_loss:
        core_algos.register_policy_loss(POLICY_LOSS)(lightning_policy_loss)
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ADV_ESTIMATOR) is not lightning_precomputed_advantage:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(ADV_ESTIMATOR, None)
        core_algos.register_adv_est(ADV_ESTIMATOR)(lightning_precomputed_advantage)


# -- config composition for a multi-GPU run --------------------------------------------------------
def verl_overrides(cfg, *, model_path: str, train_batch_size: int, n_gpus_per_node: int = 8, nnodes: int = 1,
                   rollout_tp: int = 1, max_prompt_length: int = 2048, max_response_length: int = 2048,
                   micro_batch_size_per_gpu: int = 4) -> list[str]:
    """Hydra overrides for ``python -m verl.trainer.main_ppo`` equivalent to our ``RunConfig``
    (``cfg``: a ``trainer.config.RunConfig``; its ``update``, ``rollout`` and ``samples`` sections).
    A KL term needs ``samples.weight_mode: token-mean``: verl averages it over the batch's tokens,
    update.py weights it like the policy loss, so in another mode the two would train differently."""
    u = cfg.update
    if u.kl_coef > 0 and cfg.samples.weight_mode != "token-mean":
        raise ValueError(f"update.kl_coef > 0 with verl needs samples.weight_mode=token-mean (verl's KL term is a "
                         f"token mean; {cfg.samples.weight_mode!r} would weigh it otherwise than update.py does)")
    out = [
        f"actor_rollout_ref.model.path={model_path}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        f"algorithm.adv_estimator={ADV_ESTIMATOR}",
        "algorithm.use_kl_in_reward=false",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={POLICY_LOSS}",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={train_batch_size}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",  # memory only
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        f"actor_rollout_ref.actor.clip_ratio_low={u.clip_low}",
        f"actor_rollout_ref.actor.clip_ratio_high={u.clip_high}",
        f"actor_rollout_ref.actor.optim.lr={u.lr}",
        f"actor_rollout_ref.actor.optim.weight_decay={u.weight_decay}",
        f"actor_rollout_ref.actor.grad_clip={u.max_grad_norm if u.max_grad_norm > 0 else 1e9}",
        f"actor_rollout_ref.actor.use_kl_loss={'true' if u.kl_coef > 0 else 'false'}",
        f"actor_rollout_ref.actor.kl_loss_coef={u.kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",  # verl's name for the k3 estimator
        "actor_rollout_ref.actor.entropy_coeff=0",
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=ppo_clip",
        f"algorithm.rollout_correction.rollout_is={'token' if u.tis_cap > 0 else 'null'}",
        f"algorithm.rollout_correction.rollout_is_threshold={u.tis_cap if u.tis_cap > 0 else 2.0}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={cfg.rollout.group_size}",
        f"actor_rollout_ref.rollout.temperature={cfg.rollout.temperature}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"trainer.n_gpus_per_node={n_gpus_per_node}",
        f"trainer.nnodes={nnodes}",
        f"trainer.total_training_steps={cfg.steps}",
    ]
    return out


def compose_verl_config(overrides: list[str]):
    """verl's ``ppo_trainer`` config with ``overrides`` applied (Hydra; fails on unknown keys)."""
    import os

    import verl
    from hydra import compose, initialize_config_dir

    conf_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))
