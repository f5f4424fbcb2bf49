"""`lightning-train`: build samples, run the training loop, or do one update step."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train a policy on traces captured by lightning-proxy.

    \b
    build   spans + rewards + rollouts -> samples (merging, advantages, loss weights)
    run     the collocated loop: rollouts through the proxy, updates, weight swaps
    step    one update from a samples table to a checkpoint
    """


def _register() -> None:
    # Each command lives beside the code it drives; a missing optional piece must not break the rest.
    from importlib import import_module

    for module, attr in (("build", "build_command"), ("loop", "run_command"), ("update", "step_command")):
        try:
            cmd = getattr(import_module(f"{__package__}.{module}"), attr)
        except (ImportError, AttributeError):
            continue
        main.add_command(cmd)


_register()

if __name__ == "__main__":
    main()
