"""`lightning-train`: build samples, run the training loop, do one update step, write a report, or compact a store.

Why a lazy group: `run` and `step` need torch (seconds to import); `build`, `--help` and
`run --print-config` do not, so each subcommand's module is imported only when it is invoked.
"""

from __future__ import annotations

import importlib

import click

# name -> (module, attribute, one-line help shown by `lightning-train --help`)
COMMANDS = {
    "build": ("build", "build_command", "spans + rewards + rollouts -> samples (merging, advantages, loss weights)"),
    "run": ("loop", "run_command", "the collocated loop: rollouts through the proxy, updates, weight swaps"),
    "step": ("update", "step_command", "one update from a samples table to a checkpoint"),
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


if __name__ == "__main__":
    main()
