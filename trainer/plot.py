"""Reward curve of a run: train reward per step and held-out reward at each eval, one PNG.

Reads the run's metrics Parquet (``train/reward_mean``, ``eval/reward_mean``); matplotlib with the
Agg backend, so it works on headless machines and in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

from .metrics import read_metrics

TRAIN_KEY = "train/reward_mean"
EVAL_KEY = "eval/reward_mean"


def plot_rewards(traces_root: str | os.PathLike, out_png: str | os.PathLike, run_id: str | None = None) -> Path:
    """Write the reward-curve PNG and return its path (an empty plot if nothing was logged yet)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read_metrics(traces_root, run_id)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key, label, style in ((TRAIN_KEY, "train reward (rollouts of the step)", "-o"),
                              (EVAL_KEY, "eval reward (tasks.eval)", "-s")):
        series = m.get(key, {})
        if series:
            steps = sorted(series)
            ax.plot(steps, [series[s] for s in steps], style, label=label, markersize=4)
    ax.set_xlabel("training step (policy version at eval)")
    ax.set_ylabel("mean reward")
    ax.set_title(f"reward curve{f' - {run_id}' if run_id else ''}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
