"""Rollout states: the values of the ``rollouts.state`` column, and which of them mean what.

Why here: the launcher writes these states, the trainer and the SQL views read them; one enum keeps
the stored strings (``StrEnum``: a member *is* its string, so Parquet and DuckDB see plain text).

"Failure" means two different things, and each has its own set:

* :data:`RETRY_FAILURES` (``failed``, ``timed_out``): the attempt went wrong by itself; it uses one of
  the rollout's retries. ``cancelled`` does not: stopping a batch is not the rollout's fault, so a
  cancelled attempt neither uses a retry nor finishes the rollout (a re-run runs it again).
* :data:`ABORTED` (``failed``, ``timed_out``, ``cancelled``): the harness did not run to its normal end,
  so any reward it reported is not a judged one; the training failure policy
  (``trainer.advantages.apply_failure_policy``) drops or penalises these.
* :data:`FINISHED` (``succeeded``, ``no_reward``): the attempt ran to its end; a re-run skips the rollout.
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

FINISHED = frozenset({RolloutState.SUCCEEDED, RolloutState.NO_REWARD})
RETRY_FAILURES = frozenset({RolloutState.FAILED, RolloutState.TIMED_OUT})
ABORTED = RETRY_FAILURES | {RolloutState.CANCELLED}


def sql_list(states) -> str:
    """``'a', 'b'`` for an SQL ``IN (...)``: the states are fixed identifiers, never user text."""
    return ", ".join(f"'{s.value}'" for s in sorted(states))
