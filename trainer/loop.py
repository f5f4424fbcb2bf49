"""`lightning-train run`'s loop: rollouts through the proxy, updates, in-place weight swaps.

Read :meth:`TrainingRun.run`, then :meth:`TrainingRun.step`: collect (the scheduler, scheduler.py,
decides which groups run and which finished ones an update may train on) -> samples (engine still
serving) -> the hold, only around the swap (proxy pause + drain, vLLM pause, update, checkpoint,
reload, model version + 1, resume) -> evaluate. docs/TRAINING.md tells the phases in full.

Crash safety: ``RUN/state.json`` is rewritten (atomically) after every completed step with the
checkpoint, the model version, the task stream position and the groups still in flight; rollout
ids are deterministic, so ``--resume`` resubmits the in-flight groups and the launcher skips every
rollout that had already finished. The command line and what it prints live in cli.py.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning_harness.process import log_tail, stop_group

from .config import ConfigError, RunConfig, save_config
from .scheduler import Schedule, Scheduler, staleness_filter

STATE_FILE = "state.json"
PIDS_FILE = "children.json"


class TrainingRun:
    """Owns the run folder, the engine, the proxy, the rollout runner, the scheduler and the policy
    updater; the model version (``state['model_version']``) is the loop's."""

    metrics = None  # the metrics table, opened by run(); a step driven without it (a unit) logs nowhere

    def __init__(self, cfg: RunConfig, *, resume: bool = False, console=None) -> None:
        from rich.console import Console

        self.cfg = cfg
        self.resume = resume
        self.console = console or Console(stderr=True)
        self.run_dir = cfg.run_path
        self.traces = self.run_dir / "traces"
        self.capture_state: dict | None = None  # proxy state after the last rollout phase (proxy/health.py)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.logs = self.run_dir / "logs"
        self.engine = self.proxy = self.service = self.runner = self.updater = self.metrics = self.progress = None
        self.engine_defaults: dict | None = {}  # what the engine applies to a call that gives none (once it is up)
        self.schedule = Schedule.from_rollout(cfg.rollout)
        self.scheduler: Scheduler | None = None
        self.state: dict[str, Any] = {}
        self.reports: list[dict[str, Any]] = []
        self.hooks: dict[str, Any] = {}

    def _hook(self, point: str, step: int) -> None:
        """Extension point (tests, custom schedulers): ``self.hooks[point](run, step)``. Points:
        'paused' (proxy paused and drained, or with ``proxy.in_flight: keep`` its calls in flight kept
        frozen in vLLM; vLLM paused; samples built, before the update)."""
        fn = self.hooks.get(point)
        if fn is not None:
            fn(self, step)

    @property
    def version(self) -> int:
        """The model version the engine serves (one more per completed update)."""
        return int(self.state["model_version"])

    # -- the run, top to bottom ------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Services up, the evaluation before training, the steps, the summary; everything stopped."""
        from .metrics import MetricsLog, ProgressLine

        cfg = self.cfg
        self.prepare()
        self.progress = ProgressLine(cfg.steps, self.console)
        self.metrics = MetricsLog(self.traces, cfg.run_id, self._open_trackers(),
                                  warn=lambda msg: self.progress.print(msg, markup=False))
        self.scheduler = Scheduler(self.schedule, self.train_tasks, cfg.seed, int(self.state.get("stream_pos", 0)))
        self.scheduler.discarded = int(self.state.get("discarded_groups", 0))  # a cumulative count, across --resume
        self._clock = (time.monotonic(), float(self.state.get("elapsed_s", 0.0)))  # elapsed across --resume
        try:
            self.start_services()
            self.load_updater()
            self.start_runner()
            self._evaluate_if_due(int(self.state["step"]))  # before training, or the one a crash cut short
            for label, tasks in self.scheduler.resume(self.state.get("in_flight", [])):
                self.runner.submit(tasks, step=label)
            for step in range(int(self.state["step"]) + 1, cfg.steps + 1):
                self.step(step)
            return self.finish()
        finally:
            self.shutdown()

    def step(self, step: int) -> dict[str, Any]:
        """collect -> samples -> hold + swap -> evaluate, then the step is recorded (state file, metrics)."""
        from .cli import step_line

        cfg = self.cfg
        self.progress.update(step=step, version=self.version)
        t_step = time.monotonic()
        groups = self.collect(step)
        rep: dict[str, Any] = {"time/rollout_s": time.monotonic() - t_step}
        rep.update(train_stats(groups, cfg.eval.success_threshold))
        self._check_failures(groups, first=not self.reports)
        rep["async/carry_over"] = len(self.scheduler.in_flight)  # groups still running through this update
        rep["async/discarded_groups"] = self.scheduler.discarded  # cumulative: finished too stale to train
        rep.update(self.update_phase(step, groups))
        rep["time/step_s"] = time.monotonic() - t_step
        rep["time/elapsed_s"] = time.monotonic() - self._clock[0] + self._clock[1]
        # recorded now that its weights serve: a crash in the eval resumes after this step, so its
        # version number is never given to other weights
        self.state.update(step=step, stream_pos=self.scheduler.stream.pos, discarded_groups=self.scheduler.discarded,
                          in_flight=list(self.scheduler.in_flight.values()))  # resubmitted by --resume
        # logged before the state file says the step is done (--resume never redoes a recorded step;
        # a step redone after a crash here logs again, and the latest value wins)
        self._log_metrics(step, rep)
        self._save_state(elapsed=rep["time/elapsed_s"])
        rep.update(self._evaluate_if_due(step))
        self.reports.append({"step": step, **rep})
        self.progress.print(step_line(step, cfg.steps, rep))
        self.progress.update(version=self.version, reward=rep.get("train/reward_mean"),
                             eval=self.state.get("evals", {}).get(str(self.version), {}).get("eval/success"))
        return rep

    def collect(self, step: int) -> list:
        """Rollout phase: wait until ``groups_per_step`` groups finished, keeping the scheduler's slots full."""
        sched, version = self.scheduler, self.version
        sched.expire(version)  # waited too long since the last update
        while True:
            self._check_runner()
            # free slots are filled even when enough groups already wait: they run through the update
            tasks = sched.launches(step)
            if tasks:
                self.runner.submit(tasks, step=step)
            if sched.ready:
                return sched.take()
            sched.finished(self.runner.wait_groups(1, timeout=1.0), version)
            st = self.runner.stats
            self.progress.update(phase="rollouts", done=f"{len(sched.backlog)}/{self.schedule.groups_per_step} groups",
                                 in_flight=st.running, reward=st.mean_reward)

    def _check_runner(self) -> None:
        """A launcher that stopped by itself (its proxy or engine died) cancels its rollouts and answers
        ``wait_groups`` at once, forever: stop the run with its reason instead of spinning on it."""
        error = getattr(self.runner, "error", None)
        if error:
            from lightning_harness.launcher.batch import BatchAborted

            raise BatchAborted(f"rollouts stopped: {error}", self.runner.results())

    def _check_failures(self, groups: list, first: bool) -> None:
        """Every rollout failed: on the first step that is a setup error (stop, say why); later, warn."""
        rollouts = [r for g in groups for r in g.rollouts]
        if not rollouts or any(r.ok for r in rollouts):
            return
        r = rollouts[0]
        msg = (f"all {len(rollouts)} rollouts of this step failed; first: state={r.state} error={r.error!r}\n"
               f"log {r.log_path}:\n{log_tail(r.log_path, 15)}")
        if first:
            raise RuntimeError(msg + "\n(check harness.command, harness.cwd and the reward setup)")
        self.progress.print(f"[yellow]warning: {msg}[/]")

    def update_phase(self, step: int, groups: list) -> dict[str, Any]:
        """Samples of the finished groups (engine serving), then the hold around the swap only."""
        rep: dict[str, Any] = {}
        version = self.version
        table = self.step_samples(step, groups, version, rep)
        rep.update(self.swap(step, table, version))
        return rep

    def step_samples(self, step: int, groups: list, version: int, rep: dict[str, Any]):
        """The samples this update trains on, built while the harnesses keep running.

        Why outside the hold: the groups are finished (every rollout ended, its reward judged), so
        their spans and rollout rows are final once the proxy and the runner have flushed; nothing
        here needs the engine paused. (A harness killed mid-call leaves that call to end as a
        ``client_disconnect`` error span, which is never trained on, so a span still on its way
        cannot change these samples.) The store is compacted first (bounded file count), and the
        build reads only the selected rollouts' rows (``build_samples(rollouts=...)``).
        """
        import pyarrow as pa

        from lightning_harness.proxy.health import require_capture
        from lightning_harness.schemas import PartWriter, compact_store

        from .samples import build_samples
        from .views import past_damaged_parts

        cfg = self.cfg
        t0 = time.monotonic()
        self.progress.update(phase="samples")
        # spans on disk, and all of them: stop rather than train on a partial phase
        self.capture_state = require_capture(self.proxy.control, self.capture_state)
        self.runner.flush()
        rep["time/flush_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        try:  # an uncompacted store is still correct (every row read once): a failure must not stop the step
            compacted = compact_store(self.traces)
            rep["store/files"] = sum(r.files_after for r in compacted.values())
        except Exception as exc:  # disk full, a part compaction cannot write: logged, tried again next step
            self.console.print(f"[yellow]compacting {self.traces} failed (the step goes on uncompacted): {exc!r}[/]")
        rep["time/compact_s"] = time.monotonic() - t1
        t1 = time.monotonic()
        # the groups consumed are selected by their rollouts (bound parameters)
        options = cfg.sample_options([r.rollout_id for g in groups for r in g.rollouts], self.engine_defaults)
        table, stats = past_damaged_parts(lambda: build_samples(self.traces, **options),  # a damaged part is
                                          lambda: None)  # skipped, not fatal
        rep.update({f"samples/{k}": v for k,
                    v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        table, st = staleness_filter(table, version, self.schedule.max_staleness, self.schedule.staleness_mode)
        rep.update(st)
        if table.num_rows:
            table = table.set_column(table.schema.get_field_index("step"), "step",
                                     pa.array([step] * table.num_rows, pa.int64()))
            PartWriter(self.traces, "samples", background=False).write_table(table)
        rep["time/build_s"] = time.monotonic() - t1
        rep["time/samples_s"] = time.monotonic() - t0  # flush + compaction + build, all outside the hold
        return table

    def swap(self, step: int, table, version: int) -> dict[str, Any]:
        """The hold: proxy pause + drain, the engine's part (:meth:`_engine_swap`), proxy resume.
        The proxy is resumed however the engine's part ends: a failed swap must not hold every
        harness until someone stops the proxy (an attached one is never stopped by this run).
        With ``proxy.in_flight: keep`` nothing is drained: the calls in flight are frozen in the
        engine and finish after it, so the hold is the swap alone, however long they generate."""
        from .checkpoint import prune

        cfg, ctl, rep = self.cfg, self.proxy.control, {}
        t_pause = time.monotonic()
        self.progress.update(phase="pause+drain")
        ctl.pause()
        try:
            if cfg.proxy.in_flight == "keep":  # 'drained': nothing was in flight to keep
                in_flight = int(ctl.state().get("in_flight", 0) or 0)
                drain = {"waited_s": 0.0, "drained": in_flight == 0, "in_flight": in_flight}
            else:
                drain = ctl.drain(timeout=cfg.proxy.drain_timeout_s)
            rep["time/drain_s"] = float(drain.get("waited_s", time.monotonic() - t_pause))
            rep["proxy/drained"] = bool(drain.get("drained", False))
            rep["proxy/in_flight_after_drain"] = int(drain.get("in_flight", 0) or 0)
            new_version, ckpt = self._engine_swap(step, table, version, rep)
            rep["proxy/held"] = int(ctl.state().get("held", 0) or 0)
        finally:
            ctl.resume()
        rep["time/pause_s"] = time.monotonic() - t_pause
        rep["model_version"] = new_version
        on_disk = self.state["checkpoint"]  # what state.json names until the step is recorded: resumable
        self.state.update(model_version=new_version, checkpoint=str(ckpt))
        prune(self.ckpt_dir, cfg.checkpoint.keep_last, protect=(self.state["checkpoint"], on_disk,
                                                                  self.state["base_model"]))
        return rep

    def _engine_swap(self, step: int, table, version: int, rep: dict) -> tuple[int, Path]:
        """vLLM pause (+ sleep), update, save, reload, resume; returns the new version and checkpoint.

        On a GPU the update needs the engine asleep (memory); on CPU it shares the cores with the
        engine, and the policy must not change under calls in flight, so it stays inside too.
        """
        from .checkpoint import step_dir
        from .update import scheduled_lr

        cfg = self.cfg
        when = cfg.engine.sleep_on_update
        sleep = when == "always" or (when == "auto" and self.device == "cuda")
        # what the proxy's drain left in flight is aborted, not awaited: a harness's call with a huge
        # max_tokens (ignore_eos) kept the engine's own wait past its HTTP timeout, ending the run
        kept = cfg.proxy.in_flight == "keep"
        mode = "keep" if kept else "wait" if rep.get("proxy/drained", True) else "abort"
        try:
            self.engine.pause(mode)
            if sleep:
                self.engine.sleep(cfg.engine.sleep_level, mode=mode)
            self._hook("paused", step)
            self.progress.update(phase="update")
            lr = scheduled_lr(self.cfg.update, step, self.cfg.steps)
            self.updater.set_lr(lr)
            rep.update(self.updater.update(table))
            rep["update/lr"] = lr
            new_version = self._next_version(version)
            t0 = time.monotonic()
            ckpt = self.updater.save(step_dir(self.ckpt_dir, step), model_version=new_version, step=step,
                                     save_optimizer=cfg.checkpoint.save_optimizer)
            rep["time/save_s"] = time.monotonic() - t0
            self.state["version_served"] = new_version  # on disk before any span carries it
            self._save_state()
            # stamped before the engine generates with the new weights: a call the drain left in the
            # engine (queued there, served after the reload) ends under this version and its span says
            # so ('version_changed', not trained on); a reload that fails leaves the reserved number
            self.proxy.control.set_model_version(new_version)
            # new weights into the engine, in place
            self.progress.update(phase="reload")
            # a full wake resumes vLLM's scheduler: calls kept frozen would generate with the old weights
            # (or, at sleep level 2, with none) until the reload. Kept: the weights first, the rest after it
            if sleep:
                self.engine.wake_up(tags=["weights"] if kept else None)
            rep["time/reload_s"] = self.engine.reload_weights(ckpt, kept=kept)
            if sleep and kept:
                self.engine.wake_up(tags=["kv_cache"])
        finally:
            if sleep and self.engine.is_sleeping():
                self.engine.wake_up()
            self.engine.resume()
        return new_version, ckpt

    def _next_version(self, version: int) -> int:
        """One version per step, even if nothing was trainable, and never one given before: a trainer
        killed after its engine served new weights but before the step was recorded resumes at the
        old version, and its redone step's weights must not take the number the proxy stamped on
        spans of the lost weights (``state['version_served']``, written before the engine reloads)."""
        return max(version, int(self.state.get("version_served", version))) + 1

    # -- eval --------------------------------------------------------------------------------------
    def _eval_due(self, step: int) -> bool:
        """Whether the weights after ``step`` get evaluated: before training (step 0, ``eval.before``),
        every ``eval.every`` steps, after the last step (``eval.after``)."""
        e = self.cfg.eval
        if step == 0:
            return bool(e.before)
        return bool((e.every and step % e.every == 0) or (step == self.cfg.steps and e.after))

    def _evaluate_if_due(self, step: int) -> dict[str, Any]:
        """The evaluation due after ``step``, unless ``state.json`` already holds it: a crash during it
        (the step itself already recorded, so never redone) leaves it to the ``--resume``; logged at
        ``step`` and recorded in the state file."""
        if not self._eval_due(step) or str(self.version) in self.state.get("evals", {}):
            return {}
        out = self.evaluate(self.version)  # {} without eval tasks
        if out:
            self._log_metrics(step, out)
            self._save_state()
        return out

    def _log_metrics(self, step: int, values: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.log(step, values)

    def evaluate(self, version: int) -> dict[str, float]:
        """Held-out tasks at eval temperature, through the proxy (recorded with split 'eval')."""
        from lightning_harness.launcher.batch import run_batch

        if not self.eval_tasks:
            return {}
        cfg, e = self.cfg, self.cfg.eval
        total, finished = len(self.eval_tasks) * e.group_size, itertools.count(1)
        self.progress.update(phase=f"eval v{version}", done=f"0/{total} rollouts")
        command, settings = self._harness_phase(
            e.command or cfg.harness.command, e.temperature, step=version, run_id=f"{cfg.run_id}-eval",
            samples=e.group_size, split="eval",
            on_result=lambda _r: self.progress.update(done=f"{next(finished)}/{total} rollouts"))
        t0 = time.monotonic()
        results = run_batch(self.eval_tasks, command, settings)
        rewards = [r.reward if r.reward is not None else 0.0 for r in results]
        out = {
            "eval/reward_mean": sum(rewards) / max(len(rewards), 1),
            "eval/success": sum(1 for r in rewards if r >= e.success_threshold) / max(len(rewards), 1),
            "eval/rollouts": len(results),
            "eval/failed": sum(1 for r in results if not r.ok),
            "time/eval_s": time.monotonic() - t0,
        }
        self.state.setdefault("evals", {})[str(version)] = out
        self.progress.print(f"eval @ version {version}: reward {out['eval/reward_mean']:.3f}, "
                            f"success {out['eval/success']:.1%} ({len(results)} rollouts, {out['time/eval_s']:.0f}s)")
        return out

    # -- setup: state, tasks, services ------------------------------------------------------------
    def prepare(self) -> None:
        """The run folder and its state: continued with ``--resume``, else fresh; then the tasks."""
        state_file = self.run_dir / STATE_FILE
        if self.run_dir.exists() and state_file.exists() and not self.resume:
            raise ConfigError(f"{self.run_dir} already holds a run; pass --resume to continue it, "
                              f"or choose another run_dir (--set run_dir=...)")
        for d in (self.traces, self.ckpt_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        if self.resume and state_file.exists():
            self.state = json.loads(state_file.read_text())
            kill_leftovers(self.run_dir, self.console)
            self.console.print(f"[bold]resuming[/] {self.run_dir} after step {self.state['step']} "
                               f"(model version {self.state['model_version']})", soft_wrap=True)
        else:
            self.state = self._fresh_state()
        save_config(self.cfg, self.run_dir / "config.yaml")
        self._load_tasks()

    def _fresh_state(self) -> dict[str, Any]:
        cfg = self.cfg
        model = cfg.path(cfg.model)
        if not (model / "config.json").exists():
            raise ConfigError(f"model: {model} is not an HF model folder (no config.json)")
        state = {"step": 0, "model_version": 0, "checkpoint": str(model), "base_model": str(model),
                 "stream_pos": 0, "in_flight": [], "run_id": cfg.run_id}
        from .checkpoint import is_tied, step_dir, untie_checkpoint

        if cfg.engine.untie_embeddings and is_tied(model):
            # vLLM's reload_weights leaves a tied output head stale: serve and train an untied copy
            step0 = untie_checkpoint(model, step_dir(self.ckpt_dir, 0))
            state.update(checkpoint=str(step0), base_model=str(step0))
            self.console.print(f"model has tied embeddings: serving and training an untied copy ({step0})",
                               soft_wrap=True)
            if cfg.engine.url:
                self.console.print("[yellow]warning: an attached engine must serve an untied model too, "
                                   "or weight swaps leave its output head stale[/]")
        return state

    def _load_tasks(self) -> None:
        from lightning_harness.launcher.tasks import load_tasks

        cfg = self.cfg
        load = functools.partial(load_tasks, id_field=cfg.tasks.id_field, private_fields=cfg.tasks.private_fields)
        self.train_tasks = load(cfg.path(cfg.tasks.train))
        self.eval_tasks = []
        if cfg.tasks.eval:
            self.eval_tasks = load(cfg.path(cfg.tasks.eval), limit=cfg.eval.max_tasks)
            overlap = {t.id for t in self.train_tasks} & {t.id for t in self.eval_tasks}
            if overlap:
                raise ConfigError(f"train and eval tasks overlap on ids {sorted(overlap)[:5]}")
        need = self.schedule.groups_in_flight
        if len(self.train_tasks) < need:
            raise ConfigError(f"{len(self.train_tasks)} train tasks but one step launches up to {need} groups")

    def _record_children(self) -> None:
        entries = []
        if self.engine is not None and getattr(self.engine, "process", None) is not None:
            entries.append({"what": "vllm", "pid": self.engine.process.pid, "marker": "vllm.entrypoints"})
        if self.proxy is not None and self.proxy.pid:
            entries.append({"what": "proxy", "pid": self.proxy.pid, "marker": "lightning_harness.proxy"})
        if self.service is not None and self.service.pid:
            entries.append({"what": "harness service", "pid": self.service.pid, "marker": " ".join(self.service.argv)})
        write_json_atomic(self.run_dir / PIDS_FILE, entries)

    def start_services(self) -> None:
        """vLLM (started from the current checkpoint, or attached and brought to it) and the proxy."""
        from lightning_harness.launcher.engine import VLLMEngine, detect_device
        from lightning_harness.proxy.client import ProxyProcess

        cfg, e = self.cfg, self.cfg.engine
        ckpt = Path(self.state["checkpoint"])
        self.device = detect_device()
        self.progress.update(phase="starting vLLM")
        t0 = time.monotonic()
        if e.url:
            self.engine = VLLMEngine.attach(e.url, served_name=e.served_model_name, timeout=e.startup_timeout_s)
            if self.engine.is_paused():
                self.engine.resume()
            self.engine.reload_weights(ckpt)  # an attached engine may serve other weights
        else:
            self.engine = VLLMEngine.start(
                ckpt, e.served_model_name, max_model_len=e.max_model_len, dtype=e.dtype,
                kv_cache_bytes=e.kv_cache_memory_bytes, extra_args=[str(a) for a in e.extra_args],
                log_path=self.logs / "vllm.log", startup_timeout=e.startup_timeout_s,
                temperature=self.cfg.rollout.temperature or None,  # a harness that gives none: on-policy
            )
        self.engine_defaults = self.engine.default_sampling()  # None: not known (calls leaving it one are counted)
        self._record_children()  # a trainer killed from here on leaves nothing unaccounted for
        self.progress.print(f"vLLM ready at {self.engine.url} in {time.monotonic() - t0:.0f}s "
                            f"(serving {e.served_model_name}, {self.device})")
        self.progress.update(phase="starting proxy")
        self.proxy = ProxyProcess(
            self.traces, upstreams=[self.engine.url], served_model=e.served_model_name,
            model_version=int(self.state["model_version"]), log_path=self.logs / "proxy.log",
            flush_seconds=cfg.proxy.flush_seconds, inject_token_ids=cfg.proxy.inject_token_ids,
        ).start()
        self._record_children()
        self.progress.print(f"proxy ready: reverse {self.proxy.reverse_url}, forward {self.proxy.forward_url}")
        if cfg.harness.service:
            self.start_harness_service()

    def start_harness_service(self) -> None:
        """The harness service (``harness.service``), listening where every harness will look for it."""
        from lightning_harness.launcher.service import HarnessService

        h = self.cfg.harness
        self.progress.update(phase="starting the harness service")
        self.service = HarnessService(fill(h.service, {"python": sys.executable}), cwd=self._harness_cwd(),
                                      log_path=self.logs / "harness-service.log", env=self._harness_env()).start()
        self._record_children()
        self.progress.print(f"harness service ready at {self.service.socket_path}")

    def start_runner(self) -> None:
        from lightning_harness.launcher.batch import BatchRunner

        cfg = self.cfg
        command, settings = self._harness_phase(cfg.harness.command, cfg.rollout.temperature, run_id=cfg.run_id,
                                                samples=cfg.rollout.group_size, split="train", flush_seconds=0.5)
        self.runner = BatchRunner(command, settings)

    def _harness_phase(self, command: Any, temperature: float, **fields: Any) -> tuple[Any, Any]:
        """A phase's harness command (phase placeholders filled) and its launcher BatchSettings: what
        training and evaluation share comes from ``harness``; ``fields`` are what they set apart."""
        from lightning_harness.launcher.batch import BatchSettings

        c, h = self.cfg, self.cfg.harness
        env = self._harness_env()
        if self.service is not None:
            env.update(self.service.env)
        settings = BatchSettings(
            traces_dir=self.traces, proxy=self.proxy, concurrency=h.concurrency, timeout=h.timeout_s,
            retries=h.retries, reward_cmd=self._reward_cmd(), self_reward=h.self_reward, run_as=h.run_as,
            cwd=self._harness_cwd(), extra_env=env, health_check=self.service.check if self.service else None,
            **fields)
        values = {"temperature": temperature, "max_tokens": c.rollout.max_tokens or "", "python": sys.executable}
        return fill(command, values), settings

    def _harness_env(self) -> dict[str, str]:
        """What every harness (and the harness service) gets besides Contract 2: ``harness.pass_env``
        from the trainer's environment, ``harness.env``, and the model name it asks for."""
        from lightning_harness.launcher.local import passed_env

        h = self.cfg.harness
        env = {**passed_env(h.pass_env or ()), **{str(k): str(v) for k, v in (h.env or {}).items()}}
        if h.model_name:
            env.setdefault("OPENAI_MODEL", h.model_name)
        return env

    def _harness_cwd(self) -> str:
        c = self.cfg
        return str(c.path(c.harness.cwd) if c.harness.cwd else (c.base_dir or os.getcwd()))

    def _reward_cmd(self) -> str | None:
        rc = self.cfg.harness.reward_cmd
        if rc is None:
            return None
        if not isinstance(rc, str):  # the launcher takes a shell line: join an argv list
            import shlex

            rc = " ".join(shlex.quote(str(a)) if not str(a).startswith("{") else str(a) for a in rc)
        return fill(rc, {"python": sys.executable})

    def load_updater(self) -> None:
        from .update import PolicyUpdater

        self.progress.update(phase="loading policy")
        self.updater = PolicyUpdater(self.state["checkpoint"], self.cfg.update,
                                     reference_dir=self.state["base_model"])


    def _open_trackers(self) -> dict[str, Any]:
        """The trackers named in ``logger`` (TensorBoard, W&B, MLflow), writing under RUN/trackers."""
        from .trackers import open_trackers

        cfg = self.cfg
        if not cfg.logger:
            return {}
        trackers = open_trackers(cfg.logger, cfg.tracking_path, cfg.run_id, project=cfg.tracking.project,
                                 wandb_mode=cfg.tracking.wandb_mode, mlflow_uri=cfg.tracking.mlflow_uri,
                                 config=cfg.to_dict())
        self.progress.print(f"metrics also go to {', '.join(trackers)} under {cfg.tracking_path}")
        return trackers

    def _save_state(self, elapsed: float | None = None) -> None:
        if elapsed is not None:
            self.state["elapsed_s"] = elapsed
        write_json_atomic(self.run_dir / STATE_FILE, self.state)

    def finish(self) -> dict[str, Any]:
        """The reward curve, the before/after table (cli.py prints it) and RUN/summary.json."""
        from .cli import print_summary
        from .plot import plot_rewards

        cfg = self.cfg
        png = None
        if cfg.plot:
            png = plot_rewards(self.traces, self.run_dir / "reward_curve.png", cfg.run_id)
        summary = {"run_dir": str(self.run_dir), "checkpoint": self.state["checkpoint"],
                   "model_version": self.state["model_version"], "plot": str(png) if png else None,
                   "evals": self.state.get("evals", {}), "steps": self.state["step"],
                   "eval_tasks": str(cfg.path(cfg.tasks.eval)) if cfg.tasks.eval else None}
        self.progress.close()
        print_summary(self.console, summary, self.traces, cfg.run_id)
        write_json_atomic(self.run_dir / "summary.json", summary)
        return summary

    def _compact_at_exit(self) -> None:
        """Every writer has stopped: compact what the last step and the eval left, inputs removed at
        once (no grace: the run's own readers are gone; a late reader retries on a missing part)."""
        from lightning_harness.schemas import compact_store

        try:
            if self.traces.is_dir():
                compact_store(self.traces, grace_s=0)
        except Exception as exc:  # the traces stay correct uncompacted; keep shutting down
            self.console.print(f"[yellow]compacting {self.traces} at exit failed: {exc!r}[/]")

    def shutdown(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.runner is not None:
            try:
                self.runner.cancel() if self.runner.pending else None
                self.runner.close()
            except Exception as exc:  # keep shutting the rest down
                self.console.print(f"[red]runner close failed: {exc!r}[/]")
        if self.metrics is not None:
            self.metrics.close()
        if self.service is not None:
            self.service.stop()
        if self.proxy is not None:
            self.proxy.stop()
        self._compact_at_exit()
        if self.engine is not None:
            if self.cfg.engine.url:  # attached: leave it serving, not asleep nor paused
                with contextlib.suppress(Exception):
                    if self.engine.is_sleeping():
                        self.engine.wake_up()
                    if self.engine.is_paused():
                        self.engine.resume()
            self.engine.stop()  # a no-op for attached engines
        (self.run_dir / PIDS_FILE).unlink(missing_ok=True)


# -- small pieces: state file, leftovers of a crashed run, phase placeholders, train statistics ----
def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def kill_leftovers(run_dir: Path, console) -> None:
    """A killed trainer leaves its vLLM and proxy running (own process groups): stop them, but only
    if the pid still runs the command we recorded (pids get reused)."""
    f = run_dir / PIDS_FILE
    if not f.exists():
        return
    for entry in json.loads(f.read_text()):
        pid, marker = entry.get("pid"), entry.get("marker", "")
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker and marker in cmdline:
            console.print(f"[yellow]stopping leftover {entry.get('what')} (pid {pid}) of the previous run[/]")
            stop_group(pid, grace=10.0)
    f.unlink(missing_ok=True)


def fill(command: Any, values: dict[str, Any]) -> Any:
    """Fill ``{temperature}``-style phase placeholders; task placeholders are left for the launcher."""
    from lightning_harness.launcher.command import substitute

    if isinstance(command, str):
        return substitute(command, values, quote=False)
    return [substitute(str(a), values) for a in command]


def train_stats(groups: list, threshold: float) -> dict[str, float]:
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = [r.reward for r in rollouts if r.reward is not None]
    return {
        "train/groups": len(groups),
        "train/rollouts": len(rollouts),
        "train/failed": sum(1 for r in rollouts if not r.ok),
        "train/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "train/success": sum(1 for x in rewards if x >= threshold) / len(rollouts) if rollouts else float("nan"),
        "train/duration_mean_s": sum(r.duration_s or 0 for r in rollouts) / max(len(rollouts), 1),
    }

