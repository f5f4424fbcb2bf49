"""Where a rollout's reward comes from: ``--reward-cmd``, the reward file, or the proxy's rewards table.

Why one module: the rule "a missing reward is recorded as missing, never as 0" lives in one place.
Order of precedence (first that yields a value wins):

1. ``--reward-cmd`` (the operator's scorer; runs after a harness that exited 0),
2. ``LIGHTNING_REWARD_FILE`` written by the harness (a number or ``{"reward": x, "info": {...}}``),
3. a reward the harness POSTed to ``LIGHTNING_REWARD_URL`` (the proxy writes it to ``rewards``).

Anything unparsable or non-finite is an error attached to the rollout, not a number.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import pyarrow.parquet as pq

from .local import kill_group


@dataclass(frozen=True)
class Reward:
    value: float
    source: str  # 'command', 'file', 'proxy', 'api'
    info: Mapping[str, Any] | None = None


class RewardError(ValueError):
    """A reward was reported but cannot be used (the message says why)."""


def parse_reward(text: str | bytes, *, what: str = "reward") -> tuple[float, dict | None]:
    """A number, or JSON ``{"reward": number, "info": {...}}``; raises :class:`RewardError` otherwise."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = text.strip()
    if not text:
        raise RewardError(f"{what} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise RewardError(f"{what} is not a number or JSON: {text[:120]!r}") from None
    info = None
    if isinstance(data, dict):
        if "reward" not in data:
            raise RewardError(f"{what} JSON has no 'reward' key: {text[:120]!r}")
        info = data.get("info")
        if info is not None and not isinstance(info, dict):
            info = {"info": info}
        data = data["reward"]
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise RewardError(f"{what} must be a number, got {data!r}")
    value = float(data)
    if not math.isfinite(value):
        raise RewardError(f"{what} is not finite: {value}")
    return value, info


def read_reward_file(path: Path) -> Reward | None:
    """The harness's reward file, or None if it wrote none. Raises RewardError if it is malformed."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    value, info = parse_reward(text, what=f"reward file {path}")
    return Reward(value, "file", info)


def run_reward_cmd(
    command: str,
    env: Mapping[str, str],
    *,
    timeout: float = 300.0,
    cwd: str | None = None,
    log_path: Path | None = None,
) -> Reward:
    """Run the scorer (a shell command line) and parse the last non-empty line of its stdout.

    The scorer sees the harness's task and output through ``LIGHTNING_TASK``, ``LIGHTNING_TASK_FILE``,
    ``LIGHTNING_OUTPUT_DIR``, ``LIGHTNING_LOG_FILE`` and ``LIGHTNING_EXIT_CODE``. Its stderr is appended
    to the attempt log. Raises RewardError when it fails, hangs or prints no reward.
    """
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    full_env.update(env)
    stderr = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            command, shell=True, executable="/bin/sh", env=full_env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=stderr, start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid, grace=1.0, proc=proc)
            proc.communicate()
            raise RewardError(f"reward command timed out after {timeout:g}s") from None
        finally:
            kill_group(proc.pid, grace=0.0)
    finally:
        if log_path:
            stderr.close()
    if proc.returncode != 0:
        raise RewardError(f"reward command exited with {proc.returncode}")
    lines = [ln for ln in out.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise RewardError("reward command printed nothing")
    value, info = parse_reward(lines[-1], what="reward command output")
    return Reward(value, "command", info)


class RewardsTable:
    """Incremental reader of ``TRACES/rewards`` parts: the latest reward per ``(rollout_id, attempt)``.

    Parts are immutable once renamed into place, so each is read once. ``flush`` (the proxy's
    ``POST /_lh/flush``) is called at most once per lookup wave: a lookup for an attempt that ended
    before the last flush started does not flush again.
    """

    def __init__(self, traces_dir: str | os.PathLike, flush: Callable[[], Any] | None = None) -> None:
        self.base = Path(traces_dir) / "rewards"
        self.flush_fn = flush
        self._seen: set[Path] = set()
        self._latest: dict[tuple[str, int], tuple[Any, Reward]] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._last_flush_started = float("-inf")
        self.flush_errors = 0

    def _scan(self) -> None:
        if not self.base.exists():
            return
        for path in sorted(self.base.glob("**/*.parquet")):
            if path in self._seen or path.name.startswith("."):
                continue
            try:
                rows = pq.read_table(path, columns=["rollout_id", "attempt", "reward", "created_at", "source", "info_json"]).to_pylist()
            except Exception:  # a foreign or broken file must not stop the batch; skip it
                self._seen.add(path)
                continue
            self._seen.add(path)
            for r in rows:
                key = (r["rollout_id"], int(r["attempt"] or 0))
                info = None
                if r.get("info_json"):
                    try:
                        info = json.loads(r["info_json"])
                    except json.JSONDecodeError:
                        info = {"raw": r["info_json"]}
                stamp = (r["created_at"] is not None, r["created_at"] or 0)
                old = self._latest.get(key)
                if old is None or stamp >= old[0]:
                    self._latest[key] = (stamp, Reward(float(r["reward"]), r.get("source") or "proxy", info))

    def _flush(self, ended_mono: float) -> None:
        if self.flush_fn is None:
            return
        with self._flush_lock:
            if self._last_flush_started >= ended_mono:
                return
            self._last_flush_started = time.monotonic()
            try:
                self.flush_fn()
            except Exception:
                self.flush_errors += 1

    def lookup(self, rollout_id: str, attempt: int, *, ended_mono: float | None = None, sources: tuple[str, ...] | None = None) -> Reward | None:
        """Latest reward of the attempt, flushing the proxy first if needed."""
        key = (rollout_id, int(attempt))
        with self._lock:
            self._scan()
            hit = self._latest.get(key)
        if hit is None and self.flush_fn is not None:
            self._flush(time.monotonic() if ended_mono is None else ended_mono)
            with self._lock:
                self._scan()
                hit = self._latest.get(key)
        if hit is None:
            return None
        reward = hit[1]
        if sources is not None and reward.source not in sources:
            return None
        return reward
