"""JSON on the proxy's hot paths: orjson when installed, the standard library otherwise.

A streamed answer is parsed and, when injected fields are stripped, serialised again event by
event; with the standard library that alone cost a fifth of what plain mitmproxy spends on the
whole request (50 events: ~0.45 ms of ~2.6 ms). orjson does the same in a fifth of the time.
Anything orjson refuses (NaN/Infinity, lone surrogates, nesting past its limit, bytes that are not
UTF-8) goes to the standard library, so results and error messages are the standard library's, only
faster in the usual case. Two differences, both only for answers from upstream: an integer beyond
64 bits is read as a float (no engine sends one; span columns refuse both), and a NaN/Infinity the
standard library parsed is written back as ``null`` (valid JSON). A harness's request, whose numbers
must survive a rewrite exactly, goes through :func:`loads_exact` / :func:`dumps_exact` instead.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # an environment built before orjson was added: same results, slower
    orjson = None

_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_compact_ascii = json.JSONEncoder(separators=(",", ":")).encode
_spaced = json.JSONEncoder(ensure_ascii=False).encode


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``; ``ValueError`` (``json.JSONDecodeError``) or ``RecursionError`` as it."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def loads_exact(text: str) -> tuple[Any, bool]:
    """A harness's request body: ``(value, fast)``. ``fast``: orjson read it, so every number in it
    is one orjson writes back exactly (it refuses NaN/Infinity and lone surrogates, and a body where
    it read an integer beyond 64 bits as a float goes to the standard library) and :func:`dumps_exact`
    may use orjson. On a large agent request (tens of KB of messages) the standard library costs ten
    times as much both ways."""
    if orjson is not None:
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
        else:
            if not _holds_huge_float(obj):
                return obj, True
    return json.loads(text), False


def _holds_huge_float(obj: Any) -> bool:
    """A float of magnitude 2**63 or more anywhere in ``obj``: what orjson makes of an integer
    beyond 64 bits (a float literal that large only costs the slower path). Looked for in the parsed
    value, not the text: a regular expression for 19 digits in a row cost ten times orjson's parse
    of a 400 KB request of source code (4.6 vs 0.43 ms), and it answered for digits inside strings."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if type(o) is dict:
            stack.extend(o.values())
        elif type(o) is list:
            stack.extend(o)
        elif type(o) is float and abs(o) >= 2.0**63:
            return True
    return False


# orjson (3.12 on) reserves room ahead and keeps what it did not use: the bytes of a rewritten
# 400 KB request body held 4.1 MB (8-13x for a long string; tracemalloc) for as long as its flow
# lived. Outputs from a few KB on are copied once at their size (~0.02 ms for 400 KB); smaller ones
# waste at most orjson's first 4 KB.
TRIM_FROM = 4096


def _fit(out: bytes) -> bytes:
    return bytes(memoryview(out)) if len(out) >= TRIM_FROM else out


def dumps_exact(obj: Any, fast: bool) -> bytes:
    """Compact UTF-8 JSON of a value :func:`loads_exact` read, its numbers exactly as they came; with
    a lone surrogate (the valid escape ``\\ud800`` in a harness's field) everything non-ASCII is
    written as escapes, which read back as the same value."""
    if fast and orjson is not None:
        return _fit(orjson.dumps(obj))
    try:
        return _compact(obj).encode()
    except UnicodeEncodeError:
        return _compact_ascii(obj).encode()


def dumps_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON, non-ASCII as is (what a rewritten body or event is sent as); a string
    holding a lone surrogate (upstream sent the valid JSON escape ``\\udc00``) has no UTF-8 form,
    so then everything non-ASCII is written as escapes, the way it came."""
    if orjson is not None:
        try:
            return _fit(orjson.dumps(obj))
        except TypeError:  # orjson.JSONEncodeError: lone surrogates, huge integers
            pass
    try:
        return _compact(obj).encode()
    except UnicodeEncodeError:
        return _compact_ascii(obj).encode()


def dumps_text(obj: Any) -> str:
    """JSON text, non-ASCII as is (a span's response assembled from a stream)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj).decode()
        except TypeError:
            pass
    return _spaced(obj)
