"""Where a rollout's reward comes from: the harness's reward file, the scorer, the rewards table.

What a reward is and which report wins (the verifier over the harness, the latest within a rank)
are ``schemas/rewards.py``; the rules "a missing reward is recorded as missing, never as 0" and
when self-reports count are ``launcher/attempt.py collect_reward``. Anything unparsable or
non-finite is an error attached to the rollout, not a number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from lightning_harness.schemas.rewards import MAX_REWARD_BYTES, RewardError, parse_reward, precedence

from .local import MAX_LOG_BYTES, launcher_env, open_log, open_regular, trim_to_tail
from .proctree import finish_tree, start_tree

log = logging.getLogger("lightning.launcher")

MAX_REWARD_FILE = MAX_REWARD_BYTES  # a reward is a number and a little info; more is not a reward
SCORER_TAIL = 1 << 16  # of a scorer's stdout only the end is read: its reward is the last line
LEFTOVER_LINGER = 2.0  # s a scorer's processes may take to end after it (multiprocessing's helpers do)


class RewardCancelled(Exception):
    """The batch was cancelled while the scorer ran (it was stopped): the attempt is cancelled, not judged."""


@dataclass(frozen=True)
class Reward:
    value: float
    source: str  # 'command', 'api' (verifier rank); 'file', 'proxy' (self-reports)
    info: Mapping[str, Any] | None = None
    at: dt.datetime | None = None  # when it was reported (file: its mtime); orders reports of one rank
    info_json: str | None = field(default=None, repr=False, compare=False)  # a stored row's info, not parsed yet


def read_reward_file(path: Path) -> Reward | None:
    """The harness's reward file, or None if it wrote none. Raises RewardError if it is malformed,
    is not a regular file (a link, a FIFO, a device) or is larger than :data:`MAX_REWARD_FILE`."""
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as fh:
            st = os.fstat(fh.fileno())
            data = fh.read(MAX_REWARD_FILE + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RewardError(f"reward file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_REWARD_FILE:
        raise RewardError(f"reward file {path} is larger than {MAX_REWARD_FILE} bytes")
    if st.st_nlink != 1:  # a hard link to someone else's file (--run-as: the launcher reads what the harness owns)
        raise RewardError(f"reward file {path} has {st.st_nlink} hard links; not read")
    at = dt.datetime.fromtimestamp(st.st_mtime, dt.UTC)
    value, info = parse_reward(data, what=f"reward file {path}")
    return Reward(value, "file", info, at)


def run_reward_cmd(
    command: str,
    env: Mapping[str, str],
    *,
    timeout: float = 300.0,
    cwd: str | None = None,
    log_path: Path | None = None,
    max_log_bytes: int = MAX_LOG_BYTES,
    cancel: threading.Event | None = None,
) -> Reward:
    """Run the scorer (a shell command line) and parse the last non-empty line of its stdout (read
    from its last :data:`SCORER_TAIL` bytes: scorers print what model-written code printed).

    The scorer sees the harness's task and output through ``LIGHTNING_TASK``, ``LIGHTNING_TASK_FILE``,
    ``LIGHTNING_OUTPUT_DIR``, ``LIGHTNING_LOG_FILE`` and ``LIGHTNING_EXIT_CODE``. Its stderr is appended
    to the attempt log, which is then cut to its last ``max_log_bytes`` again. Raises RewardError when
    it fails, hangs or prints no reward, :class:`RewardCancelled` when ``cancel`` stopped it.

    Its output is what it had written when it exited; one whose processes still run
    :data:`LEFTOVER_LINGER` seconds after it has no verdict (RewardError): a test suite running
    model-written code could leave one behind that keeps printing ``1.0`` into the stdout it
    inherited, after the scorer's ``0.0``. (Run such code with stdout of its own, in a
    sandbox, as ``examples/swe/reward.py`` does.)
    """
    with contextlib.ExitStack() as files:
        stdout = files.enter_context(tempfile.TemporaryFile())  # a file, not a pipe: nothing to drain while waiting
        log = files.enter_context(open_log(log_path)) if log_path else None
        at_exit = [None]  # what the scorer had written when it exited is its output, not what came later
        try:  # the scorer's leftovers end with it, like a harness's
            tree, proc = start_tree(command, shell=True, executable="/bin/sh", env=launcher_env(env), cwd=cwd,
                                    stdout=stdout, stderr=log or subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RewardError(f"reward command could not start: {exc}") from None
        timed_out, cancelled, leftovers = finish_tree(
            tree, proc, timeout=timeout, kill_grace=1.0, cancel=cancel, linger=LEFTOVER_LINGER,
            on_exit=lambda: at_exit.__setitem__(0, os.fstat(stdout.fileno()).st_size))
        if log is not None:
            trim_to_tail(log_path, max_log_bytes, log)
        size = at_exit[0] if at_exit[0] is not None else os.fstat(stdout.fileno()).st_size
        stdout.seek(max(0, size - SCORER_TAIL))
        out = stdout.read(size - stdout.tell())
    if cancelled:
        raise RewardCancelled("cancelled while the reward command ran")
    if timed_out:
        raise RewardError(f"reward command timed out after {timeout:g}s")
    if proc.returncode != 0:
        raise RewardError(f"reward command exited with {proc.returncode}")
    if leftovers:  # one still writing could have put its line after the verdict as the scorer exited
        raise RewardError(f"reward command exited leaving {leftovers} process(es) running {LEFTOVER_LINGER:g} s "
                          "later (ended now): its output is not trusted; a scorer must end what it starts")
    lines = [ln for ln in out.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise RewardError("reward command printed nothing")
    value, info = parse_reward(lines[-1], what="reward command output")
    return Reward(value, "command", info)


class RewardsTable:
    """Incremental reader of ``TRACES/rewards`` parts: the latest report per ``(rollout_id, attempt)`` and source.

    Parts are immutable once renamed into place, so each is read once. ``flush`` (the proxy's
    ``POST /_lh/flush``) is called at most once per lookup wave: a lookup for an attempt that ended
    before the last flush started does not flush again (that flush wrote what the attempt reported).
    """

    def __init__(self, traces_dir: str | os.PathLike, flush: Callable[[], Any] | None = None) -> None:
        self.base = Path(traces_dir) / "rewards"
        self.flush_fn = flush
        self._seen: set[Path] = set()
        self._latest: dict[tuple[str, int], dict[str, Reward]] = {}  # attempt -> source -> newest
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
            self._seen.add(path)
            try:
                rows = pq.read_table(path, columns=["rollout_id", "attempt", "reward", "created_at", "source",
                                                    "info_json"]).to_pylist()
            except Exception:  # a foreign or broken file must not stop the batch; skip it
                continue
            for r in rows:
                try:
                    self._add(r)
                except (TypeError, ValueError) as exc:  # a row no writer of ours makes: the others still count
                    log.warning("rewards row skipped (%s: %s) in %s", type(exc).__name__, exc, path)

    def _add(self, r: dict) -> None:
        """Keep the row if it is the latest of its attempt and source. Its info stays text here, parsed
        for the report a lookup returns only (a flood of reports must not be parsed, nor one report of
        odd nesting break the scan of the rows after it)."""
        source = r.get("source") or "proxy"  # unlabelled rows rank as self-reports
        by_source = self._latest.setdefault((r["rollout_id"], int(r["attempt"] or 0)), {})
        report = Reward(float(r["reward"]), source, None, r["created_at"], info_json=r.get("info_json"))
        by_source[source] = winner(report, by_source.get(source))

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

    def lookup(self, rollout_id: str, attempt: int, *, ended_mono: float | None = None,
               sources: tuple[str, ...] | None = None) -> Reward | None:
        """The winning report of the attempt among ``sources`` (all when None), after a flush of the proxy."""
        self._flush(time.monotonic() if ended_mono is None else ended_mono)
        with self._lock:
            self._scan()
            by_source = self._latest.get((rollout_id, int(attempt)), {})
            hits = [hit for src, hit in by_source.items() if sources is None or src in sources]
        best = winner(*hits)
        return best if best is None or not best.info_json else dataclasses.replace(
            best, info=_info(best.info_json), info_json=None)


def _info(text: str) -> Mapping[str, Any]:
    """A stored report's info as its object; text that does not decode to one is kept as ``raw``."""
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):  # (RecursionError: nested deeper than the parser goes)
        info = None
    return info if isinstance(info, dict) else {"raw": text[:1000]}


def winner(*rewards: Reward | None) -> Reward | None:
    """The report that wins by ``schemas.rewards.precedence``, or None when there is none."""
    present = [r for r in rewards if r is not None]
    return max(present, key=lambda r: precedence(r.source, r.at)) if present else None
