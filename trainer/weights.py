"""Loss weights per sample, and the one loss aggregation that is exact under any micro-batching.

Three modes; each fixes a per-token weight ``w`` (stored per sample in ``samples.loss_weight``,
applied to every model token of the sample) and a unit count ``N`` of the whole mini-batch:

=============  =====================================  ==========================  ===================
mode           weight of a model token of sample s    N (units)                   verl equivalent
=============  =====================================  ==========================  ===================
``rollout``    1 / (model tokens of s's rollout)      rollouts (with >0 tokens)   seq-mean-token-mean
                                                                                  over whole rollouts
``token-mean`` 1                                      model tokens                token-mean
``seq-mean``   1 / (model tokens of s)                samples (with >0 tokens)    seq-mean-token-mean
=============  =====================================  ==========================  ===================

loss = sum over tokens of ``token_loss * mask * w`` / N.

Why rollout mode: a harness may turn one rollout into 1 or 10 samples (broken histories); with
seq-mean the 10-sample rollout would weigh 10 times more, with token-mean the longer one would.
In rollout mode the weights of a rollout's model tokens sum to 1, so every rollout counts once;
it equals verl's ``seq-mean-token-mean`` applied to a rollout's samples concatenated into one row.

Exactness under micro-batching: ``w`` and ``N`` are computed once for the mini-batch, before it is
split, so ``aggregate_loss`` is a plain weighted sum divided by a constant: the sum of its values
over any split into micro-batches equals its value on the whole mini-batch (up to float summation
order), and so do the accumulated gradients. Call ``backward()`` on each micro-batch's result as is,
with no rescaling by the number of micro-batches.
"""

from __future__ import annotations

import numpy as np

MODES = ("rollout", "token-mean", "seq-mean")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown weight mode {mode!r}; choose from {MODES}")


def rollout_key(rollout_id: str, attempt: int | None) -> str:
    """The unit per-rollout weights count: one attempt of one rollout, ``<rollout_id>~<attempt>``
    (a missing attempt is attempt 0, as the trace views read it)."""
    return f"{rollout_id}~{attempt or 0}"


def rollout_index(keys) -> np.ndarray:
    """Each sample's rollout as an integer 0..R-1 (first seen, first numbered), from its rollout key."""
    index: dict[str, int] = {}
    return np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)


def loss_weights(rollout_index: np.ndarray, model_tokens: np.ndarray, mode: str = "rollout") -> np.ndarray:
    """Per-sample weight of each of its model tokens (float32).

    ``rollout_index``: for each sample, an integer id of its rollout (0..R-1, any order);
    ``model_tokens``: for each sample, the number of tokens with mask 1. Samples without model
    tokens get weight 0.
    """
    _check_mode(mode)
    t = np.asarray(model_tokens, dtype=np.float64)
    if mode == "token-mean":
        return np.where(t > 0, 1.0, 0.0).astype(np.float32)
    denom = t if mode == "seq-mean" else _rollout_tokens(rollout_index, t)[rollout_index]
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(denom > 0, 1.0 / np.where(denom > 0, denom, 1.0), 0.0)
    return w.astype(np.float32)


def n_units(rollout_index: np.ndarray, model_tokens: np.ndarray, mode: str = "rollout") -> int:
    """The divisor ``N`` of a mini-batch made of these samples (compute it before micro-batching)."""
    _check_mode(mode)
    t = np.asarray(model_tokens, dtype=np.int64)
    if mode == "token-mean":
        return int(t.sum())
    if mode == "seq-mean":
        return int((t > 0).sum())
    return int((_rollout_tokens(rollout_index, t) > 0).sum())


def _rollout_tokens(rollout_index: np.ndarray, model_tokens: np.ndarray) -> np.ndarray:
    """Model tokens per rollout (indexed by rollout)."""
    ri = np.asarray(rollout_index, dtype=np.int64)
    return np.bincount(ri, weights=model_tokens) if len(ri) else np.zeros(0)


def aggregate_loss(token_loss, mask, token_weight, n_units, mode: str = "rollout"):
    """Scalar loss of one micro-batch: ``sum(token_loss * mask * w) / n_units`` (torch).

    Stable signature (the update step relies on it):

    * ``token_loss``: float tensor ``(B, T)``, per-token loss (e.g. clipped PPO term).
    * ``mask``: ``(B, T)``, 1 for trained (model) tokens, 0 for prompt, inserted context, padding.
    * ``token_weight``: ``(B,)`` per-sample weight (``samples.loss_weight``) or ``(B, T)`` per
      token; ignored (taken as 1) in ``token-mean`` mode, may then be ``None``.
    * ``n_units``: the mini-batch's unit count from ``n_units(...)`` (int or 0-d tensor), the SAME
      number for every micro-batch of the mini-batch.
    * ``mode``: ``rollout`` | ``token-mean`` | ``seq-mean``.

    Exact under any micro-batching (module doc)."""
    import torch

    _check_mode(mode)
    w = mask.to(token_loss.dtype)
    if mode != "token-mean":
        if token_weight is None:
            raise ValueError(f"mode {mode!r} needs token_weight (samples.loss_weight)")
        tw = torch.as_tensor(token_weight, dtype=token_loss.dtype, device=token_loss.device)
        w = w * (tw.unsqueeze(-1) if tw.dim() == 1 else tw)
    denom = torch.as_tensor(n_units, dtype=token_loss.dtype, device=token_loss.device)
    if float(denom) <= 0:
        raise ValueError("n_units must be positive (no trainable token in the mini-batch?)")
    return (token_loss * w).sum() / denom
