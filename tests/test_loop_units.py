"""Loop pieces that need no engine: config + overrides, task stream, staleness filter, metrics, plot."""

from __future__ import annotations

import pyarrow as pa
import pytest

from lightning_harness.schemas import SAMPLES, read_table
from lightning_harness.trainer import config as C
from lightning_harness.trainer.cli import step_line
from lightning_harness.trainer.metrics import MetricsLog, read_metrics
from lightning_harness.trainer.plot import plot_rewards
from lightning_harness.trainer.scheduler import TaskStream, staleness_filter


def write_cfg(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    (tmp_path / "model").mkdir(exist_ok=True)
    return p


BASE = """
model: model
harness: {command: ["{python}", "h.py", "--temperature", "{temperature}"]}
tasks: {train: train.jsonl}
update: {lr: 1.0e-5}
"""


def test_config_overrides_types_and_paths(tmp_path):
    p = write_cfg(tmp_path, BASE)
    cfg = C.load_config(p, ["update.lr=2e-5", "rollout.mode=async", "steps=3", "update.betas=[0.8, 0.9]",
                            "samples.weight_mode=token-mean", "harness.env.FOO=bar"])
    assert cfg.update.lr == 2e-5 and cfg.rollout.mode == "async" and cfg.steps == 3
    assert cfg.update.betas == (0.8, 0.9)
    assert cfg.update.loss_mode == "token-mean"  # follows the samples' weight mode
    assert cfg.harness.env == {"FOO": "bar"}
    assert cfg.path(cfg.model) == (tmp_path / "model").resolve()  # relative to the config file
    # a round trip through the saved copy gives the same config
    C.save_config(cfg, tmp_path / "copy.yaml")
    again = C.load_config(tmp_path / "copy.yaml", base_dir=tmp_path)
    assert again.to_dict() == {**cfg.to_dict(), "base_dir": str(tmp_path)}


@pytest.mark.parametrize("override, message", [
    ("update.lr_rate=1", "did you mean 'lr'"),
    ("rollout.mode=fast", "rollout.mode"),
    ("update.lr=abc", "update.lr"),
    ("steps", "KEY=VALUE"),
    ("rollout=3", "expected a mapping"),
])
def test_config_errors_name_the_key(tmp_path, override, message):
    p = write_cfg(tmp_path, BASE)
    with pytest.raises(C.ConfigError, match=message):
        C.load_config(p, [override])


def test_config_requires_essentials(tmp_path):
    p = write_cfg(tmp_path, "steps: 2\n")
    with pytest.raises(C.ConfigError) as e:
        C.load_config(p)
    for key in ("model", "harness.command", "tasks.train"):
        assert key in str(e.value)


def test_task_stream_is_deterministic_and_resumable():
    from lightning_harness.launcher.tasks import tasks_from_rows

    tasks = tasks_from_rows([{"id": f"t{i}"} for i in range(5)])
    a = TaskStream(tasks, seed=3)
    first = [t.id for t in a.take(3, set())]
    saved = a.pos
    second = [t.id for t in a.take(4, set())]
    assert len(set(first)) == 3 and len(set(second)) == 4
    b = TaskStream(tasks, seed=3, pos=0)
    assert [t.id for t in b.take(3, set())] == first
    c = TaskStream(tasks, seed=3, pos=saved)  # resume from a saved position
    assert [t.id for t in c.take(4, set())] == second
    used = {"t0", "t1"}
    got = [t.id for t in TaskStream(tasks, seed=3).take(3, used)]
    assert not {"t0", "t1"} & set(got)
    with pytest.raises(C.ConfigError, match="not enough distinct"):
        TaskStream(tasks, seed=3).take(6, set())


def samples_table(vmins):
    rows = []
    for i, (rid, v) in enumerate(vmins):
        rows.append(dict(sample_id=f"s{i}", rollout_id=rid, attempt=0, prompt_token_ids=[1],
                         response_token_ids=[2], response_mask=[1], response_logprobs=[-1.0],
                         advantage=1.0, loss_weight=1.0, model_version_min=v, model_version_max=v))
    return pa.Table.from_pylist(rows, schema=SAMPLES)


def test_staleness_filter_drops_whole_rollouts_or_keeps_them_for_tis():
    t = samples_table([("a", 5), ("a", 3), ("b", 4), ("c", 5)])
    kept, rep = staleness_filter(t, 5, 1, "drop")
    assert sorted(set(kept["rollout_id"].to_pylist())) == ["b", "c"]  # 'a' had a sample 2 versions old
    assert rep["async/dropped_rollouts"] == 1 and rep["async/dropped_samples"] == 2
    assert rep["async/staleness_seen_max"] == 2 and rep["async/staleness_max"] == 1  # of what is trained
    kept, rep = staleness_filter(t, 5, 1, "tis")
    assert kept.num_rows == 4 and rep["async/dropped_rollouts"] == 0 and rep["async/staleness_max"] == 2


def test_metrics_parquet_latest_wins_and_plot(tmp_path):
    m = MetricsLog(tmp_path, "run1")
    m.log(0, {"eval/reward_mean": 0.1, "note": "not a number"})
    m.log(1, {"train/reward_mean": 0.2, "time/pause_s": 1.5, "flag": True})
    m.log(1, {"train/reward_mean": 0.3})  # a redone step after --resume overrides
    m.log(2, {"train/reward_mean": 0.5, "eval/reward_mean": 0.6})
    m.close()
    MetricsLog(tmp_path, "other").log(1, {"train/reward_mean": 9.0})
    got = read_metrics(tmp_path, "run1")
    assert got["train/reward_mean"] == {1: 0.3, 2: 0.5}
    assert got["eval/reward_mean"] == {0: 0.1, 2: 0.6}
    assert got["flag"] == {1: 1.0} and "note" not in got
    assert read_table(tmp_path, "metrics").num_rows == 8
    png = plot_rewards(tmp_path, tmp_path / "curve.png", "run1")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_step_line_reports_the_async_fields():
    line = step_line(2, 5, {"model_version": 2, "train/reward_mean": 0.5, "async/carry_over": 3,
                            "async/staleness_max": 1, "time/drain_s": 0.25, "time/pause_s": 1.5, "proxy/held": 4})
    for part in ("step 2/5", "v2", "carry-over 3", "stale max 1", "drain 0.25s", "pause 1.50s", "held 4"):
        assert part in line


def test_cli_help_build_and_print_config_do_not_import_torch():
    """`lightning-train --help`, `build --help`, `run --print-config` and `step --help` stay fast: torch
    (seconds to import) loads only when a loop or an update runs."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from lightning_harness.trainer.cli import main\n"
        "outs = [CliRunner().invoke(main, a) for a in (['--help'], ['build', '--help'], ['run', '--print-config'])]\n"
        "assert all(o.exit_code == 0 for o in outs), [o.output for o in outs]\n"
        "assert 'step ' in outs[0].output and 'lr:' in outs[2].output\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
        "r = CliRunner().invoke(main, ['step', '--help'])\n"
        "print(r.exit_code, 'TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
        "import lightning_harness.trainer.update\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NO-TORCH", "0", "NO-TORCH", "TORCH"]


def test_summary_table_before_after_and_evaluation_only():
    from rich.console import Console

    from lightning_harness.trainer.cli import print_summary

    def table(evals):
        console = Console(record=True, width=200)
        print_summary(console, {"evals": evals, "checkpoint": "ck", "model_version": 0, "run_dir": "r",
                                "eval_tasks": "/x/tasks_eval.jsonl"},
                      "traces", "run")
        return console.export_text()

    two = table({"0": {"eval/success": 0.25, "eval/reward_mean": 0.3},
                 "4": {"eval/success": 0.5, "eval/reward_mean": 0.5}})
    assert "before (v0)" in two and "after (v4)" in two and "+25.0 pts" in two
    assert "evaluation on tasks_eval.jsonl" in two
    one = table({"0": {"eval/success": 0.25, "eval/reward_mean": 0.3}})  # steps=0: one evaluation
    assert "before" not in one and "after" not in one and "change" not in one
    assert "v0" in one and one.count("25.0%") == 1
    three = table({"0": {"eval/success": 0.25}, "8": {"eval/success": 0.625}, "16": {"eval/success": 0.5}})
    assert "before (v0)" in three and "v8" in three and "after (v16)" in three  # the halfway one too
    assert "62.5%" in three and "+25.0 pts" in three and "│ eval/reward_mean" not in three  # none recorded
    gap = table({"0": {"eval/success": 0.25, "eval/reward_mean": 0.3}, "8": {"eval/success": 0.5},
                 "16": {"eval/success": 0.5, "eval/reward_mean": 0.45}})  # a middle one without the reward
    assert "│ eval/reward_mean" in gap and "+0.150" in gap
    many = table({str(v): {"eval/success": v / 100} for v in range(0, 100, 10)})  # the first, then the latest
    assert "before (v0)" in many and "v10 " not in many and "v50" in many and "after (v90)" in many


def _stub_run(tmp_path, keep_last: int = 1):
    """A TrainingRun with its collaborators stubbed: the run's bookkeeping alone."""
    import time
    from types import SimpleNamespace

    from lightning_harness.trainer.checkpoint import step_dir
    from lightning_harness.trainer.loop import TrainingRun, write_json_atomic

    ck = tmp_path / "checkpoints"
    run = object.__new__(TrainingRun)
    run.run_dir, run.ckpt_dir, run.traces = tmp_path, ck, tmp_path / "traces"
    run.cfg = SimpleNamespace(checkpoint=SimpleNamespace(keep_last=keep_last),
                              proxy=SimpleNamespace(drain_timeout_s=1, in_flight="drain"),
                              steps=5, eval=SimpleNamespace(every=1, after=True, success_threshold=0.5))
    step_dir(ck, 1).mkdir(parents=True)
    run.state = {"step": 1, "model_version": 1, "checkpoint": str(step_dir(ck, 1)), "base_model": str(tmp_path)}
    write_json_atomic(tmp_path / "state.json", run.state)
    quiet = SimpleNamespace(pause=lambda: None, resume=lambda: None, drain=lambda timeout: {"drained": True},
                            set_model_version=lambda v: None, state=lambda: {}, update=lambda **k: None)
    run.proxy, run.progress = SimpleNamespace(control=quiet), quiet

    def engine_swap(step, table, version, rep):
        step_dir(ck, step).mkdir(parents=True)
        return version + 1, step_dir(ck, step)

    run._engine_swap = engine_swap
    run._clock, run.reports = (time.monotonic(), 0.0), []
    return run


def test_a_swap_never_prunes_the_checkpoint_the_state_file_names(tmp_path):
    """keep_last 1: until the step is recorded, state.json names the previous checkpoint; a crash
    in between must leave it to resume from (prune deleted it)."""
    import json
    from pathlib import Path

    run = _stub_run(tmp_path, keep_last=1)
    run.swap(2, None, 1)
    on_disk = json.loads((tmp_path / "state.json").read_text())
    assert Path(on_disk["checkpoint"]).is_dir()


def test_a_step_is_recorded_before_its_eval(tmp_path):
    """The eval crashes after the swap: state.json already says this step and its version, so a
    resume goes on from the new weights instead of giving their version number to other weights."""
    import json
    from types import SimpleNamespace

    run = _stub_run(tmp_path)
    group = SimpleNamespace(group_id="g", rollouts=[SimpleNamespace(reward=1.0, ok=True, duration_s=1.0)])
    run.collect = lambda step: [group]
    run._check_failures = lambda groups, first: None
    run.scheduler = SimpleNamespace(in_flight={}, discarded=3, stream=SimpleNamespace(pos=7))

    def update_phase(step, groups):
        return run.swap(step, None, run.version)

    def evaluate(version):
        raise RuntimeError("killed during the eval")

    run.update_phase, run.evaluate = update_phase, evaluate
    with pytest.raises(RuntimeError, match="killed"):
        run.step(2)
    on_disk = json.loads((tmp_path / "state.json").read_text())
    assert (on_disk["step"], on_disk["model_version"], on_disk["stream_pos"]) == (2, 2, 7)
    assert on_disk["checkpoint"].endswith("step-000002")
    assert on_disk["discarded_groups"] == 3  # cumulative: --resume starts counting from it


def test_the_loops_rollouts_stop_when_its_harness_service_died(tmp_path):
    """Every rollout after a dead harness service fails at once (its harness cannot connect); the
    loop's batches had no health check for it, so past the first step the run went on to its end
    training on nothing. Now a batch of the loop aborts, naming the service and its log."""
    import os
    import signal
    import sys
    import time
    from pathlib import Path
    from types import SimpleNamespace

    from lightning_harness.launcher.batch import BatchAborted, run_batch
    from lightning_harness.trainer.loop import TrainingRun

    echo = Path(__file__).parent / "support" / "echo_service.py"
    (tmp_path / "train.jsonl").write_text('{"id": "t0"}\n')
    p = write_cfg(tmp_path, BASE + f"run_dir: {tmp_path / 'run'}\n")
    cfg = C.load_config(p, [f"harness.service={sys.executable} {echo}"])
    run = TrainingRun(cfg)
    run.logs.mkdir(parents=True)
    run.progress = SimpleNamespace(update=lambda **k: None, print=lambda *a, **k: None)
    run.start_harness_service()
    try:
        command, settings = run._harness_phase([sys.executable, "-c", "import time; time.sleep(30)"], 1.0,
                                               run_id="r", samples=1, split="train")
        os.kill(run.service.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(BatchAborted, match="harness service exited"):  # before the fix: ran to the end
            run_batch([{"id": "t0"}], command, settings)
        assert time.monotonic() - t0 < 20
    finally:
        run.service.stop(grace=1)
