"""The launcher's Python API: run groups of rollouts concurrently, retry, reward, record.

Why an object and not only a function: the trainer's asynchronous mode starts groups, takes the
groups that finished and lets the others keep running across a weight update. ``BatchRunner`` does
that (``submit`` / ``finished_groups`` / ``wait_groups`` / ``cancel``); ``run_batch`` is the
one-call form for a synchronous step or an evaluation.

Scheduling: ``concurrency`` worker threads take attempts from a priority queue ordered by group,
so early groups finish first and retries jump ahead of new groups. Every attempt, whatever its
end, becomes one row of ``rollouts``; rows are flushed by age and on close/cancel.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_harness.process import exit_code
from lightning_harness.proxy.credentials import attempt_credential
from lightning_harness.proxy.health import CaptureUnhealthy, capture_baseline, require_capture
from lightning_harness.proxy.redact import Redactor, environment_secrets
from lightning_harness.schemas import PartWriter
from lightning_harness.schemas.states import CANCELLED, FAILED, NO_REWARD, RETRY_FAILURES

from .attempt import WORK_DIR, AttemptSettings, attempt_dir, make_result, run_attempt
from .identity import GroupFn, RolloutSpec, check_run_id, plan_rollouts
from .local import LocalRunner, utcnow
from .progress import BatchProgress, BatchStats
from .proxy_link import ProxyLink
from .results import GroupResult, History, RolloutResult, load_history
from .rewards import RewardsTable
from .runas import lock_traces
from .tasks import Task, tasks_from_rows

_UNSET = object()
__all__ = ["BatchAborted", "BatchRunner", "BatchSettings", "run_batch", "WORK_DIR", "clean_work_dirs"]


@dataclass(order=True)
class _Item:
    priority: tuple
    spec: RolloutSpec = field(compare=False)
    attempt: int = field(compare=False)
    failures: int = field(compare=False)  # failed/timed-out attempts so far (earlier runs included)
    ran: int = field(default=0, compare=False)  # attempts this runner already made for the rollout


@dataclass
class _Group:
    group_id: str
    specs: list[RolloutSpec]
    final: dict[str, RolloutResult] = field(default_factory=dict)
    reported: bool = False

    @property
    def done(self) -> bool:
        return len(self.final) == len(self.specs)

    def result(self) -> GroupResult:
        return GroupResult(self.group_id, [self.final[s.rollout_id] for s in self.specs])


def process_check(name: str, owner: Any) -> Callable[[], str | None] | None:
    """A check that reports when a child process we depend on (``owner.proc``) has exited."""
    if owner is None or not hasattr(owner, "proc"):
        return None

    def check() -> str | None:
        proc = getattr(owner, "proc", None)
        rc = exit_code(proc) if proc is not None else None  # not reaped: stopping it still ends its group
        if rc is None:
            return None
        log = getattr(owner, "log_path", None)
        return f"{name} exited with code {rc}" + (f" (log {log})" if log else "")

    return check


class BatchAborted(RuntimeError):
    """The batch stopped by itself (its proxy or engine died); rows written so far stay valid."""

    def __init__(self, message: str, results: list[RolloutResult]) -> None:
        super().__init__(message)
        self.results = results


def _as_link(proxy: Any) -> ProxyLink | None:
    if proxy is None or isinstance(proxy, ProxyLink):
        return proxy
    if hasattr(proxy, "forward_url") and hasattr(proxy, "env_for"):
        return ProxyLink.from_process(proxy)
    if isinstance(proxy, (tuple, list)) and len(proxy) in (2, 3):
        return ProxyLink.attach(proxy[0], proxy[1], control_token=proxy[2] if len(proxy) == 3 else None)
    if isinstance(proxy, str):
        return ProxyLink.attach(proxy, None)
    raise TypeError(f"proxy must be a ProxyProcess, ProxyLink, (url, token[, control_token]) or URL, got "
                    f"{type(proxy).__name__}")


@dataclass(kw_only=True)
class BatchSettings:
    """How a batch runs, declared once: :class:`BatchRunner` and :func:`run_batch` take it (or its
    fields as keywords), the trainer builds one per phase.

    ``proxy``: a ``ProxyProcess``, a :class:`ProxyLink`, ``(reverse_url, token[, control_token])``, or
    None (no capture). ``model_version``: stamped on rows; None reads the proxy's current version per
    attempt. ``run_as``: users for the local runner (not with ``runner``). ``health_check``: returns
    why the batch must stop (a dead engine), else None.
    """

    traces_dir: str | Path
    run_id: str
    proxy: Any = None
    runner: Any = None
    samples: int = 1
    concurrency: int = 4
    timeout: float | None = None
    retries: int = 0
    reward_cmd: str | None = None
    reward_timeout: float = 300.0
    self_reward: bool = True  # may the harness's own report (file, POST) be the reward when there is no reward_cmd
    run_as: Any = None
    step: int | None = None
    split: str = "train"
    model_version: int | None = None
    group_fn: GroupFn | None = None
    cwd: str | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    skip_finished: bool = True
    progress: bool | BatchProgress = False
    on_result: Callable[[RolloutResult], None] | None = None
    flush_seconds: float = 1.0
    health_check: Callable[[], str | None] | None = None


class BatchRunner:
    """Runs rollouts of submitted tasks; see the module doc. Use as a context manager.

    ``harness``: argv list or shell command line, with ``{placeholders}`` (see :mod:`.command`).
    ``settings``: a :class:`BatchSettings`, or its fields as keywords (keywords win over ``settings``).
    The trainer may assign ``runner.model_version`` after each update.
    """

    def __init__(self, harness: Sequence[str] | str | None, settings: BatchSettings | None = None,
                 **fields: Any) -> None:
        s = self.settings = replace(settings, **fields) if settings else BatchSettings(**fields)
        if s.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if s.retries < 0:
            raise ValueError("retries must be >= 0")
        self.harness = harness
        self.traces_dir = Path(s.traces_dir)
        self.proxy = _as_link(s.proxy)
        self._checks = [c for c in (process_check("capture proxy", s.proxy), s.health_check) if c is not None]
        self.error: str | None = None  # why the batch stopped by itself (a dead proxy or engine)
        if s.run_as is not None and s.runner is not None:
            raise ValueError("run_as is for the local runner (give LocalRunner(run_as=...) yourself, or no runner)")
        self.runner = s.runner or LocalRunner(run_as=s.run_as)
        if getattr(self.runner, "run_as", None):  # harnesses of other users: close the traces to them
            lock_traces(self.traces_dir)
        if not harness and isinstance(self.runner, LocalRunner):
            raise ValueError("a harness command is needed (only a Kubernetes Job template may supply its own)")
        self.model_version = s.model_version
        self.stats = BatchStats()
        self.progress: BatchProgress | None = BatchProgress(self.stats) if s.progress is True else s.progress or None
        self.traces_dir.mkdir(parents=True, exist_ok=True)
        self._rollouts = PartWriter(self.traces_dir, "rollouts", flush_seconds=s.flush_seconds)
        self._rewards = PartWriter(self.traces_dir, "rewards", flush_seconds=s.flush_seconds)
        control = self.proxy.control if self.proxy else None
        # what a harness or scorer wrote (a reward file's text in an error, a reward's info) is recorded
        # masked, as the proxy masks the info of a POSTed reward: known secrets and provider key shapes
        self._redactor = Redactor([*((self.proxy.token, self.proxy.control_token, self.proxy.api_key)
                                     if self.proxy else ()), *environment_secrets(os.environ)])
        self._capture_baseline = capture_baseline(control) if control else None  # see _check_capture
        self._settings = AttemptSettings(s, harness, self.runner, self.proxy,
                                         RewardsTable(self.traces_dir, control.flush if control else None))
        self._queue: queue.PriorityQueue[_Item] = queue.PriorityQueue()
        self._lock = threading.Condition()
        self._cancel = threading.Event()
        self._closed = threading.Event()
        self._groups: dict[str, _Group] = {}
        self._group_order = itertools.count()
        self._order: dict[str, None] = {}  # rollout ids in submission order
        self._history: dict[str, History] | None = None
        self._results: dict[str, RolloutResult] = {}
        self._finished_groups: list[GroupResult] = []
        self._workers: list[threading.Thread] = []
        self._progress_started = False

    # -- submitting --------------------------------------------------------------------------
    def submit(
        self,
        tasks: Iterable[Task | Mapping[str, Any]],
        *,
        samples: int | None = None,
        step: Any = _UNSET,
        split: str | None = None,
    ) -> list[str]:
        """Plan tasks x samples, skip what earlier runs finished, queue the rest. Returns the group ids."""
        if self._closed.is_set() or self._cancel.is_set():
            raise RuntimeError("runner is closed or cancelled")
        tasks = tasks_from_rows(tasks, source="submit")
        specs = plan_rollouts(
            tasks, run_id=self.settings.run_id, samples=samples or self.settings.samples,
            step=self.settings.step if step is _UNSET else step, split=split or self.settings.split,
            group_fn=self.settings.group_fn,
        )
        if self._history is None:
            # read once: within this runner a rollout is submitted once, so only earlier runs matter.
            # Read without resuming too: attempt numbers never repeat (rows, spans and rewards are keyed by them)
            self._history = load_history(self.traces_dir, run_id=self.settings.run_id)
        history, resume = self._history, self.settings.skip_finished
        by_group: dict[str, list[RolloutSpec]] = {}
        for spec in specs:
            if spec.rollout_id in self._order:
                raise ValueError(f"rollout {spec.rollout_id} was already submitted to this runner")
            by_group.setdefault(spec.group_id, []).append(spec)
        with self._lock:
            taken = [gid for gid in by_group if gid in self._groups]
            if taken:  # checked before anything is queued: a refused submit changes nothing
                raise ValueError(f"groups {taken} were already submitted to this runner")
            for gid, gspecs in by_group.items():
                group = _Group(gid, gspecs)
                self._groups[gid] = group
                gnum = next(self._group_order)
                for spec in gspecs:
                    self._order[spec.rollout_id] = None
                    self.stats.total += 1
                    hist = history.get(spec.rollout_id, History())
                    final = hist.final(self.settings.retries) if resume else None
                    if final is not None:
                        self._finalize(group, RolloutResult.from_row(final, skipped=True), ran=False)
                        continue
                    attempt = max(hist.last_attempt, self._last_attempt_on_disk(spec)) + 1
                    self._queue.put(_Item((gnum, spec.sample_index, attempt), spec, attempt,
                                          hist.failures if resume else 0))
            self._lock.notify_all()
        self._ensure_workers()
        if self.progress is not None:
            self.progress.update()
        return list(by_group)

    def _last_attempt_on_disk(self, spec: RolloutSpec) -> int:
        """An attempt folder without a row means an earlier launcher died mid-attempt: never reuse it."""
        folder = attempt_dir(self.traces_dir, spec, 0).parent
        nums = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []
        return max(nums, default=-1)

    def _ensure_workers(self) -> None:
        if self.progress is not None and not self._progress_started:
            self._progress_started = True
            self.progress.start()
        while len(self._workers) < self.settings.concurrency:
            t = threading.Thread(target=self._worker, name=f"rollout-{len(self._workers)}", daemon=True)
            self._workers.append(t)
            t.start()

    # -- collecting ----------------------------------------------------------------------------
    def finished_groups(self) -> list[GroupResult]:
        """Groups that finished since the last call (non-blocking)."""
        with self._lock:
            out, self._finished_groups = self._finished_groups, []
        return out

    def wait_groups(self, n: int | None = None, timeout: float | None = None) -> list[GroupResult]:
        """Block until at least ``n`` finished groups are waiting (all outstanding ones if None), return them.

        Returns fewer on timeout or cancel. Groups still running keep running.
        """
        def enough() -> bool:
            waiting = len(self._finished_groups)
            reachable = waiting + sum(1 for g in self._groups.values() if not g.reported)
            return waiting >= (reachable if n is None else min(n, reachable))

        with self._lock:
            self._wait_until(enough, timeout)
            out, self._finished_groups = self._finished_groups, []
        if self.progress is not None:
            self.progress.update()
        return out

    def wait(self, timeout: float | None = None) -> list[RolloutResult]:
        """Block until every submitted rollout is final; final attempts in submission order."""
        with self._lock:
            self._wait_until(lambda: all(g.done for g in self._groups.values()), timeout)
            complete = all(g.done for g in self._groups.values()) and not self._cancel.is_set()
        if self._cancel.is_set():
            self._join_workers()
        if complete:
            self._check_capture()
        return self.results()

    def _wait_until(self, ready: Callable[[], bool], timeout: float | None) -> None:
        """With the lock held: until ``ready()``, a cancel or the timeout. Polls too, since not every
        cancel notifies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready() and not self._cancel.is_set():
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                return
            self._lock.wait(left)

    def _check_capture(self) -> None:
        """After the phase: a proxy that could not record every call marks the batch failed
        (``self.error``; ``run_batch`` raises :class:`BatchAborted`), see ``proxy/health.py``."""
        if self.proxy is None:
            return
        try:
            self._capture_baseline = require_capture(self.proxy.control, self._capture_baseline)
            return
        except CaptureUnhealthy as exc:
            problem = str(exc)
        except Exception as exc:  # unreachable: what was recorded cannot be vouched for
            problem = self._health() or f"could not check the capture proxy's health: {exc}"
        with self._lock:
            self.error = self.error or problem

    def results(self) -> list[RolloutResult]:
        with self._lock:
            return [self._results[rid] for rid in self._order if rid in self._results]

    @property
    def pending(self) -> int:
        """Rollouts not yet final (queued or running)."""
        with self._lock:
            return sum(len(g.specs) - len(g.final) for g in self._groups.values())

    # -- stopping -----------------------------------------------------------------------------
    def _health(self) -> str | None:
        for check in self._checks:
            try:
                problem = check()
            except Exception as exc:
                problem = f"health check failed: {exc!r}"
            if problem:
                return problem
        return None

    def _abort(self, problem: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = problem
            self._cancel.set()
            self._lock.notify_all()

    def cancel(self) -> None:
        """Stop every running harness (whole process trees), drop queued attempts, flush rows."""
        self._cancel.set()
        with self._lock:
            self._lock.notify_all()
        self._join_workers()
        self.flush()

    def close(self) -> None:
        """Stop the workers once idle (cancels if attempts are still running) and flush everything."""
        if self._closed.is_set():
            return
        if self.pending:
            self._cancel.set()
        self._closed.set()
        self._join_workers()
        self._rollouts.close()
        self._rewards.close()
        if self.progress is not None and self._progress_started:
            self.progress.stop()

    def _join_workers(self) -> None:
        for t in self._workers:
            t.join(timeout=60)

    def flush(self) -> None:
        """Write buffered rollout and reward rows now (the trainer calls this before building samples)."""
        self._rollouts.flush()
        self._rewards.flush()

    def __enter__(self) -> BatchRunner:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is not None:
            self._cancel.set()
        self.close()

    # -- workers ------------------------------------------------------------------------------
    def _worker(self) -> None:
        while not self._closed.is_set() or not self._queue.empty():
            if self._cancel.is_set():
                return
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._closed.is_set():
                    return
                continue
            problem = self._health()
            if problem:  # infrastructure is gone: stop instead of failing every rollout in turn
                self._abort(problem)
                return
            with self._lock:
                self.stats.running += 1
            try:
                result = self._run_attempt(item)
            except Exception as exc:  # a launcher bug must not lose the rollout silently
                now = utcnow()
                result = make_result(item.spec, item.attempt, FAILED, None, now, now, error=f"launcher error: {exc!r}",
                                     runner=getattr(self.runner, "name", "local"))
                self._rollouts.append(result.row())
            finally:
                with self._lock:
                    self.stats.running -= 1
            self._after_attempt(item, result)

    def _after_attempt(self, item: _Item, result: RolloutResult) -> None:
        failures = item.failures + (result.state in RETRY_FAILURES)
        retry = result.state in RETRY_FAILURES and failures <= self.settings.retries and not self._cancel.is_set()
        with self._lock:
            if retry:
                self.stats.retried += 1
                nxt = item.attempt + 1
                self._queue.put(_Item((item.priority[0], item.priority[1], nxt), item.spec, nxt, failures,
                                      item.ran + 1))
            elif result.state != CANCELLED:
                result.attempts_run = item.ran + 1
                self._finalize(self._groups[item.spec.group_id], result, ran=True)
            self._lock.notify_all()
        if self.progress is not None:
            self.progress.update()
        if self.settings.on_result is not None and not retry and result.state != CANCELLED:
            try:
                self.settings.on_result(result)
            except Exception as exc:  # the caller's callback must not end this worker (wait() would hang)
                print(f"[lightning] on_result failed for {result.rollout_id}: {exc!r}", flush=True)

    def _finalize(self, group: _Group, r: RolloutResult, *, ran: bool) -> None:
        """With the lock held: ``r`` is the rollout's final attempt; a group complete with it is reported."""
        group.final[r.rollout_id] = r
        self._results[r.rollout_id] = r
        if group.done and not group.reported:
            group.reported = True
            self._finished_groups.append(group.result())
        s = self.stats
        s.finished += 1
        s.ran += ran
        s.skipped += not ran
        s.failed += r.state in RETRY_FAILURES
        s.no_reward += r.state == NO_REWARD
        if r.reward is not None:
            s.reward_sum += r.reward
            s.reward_n += 1

    # -- one attempt --------------------------------------------------------------------------
    def _current_model_version(self) -> int | None:
        if self.model_version is not None:
            return int(self.model_version)
        if self.proxy is None:
            return None
        try:
            return int(self.proxy.control.state(timeout=10).get("model_version"))
        except Exception:
            return None

    def _run_attempt(self, item: _Item) -> RolloutResult:
        result, reward = run_attempt(self._settings, item.spec, item.attempt, self._cancel,
                                     self._current_model_version())
        if result.state in RETRY_FAILURES or result.state == NO_REWARD:  # a dead proxy loses POSTed rewards too
            problem = self._health()
            if problem:  # not the harness's fault: recorded as cancelled, so it neither retries now nor counts later
                result.state, result.error = CANCELLED, f"{problem}; the attempt ended with: {result.error}"
                self._abort(problem)
        # the attempt's own credential too: its harness had it (in HTTPS_PROXY, the base URL) and may
        # have written it into its reward file's info or text that ends up in the error
        own = (attempt_credential(self.proxy.token, result.rollout_id, result.attempt),) \
            if self.proxy and self.proxy.token else ()
        result.error = self._redactor.text(result.error, own)
        if reward is not None and reward.source in ("file", "command"):
            self._rewards.append({
                "reward_id": uuid.uuid4().hex, "rollout_id": result.rollout_id, "attempt": result.attempt,
                "reward": reward.value, "created_at": utcnow(), "source": reward.source,
                "info_json": None if reward.info is None else self._redactor.json_text(json.dumps(reward.info), own),
            })
        self._rollouts.append(result.row())
        if result.state == CANCELLED:
            try:
                self.flush()
            except Exception as exc:  # the writers keep the rows (written at close); the row is appended once
                print(f"[lightning] could not flush rows after a cancel: {exc!r}", flush=True)
        return result


def run_batch(tasks: Iterable[Task | Mapping[str, Any]], harness: Sequence[str] | str | None,
              settings: BatchSettings | None = None, **fields: Any) -> list[RolloutResult]:
    """Run tasks x samples to completion and return each rollout's final attempt (submission order);
    ``settings``/``fields`` as for :class:`BatchRunner`.

    Ctrl-C cancels: every harness process tree is killed, cancelled attempts are recorded, rows flushed.
    Raises :class:`BatchAborted` if the proxy (or ``health_check``) reports a failure mid-batch.
    """
    with BatchRunner(harness, settings, **fields) as batch:
        batch.submit(tasks)
        try:
            results = batch.wait()
        except KeyboardInterrupt:
            batch.cancel()
            raise
        if batch.error:
            raise BatchAborted(batch.error, results)
        return results


def clean_work_dirs(traces_dir: str | Path, run_id: str) -> None:
    """Remove a run's per-attempt folders (logs included); rows in the tables stay. ``rm -rf``, not
    ``shutil.rmtree``: a harness's tree a thousand folders deep makes the latter raise RecursionError
    (``ignore_errors`` covers OSError only); rm walks without recursing and follows no link."""
    check_run_id(run_id)
    subprocess.run(["rm", "-rf", "--", str(Path(traces_dir) / WORK_DIR / run_id)], check=False)
