#!/usr/bin/env python
"""Build the calculator demo's tiny model from nothing, deterministically (no model hub).

Writes examples/calc/tasks_{train,eval}.jsonl, trains a byte-level BPE tokenizer on the task's
transcripts, initialises a small Qwen2 and warm-starts it with supervised learning on a mix of
transcripts: some call the calculator and copy its result, most answer at once with a guess. The
mix is what makes the model succeed sometimes but far from always, so RL through the real harness
has something to find (calling the tool pays). ``--rl-check`` then runs an in-process REINFORCE
sanity check (group baselines) to show the task is learnable, without vLLM or the proxy.

\b
    python scripts/build_tiny_model.py                      # rebuild examples/calc/model
    python scripts/build_tiny_model.py --out /tmp/m --rl-check
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm  # noqa: E402

console = Console(stderr=True)


def evaluate(model, tok, tasks, harness, samples: int, seed: int, temperature: float = 1.0) -> dict:
    """Success rate (and how often the tool was used) over ``samples`` sampled runs per task."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    model.eval()
    runs = []
    for _ in range(samples):
        for i in range(0, len(tasks), 128):
            runs += tm.rollouts(model, tok, tasks[i:i + 128], harness, temperature=temperature, generator=gen)
    tool = [r for r in runs if r.used_tool]
    return {"success": sum(r.reward for r in runs) / len(runs), "tool_rate": len(tool) / len(runs),
            "success_with_tool": (sum(r.reward for r in tool) / len(tool)) if tool else 0.0}


def sft(model, tok, pairs, steps: int, lr: float, batch: int, seed: int) -> None:
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * max(0.05, 1 - s / steps))
    model.train()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("SFT", total=steps)
        for step in range(steps):
            chunk = rng.sample(pairs, batch)
            logp, n = tm.completion_logprobs(model, None, tok.pad_token_id, samples=chunk)
            loss = -(logp.sum() / n.sum())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            progress.update(task, advance=1, description=f"SFT loss {loss.item():.3f}")
            if (step + 1) % 200 == 0:
                progress.console.print(f"SFT step {step + 1}/{steps} loss {loss.item():.4f}")


def rl_check(model, tok, train, evals, harness, steps: int, tasks_per_step: int, group: int,
             lr: float, seed: int, eval_samples: int) -> list[dict]:
    """REINFORCE with group-mean baselines, one sequence-level loss per rollout (sum over its turns)."""
    import torch

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve = []
    t0 = time.monotonic()
    seen = 0
    for step in range(steps + 1):
        if step % max(1, steps // 5) == 0 or step == steps:
            ev = evaluate(model, tok, evals, harness, eval_samples, seed=1000 + step)
            curve.append({"step": step, "rollouts": seen, **ev, "s": round(time.monotonic() - t0, 1)})
            console.print(curve[-1])
        if step == steps:
            break
        batch = rng.sample(train, tasks_per_step)
        model.eval()
        runs = tm.rollouts(model, tok, [t for t in batch for _ in range(group)], harness, generator=gen)
        seen += len(runs)
        model.train()
        rewards = torch.tensor([r.reward for r in runs]).view(tasks_per_step, group)
        adv = (rewards - rewards.mean(-1, keepdim=True)).flatten()
        pairs, owner = [], []
        for k, r in enumerate(runs):
            if adv[k] != 0:
                pairs += r.pairs
                owner += [k] * len(r.pairs)
        if not pairs:
            continue
        logp, _ = tm.completion_logprobs(model, pairs, tok.pad_token_id)
        loss = -(adv[torch.tensor(owner)] * logp).sum() / len(runs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return curve


@click.command(help=__doc__)
@click.option("--out", type=click.Path(path_type=Path), default=tm.CALC_DIR / "model", show_default=True)
@click.option("--tasks-dir", type=click.Path(path_type=Path), default=tm.CALC_DIR, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--p-tool", default=0.25, show_default=True, help="share of SFT transcripts that use the tool")
@click.option("--p-miscopy", default=0.0, show_default=True, help="share of tool transcripts that miscopy")
@click.option("--traces", default=20000, show_default=True, help="SFT conversations")
@click.option("--steps", default=1000, show_default=True, help="SFT steps")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--batch", default=64, show_default=True)
@click.option("--layers", default=2, show_default=True)
@click.option("--hidden", default=128, show_default=True)
@click.option("--eval-samples", default=2, show_default=True, help="sampled runs per held-out task")
@click.option("--rl-check/--no-rl-check", default=False, help="then run the in-process REINFORCE check")
@click.option("--rl-steps", default=10, show_default=True)
@click.option("--rl-tasks", default=8, show_default=True, help="tasks per RL step")
@click.option("--rl-group", default=8, show_default=True, help="samples per task (group)")
@click.option("--rl-lr", default=5e-4, show_default=True)
@click.option("--check-only", is_flag=True, help="skip the build: run --rl-check on the model in --out")
@click.option("--threads", default=1, show_default=True)
def main(out, tasks_dir, seed, p_tool, p_miscopy, traces, steps, lr, batch, layers, hidden, eval_samples,
         rl_check, rl_steps, rl_tasks, rl_group, rl_lr, check_only, threads):
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    torch.set_num_threads(threads)  # 1 is fastest for this size, and far faster on a busy machine
    torch.manual_seed(seed)
    harness = tm.load_harness()
    train, evals = tm.make_splits(seed=seed)
    if check_only:
        model, tok = Qwen2ForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
        curve = rl_check_fn(model, tok, train, evals, harness, rl_steps, rl_tasks, rl_group, rl_lr,
                            seed, eval_samples)
        print(json.dumps(curve))
        return
    tasks_dir.mkdir(parents=True, exist_ok=True)
    tm.write_jsonl(train, tasks_dir / "tasks_train.jsonl")
    tm.write_jsonl(evals, tasks_dir / "tasks_eval.jsonl")
    held_out = {t["expression"] for t in evals}

    rng = random.Random(seed + 1)
    mix = tm.TraceMix(p_tool=p_tool, p_miscopy=p_miscopy)
    conversations = []
    while len(conversations) < traces:
        problem = tm.make_problem(rng)
        if problem["expression"] not in held_out:  # the warm start never sees a held-out problem
            conversations += tm.make_traces(problem, mix, rng, harness)
    tok = tm.build_tokenizer([tm.render(c) for c, _ in conversations])
    pairs = [tm.conversation_sample(tok, c, decision) for c, decision in conversations]
    model = Qwen2ForCausalLM(tm.model_config(tok, layers=layers, hidden=hidden))
    console.print(f"vocab {len(tok)}, params {sum(p.numel() for p in model.parameters()):,}, "
                  f"{len(pairs)} SFT conversations")
    t0 = time.monotonic()
    sft(model, tok, pairs, steps, lr, batch, seed)
    console.print(f"SFT {time.monotonic() - t0:.0f}s")
    model = tm.untie(model)  # trained tied (fewer parameters), shipped untied (see tm.untie)
    base = evaluate(model, tok, evals, harness, eval_samples, seed=seed)
    console.print({"held_out_before_rl": base})
    tm.save_checkpoint(model, tok, out)
    (out / "build_info.json").write_text(json.dumps({
        "seed": seed, "p_tool": p_tool, "p_miscopy": p_miscopy, "traces": traces, "steps": steps,
        "lr": lr, "batch": batch, "layers": layers, "hidden": hidden, "untied_after_sft": True,
        "held_out_in_process": base}, indent=1) + "\n")
    console.print(f"wrote {out}")
    if rl_check:
        curve = rl_check_fn(model, tok, train, evals, harness, rl_steps, rl_tasks, rl_group, rl_lr,
                            seed, eval_samples)
        print(json.dumps(curve))


rl_check_fn = rl_check

if __name__ == "__main__":
    main()
