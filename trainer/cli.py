"""`lightning-train`: build samples, run the training loop, or do one update step."""

from __future__ import annotations

import click

from .build import build_command
from .loop import run_command
from .update import step_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train a policy on traces captured by lightning-proxy.

    \b
    build   spans + rewards + rollouts -> samples (merging, advantages, loss weights)
    run     the collocated loop: rollouts through the proxy, updates, weight swaps
    step    one update from a samples table to a checkpoint
    """


main.add_command(build_command, "build")
main.add_command(run_command, "run")
main.add_command(step_command, "step")

if __name__ == "__main__":
    main()
