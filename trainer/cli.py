"""`lightning-train`: build samples, run the training loop, do one update step, write a report, or compact a store.

Why a lazy group: `run` and `step` need torch (seconds to import); `build`, `--help` and
`run --print-config` do not, so each subcommand's module is imported only when it is invoked (`step`,
defined here, imports the update inside its body).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import click

# name -> (module, attribute, one-line help shown by `lightning-train --help`)
COMMANDS = {
    "build": ("build", "build_command", "spans + rewards + rollouts -> samples (merging, advantages, loss weights)"),
    "run": ("loop", "run_command", "the collocated loop: rollouts through the proxy, updates, weight swaps"),
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


def read_samples(path: str | os.PathLike):
    """A samples Parquet file, or a folder of parts (a traces root with samples/ or the samples/ folder)."""
    import pyarrow.parquet as pq

    from lightning_harness.schemas import read_table

    p = Path(path)
    if p.is_file():
        return pq.read_table(p)
    if not p.exists():
        raise FileNotFoundError(f"no samples at {p}")
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
    from .config import UpdateConfig, parse_overrides
    from .update import PolicyUpdater

    console = Console(stderr=True)
    cfg = UpdateConfig.from_dict(parse_overrides(overrides))
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
