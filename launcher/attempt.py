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
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_harness.schemas.rewards import SELF_SOURCES, RewardError
from lightning_harness.schemas.states import RolloutState

from .command import render_command, substitute
from .identity import RolloutSpec
from .local import MAX_LOG_BYTES, AttemptJob, AttemptOutcome
from .proxy_link import ProxyLink
from .results import RolloutResult
from .rewards import Reward, RewardCancelled, RewardsTable, read_reward_file, run_reward_cmd, winner

if TYPE_CHECKING:
    from .batch import BatchSettings

log = logging.getLogger("lightning.launcher")
WORK_DIR = "launch"  # TRACES/launch/<run_id>/<rollout_id>/<attempt>/ holds task.json, reward.json, harness.log, out/
NO_REWARD_ERROR = "no reward reported (no reward file, nothing POSTed to LIGHTNING_REWARD_URL)"
SELF_REWARD_OFF = "no verifier reward: self-reports are off (--no-self-reward) and there is no --reward-cmd"


@dataclass
class AttemptSettings:
    """What every attempt of a batch shares: the batch's settings and what the batch runner built from them."""

    batch: BatchSettings
    harness: Sequence[str] | str | None
    runner: Any
    proxy: ProxyLink | None
    reward_table: RewardsTable


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
        runner=runner, task_json=spec.task.public_json(),  # the traces are readable by a harness user
    )


def run_attempt(s: AttemptSettings, spec: RolloutSpec, attempt: int, cancel,
                model_version: int | None) -> tuple[RolloutResult, Reward | None]:
    """Prepare, run and judge one attempt; returns its row and the reward (if any)."""
    work = attempt_dir(s.batch.traces_dir, spec, attempt)
    (work / "out").mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o700)  # what a harness leaves there (a setuid binary, its files) is no other user's to reach
    task_file, log_path = work / "task.json", work / "harness.log"
    fields, seen = spec.task.public, spec.task.public_json()  # private fields are the reward's alone
    write_task_file(task_file, seen)
    (work / "reward.json").unlink(missing_ok=True)
    paths_in = getattr(s.runner, "harness_paths", None)  # paths as the harness sees them (a pod mounts them elsewhere)
    paths = paths_in(work) if paths_in else local_paths(work)
    named = named_values(spec, attempt, paths)
    env = {**(s.batch.extra_env or {}), **proxy_env(s, spec, attempt, work), **contract_env(named, seen, model_version)}
    files = {"task.json": task_file}
    if s.proxy is not None and Path(s.proxy.ca_bundle).exists():
        files["ca-bundle.pem"] = Path(s.proxy.ca_bundle)
    job = AttemptJob(
        rollout_id=spec.rollout_id, attempt=attempt,
        command=render_command(s.harness, {**fields, **named}) if s.harness else None, env=env, workdir=work,
        log_path=log_path, timeout=s.batch.timeout, cwd=s.batch.cwd, task_json=seen,
        labels={"run_id": spec.run_id, "task_id": spec.task.id, "group_id": spec.group_id}, files=files,
    )
    outcome = None
    try:
        outcome = s.runner.run(job, cancel)
    finally:  # the harness is gone: its credential dies before any reward is judged, whatever the runner raised
        ended_mono = time.monotonic()
        if s.proxy is not None:
            outcome = revoke_credential(s.proxy, spec, attempt, outcome)
    state, reward, error = judge(s, spec, attempt, work, outcome, ended_mono, cancel)
    result = make_result(spec, attempt, state, outcome, outcome.started_at, outcome.ended_at,
                         runner=getattr(s.runner, "name", "local"), reward=reward, error=error,
                         log_path=log_path, model_version=model_version)
    return result, reward


def revoke_credential(proxy, spec: RolloutSpec, attempt: int,
                      outcome: AttemptOutcome | None) -> AttemptOutcome | None:
    """End the attempt's credential at the proxy (one retry). An attempt whose credential outlives it
    is not judged: whatever it left running could still record calls into the trajectory or post a
    reward the scorer never saw, so it ends failed (a retry policy gives the rollout a new attempt).
    ``outcome`` is None when the runner raised: the credential is ended all the same."""
    problem = proxy.end_attempt(spec.rollout_id, attempt)
    if problem:
        time.sleep(0.5)
        problem = proxy.end_attempt(spec.rollout_id, attempt)
    if problem:
        log.warning("%s", problem)
    if not problem or outcome is None:
        return outcome
    reason = f"{problem}; not judged, since its credential still records calls"
    return dataclasses.replace(outcome, error=f"{outcome.error}; {reason}" if outcome.error else reason)


def judge(s: AttemptSettings, spec: RolloutSpec, attempt: int, work: Path, outcome: AttemptOutcome,
          ended_mono: float, cancel=None) -> tuple[RolloutState, Reward | None, str | None]:
    """The attempt's state from how it ended; only a harness that exited 0 is scored (a cancel
    that stops the scorer leaves it cancelled: not judged)."""
    if outcome.cancelled:
        return RolloutState.CANCELLED, None, outcome.error
    if outcome.timed_out:
        return RolloutState.TIMED_OUT, None, outcome.error
    if outcome.error or outcome.exit_code != 0:
        return RolloutState.FAILED, None, outcome.error
    try:
        reward, error = collect_reward(s, spec, attempt, work, outcome, ended_mono, cancel)
    except RewardCancelled as exc:
        return RolloutState.CANCELLED, None, str(exc)
    return (RolloutState.SUCCEEDED if reward is not None else RolloutState.NO_REWARD), reward, error


# -- Contract 2, the launcher's part: who the attempt is, its task, its files ---------------------------
def write_task_file(path: Path, row_json: str) -> None:
    path.unlink(missing_ok=True)  # a link planted here (by a harness) is replaced, not followed
    path.write_text(row_json + "\n")


def local_paths(work: Path) -> dict[str, str]:
    return {"task_file": str(work / "task.json"), "reward_file": str(work / "reward.json"),
            "output_dir": str(work / "out")}


def named_values(spec: RolloutSpec, attempt: int, paths: Mapping[str, str]) -> dict[str, Any]:
    """Who the attempt is and where its files are: ``{placeholders}`` of the harness and reward
    command lines, and (upper-cased, by :func:`contract_env`) ``LIGHTNING_*`` variables."""
    return {"rollout_id": spec.rollout_id, "attempt": attempt, "run_id": spec.run_id, "task_id": spec.task.id,
            "group_id": spec.group_id, "sample_index": spec.sample_index, "split": spec.split,
            "step": "" if spec.step is None else spec.step, **paths}


def contract_env(named: Mapping[str, Any], task_json: str, model_version: int | None = None) -> dict[str, str]:
    """The launcher's part of Contract 2 (the proxy's part: ``proxy.client.harness_env``), for a harness
    and for a reward command: ``LIGHTNING_<NAME>`` for each of :func:`named_values`, the task row (a
    harness's without the task's private fields), the model version."""
    env = {f"LIGHTNING_{k.upper()}": str(v) for k, v in named.items()}
    env["LIGHTNING_TASK"] = task_json
    if model_version is not None:
        env["LIGHTNING_MODEL_VERSION"] = str(model_version)
    return env


def proxy_env(s: AttemptSettings, spec: RolloutSpec, attempt: int, work: Path) -> dict[str, str]:
    """The proxy's part of Contract 2 (``proxy.client.harness_env``) as this runner's harness reaches it:
    a pod through the runner's view of the proxy; a harness run as another user (--run-as) with the CA
    bundle copied into the attempt folder (the proxy's confdir, root's home by default, is not its to read)."""
    if s.proxy is None:
        return {}
    link = s.proxy
    if getattr(s.runner, "proxy_view", None):
        link = s.runner.proxy_view(link)
    elif getattr(s.runner, "run_as", None) and Path(link.ca_bundle).is_file():
        copy = work / "ca-bundle.pem"
        copy.unlink(missing_ok=True)
        shutil.copyfile(link.ca_bundle, copy)
        os.chmod(copy, 0o644)
        link = dataclasses.replace(link, ca_bundle=str(copy))
    return link.env_for(spec.rollout_id, attempt)


def collect_reward(s: AttemptSettings, spec: RolloutSpec, attempt: int, work: Path, outcome: AttemptOutcome,
                   ended_mono: float, cancel=None) -> tuple[Reward | None, str | None]:
    """The attempt's reward by rank (schemas/rewards.py): verifier (command, api) over the harness's own
    report (file, proxy), which counts only without --reward-cmd and with self-rewards on.
    Errors are kept, never turned into 0."""
    def lookup(sources: tuple[str, ...]) -> Reward | None:
        return s.reward_table.lookup(spec.rollout_id, attempt, ended_mono=ended_mono, sources=sources)

    errors: list[str] = []
    if s.batch.reward_cmd:
        try:
            return score(s, spec, attempt, work, outcome, cancel), None
        except RewardError as exc:
            errors.append(str(exc))
    operator = lookup(("api",))  # the operator's word ranks with the verifier (and is latest when the scorer failed)
    if operator is not None:
        return operator, None
    if s.batch.reward_cmd:
        return None, "; ".join(errors)
    if not s.batch.self_reward:
        claimed = lookup(SELF_SOURCES) or (outcome.reward_file_local and (work / "reward.json").exists())
        return None, SELF_REWARD_OFF + ("; the harness's own report was ignored" if claimed else "")
    from_file = None
    if outcome.reward_file_local:
        try:
            from_file = read_reward_file(work / "reward.json")
        except RewardError as exc:
            errors.append(str(exc))
    reward = winner(from_file, lookup(("proxy",)))
    if reward is not None:
        return reward, None
    if s.reward_table.flush_errors:
        errors.append(f"the proxy's flush failed {s.reward_table.flush_errors} time(s)")
    return None, "; ".join(errors) or NO_REWARD_ERROR


def score(s: AttemptSettings, spec: RolloutSpec, attempt: int, work: Path, outcome: AttemptOutcome,
          cancel=None) -> Reward:
    """Run ``--reward-cmd`` (the verifier) on a finished attempt; raises RewardError when it gives no reward.

    The scorer is ours: it sees the whole task row (private fields too) in a file of its own outside
    the traces (``task.json`` there stays the public row the harness saw: a launcher killed while
    scoring leaves no private field where a harness user can read it), local paths, no capture proxy."""
    log_path, whole = work / "harness.log", spec.task.to_json()
    with tempfile.TemporaryDirectory(prefix="lightning-score-") as private:
        task_file = Path(private) / "task.json"
        try:
            task_file.write_text(whole + "\n")
        except OSError as exc:
            raise RewardError(f"cannot write the reward command's task file: {exc}") from None
        paths = {**local_paths(work), "task_file": str(task_file), "log_file": str(log_path)}
        named = named_values(spec, attempt, paths)
        env = {**contract_env(named, whole), "LIGHTNING_EXIT_CODE": str(outcome.exit_code)}
        try:
            line = substitute(s.batch.reward_cmd, {**spec.task.fields, **named}, quote=True)
        except ValueError as exc:  # a placeholder inside quotes
            raise RewardError(str(exc)) from None
        return run_reward_cmd(line, env,
                              timeout=s.batch.reward_timeout, cwd=s.batch.cwd, log_path=log_path,
                              max_log_bytes=getattr(s.runner, "max_log_bytes", MAX_LOG_BYTES), cancel=cancel)
