"""The environment `lightning-proxy env` prints is the one the compatibility tests hand their
clients (``ProxyProcess.env_for``), and a Node harness started from a shell that evals it works."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from fixtures_compat import PASS_THROUGH
from fixtures_proxy import read_spans

from lightning_harness.proxy.locate import proxy_python

pytestmark = pytest.mark.timeout(300)


def _printed(p, fmt: str) -> str:
    cmd = [proxy_python(), "-m", "lightning_harness.proxy", "env", "cli-env", "--attempt", "3", "--token", p.token,
           "--forward-port", str(p.forward_port), "--reverse-port", str(p.reverse_port), "--confdir", str(p.confdir),
           "--format", fmt]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY",)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_printed_env_equals_env_for(proxy):
    assert json.loads(_printed(proxy, "json")) == proxy.env_for("cli-env", 3)


def test_node_harness_from_evaluated_printed_env(proxy, node_app):
    cmd = node_app("openai_node.mjs", "policy", "stream")
    base = {k: os.environ[k] for k in PASS_THROUGH if k in os.environ}
    r = subprocess.run(["bash", "-c", _printed(proxy, "export") + '\nexec "$@"', "harness", *cmd],
                       env=base, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["content"] == "w0 w1 w2 w3 " and out["usage"]["completion_tokens"] == 4
    (span,) = read_spans(proxy)
    assert (span["rollout_id"], span["attempt"], span["mode"]) == ("cli-env", 3, "reverse")
    assert span["response_token_ids"] == [100, 101, 102, 103]
