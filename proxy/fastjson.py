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
import re
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


# orjson reads an integer beyond 64 bits as a float; a run of 19+ digits anywhere in the text
# (inside a string too: a false alarm only costs the slower path) sends the body to the standard library
_LONG_DIGITS = re.compile(r"\d{19}")


def loads_exact(text: str) -> tuple[Any, bool]:
    """A harness's request body: ``(value, fast)``. ``fast``: orjson read it, so every number in it
    is one orjson writes back exactly (it refuses NaN/Infinity and lone surrogates, and bodies with
    long digit runs never reach it) and :func:`dumps_exact` may use orjson. On a large agent request
    (tens of KB of messages) the standard library costs ten times as much both ways."""
    if orjson is not None and not _LONG_DIGITS.search(text):
        try:
            return orjson.loads(text), True
        except orjson.JSONDecodeError:
            pass
    return json.loads(text), False


# orjson (3.12 on) reserves room ahead and keeps what it did not use: the bytes of a rewritten
# 400 KB request body held 4.1 MB (8-13x for a long string; tracemalloc) for as long as its flow
# lived. Outputs from a few KB on are copied once at their size (~0.02 ms for 400 KB); smaller ones
# waste at most orjson's first 4 KB.
TRIM_FROM = 4096


def _fit(out: bytes) -> bytes:
    return bytes(memoryview(out)) if len(out) >= TRIM_FROM else out


def dumps_exact(obj: Any, fast: bool) -> bytes:
    """Compact UTF-8 JSON of a value :func:`loads_exact` read, its numbers exactly as they came."""
    return _fit(orjson.dumps(obj)) if fast and orjson is not None else _compact(obj).encode()


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
