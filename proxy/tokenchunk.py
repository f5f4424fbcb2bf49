"""The chunk a vLLM chat stream sends for each token of plain text, recognised whole by one regular
expression, so that the relay rewrites it with one C-level match and a join, and the span's
assembler folds a run of them as one chunk.

vLLM (pydantic's compact JSON, its field order) streams such a token as::

    data: {"id":"..","object":"chat.completion.chunk","created":N,"model":"..","choices":[{"index":0,
    "delta":{"content":".."},"logprobs":null|{"content":[{"token":"..","logprob":X,"bytes":[..]|null,
    "top_logprobs":[]},..]},"finish_reason":null[,"stop_reason":null],"token_ids":[N,..]}]}

Why a match has that structure whatever the model wrote: a JSON string runs to the first ``"`` no
backslash escapes, which ``STRING`` follows exactly, and every other byte of the pattern is literal
structure or a number. The pattern is JSON's own grammar for what it covers (no raw control
character or bad escape in a string, no leading zero in a number), and :func:`match` also wants
UTF-8, so a matched event is valid JSON text: what the filters cut out of it (a logprob's token, the
model) can never have been what made it malformed, so this path never hands the client a clean
event whose text the span refuses. (An event it refuses goes on to the older byte cut,
``filters.cut_chat_chunk``, which checks structure, not JSON: a raw control character in a logprob's
token is cut away there, as before this path existed.) What a parser may still refuse (a lone
surrogate escape, a number past a double) is valid JSON: :func:`merged` then gives up on the run and
the relay parses its events one at a time, as it parses any other event. The quantifiers are
possessive: a long chunk that fails near its end costs one pass, not a backtrack over every byte.

Measured (docs/BENCHMARKS.md): relaying and assembling a 50-token streamed answer, in one loop,
596 -> 295 us (a chunk relayed: 7.8 -> 3.2 us); through the proxy, 5-8% less CPU a streamed request
(``scripts/bench_proxy_ab.py --together``); :func:`merged` reading only what it needs, 5-7% more.
Any other event (the first, with the role and prompt ids; tool calls; reasoning; the last, with its
finish reason and usage) takes the general path.
"""

from __future__ import annotations

import json
import re

from . import fastjson

STRING = rb'"[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+"'
NUMBER = rb"-?(?:0|[1-9]\d*+)(?:\.\d++)?+(?:[eE][-+]?\d++)?+"
_INT = rb"(?:0|[1-9]\d*+)"
_ENTRY = (rb'\{"token":' + STRING + rb',"logprob":' + NUMBER
          + rb',"bytes":(?:null|\[(?:' + _INT + rb"(?:," + _INT + rb')*+)?+\]),"top_logprobs":\[\]\}')
# groups: 1 the head up to the model's value, 2 the model, 3 the choice up to its logprobs' value (4: its
# content, a JSON string), 5 that value (6: its entries, without their brackets), 7 finish_reason (and
# stop_reason), 8 the token ids' digits
TOKEN_CHUNK = re.compile(
    rb'data: (\{"id":' + STRING + rb',"object":"chat\.completion\.chunk","created":' + _INT + rb',"model":)('
    + STRING + rb")"
    rb'(,"choices":\[\{"index":0,"delta":\{"content":(' + STRING + rb')\},"logprobs":)'
    rb'(null|\{"content":\[(' + _ENTRY + rb"(?:," + _ENTRY + rb")*+)\]\})"
    rb'(,"finish_reason":null(?:,"stop_reason":null)?+),"token_ids":\['
    rb"(" + _INT + rb"(?:," + _INT + rb")*+)" rb"\]\}\]\}\n\n")
MODEL, LOGPROBS, TOKEN_IDS = 1, 3, 5  # the parts (below) a filter replaces
# a token's chunk is a few hundred bytes (several tokens in one under load): a longer chunk is not tried,
# so a hostile upstream's megabyte chunks cost the general path alone, not a pass of the pattern first
MAX_BYTES = 16384


def match(chunk: bytes) -> re.Match | None:
    """``chunk`` (one whole SSE event) matched as a token chunk, or None: not that shape, longer than
    ``MAX_BYTES``, or not UTF-8 (such an event is parsed with replacement characters and the span
    marked salvaged)."""
    if len(chunk) > MAX_BYTES:
        return None
    m = TOKEN_CHUNK.fullmatch(chunk)
    if m is None or chunk.isascii():
        return m
    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return m


def parts(m: re.Match) -> list[bytes]:
    """The matched chunk's pieces, for filters to replace (``MODEL``: the model's JSON string;
    ``LOGPROBS``: the logprobs' value; ``TOKEN_IDS``: the whole ``,"token_ids":[..]`` member, b""
    to drop it); :func:`joined` makes the event of them."""
    return [m[1], m[2], m[3], m[5], m[7], b',"token_ids":[' + m[8] + b"]"]


def joined(pieces: list[bytes]) -> bytes:
    return b"data: " + b"".join(pieces) + b"}]}\n\n"


def payload(m: re.Match) -> bytes:
    """The event's JSON, as upstream sent it."""
    return m.string[6:-2]


def merged(run: list[re.Match]) -> dict | None:
    """One chunk holding the run's text, logprob entries and token ids, in order: what the assembler
    makes of the run chunk by chunk (the first chunk's id, created and model, as there: the first
    value of each wins).

    Only the first payload is parsed whole; of the others, only their text, logprob entries and
    token ids, joined into one JSON array: a third of the bytes, half the objects (relaying and
    assembling a 50-token answer, ``scripts/bench_relay.py``: 399 -> 172 us; with the caches cold,
    as in the proxy, 416 -> 352 us; a streamed request through the proxy, 0.93-0.95 of the CPU,
    ``scripts/bench_proxy_ab.py --together``). That reading is the one chunk by chunk gives only
    where each chunk, read alone, would get the same parser, so: None where a later chunk's id,
    created or model differ from the first's (vLLM repeats them; a value there that orjson refuses
    would send that chunk, token ids included, to the standard library, which reads an integer
    past 64 bits as an integer where orjson reads a float), where a parser refuses a value (orjson:
    a lone surrogate escape, a number past a double), or where only some chunks have logprobs (the
    span's answer would then list its keys in another order): the caller then gives them one at a
    time."""
    head, model = run[0][1], run[0][2]
    if any(m[1] != head or m[2] != model for m in run):
        return None
    lps = [m[6] for m in run if m[6] is not None]
    if lps and len(lps) < len(run):
        return None
    data = (b"[[" + b",".join([m[4] for m in run]) + b"],[" + b",".join(lps)
            + b"],[" + b",".join([m[8] for m in run]) + b"]]")
    try:
        first, (texts, entries, ids) = _loads(payload(run[0])), _loads(data)
    except ValueError:  # (orjson's JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return None
    first["choices"] = [{"index": 0, "delta": {"content": "".join(texts)},
                         "logprobs": {"content": entries} if lps else None, "finish_reason": None, "token_ids": ids}]
    return first


def _loads(data: bytes):
    return fastjson.orjson.loads(data) if fastjson.orjson is not None else json.loads(data.decode("utf-8"))
