"""The training loop stops before building samples when the proxy could not record the phase.

A real proxy process whose disk is full (fixtures_disk.py); the vLLM engine and the launcher are
replaced by a recorder (no vLLM here: tests marked `vllm` run the whole loop), since the part
under test is the loop's update phase reading the proxy's health.
"""

from __future__ import annotations

import io

import httpx
import pytest
from rich.console import Console

from lightning_harness.proxy.health import CaptureUnhealthy
from lightning_harness.trainer import config as C
from lightning_harness.trainer.loop import TrainingRun

pytestmark = pytest.mark.timeout(120)


class Recorder:
    """Stands in for the engine, the launcher and the progress line: records what the loop calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def record(*args, **kwargs):
            self.calls.append(name)
            return False

        return record


def test_update_phase_stops_on_an_unhealthy_proxy(make_proxy, small_disk, tmp_path):
    cfg_path = tmp_path / "cfg.yaml"
    (tmp_path / "model").mkdir()
    cfg_path.write_text('model: model\nharness: {command: ["x"]}\ntasks: {train: t.jsonl}\nupdate: {lr: 1.0e-5}\n')
    run = TrainingRun(C.load_config(cfg_path), console=Console(file=io.StringIO()))
    run.proxy = make_proxy(traces_dir=small_disk.path / "traces", flush_seconds=0.2,
                           extra_args=["--capture-failure", "serve"])
    run.engine, run.runner, run.progress = Recorder(), Recorder(), Recorder()
    run.device, run.state = "cpu", {"model_version": 0}
    small_disk.fill()
    url = run.proxy.env_for("r")["OPENAI_BASE_URL"] + "/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json=body, timeout=60, trust_env=False).status_code == 200  # served, not on disk
    with pytest.raises(CaptureUnhealthy, match="spans cannot be written .*No space.*1 spans pending"):
        run.update_phase(1, [])
    assert "flush" not in run.runner.calls  # stopped before the launcher's rows and the samples
    # samples come before the hold: nothing was paused, so nothing is left paused
    assert "pause" not in run.engine.calls
    assert not run.proxy.control.state()["paused"]
    assert not (run.traces / "samples").exists()
