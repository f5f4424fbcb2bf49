#!/usr/bin/env python
"""Build the SWE example's tiny tool-calling model from nothing, deterministically (no model hub).

Conversations come from ``--trajectories`` (one JSON line per model call that mini-swe-agent made
against the scripted solver: ``request`` body, solver ``reply`` message, ``task_id``, ``call_index``;
the last call of each episode plus its reply is the whole conversation) or, without it, from an
in-process imitation of the same loop (mini-swe-agent's message shapes and default observation
template, short prompts of our own, commands run in bubblewrap). A byte-level BPE tokenizer is
trained on them, a small Qwen2 learns every assistant turn (loss on those tokens only), and held-out
success is measured by running the same loop in-process with the model sampling.

Noise: ``--p-wrong`` of the solver's episodes first apply a wrong edit (wrong line or wrong
replacement); half of those then retry with the right one, the rest submit the broken state. With
the model's own errors this keeps held-out success low while the right fix stays in reach.

\b
    python scripts/build_swe_model.py                       # rebuild examples/swe/model
    python scripts/build_swe_model.py --trajectories /path/trajectories.jsonl
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm

SWE_DIR = tm.ROOT / "examples" / "swe"
sys.path.insert(0, str(SWE_DIR))
import generate as swe_tasks  # noqa: E402
import reward as swe_reward  # noqa: E402 (the sandboxed hidden-test scorer: these folders hold model-written code)

console = Console(stderr=True)
SPECIALS = tm.SPECIALS + ["<tool_call>", "</tool_call>"]
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {
        "type": "string", "description": "The bash command to execute"}}, "required": ["command"]}}}
SYSTEM = ("You fix bugs in a small Python project. Run one bash command per reply with the bash tool. "
          "When the tests pass, run: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")  # examples/swe/mini.yaml
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TEST_CMD = "python -m pytest -q --tb=no"
NO_CALL = ('Reply with exactly one bash tool call ({"command": "..."}). '
           "No tool calls found in the response. Every response MUST include at least one tool call.")


def observation(rc: int, out: str) -> str:
    """mini.yaml's observation template (exit code, output cut to its last 1,500 characters)."""
    if len(out) > 1500:
        out = f"[... {len(out) - 1500} characters cut]\n{out[-1500:]}"
    return f"exit code {rc}\n{out}"


# ---------------------------------------------------------------- sandboxed execution
def run_sandboxed(command: str, folder: Path, timeout: float = 10.0) -> tuple[int, str]:
    """Run a command in bubblewrap: no network, empty environment, only the task folder writable
    (seen as /repo) and this interpreter's environment read-only (for ``python -m pytest``)."""
    prefix = Path(sys.prefix)
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--ro-bind", str(prefix.resolve()), str(prefix),
            "--ro-bind", str(Path(sys.base_prefix).resolve()), sys.base_prefix, "--bind", str(folder), "/repo",
            "--chdir", "/repo",
            "--setenv", "PATH", f"{prefix}/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--", "bash", "-c", command]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    out = proc.stdout + proc.stderr
    return proc.returncode, re.sub(r" in \d+\.\d+s", "", out)  # timings would make outputs unique


# ---------------------------------------------------------------- scripted solver (imitation)
def module_name(task: dict) -> str:
    return next(k for k in task["files"] if not k.startswith("test_"))


def _sed_escape(text: str, replacement: bool) -> str:
    specials = "\\/&" if replacement else "\\/.*[]^$"
    return "".join("\\" + c if c in specials else c for c in text)


def _span(old: str, new: str) -> tuple[str, str]:
    """The smallest change of whole space-separated words turning line ``old`` into ``new``, widened to the line's
    start when a shorter span would not be its first occurrence (sed replaces the first)."""
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    s = 0
    while s < min(len(old), len(new)) - p and old[-1 - s] == new[-1 - s]:
        s += 1
    a, end = p, len(old) - s
    while a > 0 and not old[a - 1].isspace():
        a -= 1
    while end < len(old) and not old[end].isspace():
        end += 1
    while end == a and end < len(old):  # a pure insertion: take the next word along
        end += 1
        while end < len(old) and old[end - 1] != " " and old[end] != " ":
            end += 1
    if old.find(old[a:end]) != a:
        a = len(old) - len(old.lstrip())
    tail = len(old) - end
    return old[a:end], new[a:len(new) - tail]


def fix_command(task: dict) -> str:
    """The solver's one-line sed for the task's bug (line replaced in part, or the return added)."""
    name = module_name(task)
    buggy, good = task["files"][name].splitlines(), task["solution"].splitlines()
    tag, i1, _, j1, _ = next(o for o in difflib.SequenceMatcher(None, buggy, good).get_opcodes() if o[0] != "equal")
    if tag == "insert":
        script = f"{i1}a\\{good[j1]}"
    else:
        old, new = _span(buggy[i1], good[j1])
        script = f"{i1 + 1}s/{_sed_escape(old, False)}/{_sed_escape(new, True)}/"
    return "sed -i '" + script.replace("'", "'\\''") + f"' {name}"


def wrong_command(task: dict, rng: random.Random) -> str:
    """A plausible wrong edit: the right change on a neighbouring line, or a wrong replacement."""
    right = fix_command(task)
    m = re.match(r"sed -i '(\d+)(.*)", right)
    line, rest = int(m.group(1)), m.group(2)
    swaps = [("<=", "<"), ("<", "<="), (">", ">="), ("+", "-"), ("-", "+"), ("0", "1"), ("1", "0"),
             ("and", "or"), ("==", "!="), ("a, b", "b, a")]
    if "s/" in rest and rng.random() < 0.5:
        before, new, after = rest.rsplit("/", 2)[0], rest.rsplit("/", 2)[1], rest.rsplit("/", 2)[2]
        for a, b in rng.sample(swaps, len(swaps)):
            if a in new and new.replace(a, b, 1) not in (new, before.split("s/", 1)[-1]):
                return right.replace(rest, f"{before}/{new.replace(a, b, 1)}/{after}")
    return right.replace(f"'{line}", f"'{max(1, line + rng.choice([-2, -1, 1, 2]))}", 1)


def call_message(command: str, call_id: str) -> dict:
    """An assistant message as vLLM's hermes parser returns it (arguments: json.dumps, ensure_ascii off)."""
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": command}, ensure_ascii=False)}}]}


def conversation(task: dict, steps: list[tuple[str, str]]) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for k, (command, obs) in enumerate(steps):
        messages.append(call_message(command, f"call_{k}"))
        if command != SUBMIT:
            messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": obs})
    return messages


def imitation_episodes(task: dict, rng: random.Random, p_wrong: float) -> list[dict]:
    """The solver on one task: the clean episode (read, fix, test, submit) and, with ``p_wrong``, a
    noisy one (a wrong edit tested first; then the right fix, or submitting the broken state).
    Every command really runs (bubblewrap); one run per task yields the observations of both."""
    name = module_name(task)
    with tempfile.TemporaryDirectory() as tmp:
        folder = swe_tasks.write_task(task, Path(tmp) / "repo")
        cmds = [f"cat -n {name}", wrong_command(task, rng)]
        obs = {}
        obs["cat"] = observation(*run_sandboxed(cmds[0], folder))
        obs["wrong"] = observation(*run_sandboxed(cmds[1], folder))
        obs["test_wrong"] = observation(*run_sandboxed(TEST_CMD, folder))
        wrong_reward = swe_reward.score(task, folder)[0]
        swe_tasks.write_task(task, folder)
        fix = fix_command(task)
        obs["fix"] = observation(*run_sandboxed(fix, folder))
        obs["test_fix"] = observation(*run_sandboxed(TEST_CMD, folder))
        reward = swe_reward.score(task, folder)[0]
    read = [(cmds[0], obs["cat"])]
    fixed = [(fix, obs["fix"]), (TEST_CMD, obs["test_fix"]), (SUBMIT, "")]
    wrong = [(cmds[1], obs["wrong"]), (TEST_CMD, obs["test_wrong"])]
    out = [{"task_id": task["id"], "messages": conversation(task, read + fixed), "reward": reward}]
    if rng.random() < p_wrong:
        if rng.random() < 0.5:
            out.append({"task_id": task["id"], "messages": conversation(task, read + wrong + fixed), "reward": reward})
        else:
            out.append({"task_id": task["id"], "messages": conversation(task, read + wrong + [(SUBMIT, "")]),
                        "reward": wrong_reward})
    for episode in out:
        episode["tools"] = [BASH_TOOL]
    return out


def load_trajectories(path: Path) -> list[dict]:
    """Whole conversations from per-call lines: the last call of each episode plus the solver's reply."""
    last: dict = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        key = (row.get("task_id"), row.get("episode", 0))
        if key not in last or row["call_index"] > last[key]["call_index"]:
            last[key] = row
    episodes = []
    for row in last.values():
        req = row["request"]
        messages = [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
                    for m in req["messages"] + [row["reply"]]]
        episodes.append({"task_id": row.get("task_id"), "messages": messages, "tools": req.get("tools"),
                         "reward": row.get("reward")})
    return episodes


# ---------------------------------------------------------------- the agent loop, in process
def parse_reply(text: str) -> dict:
    """The assistant message vLLM's hermes parser makes of ``text`` (no parse: plain content)."""
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)
    try:
        calls = [json.loads(a or b) for a, b in blocks]
        tool_calls = [{"id": f"call_{i}", "type": "function", "function": {
            "name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(calls)]
    except (ValueError, KeyError, TypeError):
        tool_calls = []
    if not tool_calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text[:text.find("<tool_call>")] or None, "tool_calls": tool_calls}


def step_episode(state: dict, message: dict) -> None:
    """mini-swe-agent's step on one reply: run every call, or answer a format error; submit ends."""
    state["messages"].append(message)
    calls = message.get("tool_calls") or []
    if not calls:
        state["messages"].append({"role": "user", "content": NO_CALL})
        return
    for call in calls:
        try:
            command = json.loads(call["function"]["arguments"])["command"]
        except (ValueError, KeyError, TypeError):
            state["messages"].append({"role": "tool", "tool_call_id": call["id"],
                                      "content": "Missing 'command' argument in bash tool call."})
            continue
        rc, out = run_sandboxed(command, state["folder"])
        if rc == 0 and out.lstrip().splitlines()[:1] == ["COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]:
            state["done"] = state["submitted"] = True
            return
        state["messages"].append({"role": "tool", "tool_call_id": call["id"], "content": observation(rc, out)})


def agent_rollouts(model, tok, tasks: list[dict], step_limit: int, temperature: float, generator,
                   max_new_tokens: int = 96, max_len: int = 2048) -> list[dict]:
    """Held-out episodes through the same loop as mini-swe-agent, the model sampling in process."""
    with tempfile.TemporaryDirectory() as tmp:
        states = [{"task": t, "folder": swe_tasks.write_task(t, Path(tmp) / f"r{i}"), "done": False, "calls": 0,
                   "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t["prompt"]}]}
                  for i, t in enumerate(tasks)]
        for _ in range(step_limit):
            active = [s for s in states if not s["done"]]
            prompts = [tok(tok.apply_chat_template(s["messages"], tools=[BASH_TOOL], add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False)["input_ids"]
                       for s in active]
            keep = [(s, p) for s, p in zip(active, prompts) if len(p) + max_new_tokens <= max_len]
            for s, p in zip(active, prompts):
                if len(p) + max_new_tokens > max_len:  # mini-swe-agent ends on a context-length error
                    s["done"], s["overflow"] = True, True
            if not keep:
                break
            outs = []
            for i in range(0, len(keep), 16):
                outs += tm.sample_turn(model, tok, [p for _, p in keep[i:i + 16]], max_new_tokens, temperature,
                                       generator)
            for (s, _), out in zip(keep, outs):
                s["calls"] += 1
                s["submitted"] = False
                text = tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=False)
                step_episode(s, parse_reply(text))
        for s in states:
            s["reward"] = swe_reward.score(s["task"], s["folder"])[0]
    return [{"task_id": s["task"]["id"], "reward": s["reward"], "calls": s["calls"],
             "submitted": s.get("submitted", False),
             "messages": s["messages"]} for s in states]


def summarise(runs: list[dict]) -> dict:
    calls = sorted(r["calls"] for r in runs)
    return {"episodes": len(runs), "success": round(sum(r["reward"] for r in runs) / len(runs), 4),
            "submitted": round(sum(r["submitted"] for r in runs) / len(runs), 4),
            "tasks_ever_solved": len({r["task_id"] for r in runs if r["reward"]}),
            "calls_min_median_max": [calls[0], calls[len(calls) // 2], calls[-1]]}


def read_tasks(split: str) -> list[dict]:
    return [json.loads(line) for line in (SWE_DIR / f"tasks_{split}.jsonl").read_text().splitlines()]


def solver_data(train: list[dict], p_wrong: float, seed: int, workers: int) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    rngs = [random.Random(f"{seed}-{t['id']}") for t in train]  # per task: independent of scheduling
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda tr: imitation_episodes(tr[0], tr[1], p_wrong), zip(train, rngs)))
    return [e for part in parts for e in part]


def make_tokenizer(episodes: list[dict], vocab: int, max_len: int):
    template = (SWE_DIR / "chat_template.jinja").read_text()
    renderer = tm.build_tokenizer(["x"], vocab_size=300, specials=SPECIALS, chat_template=template)
    corpus = [renderer.apply_chat_template(e["messages"], tools=e["tools"], tokenize=False) for e in episodes]
    return tm.build_tokenizer(corpus, vocab_size=vocab, specials=SPECIALS, chat_template=template, max_length=max_len)


@click.command(help=__doc__)
@click.option("--out", type=click.Path(path_type=Path), default=SWE_DIR / "model", show_default=True)
@click.option("--trajectories", type=click.Path(path_type=Path, exists=True), default=None,
              help="mini-swe-agent x scripted solver calls (JSONL); default: the in-process imitation")
@click.option("--seed", default=0, show_default=True)
@click.option("--p-wrong", default=0.5, show_default=True, help="share of tasks that also get a noisy episode")
@click.option("--vocab", default=2048, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--hidden", default=128, show_default=True)
@click.option("--max-len", default=2048, show_default=True)
@click.option("--steps", default=360, show_default=True, help="SFT steps")
@click.option("--minutes", default=0.0, show_default=True, help="stop SFT after this wall time (0: no limit)")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--batch", default=6, show_default=True)
@click.option("--eval-tasks", default=84, show_default=True, help="held-out tasks evaluated (first N)")
@click.option("--eval-shard", default="0/1", show_default=True,
              help="i/n: evaluate every n-th task from i (parallel runs)")
@click.option("--eval-samples", default=1, show_default=True, help="sampled episodes per held-out task")
@click.option("--step-limit", default=8, show_default=True, help="model calls per episode")
@click.option("--threads", default=1, show_default=True)
@click.option("--workers", default=2, show_default=True, help="parallel solver episodes")
@click.option("--episodes", "episodes_file", type=click.Path(path_type=Path), default=None,
              help="reuse the imitation episodes saved in this JSONL (written there when missing)")
@click.option("--device", default="cpu", show_default=True, help="where SFT runs (cuda if you have one)")
@click.option("--eval/--no-eval", "run_eval", default=True, help="measure held-out success after the build")
@click.option("--eval-only", is_flag=True, help="skip the build: evaluate the model in --out")
@click.option("--snapshots", default="",
              help="comma-separated SFT steps at which to also save OUT-stepN "
                   "(pick a warm start by its held-out success)")
def main(out, trajectories, seed, p_wrong, vocab, layers, hidden, max_len, steps, minutes, lr, batch, eval_tasks,
         eval_shard, eval_samples,
         step_limit, threads, workers, episodes_file, device, run_eval, eval_only, snapshots):
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    shard, shards = (int(x) for x in eval_shard.split("/"))
    evals = read_tasks("eval")[:eval_tasks][shard::shards]
    if eval_only:
        model, tok = Qwen2ForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
        print(json.dumps(evaluate(model, tok, evals, eval_samples, step_limit, seed, max_len)))
        return
    t0 = time.monotonic()
    if trajectories:
        episodes = load_trajectories(trajectories)
    elif episodes_file and episodes_file.exists():
        episodes = [json.loads(line) for line in episodes_file.read_text().splitlines()]
    else:
        episodes = solver_data(read_tasks("train"), p_wrong, seed, workers)
        if episodes_file:
            tm.write_jsonl(episodes, episodes_file)
    console.print(f"{len(episodes)} SFT episodes ({time.monotonic() - t0:.0f}s), solver success "
                  f"{sum(e['reward'] or 0 for e in episodes) / len(episodes):.3f}")
    tok = make_tokenizer(episodes, vocab, max_len)
    samples = [tm.chat_sample(tok, e["messages"], e["tools"]) for e in episodes]
    samples = [s for s in samples if len(s[0]) <= max_len]
    heads = hidden // 64
    model = Qwen2ForCausalLM(tm.model_config(tok, layers=layers, hidden=hidden, heads=heads, max_positions=max_len))
    lengths = sorted(len(s[0]) for s in samples)
    console.print(f"vocab {len(tok)}, params {sum(p.numel() for p in model.parameters()):,}, {len(samples)} samples, "
                  f"tokens median {lengths[len(lengths) // 2]} max {lengths[-1]}")
    t1 = time.monotonic()
    def snapshot(step: int) -> None:  # an untied copy on CPU, as shipped
        tm.save_checkpoint(tm.untie(copy.deepcopy(model).cpu()), tok, out.with_name(f"{out.name}-step{step}"))

    marks = {int(x) for x in snapshots.split(",") if x.strip()}
    done = sft(model.to(device), tok, samples, steps, lr, batch, seed, minutes, marks, snapshot)
    sft_s = time.monotonic() - t1
    model = tm.untie(model.cpu())  # trained tied, shipped untied (see tm.untie)
    tm.save_checkpoint(model, tok, out)
    source = ({"trajectories": trajectories.name, "sha256": hashlib.sha256(trajectories.read_bytes()).hexdigest()}
              if trajectories else "imitation")
    info = {"seed": seed, "source": source, "p_wrong": p_wrong,
            "episodes": len(samples), "vocab": len(tok), "layers": layers, "hidden": hidden, "heads": heads,
            "max_len": max_len, "steps": done, "planned_steps": steps, "minutes_budget": minutes, "device": device,
            "lr": lr, "batch": batch, "sft_seconds": round(sft_s),
            "params": sum(p.numel() for p in model.parameters()), "untied_after_sft": True}
    (out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    console.print(f"SFT {sft_s:.0f}s, wrote {out}")
    if not run_eval:
        return
    info["held_out_in_process"] = evaluate(model, tok, evals, eval_samples, step_limit, seed, max_len)
    (out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    console.print({k: v for k, v in info["held_out_in_process"].items() if k != "runs"})


def sft(model, tok, samples, steps: int, lr: float, batch: int, seed: int, minutes: float,
        marks: set = frozenset(), snapshot=None) -> int:
    """Supervised warm start on the assistant turns (short warm-up, linear decay), stopped early
    when a wall-time budget runs out on a busy machine; returns the steps done."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    model.train()
    t0 = time.monotonic()
    for step in range(steps):
        logp, n = tm.completion_logprobs(model, None, tok.pad_token_id, samples=rng.sample(samples, batch))
        loss = -(logp.sum() / n.sum())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step + 1 in marks:
            snapshot(step + 1)
        if step % 20 == 0:
            console.print(f"SFT step {step}/{steps} loss {loss.item():.4f} {time.monotonic() - t0:.0f}s")
        if minutes and time.monotonic() - t0 > 60 * minutes:
            return step + 1
    return steps


def evaluate(model, tok, evals, samples: int, step_limit: int, seed: int, max_len: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    model.eval()
    runs = agent_rollouts(model, tok, evals * samples, step_limit, 1.0, gen, max_len=max_len)
    return {"temperature": 1.0, "step_limit": step_limit, **summarise(runs),
            "runs": [{k: r[k] for k in ("task_id", "reward", "calls", "submitted")} for r in runs]}


if __name__ == "__main__":
    main()
