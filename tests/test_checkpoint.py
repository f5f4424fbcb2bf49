"""Checkpoint folders (trainer/checkpoint.py) on real files, and the rollout key the update and the
verl backend both count units with (trainer/weights.py)."""

from __future__ import annotations

import pyarrow as pa
import torch
from test_update_core import make_samples

from lightning_harness.schemas import SAMPLES
from lightning_harness.trainer import checkpoint as C
from lightning_harness.trainer import update as U
from lightning_harness.trainer import verl_backend as VB
from lightning_harness.trainer.weights import rollout_index, rollout_key


def test_prune_keeps_the_newest_and_every_protected_checkpoint(tmp_path):
    for step in range(6):
        (C.step_dir(tmp_path, step) / "x").mkdir(parents=True)
    (tmp_path / "not-a-step").mkdir()
    C.prune(tmp_path, 2, protect=(C.step_dir(tmp_path, 0), str(C.step_dir(tmp_path, 3))))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["not-a-step", "step-000000", "step-000003", "step-000004", "step-000005"]
    C.prune(tmp_path, 0)  # keep_last 0 still keeps the newest: the engine serves it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-step", "step-000005"]


def test_optimizer_state_loads_only_when_saved(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert not C.load_optimizer_state(opt, tmp_path, torch.device("cpu"))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    (tmp_path / C.TRAINER_STATE_DIR).mkdir()
    torch.save(opt.state_dict(), tmp_path / C.OPTIMIZER_FILE)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert C.load_optimizer_state(fresh, tmp_path, torch.device("cpu"))
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert C.read_version(tmp_path) == {"model_version": 0}  # a plain HF folder is version 0


def test_one_rollout_key_for_the_update_and_the_verl_backend():
    """Two attempts of one rollout are two units; a missing attempt is attempt 0; both consumers agree."""
    assert rollout_key("r1", None) == rollout_key("r1", 0) == "r1~0" != rollout_key("r1", 1)
    assert rollout_index(["b~0", "a~0", "b~0", "b~1"]).tolist() == [0, 1, 0, 2]
    rows = make_samples(seed=13, n_rollouts=3).to_pylist()
    rows += [dict(r, attempt=1, sample_id=r["sample_id"] + "-retry") for r in rows]
    table = pa.Table.from_pylist(rows, schema=SAMPLES)
    samples, _ = U.table_to_samples(table, None)
    assert len({s.rollout_id for s in samples}) == 6
    assert U._units(samples, "rollout") == VB.samples_to_tensors(table)[2]["lightning_units"] == 6


def test_padded_rows_left_and_right():
    t = U.padded([[1, 2], [], [3]], 3, torch.long, 9)
    assert t.tolist() == [[1, 2, 9], [9, 9, 9], [3, 9, 9]]
    assert U.padded([[1, 2], [3]], 3, torch.long, left=True).tolist() == [[0, 1, 2], [0, 0, 3]]
    assert U.lengths_mask([0, 2], 3).tolist() == [[False, False, False], [True, True, False]]


def test_a_checkpoint_is_on_disk_before_its_name_is(tmp_path, monkeypatch):
    """Every file of a checkpoint (weights, optimizer state, version stamp) and its folder are flushed
    before the rename that names it, and the parent folder after it: the trainer's state file may
    name it as the one to resume from right after."""
    import os

    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(C.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(C.os, "replace", lambda a, b: (renamed.append(len(synced)), real_replace(a, b)))
    model = torch.nn.Linear(2, 2)
    model.save_pretrained = lambda d, **_: torch.save(model.state_dict(), f"{d}/weights.pt")
    opt = torch.optim.AdamW(model.parameters())
    out = C.save_checkpoint(model, tmp_path / "step-000001", source_dir=tmp_path, version_info={"model_version": 1},
                            optimizer=opt)
    before = [p.replace(".step-000001.tmp", "step-000001") for p in synced[:renamed[0]]]
    for path in ("weights.pt", "trainer_state/optimizer.pt", "trainer_state", C.VERSION_FILE, ""):
        assert str(out / path).rstrip("/") in before, path
    assert synced[renamed[0]:] == [str(tmp_path)]
