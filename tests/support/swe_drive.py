"""Drive the coding-agent example's own command path (``CancellableEnvironment.execute``), run with the
swe environment's Python: ``swe_drive.py SWE_DIR WORKDIR CONFIG_DIR [--no-cgroup]``. The commands come
as a JSON list on stdin; each observation goes out as one JSON line. ``--no-cgroup``: the harness finds
no writable cgroup, as an unprivileged one does."""
import json
import os
import sys

sys.path.insert(0, sys.argv[1])
os.environ.update(MSWEA_GLOBAL_CONFIG_DIR=sys.argv[3], MSWEA_CONFIGURED="true", MSWEA_SILENT_STARTUP="1",
                  LITELLM_LOCAL_MODEL_COST_MAP="True")
import harness  # noqa: E402  (the example's, from SWE_DIR)

if "--no-cgroup" in sys.argv[4:]:
    harness.sandbox.cgroup_parents = lambda: ()
agent = harness.build_agent(harness.load_config(harness.DEFAULT_CONFIG), sys.argv[2], "openai/x", None,
                            "http://127.0.0.1:9/v1", None, "sk-test")
for command in json.loads(sys.stdin.read()):
    print(json.dumps(agent.env.execute({"command": command})), flush=True)
agent.env.cleanup()
