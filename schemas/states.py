"""Rollout states: the values of the ``rollouts.state`` column, and which of them mean what.

One ``StrEnum`` for the launcher that writes them and the trainer and SQL views that read them (a
member *is* its string, so Parquet and DuckDB see plain text). "Failure" means two things:
:data:`RETRY_FAILURES` use one of the rollout's retries; ``cancelled`` does not (stopping a batch is
not the rollout's fault: it neither uses a retry nor finishes the rollout, a re-run runs it again).
:data:`ABORTED` adds ``cancelled``: the harness did not run to its end, so the training failure
policy (``trainer.advantages.apply_failure_policy``) drops or penalises these. A rollout with a
:data:`FINISHED` attempt ran to its end; a re-run skips it.
"""

from __future__ import annotations

from enum import StrEnum


class RolloutState(StrEnum):
    SUCCEEDED = "succeeded"  # ran to its end with a reward
    NO_REWARD = "no_reward"  # ran to its end (exit 0) but no usable reward: never a silent 0
    FAILED = "failed"  # exited non-zero or could not start
    TIMED_OUT = "timed_out"  # killed at the attempt's time limit
    CANCELLED = "cancelled"  # stopped with its batch


SUCCEEDED, NO_REWARD, FAILED, TIMED_OUT, CANCELLED = RolloutState  # short names, for `state == FAILED`
FINISHED = frozenset({SUCCEEDED, NO_REWARD})
RETRY_FAILURES = frozenset({FAILED, TIMED_OUT})
ABORTED = RETRY_FAILURES | {CANCELLED}
