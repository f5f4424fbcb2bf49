"""The training-run configuration: one YAML file, every key overridable from the command line.

Why a typed tree instead of a free dict: a typo (``update.lr_rate``) must fail before vLLM spends a
minute starting, with the key and the closest known key named. Overrides use dotted keys and YAML
values: ``--set update.lr=2e-5 --set rollout.mode=async --set steps=20``.

Why pydantic (v2, already in the training environment through vLLM): its dataclasses check the whole
tree in one pass. Types and coercion (YAML 1.1 reads ``1e-5`` as a string: pydantic parses it as the
float the field wants, and refuses ``abc``), unknown keys (``extra="forbid"``), choices (``Literal``)
and ranges (``Field(ge=1)``) are declared on the fields, and every problem comes back at once with its
location, which we only turn into a dotted key and a suggestion. The sections stay standard
dataclasses (``dataclasses.asdict`` and ``field`` work as before), so the rest of the trainer reads
``cfg.update.lr`` unchanged. OmegaConf structured configs were the other choice: their dotlist merge
is built in, but they have no ``Literal`` (choices become Enum members, not the strings the trainer
compares), are not in the training environment, and hand back DictConfig objects without our methods;
the merge they would save is ``parse_overrides`` below. What stays ours: the ``--set``
syntax, the closest-key hint, the keys a run cannot do without, the rules between sections, and how
paths resolve.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from collections.abc import Iterable
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from .advantages import ESTIMATORS
from .merge import MODES as SAMPLE_MODES
from .weights import MODES as LOSS_MODES

LR_SCHEDULES = ("constant", "linear", "cosine")
AUTOCAST_MODES = ("auto", "bfloat16", "off")
AtLeastOne = Annotated[int, Field(ge=1)]
NotNegative = Annotated[int, Field(ge=0)]
typed_section = pydantic_dataclass(config=ConfigDict(extra="forbid"))  # every class below: unknown keys fail


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key and why."""


@typed_section
class Section:
    """What every section shares: built from YAML / ``--set`` data with errors that name the key."""

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, data: Any) -> Any:
        return {} if data is None else data  # 'eval:' with every line commented out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Any:
        """From plain data (YAML / --set): unknown keys, wrong types and bad choices fail, all named."""
        try:
            return TypeAdapter(cls).validate_python(data or {})
        except ValidationError as exc:
            raise ConfigError("\n  ".join(["invalid config:", *explain(exc, cls)])) from None


@typed_section
class UpdateConfig(Section):
    """Every knob of one policy update (the loop's YAML ``update:`` section maps onto this)."""

    lr: float = 1e-5
    lr_schedule: Literal[LR_SCHEDULES] = "constant"  # 'constant', or 'linear' / 'cosine' decay over the run's steps...
    lr_final_ratio: float = 0.1  # ...to lr * this at the last step (lightning-train run only)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_low: float = 0.2  # PPO clip range: ratio in [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28  # asymmetric ("clip-higher") keeps exploration alive
    tis_cap: float = 2.0  # truncated importance weight cap for pi_prox / mu; <= 0 disables
    kl_coef: float = 0.0  # k3 KL to the frozen reference; 0 = no reference model loaded
    max_grad_norm: float = 1.0  # <= 0 disables clipping
    micro_batch_size: AtLeastOne = 4  # samples per forward/backward (memory only; never changes the result)
    mini_batches: AtLeastOne = 1  # optimizer steps per update (rollouts split into this many groups)
    epochs: AtLeastOne = 1  # passes over the samples per update
    loss_mode: Literal[LOSS_MODES] = "rollout"  # weights.aggregate_loss mode: 'rollout', 'token-mean' or 'seq-mean'
    #   (must match the mode the samples' loss_weight was built with; the loop keeps them in sync)
    max_seq_len: int = 4096  # prompt + response longer than this is cut from the right
    temperature: float | None = Field(default=None, gt=0)  # logits / T before log-softmax; None: the
    #   rollout's temperature (the engine records the logprobs it sampled with, launcher/engine.py), else 1
    device: str = "auto"  # 'auto' = cuda if available else cpu
    dtype: str = "float32"  # training dtype ('float32' on CPU; 'bfloat16' on GPU if you like)
    seed: int = 0
    gradient_checkpointing: bool = False  # recompute the model body's activations in the backward
    autocast: Literal[AUTOCAST_MODES] = "auto"  # bf16 autocast: 'auto' = on cuda only, 'bfloat16' = always, 'off'
    logprob_chunk_tokens: int = 1024  # response positions per LM-head chunk in the log-prob step
    #   (peak ~ a few chunk x vocab fp32 tensors); 0 = full logits (a [B, L, V] and a [B, R, V] tensor)
    skip_zero_advantage: bool = True  # drop samples whose advantage is exactly 0 (no signal)


@typed_section
class HarnessConfig(Section):
    """How to run one rollout: an ordinary agent command, given Contract 2's environment."""

    command: Any = None  # list or string; '{temperature}', '{max_tokens}' and '{python}' (this
    #   interpreter) are filled per phase; task fields ('{question}') are filled by the launcher
    cwd: str | None = None  # where harnesses run (default: the config file's folder)
    reward_cmd: Any = None  # optional verifier printing a reward; when set, the harness's own report never counts
    self_reward: bool = True  # without reward_cmd, may the harness's own report be its reward (launcher --self-reward)
    run_as: Any = None  # run harnesses as this unprivileged user ('nobody', a uid, 'user:group') or a list,
    #   one per running attempt (launcher --run-as)
    timeout_s: float = 300.0  # per rollout attempt
    retries: int = 0
    env: dict = field(default_factory=dict)  # extra environment for every harness
    pass_env: list = field(default_factory=list)  # the trainer's variables to pass on (glob: 'HF_*'); unasked a
    #   harness gets only PATH, HOME, USER, SHELL, locale, TMPDIR, PYTHONPATH, VIRTUAL_ENV (launcher --pass-env)
    concurrency: int = 16  # harness processes alive at once
    model_name: str | None = None  # model name the harness asks for (mapped to the served model)
    service: Any = None  # optional long-lived helper the harness commands talk to (an agent kept imported):
    #   started once before the first rollout, stopped at the end; it and every harness get its Unix
    #   socket path as LIGHTNING_HARNESS_SERVICE ('{python}' is filled; launcher/service.py)


@typed_section
class TasksConfig(Section):
    train: str | None = None  # JSONL/JSON/Parquet task file
    eval: str | None = None  # held-out tasks; must not overlap train (checked)
    id_field: str | None = None
    # task fields only the reward command sees (a solution, hidden tests): the harness gets the row without them
    private_fields: list[str] = field(default_factory=list)


@typed_section
class RolloutConfig(Section):
    """The rollout phase. sync: a step's groups all finish before its update. async: up to
    ``groups_in_flight`` groups run at once; an update takes the finished groups (at least
    ``groups_per_step``) while the rest keep running through the pause."""

    mode: Literal["sync", "async"] = "sync"  # 'sync' or 'async'
    groups_per_step: AtLeastOne = 8  # groups (tasks) consumed by one update
    group_size: AtLeastOne = 4  # samples per task (GRPO group)
    groups_in_flight: int = 16  # async only: groups kept active (> groups_per_step)
    max_staleness: int = 1  # async only: samples older than this many versions...
    staleness_mode: Literal["drop", "tis"] = "drop"  # ...are dropped ('drop') or kept with TIS correction only ('tis')
    temperature: float = 1.0
    max_tokens: int | None = None


@typed_section
class SamplesConfig(Section):
    """Passed to trainer.samples.build_samples."""

    mode: Literal[SAMPLE_MODES] = "trajectory"  # merge consecutive calls of a rollout ('trajectory') or not
    advantage: Literal[ESTIMATORS] = "grpo"  # rollout-level advantage estimator: 'grpo' or 'rloo'
    weight_mode: Literal[LOSS_MODES] = "rollout"  # 'rollout' (each rollout counts once), 'token-mean' or 'seq-mean';
    #   update.loss_mode follows it
    include_secret_spans: bool = False  # train on spans the proxy masked a secret in (retokenised
    #   from the masked text; needs the tokenizer); by default they are left out
    extra: dict = field(default_factory=dict)  # any other build_samples keyword


@typed_section
class EvalConfig(Section):
    every: int = 5  # held-out eval every K steps (0 = only before and after)
    before: bool = True
    after: bool = True
    group_size: int = 1  # samples per held-out task
    temperature: float = 0.0
    max_tasks: int | None = None
    success_threshold: float = 1.0  # a rollout "succeeds" when its reward >= this
    command: Any = None  # defaults to harness.command


@typed_section
class EngineConfig(Section):
    """The inference engine (vLLM) the proxy routes to."""

    url: str | None = None  # attach to a running vLLM (must run with VLLM_SERVER_DEV_MODE=1) instead of starting one
    served_model_name: str = "policy"
    max_model_len: int = 1024
    dtype: str = "float32"
    kv_cache_memory_bytes: int | None = 268435456
    extra_args: list = field(default_factory=list)
    startup_timeout_s: float = 900.0
    sleep_on_update: Literal["auto", "always", "never"] = "auto"  # 'auto' = sleep/wake only on GPU (frees memory)
    sleep_level: int = 1
    untie_embeddings: bool = True  # serve/train an untied copy of a tied model (vLLM reload leaves a tied head stale)


@typed_section
class ProxyRunConfig(Section):
    # calls in flight when an update starts: 'drain' waits for them (at most drain_timeout_s, then aborts
    # what is left); 'keep' freezes them in the engine, which finishes them under the new weights
    # (recorded as 'version_changed', not trained on): the hold is then the swap alone
    in_flight: Literal["drain", "keep"] = "drain"
    drain_timeout_s: float = 300.0  # how long an update waits for in-flight calls
    flush_seconds: float = 0.5
    inject_token_ids: bool = True


@typed_section
class CheckpointConfig(Section):
    keep_last: int = 2  # older step checkpoints are deleted (the initial model is never touched)
    save_optimizer: bool = True


@typed_section
class TrackingConfig(Section):
    """Where the trackers named in ``logger`` write (trainer/trackers.py)."""

    project: str = "lightning-harness"  # W&B project and MLflow experiment; the run is named run_id
    dir: str | None = None  # tracker files (TensorBoard events, W&B offline runs, MLflow file store);
    #   default RUN/trackers
    wandb_mode: Literal["offline", "online", "disabled"] | None = None  # default 'offline' unless WANDB_MODE
    #   says otherwise (`wandb sync` uploads later)
    mlflow_uri: str | None = None  # MLflow tracking URI; default MLFLOW_TRACKING_URI, else a file store
    #   under tracking.dir


@typed_section
class RunConfig(Section):
    """A whole `lightning-train run`. Paths are relative to the config file's folder unless absolute."""

    model: str | None = None  # HF folder to start from
    run_dir: str = "runs/default"
    name: str | None = None  # run id (defaults to the run folder name)
    seed: int = 0
    steps: NotNegative = 10
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    proxy: ProxyRunConfig = field(default_factory=ProxyRunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plot: bool = True
    logger: Any = field(default_factory=list)  # metric trackers beside the Parquet table: any of
    #   tensorboard, wandb, mlflow (--set logger=[tensorboard,wandb]); each is an optional extra
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    base_dir: str | None = None  # folder relative paths resolve against (set by load_config)

    # -- paths ------------------------------------------------------------------------------
    def path(self, value: str | os.PathLike | None) -> Path | None:
        """A path from the config: absolute as is; relative against the config's folder, else the
        current folder when only that one exists (configs in examples/ name repo-relative paths)."""
        if value is None:
            return None
        p = Path(os.path.expanduser(str(value)))
        if p.is_absolute() or self.base_dir is None:
            return p.resolve()
        near = Path(self.base_dir) / p
        return near.resolve() if near.exists() or not p.exists() else p.resolve()

    @property
    def run_path(self) -> Path:
        """The run folder: relative to the current folder (where the user runs the command)."""
        return Path(os.path.expanduser(self.run_dir)).resolve()

    @property
    def tracking_path(self) -> Path:
        """Where the trackers write: tracking.dir, or RUN/trackers."""
        return self.path(self.tracking.dir) if self.tracking.dir else self.run_path / "trackers"

    @property
    def run_id(self) -> str:
        return self.name or self.run_path.name

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["update"]["betas"] = list(d["update"]["betas"])
        return d

    def validate(self) -> RunConfig:
        """What a run needs beyond well-typed keys: the required ones and the rules between sections
        (skipped for --print-config and for reading a saved config)."""
        problems = []
        if not self.model:
            problems.append("model: required (an HF model folder)")
        if not self.harness.command:
            problems.append("harness.command: required (the agent command to run per rollout)")
        if not self.tasks.train:
            problems.append("tasks.train: required (a task file)")
        if self.harness.service and self.harness.run_as is not None:  # one service would serve every user
            problems.append("harness.service cannot be combined with harness.run_as (one service, one user)")
        if self.rollout.mode == "async" and self.rollout.groups_in_flight < self.rollout.groups_per_step:
            problems.append("rollout.groups_in_flight must be >= rollout.groups_per_step in async mode")
        if self.rollout.mode == "async" and self.rollout.max_staleness < 0:  # every group would be too stale:
            # 'drop' would discard and relaunch them without one update until the tasks ran out
            problems.append(f"rollout.max_staleness must be >= 0, got {self.rollout.max_staleness}")
        # the samples' loss_weight and the update's divisor must come from the same mode
        self.update.loss_mode = self.samples.weight_mode
        if self.update.temperature is None and self.rollout.temperature > 0:  # on-policy: pi as it sampled
            self.update.temperature = self.rollout.temperature
        self._check_sample_options(problems)
        from .trackers import TrackerError, tracker_names

        try:  # before vLLM starts: an unknown or uninstalled tracker names its extra
            self.logger = tracker_names(self.logger)
        except TrackerError as exc:
            problems.append(str(exc))
        if problems:
            raise ConfigError("\n  ".join(["invalid config:", *problems]))
        return self

    def sample_options(self, rollouts: Iterable[str] = (), engine_defaults: dict | None = None) -> dict:
        """``build_samples``' keywords at an update: ``samples.extra``, then the samples section and
        what the loop sets (the train split, the consumed groups' rollouts, the update's temperature,
        the engine's sampling defaults), which ``samples.extra`` may not set (checked at load)."""
        return {**(self.samples.extra or {}), **self._set_by_loop(rollouts, engine_defaults)}

    def _set_by_loop(self, rollouts: Iterable[str] = (), engine_defaults: dict | None = None) -> dict:
        s = self.samples
        return {"mode": s.mode, "advantage": s.advantage, "weight_mode": s.weight_mode, "where": "split = 'train'",
                "include_secret_spans": s.include_secret_spans, "rollouts": list(rollouts),
                "temperature": self.update.temperature or 1.0, "engine_defaults": engine_defaults}

    def _check_sample_options(self, problems: list[str]) -> None:
        """``samples.extra`` as :meth:`sample_options` passes it to ``build_samples``: a misspelt key or a
        bad value (``reward_clip: [1, 0]``) fails now, not at the first update, after a step's rollouts ran."""
        from .samples import SampleOptions

        extra, loop_keys = self.samples.extra or {}, set(self._set_by_loop())
        if clash := sorted(map(str, set(extra) & loop_keys)):
            problems.append(f"samples.extra: {', '.join(clash)} set by the loop (use samples.<key> where there is one)")
            return
        known = sorted(f.name for f in dataclasses.fields(SampleOptions) if f.name not in loop_keys)
        if unknown := sorted(map(str, set(extra) - set(known))):
            problems += [f"unknown key 'samples.extra.{k}'{suggest(str(k), known)}; known: {known}" for k in unknown]
            return
        try:
            SampleOptions(**self.sample_options(engine_defaults={}))
        except (TypeError, ValueError) as exc:
            problems.append(f"samples.extra: {exc}")


# -- pydantic's errors, told with dotted keys -----------------------------------------------------
def explain(exc: ValidationError, cls: type) -> list[str]:
    """One line per problem: the dotted key, what was expected, and the value given."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        if err["type"] == "unexpected_keyword_argument":
            known = _known_keys(cls, err["loc"][:-1])
            lines.append(f"unknown key '{key}'{suggest(str(err['loc'][-1]), known)}; known: {known}")
        elif err["type"] == "dataclass_type":
            lines.append(f"{key}: expected a mapping of {_known_keys(cls, err['loc'])}, got {err['input']!r}")
        else:
            msg = err["msg"][:1].lower() + err["msg"][1:]
            lines.append(f"{key}: {msg}, got {err['input']!r}")
    return lines


def _known_keys(cls: type, loc: tuple) -> list[str]:
    node = cls()
    for part in loc:
        node = getattr(node, str(part))
    return sorted(f.name for f in dataclasses.fields(node))


def suggest(key: str, known: list[str]) -> str:
    """The closest known key: a near spelling ('lr_shedule'), else the key a typo extends by a word
    ('lr_rate' -> 'lr'), else a looser spelling, else a shared prefix."""
    extended = sorted((k for k in known if key.startswith(k + "_")), key=len, reverse=True)
    prefixed = sorted((k for k in known if key.startswith(k) or k.startswith(key)), key=len, reverse=True)
    close = (difflib.get_close_matches(key, known, n=1, cutoff=0.8) or extended
             or difflib.get_close_matches(key, known, n=1, cutoff=0.5) or prefixed)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- overrides ----------------------------------------------------------------------------------
def parse_overrides(items: Iterable[str], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` (values parsed as YAML) set on a copy of ``base``: ``{"a": {"b": 1}, "c": "x"}``;
    sections merge, values replace."""
    out = copy.deepcopy(base or {})
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE (dotted keys for sections, e.g. update.lr=1e-5)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        node = out
        *sections, name = key.split(".")
        for p in sections:
            if node.get(p) is None:  # a new section, or one left empty in the file ('eval:')
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[name] = _merged(node.get(name), value)
    return out


def _merged(old: Any, new: Any) -> Any:
    """``new`` set over ``old``: a mapping merges into a section key by key (``--set update={lr: 1}``
    keeps the file's other update keys), anything else replaces."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}


def load_config(path: str | os.PathLike | None, overrides: Iterable[str] = (), *,
                base_dir: str | os.PathLike | None = None, validate: bool = True) -> RunConfig:
    """YAML file + ``--set`` overrides -> a validated RunConfig (relative paths resolve against the
    config file's folder; ``run_dir`` against the current folder unless absolute)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping of keys, got {type(data).__name__}")
        if base_dir is None:
            base_dir = p.resolve().parent
    data = parse_overrides(overrides, data)
    data.pop("base_dir", None)
    cfg = RunConfig.from_dict(data)
    cfg.base_dir = str(base_dir) if base_dir is not None else None
    return cfg.validate() if validate else cfg


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
