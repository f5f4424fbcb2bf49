"""Metric trackers beside the Parquet metrics: TensorBoard, Weights & Biases, MLflow.

Why: people watch RL runs in the tracker they already use (verl's ``trainer.logger``, TRL's
``report_to``). The Parquet ``metrics`` table stays the record; a tracker gets the same names and
values at the same step (``MetricsLog.log`` fans each step out), and never blocks the run: each
package is an optional extra, checked when the config names it (before any engine starts), and a
tracker that fails while logging is switched off with one warning line.

Every tracker writes locally by default: TensorBoard event files, W&B in offline mode (``wandb sync``
uploads later), MLflow into a file store under the run folder.

Secrets: the run config a tracker stores (W&B config, MLflow params; both may end up on a shared
server) goes through :func:`public_config` first: values under secret-like names (``OPENAI_API_KEY``,
``--api-key X``), URL passwords and provider key shapes are masked. W&B's run metadata (the command
line, which can hold ``--set harness.env.KEY=...``, the git remote) is not collected.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import numbers
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..proxy.keyshapes import mask_keys
from .config import suggest

MASK = "[REDACTED]"
# name parts (split at non-alphanumerics) that say a value is a credential
_SECRET_PARTS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "pwd", "pass", "credential",
                           "credentials", "auth", "authorization", "cookie", "bearer"})
_SECRET_WORD = r"[A-Za-z0-9_.-]*(?:key|token(?!s)|secret|passw|pwd|credential|auth|cookie)[A-Za-z0-9_-]*"
_ASSIGNED = re.compile(rf"(?i)(?<![A-Za-z0-9])({_SECRET_WORD})(=|:[ \t]*)[^\s&,;'\"]+")  # NAME=value, NAME: value
_FLAG_VALUE = re.compile(rf"(?i)(?<!\S)(--?{_SECRET_WORD})\s+[^\s-]\S*")  # --api-key value
_URL_PASSWORD = re.compile(r"(?<=://)([^/@\s:]*):[^/@\s]+@")
# MLflow's rule for metric names; anything else is replaced (one odd name must not end the tracker)
_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")

# name -> (module to import, pyproject extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


class TrackerError(ValueError):
    """A tracker was asked for that is unknown or not installed; the message says what to do."""


def tracker_names(value: Any) -> list[str]:
    """``logger`` as configured (a name, a list, or nothing) -> a list of known, installed names."""
    if value in (None, "", "none"):
        return []
    names = [value] if isinstance(value, str) else list(value)
    out = []
    for name in names:
        name = str(name).strip().lower()
        if name in ("console", "parquet"):  # always on: the progress line and the metrics table
            continue
        if name not in TRACKERS:
            hint = suggest(name, list(TRACKERS))
            raise TrackerError(f"logger: unknown tracker {name!r}{hint}; choose from {sorted(TRACKERS)}")
        require(name)
        if name not in out:
            out.append(name)
    return out


def require(name: str) -> Any:
    """Import the tracker's package, or say which extra installs it."""
    module, extra = TRACKERS[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerError(
            f"logger: {name!r} needs the {module!r} package, which is not installed ({exc}); "
            f"install it with: pip install 'lightning-harness[{extra}]'") from None


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The values a step logs, as the metrics table stores them: numbers (bools as 0/1) only, numpy
    and torch scalars included (a stat computed with numpy must not vanish from the record)."""
    return {str(name): float(value) for name, value in values.items() if _is_number(value)}


def _is_number(value: Any) -> bool:
    """A real number: Python's, or a 0-d numpy/torch value of a real dtype (``np.bool_`` too)."""
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "ndim", None) != 0:
        return False
    kind = getattr(dtype, "kind", None)  # numpy; torch dtypes have none
    return kind in ("b", "i", "u", "f") if kind is not None else not getattr(dtype, "is_complex", True)


def secret_name(name: str) -> bool:
    """Does a config key or command-line flag name a credential (``OPENAI_API_KEY``, ``--hf-token``)?"""
    parts = [p for p in re.split(r"[^a-z0-9]+", name.lower()) if p]
    return any(p in _SECRET_PARTS or p.endswith(("apikey", "token", "secret", "password")) for p in parts)


def _public_text(text: str) -> str:
    """A config string without credentials: assigned secrets, URL passwords, provider key shapes."""
    text = _URL_PASSWORD.sub(rf"\1:{MASK}@", text)
    text = _ASSIGNED.sub(rf"\1\2{MASK}", text)
    text = _FLAG_VALUE.sub(rf"\1 {MASK}", text)
    return mask_keys(text, MASK)


def public_config(value: Any, name: str = "") -> Any:
    """The run config as a tracker may store it: W&B and MLflow keep it (and often upload it), and
    a config can carry keys (``harness.env``, a command's ``--api-key``, ``engine.url`` with a password)."""
    if isinstance(value, Mapping):
        return {k: public_config(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out, after_flag = [], False
        for item in value:
            out.append(MASK if after_flag and isinstance(item, str) else public_config(item, name))
            after_flag = isinstance(item, str) and item.startswith("-") and "=" not in item and secret_name(item)
        return out
    if isinstance(value, str):
        return MASK if value and secret_name(name) else _public_text(value)
    return value


class TensorBoardTracker:
    """Scalars into TensorBoard event files (one tag per metric name)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a killed run keeps its finished steps, as the Parquet table does

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, offline unless told otherwise (``tracking.wandb_mode`` or ``WANDB_MODE``). Its id
    is stable per run folder, so a ``--resume`` continues the same W&B run."""

    def __init__(self, root: Path, run_id: str, project: str, mode: str | None,
                 config: Mapping[str, Any] | None = None) -> None:
        import wandb

        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_id, id=stable_id(run_id, root), resume="allow",
                              dir=str(root), config=public_config(dict(config or {})),
                              mode=mode or os.environ.get("WANDB_MODE") or "offline", settings=_wandb_settings(wandb))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_settings(wandb: Any) -> Any:
    """No run metadata: it holds the command line (``--set harness.env.OPENAI_API_KEY=...``) and the
    git remote (a URL can carry a token). Only the settings this wandb version knows are passed."""
    known = getattr(wandb.Settings, "model_fields", {})
    return wandb.Settings(**{k: True for k in ("x_disable_meta", "disable_git") if k in known})


class MlflowTracker:
    """An MLflow run in experiment ``project``; a file store under the run folder by default
    (read it with ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN/trackers/mlruns``)."""

    def __init__(self, root: Path, run_id: str, project: str, tracking_uri: str | None,
                 config: Mapping[str, Any] | None = None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (root / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in "maintenance mode" behind this opt-in; it is the one
            # backend that needs no database or server, so a local run uses it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self._resumed(root / "mlflow-run.json", uri)
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
            self.run_id = self.client.create_run(exp_id, run_name=run_id).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in _flatten(public_config(config or {})).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            root.mkdir(parents=True, exist_ok=True)
            (root / "mlflow-run.json").write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))

    def _resumed(self, marker: Path, uri: str) -> str | None:
        """The MLflow run an earlier start of this run folder opened (``--resume``), if it still exists."""
        from mlflow.exceptions import MlflowException

        try:
            known = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(known, dict) or known.get("tracking_uri") != uri:
            return None
        try:
            self.client.update_run(str(known["run_id"]), status="RUNNING")
        except (MlflowException, KeyError):
            return None
        return str(known["run_id"])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_name(name: str) -> str:
    """A metric name MLflow accepts (its characters, no empty or dot path parts, 250 characters at
    most): it refuses a whole batch for one bad name, and the tracker would be switched off."""
    parts = [p if p.strip(".") else "_" for p in _MLFLOW_BAD.sub("_", name).split("/")]
    return "/".join(parts)[:250].rstrip("/") or "_"


def stable_id(run_id: str, root: Path) -> str:
    """A tracker run id for this run folder: readable, and the same on every start of the run."""
    digest = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_id)[:48]}-{digest}"


def _folder_name(run_id: str) -> str:
    """``run_id`` as one folder name: a name like ``../../x`` must not write outside ``root``."""
    name = re.sub(r"[/\\\x00]", "-", run_id)
    return name if name.strip(".") else "run"


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def open_trackers(names: list[str], root: str | os.PathLike, run_id: str, *, project: str = "lightning-harness",
                  wandb_mode: str | None = None, mlflow_uri: str | None = None,
                  config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Open the named trackers writing under ``root`` (``root/tensorboard``, ``root/wandb``, ``root/mlruns``)."""
    root = Path(root)
    out: dict[str, Any] = {}
    for name in tracker_names(names):
        if name == "tensorboard":
            out[name] = TensorBoardTracker(root / "tensorboard" / _folder_name(run_id))
        elif name == "wandb":
            out[name] = WandbTracker(root, run_id, project, wandb_mode, config)
        elif name == "mlflow":
            out[name] = MlflowTracker(root, run_id, project, mlflow_uri, config)
    return out
