"""The policy update, readable top to bottom: samples table -> clipped PPO/GRPO step -> new weights.

One file on purpose (nanoGPT style): everything that touches the gradient is here, in the order it
happens, and nothing else (checkpoint files: checkpoint.py; the ``step`` command: cli.py; the model
version: the caller's, since only the loop knows what a step is).

    samples (Parquet, schemas.SAMPLES)                    one row = prompt + response of a rollout
      -> batches        prompt+response ids, response mask, behaviour logprobs, advantage, loss weight
      -> logprobs       new logprobs of the response tokens under the current policy
                        (LM head in chunks over the response positions: no [B, R, V] tensor)
      -> loss           decoupled PPO:  r = pi / pi_prox (clipped), w = min(pi_prox / mu, tis_cap)
                        token_loss = max(-A r, -A clip(r)) * w  (+ kl_coef * k3(pi, pi_ref))
      -> aggregate      weights.aggregate_loss: per-rollout weights (each rollout counts once) or
                        token-mean; the sum over micro-batches equals the full-batch loss exactly
      -> AdamW step     gradient clipping, one or more optimizer steps per update

Symbols. ``mu`` = behaviour policy: the logprobs vLLM returned when the rollout ran (captured by the
proxy, possibly several versions old in async mode). ``pi_prox`` = the policy at the start of this
update ("proximal" policy of decoupled PPO). ``pi`` = the policy being optimised. With a single
optimizer step per update ``pi_prox == pi`` numerically, so we take it from the same forward pass
(detached) instead of paying for a second one. The truncated importance weight ``min(pi_prox/mu, C)``
corrects for stale or engine-mismatched samples without letting one token dominate.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..launcher.engine import detect_device
from . import checkpoint as ckpt
from .config import UpdateConfig
from .weights import aggregate_loss, loss_weights, rollout_index, rollout_key
from .weights import n_units as count_units

# -- 1. Configuration ------------------------------------------------------------------------------
# UpdateConfig (every knob of an update: lr, clip range, TIS cap, KL, micro-batch size, loss mode...)
# lives in config.py beside the rest of the run's configuration, so reading a config needs no torch.


def scheduled_lr(cfg: UpdateConfig, step: int, total: int) -> float:
    """The learning rate of update ``step`` (1-based) of ``total``: constant, or decayed linearly or
    along a half cosine from ``lr`` at the first update to ``lr * lr_final_ratio`` at the last."""
    if cfg.lr_schedule == "constant" or total <= 1:
        return cfg.lr
    frac = min(max((step - 1) / (total - 1), 0.0), 1.0)
    low = cfg.lr * cfg.lr_final_ratio
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - low) * frac
    return low + (cfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * frac))


# -- 2. Samples -> padded batches ------------------------------------------------------------------
REQUIRED_COLUMNS = ("rollout_id", "prompt_token_ids", "response_token_ids", "response_mask",
                    "response_logprobs", "advantage", "loss_weight")


@dataclass
class Sample:
    """One row of the samples table, as Python lists (cheap at the sizes one update sees)."""

    rollout_id: str  # weights.rollout_key: "<rollout_id>~<attempt>", the unit per-rollout weights count
    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    advantage: float
    loss_weight: float


def table_to_samples(table: pa.Table, max_seq_len: int | None,
                     loss_mode: str | None = None) -> tuple[list[Sample], dict[str, int]]:
    """Validate and unpack a samples table; bad rows raise a clear error (nothing silently dropped).
    Responses longer than ``max_seq_len`` minus their prompt are cut (``None``: no limit); the cut
    tokens' share of the loss weight goes with them unless ``loss_mode`` is given, which re-derives
    the weights of the kept tokens so that each rollout (``seq-mean``: sample) still counts once.
    A prompt that fills ``max_seq_len`` by itself leaves no response token (counted in
    ``prompt_too_long``): a sample, not the update, is lost, and its rollout's other samples carry
    its weight. (A conversation that outgrew the window and broke the merge starts such a sample.)"""
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"samples table lacks columns {missing} (expected schemas.SAMPLES)")
    cols = {c: table.column(c).to_pylist() for c in REQUIRED_COLUMNS}
    attempts = table.column("attempt").to_pylist() if "attempt" in table.column_names else [0] * table.num_rows
    out, truncated, too_long = [], 0, 0
    for i in range(table.num_rows):
        prompt, resp = cols["prompt_token_ids"][i] or [], cols["response_token_ids"][i] or []
        mask, lps = cols["response_mask"][i] or [], cols["response_logprobs"][i] or []
        rid = rollout_key(cols["rollout_id"][i], attempts[i])
        if not prompt:
            raise ValueError(f"sample {i} (rollout {rid}): empty prompt_token_ids")
        if not (len(resp) == len(mask) == len(lps)):
            raise ValueError(
                f"sample {i} (rollout {rid}): response_token_ids/mask/logprobs lengths differ "
                f"({len(resp)}/{len(mask)}/{len(lps)})"
            )
        adv, w = cols["advantage"][i], cols["loss_weight"][i]
        if adv is None or w is None or not math.isfinite(adv) or not math.isfinite(w):
            raise ValueError(f"sample {i} (rollout {rid}): advantage/loss_weight missing or not finite")
        room = len(resp) if max_seq_len is None else max(max_seq_len - len(prompt), 0)
        too_long += max_seq_len is not None and len(prompt) >= max_seq_len
        if len(resp) > room:
            resp, mask, lps, truncated = resp[:room], mask[:room], lps[:room], truncated + 1
        out.append(Sample(rid, list(prompt), list(resp), [int(m) for m in mask],
                          [float("nan") if x is None else float(x) for x in lps], float(adv), float(w)))
    if truncated and loss_mode is not None:
        reweigh(out, loss_mode)
    return out, {"truncated": truncated, "prompt_too_long": too_long}


def reweigh(samples: list[Sample], mode: str) -> None:
    """Re-derive each sample's loss weight from the model tokens its mask keeps now (after tokens
    left it: a cut response, tokens verl cannot weigh), so every rollout (``seq-mean``: sample)
    still counts once."""
    kept = np.array([sum(s.mask) for s in samples])
    for s, w in zip(samples, loss_weights(rollout_index([s.rollout_id for s in samples]), kept, mode)):
        s.loss_weight = float(w)


def padded(rows: list, width: int, dtype: torch.dtype, fill: float = 0, *, left: bool = False,
           device: torch.device | None = None) -> torch.Tensor:
    """``rows`` (lists or 1-d tensors) as one [len(rows), width] tensor, each row at the left
    (right-padded) or, with ``left``, at the right (left-padded, as verl lays out prompts)."""
    out = torch.full((len(rows), width), fill, dtype=dtype, device=device)
    for b, row in enumerate(rows):
        if len(row):
            target = out[b, width - len(row):] if left else out[b, : len(row)]
            target.copy_(torch.as_tensor(row, dtype=dtype))
    return out


def lengths_mask(lengths: list[int], width: int) -> torch.Tensor:
    """[B, width] bool: True at positions j < lengths[b]."""
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


@dataclass
class Batch:
    """Padded tensors of a micro-batch. Response-aligned tensors are [B, R] (R = longest response)."""

    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, R] index t of the logit that predicts response token j (t = |p| - 1 + j)
    targets: torch.Tensor  # [B, R] response token ids
    mask: torch.Tensor  # [B, R] 1.0 = model token we train on
    behaviour_logprobs: torch.Tensor  # [B, R] mu, captured by the proxy (NaN where none was captured)
    advantages: torch.Tensor  # [B] rollout-level advantage
    token_weight: torch.Tensor  # [B, R] per-token loss weight (the sample's loss_weight, on masked tokens)
    valid: torch.Tensor  # [B, R] bool: j < the sample's response length (False on padding)


def collate(samples: list[Sample], device: torch.device, pad_id: int = 0) -> Batch:
    """One micro-batch on ``device``: prompt+response right-padded with ``pad_id``, [B, R] response views."""
    full = [s.prompt + s.response for s in samples]
    L = max(len(f) for f in full)
    R = max(max(len(s.response) for s in samples), 1)
    n_resp = [len(s.response) for s in samples]
    mask = padded([s.mask for s in samples], R, torch.float32)
    batch = Batch(
        input_ids=padded(full, L, torch.long, pad_id),
        attention_mask=lengths_mask([len(f) for f in full], L).long(),
        positions=padded([list(range(len(s.prompt) - 1, len(s.prompt) - 1 + len(s.response))) for s in samples],
                         R, torch.long),
        targets=padded([s.response for s in samples], R, torch.long),
        mask=mask,
        behaviour_logprobs=padded([s.logprobs for s in samples], R, torch.float32),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        token_weight=torch.tensor([s.loss_weight for s in samples], dtype=torch.float32).unsqueeze(-1) * mask,
        valid=lengths_mask(n_resp, R),
    )
    return Batch(**{k: v.to(device) for k, v in vars(batch).items()})


# -- 3. Logprobs and the loss ----------------------------------------------------------------------
# Why not ``model(...).logits``: that is a [B, L, V] tensor, and log-softmax over the response
# positions another [B, R, V] fp32 one; at a 150k vocabulary and 8-32k tokens, tens of GB. Instead the
# model body runs to hidden states, only the response positions go through the LM head, a chunk of
# ``chunk_tokens`` rows at a time, and each chunk's logits are reduced at once to
# (target logit - logsumexp) in fp32. Under autograd each chunk is checkpointed: the backward
# recomputes its logits instead of keeping them, so at most one chunk's [chunk, V] lives at a time.
def response_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0,
                      chunk_tokens: int = 1024) -> torch.Tensor:
    """log pi(response token j | prefix) for every response position: [B, R] fp32, 0 past a sample's
    response. ``chunk_tokens <= 0`` (or a head the chunked path cannot reproduce) takes the full
    logits; both give the same numbers (tested)."""
    if chunk_tokens <= 0 or not _plain_lm_head(model):
        return full_logits_logprobs(model, batch, temperature)
    body = model.base_model  # the decoder stack, final norm included; no KV cache in training
    hidden = body(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).last_hidden_state
    rows, cols = batch.valid.nonzero(as_tuple=True)  # response positions only, padding skipped
    h = hidden[rows, batch.positions[rows, cols]]  # [N, H]: the states that predict the response tokens
    targets = batch.targets[rows, cols]
    head = model.get_output_embeddings()
    pieces = []
    for s in range(0, h.shape[0], chunk_tokens):
        args = (h[s : s + chunk_tokens], targets[s : s + chunk_tokens], head.weight, head.bias, temperature)
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    lp = torch.cat(pieces) if pieces else h.new_zeros(0, dtype=torch.float32)
    return lp.new_zeros(batch.valid.shape).index_put((rows, cols), lp)


def _chunk_logprobs(h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """log_softmax(h W^T + b)[target] for one chunk of rows, reduced in fp32: [n]."""
    logits = F.linear(h, weight, bias).float()  # [n, V]
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _plain_lm_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly ``lm_head(base_model(...).last_hidden_state)`` (Llama, Qwen2,
    Mistral...): no logit soft-capping or scaling the chunked path would have to repeat."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    scaled = any(getattr(config, k, None) not in (None, 1, 1.0)
                 for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    return isinstance(head, torch.nn.Linear) and getattr(model, "base_model", model) is not model and not scaled


def full_logits_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """The plain path (and the reference of the chunked one): full logits, gather, log-softmax."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits  # [B, L, V]
    V = logits.shape[-1]
    picked = logits.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, V)).float()  # [B, R, V]
    if temperature != 1.0:
        picked = picked / temperature
    lp = torch.log_softmax(picked, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.valid, lp, 0.0)  # 0 past a sample's response, as the chunked path


def ppo_token_loss(
    new_lp: torch.Tensor,
    prox_lp: torch.Tensor,
    behaviour_lp: torch.Tensor,
    advantages: torch.Tensor,
    cfg: UpdateConfig,
    ref_lp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token decoupled-PPO loss [B, R] and per-token diagnostics (all detached except the loss)."""
    A = advantages.unsqueeze(-1)  # [B, 1]: the rollout's advantage on every token
    ratio = torch.exp(new_lp - prox_lp)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(-A * ratio, -A * clipped)
    # Truncated importance weight corrects mu (engine, maybe stale) -> pi_prox; never differentiated.
    # Tokens without a captured logprob (NaN: ids rebuilt by the tokenizer) get weight 1.
    behaviour_lp = torch.where(torch.isnan(behaviour_lp), prox_lp.detach(), behaviour_lp)
    log_w = (prox_lp - behaviour_lp).detach()
    w = torch.exp(log_w)
    if cfg.tis_cap > 0:
        w = torch.clamp(w, max=cfg.tis_cap)
    loss = pg * w
    diag = {
        "clipped": ((-A * clipped) > (-A * ratio)).float().detach(),
        "tis": w.detach(),
        "tis_capped": (torch.exp(log_w) > cfg.tis_cap).float() if cfg.tis_cap > 0 else torch.zeros_like(w),
        "mismatch": (prox_lp - behaviour_lp).abs().detach(),
    }
    if ref_lp is not None and cfg.kl_coef > 0:
        # k3 estimator of KL(pi || ref): exp(d) - d - 1 >= 0, unbiased, low variance; clamped as verl's
        # low_var_kl clamps it: at a context token the policy learned to avoid (the harness wrote it,
        # mask 0) exp(d) overflowed, and inf * 0 made the whole mini-batch's loss NaN
        d = torch.clamp(ref_lp - new_lp, -20.0, 20.0)
        kl = torch.clamp(torch.exp(d) - d - 1.0, max=10.0)
        loss = loss + cfg.kl_coef * kl
        diag["kl"] = kl.detach()
    return loss, diag


# -- 4. The updater: model + optimizer kept in memory across steps ---------------------------------
def _split_by_rollout(samples: list[Sample], parts: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffle rollouts and deal them into ``parts`` groups of sample positions; a rollout's samples
    stay together."""
    by_rollout: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_rollout.setdefault(s.rollout_id, []).append(i)
    keys = list(by_rollout)
    order = torch.randperm(len(keys), generator=gen).tolist()
    parts = max(1, min(parts, len(keys)))
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i, k in enumerate(order):
        groups[i % parts].extend(by_rollout[keys[k]])
    return groups


def _units(samples: list[Sample], mode: str) -> int:
    """The divisor aggregate_loss uses, counted once over the whole mini-batch (weights.n_units):
    rollouts (rollout mode), model tokens (token-mean) or samples (seq-mean)."""
    return count_units(rollout_index([s.rollout_id for s in samples]), [sum(s.mask) for s in samples], mode)


class PolicyUpdater:
    """Holds the policy, the optional frozen reference and AdamW between steps; the loop calls
    ``update`` then ``save`` once per training step."""

    def __init__(self, model_dir: str | os.PathLike, cfg: UpdateConfig | None = None,
                 *, reference_dir: str | os.PathLike | None = None, load_optimizer: bool = True,
                 model: torch.nn.Module | None = None) -> None:
        """``model``: an already built policy on the configured device (benchmarks build one from a
        config with random weights); ``model_dir`` then only names where checkpoints come from."""
        self.cfg = cfg or UpdateConfig()
        self.model_dir = Path(model_dir)
        self.device = torch.device(detect_device() if self.cfg.device == "auto" else self.cfg.device)
        torch.manual_seed(self.cfg.seed)
        # the updates this policy has had (a checkpoint's step): each update's mini-batch shuffle is
        # seeded by it, so a run resumed from a checkpoint deals its next step as an unbroken run would
        version = ckpt.read_version(self.model_dir)
        self.updates_done = int(version.get("step") or 0)
        self.model = model if model is not None else ckpt.load_model(self.model_dir, self.device, self.cfg.dtype)
        if self.cfg.gradient_checkpointing:  # the body's activations are recomputed in the backward
            self.model.gradient_checkpointing_enable()
        # bf16 autocast: the GPU default (fp32 master weights, bf16 matmuls); off on CPU unless asked.
        self.autocast = self.cfg.autocast == "bfloat16" or (self.cfg.autocast == "auto" and self.device.type == "cuda")
        self.model.train()
        self.base_dir = Path(version.get("base_model", self.model_dir))
        self.ref = None
        if self.cfg.kl_coef > 0:  # frozen: eval mode, no gradients
            self.ref = ckpt.load_model(reference_dir or self.base_dir, self.device, self.cfg.dtype).eval()
            self.ref.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.eps,
            weight_decay=self.cfg.weight_decay,
        )
        if load_optimizer and ckpt.load_optimizer_state(self.optimizer, self.model_dir, self.device):
            for group in self.optimizer.param_groups:  # the saved state carries the old settings; the config's win
                group.update(lr=self.cfg.lr, betas=tuple(self.cfg.betas), eps=self.cfg.eps,
                             weight_decay=self.cfg.weight_decay)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # -- one update ------------------------------------------------------------------------
    def update(self, samples: pa.Table | list[Sample]) -> dict[str, float]:
        """One policy update on a samples table; returns scalar metrics (no checkpoint written, no
        model version: the caller counts versions)."""
        cfg, t0 = self.cfg, time.monotonic()
        shuffle = torch.Generator().manual_seed(hash((cfg.seed, self.updates_done)) & (2**63 - 1))
        self.updates_done += 1
        if isinstance(samples, pa.Table):
            rows, info = table_to_samples(samples, cfg.max_seq_len, cfg.loss_mode)
        else:
            rows, info = list(samples), {"truncated": 0, "prompt_too_long": 0}
        n_in = len(rows)
        rows = [s for s in rows if sum(s.mask) > 0]
        # Samples with advantage 0 add nothing to the policy gradient: without a KL term, skip their
        # forward pass. They still count in the divisor N (a group with no signal dilutes, as in verl).
        skip_zero = cfg.skip_zero_advantage and not (cfg.kl_coef > 0)
        trains = [not skip_zero or s.advantage != 0.0 for s in rows]
        useful = [i for i, t in enumerate(trains) if t]  # positions in rows: the keys of prox and ref
        m: dict[str, float] = {"update/samples_in": n_in, "update/samples_used": len(useful),
                               "update/truncated": info["truncated"], "update/prompt_too_long": info["prompt_too_long"]}
        if not useful:
            m.update({"update/skipped": 1.0, "update/time_s": time.monotonic() - t0})
            return m
        # One optimizer step: pi_prox == pi, read it off the same forward pass. Several steps: pi_prox
        # is the policy before the first step, so compute it once, up front, without gradients.
        single = cfg.mini_batches == 1 and cfg.epochs == 1
        prox = None if single else self.frozen_logprobs(self.model, rows, useful)
        ref = self.frozen_logprobs(self.ref, rows, useful) if self.ref is not None else None
        sums: Counter[str] = Counter()
        n_steps, skipped, grad_norms = 0, 0, []
        for _epoch in range(cfg.epochs):
            for group in _split_by_rollout(rows, cfg.mini_batches, shuffle):
                n_units = _units([rows[i] for i in group], cfg.loss_mode)  # the whole mini-batch, before skipping
                group = [i for i in group if trains[i]]
                self.optimizer.zero_grad(set_to_none=True)
                if not group:
                    continue
                stats = self.accumulate_gradients([rows[i] for i in group], n_units=n_units,
                                                  prox=None if prox is None else [prox[i] for i in group],
                                                  ref=None if ref is None else [ref[i] for i in group])
                sums.update(stats)
                grad_norms.append(self._clip_and_step())
                n_steps += math.isfinite(grad_norms[-1])  # a non-finite gradient: no step was taken
                skipped += not math.isfinite(grad_norms[-1])
        tokens = max(sums.pop("tokens", 0.0), 1.0)
        m.update({f"update/{k}": v / tokens for k, v in sums.items() if k != "loss"})
        m.update({
            "update/loss": sums.get("loss", 0.0) / max(n_steps, 1),
            "update/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "update/optimizer_steps": n_steps,
            "update/skipped_nonfinite": skipped,
            "update/tokens": tokens / cfg.epochs,
            "update/rollouts": len({rows[i].rollout_id for i in useful}),
            "update/time_s": time.monotonic() - t0,
        })
        return m

    def accumulate_gradients(self, group: list[Sample], *, prox: list[torch.Tensor] | None = None,
                             ref: list[torch.Tensor] | None = None,
                             n_units: int | None = None) -> dict[str, float]:
        """Backward over micro-batches of ``group``; ``.grad`` ends up equal to the gradient of the
        group's aggregated loss whatever ``micro_batch_size`` is (aggregate_loss divides by the whole
        group's unit count, not the micro-batch's). ``prox``/``ref``: frozen logprobs of each sample
        of ``group``, in order (``frozen_logprobs``). Returns summed diagnostics."""
        cfg = self.cfg
        n_units = _units(group, cfg.loss_mode) if n_units is None else n_units
        stats = {"loss": 0.0, "tokens": 0.0, "clip_frac": 0.0, "tis_mean": 0.0, "tis_capped_frac": 0.0,
                 "mismatch_abs": 0.0, "kl": 0.0, "ratio_mean": 0.0}
        mbs = max(1, cfg.micro_batch_size)
        for start in range(0, len(group), mbs):
            batch = collate(group[start : start + mbs], self.device, self.pad_id)
            new_lp = self.logprobs(self.model, batch)
            R, dev = new_lp.shape[1], new_lp.device
            prox_lp = new_lp.detach()
            if prox is not None:
                prox_lp = padded(prox[start : start + mbs], R, torch.float32, device=dev)
            ref_lp = None if ref is None else padded(ref[start : start + mbs], R, torch.float32, device=dev)
            token_loss, diag = ppo_token_loss(new_lp, prox_lp, batch.behaviour_logprobs, batch.advantages, cfg, ref_lp)
            loss = aggregate_loss(token_loss, batch.mask, batch.token_weight, n_units, cfg.loss_mode)
            loss.backward()
            stats["loss"] += float(loss.detach())
            stats["tokens"] += float(batch.mask.sum())
            per_token = {"clip_frac": diag["clipped"], "tis_mean": diag["tis"], "tis_capped_frac": diag["tis_capped"],
                         "mismatch_abs": diag["mismatch"], "ratio_mean": torch.exp(new_lp.detach() - prox_lp),
                         "kl": diag.get("kl")}
            for k, v in per_token.items():  # token sums; update() divides by the tokens
                stats[k] += 0.0 if v is None else float((v * batch.mask).sum())
        return stats

    def logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """response_logprobs with this update's temperature, chunking and autocast: [B, R] fp32."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return response_logprobs(model, batch, self.cfg.temperature or 1.0, self.cfg.logprob_chunk_tokens)

    @torch.no_grad()
    def frozen_logprobs(self, model: torch.nn.Module, rows: list[Sample],
                        positions: list[int] | None = None) -> dict[int, torch.Tensor]:
        """Response logprobs under ``model`` without gradients (pi_prox before the first step, or the
        reference), keyed by position in ``rows`` (``positions``: only those; default all)."""
        positions = list(range(len(rows))) if positions is None else positions
        out: dict[int, torch.Tensor] = {}
        mbs = max(1, self.cfg.micro_batch_size)
        for start in range(0, len(positions), mbs):
            chunk = positions[start : start + mbs]
            lp = self.logprobs(model, collate([rows[i] for i in chunk], self.device, self.pad_id))
            for b, i in enumerate(chunk):
                out[i] = lp[b, : len(rows[i].response)]
        return out

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
        else:
            norm = float(torch.norm(torch.stack([p.grad.norm() for p in params])))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, out_dir: str | os.PathLike, *, model_version: int, step: int | None = None,
             save_optimizer: bool = True) -> Path:
        """HF checkpoint of the current policy (checkpoint.save_checkpoint), stamped with the caller's
        ``model_version``."""
        info = {"model_version": model_version, "step": step, "base_model": str(self.base_dir),
                "update": asdict(self.cfg)}
        out = ckpt.save_checkpoint(self.model, out_dir, source_dir=self.model_dir, version_info=info,
                                   optimizer=self.optimizer if save_optimizer else None)
        self.model_dir = out  # the next save copies the tokenizer from here: a resumed run's start is pruned
        return out
