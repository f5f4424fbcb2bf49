"""`lightning-train`: build samples, run the training loop, do one update step, write a report, or compact a store.

Why a lazy group: `run` and `step` need torch (seconds to import); `build`, `--help` and
`run --print-config` do not, so each subcommand's module is imported only when it is invoked (`run`
and `step`, defined here, import the loop and the update inside their bodies). `run` lives here with
what the loop prints (the step line, the closing summary); the loop is loop.py.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

# name -> (module, attribute, one-line help shown by `lightning-train --help`)
COMMANDS = {
    "build": ("build", "build_command", "spans + rewards + rollouts -> samples (merging, advantages, loss weights)"),
    "run": ("cli", "run_command", "the collocated loop: rollouts through the proxy, updates, weight swaps"),
    "step": ("cli", "step_command", "one update from a samples table to a checkpoint"),
    "report": ("report", "report_command", "one self-contained HTML page to read a run: reward curve, steps, rollouts"),
    "compact": ("compact", "compact_command", "merge a trace store's small Parquet parts into a few large ones"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(f".{module}", __package__), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, _, short) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train a policy on traces captured by lightning-proxy."""


@click.command("run", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="YAML run config (see --print-config for every key).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override any key, dotted for sections: --set steps=20 --set rollout.mode=async "
                   "--set update.lr=2e-5.")
@click.option("--resume", is_flag=True, help="Continue the run in run_dir from its last complete step.")
@click.option("--print-config", is_flag=True, help="Print the resolved config (or the defaults) and exit.")
def run_command(config_path, overrides, resume, print_config):
    """Train a policy through the live proxy and vLLM in collocated phases.

    \b
    Each step: rollouts of task groups through the proxy -> proxy pause + drain -> vLLM pause
    -> samples -> update -> checkpoint -> vLLM reload_weights -> model version + 1 -> resume.
    The run folder holds config.yaml, state.json, checkpoints/, traces/ (spans, rollouts,
    rewards, samples, metrics; query with lightning-sql), logs/ and reward_curve.png.

    \b
    Example:
      lightning-train run --config examples/calc/config.yaml --set rollout.mode=async
    """
    import yaml
    from rich.console import Console

    from .config import ConfigError, load_config

    console = Console(stderr=True)
    try:
        cfg = load_config(config_path, overrides, validate=not print_config)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if print_config:
        click.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return
    from .loop import TrainingRun

    run = TrainingRun(cfg, resume=resume, console=console)

    def _term(signum, frame):  # SIGTERM: stop the engine, proxy and harnesses like Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        run.run()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted; continue with: lightning-train run --config {config_path} --resume[/]")
        sys.exit(130)
    except RuntimeError as exc:  # engine, proxy or harness setup: the message says what and where
        console.print(f"[red]error:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
        console.print(f"fix it, then continue with: lightning-train run --config {config_path} --resume")
        sys.exit(1)


def step_line(step: int, total: int, r: dict[str, Any]) -> str:
    """The permanent line a finished step leaves in the terminal (the loop prints it)."""
    g = lambda k, f="{:.3g}": "-" if r.get(k) is None else f.format(r[k])  # noqa: E731
    return (f"step {step}/{total} v{r.get('model_version')} | reward {g('train/reward_mean')} "
            f"| groups {g('train/groups', '{:.0f}')} carry-over {g('async/carry_over', '{:.0f}')} "
            f"stale max {g('async/staleness_max', '{:.0f}')} dropped {g('async/dropped_rollouts', '{:.0f}')} "
            f"| samples {g('time/samples_s', '{:.2f}')}s | drain {g('time/drain_s', '{:.2f}')}s "
            f"pause {g('time/pause_s', '{:.2f}')}s held {g('proxy/held', '{:.0f}')} "
            f"| update {g('update/time_s', '{:.2f}')}s save {g('time/save_s', '{:.2f}')}s "
            f"reload {g('time/reload_s', '{:.2f}')}s | rollouts {g('time/rollout_s', '{:.1f}')}s")


MAX_EVAL_COLUMNS = 6  # evaluations in the summary table (a long run with frequent ones shows its latest)


def print_summary(console, summary: dict[str, Any], traces: Path, run_id: str) -> None:
    """The end of a run: success at each evaluation (before, in between, after) and the change; where the
    curve, checkpoint and traces are."""
    from rich.table import Column, Table

    evals = summary.get("evals") or {}
    if evals:
        versions = sorted(int(v) for v in evals)
        if len(versions) > MAX_EVAL_COLUMNS:  # the first, then the latest ones
            versions = versions[:1] + versions[1 - MAX_EVAL_COLUMNS:]
        several = len(versions) > 1  # an evaluation-only run (steps=0) has one column and no change to show
        heads = [f"v{v}" for v in versions]
        if several:
            heads[0], heads[-1] = f"before ({heads[0]})", f"after ({heads[-1]})"
            heads.append("change")
        tasks = summary.get("eval_tasks")  # held out, or (swe-practice) the train tasks under new ids
        t = Table("metric", *(Column(h, justify="right") for h in heads),
                  title=f"evaluation on {Path(tasks).name}" if tasks else "evaluation")
        for key, fmt in (("eval/success", "{:.1%}"), ("eval/reward_mean", "{:.3f}")):
            values = [evals[str(v)].get(key) for v in versions]
            if values[0] is None or values[-1] is None:
                continue
            cells = ["-" if x is None else fmt.format(x) for x in values]  # (a metric one evaluation lacks)
            if several:
                a, b = values[0], values[-1]
                cells.append(f"{(b - a) * 100:+.1f} pts" if key == "eval/success" else f"{b - a:+.3f}")
            t.add_row(key, *cells)
        console.print(t)
    if summary.get("plot"):
        console.print(f"reward curve:     {summary['plot']}", soft_wrap=True)
    console.print(f"final checkpoint: {summary['checkpoint']} (model version {summary['model_version']})",
                  soft_wrap=True)
    console.print(f"read the rollouts: lightning-train report {summary['run_dir']}  (one HTML page)",
                  soft_wrap=True, highlight=False, markup=False)
    console.print("inspect the run:  lightning-sql " + f"{traces} " +
                  f"\"SELECT step, name, round(value, 3) AS value FROM metrics WHERE run_id = '{run_id}' "
                  f"AND name IN ('train/reward_mean', 'eval/reward_mean', 'eval/success') ORDER BY step, name\"",
                  soft_wrap=True, highlight=False, markup=False)


def read_samples(path: str | os.PathLike):
    """A samples Parquet file, or a folder of parts (a traces root with samples/ or the samples/ folder);
    ``step`` has checked that it exists."""
    import pyarrow.parquet as pq

    from lightning_harness.schemas import read_table

    p = Path(path)
    if p.is_file():
        return pq.read_table(p)
    root = p.parent if p.name == "samples" else p
    t = read_table(root, "samples")
    if t.num_rows == 0:
        raise ValueError(f"no samples rows under {root / 'samples'}")
    return t


@click.command("step", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("samples", type=click.Path(exists=True))
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF model folder to start from (a previous checkpoint keeps its version and optimizer).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Where to write the new checkpoint (safetensors + tokenizer + lightning_version.json).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Update setting, e.g. --set lr=1e-5 --set micro_batch_size=8 (see UpdateConfig).")
@click.option("--step-filter", type=int, default=None, help="Only use samples of this training step.")
@click.option("--no-optimizer", is_flag=True, help="Do not save optimizer state with the checkpoint.")
def step_command(samples, model_dir, out_dir, overrides, step_filter, no_optimizer):
    """One policy update: SAMPLES (Parquet file or traces folder) -> checkpoint in --out.

    The checkpoint's model version is --model's plus one (unchanged when nothing was trainable).

    \b
    Example:
      lightning-train step runs/demo/traces --model examples/calc/model --out ckpt-1 --set lr=2e-5
    """
    from rich.console import Console

    from .checkpoint import read_version
    from .config import ConfigError, UpdateConfig, parse_overrides
    from .update import PolicyUpdater

    console = Console(stderr=True)
    try:
        cfg = UpdateConfig.from_dict(parse_overrides(overrides))
    except ConfigError as exc:  # a usage error, as `run` reports it: no traceback
        raise click.UsageError(str(exc)) from None
    table = read_samples(samples)
    if step_filter is not None:
        import pyarrow.compute as pc

        table = table.filter(pc.equal(table["step"], step_filter))
    console.print(f"[bold]update[/] {table.num_rows} samples from {samples} on {model_dir}")
    up = PolicyUpdater(model_dir, cfg, load_optimizer=not no_optimizer)
    metrics = up.update(table)
    version = int(read_version(model_dir).get("model_version", 0)) + (0 if metrics.get("update/skipped") else 1)
    out = up.save(out_dir, model_version=version, save_optimizer=not no_optimizer)
    for k, v in sorted(metrics.items()):
        console.print(f"  {k:28s} {v:.6g}")
    console.print(f"[green]checkpoint[/] {out} (model_version {version})")


if __name__ == "__main__":
    main()
