"""Rollout-level advantages: one scalar per rollout, normalised within its group, numpy only.

Why rollout level: a harness turns one rollout into several model calls, hence possibly several
samples. Computing the advantage per sample would let a rollout with many samples count many times
in its group's statistics; here every rollout is one member of its group, and its advantage is then
broadcast to all of its samples (``broadcast``).

The estimators follow verl 0.9 exactly (checked by tests/test_verl_parity.py):

* ``grpo``: ``(r - mean) / (std + eps)``, ``std`` unbiased (``torch.std``), ``eps = 1e-6``; a group
  of one rollout uses mean 0 and std 1 (so its advantage is ``r / (1 + eps)``), as verl does.
  ``norm_by_std=False`` gives Dr. GRPO (``r - mean``).
* ``rloo``: ``n/(n-1) * (r - mean)`` = ``r - mean of the others``; a group of one keeps ``r``.

That rule is for a group of one by design (a group size of 1). A group the failure policy cut down
to one member has no baseline left: its survivor gets advantage 0 (``cut_to_one``), else its raw
reward (80, or a self-reported 1e15) would outweigh every normalised group of the step.

Failed, timed-out and reward-less rollouts never get a silent 0: ``apply_failure_policy`` decides
explicitly (drop them, keep failed ones that did report a reward, or give them a stated penalty
reward) and says how many it touched. An attempt that was retried never reaches it: its retry is
the rollout's member of the group (``samples._kept_rollouts``). A group whose members all got the same reward yields
advantage 0 for all of them: it carries no signal and is reported by ``group_advantages``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..schemas.states import ABORTED, CANCELLED, FAILED, TIMED_OUT

ESTIMATORS = ("grpo", "rloo")
FAILED_POLICIES = ("drop", "keep", "penalize")


@dataclass
class AdvantageReport:
    """What the group statistics looked like: what a user checks when learning stalls."""

    n_rollouts: int = 0
    n_groups: int = 0
    singleton_groups: int = 0
    equal_reward_groups: int = 0
    equal_reward_group_ids: list = field(default_factory=list)  # first 20, for display
    rollouts_in_equal_groups: int = 0


def group_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    *,
    method: str = "grpo",
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[np.ndarray, AdvantageReport]:
    """Advantage per rollout from its reward and group label (any hashable/np-sortable labels).

    Vectorised: groups via ``np.unique(return_inverse)``, sums via ``bincount``. Rewards must be
    finite; decide about missing rewards before (``apply_failure_policy``).
    """
    if method not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {method!r}; choose from {ESTIMATORS}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError("rewards must be one scalar per rollout")
    if len(group_ids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(group_ids)} group ids")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards contain NaN/inf: apply a failure policy before computing advantages")
    report = AdvantageReport(n_rollouts=len(r))
    if len(r) == 0:
        return np.zeros(0, dtype=np.float64), report
    labels = np.asarray(group_ids)
    if labels.dtype.kind == "U":  # numpy's fixed-width strings drop trailing NULs ("g" == "g\0"): keep str objects
        labels = np.asarray(list(group_ids), dtype=object)
    uniq, inv = np.unique(labels, return_inverse=True)
    inv = inv.reshape(-1)
    n = np.bincount(inv).astype(np.float64)
    single = n == 1
    gmax = np.full(len(uniq), -np.inf)
    gmin = np.full(len(uniq), np.inf)
    np.maximum.at(gmax, inv, r)
    np.minimum.at(gmin, inv, r)
    equal = (~single) & (gmax == gmin)
    # The statistics of r / s, s = a power of two at the group's largest |reward|: the same bits as
    # unscaled wherever those are finite, but no overflow in sums and squares of large rewards (a
    # self-reported 1e200 made the group's std inf and every advantage 0; 1e308 made them NaN).
    s = np.ldexp(1.0, np.frexp(np.maximum(np.abs(gmax), np.abs(gmin)))[1] - 1)
    rs = r / s[inv]
    mean = np.where(single, 0.0, np.bincount(inv, weights=rs) / n)  # a group of one: mean 0
    dev = rs - mean[inv]
    with np.errstate(invalid="ignore", divide="ignore"):
        std = np.sqrt(np.bincount(inv, weights=dev * dev) / (n - 1))  # unbiased, like torch.std

    with np.errstate(invalid="ignore", divide="ignore"):  # equal rewards and epsilon 0: 0/0, set below
        if method == "grpo" and norm_by_std:  # dev / (std + eps) in units of s; a group of one: std 1
            adv = dev / (np.where(single, 1.0 / s, std)[inv] + epsilon / s[inv])
        else:  # r - mean (rloo: times n / (n - 1)) back in reward units
            adv = dev * s[inv] * (np.where(single, 1.0, n / np.maximum(n - 1, 1))[inv] if method == "rloo" else 1.0)
    # Equal rewards: the exact answer is 0; float noise in the mean must not become a tiny signal.
    adv[equal[inv]] = 0.0

    report.n_groups = len(uniq)
    report.singleton_groups = int(single.sum())
    report.equal_reward_groups = int(equal.sum())
    report.equal_reward_group_ids = [str(g) for g in uniq[equal][:20]]
    report.rollouts_in_equal_groups = int(n[equal].sum())
    return adv, report


def cut_to_one(group_ids: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Over the kept rollouts: which one is the only member its group kept, of several selected."""
    labels = np.asarray(group_ids, dtype=object)
    _, inv, selected = np.unique(labels, return_inverse=True, return_counts=True)
    kept = np.bincount(inv.reshape(-1)[keep], minlength=len(selected))
    alone = (kept == 1) & (selected > 1)
    return alone[inv.reshape(-1)[keep]]


def apply_failure_policy(
    rewards: np.ndarray,
    states: np.ndarray,
    *,
    policy: str = "drop",
    failed_reward: float | None = None,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Decide which rollouts enter the advantage computation and with which reward.

    ``rewards``: float array with NaN for "no reward"; ``states``: launcher states (object array).
    Returns ``(keep_mask, effective_rewards, counts)``. "Failed" here is ``schemas.states.ABORTED``
    (cancelled counts: its harness did not run to its end either).

    * ``drop`` (default): failed / timed-out / cancelled rollouts and rollouts without a reward are
      left out (their samples are not trained on).
    * ``keep``: failed / timed-out rollouts that *did* report a reward keep it; reward-less ones
      are still dropped (there is nothing to train towards).
    * ``penalize``: every failed, timed-out, cancelled or reward-less rollout gets ``failed_reward``
      (required, explicit: never an implicit 0).
    """
    if policy not in FAILED_POLICIES:
        raise ValueError(f"unknown failed policy {policy!r}; choose from {FAILED_POLICIES}")
    r = np.asarray(rewards, dtype=np.float64).copy()
    st = np.asarray(states, dtype=object)
    failed = np.isin(st, [s.value for s in ABORTED])
    missing = ~np.isfinite(r)
    counts = {state.value: int((st == state).sum()) for state in (FAILED, TIMED_OUT, CANCELLED)}
    counts["no_reward"] = int((missing & ~failed).sum())
    if policy == "drop":
        keep = ~failed & ~missing
    elif policy == "keep":
        keep = ~missing
    else:
        if failed_reward is None or not np.isfinite(failed_reward):
            raise ValueError("failed_policy='penalize' needs an explicit finite failed_reward")
        bad = failed | missing
        r[bad] = float(failed_reward)
        keep = np.ones(len(r), dtype=bool)
        counts["penalized"] = int(bad.sum())
    counts["dropped"] = int((~keep).sum())
    return keep, r, counts


def broadcast(values_per_rollout: np.ndarray, rollout_index_of_sample: np.ndarray) -> np.ndarray:
    """Give every sample the value of its rollout (``rollout_index_of_sample`` indexes rollouts)."""
    return np.asarray(values_per_rollout)[np.asarray(rollout_index_of_sample)]
