"""Trackers, metrics and the run report against odd or hostile input: secrets in the run config
and on the command line, metric names MLflow refuses, numpy scalars, rows without a step, huge
rewards, a run folder whose name is not UTF-8, a run name that climbs out of the tracker folder."""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
from pathlib import Path

import pytest
from fixtures_traces import rollout, write_traces

from lightning_harness.schemas import PartWriter
from lightning_harness.trainer.metrics import MetricsLog, read_metrics
from lightning_harness.trainer.trackers import open_trackers

KEY = "sk-proj-Ab3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5bC7"
SECRETS = ("hunter2-env", "hunter2-flag", "hunter2-url", "hunter2-inline", KEY)
CONFIG = {"harness": {"env": {"OPENAI_API_KEY": "hunter2-env", "PATH": "/usr/bin"},
                      "command": ["agent", "--api-key", "hunter2-flag", "--max-tokens", "{max_tokens}"],
                      "reward_cmd": f"HF_TOKEN=hunter2-inline verify --model {KEY}"},
          "engine": {"url": "http://bob:hunter2-url@vllm:8000/v1", "max_model_len": 1024},
          "update": {"lr": 0.01}}


@pytest.fixture
def local_trackers(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)


def files_holding(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_the_config_a_tracker_stores_has_no_secrets():
    from lightning_harness.trainer.trackers import public_config

    shown = public_config(CONFIG)
    assert not any(s in repr(shown) for s in SECRETS), shown
    assert shown["harness"]["env"]["PATH"] == "/usr/bin" and shown["update"] == {"lr": 0.01}
    assert shown["harness"]["command"][3:] == ["--max-tokens", "{max_tokens}"]
    assert shown["engine"] == {"url": "http://bob:[REDACTED]@vllm:8000/v1", "max_model_len": 1024}


def test_wandb_files_hold_no_secret_from_the_config_or_the_command_line(tmp_path, monkeypatch, local_trackers):
    pytest.importorskip("wandb")
    monkeypatch.setattr(sys, "argv", ["lightning-train", "run", "--set", "harness.env.GH_TOKEN=hunter2-argv"])
    trackers = open_trackers(["wandb"], tmp_path, "r", config=CONFIG)
    trackers["wandb"].log(1, {"a": 1.0})
    trackers["wandb"].close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    for secret in (*SECRETS, "hunter2-argv"):
        assert files_holding(tmp_path, secret) == [], secret


def test_mlflow_keeps_every_param_and_metric_without_secrets(tmp_path, local_trackers):
    """No secret in the params; all of a config over MLflow's 100-params batch; names MLflow refuses
    are renamed, not the reason the tracker is switched off for the rest of the run."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    config = {**CONFIG, "extra": {f"k{i:03d}": i for i in range(150)}}
    warnings = []
    log = MetricsLog(tmp_path / "traces", "r", open_trackers(["mlflow"], tmp_path / "t", "r", config=config),
                     warn=warnings.append)
    log.log(1, {"ok": 1.0, "pass@k (mean)": 0.5, "a/../b": 2.0})
    log.log(2, {"ok": 2.0})
    log.close()
    assert warnings == []
    client = MlflowClient(tracking_uri=(tmp_path / "t" / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("lightning-harness").experiment_id])
    assert run.data.params["extra.k149"] == "149" and run.data.params["update.lr"] == "0.01"
    assert not any(s in v for s in SECRETS for v in run.data.params.values())
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "ok")] == [(1, 1.0), (2, 2.0)]
    assert run.data.metrics["pass_k _mean_"] == 0.5 and run.data.metrics["a/_/b"] == 2.0


def test_a_run_name_cannot_put_tensorboard_files_outside_the_tracker_folder(tmp_path):
    pytest.importorskip("tensorboard")
    root = tmp_path / "a" / "b" / "trackers"
    trackers = open_trackers(["tensorboard"], root, "../../../escaped")
    trackers["tensorboard"].log(1, {"a": 1.0})
    trackers["tensorboard"].close()
    assert not (tmp_path / "escaped").exists()
    assert [p.parent.name for p in root.rglob("events.out.tfevents.*")] == ["..-..-..-escaped"]


def test_numpy_and_torch_scalars_are_logged_not_dropped(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    log = MetricsLog(tmp_path, "r")
    log.log(1, {"f32": np.float32(0.5), "i64": np.int64(3), "b": np.bool_(True), "t": torch.tensor(0.25),
                "vector": np.array([1.0, 2.0]), "text": "x"})
    log.close()
    assert read_metrics(tmp_path, "r") == {"f32": {1: 0.5}, "i64": {1: 3.0}, "b": {1: 1.0}, "t": {1: 0.25}}


def test_a_metric_row_without_a_step_stops_neither_the_plot_nor_the_report(tmp_path):
    from lightning_harness.trainer.plot import plot_rewards
    from lightning_harness.trainer.report import collect

    traces = write_traces(tmp_path / "run" / "traces", rollouts=[rollout("r1", reward=1.0)])
    now = dt.datetime.now(dt.UTC)
    with PartWriter(traces, "metrics", background=False) as w:
        w.extend([{"run_id": "r", "step": None, "name": "train/reward_mean", "value": 9.0, "at": now},
                  {"run_id": "r", "step": 1, "name": "train/reward_mean", "value": 0.5, "at": now}])
    assert read_metrics(traces) == {"train/reward_mean": {1: 0.5}}
    assert plot_rewards(traces, tmp_path / "curve.png").is_file()
    assert collect(tmp_path / "run")["steps"]["rows"] == [[1, 0.5]]


def test_huge_rewards_keep_every_point_of_the_curve_on_the_page():
    from lightning_harness.trainer.report import curve

    c = curve({"train/reward_mean": [[1, 0.5], [2, -1e308]], "eval/reward_mean": [[1, 1e308]]})
    coords = [v for line in c["lines"] for x, y, _, _ in line["points"] for v in (x, y)]
    coords += [y for y, _ in c["yticks"]]
    assert all(math.isfinite(v) for v in coords), coords
    assert [label for _, label in c["yticks"]] == ["-1e+308", "-5e+307", "0", "5e+307", "1e+308"]


def test_a_run_folder_whose_name_is_not_utf8_gets_its_report(tmp_path):
    from lightning_harness.trainer.report import write_report

    run = Path(os.fsdecode(os.fsencode(tmp_path) + b"/run-\xff"))
    run.mkdir()
    (run / "spans").mkdir()  # a traces directory (its parts cannot be read under this name: schemas/checked.py)
    out = write_report(run, tmp_path / "p.html")
    assert "run-?" in out.read_text(encoding="utf-8")


def test_the_report_holds_one_rollouts_calls_at_a_time(tmp_path):
    """Every request repeats the context so far: holding all picked rollouts' requests at once costs
    their whole size (gigabytes for long agent runs); the page keeps only what each call added."""
    import json
    import tracemalloc

    from fixtures_traces import span

    from lightning_harness.trainer.report import collect

    text, spans, size = "x" * 5_000, [], 0
    for r in range(30):
        msgs = []
        for c in range(20):
            msgs += [{"role": "user", "content": f"{r}/{c} {text}"}, {"role": "assistant", "content": "ok"}]
            spans.append(span(f"r{r}", c, [1], [2], request_json=json.dumps({"model": "m", "messages": msgs[:-1]})))
            size += len(spans[-1]["request_json"])
    write_traces(tmp_path / "traces", spans=spans, rollouts=[rollout(f"r{r}", reward=1.0) for r in range(30)])
    del spans
    tracemalloc.start()
    try:
        page = collect(tmp_path / "traces")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(page["rollouts"]) == 30 and all(len(r["calls"]) == 20 for r in page["rollouts"])
    assert peak < size / 3, (peak, size)
