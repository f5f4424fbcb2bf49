"""`lightning-train build`: traces -> samples Parquet, with merge statistics a user can act on."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..schemas import PartWriter
from ..schemas.compact import compaction_held
from .advantages import ESTIMATORS, FAILED_POLICIES
from .samples import MODES, SampleOptions, build_samples
from .views import past_damaged_parts
from .weights import MODES as WEIGHT_MODES


def stats_table(stats: dict[str, Any], title: str = "samples built") -> Table:
    """The merge / reward / weight statistics of ``build_samples`` as one readable rich table."""
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_column("meaning", style="dim")

    def row(name: str, value: Any, meaning: str = "") -> None:
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        t.add_row(name, str(value), meaning)

    row("rollouts selected", stats["rollouts_selected"])
    if stats.get("rollouts_superseded"):
        row("attempts retried", stats["rollouts_superseded"], "left out: a later attempt took their place")
    by_state = ", ".join(f"{k} {v}" for k, v in stats["rollouts_by_state"].items() if v)
    row("rollouts dropped", stats["rollouts_dropped"], f"policy {stats['failed_policy']}: {by_state or 'none'}")
    row("spans read", stats["spans_read"])
    row("calls with errors (skipped)", stats["calls_error"])
    if stats.get("calls_multi_choice"):
        row("calls with several choices", stats["calls_multi_choice"], "left out: the harness may have used another")
    if stats.get("calls_unrouted"):
        row("calls to a harness's own server", stats["calls_unrouted"], "left out: its answer is not the policy's")
    if stats.get("calls_secret_detected"):
        hint = " (--include-secret-spans to retokenise them)" if stats["calls_dropped_secret"] else ""
        row("calls with a secret", stats["calls_secret_detected"], f"left out {stats['calls_dropped_secret']}{hint}")
    if stats.get("calls_other_sampling"):
        which = ", ".join(f"{k} {v:,}" for k, v in stats["other_sampling"].items())
        row("calls sampled otherwise", stats["calls_other_sampling"],
            f"than the update computes (--temperature): {which}; their importance weights stray from 1")
    hint = ""
    if stats["calls_without_token_ids"] and not stats["retokenized_calls"]:
        hint = " (pass --tokenizer to rebuild)"
    row("calls without token ids", stats["calls_without_token_ids"],
        f"rebuilt {stats['retokenized_calls']}, dropped {stats['calls_dropped_no_token_ids']}{hint}")
    if stats.get("drift_checked"):
        row("token drift", f"{stats['drift_prompt']}/{stats['drift_response']} of {stats['drift_checked']}",
            "prompt/response ids that differ from a retokenisation")
    row("samples", stats["samples"], f"mode {stats['mode']}")
    if stats.get("rollouts_capped"):
        row("rollouts capped", stats["rollouts_capped"],
            f"{stats['samples_capped']:,} samples left out: more than --max-samples-per-rollout, a random subset kept")
    row("samples per rollout", stats["samples_per_rollout"])
    row("rollouts kept as one sample", f"{100 * stats['single_sample_rollout_share']:.1f}%")
    row("calls continuing their history", stats["calls_continuing_history"])
    for reason, n in stats["breaks"].items():
        row(f"  break: {reason}", n)
    row("prompt too long (dropped)", stats["samples_dropped_prompt_too_long"])
    row("responses truncated", stats["samples_truncated"],
        f"{stats.get('truncated_model_tokens', 0):,} model tokens cut")
    row("model / context tokens", f"{stats['model_tokens']:,} / {stats['context_tokens']:,}")
    row("advantage groups", stats["adv_n_groups"], f"{stats['advantage']}; singletons {stats['adv_singleton_groups']}"
        f" ({stats.get('adv_groups_cut_to_one', 0)} cut to one by the failure policy: advantage 0)")
    if stats.get("rollouts_reward_clipped"):
        row("rewards clipped", stats["rollouts_reward_clipped"], "outside --reward-clip")
    eq = stats["adv_equal_reward_groups"]
    row("groups with equal rewards", eq,
        ("no signal: " + ", ".join(stats["adv_equal_reward_group_ids"][:5])) if eq else "")
    row("loss weights", stats["weight_mode"], f"units {stats['n_units']:,}")
    return t


@click.command("build", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("traces_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Directory to write the samples table under (default: TRACES_DIR, i.e. TRACES_DIR/samples/).")
@click.option("--mode", type=click.Choice(MODES), default="trajectory", show_default=True,
              help="trajectory: merge calls whose prompt continues the history; transition: one sample per call.")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=None,
              help="Local HF tokenizer directory: rebuilds token ids of calls that have none, and measures drift.")
@click.option("--group-by", default="group_id", show_default=True,
              help="SQL expression over the `rollouts` view giving the advantage group (e.g. task_id).")
@click.option("--advantage", type=click.Choice(ESTIMATORS), default="grpo", show_default=True)
@click.option("--no-std", is_flag=True, help="GRPO without dividing by the group std (Dr. GRPO).")
@click.option("--failed-policy", type=click.Choice(FAILED_POLICIES), default="drop", show_default=True,
              help="Failed / timed-out / reward-less rollouts: drop them, keep failed ones with a reward, or give them "
                   "--failed-reward. A retried attempt is never a member: its retry is.")
@click.option("--failed-reward", type=float, default=None,
              help="Reward given by --failed-policy penalize (required there).")
@click.option("--reward-clip", type=(float, float), default=None, metavar="LOW HIGH",
              help="Clip every reward (a --failed-reward too) into [LOW, HIGH] before the group advantages "
                   "(reported): bounds what one rollout's reward, a harness's self-report say, can do to its group.")
@click.option("--weight-mode", type=click.Choice(WEIGHT_MODES), default="rollout",
              show_default=True,
              help="rollout: each rollout weighs the same however many samples/tokens it produced.")
@click.option("--max-prompt-len", type=int, default=None, help="Drop samples whose prompt is longer (reported).")
@click.option("--max-response-len", type=int, default=None, help="Truncate longer responses (reported).")
@click.option("--max-samples-per-rollout", type=click.IntRange(min=0),
              default=SampleOptions.max_samples_per_rollout, show_default=True,
              help="A rollout with more samples keeps a random subset of this many, the same at every rebuild "
                   "(reported); its weight is unchanged, but its cost to the update is bounded. 0: no cap.")
@click.option("--step", "steps", type=int, multiple=True, help="Only rollouts of this step (repeatable).")
@click.option("--where", default=None, help="Extra SQL predicate on the `rollouts` view, e.g. \"split = 'train'\".")
@click.option("--include-secret-spans", is_flag=True,
              help="Train on spans the proxy masked a secret in (no token ids: retokenised from the masked text, needs "
                   "--tokenizer).")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="The temperature the update computes the policy at (update.temperature): calls sampled otherwise "
                   "(another temperature, top-p/k, penalties, a constraint) are counted.")
@click.option("--replace", is_flag=True,
              help="Replace an existing samples table (old parts are removed after the new one is written).")
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON instead of a table.")
def build_command(traces_dir, out, mode, tokenizer, group_by, advantage, no_std, failed_policy, failed_reward,
                  reward_clip, weight_mode, max_prompt_len, max_response_len, max_samples_per_rollout, steps, where,
                  include_secret_spans, temperature, replace, as_json) -> None:
    """Build training samples from TRACES_DIR (spans + rewards + rollouts) into a `samples` table.

    \b
    Example:
      lightning-train build runs/exp1/traces --tokenizer models/tiny --max-response-len 2048
      lightning-sql runs/exp1/traces -q merge_breaks
    """
    console = Console(stderr=as_json)
    out_root = Path(out) if out else Path(traces_dir)
    if failed_policy == "penalize" and failed_reward is None:
        raise click.BadParameter("--failed-policy penalize needs --failed-reward", param_hint="--failed-reward")
    options = dict(mode=mode, tokenizer=tokenizer, group_by=group_by, advantage=advantage, norm_by_std=not no_std,
                   failed_policy=failed_policy, failed_reward=failed_reward, reward_clip=reward_clip,
                   weight_mode=weight_mode,
                   max_prompt_len=max_prompt_len, max_response_len=max_response_len,
                   max_samples_per_rollout=max_samples_per_rollout, steps=list(steps) or None,
                   where=where, include_secret_spans=include_secret_spans, temperature=temperature)
    t0 = time.perf_counter()
    with compaction_held(out_root, "samples"):  # a compaction in between would keep the rows --replace removes
        old_parts = sorted((out_root / "samples").glob("**/*.parquet"))
        if old_parts and not replace:
            raise click.ClickException(f"{out_root / 'samples'} already holds {len(old_parts)} part(s); "
                                       f"pass --replace to rebuild it or --out DIR")
        with console.status("building samples ..."):
            try:
                # a part whose data is damaged is skipped and the build runs again (it reconnects)
                table, stats = past_damaged_parts(lambda: build_samples(traces_dir, **options), lambda: None)
            except (ValueError, FileNotFoundError) as exc:
                raise click.ClickException(str(exc)) from exc
            path = None
            if table.num_rows:
                path = PartWriter(out_root, "samples", background=False).write_table(table)
            for p in old_parts:  # --replace: after the new table is safely on disk; an empty build leaves none
                p.unlink(missing_ok=True)
    elapsed = time.perf_counter() - t0
    if as_json:
        click.echo(json.dumps({**stats, "path": str(path) if path else None, "seconds": round(elapsed, 3)},
                              default=str))
        return
    console.print(stats_table(stats, title=f"samples from {traces_dir}"))
    if path:
        console.print(f"wrote {table.num_rows:,} samples to [bold]{path}[/] in {elapsed:.1f}s")
    else:
        gone = f"; the {len(old_parts)} old part(s) were removed (--replace)" if old_parts else ""
        console.print(f"[yellow]no samples built[/]: nothing to train on (see the table above){gone}")


__all__ = ["build_command", "stats_table"]
