"""verl glue: our harness rollouts, through our proxy, become the batch verl's PPO trainer updates on.

Why a custom *agent-loop manager* and not a per-sample ``AgentLoop``: verl calls an ``AgentLoop``
once per (prompt, sample) and expects one ``AgentLoopOutput`` back, but our advantages are
group-normalised over whole rollouts and one rollout may yield several samples (a harness that
rewrote its history). A manager sees the whole step at once: it runs the harness batch, builds the
``samples`` table with ``trainer/samples.py`` (the same code as a local run) and returns the
``DataProto`` verl's trainer would have received from its own agent loops.

Where it plugs in (verl 0.9.1, ``trainer.use_v1=false``: ``RayPPOTrainer.fit``; the v1 trainer
talks to its manager through TransferQueue instead and is not supported here)::

    gen_out = manager.generate_sequences(gen_batch)      # <- LightningAgentLoopManager
    batch = batch.repeat(n).union(gen_out)                # row counts must match
    reward = batch.batch["rm_scores"]                     # <- our folded advantages A' (per token)
    apply_bypass_mode(batch)                              # old_log_probs = rollout_log_probs
    compute_advantage(batch, "lightning_precomputed")     # passes A' through unchanged
    update_actor(batch)                                   # PPO-clip, token-mean over the batch

Row contract: verl hands ``train_batch_size * rollout.n`` rows and unions the answer row by row,
so the answer has exactly that many rows. We run ``lightning.group_size`` rollouts per distinct
task (``rollout.n = group_size * slots``); the samples fill the first rows and the rest are padding
rows (one attended pad token, no response token: zero loss, zero tokens, so ``T`` and ``N`` stay
those of the real samples). More samples than rows is a clear error (raise ``slots``).

Imports without verl; verl, Ray and the launcher are imported only where used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from .verl_backend import samples_to_tensors

MANAGER_FQN = "lightning_harness.trainer.verl_agent_loop.LightningAgentLoopManager"
TASK_KEY = "lightning_task"  # extra_info field of verl's dataset rows: our task as JSON

# +lightning.* keys: the launcher's, and the build_samples options passed through (any other is refused)
LAUNCH_KEYS = ("group_size", "harness", "traces", "run_id", "served_model", "concurrency", "timeout", "pad_id")
SAMPLE_KEYS = ("mode", "advantage", "weight_mode", "norm_by_std", "epsilon", "failed_policy", "failed_reward",
               "reward_clip", "group_by", "where", "tokenizer", "include_secret_spans", "drift_check",
               "max_samples_per_rollout")

# the response-aligned keys an agent-loop manager returns (verl's AgentLoopWorker._postprocess names)
OUTPUT_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
               "rollout_log_probs", "rm_scores")


# -- samples -> the rows verl's trainer unions with its prompt batch (torch + pyarrow only) --------
def pack_samples(table, rows: int, *, max_prompt_len: int, max_response_len: int, pad_id: int = 0,
                 weight_mode: str = "rollout") -> tuple[dict, dict, dict]:
    """``samples`` -> (tensors, non_tensors, meta) with exactly ``rows`` rows, prompts left-padded
    to ``max_prompt_len`` and responses right-padded to ``max_response_len`` (verl's fixed widths).

    ``rm_scores`` carries the folded advantages ``A * loss_weight * T / N`` (see verl_backend);
    ``rollout_log_probs`` the captured behaviour logprobs (0 on masked tokens)."""
    import numpy as np
    import torch

    S = table.num_rows
    if S > rows:
        raise ValueError(f"{S} samples do not fit the {rows} rows verl gave this step: raise "
                         f"actor_rollout_ref.rollout.n (slots per rollout) or lower lightning.group_size")
    for col, cap in (("prompt_token_ids", max_prompt_len), ("response_token_ids", max_response_len)):
        longest = max((len(x or []) for x in table.column(col).to_pylist()), default=0)
        if longest > cap:
            raise ValueError(f"a sample has {longest} {col.split('_')[0]} tokens > {cap}: build the samples "
                             f"with max_prompt_len/max_response_len = data.max_prompt_length/max_response_length")
    t, nt, meta = samples_to_tensors(table, pad_id=pad_id, weight_mode=weight_mode)
    P, R = max_prompt_len, max_response_len
    p0, r0 = t["prompts"].shape[1], t["responses"].shape[1]

    def widen(x, width, left, fill=0):  # [S, w] -> [rows, width]: pad columns, then padding rows
        cols = (width - x.shape[1], 0) if left else (0, width - x.shape[1])
        return torch.nn.functional.pad(x, (*cols, 0, rows - S), value=fill)

    prompts = widen(t["prompts"], P, True, pad_id)
    prompt_att = widen(t["attention_mask"][:, :p0], P, True)
    prompt_att[S:, -1] = 1  # padding rows: one attended pad token, so no sequence is empty
    responses = widen(t["responses"], R, False, pad_id)
    resp_att = widen(t["attention_mask"][:, p0:], R, False)
    attention = torch.cat([prompt_att, resp_att], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0),
        "response_mask": widen(t["response_mask"].long(), R, False),
        "rollout_log_probs": widen(t["rollout_log_probs"], R, False),
        "rm_scores": widen(t["advantages"], R, False),
    }
    assert r0 <= R and tuple(tensors) == OUTPUT_KEYS

    def col(a):  # object column, "" on padding rows
        return np.array(list(a) + [""] * (rows - S), dtype=object)

    non_tensors = {
        "lightning_sample_id": col(nt["sample_id"]),
        "lightning_rollout_id": col(nt["rollout_id"]),
        "lightning_group_id": col(nt["uid"]),  # not "uid": verl's own uid column is unioned with it
        "multi_modal_inputs": np.array([{} for _ in range(rows)], dtype=object),  # fit() iterates it
    }
    meta = {k: v for k, v in meta.items() if k != "global_token_num"}  # fit() recomputes it
    meta["lightning_samples"] = S
    return tensors, non_tensors, meta


def tasks_of(non_tensor_batch: dict) -> list[dict]:
    """Distinct tasks of verl's prompt rows (each repeated ``rollout.n`` times, interleaved), from
    ``extra_info[TASK_KEY]`` (JSON), in order."""
    by_id: dict[Any, dict] = {}  # the first row of each task id, in row order
    for i, info in enumerate(non_tensor_batch.get("extra_info", [])):
        raw = (info or {}).get(TASK_KEY)
        if raw is None:
            raise ValueError(f"row {i}: extra_info.{TASK_KEY} missing; write the dataset with write_task_dataset()")
        task = json.loads(raw)
        by_id.setdefault(task["id"], task)
    return list(by_id.values())


def write_task_dataset(tasks: list[dict], path: str) -> None:
    """verl's ``data.train_files``: one row per task. The prompt is a placeholder (verl's dataset
    needs one; the harness builds its own); the task travels as JSON in ``extra_info``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "lightning", "prompt": [{"role": "user", "content": str(t["id"])}],
             "reward_model": {"style": "rule", "ground_truth": ""},  # unused: rewards come from our samples
             "extra_info": {TASK_KEY: json.dumps(t), "index": i}} for i, t in enumerate(tasks)]
    pq.write_table(pa.Table.from_pylist(rows), path)


# -- the rollout: launcher + proxy against verl's vLLM servers -> samples --------------------------
class LauncherRollout:
    """Default rollout function: our launcher runs ``group_size`` harness rollouts per task through
    our proxy, whose upstreams are verl's vLLM servers; the step's samples come from
    ``build_samples`` exactly as in a local run. The proxy starts on first use; proxy and harness
    processes run where verl's TaskRunner runs (the manager lives there)."""

    def __init__(self, settings: dict, *, max_prompt_len: int, max_response_len: int, temperature: float = 1.0,
                 engine_defaults: dict | None = None) -> None:
        self.s, self.max_prompt_len, self.max_response_len = settings, max_prompt_len, max_response_len
        # verl's actor computes the policy at the rollout temperature, and its vLLM servers sample a
        # request that gives none at the rollout's temperature, top_k and top_p (override_generation_config)
        self.temperature, self.engine_defaults = temperature, engine_defaults or {"temperature": temperature}
        self.proxy = None

    def __call__(self, tasks: list[dict], step: int, upstreams: list[str]):
        from lightning_harness.launcher.batch import run_batch
        from lightning_harness.proxy.client import ProxyProcess

        from .samples import build_samples

        s = self.s
        if self.proxy is None:
            self.proxy = ProxyProcess(s["traces"], upstreams=upstreams, served_model=s.get("served_model"),
                                      model_version=step).start()
        self.proxy.control.set_model_version(step)  # verl synced the weights of step-1's update
        results = run_batch(tasks, s["harness"], traces_dir=s["traces"], run_id=s["run_id"], proxy=self.proxy,
                            samples=int(s["group_size"]), concurrency=int(s.get("concurrency", 8)),
                            timeout=s.get("timeout"), step=step, model_version=step)
        # this batch's rollouts only (as the local loop selects them): a step number alone also
        # matches other runs' rollouts in the same traces directory
        options = {k: s[k] for k in SAMPLE_KEYS if k in s}
        table, _ = build_samples(s["traces"], rollouts=[r.rollout_id for r in results], **options,
                                 max_prompt_len=self.max_prompt_len, max_response_len=self.max_response_len,
                                 temperature=self.temperature, engine_defaults=self.engine_defaults)
        return table

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None


def _server_urls(llm_client) -> list[str]:
    """verl's vLLM replicas (OpenAI-compatible HTTP servers) as base URLs for our proxy."""
    import ray

    addrs = ray.get(llm_client._load_balancer.get_all_servers.remote())
    return [a if a.startswith("http") else f"http://{a}" for a in addrs]


def lightning_settings(config, *, launcher: bool) -> dict:
    """``+lightning.*`` of the verl config, checked: required keys present, unknown ones refused
    (a misspelt or unsupported option, e.g. ``failed_plicy``, must not silently train on other
    data), and a ``run_id`` of this run's own by default.

    Why the run id: rollout ids are ``<run_id>-s<step>-<task>-<i>`` and the launcher skips rollouts
    an earlier run with the same id finished, so a shared default made a new run reuse (train on)
    the rollouts of an older run's policy. Set ``+lightning.run_id`` to resume a run's rollouts."""
    import uuid

    settings = dict(config.get("lightning") or {})
    unknown = sorted(set(settings) - set(LAUNCH_KEYS) - set(SAMPLE_KEYS))
    if unknown:
        raise ValueError(f"unknown +lightning keys {unknown}; known: {sorted(LAUNCH_KEYS + SAMPLE_KEYS)}")
    for key in ("group_size", "harness", "traces") if launcher else ("group_size",):
        if key not in settings:
            raise ValueError(f"missing +lightning.{key}=... in the verl config")
    settings.setdefault("run_id", f"verl-{uuid.uuid4().hex[:12]}")
    return settings


class LightningAgentLoopManager:
    """verl ``agent_loop_manager_class``: ``generate_sequences(prompts)`` runs our harness batch
    and returns our samples as the trainer's rollout batch. Constructed by verl in its TaskRunner
    process (the one that computes advantages), so it registers our estimator and loss there.

    ``rollout_fn(tasks, step, upstreams) -> samples table`` replaces the launcher (tests, custom
    rollouts); ``upstreams`` defaults to the servers behind ``llm_client``."""

    def __init__(self, config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None,
                 rollout_fn: Callable[..., Any] | None = None, upstreams: list[str] | None = None) -> None:
        from .verl_backend import register

        register()
        self.config, self.llm_client = config, llm_client
        self.settings = lightning_settings(config, launcher=rollout_fn is None)
        self.group_size = int(self.settings["group_size"])
        n = int(config.actor_rollout_ref.rollout.n)
        if n % self.group_size:
            raise ValueError(f"actor_rollout_ref.rollout.n={n} must be a multiple of "
                             f"lightning.group_size={self.group_size}")
        agg = config.actor_rollout_ref.actor.loss_agg_mode
        if agg != "token-mean":  # bypass mode replaces the loss; only token-mean keeps our weights exact
            raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode={agg}: the folded weights need token-mean")
        self.max_prompt_len = int(config.data.max_prompt_length)
        self.max_response_len = int(config.data.max_response_length)
        self.rollout_fn = rollout_fn or self._launcher_rollout(config.actor_rollout_ref.rollout)
        self.upstreams = upstreams

    def _launcher_rollout(self, rollout) -> LauncherRollout:
        """Our launcher as verl's rollout; the update computes at verl's rollout temperature, and
        verl's servers apply its temperature, top_k and top_p to a call that gives none."""
        from lightning_harness.proxy.sampling import sampling_settings

        t = float(rollout.get("temperature", 1.0) or 1.0)
        defaults = sampling_settings({"temperature": t, "top_k": rollout.get("top_k", -1),
                                      "top_p": rollout.get("top_p", 1.0), "repetition_penalty": 1.0})
        return LauncherRollout(self.settings, max_prompt_len=self.max_prompt_len,
                               max_response_len=self.max_response_len, temperature=t, engine_defaults=defaults)

    @classmethod
    def create(cls, *args, **kwargs) -> LightningAgentLoopManager:
        return cls(*args, **kwargs)

    def generate_sequences(self, prompts):
        """verl prompt rows (tasks x n) -> DataProto of our samples, padded to the same row count."""
        from verl import DataProto

        if prompts.meta_info.get("validate"):
            raise NotImplementedError("validation through verl is not wired: set trainer.test_freq=-1 "
                                      "and trainer.val_before_train=false; evaluate with lightning-train")
        step = int(prompts.meta_info.get("global_steps", 0))
        tasks = tasks_of(prompts.non_tensor_batch)
        t0 = time.perf_counter()
        table = self.rollout_fn(tasks, step, self.upstreams or _server_urls(self.llm_client))
        t1 = time.perf_counter()
        tensors, non_tensors, meta = pack_samples(
            table, len(prompts), max_prompt_len=self.max_prompt_len, max_response_len=self.max_response_len,
            pad_id=int(self.settings.get("pad_id", 0)), weight_mode=self.settings.get("weight_mode", "rollout"))
        meta["timing"] = {"lightning/rollout_s": t1 - t0, "lightning/pack_s": time.perf_counter() - t1}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


# -- config ----------------------------------------------------------------------------------------
def agent_loop_overrides(*, train_files: str, harness: str, traces: str, group_size: int, slots: int = 1,
                         concurrency: int = 8) -> list[str]:
    """Overrides (on top of ``verl_backend.verl_overrides``) that route verl's rollout through us."""
    return [
        "trainer.use_v1=false",  # RayPPOTrainer: manager returns a DataProto (v1 uses TransferQueue)
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
        f"actor_rollout_ref.rollout.n={group_size * slots}",
        f"data.train_files={train_files}",
        f"data.val_files={train_files}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"+lightning.harness='{harness}'",
        f"+lightning.traces={traces}",
        f"+lightning.group_size={group_size}",
        f"+lightning.concurrency={concurrency}",
    ]


def main() -> None:
    """``python -m lightning_harness.trainer.verl_agent_loop <hydra overrides>``: register our loss
    and estimator in the driver (``validate_config``), then run verl's ``main_ppo``."""
    from verl.trainer import main_ppo

    from .verl_backend import register

    register()
    main_ppo.main()


if __name__ == "__main__":
    main()
