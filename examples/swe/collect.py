#!/usr/bin/env python
"""Collect warm-start trajectories: real mini-swe-agent against the scripted solver, one JSON line per call.

One long-lived process (the ``mini`` CLI costs 4-7 s of CPU per process, mostly importing litellm)
runs mini-swe-agent 2.4.6 through its public API (harness.py's ``run_episode``: the same config and
the same sandbox as a training rollout) on N train tasks against ``solver.py`` served on a local
port. Every model call becomes one line:

    {"task_id", "episode", "call_index", "n_calls", "request": <the exact body mini-swe-agent sent>,
     "reply": <the solver's assistant message>, "action": <look|test|fix|wrong|submit>,
     "exit_status", "reward": <hidden tests on the final folder, scored in the sandbox>}

Run it with the swe environment's interpreter:

    .venv-swe/bin/python examples/swe/collect.py --episodes 300 --out trajectories.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from lightning_harness.process import PROXY_VARS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
import reward  # noqa: E402
import sandbox  # noqa: E402
import solver  # noqa: E402


class Recorder:
    """Keeps the exchanges of the episode running now (episodes run one at a time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[dict] = []

    def __call__(self, request: dict, reply: dict, action: solver.Action) -> None:
        with self.lock:
            self.calls.append({"request": request, "reply": reply, "action": action.kind})

    def take(self) -> list[dict]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls


def quiet_client_env() -> None:
    """The agent talks to the local solver directly: no proxy variables, a placeholder key."""
    for k in PROXY_VARS:
        os.environ.pop(k, None)
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    os.environ.setdefault("OPENAI_API_KEY", "sk-collect-placeholder")
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-config-"))  # not the user's .env
    os.environ.setdefault("MSWEA_CONFIGURED", "true")
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")


def episode_order(tasks: list[dict], n: int, seed: int) -> list[dict]:
    """n tasks: each pass over the train split in a fresh shuffled order."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        batch = tasks[:]
        rng.shuffle(batch)
        out.extend(batch)
    return out[:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=str(HERE / "tasks_train.jsonl"))
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--out", required=True, help="JSONL to append to")
    parser.add_argument("--noise", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first episode index (to extend a file)")
    parser.add_argument("--config", default=str(harness.DEFAULT_CONFIG))
    parser.add_argument("--model", default="swe-tiny", help="served name the requests carry")
    args = parser.parse_args()
    quiet_client_env()
    sandbox.check()
    config = harness.load_config(args.config)
    tasks = solver.load_tasks([args.tasks])
    policy = solver.Policy(tasks, solver.Noise.scaled(args.noise), args.seed + args.start,
                           config["agent"]["step_limit"])
    recorder = Recorder()
    server = solver.SolverServer(("127.0.0.1", 0), policy, recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    order = episode_order(tasks, args.start + args.episodes, args.seed)[args.start:]
    t0, rewards, calls = time.time(), [], []
    with open(args.out, "a") as out, tempfile.TemporaryDirectory(prefix="swe-collect-") as tmp:
        for i, task in enumerate(order, start=args.start):
            workdir = Path(tmp) / f"ep{i}" / "repo"
            info = harness.run_episode(task, workdir, config, harness.model_name(config, args.model),
                                       base_url=base_url)
            r, _why = reward.score(task, workdir)
            exchanges = recorder.take()
            for j, ex in enumerate(exchanges):
                out.write(json.dumps({"task_id": task["id"], "episode": i, "call_index": j,
                                      "n_calls": len(exchanges), "noise": args.noise, **ex,
                                      "exit_status": info["exit_status"],
                                      "reward": r}) + "\n")
            out.flush()
            rewards.append(r)
            calls.append(len(exchanges))
            if (i - args.start + 1) % 25 == 0:
                print(f"[collect] {i - args.start + 1}/{len(order)} episodes, "
                      f"success {sum(rewards) / len(rewards):.2f}, "
                      f"calls/episode {sum(calls) / len(calls):.2f}, {time.time() - t0:.0f} s", file=sys.stderr,
                      flush=True)
    server.shutdown()
    hist = {k: calls.count(k) for k in sorted(set(calls))}
    print(json.dumps({"episodes": len(rewards), "success": sum(rewards) / max(1, len(rewards)),
                      "calls_histogram": hist, "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
