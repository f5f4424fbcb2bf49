"""The run config through the real CLI (`lightning-train run --print-config`): YAML + --set resolved and
printed, and every mistake refused before anything starts, with the key, the value and what was expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_harness.trainer import config as C

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
model: model
harness: {command: ["{python}", "h.py"]}
tasks: {train: train.jsonl}
update: {lr: 1.0e-5}
eval:
"""


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_harness.trainer.cli", "run", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG)
    return path


def test_print_config_shows_the_file_with_its_overrides_and_reads_back(config_file, tmp_path):
    overrides = ["update.lr=2e-5", "rollout.mode=async", "update.betas=[0.8, 0.9]"]
    res = train("--config", str(config_file), *[arg for o in overrides for arg in ("--set", o)], "--print-config")
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    assert printed["update"]["lr"] == 2e-5 and printed["update"]["betas"] == [0.8, 0.9]
    assert printed["rollout"]["mode"] == "async" and printed["model"] == "model"
    assert printed["eval"] == C.EvalConfig().__dict__  # an empty section means its defaults
    assert printed["base_dir"] == str(tmp_path)  # relative paths resolve against the file's folder
    copy = tmp_path / "printed.yaml"
    copy.write_text(res.stdout)
    assert C.load_config(copy, base_dir=tmp_path).to_dict() == C.load_config(config_file, overrides).to_dict()


def test_print_config_without_a_file_prints_every_default():
    res = train("--print-config")
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout) == C.RunConfig().to_dict()


@pytest.mark.parametrize("override, expected", [
    ("update.lr_rate=1", "unknown key 'update.lr_rate' (did you mean 'lr'?)"),
    ("rollout.group_sise=2", "unknown key 'rollout.group_sise' (did you mean 'group_size'?)"),
    ("stpes=3", "unknown key 'stpes' (did you mean 'steps'?)"),
    ("update.lr=abc", "update.lr: input should be a valid number, unable to parse string as a number, got 'abc'"),
    ("steps=many", "steps: input should be a valid integer, unable to parse string as an integer, got 'many'"),
    ("rollout.mode=fast", "rollout.mode: input should be 'sync' or 'async', got 'fast'"),
    ("samples.mode=trajectroy", "samples.mode: input should be 'trajectory' or 'transition', got 'trajectroy'"),
    ("samples.advantage=ppo", "samples.advantage: input should be 'grpo' or 'rloo', got 'ppo'"),
    ("rollout.group_size=0", "rollout.group_size: input should be greater than or equal to 1, got 0"),
    ("harness.self_reward=maybe", "harness.self_reward: input should be a valid boolean"),
    ("update=3", "update: expected a mapping of ['autocast', 'betas',"),
])
def test_a_mistake_in_set_names_the_key_the_value_and_what_was_expected(config_file, override, expected):
    res = train("--config", str(config_file), "--set", override, "--print-config")
    assert res.returncode == 2 and expected in res.stderr, res.stderr


def test_a_typo_in_the_file_is_named_and_every_problem_comes_at_once(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.replace("update: {lr: 1.0e-5}", "update: {lr: fast, lr_shedule: cosine}"))
    res = train("--config", str(path), "--set", "engine.sleep_on_update=sometimes")
    assert res.returncode == 2
    for line in ("unknown key 'update.lr_shedule' (did you mean 'lr_schedule'?)",
                 "update.lr: input should be a valid number", "got 'fast'",
                 "engine.sleep_on_update: input should be 'auto', 'always' or 'never', got 'sometimes'"):
        assert line in res.stderr, res.stderr


def test_a_run_needs_its_essentials_but_print_config_does_not(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("steps: 2\n")
    res = train("--config", str(path))
    assert res.returncode == 2
    for key in ("model: required", "harness.command: required", "tasks.train: required"):
        assert key in res.stderr, res.stderr
    assert train("--config", str(path), "--print-config").returncode == 0


@pytest.mark.parametrize("name", ["calc", "swe"])
def test_the_example_configs_load(name):
    cfg = C.load_config(ROOT / "examples" / name / "config.yaml")
    assert cfg.model and cfg.harness.command and cfg.tasks.train
    assert cfg.base_dir == str(ROOT / "examples" / name)


def test_set_with_a_mapping_merges_into_the_files_section():
    base = {"update": {"lr": 3e-5, "batch_size": 4}, "steps": 2}
    assert C.parse_overrides(["update={lr: 1.0e-5}", "steps=5"], base) == {
        "update": {"lr": 1e-5, "batch_size": 4}, "steps": 5}  # the file's other update keys stay
    assert base == {"update": {"lr": 3e-5, "batch_size": 4}, "steps": 2}  # the file's mapping is not changed
    assert C.parse_overrides(["update.lr=2"], {"update": None}) == {"update": {"lr": 2}}  # 'update:' left empty


def test_a_harness_service_cannot_serve_harnesses_run_as_other_users(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("model: m\ntasks: {train: t.jsonl}\nharness: {command: [a], service: [b], run_as: nobody}\n")
    res = train("--config", str(path))
    assert res.returncode == 2 and "harness.service cannot be combined with harness.run_as" in res.stderr, res.stderr


def test_the_update_computes_logprobs_at_the_rollout_temperature_unless_told(config_file):
    """The engine records the logprobs of the distribution it sampled from (launcher/engine.py): an update
    at temperature 1 after rollouts at 0.5 took every sample for off-policy (importance weights of
    pi_1 / pi_0.5); ``update.temperature`` left unset follows ``rollout.temperature``."""
    assert C.load_config(config_file, ["rollout.temperature=0.5"]).update.temperature == 0.5
    assert C.load_config(config_file).update.temperature == 1.0
    told = C.load_config(config_file, ["rollout.temperature=0.5", "update.temperature=0.7"])
    assert told.update.temperature == 0.7
    assert C.load_config(config_file, ["rollout.temperature=0"]).update.temperature is None  # greedy: 1 in update.py
    res = train("--config", str(config_file), "--set", "update.temperature=0", "--print-config")
    assert res.returncode == 2 and "update.temperature" in res.stderr, res.stderr


@pytest.mark.parametrize("override, expected", [
    ("samples.extra.reward_clip=[1, 0]", "samples.extra: reward_clip must be two finite numbers with low < high"),
    ("samples.extra.failed_polciy=keep", "unknown key 'samples.extra.failed_polciy' (did you mean 'failed_policy'?)"),
    ("samples.extra.failed_policy=penalise", "samples.extra: unknown failed policy 'penalise'"),
    ("samples.extra.mode=transition", "samples.extra: mode set by the loop (use samples.<key>"),
    ("samples.extra.failed_policy=penalize", "samples.extra: failed_policy 'penalize' needs an explicit finite"),
    ("samples.extra.failed_reward=abc", "samples.extra: failed_reward must be a finite number, got 'abc'"),
    ("samples.extra.epsilon=abc", "samples.extra: epsilon must be a finite number >= 0, got 'abc'"),
    ("samples.extra.drift_check=-5", "samples.extra: drift_check must be a whole number >= 0, got -5"),
    ("samples.extra.reward_clip=01", "samples.extra: reward_clip must be two numbers [low, high] (or null), got 1"),
    ("samples.extra={1: 2, a: 3}", "unknown key 'samples.extra.1'"),
])
def test_a_bad_samples_extra_fails_at_load_not_at_the_first_update(config_file, override, expected):
    """``samples.extra`` goes to ``build_samples`` at each update: checked when the config loads, before
    vLLM starts or a rollout runs."""
    res = train("--config", str(config_file), "--set", override)
    assert res.returncode == 2 and expected in res.stderr, res.stderr
    good = C.load_config(config_file, ["samples.extra.reward_clip=[0, 1]", "samples.extra.failed_policy=keep"])
    assert good.samples.extra == {"reward_clip": [0, 1], "failed_policy": "keep"}
