"""Parity of our advantages and loss aggregation with verl's, on random batches.

Runs in the verl environment (``.venv-verl``: verl 0.9.1, torch, numpy; our package installed
without its dependencies). It imports only ``lightning_harness.trainer.advantages`` and
``.weights`` (numpy / lazy torch), never DuckDB.

Checks, for ``--batches`` random batches (groups of varied size incl. singletons and groups with
equal rewards; responses of varied length):

* ``group_advantages(grpo)`` == ``compute_grpo_outcome_advantage`` (with and without std norm)
* ``group_advantages(rloo)`` == ``compute_rloo_outcome_advantage``
* ``aggregate_loss(token-mean)`` == ``agg_loss(token-mean)``
* ``aggregate_loss(seq-mean)`` == ``agg_loss(seq-mean-token-mean)``, whole batch and summed over
  random micro-batch splits
* ``aggregate_loss(rollout)`` on samples == ``agg_loss(seq-mean-token-mean)`` on rows that
  concatenate each rollout's samples: rollout mode is verl's sequence mean with a rollout as the
  sequence.

Prints one JSON line ``{"ok": bool, "max_abs_diff": {...}, ...}``; exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from verl.trainer.ppo.core_algos import agg_loss, compute_grpo_outcome_advantage, compute_rloo_outcome_advantage

from lightning_harness.trainer.advantages import group_advantages
from lightning_harness.trainer.weights import aggregate_loss, loss_weights, n_units


def random_groups(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    sizes = rng.integers(1, 9, rng.integers(2, 12))
    index = np.concatenate([np.full(s, f"task{g}") for g, s in enumerate(sizes)])
    rewards = rng.choice([0.0, 0.25, 0.5, 1.0], len(index)) if rng.random() < 0.5 else rng.normal(size=len(index))
    if len(sizes) > 1:  # make one group's rewards all equal
        rewards[index == "task1"] = 0.75
    return rewards.astype(np.float32), index


def check_advantages(rng, diffs):
    rewards, index = random_groups(rng)
    B, T = len(rewards), int(rng.integers(3, 40))
    lens = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None, :] < lens[:, None]).astype(np.float32)
    tlr = np.zeros((B, T), np.float32)
    tlr[np.arange(B), lens - 1] = rewards  # outcome reward on the last response token
    for norm in (True, False):
        v, _ = compute_grpo_outcome_advantage(torch.tensor(tlr), torch.tensor(mask), index,
                                              norm_adv_by_std_in_grpo=norm)
        ours, _ = group_advantages(rewards.astype(np.float64), index, method="grpo", norm_by_std=norm)
        key = "grpo" if norm else "grpo_no_std"
        diffs[key] = max(diffs.get(key, 0.0), float(np.abs(v.numpy() - ours[:, None] * mask).max()))
    v, _ = compute_rloo_outcome_advantage(torch.tensor(tlr), torch.tensor(mask), index)
    ours, _ = group_advantages(rewards.astype(np.float64), index, method="rloo")
    diffs["rloo"] = max(diffs.get("rloo", 0.0), float(np.abs(v.numpy() - ours[:, None] * mask).max()))


def _splits(rng, n):
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 4))),
                              replace=False)) if n > 1 else []
    return np.split(rng.permutation(n), cuts)


def check_aggregation(rng, diffs):
    # samples belonging to rollouts (1-3 samples each), per-token losses and masks
    n_roll = int(rng.integers(2, 10))
    per = rng.integers(1, 4, n_roll)
    rid = np.repeat(np.arange(n_roll), per)
    S, T = len(rid), int(rng.integers(4, 30))
    lens = rng.integers(1, T + 1, S)
    mask = (np.arange(T)[None, :] < lens[:, None]) & (rng.random((S, T)) < 0.8)
    mask[np.arange(S), 0] = True  # every sample has a model token
    loss = torch.tensor(rng.normal(size=(S, T)), dtype=torch.float64)
    M = torch.tensor(mask.astype(np.float64))
    tokens = mask.sum(1)

    for ours_mode, verl_mode in (("token-mean", "token-mean"), ("seq-mean", "seq-mean-token-mean")):
        w = torch.tensor(loss_weights(rid, tokens, ours_mode), dtype=torch.float64)
        n = n_units(rid, tokens, ours_mode)
        ref = agg_loss(loss, M, verl_mode)
        full = aggregate_loss(loss, M, w, n, ours_mode)
        split = sum(aggregate_loss(loss[p], M[p], w[p], n, ours_mode) for p in _splits(rng, S))
        for key, val in ((ours_mode, full), (ours_mode + "_microbatched", split)):
            diffs[key] = max(diffs.get(key, 0.0), abs(float(val) - float(ref)))

    # rollout mode vs verl seq-mean-token-mean over rollout-concatenated rows
    w = torch.tensor(loss_weights(rid, tokens, "rollout"), dtype=torch.float64)
    ours = aggregate_loss(loss, M, w, n_units(rid, tokens, "rollout"), "rollout")
    split = sum(aggregate_loss(loss[p], M[p], w[p], n_units(rid, tokens, "rollout"), "rollout")
                for p in _splits(rng, S))
    L = max(int(mask[rid == r].size) for r in range(n_roll))
    cat_loss = torch.zeros((n_roll, L), dtype=torch.float64)
    cat_mask = torch.zeros((n_roll, L), dtype=torch.float64)
    for r in range(n_roll):  # building the reference layout; the code under test is vectorised
        rows = np.flatnonzero(rid == r)
        cat_loss[r, : len(rows) * T] = loss[rows].reshape(-1)
        cat_mask[r, : len(rows) * T] = M[rows].reshape(-1)
    ref = agg_loss(cat_loss, cat_mask, "seq-mean-token-mean")
    diffs["rollout"] = max(diffs.get("rollout", 0.0), abs(float(ours) - float(ref)))
    diffs["rollout_microbatched"] = max(diffs.get("rollout_microbatched", 0.0), abs(float(split) - float(ref)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--atol", type=float, default=1e-5)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    diffs: dict[str, float] = {}
    for _ in range(args.batches):
        check_advantages(rng, diffs)
        check_aggregation(rng, diffs)
    ok = all(v <= args.atol for v in diffs.values())
    print(json.dumps({"ok": ok, "batches": args.batches, "atol": args.atol, "max_abs_diff": diffs}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
