"""verl agent-loop manager: our samples as the rollout batch of verl 0.9.1's PPO trainer.

Pure parts (packing, task rows) run in .venv; the trainer-side check runs
scripts/verl_check_agent_loop.py under LIGHTNING_VERL_PYTHON (default .venv-verl): Hydra composition,
class resolution as verl does it, verl's union / extract_reward / bypass / advantage path and the
actor's bypass-mode loss against update.py. Not run here: Ray workers, vLLM, FSDP (GPU only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_verl import attribute_without, needs_verl, run_in_verl
from test_update_core import make_samples

from lightning_harness.trainer import verl_agent_loop as VA
from lightning_harness.trainer import verl_backend as VB

ROOT = Path(__file__).resolve().parents[1]


def test_module_imports_without_verl():
    fqn = attribute_without(["verl", "ray"], "lightning_harness.trainer.verl_agent_loop", "MANAGER_FQN")
    assert fqn == "lightning_harness.trainer.verl_agent_loop.LightningAgentLoopManager"


def test_pack_fills_rows_with_samples_then_inert_padding():
    table = make_samples(seed=21)
    S, rows, P, R = table.num_rows, table.num_rows + 5, 12, 16
    t, nt, meta = VA.pack_samples(table, rows, max_prompt_len=P, max_response_len=R)
    ref, _, ref_meta = VB.samples_to_tensors(table)
    assert tuple(t) == VA.OUTPUT_KEYS
    assert {k: tuple(v.shape) for k, v in t.items()} == {
        **{k: (rows, R) for k in ("responses", "response_mask", "rollout_log_probs", "rm_scores")},
        "prompts": (rows, P), **{k: (rows, P + R) for k in ("input_ids", "attention_mask", "position_ids")}}
    for b, row in enumerate(table.to_pylist()):
        p, r = row["prompt_token_ids"], row["response_token_ids"]
        assert t["prompts"][b, P - len(p):].tolist() == p and t["responses"][b, : len(r)].tolist() == r
        assert t["response_mask"][b].tolist() == row["response_mask"] + [0] * (R - len(r))
        assert t["attention_mask"][b].sum() == len(p) + len(r)
        assert t["position_ids"][b, P - len(p)] == 0 and t["position_ids"][b, P + len(r) - 1] == len(p) + len(r) - 1
        assert torch.equal(t["rm_scores"][b, : len(r)], ref["advantages"][b, : len(r)])
        assert torch.equal(t["rollout_log_probs"][b, : len(r)], ref["old_log_probs"][b, : len(r)])
    pad = slice(S, rows)
    assert t["response_mask"][pad].sum() == 0 and t["rm_scores"][pad].abs().sum() == 0
    assert t["attention_mask"][pad].sum(-1).tolist() == [1] * 5  # one attended token: never empty
    assert list(nt["lightning_sample_id"][S:]) == [""] * 5 and "uid" not in nt
    assert meta["lightning_samples"] == S and meta["lightning_units"] == ref_meta["lightning_units"]
    # padding adds no model tokens, so the folded weights (T / N) are those of the real samples
    assert int(t["response_mask"].sum()) == meta["lightning_model_tokens"]


def test_pack_refuses_what_does_not_fit():
    table = make_samples(seed=22)
    with pytest.raises(ValueError, match="do not fit"):
        VA.pack_samples(table, table.num_rows - 1, max_prompt_len=64, max_response_len=64)
    with pytest.raises(ValueError, match="prompt tokens"):
        VA.pack_samples(table, table.num_rows, max_prompt_len=4, max_response_len=64)
    with pytest.raises(ValueError, match="response tokens"):
        VA.pack_samples(table, table.num_rows, max_prompt_len=64, max_response_len=2)


def test_task_rows_round_trip_through_the_dataset(tmp_path):
    import numpy as np
    import pyarrow.parquet as pq

    tasks = [{"id": "a", "prompt": "x"}, {"id": "b", "repo": "r", "n": 2}]
    VA.write_task_dataset(tasks, str(tmp_path / "tasks.parquet"))
    rows = pq.read_table(tmp_path / "tasks.parquet").to_pylist()
    assert [r["prompt"][0]["content"] for r in rows] == ["a", "b"]
    # verl repeats each row rollout.n times (interleaved); the manager gets each task once, in order
    extra = np.array([r["extra_info"] for r in rows for _ in range(3)], dtype=object)
    assert VA.tasks_of({"extra_info": extra}) == tasks
    with pytest.raises(ValueError, match="lightning_task"):
        VA.tasks_of({"extra_info": np.array([{"index": 0}], dtype=object)})


@needs_verl
def test_manager_drives_verls_trainer_step_on_cpu(tmp_path):
    import pyarrow.parquet as pq

    table = make_samples(seed=23)
    pq.write_table(table, tmp_path / "samples.parquet")
    out = run_in_verl(ROOT / "scripts" / "verl_check_agent_loop.py", tmp_path / "samples.parquet", cwd=tmp_path)
    tasks = list(dict.fromkeys(table.column("task_id").to_pylist()))
    assert out["config"] == {"cls": VA.MANAGER_FQN, "n": 6, "use_v1": False, "group_size": 2, "bypass": True,
                             "harness": "python agent.py --task {task_id}"}
    assert out["rollout_calls"] == [{"tasks": tasks, "step": 7, "upstreams": ["http://10.0.0.1:8000"]}]
    rows = len(tasks) * 6
    assert out["rows"] == rows and out["samples"] == table.num_rows
    assert out["shapes"] == {"prompts": [rows, 16], "responses": [rows, 20], "input_ids": [rows, 36],
                             "response_mask": [rows, 20], "advantages": [rows, 20]}
    assert out["exact"]  # every row: ids, padding, masks, old logprobs, advantages as verl's actor sees them
    assert out["loss_mode_after_bypass"] == "bypass_mode"  # bypass replaces the loss: PPO-clip, token-mean
    assert out["loss_verl"] == pytest.approx(out["loss_ours"], rel=1e-5, abs=1e-7)
    assert out["grad_max"] > 0 and out["grad_maxdiff"] <= 1e-5 * out["grad_max"]
    assert set(out["timing_keys"]) == {"lightning/rollout_s", "lightning/pack_s"}
