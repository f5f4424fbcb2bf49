"""Per-step metrics to Parquet (``schemas.METRICS``) and a live progress line.

Why Parquet: the metrics sit beside the spans, rollouts and samples of the same run, so one
``lightning-sql`` query joins a reward curve with the calls behind it. Every ``log`` call writes a
part at once (a killed run keeps every finished step); readers keep the latest row per
``(run_id, step, name)``, so a step redone after ``--resume`` simply overrides.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from lightning_harness.schemas import PartWriter, read_table

from .trackers import numeric


class MetricsLog:
    """Append-only metrics of one run under ``TRACES/metrics/``."""

    def __init__(self, traces_root: str | os.PathLike, run_id: str, trackers: Mapping[str, Any] | None = None,
                 warn=None) -> None:
        self.root = Path(traces_root)
        self.run_id = run_id
        self._writer = PartWriter(self.root, "metrics", background=False, flush_seconds=0)
        self.trackers = dict(trackers or {})  # name -> trainer.trackers tracker (log/close)
        self._warn = warn or (lambda msg: print(msg, file=sys.stderr))

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """Write ``values`` (name -> number) for ``step`` now; non-numbers are skipped. The trackers
        get the same names and values."""
        at = _dt.datetime.now(_dt.UTC)
        numbers = numeric(values)
        rows = [{"run_id": self.run_id, "step": int(step), "name": name, "value": value, "at": at}
                for name, value in numbers.items()]
        if rows:
            self._writer.extend(rows)
            self._writer.flush()
            self._each_tracker("log", int(step), numbers)

    def _each_tracker(self, method: str, *args: Any) -> None:
        """A tracker that fails is switched off with one warning; the Parquet table is the record."""
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # a tracker's own error must not stop training
                self.trackers.pop(name)
                self._warn(f"warning: metric tracker {name!r} failed and is switched off: {exc!r}")

    def close(self) -> None:
        self._writer.close()
        self._each_tracker("close")
        self.trackers.clear()


def read_metrics(traces_root: str | os.PathLike, run_id: str | None = None) -> dict[str, dict[int, float]]:
    """``{name: {step: value}}``, the latest value per (step, name) of ``run_id`` (or every run).

    A row without a step (the column is nullable; any writer may add rows) belongs on no curve and
    is skipped: it must not stop the reward plot at the end of a run, or the report."""
    t = read_table(traces_root, "metrics")
    if run_id is not None and t.num_rows:
        t = t.filter(pc.equal(t["run_id"], run_id))
    t = t.sort_by([("at", "ascending")])
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for step, name, value in zip(t["step"].to_pylist(), t["name"].to_pylist(), t["value"].to_pylist()):
        if step is not None:
            out[name][int(step)] = value
    return dict(out)


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class ProgressLine:
    """One live line (rich) saying where the run is: step, phase, version, rewards, elapsed.

    Falls back to plain prints when stderr is not a terminal (CI logs stay readable)."""

    def __init__(self, total_steps: int, console=None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.total = total_steps
        self.t0 = time.monotonic()
        self.fields: dict[str, Any] = {"step": 0, "phase": "starting"}
        self._live = None
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def _render(self):
        from rich.text import Text

        f = self.fields
        el = time.monotonic() - self.t0
        parts = [f"step {f.get('step', 0)}/{self.total}", f"[{f.get('phase', '')}]"]
        parts += [f"{key} {_fmt(f[key])}" for key in ("version", "reward", "eval", "in_flight", "done") if key in f]
        parts.append(f"{int(el // 60)}m{int(el % 60):02d}s")
        return Text("  ".join(parts), style="bold cyan")

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)
        if self._live is not None:
            self._live.update(self._render())

    def print(self, *args: Any, **kw: Any) -> None:
        """A permanent line above the live one."""
        kw.setdefault("soft_wrap", True)
        self.console.print(*args, **kw)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
