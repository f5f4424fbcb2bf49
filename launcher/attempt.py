"""One attempt of one rollout: its folder, its environment, running it, and what its end means.

Why apart from the scheduler (batch.py): this is the part that defines the product's promise to a
harness (Contract 2) and to the trainer (state, reward, never a silent 0); scheduling only decides
when it happens. Runners (local.py, k8s.py) only start and stop things.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .command import render_command, substitute
from .identity import RolloutSpec
from .local import AttemptJob, AttemptOutcome
from .proxy_link import ProxyLink
from .results import CANCELLED, FAILED, NO_REWARD, SUCCEEDED, TIMED_OUT, RolloutResult
from .rewards import SELF_SOURCES, Reward, RewardError, RewardsTable, latest, read_reward_file, run_reward_cmd

log = logging.getLogger("lightning.launcher")
WORK_DIR = "launch"  # TRACES/launch/<run_id>/<rollout_id>/<attempt>/ holds task.json, reward.json, harness.log, out/
NO_REWARD_ERROR = "no reward reported (no reward file, nothing POSTed to LIGHTNING_REWARD_URL)"
SELF_REWARD_OFF = "no verifier reward: self-reports are off (--no-self-reward) and there is no --reward-cmd"


@dataclass
class AttemptSettings:
    """What every attempt of a batch shares."""

    traces_dir: Path
    harness: Sequence[str] | str | None
    runner: Any
    proxy: ProxyLink | None
    reward_table: RewardsTable
    timeout: float | None = None
    cwd: str | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    reward_cmd: str | None = None
    reward_timeout: float = 300.0
    self_reward: bool = True  # may the harness's own report (file, POST) be the reward when there is no reward_cmd


def attempt_dir(traces_dir: Path, spec: RolloutSpec, attempt: int) -> Path:
    return Path(traces_dir) / WORK_DIR / spec.run_id / spec.rollout_id / str(attempt)


def make_result(spec: RolloutSpec, attempt: int, state: str, outcome: AttemptOutcome | None, started, ended, *,
                runner: str, reward: Reward | None = None, error: str | None = None,
                log_path: Path | None = None, model_version: int | None = None) -> RolloutResult:
    return RolloutResult(
        rollout_id=spec.rollout_id, attempt=attempt, run_id=spec.run_id, task_id=spec.task.id,
        group_id=spec.group_id, sample_index=spec.sample_index, step=spec.step, split=spec.split,
        state=state, exit_code=outcome.exit_code if outcome else None, started_at=started, ended_at=ended,
        duration_s=(ended - started).total_seconds(), reward=reward.value if reward else None,
        reward_source=reward.source if reward else None, error=error,
        log_path=str(log_path) if log_path else None, model_version=model_version,
        runner=runner, task_json=spec.task.to_json(),
    )


def run_attempt(s: AttemptSettings, spec: RolloutSpec, attempt: int, cancel, model_version: int | None) -> tuple[RolloutResult, Reward | None]:
    """Prepare, run and judge one attempt; returns its row and the reward (if any)."""
    work = attempt_dir(s.traces_dir, spec, attempt)
    out_dir = work / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    task_file, reward_file, log_path = work / "task.json", work / "reward.json", work / "harness.log"
    task_json = spec.task.to_json()
    task_file.unlink(missing_ok=True)  # a link planted here (by another harness) is replaced, not followed
    task_file.write_text(task_json + "\n")
    reward_file.unlink(missing_ok=True)

    # paths as the harness sees them (a pod mounts them elsewhere)
    paths = getattr(s.runner, "harness_paths", None)
    inside = paths(work) if paths else {"task_file": str(task_file), "reward_file": str(reward_file), "output_dir": str(out_dir)}
    values: dict[str, Any] = dict(spec.task.fields)
    values.update(
        task_id=spec.task.id, rollout_id=spec.rollout_id, attempt=attempt, sample_index=spec.sample_index,
        group_id=spec.group_id, run_id=spec.run_id, split=spec.split, step="" if spec.step is None else spec.step,
        **inside,
    )
    env: dict[str, str] = dict(s.extra_env)
    if s.proxy is not None:
        view = getattr(s.runner, "proxy_view", None)
        env.update((view(s.proxy) if view else own_ca(s, work)).env_for(spec.rollout_id, attempt))
    env.update(
        LIGHTNING_ROLLOUT_ID=spec.rollout_id,
        LIGHTNING_ATTEMPT=str(attempt),
        LIGHTNING_RUN_ID=spec.run_id,
        LIGHTNING_TASK_ID=spec.task.id,
        LIGHTNING_GROUP_ID=spec.group_id,
        LIGHTNING_SAMPLE_INDEX=str(spec.sample_index),
        LIGHTNING_SPLIT=spec.split,
        LIGHTNING_STEP="" if spec.step is None else str(spec.step),
        LIGHTNING_TASK=task_json,
        LIGHTNING_TASK_FILE=inside["task_file"],
        LIGHTNING_REWARD_FILE=inside["reward_file"],
        LIGHTNING_OUTPUT_DIR=inside["output_dir"],
    )
    if model_version is not None:
        env["LIGHTNING_MODEL_VERSION"] = str(model_version)
    files = {"task.json": task_file}
    if s.proxy is not None and Path(s.proxy.ca_bundle).exists():
        files["ca-bundle.pem"] = Path(s.proxy.ca_bundle)
    job = AttemptJob(
        rollout_id=spec.rollout_id, attempt=attempt,
        command=render_command(s.harness, values) if s.harness else None, env=env, workdir=work,
        log_path=log_path, timeout=s.timeout, cwd=s.cwd, task_json=task_json,
        labels={"run_id": spec.run_id, "task_id": spec.task.id, "group_id": spec.group_id}, files=files,
    )
    outcome = s.runner.run(job, cancel)
    ended_mono = time.monotonic()
    if s.proxy is not None:  # the harness is gone: its credential dies before any reward is judged
        problem = s.proxy.end_attempt(spec.rollout_id, attempt)
        if problem:
            log.warning("%s", problem)

    reward: Reward | None = None
    error = outcome.error
    if outcome.cancelled:
        state = CANCELLED
    elif outcome.timed_out:
        state = TIMED_OUT
    elif outcome.error or outcome.exit_code != 0:
        state = FAILED
    else:
        reward, error = collect_reward(s, spec, attempt, work, outcome, ended_mono)
        state = SUCCEEDED if reward is not None else NO_REWARD
    result = make_result(spec, attempt, state, outcome, outcome.started_at, outcome.ended_at,
                         runner=getattr(s.runner, "name", "local"), reward=reward, error=error,
                         log_path=log_path, model_version=model_version)
    return result, reward


def own_ca(s: AttemptSettings, work: Path) -> ProxyLink:
    """The proxy link, with the CA bundle copied into the attempt folder when the harness runs as
    another user (--run-as): the proxy's confdir (root's home by default) is not that user's to read."""
    if not getattr(s.runner, "run_as", None) or not Path(s.proxy.ca_bundle).is_file():
        return s.proxy
    copy = work / "ca-bundle.pem"
    copy.unlink(missing_ok=True)
    shutil.copyfile(s.proxy.ca_bundle, copy)
    os.chmod(copy, 0o644)
    return dataclasses.replace(s.proxy, ca_bundle=str(copy))


def collect_reward(s: AttemptSettings, spec: RolloutSpec, attempt: int, work: Path, outcome: AttemptOutcome,
                   ended_mono: float) -> tuple[Reward | None, str | None]:
    """The attempt's reward by rank (launcher/rewards.py): verifier (command, api) over the harness's own
    report (file, proxy), which counts only without --reward-cmd and with self-rewards on.
    Errors are kept, never turned into 0."""
    def lookup(sources: tuple[str, ...]) -> Reward | None:
        return s.reward_table.lookup(spec.rollout_id, attempt, ended_mono=ended_mono, sources=sources)

    errors: list[str] = []
    if s.reward_cmd:
        try:
            return score(s, spec, attempt, work, outcome), None
        except RewardError as exc:
            errors.append(str(exc))
    operator = lookup(("api",))  # the operator's word ranks with the verifier (and is latest when the scorer failed)
    if operator is not None:
        return operator, None
    if s.reward_cmd:
        return None, "; ".join(errors)
    if not s.self_reward:
        claimed = lookup(SELF_SOURCES) or (outcome.reward_file_local and (work / "reward.json").exists())
        return None, SELF_REWARD_OFF + ("; the harness's own report was ignored" if claimed else "")
    from_file = None
    if outcome.reward_file_local:
        try:
            from_file = read_reward_file(work / "reward.json")
        except RewardError as exc:
            errors.append(str(exc))
    reward = latest(from_file, lookup(("proxy",)))
    if reward is not None:
        return reward, None
    if s.reward_table.flush_errors:
        errors.append(f"the proxy's flush failed {s.reward_table.flush_errors} time(s)")
    return None, "; ".join(errors) or NO_REWARD_ERROR


def score(s: AttemptSettings, spec: RolloutSpec, attempt: int, work: Path, outcome: AttemptOutcome) -> Reward:
    """Run ``--reward-cmd`` (the verifier) on a finished attempt; raises RewardError when it gives no reward."""
    log_path = work / "harness.log"
    # the scorer is ours: local paths, and it does not go through the capture proxy
    env = {
        "LIGHTNING_ROLLOUT_ID": spec.rollout_id, "LIGHTNING_ATTEMPT": str(attempt),
        "LIGHTNING_TASK_ID": spec.task.id, "LIGHTNING_TASK": spec.task.to_json(),
        "LIGHTNING_TASK_FILE": str(work / "task.json"), "LIGHTNING_OUTPUT_DIR": str(work / "out"),
        "LIGHTNING_REWARD_FILE": str(work / "reward.json"), "LIGHTNING_LOG_FILE": str(log_path),
        "LIGHTNING_EXIT_CODE": str(outcome.exit_code),
    }
    values = dict(spec.task.fields)
    values.update(task_id=spec.task.id, rollout_id=spec.rollout_id, attempt=attempt, output_dir=str(work / "out"),
                  task_file=str(work / "task.json"), log_file=str(log_path))
    return run_reward_cmd(substitute(s.reward_cmd, values, quote=True), env, timeout=s.reward_timeout,
                          cwd=s.cwd, log_path=log_path)
