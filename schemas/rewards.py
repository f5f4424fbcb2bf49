"""What a reward is, and which of several reports of one attempt wins.

Why here: the proxy (a harness's POST, the operator's control call), the launcher (a reward file,
the ``--reward-cmd`` output) and the trainer's SQL view (``rollouts``) all apply these rules; the
proxy's environment has no torch, so they live in the layer everyone imports.

A reward is a finite JSON number (not a bool, not a numeric string), with an optional ``info`` that
is a JSON object. Anything else is a :class:`RewardError` attached to the rollout, never a number.

Precedence: each source has a rank (:data:`SOURCE_RANK`); the harness may run model-written
commands, so what it says about itself ranks below the verifier. The higher rank wins; within a rank
the latest report wins; a report without a time counts as oldest. :func:`precedence` is the rule in
Python, :func:`precedence_sql` the same rule as an SQL ``ORDER BY``, built from the same table.
"""

from __future__ import annotations

import json
import math
from typing import Any

VERIFIER, SELF_REPORT = 1, 0
SOURCE_RANK = {
    "command": VERIFIER,  # --reward-cmd: the run's scorer, run after a harness that exited 0
    "api": VERIFIER,  # the operator, through the control API
    "proxy": SELF_REPORT,  # the harness's POST to LIGHTNING_REWARD_URL
    "file": SELF_REPORT,  # the harness's LIGHTNING_REWARD_FILE
}  # any other (or no) source ranks as a self-report
VERIFIER_SOURCES = tuple(s for s, r in SOURCE_RANK.items() if r == VERIFIER)
SELF_SOURCES = tuple(s for s, r in SOURCE_RANK.items() if r == SELF_REPORT)


class RewardError(ValueError):
    """A reward was reported but cannot be used (the message says why)."""


def check_reward(value: Any, *, what: str = "reward") -> float:
    """``value`` (decoded JSON) as a reward: a finite number; bools and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"{what} must be a number, got {value!r}"[:200])
    number = float(value)
    if not math.isfinite(number):
        raise RewardError(f"{what} must be a finite number, got {number}")
    return number


def check_info(info: Any, *, what: str = "reward") -> dict | None:
    """The optional ``info`` of a reward: a JSON object or nothing."""
    if info is not None and not isinstance(info, dict):
        raise RewardError(f"{what} info must be a JSON object, got {type(info).__name__}")
    return info


def reward_from_object(obj: Any, *, what: str = "reward") -> tuple[float, dict | None]:
    """``{"reward": number, "info": {...}}`` (decoded JSON) as ``(value, info)``."""
    if not isinstance(obj, dict) or "reward" not in obj:
        raise RewardError(f'{what} must be {{"reward": number, "info": {{...}}}}, got {obj!r}'[:200])
    return check_reward(obj["reward"], what=what), check_info(obj.get("info"), what=what)


def parse_reward(text: str | bytes, *, what: str = "reward") -> tuple[float, dict | None]:
    """A number, or JSON ``{"reward": number, "info": {...}}`` (a reward file, a scorer's last line)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = text.strip()
    if not text:
        raise RewardError(f"{what} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise RewardError(f"{what} is not a number or JSON: {text[:120]!r}") from None
    if isinstance(data, dict):
        return reward_from_object(data, what=what)
    return check_reward(data, what=what), None


def rank(source: str | None) -> int:
    return SOURCE_RANK.get(source or "", SELF_REPORT)


def precedence(source: str | None, at: Any) -> tuple:
    """Sort key of one report: the greatest wins (rank, then a known time, then the latest time)."""
    return (rank(source), at is not None, at)


def precedence_sql(source: str, at: str) -> str:
    """:func:`precedence` as an SQL ``ORDER BY`` list (first row wins) over the given columns."""
    return f"{rank_sql(source)} DESC, {at} DESC NULLS LAST"


def rank_sql(source: str) -> str:
    """The rank of ``source`` as an SQL expression (``= VERIFIER`` selects the verifier rank)."""
    cases = " ".join(f"WHEN '{s}' THEN {r}" for s, r in SOURCE_RANK.items())
    return f"CASE {source} {cases} ELSE {SELF_REPORT} END"
