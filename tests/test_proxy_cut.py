"""The byte-level stripper of vLLM chat chunks (``filters.cut_chat_chunk``) against the parsing one.

The cut runs on every streamed token in place of parse + strip + serialise, so it is checked on
thousands of generated chunks whose text is the model's (quotes, backslashes, braces, the very
key names it looks for, non-ASCII, escapes): whenever it answers, its bytes must parse to what
the parsing stripper returns; and it must decline every shape outside its argument.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

from lightning_harness.proxy.assemble import CHAT, StreamAssembler
from lightning_harness.proxy.filters import cut_chat_chunk, make_model_restorer, make_stripper
from lightning_harness.proxy.sse import SSERelay
from lightning_harness.proxy.tokenchunk import MAX_BYTES, TOKEN_CHUNK, match, merged

STRIP = make_stripper(token_ids=True, logprobs=True)
STRIP_NULL = make_stripper(token_ids=True, logprobs=True, as_null=True)  # the pool's answers: vLLM's nulls
NASTY = ['"', "\\", '\\"', "}", "]}]}", '},"finish_reason":', ',"token_ids":[1]}]}', '"index":', ',"logprobs":{',
         '},"', "null", "é", "\u2028", "\x00", "\U0001F600", '{"a":1}', " ", ",", "[", ""]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(NASTY + ["w", "x y", "0"]) for _ in range(rng.randint(0, 6)))


def _entry(rng: random.Random, top: bool) -> dict:
    e = {"token": _text(rng), "logprob": rng.choice([-0.5, -1e-7, 0.0, -23.25]),
         "bytes": rng.choice([None, [104, 105], []])}
    if not top:
        e["top_logprobs"] = [_entry(rng, True) for _ in range(rng.randint(0, 2))]
    return e


def _chunk(rng: random.Random) -> dict:
    """A chat chunk as vLLM writes it (its field order), with the model's text in every string."""
    delta = rng.choice([{"content": _text(rng)}, {"role": "assistant", "content": ""}, {},
                        {"reasoning": _text(rng), "content": _text(rng)}])
    choice = {"index": 0, "delta": delta}
    lp = rng.random()
    if lp < 0.8:
        choice["logprobs"] = {"content": [_entry(rng, False) for _ in range(rng.randint(0, 3))]} if lp < 0.7 else None
    if rng.random() < 0.8:
        choice["finish_reason"] = rng.choice([None, "stop", "length"])
    if rng.random() < 0.3:
        choice["stop_reason"] = rng.choice([None, 7, "</s>"])
    choice["token_ids"] = [rng.randint(0, 200000) for _ in range(rng.randint(0, 3))]
    return {"id": f"chatcmpl-{rng.randint(0, 10**9)}", "object": "chat.completion.chunk", "created": 1,
            "model": rng.choice(["m", "qwen/Qwen3-0.6B"]), "choices": [choice]}


def _dump(obj: dict, ascii_only: bool) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def test_cut_gives_what_parsing_and_stripping_gives_on_generated_chunks():
    rng = random.Random(0)
    cut = 0
    for n in range(5000):
        obj = _chunk(rng)
        raw = _dump(obj, ascii_only=n % 2 == 0)
        got = cut_chat_chunk(raw)
        if got is None:
            continue
        cut += 1
        assert json.loads(got) == STRIP(json.loads(raw)), raw
    assert cut > 4000  # the usual chunk is cut (a token spelling `},"` is declined, for one)


def test_null_cut_gives_what_the_null_stripper_gives_and_vllms_bytes():
    """Answers from the pool say ``"token_ids":null`` where plain vLLM 0.32 does (the choice's last
    member, in every token chunk); a chunk left with nothing for the harness loses the key instead,
    so the relay drops it (vLLM sends none). Cut or parsed, the same value; cut, vLLM's own bytes."""
    rng = random.Random(3)
    cut = nulled = 0
    for n in range(5000):
        obj = _chunk(rng)
        raw = _dump(obj, ascii_only=n % 2 == 0)
        got = cut_chat_chunk(raw, as_null=True)
        if got is None:
            continue
        cut += 1
        assert json.loads(got) == STRIP_NULL(json.loads(raw)), raw
        if got.endswith(b',"token_ids":null}]}'):
            nulled += 1
            plain = {**obj, "choices": [{**obj["choices"][0], "token_ids": None}]}
            if obj["choices"][0].get("logprobs") is not None:
                plain["choices"][0]["logprobs"] = None
            assert got == _dump(plain, ascii_only=n % 2 == 0)  # what vLLM writes when not asked
        else:
            assert _carried_only_injected(obj) and b"token_ids" not in got  # (dropped by the relay)
    assert cut > 4000 and nulled > 3000
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}]}
    assert STRIP_NULL(first) == {**first, "prompt_token_ids": None}  # (vLLM's first chunk says null too)


def test_model_name_cut_gives_what_the_restorer_gives():
    """A harness that asked for ``gpt-4o`` gets ``gpt-4o`` back in every chunk, cut or parsed."""
    rng = random.Random(2)
    for asked in ("gpt-4o", 'é"\\name', "a\udc00b"):  # (the last: a lone surrogate the harness escaped)
        restore = make_model_restorer(asked)
        for n in range(500):
            obj = _chunk(rng)
            raw = _dump(obj, ascii_only=n % 2 == 0)
            got = restore.cut(raw)
            assert got is not None and json.loads(got) == restore(json.loads(raw))
            got.decode("utf-8")  # what the harness gets is UTF-8 whatever name it asked for
            both = restore.cut(cut_chat_chunk(raw) or raw)
            assert json.loads(both) == restore(STRIP(json.loads(raw))) or cut_chat_chunk(raw) is None
    restore = make_model_restorer("gpt-4o")
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": []}
    for odd in ({"model": 'a"b'}, {"model": "a\\b"}, {"extra": {"model": "x"}}, {"object": "chat.completion"},
                {"created": [1]}):
        assert restore.cut(_dump({**base, **odd}, True)) is None, odd  # parsed instead
    assert restore.cut(_dump({k: v for k, v in base.items() if k != "model"}, True)) is None


def test_cut_declines_what_its_argument_does_not_cover():
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": {"content": []},
                         "finish_reason": None, "token_ids": [5]}]}
    assert cut_chat_chunk(_dump(base, True)) == (
        b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null}]}')

    def variant(**change) -> bytes:
        obj = json.loads(json.dumps(base))
        for where, value in change.items():
            if where == "top":
                obj.update(value)
            else:
                obj["choices"][0] = value(obj["choices"][0])
        return _dump(obj, True)

    declined = [
        variant(top={"prompt_token_ids": [1, 2]}),  # the first chunk: the parsing path strips it
        variant(top={"object": "text_completion"}),
        variant(top={"usage": {"prompt_tokens": 3, "completion_tokens": 1}}),  # continuous usage stats
        variant(top={"system_fingerprint": "fp"}),  # vLLM's last chunk
        variant(top={"choices": [base["choices"][0], {**base["choices"][0], "index": 1}]}),  # two choices
        variant(choice=lambda c: {**c, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}),
        variant(choice=lambda c: {k: v for k, v in c.items() if k != "token_ids"}),  # nothing to cut
        variant(choice=lambda c: {**c, "token_ids": [1.5]}),
        variant(choice=lambda c: {**c, "token_ids": None}),
        # a member between logprobs and what follows it must never be cut away with it
        variant(choice=lambda c: {"index": 0, "delta": c["delta"], "logprobs": c["logprobs"], "extra": {"a": 1},
                                  "finish_reason": None, "token_ids": [5]}),
        variant(choice=lambda c: {"index": 0, "delta": c["delta"], "logprobs": c["logprobs"], "extra": {"a": 1},
                                  "token_ids": [5]}),
        variant(choice=lambda c: {"index": 0, "delta": c["delta"], "logprobs": c["logprobs"], "extra": 1,
                                  "token_ids": [5]}),
        variant(choice=lambda c: {"index": 0, "delta": c["delta"], "logprobs": c["logprobs"], "extra": [1],
                                  "finish_reason": None, "token_ids": [5]}),
        variant(choice=lambda c: {**c, "logprobs": [1]}),
        # a key the cut looks for, twice: nested in logprobs, or the choice's prompt_token_ids (found by a
        # fuzzer: the first gave the client invalid JSON, the second kept token ids the parse strips)
        variant(choice=lambda c: {**c, "logprobs": {"content": [], "x": {}, "finish_reason": 1}}),
        variant(choice=lambda c: {**c, "logprobs": {"x": {"logprobs": {}}, "content": []}}),
        variant(choice=lambda c: {**c, "logprobs": {"content": [], "y": {"stop_reason": 1}}, "stop_reason": None}),
        variant(choice=lambda c: {"index": 0, "delta": c["delta"], "logprobs": None, "finish_reason": None,
                                  "prompt_token_ids": [1, 2, 3], "token_ids": [5]}),
        variant(choice=lambda c: {"index": 0, "delta": c["delta"], "x": {"x": 1, "logprobs": {"token_ids": [[]]}},
                                  "finish_reason": None, "token_ids": []}),  # a logprobs key, not the choice's
        variant(choice=lambda c: {**c, "logprobs": {"token_ids": {}, "finish_reason": []}}),  # no finish of its own
        variant(top={"more": [{"finish_reason": None, "token_ids": []}]}),  # the last token_ids, not the choice's
    ]
    for raw in declined:
        assert cut_chat_chunk(raw) is None, raw
    spaced = json.dumps({**base, "choices": [{"index": 0, "delta": {}, "logprobs": {"content": []},
                                              "x": {"a": 1}, "token_ids": [5]}]}).encode()
    assert cut_chat_chunk(spaced) is None  # not vLLM's compact spelling: the parsing path takes it
    # a member between logprobs and finish_reason, spelled with spaces inside the cut: still found
    sly = _dump(base, True).replace(b'"logprobs":{"content":[]}', b'"logprobs":{"content":[]} , "x":{}')
    assert cut_chat_chunk(sly) is None


def _stream(chunks: list[bytes]) -> list[bytes]:
    return [b"data: " + c + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def test_relay_cutting_gives_the_client_and_the_span_what_parsing_gives():
    """Through the relay: the client's events parse to the parsing path's, and the span's assembled
    answer is identical; a chunk the cut declines (the first, a malformed one) takes the parsing path."""
    rng = random.Random(1)
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}]}
    chunks = [_dump(first, False)] + [_dump(_chunk(rng), False) for _ in range(300)]
    restore, cut_calls = make_model_restorer("gpt-4o"), []
    model_cut = restore.cut
    restore.cut = lambda p: cut_calls.append(p) or model_cut(p)  # (seen: the byte path is taken)
    runs = []
    for filters in ([STRIP], [lambda o: STRIP(o)], [STRIP, restore], [lambda o: restore(STRIP(o))],
                    [STRIP_NULL], [lambda o: STRIP_NULL(o)]):
        asm, errors = StreamAssembler(CHAT), []  # (a lambda has no ``cut``: the parsing path)
        relay = SSERelay(asm.add, filters, on_error=errors.append)
        out = [relay(e) for e in _stream(chunks)] + [relay(b"")]
        events = [json.loads(o[6:-2]) if o else None for o in out[:-2]]  # None: dropped ([])
        runs.append((events, json.loads(json.dumps(asm.result())), errors, relay.events, relay.done))
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[4] == runs[5] and len(cut_calls) > 250
    # with vLLM's nulls: the same chunks dropped and sent, the same span; each sent one says null
    assert [e is None for e in runs[4][0]] == [e is None for e in runs[0][0]] and runs[4][1:] == runs[0][1:]
    assert all(c["token_ids"] is None for e in runs[4][0][1:] if e for c in e["choices"])
    assert runs[0][3] == 301 and not runs[0][2] and {e["model"] for e in runs[2][0] if e} == {"gpt-4o"}
    # a chunk that carried only the injected token ids and logprobs is not relayed (vLLM sends none
    # for a token that makes no delta unless they are asked for); every other one is, and the span
    # has them all
    emptied = [i for i, c in enumerate(chunks) if _carried_only_injected(json.loads(c))]
    assert len(emptied) > 10 and [i for i, e in enumerate(runs[0][0]) if e is None] == emptied
    ends = next(i for i, c in enumerate(chunks) if json.loads(c)["choices"][0].get("finish_reason"))
    assert len(runs[0][1]["choices"][0]["token_ids"]) == sum(len(json.loads(c)["choices"][0].get("token_ids", []))
                                                            for c in chunks[:ends + 1])  # (its finish ends it)


def _carried_only_injected(chunk: dict) -> bool:
    (ch,) = chunk["choices"]
    return not ch["delta"] and ch.get("finish_reason") is None and ch.get("stop_reason") is None and \
        "prompt_token_ids" not in chunk


def test_an_emptied_chunk_is_dropped_only_where_injection_emptied_it():
    """Dropped: a chunk stripped to nothing (both paths, and a last event without its blank line),
    with usage too (continuous usage stats put it in every chunk; the next one counts the token).
    Kept: the same chunk when nothing was stripped (no filters, or the harness asked for logprobs
    itself), one with a finish reason, a role, content or a member this rule does not know, and the
    usage-only chunk that ends a stream."""
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    injected = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": {"content": [
        {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]}, "finish_reason": None,
        "token_ids": [7]}]}
    raw = _dump(injected, False)
    for filters in ([STRIP], [lambda o: STRIP(o)], [STRIP_NULL], [lambda o: STRIP_NULL(o)]):
        seen = []
        relay = SSERelay(seen.append, filters)
        assert relay(b"data: " + raw + b"\n\n") == []
        assert relay(b"data: " + raw + b"\n\ndata: " + raw + b"\n\n") == []  # (the general scan)
        assert relay(b"data: " + raw) == [] and relay(b"") == []
        assert len(seen) == 4 and seen[0]["choices"][0]["token_ids"] == [7]  # the span has every token
    assert SSERelay(lambda e: None, [])(b"data: " + raw + b"\n\n") == b"data: " + raw + b"\n\n"
    ids_only = make_stripper(token_ids=True, logprobs=False)  # the harness asked for logprobs
    assert b'"logprob":-0.5' in SSERelay(lambda e: None, [ids_only])(b"data: " + raw + b"\n\n")
    for other in ({"finish_reason": "stop"}, {"delta": {"role": "assistant"}}, {"delta": {"content": ""}},
                  {"extra": 1}):
        kept = {**injected, "choices": [{**injected["choices"][0], **other}]}
        assert SSERelay(lambda e: None, [STRIP])(b"data: " + _dump(kept, False) + b"\n\n") != [], other
        sent = SSERelay(lambda e: None, [STRIP_NULL])(b"data: " + _dump(kept, False) + b"\n\n")
        assert sent != [] and json.loads(sent[6:])["choices"][0]["token_ids"] is None, other
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    for filters in ([STRIP], [lambda o: STRIP(o)], [STRIP_NULL], [lambda o: STRIP_NULL(o)]):
        assert SSERelay(lambda e: None, filters)(b"data: " + _dump({**injected, "usage": usage}, False) + b"\n\n") == []
        last = {**base, "choices": [], "usage": usage}
        assert SSERelay(lambda e: None, filters)(b"data: " + _dump(last, False) + b"\n\n") != []


def test_a_malformed_chunk_the_cut_took_is_reported_when_the_span_reads_it():
    """The cut never parses: a chunk that passes its checks yet is not JSON is reported (and not
    assembled) when the relay parses the held bytes, as the parsing path reports it on arrival."""
    bad = (b'{"id":"c","object":"chat.completion.chunk","created":01,"model":"m",'
           b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[5]}]}')
    assert cut_chat_chunk(bad) is not None
    seen, errors = [], []
    relay = SSERelay(seen.append, [STRIP], on_error=errors.append)
    relay(b"data: " + bad + b"\n\n")
    relay(b"")
    assert seen == [] and len(errors) == 1 and "malformed SSE event" in errors[0]


def test_a_lone_surrogate_escape_is_relayed_not_raised():
    """``"\\udc00"`` is valid JSON that has no UTF-8 form once parsed; rewriting such an event raised
    inside mitmproxy's stream hook. It goes out as the escape it came as."""
    seen = []
    relay = SSERelay(seen.append, [lambda o: STRIP(o)])  # the parsing path
    raw = b'{"choices":[{"index":0,"delta":{"content":"a\\udc00\\u00e9"},"token_ids":[1]}]}'
    out = relay(b"data: " + raw + b"\n\n")
    relay(b"")
    assert json.loads(out[6:-2]) == {"choices": [{"index": 0, "delta": {"content": "a\udc00\u00e9"}}]}
    assert seen == [json.loads(raw)]


def test_a_last_event_without_its_blank_line_is_stripped_too():
    """The stream's last event, cut short of its blank line, still reaches the client rewritten (it went
    out with the injected token ids, logprobs and served model name), with upstream's own line end."""
    event = _dump({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "policy",
                   "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": []},
                                "finish_reason": "stop", "token_ids": [42]}]}, True)
    for tail in (b"\n", b"\r\n", b""):
        asm = StreamAssembler(CHAT)
        relay = SSERelay(asm.add, [STRIP, make_model_restorer("gpt-4o")])
        first = relay(b"data: " + event + b"\n\n")
        sent = (relay(b"data: " + event + tail), relay(b""))
        rest = b"".join(r if isinstance(r, bytes) else b"".join(r) for r in sent)
        assert rest.endswith(tail) and rest.startswith(b"data: ") and rest == first[:len(first) - 2] + tail
        assert b"token_ids" not in rest and b'"policy"' not in rest
        assert relay.events == 2 and asm.result()["choices"][0]["token_ids"] == [42]  # (the first finish ends it)


# -- a token of plain text, matched whole (tokenchunk) --------------------------------------------------


def _token_chunk(rng: random.Random, head: dict | None = None) -> dict:
    """A chunk in the shape vLLM streams a token of plain text (tokenchunk.TOKEN_CHUNK), the model's
    text in every string, one to three tokens (a loaded engine sends several in one chunk); its id,
    created and model those of ``head`` (a stream's, as vLLM repeats them) or drawn."""
    n = rng.randint(1, 3)
    entry = lambda: {"token": _text(rng), "logprob": rng.choice([-0.5, -1e-7, 0.0, -23.25, -9999.0]),  # noqa: E731
                     "bytes": rng.choice([None, [104, 105], []]), "top_logprobs": []}
    choice = {"index": 0, "delta": {"content": _text(rng)},
              "logprobs": None if rng.random() < 0.2 else {"content": [entry() for _ in range(n)]},
              "finish_reason": None}
    if rng.random() < 0.5:
        choice["stop_reason"] = None
    choice["token_ids"] = [rng.randint(0, 200000) for _ in range(n)]
    head = head or {"id": f"chatcmpl-{_text(rng)}", "created": rng.randint(0, 2**40),
                    "model": rng.choice(["m", "qwen/Qwen3-0.6B", _text(rng)])}
    return {"id": head["id"], "object": "chat.completion.chunk", "created": head["created"], "model": head["model"],
            "choices": [choice]}


def test_a_token_chunk_is_matched_whole_and_rewritten_as_the_cut_and_the_parse_rewrite_it():
    rng = random.Random(5)
    restore = make_model_restorer('é"gpt')
    for n in range(3000):
        obj = _token_chunk(rng)
        raw = _dump(obj, ascii_only=n % 2 == 0)
        m = TOKEN_CHUNK.fullmatch(b"data: " + raw + b"\n\n")
        assert m is not None, raw
        for filters, cut in (([STRIP], cut_chat_chunk(raw)), ([STRIP_NULL], cut_chat_chunk(raw, as_null=True)),
                             ([STRIP, restore], cut_chat_chunk(raw) and restore.cut(cut_chat_chunk(raw))),
                             ([restore], restore.cut(raw))):
            got = SSERelay(lambda e: None, filters)(b"data: " + raw + b"\n\n")
            parsed = obj
            for f in filters:
                parsed = f(parsed)
            assert json.loads(got[6:-2]) == parsed and got.endswith(b"}]}\n\n"), raw
            assert cut is None or got == b"data: " + cut + b"\n\n"  # vLLM's bytes, as the cut writes them
        assert SSERelay(lambda e: None, [])(b"data: " + raw + b"\n\n") == b"data: " + raw + b"\n\n"
    for other in ({"delta": {"content": "x", "role": "assistant"}}, {"finish_reason": "stop"}, {"token_ids": []},
                  {"logprobs": {"content": []}}, {"stop_reason": 7}, {"index": 1}):
        obj = _token_chunk(rng)
        obj["choices"][0].update(other)
        assert TOKEN_CHUNK.fullmatch(b"data: " + _dump(obj, True) + b"\n\n") is None, other
    obj = _token_chunk(rng)
    for odd in (b'"logprob":NaN', b'"logprob":01', b' "content"'):  # not JSON, or not vLLM's spelling
        raw = _dump(obj, True).replace(b'"logprob":', odd[:-2] if odd.startswith(b'"logprob"') else b'"logprob":', 1)
        raw = raw.replace(b'"logprob":-', odd + b"-", 1) if odd.startswith(b'"logprob"') else raw.replace(
            b'"content"', odd, 1)
        assert TOKEN_CHUNK.fullmatch(b"data: " + raw + b"\n\n") is None, raw


def test_a_run_of_token_chunks_reaches_the_span_as_the_chunks_would_one_by_one():
    """The assembler gets a run of matched chunks as one (tokenchunk.merged): the span's answer, the
    event count and the errors are those of the parsing path, with other chunks between runs, a
    finish that ends the answer, chunks after it, a matched chunk that is not JSON (its run is
    then parsed chunk by chunk, and that one reported), and chunks whose id, created or model are
    not the stream's (vLLM repeats them; such a run is parsed chunk by chunk too)."""
    rng = random.Random(6)
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}]}
    bad = _dump(_token_chunk(rng), True).replace(b'"created":', b'"created":0', 1)  # 0123: not JSON
    merged_runs = 0
    for trial in range(40):
        chunks = [_dump(first, trial % 2 == 0)]
        head = {"id": f"chatcmpl-{_text(rng)}", "created": rng.randint(0, 2**40), "model": _text(rng)}
        for _ in range(rng.randint(1, 600)):
            pick = rng.random()
            own = None if pick < 0.03 else head
            chunks.append(bad if pick < 0.01 else _dump(_token_chunk(rng, own) if pick < 0.85 else _chunk(rng), False))
        matched = [match(b"data: " + c + b"\n\n") for c in chunks]
        merged_runs += sum(merged(list(run)) is not None for run in _runs(matched))
        runs = []
        for filters in ([STRIP_NULL, make_model_restorer("gpt-4o")], [lambda o: STRIP_NULL(o)]):
            asm, errors = StreamAssembler(CHAT), []
            relay = SSERelay(asm.add, filters, on_error=errors.append)
            for e in _stream(chunks):
                relay(e)
            relay(b"")
            runs.append((json.loads(json.dumps(asm.result())), errors, relay.events, relay.done, relay.salvaged))
        assert runs[0] == runs[1]
        assert len(runs[0][1]) == chunks.count(bad)  # each malformed one reported once
    assert merged_runs > 200  # (the token path was taken, not only its fallback)


def _runs(matched: list) -> list[list]:
    """The runs of two or more matches in a row."""
    runs, cur = [], []
    for m in [*matched, None]:
        if m is None:
            if len(cur) > 1:
                runs.append(cur)
            cur = []
        else:
            cur.append(m)
    return runs


def _tok(content: bytes = b'"a"', model: bytes = b'"m"', ids: bytes = b"5", logprobs: bytes = b"null",
         created: bytes = b"1", token: bytes | None = None, id_: bytes = b'"c"') -> bytes:
    """One token chunk's SSE event, spelled byte by byte (to write what json.dumps never writes)."""
    if token is not None:
        logprobs = b'{"content":[{"token":' + token + b',"logprob":-0.5,"bytes":null,"top_logprobs":[]}]}'
    return (b'data: {"id":' + id_ + b',"object":"chat.completion.chunk","created":' + created + b',"model":' + model
            + b',"choices":[{"index":0,"delta":{"content":' + content + b'},"logprobs":' + logprobs
            + b',"finish_reason":null,"token_ids":[' + ids + b"]}]}\n\n")


_FIRST = _dump({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}, True)
_LAST = _dump({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
    {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "stop", "token_ids": [2]}]}, True)


def _both_paths(events: list[bytes]) -> list[tuple]:
    """What the span and the relay's counters get from ``events`` through the token path and through
    the parsing path (the filters wrapped, so that none has ``cut`` or ``token_edit``)."""
    from lightning_harness.proxy.fastjson import dumps_text

    out = []
    for filters in ([STRIP_NULL, make_model_restorer("gpt-4o")],
                    [lambda o: STRIP_NULL(o), lambda o: make_model_restorer("gpt-4o")(o)]):
        asm, errors = StreamAssembler(CHAT), []
        relay = SSERelay(asm.add, filters, on_error=errors.append)
        for e in events:
            relay(e)
        relay(b"")
        out.append((dumps_text(asm.result()), relay.events, relay.salvaged, len(errors)))
    return out


HOSTILE_RUNS = {  # (a review's finds. The span is compared here; the client's bytes for the shapes the token
    # path must refuse are left to the byte cut, and test_what_is_not_json_... checks the refusal itself)
    "encoded surrogate (not UTF-8) in a run": [_tok(b'"x\xed\xa0\x80y"'), _tok(b'"b"', ids=b"6")],
    "byte FF in a run": [_tok(b'"x\xffy"'), _tok(b'"b"', ids=b"6")],
    "lone surrogate escape beside an integer past 64 bits": [_tok(b'"a\\ud800"'),
                                                             _tok(b'"b"', ids=b"18446744073709551616")],
    "a logprob past a double beside an integer past 64 bits": [_tok(token=b'"t"').replace(b"-0.5", b"-1e400"),
                                                               _tok(b'"b"', ids=b"18446744073709551616")],
    "logprobs in only some chunks of a run": [_tok(b'"a"'), _tok(b'"b"', ids=b"6", token=b'"b"')],
    "raw line breaks in a string": [_tok(b'"a\n\ndata: {}\n\nz"'), _tok(b'"b"', ids=b"6")],
    "a raw tab in a logprob's token": [_tok(b'"SECRET"', token=b'"t\tx"'), _tok(b'"b"', ids=b"6")],
    "a bad escape in the model": [_tok(b'"a"', model=b'"m\\x"'), _tok(b'"b"', ids=b"6")],
    # (merged parses only the first chunk's head: a later one's that a parser refuses must not change
    # how that chunk's token ids are read)
    "a later id's lone surrogate escape beside an integer past 64 bits": [
        _tok(b'"a"'), _tok(b'"b"', id_=b'"c\\udc00"', ids=b"18446744073709551616")],
    "a later created past a double beside an integer past 64 bits": [
        _tok(b'"a"'), _tok(b'"b"', created=b"1" + b"0" * 400, ids=b"18446744073709551616")],
    "a later model's lone surrogate escape beside an integer past 64 bits": [
        _tok(b'"a"'), _tok(b'"b"', model=b'"m\\ud800"', ids=b"18446744073709551616")],
}


def test_hostile_token_chunks_reach_the_span_as_through_the_parsing_path():
    """Byte for byte the same answer text in the span, the same event count, salvaged flag and error
    count, for the shapes a review found to differ. Run here with the standard library, and by
    test_hostile_token_chunks_with_orjson with orjson (the proxy's environment)."""
    for name, run in HOSTILE_RUNS.items():
        token, parsing = _both_paths([*run, b"data: " + _LAST + b"\n\n"])  # (no role chunk: it orders keys)
        assert token == parsing, name


def test_hostile_token_chunks_with_orjson():
    from lightning_harness.proxy.locate import proxy_python

    code = ("import sys; sys.path[:0] = sys.argv[1:]; import test_proxy_cut as t; "
            "from lightning_harness.proxy import fastjson; assert fastjson.orjson is not None; "
            "t.test_hostile_token_chunks_reach_the_span_as_through_the_parsing_path(); print('same')")
    here = str(Path(__file__).parent)
    got = subprocess.run([proxy_python(), "-c", code, here, str(Path(here) / "support")], capture_output=True,
                         text=True, timeout=120)
    assert got.stdout.strip() == "same", got.stderr[-3000:]


def test_what_is_not_json_or_too_long_is_never_matched_as_a_token_chunk():
    """A match is valid JSON text in UTF-8, so the filters can never cut away what made an event
    malformed and hand the client a clean one whose text the span refuses."""
    assert match(_tok()) is not None and match(_tok(b'"\\u00e9\\n\\"\xc3\xa9"')) is not None
    for bad in (_tok(b'"a\nb"'), _tok(b'"a\rb"'), _tok(token=b'"t\tx"'), _tok(model=b'"m\x00"'),
                _tok(b'"a\\x"'), _tok(b'"a\\u12"'), _tok(created=b"01"), _tok(ids=b"05"),
                _tok(token=b'"t"').replace(b"-0.5", b"NaN"), _tok(token=b'"t"').replace(b"-0.5", b"-.5"),
                _tok(b'"x\xed\xa0\x80"'), _tok(b'"x\xff"')):
        assert match(bad) is None, bad
    long = _tok(b'"' + b"a" * MAX_BYTES + b'"')
    assert TOKEN_CHUNK.fullmatch(long) is not None and match(long) is None  # (the general path takes it)
