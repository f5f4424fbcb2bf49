"""The loop's scheduling under hostile timing: crashes between a step's records, a rollout phase whose
launcher stopped by itself, finished groups waiting in numbers.

The real :class:`Scheduler` and the real ``TrainingRun.collect`` / ``step`` / ``run`` bookkeeping; the
launcher is a fake that reports finished groups (or, where the hang is the point, the real
``BatchRunner``), and the update only moves the model version. No vLLM, no proxy.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from lightning_harness.launcher.identity import plan_rollouts
from lightning_harness.launcher.results import GroupResult, RolloutResult
from lightning_harness.launcher.tasks import tasks_from_rows
from lightning_harness.trainer.loop import TrainingRun
from lightning_harness.trainer.scheduler import Schedule, Scheduler

pytestmark = pytest.mark.timeout(60)

TASKS = tasks_from_rows([{"id": f"t{i}"} for i in range(10)])
QUIET = SimpleNamespace(update=lambda **k: None, print=lambda *a, **k: None, close=lambda: None)


def group_result(task, label: int, version: int) -> GroupResult:
    """What the launcher reports for the finished group of ``task`` launched at ``label``."""
    specs = plan_rollouts([task], run_id="run", samples=2, step=label)
    rollouts = [RolloutResult(s.rollout_id, 0, "run", task.id, s.group_id, s.sample_index, label, "train",
                              "succeeded", 0, None, None, 1.0, 1.0, "file", None, None, version, "local", None)
                for s in specs]
    return GroupResult(specs[0].group_id, rollouts)


class FakeRunner:
    """Submitted groups finish at the next ``wait_groups``, stamped with the version serving then."""

    def __init__(self, version) -> None:
        self.version, self.queued, self.submits = version, [], []
        self.stats = SimpleNamespace(running=0, mean_reward=None)
        self.error, self.pending = None, 0

    def submit(self, tasks, step):
        self.submits.append((step, [t.id for t in tasks]))
        self.queued += [(t, step) for t in tasks]

    def wait_groups(self, n, timeout):
        out = [group_result(t, label, self.version()) for t, label in self.queued]
        self.queued = []
        return out

    def flush(self):
        pass


class Metrics:
    """The metrics table: the latest value per (step, name), as ``read_metrics`` gives it."""

    def __init__(self) -> None:
        self.rows: dict[int, dict] = {}

    def log(self, step, values):
        self.rows.setdefault(step, {}).update(values)


def stub_run(tmp_path, schedule: Schedule, *, steps=3, state=None, metrics=None, eval_every=0,
             eval_after=False, eval_before=False) -> TrainingRun:
    """A TrainingRun whose update moves the version and records the groups it trained on."""
    run = object.__new__(TrainingRun)
    run.run_dir, run.hooks, run.reports = tmp_path, {}, []
    run.cfg = SimpleNamespace(steps=steps, seed=0, eval=SimpleNamespace(
        every=eval_every, after=eval_after, before=eval_before, success_threshold=0.5))
    run.schedule, run.progress, run.metrics, run.console = schedule, QUIET, metrics or Metrics(), QUIET
    run.state = state or {"step": 0, "model_version": 0, "stream_pos": 0, "in_flight": [],
                          "checkpoint": "c", "base_model": "c"}
    run.scheduler = Scheduler(schedule, TASKS, 0, int(run.state.get("stream_pos", 0)))
    run.scheduler.discarded = int(run.state.get("discarded_groups", 0))
    run.runner = FakeRunner(lambda: run.version)
    run._clock, run.trained = (time.monotonic(), 0.0), []
    run.eval_tasks, run.evaluated = TASKS[:1], []

    def update_phase(step, groups):
        run.trained.append((step, [g.group_id for g in groups]))
        run.state["model_version"] = run.version + 1
        return {"model_version": run.version}

    def evaluate(version):
        run.evaluated.append(version)
        run.state.setdefault("evals", {})[str(version)] = {"eval/success": 1.0}
        return {"eval/success": 1.0}

    run.update_phase, run.evaluate = update_phase, evaluate
    return run


def saved_state(tmp_path) -> dict:
    return json.loads((tmp_path / "state.json").read_text())


# -- a crash between a step's state file and its metrics ------------------------------------------
def crash_in_eval(run) -> None:
    """The trainer is killed during the step's evaluation (after the step was recorded)."""
    def killed(version):
        raise KeyboardInterrupt("killed during the eval")

    run.evaluate = killed


def full_run(run, monkeypatch):
    """``TrainingRun.run`` itself, its services stubbed: what a (resumed) run does with its state."""
    from lightning_harness.trainer import metrics as M

    metrics = run.metrics
    monkeypatch.setattr(M, "MetricsLog", lambda *a, **k: metrics)
    monkeypatch.setattr(M, "ProgressLine", lambda *a, **k: QUIET)
    runner = run.runner
    run.train_tasks, run.traces = TASKS, run.run_dir / "traces"
    run.cfg.run_id = "run"
    for name in ("prepare", "start_services", "load_updater", "shutdown"):
        setattr(run, name, lambda: None)
    run.start_runner = lambda: setattr(run, "runner", runner)
    run._open_trackers = lambda: {}
    run.finish = lambda: dict(run.state)
    return run.run()


def test_a_crash_in_the_eval_loses_neither_the_steps_metrics_nor_its_eval(tmp_path, monkeypatch):
    """Killed during step 2's eval: state.json says step 2 is done, so --resume never redoes it. Its
    train metrics must already be in the metrics table, and its eval must run on resume."""
    metrics = Metrics()
    run = stub_run(tmp_path, Schedule(2, 2, 0, "tis"), metrics=metrics, eval_every=2)
    run.step(1)
    crash_in_eval(run)
    with pytest.raises(KeyboardInterrupt):
        run.step(2)
    assert saved_state(tmp_path)["step"] == 2
    assert "train/groups" in metrics.rows.get(2, {})  # before the fix: step 2 had no metrics at all
    again = stub_run(tmp_path, Schedule(2, 2, 0, "tis"), state=saved_state(tmp_path), metrics=metrics, eval_every=2)
    full_run(again, monkeypatch)
    assert again.evaluated == [2]  # version 2's eval, due at step 2, ran on resume (once)
    assert metrics.rows[2]["eval/success"] == 1.0 and "2" in saved_state(tmp_path)["evals"]
    assert sorted(metrics.rows) == [1, 2, 3]


def test_the_final_eval_runs_after_a_crash_in_it(tmp_path, monkeypatch):
    """Killed during the last step's eval.after: the resumed run has no step left, but the run's
    'after' evaluation (the summary's before/after table) must still happen."""
    run = stub_run(tmp_path, Schedule(2, 2, 0, "tis"), steps=2, eval_after=True)
    run.step(1)
    crash_in_eval(run)
    with pytest.raises(KeyboardInterrupt):
        run.step(2)
    again = stub_run(tmp_path, Schedule(2, 2, 0, "tis"), steps=2, state=saved_state(tmp_path), eval_after=True)
    summary = full_run(again, monkeypatch)
    assert again.evaluated == [2] and "2" in summary["evals"]  # before the fix: no 'after' eval at all


def test_resume_does_not_evaluate_again_unless_an_eval_is_due(tmp_path, monkeypatch):
    """eval.before is the evaluation before training: a resume after step 1 (no eval due there) does
    not run one at version 1 and log it at step 1."""
    run = stub_run(tmp_path, Schedule(2, 2, 0, "tis"), steps=2, eval_before=True, eval_every=2)
    full_run(run, monkeypatch)
    assert run.evaluated == [0, 2]
    state = {**saved_state(tmp_path), "step": 1, "model_version": 1}  # as after step 1
    again = stub_run(tmp_path, Schedule(2, 2, 0, "tis"), steps=1, state=state, eval_before=True, eval_every=2)
    full_run(again, monkeypatch)
    assert again.evaluated == []  # before the fix: [1], an eval no setting asked for


# -- the launcher stopped by itself: the rollout phase must stop too ------------------------------
def test_collect_stops_when_the_launcher_aborted(tmp_path):
    """The capture proxy (or the engine) died: the real BatchRunner cancels itself and wait_groups
    returns at once, forever. collect spun at 100% CPU instead of failing."""
    from lightning_harness.launcher.batch import BatchAborted, BatchRunner

    run = stub_run(tmp_path, Schedule(2, 2, 0, "tis"))
    run.runner = BatchRunner(["sleep", "30"], traces_dir=tmp_path / "traces", run_id="run", samples=1,
                             health_check=lambda: "capture proxy exited with code 1", flush_seconds=0.1)
    outcome: list = []

    def collect():
        try:
            outcome.append(run.collect(1))
        except Exception as exc:
            outcome.append(exc)

    t = threading.Thread(target=collect, daemon=True)
    t.start()
    t.join(10)
    try:
        assert not t.is_alive(), "collect never returned: the launcher aborted and the loop kept waiting"
        assert isinstance(outcome[0], BatchAborted) and "capture proxy exited" in str(outcome[0])
    finally:
        run.runner._cancel.set()  # let a spinning collect end
        t.join(5)
        run.runner.close()


# -- finished groups waiting in numbers: the freed slots are refilled before the update ------------
def test_slots_freed_by_an_update_are_refilled_even_with_enough_groups_waiting(tmp_path):
    """Async, 2 groups per step, 6 in flight: 4 groups finished at once in step 1; step 2 takes the
    other 2 waiting ones. The 2 slots step 1 freed must run through step 2's update, not idle."""
    run = stub_run(tmp_path, Schedule(2, 6, 2, "drop"))
    run.scheduler.launches(1)
    run.runner.queued = []
    finished = [group_result(t, 1, 0) for t in [run.scheduler._by_id[e["task"]]
                                                 for e in list(run.scheduler.in_flight.values())[:4]]]
    run.scheduler.finished(finished, 0)
    assert len(run.scheduler.take()) == 2 and len(run.scheduler.backlog) == 2 and len(run.scheduler.in_flight) == 4
    taken = run.collect(2)
    assert len(taken) == 2
    assert [(label, len(ids)) for label, ids in run.runner.submits] == [(2, 2)]  # before the fix: none
    assert len(run.scheduler.in_flight) == 4  # 2 running since step 1, 2 launched at step 2


def test_groups_per_step_and_no_group_twice_over_steps(tmp_path):
    """The refill before waiting keeps every update at groups_per_step, each group consumed once."""
    run = stub_run(tmp_path, Schedule(2, 4, 1, "drop"), steps=5)
    for step in range(1, 6):
        run.step(step)
    ids = [g for _, groups in run.trained for g in groups]
    assert [len(g) for _, g in run.trained] == [2] * 5 and len(ids) == len(set(ids))


# -- a negative staleness bound: every group discarded, forever ------------------------------------
def test_a_negative_max_staleness_is_refused_before_rollouts_run(tmp_path):
    """``max_staleness: -1`` passed the config: in 'drop' mode every finished group (staleness >= 0)
    was discarded and relaunched at the same step until every train task had run once, then the run
    stopped with a misleading 'not enough distinct train tasks' (never one update)."""
    from lightning_harness.trainer import config as C

    (tmp_path / "model").mkdir()
    p = tmp_path / "cfg.yaml"
    p.write_text('model: model\nharness: {command: ["x"]}\ntasks: {train: t.jsonl}\nupdate: {lr: 1.0e-5}\n'
                 "rollout: {mode: async, groups_per_step: 1, groups_in_flight: 2, max_staleness: -1}\n")
    with pytest.raises(C.ConfigError, match="max_staleness must be >= 0"):
        Schedule.from_rollout(C.load_config(p).rollout)
    assert Schedule.from_rollout(C.load_config(p, ["rollout.mode=sync"]).rollout).max_staleness == 0


# -- a crash after the engine served new weights, before the step was recorded --------------------
class SwapFakes:
    """The hold's other parties: a proxy control and an engine that record what they were told, an
    updater that saves an (empty) checkpoint folder."""

    def __init__(self) -> None:
        self.stamped: list[int] = []  # versions the proxy was told to stamp on spans

    def control(self):
        return SimpleNamespace(pause=lambda: None, resume=lambda: None, state=lambda: {"held": 0},
                               drain=lambda timeout: {"drained": True, "waited_s": 0.0, "in_flight": 0},
                               set_model_version=self.stamped.append)

    @staticmethod
    def engine():
        return SimpleNamespace(pause=lambda mode: None, resume=lambda: None, sleep=lambda level, **kw: None,
                               wake_up=lambda: None, is_sleeping=lambda: False, reload_weights=lambda ckpt, **kw: 0.0)

    @staticmethod
    def updater():
        def save(path, **kw):
            path.mkdir(parents=True, exist_ok=True)
            return path

        return SimpleNamespace(set_lr=lambda lr: None, update=lambda table: {}, save=save)


def swap_run(tmp_path, fakes: SwapFakes, state: dict) -> TrainingRun:
    from lightning_harness.trainer.config import UpdateConfig

    run = stub_run(tmp_path, Schedule(2, 2, 0, "tis"), state=state)
    run.cfg.proxy = SimpleNamespace(drain_timeout_s=1.0, in_flight="drain")
    run.cfg.engine = SimpleNamespace(sleep_on_update="never", sleep_level=1)
    run.cfg.checkpoint = SimpleNamespace(keep_last=2, save_optimizer=False)
    run.cfg.update = UpdateConfig()
    run.ckpt_dir, run.device = tmp_path / "checkpoints", "cpu"
    run.proxy = SimpleNamespace(control=fakes.control())
    run.engine, run.updater = fakes.engine(), fakes.updater()
    return run


def test_a_version_the_proxy_stamped_is_never_given_to_other_weights(tmp_path):
    """Killed after step 1's swap (the engine serves the new weights, the proxy stamps version 1 on
    spans) but before the step was recorded: --resume redoes step 1 from the old checkpoint, and its
    new weights must not take version 1 again (spans of the lost weights carry it)."""
    fakes = SwapFakes()
    run = swap_run(tmp_path, fakes, None)
    run._save_state()  # as a run's state file stands before its first step
    rep = run.swap(1, None, run.version)
    assert rep["model_version"] == 1 and fakes.stamped == [1]
    # killed here: the step-end state save never ran
    resumed_state = saved_state(tmp_path)
    assert resumed_state["model_version"] == 0  # the resumed run serves the old checkpoint
    again = swap_run(tmp_path, fakes, resumed_state)
    rep = again.swap(1, None, again.version)
    assert fakes.stamped == [1, 2]  # before the fix: [1, 1], one number for two sets of weights
    assert rep["model_version"] == 2
