#!/usr/bin/env python
"""One mini-swe-agent episode on one swe task: the harness command the launcher runs per rollout.

It writes a private copy of the task's project into ``$LIGHTNING_OUTPUT_DIR/repo`` (or ``--workdir``),
and runs mini-swe-agent (pinned, unmodified, in its own environment ``.venv-swe``) on the task text
through its public Python API: ``DefaultAgent(LitellmModel(...), BubblewrapEnvironment(...))``,
configured by ``mini.yaml``. The model is reached through litellm (``openai/<name>``) at
``OPENAI_BASE_URL`` with ``OPENAI_API_KEY`` (the launcher hands both, pointing at this rollout's
proxy URL). Every command the model writes runs in the sandbox of ``sandbox.py``: no network, no
inherited environment, uid 65534, only the task folder writable, time and memory limits.

It prints one JSON line (exit status, model calls) and leaves ``trajectory.json`` next to the repo.
It never scores itself: the reward is the hidden tests on the final folder, run by the launcher's
reward step (``reward.py``), which outranks anything a harness reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generate  # noqa: E402
import sandbox  # noqa: E402

DEFAULT_CONFIG = HERE / "mini.yaml"


def load_config(path: str | Path = DEFAULT_CONFIG) -> dict:
    import yaml
    return yaml.safe_load(Path(path).read_text())


def load_task(arg: str | None) -> dict:
    """The task row: argv (JSON or a path), else LIGHTNING_TASK, else LIGHTNING_TASK_FILE."""
    raw = arg or os.environ.get("LIGHTNING_TASK")
    if raw is None and os.environ.get("LIGHTNING_TASK_FILE"):
        raw = Path(os.environ["LIGHTNING_TASK_FILE"]).read_text()
    if raw is None:
        sys.exit("harness.py: no task (pass one, or set LIGHTNING_TASK / LIGHTNING_TASK_FILE)")
    if not raw.lstrip().startswith("{"):
        raw = Path(raw).read_text()
    task = json.loads(raw)
    missing = [k for k in ("files", "prompt", "project") if k not in task]
    if missing:
        sys.exit(f"harness.py: the task lacks {missing}: is it a row of examples/swe/tasks_*.jsonl?")
    return task


def model_name(config: dict, override: str | None) -> str:
    name = override or os.environ.get("OPENAI_MODEL") or config["model"]["model_name"]
    return name if "/" in name else f"openai/{name}"


def build_agent(config: dict, workdir: Path, name: str, output_path: Path | None = None,
                base_url: str | None = None, temperature: float | None = None):
    """mini-swe-agent's DefaultAgent with its litellm model and its bubblewrap environment, sandboxed."""
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True  # its "Provider List" banner on every unpriced call

    model_cfg = dict(config["model"], model_name=name)
    kwargs = dict(model_cfg.get("model_kwargs") or {})
    if base_url:
        kwargs["api_base"] = base_url
    if temperature is not None:
        kwargs["temperature"] = temperature
    model_cfg["model_kwargs"] = kwargs
    env_cfg = config.get("environment") or {}
    env = BubblewrapEnvironment(**sandbox.environment_config(workdir, env_cfg.get("timeout", 20), env_cfg.get("env")))
    agent_cfg = {k: v for k, v in config["agent"].items() if k != "mode"}
    if output_path is not None:
        agent_cfg["output_path"] = output_path
    return DefaultAgent(LitellmModel(**model_cfg), env, **agent_cfg)


def run_episode(task: dict, workdir: Path, config: dict, name: str, output_path: Path | None = None,
                base_url: str | None = None, temperature: float | None = None) -> dict:
    """Write the task into workdir (a fresh folder) and run one episode; returns mini's exit info."""
    workdir.mkdir(parents=True, exist_ok=True)
    generate.write_task(task, workdir)
    agent = build_agent(config, workdir, name, output_path, base_url, temperature)
    try:
        info = agent.run(task["prompt"])
    finally:
        agent.env.cleanup()
    return {"exit_status": info.get("exit_status", ""), "model_calls": agent.n_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", nargs="?", help="task as JSON or a path to it (default: LIGHTNING_TASK[_FILE])")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--model", help="served model name (default: OPENAI_MODEL, else mini.yaml)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--workdir", help="task folder (default: $LIGHTNING_OUTPUT_DIR/repo)")
    args = parser.parse_args()
    task = load_task(args.task)
    out = Path(os.environ.get("LIGHTNING_OUTPUT_DIR") or ".")
    workdir = Path(args.workdir) if args.workdir else out / "repo"
    if workdir.exists() and any(workdir.iterdir()):
        sys.exit(f"harness.py: {workdir} is not empty; every episode needs a fresh private copy")
    # mini-swe-agent loads `<config dir>/.env` into the environment at import: use an empty one of this
    # attempt, not whatever the user's ~/.config/mini-swe-agent holds
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str((out / "mini-swe-agent-config").resolve()))
    os.environ.setdefault("MSWEA_CONFIGURED", "true")
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    sandbox.check()
    config = load_config(args.config)
    info = run_episode(task, workdir, config, model_name(config, args.model), out / "trajectory.json",
                       temperature=args.temperature)
    print(json.dumps({"task_id": task.get("id"), **info}), flush=True)


if __name__ == "__main__":
    main()
