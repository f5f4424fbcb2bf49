#!/usr/bin/env python
"""A small multi-turn test harness written the ordinary way: the official ``openai`` client, env config.

It knows nothing about the launcher beyond Contract 2. The task row steers what it does:
  turns       number of chat turns (default 2), each appending the reply and a "user" follow-up
  behave      'url'   (default) POST the reward to LIGHTNING_REWARD_URL
              'file'  write {"reward": x} to LIGHTNING_REWARD_FILE
              'none'  report no reward
              'bad'   write "not a number" to the reward file
              'crash' exit 3 after the first call
              'flaky' crash on attempt 0, behave like 'url' afterwards
              'hang'  start a child `sleep`, record both pids in LIGHTNING_OUTPUT_DIR, sleep forever
              'slow'  sleep `sleep` seconds after the calls, then 'url'
  reward      the reward to report (default: number of turns completed / turns)
  base_url    call this URL with HTTP(S)_PROXY (forward mode) instead of OPENAI_BASE_URL
Prints the replies and a final line ``DONE <rollout_id>~<attempt>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    task = json.loads(os.environ["LIGHTNING_TASK"])
    assert json.loads(Path(os.environ["LIGHTNING_TASK_FILE"]).read_text()) == task, "task file differs from env"
    rid, attempt = os.environ["LIGHTNING_ROLLOUT_ID"], int(os.environ["LIGHTNING_ATTEMPT"])
    out = Path(os.environ["LIGHTNING_OUTPUT_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    behave = task.get("behave", "url")
    if behave == "flaky":
        behave = "crash" if attempt == 0 else "url"

    if behave == "hang":
        child = subprocess.Popen(["sleep", "1000"])
        (out / "pids.json").write_text(json.dumps({"leader": os.getpid(), "child": child.pid}))
        print("hanging", flush=True)
        time.sleep(1000)
        return 0

    from openai import OpenAI

    kwargs = {"max_retries": 0, "timeout": 60}
    if task.get("base_url"):
        kwargs["base_url"] = task["base_url"]
    client = OpenAI(**kwargs)
    turns = int(task.get("turns", 2))
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": task.get("question", "hi")}]
    done = 0
    for turn in range(turns):
        reply = client.chat.completions.create(model=task.get("model", "gpt-4o-mini"), messages=messages, max_tokens=4)
        text = reply.choices[0].message.content or ""
        print(f"turn {turn}: {text!r}", flush=True)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"continue {turn}"}]
        done += 1
        if behave == "crash":
            print("crashing on purpose", file=sys.stderr, flush=True)
            return 3
    if behave == "slow":
        time.sleep(float(task.get("sleep", 1.0)))
        behave = "url"
    reward = float(task.get("reward", done / turns))
    if behave == "url":
        import httpx

        r = httpx.post(os.environ["LIGHTNING_REWARD_URL"], json={"reward": reward, "info": {"turns": done}}, timeout=30)
        r.raise_for_status()
    elif behave == "file":
        Path(os.environ["LIGHTNING_REWARD_FILE"]).write_text(json.dumps({"reward": reward, "info": {"turns": done}}))
    elif behave == "bad":
        Path(os.environ["LIGHTNING_REWARD_FILE"]).write_text("not a number")
    print(f"DONE {rid}~{attempt}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
