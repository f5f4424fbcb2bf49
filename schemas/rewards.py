"""What a reward is, and which of several reports of one attempt wins: one rule for the proxy (a
harness's POST, the operator's control call), the launcher (reward file, ``--reward-cmd``) and the
``rollouts`` SQL view. Here because the proxy's environment has no torch.

A reward is a finite JSON number (not a bool, not a numeric string) with an optional ``info`` that is
a JSON object; anything else is a :class:`RewardError` attached to the rollout, never a number.
Precedence: the harness may run model-written commands, so what it says about itself ranks below the
verifier (:data:`SOURCE_RANK`; an unknown source ranks as a self-report); the higher rank wins, then
the latest report (one without a time counts as oldest). :func:`precedence` is the rule in Python,
:func:`precedence_sql` the same rule as SQL, both from the one table.
"""

from __future__ import annotations

import json
import math
from typing import Any

VERIFIER, SELF_REPORT = 1, 0
# the run's --reward-cmd and the operator's control call; the harness's POST and its reward file
SOURCE_RANK = {"command": VERIFIER, "api": VERIFIER, "proxy": SELF_REPORT, "file": SELF_REPORT}
SELF_SOURCES = tuple(s for s, r in SOURCE_RANK.items() if r == SELF_REPORT)


class RewardError(ValueError):
    """A reward was reported but cannot be used (the message says why)."""


# Rewards past this magnitude are refused: a harness reports its own by default, and one of 1e300 (or a
# 400-digit integer, which no float holds) overflowed the advantages (float32 samples) or crashed the
# reader; no scoring scheme needs them.
MAX_REWARD = 1e15
# A reward report's bytes (a reward file, a harness's POST, decoded): a number and a little info. Past it is
# no reward: a 300 KB gzip POST that expanded to 300 MB held the proxy 3.5 GB and stalled every rollout 18 s.
MAX_REWARD_BYTES = 1 << 16
# Reward reports one attempt may POST to the proxy (the latest of a source wins, so one is all a harness
# needs): past it, 429. Why: a harness posted 1,000 reports of 60 KB in 5 s, each stored, and the
# launcher's reader then parsed them all while every attempt being judged waited (found by review).
MAX_REWARD_POSTS = 16
# How deep a reward's info may nest. A report nested ~980 deep passed the launcher's parse of the reward
# file but not its later parse of the stored row (two frames deeper: RecursionError), which failed the
# attempt being judged then, another rollout's, in every batch that read the row (found by review).
MAX_INFO_DEPTH = 32


def check_reward(value: Any, *, what: str = "reward") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"{what} must be a number, got {value!r}"[:200])
    if isinstance(value, int) and abs(value) > MAX_REWARD:
        raise RewardError(f"{what} must be a number within +-{MAX_REWARD:g}, got an integer of "
                          f"{value.bit_length()} bits")
    if not math.isfinite(value):
        raise RewardError(f"{what} must be a finite number, got {value}")
    if abs(value) > MAX_REWARD:
        raise RewardError(f"{what} must be a number within +-{MAX_REWARD:g}, got {value:g}")
    return float(value)


def reward_from_object(obj: Any, *, what: str = "reward") -> tuple[float, dict | None]:
    """``{"reward": number, "info": {...}}`` (decoded JSON) as ``(value, info)``."""
    if not isinstance(obj, dict) or "reward" not in obj:
        raise RewardError(f'{what} must be {{"reward": number, "info": {{...}}}}, got {obj!r}'[:200])
    if obj.get("info") is not None and not isinstance(obj["info"], dict):
        raise RewardError(f"{what} info must be a JSON object, got {type(obj['info']).__name__}")
    if not _nested_within(obj.get("info"), MAX_INFO_DEPTH):
        raise RewardError(f"{what} info nests deeper than {MAX_INFO_DEPTH} levels")
    return check_reward(obj["reward"], what=what), obj.get("info")


def _nested_within(value: Any, limit: int) -> bool:
    """Whether decoded JSON ``value`` nests at most ``limit`` containers deep (no recursion: any depth)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def parse_reward(text: str | bytes, *, what: str = "reward") -> tuple[float, dict | None]:
    """A number, or JSON ``{"reward": number, "info": {...}}`` (a reward file, a scorer's last line)."""
    text = (text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text).strip()
    if not text:
        raise RewardError(f"{what} is empty")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, an integer past Python's 4,300 digits, deep nesting
        raise RewardError(f"{what} is not a number or JSON: {text[:120]!r}") from None
    return reward_from_object(data, what=what) if isinstance(data, dict) else (check_reward(data, what=what), None)


def precedence(source: str | None, at: Any) -> tuple:
    """Sort key of one report: the greatest wins (rank, then a known time, then the latest time)."""
    return (SOURCE_RANK.get(source or "", SELF_REPORT), at is not None, at)


def rank_sql(source: str) -> str:
    """The rank of the column ``source`` as an SQL expression."""
    return f"CASE {source} " + " ".join(f"WHEN '{s}' THEN {r}" for s,
                                        r in SOURCE_RANK.items()) + f" ELSE {SELF_REPORT} END"


def precedence_sql(source: str, at: str) -> str:
    """:func:`precedence` as an SQL ``ORDER BY`` list (the first row wins)."""
    return f"{rank_sql(source)} DESC, {at} DESC NULLS LAST"
