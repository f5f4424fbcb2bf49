"""`lightning-train compact TRACES`: compact a trace store written elsewhere (a thin CLI over
``schemas.compact.compact_store``; the proxy and the training loop compact their own stores)."""

from __future__ import annotations

import click

from ..schemas import TABLES
from ..schemas.compact import GRACE_S, TARGET_BYTES, compact_store


@click.command("compact", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("traces_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--table", "tables", multiple=True, type=click.Choice(sorted(TABLES)),
              help="Table to compact (repeatable). [default: all]")
@click.option("--target-mb", type=float, default=TARGET_BYTES / (1 << 20), show_default=True,
              help="Size of a compacted part in MiB; parts under half of it are merged.")
@click.option("--grace-s", type=float, default=GRACE_S, show_default=True,
              help="Seconds replaced parts stay on disk for readers that listed them before; the "
                   "command waits them out, then removes them. 0 when nothing else reads the store.")
def compact_command(traces_dir, tables, target_mb, grace_s) -> None:
    """Merge the small Parquet parts of TRACES_DIR into a few large ones, atomically.

    \b
    Safe beside a running proxy, loop or query: a compacted part is written under a temporary
    name, fsynced and renamed; readers leave out the parts it replaces from then on, and those
    are removed after --grace-s. Killed at any point, it loses and duplicates no row.
    \b
    Example:
      lightning-train compact runs/calc/traces
      lightning-train compact traces --table spans --grace-s 0
    """
    if target_mb <= 0 or grace_s < 0:
        raise click.UsageError("--target-mb must be positive and --grace-s not negative")
    try:
        reports = compact_store(traces_dir, tables or None, target_bytes=int(target_mb * (1 << 20)),
                                grace_s=grace_s, wait=True)
    except OSError as exc:  # disk full, permissions: what was written stays readable; no row is lost
        raise click.ClickException(f"compaction stopped: {exc} (the store stays readable as it is; "
                                   "a later run goes on from there)") from exc
    for name, r in reports.items():
        if r.skipped:
            click.echo(f"{name}: skipped ({r.skipped})")
            continue
        click.echo(f"{name}: {r.files_before} -> {r.files_after} files ({r.rows_compacted:,} rows into "
                   f"{r.parts_written} part(s), {r.parts_removed} replaced part(s) removed, {r.seconds:.1f}s)")
