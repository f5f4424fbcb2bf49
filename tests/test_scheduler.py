"""The rollout scheduler's rules without processes: slots, backlog, staleness, resume, sync as a setting.

Finished groups are the launcher's own result objects, planned by the launcher's own identity code,
so the group ids the scheduler keys on are the ones a real BatchRunner reports.
"""

from __future__ import annotations

import pytest

from lightning_harness.launcher.identity import plan_rollouts
from lightning_harness.launcher.results import GroupResult, RolloutResult
from lightning_harness.launcher.tasks import tasks_from_rows
from lightning_harness.trainer import config as C
from lightning_harness.trainer.scheduler import Schedule, Scheduler

TASKS = tasks_from_rows([{"id": f"t{i}"} for i in range(10)])


def finish(task, label: int, started_at: int | None, run_id: str = "run") -> GroupResult:
    """What the launcher reports when the group of ``task`` launched at ``label`` has finished."""
    specs = plan_rollouts([task], run_id=run_id, samples=2, step=label)
    rollouts = [RolloutResult(s.rollout_id, 0, run_id, task.id, s.group_id, s.sample_index, label, "train",
                              "succeeded", 0, None, None, 1.0, 1.0, "file", None, None, started_at, "local", None)
                for s in specs]
    return GroupResult(specs[0].group_id, rollouts)


def async_schedule(**over) -> Schedule:
    return Schedule(**{"groups_per_step": 2, "groups_in_flight": 4, "max_staleness": 1,
                       "staleness_mode": "drop", **over})


def test_mode_is_translated_once_sync_is_async_with_only_the_steps_groups(tmp_path):
    (tmp_path / "model").mkdir()
    p = tmp_path / "cfg.yaml"
    p.write_text('model: model\nharness: {command: ["x"]}\ntasks: {train: t.jsonl}\nupdate: {lr: 1.0e-5}\n'
                 "rollout: {groups_per_step: 3, groups_in_flight: 7, max_staleness: 2, staleness_mode: drop}\n")
    assert Schedule.from_rollout(C.load_config(p).rollout) == Schedule(3, 3, 0, "tis")
    assert Schedule.from_rollout(C.load_config(p, ["rollout.mode=async"]).rollout) == Schedule(3, 7, 2, "drop")


def test_sync_launches_the_step_and_consumes_all_of_it():
    s = Scheduler(Schedule(2, 2, 0, "tis"), TASKS, seed=0)
    launched = s.launches(1)
    assert len(launched) == 2 and s.launches(1) == []  # full: nothing more until the update
    s.finished([finish(t, 1, started_at=0) for t in launched], version=0)
    assert s.ready
    taken = s.take()
    assert sorted(g.group_id for g in taken) == sorted(f"{t.id}@1" for t in launched)
    assert s.in_flight == {} and s.backlog == []  # nothing carried over an update
    # sync never discards, whatever version a rollout reports
    assert not s.schedule.too_stale(finish(TASKS[0], 1, started_at=0), version=9)


def test_async_keeps_slots_full_and_an_update_takes_the_oldest_launches_first():
    s = Scheduler(async_schedule(), TASKS, seed=0)
    a, b, c, d = s.launches(1)
    assert len(s.in_flight) == 4
    s.finished([finish(d, 1, started_at=0)], version=0)
    assert not s.ready and s.launches(1) == []  # a finished group keeps its slot until consumed
    s.finished([finish(a, 1, started_at=0)], version=0)
    assert s.ready and [g.group_id for g in s.take()] == [f"{d.id}@1", f"{a.id}@1"]
    assert set(s.in_flight) == {f"{b.id}@1", f"{c.id}@1"}  # carried over the update
    e, f = s.launches(2)  # the freed slots, labelled with the launching step
    assert {f"{e.id}@2", f"{f.id}@2"} <= set(s.in_flight)
    s.finished([finish(e, 2, started_at=1), finish(b, 1, started_at=0)], version=1)
    assert [g.group_id for g in s.take()] == [f"{b.id}@1", f"{e.id}@2"]  # older launch first
    assert set(s.in_flight) == {f"{c.id}@1", f"{f.id}@2"}


def test_a_group_too_stale_is_discarded_whole_and_its_slot_refilled():
    s = Scheduler(async_schedule(), TASKS, seed=0)
    launched = s.launches(1)
    s.finished([finish(launched[0], 1, started_at=0)], version=2)  # 2 versions behind, bound 1
    assert s.discarded == 1 and s.backlog == [] and len(s.in_flight) == 3
    assert len(s.launches(3)) == 1  # its slot is free again
    # waiting in the backlog while an update happens: fine at bound 1, discarded at the next update
    s.finished([finish(launched[1], 1, started_at=1)], version=2)
    s.expire(version=2)
    assert len(s.backlog) == 1
    s.expire(version=3)
    assert s.backlog == [] and s.discarded == 2
    # a rollout with no recorded version (no model call) is never stale
    assert not s.schedule.too_stale(finish(TASKS[0], 1, started_at=None), version=100)


def test_tis_keeps_stale_groups():
    s = Scheduler(async_schedule(staleness_mode="tis"), TASKS, seed=0)
    launched = s.launches(1)
    s.finished([finish(launched[0], 1, started_at=0)], version=5)
    s.expire(version=6)
    assert len(s.backlog) == 1 and s.discarded == 0


def test_resume_resubmits_what_was_in_flight_and_continues_the_same_stream():
    s = Scheduler(async_schedule(), TASKS, seed=4)
    first = s.launches(1)
    s.finished([finish(t, 1, started_at=0) for t in first[:2]], version=0)
    s.take()
    s.launches(2)
    saved, pos = list(s.in_flight.values()), s.stream.pos
    future = [t.id for t in s.stream.take(3, set())]

    again = Scheduler(async_schedule(), TASKS, seed=4, stream_pos=pos)
    batches = again.resume(saved)
    assert [label for label, _ in batches] == [1, 2]  # in label order
    assert {(t.id, label) for label, tasks in batches for t in tasks} == {(e["task"], e["label"]) for e in saved}
    assert again.in_flight == s.in_flight and again.launches(2) == []  # the same slots are taken
    assert [t.id for t in again.stream.take(3, set())] == future
    with pytest.raises(KeyError):  # a task file that lost a task in flight is not silently skipped
        Scheduler(async_schedule(), TASKS[1:], seed=4).resume([{"task": "t0", "label": 1}])


def test_one_label_never_launches_a_task_twice():
    """Group ids are ``task@label``: two groups of one task launched at one step would collide."""
    s = Scheduler(Schedule(1, 3, 1, "drop"), TASKS[:4], seed=0)
    launched = s.launches(1)
    s.finished([finish(launched[0], 1, started_at=0)], version=0)
    s.take()
    (fourth,) = s.launches(1)  # the last task not yet launched at label 1
    assert fourth.id not in {t.id for t in launched}
    s.finished([finish(launched[1], 1, started_at=0)], version=0)
    s.take()
    with pytest.raises(C.ConfigError, match="not enough distinct"):  # the stream's next epoch repeats them
        s.launches(1)
    assert len(s.launches(2)) == 1  # at the next step every task may run again
