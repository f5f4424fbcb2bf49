"""Relay a server-sent-event stream chunk by chunk while capturing (and optionally rewriting) it.

Installed as ``flow.response.stream``: mitmproxy calls it with each upstream chunk and ``b""`` at
the end. Without rewriting, every chunk is forwarded unchanged the moment it arrives and its events
are kept for the span (parsed in batches: :meth:`SSERelay.settle`). With rewriting (stripping
injected token ids / logprobs), only complete events can be rewritten, so a partial event waits
for its end (never longer than the upstream takes to send it). An empty list, never ``b""``,
means "nothing to send yet": ``b""`` ends an HTTP/1.1 body.
The sink sees each event as upstream sent it (a run of plain-text token chunks as the one chunk
that holds them all, :func:`tokenchunk.merged`): filters return rewritten copies and never change
the object they are given.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from . import fastjson, tokenchunk

# A blank line ends an event; a line ends with CRLF, LF or CR (the SSE spec), so a line end followed
# by another is one of these (the longest first where they start at the same byte). An end cut at
# "\n\r" whose "\n" was still to come leaves an empty line before the next event: ignored, as the spec does.
EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r|\n\r")
# What a chat chunk is after stripping when it carried nothing but the injected token id and logprob:
# with a tool or reasoning parser, vLLM sends no chunk for a token that makes no delta unless ids or
# logprobs are asked for (28 of a 30-token tool call). Such chunks are dropped, as vLLM would have
# (a few parsers, e.g. mistral's once its calls are complete, do send an empty delta: harmless).
_EMPTIED_TAIL = re.compile(rb'"delta":\{\}(?:,"logprobs":null)?(?:,"finish_reason":null)?'
                           rb'(?:,"stop_reason":null)?\}\]\}\Z')
_EMPTIED_TAIL_MAX = 80  # bytes: at least its longest match, so only the payload's end is searched
_CHOICE_KEYS = frozenset(("index", "delta", "logprobs", "finish_reason", "stop_reason"))
EventSink = Callable[[dict], None]
EventFilter = Callable[[dict], dict]  # returns the rewritten copy (see filters.py)


class SSERelay:
    """Linear in the bytes relayed: the buffer is a ``bytearray`` that only grows at its end, each
    chunk is scanned once for event ends (from where the last scan stopped), and a partial event is
    never copied until it is complete, so one 8 MB event costs what eight 1 MB ones do. An event
    longer than ``max_event`` bytes is not parsed (memory): the rest of the stream is relayed
    as is and ``oversize`` is set. Bytes that are not UTF-8 are decoded with replacement characters
    and ``salvaged`` is set, so the event still reaches the span.

    The sink gets the events in order, but in batches (:meth:`settle`: every ``SETTLE_EVERY`` events,
    at the end of the stream, before an oversize event, and whenever the caller needs the assembly
    so far). Feeding the assembler between chunks, when the interpreter's caches hold mitmproxy's
    state, cost three times what the same work costs in one loop; it was most of the proxy's CPU
    above plain mitmproxy on a streamed answer. Without filters, held events are raw payload bytes
    (parsed at settle, in that loop); with filters, each event is parsed once as it arrives, and that
    object is held (filters return copies, so it is the event as upstream sent it), unless every
    filter can rewrite the event's bytes itself (``cut``: a vLLM chat token chunk, see
    ``filters.cut_chat_chunk``): then the raw bytes are held, as without filters. A chunk of plain
    text as vLLM sends it (``tokenchunk.TOKEN_CHUNK``) is matched whole: every filter rewrites its
    parts (``token_edit``), and a run of them reaches the sink as one chunk (``tokenchunk.merged``)."""

    SETTLE_EVERY = 256

    def __init__(self, on_event: EventSink, filters: list[EventFilter] | None = None, on_error=None,
                 max_event: int | None = None) -> None:
        self.on_event = on_event
        self.filters = filters if filters is not None else []  # live list: rewrite may add later
        self.on_error = on_error
        self.max_event = max_event
        self.buf = bytearray()
        self.scan = 0  # event ends before this offset were already looked for
        self.pending: list[bytes | dict | re.Match] = []  # events the sink has not had yet, in stream order
        self.done = False  # saw data: [DONE]
        self.oversize = False
        self.salvaged = False
        self.events = 0  # object events the sink got
        self.bytes = 0
        self.last_chunk: float | None = None
        self._looked_up: dict[str, tuple[int, list | None]] = {}  # (see _every_filters)

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        if not chunk:  # end of stream
            rest = bytes(self.buf)
            self.buf.clear()
            if rest.strip() and not self.oversize:  # a last event without its blank line: rewritten too
                new = self._parse_block(rest)
                if new is not None and self.filters:
                    rest = new
            self.settle()
            return rest if rest else []
        self.bytes += len(chunk)
        self.last_chunk = time.time()  # (an idle upstream is told from a client that left by it)
        if self.oversize:
            return chunk
        buf = self.buf
        if not buf and (edits := self._every_filters("token_edit")) is not None:
            m = tokenchunk.match(chunk)
            if m is not None:  # a token of plain text, as vLLM sends it (held as the match)
                self._hold(m)
                if not edits:
                    return chunk
                pieces = tokenchunk.parts(m)
                for edit in edits:
                    edit(pieces)
                return tokenchunk.joined(pieces)
        # the usual chunk: exactly one whole one-line `data:` event, as engines send them. It skips
        # the general scan below (which gives the same result for the same bytes, at more calls)
        if not buf and chunk[:5] == b"data:" and chunk.find(b"\n") == len(chunk) - 2 and chunk[-2:] == b"\n\n" \
                and b"\r" not in chunk:
            payload = chunk[5:-2].lstrip(b" ")
            if payload[:1] == b"{":  # an object: _event's work inlined (this runs for every token)
                filters = self.filters
                if not filters:
                    self._hold(payload)
                    return chunk
                out = self._cut(payload)
                if out is not None:  # rewritten as bytes; the held bytes are parsed at settle
                    self._hold(payload)
                    return [] if emptied_bytes(out) else b"data: " + out + b"\n\n"
                obj = self._loads(payload)
                if type(obj) is dict:
                    self._hold(obj)  # filters return copies: the sink gets the event as sent
                    new = obj
                    for f in filters:
                        new = f(new)
                    return [] if emptied(obj, new) else b"data: " + fastjson.dumps_bytes(new) + b"\n\n"
            new = self._event(payload, ())  # anything else: [DONE], not JSON, not an object; b"": dropped
            return chunk if new is None else new + b"\n\n" if new else []
        rewrite = bool(self.filters)
        if buf:
            buf += chunk
            out, used = self._drain(buf, self.scan, rewrite)
            del buf[:used]
        else:  # nothing pending, so the chunk itself is scanned, never copied
            out, used = self._drain(chunk, 0, rewrite)
            if used < len(chunk):
                buf += chunk[used:]
        self.scan = max(len(buf) - 3, 0)  # a separator may straddle this chunk and the next
        if self.max_event is not None and len(buf) > self.max_event:
            return self._overflow(chunk, out)
        if not rewrite:
            return chunk
        return out if out else []

    def settle(self) -> None:
        """Give the sink every event held so far (in order)."""
        pending, self.pending = self.pending, []
        run: list[re.Match] = []  # token chunks in a row (tokenchunk): given as one
        for held in pending:
            if type(held) is re.Match:
                run.append(held)
                continue
            if run:
                self._give_run(run)
                run = []
            self._give(held)
        if run:
            self._give_run(run)

    def _give_run(self, run: list[re.Match]) -> None:
        one = tokenchunk.merged(run) if len(run) > 1 else None
        if one is None:  # one chunk, or a run merged refuses (tokenchunk.merged): each is parsed (and reported) alone
            for m in run:
                self._give(tokenchunk.payload(m))
        else:
            self._give(one, len(run))

    def _give(self, held: bytes | dict, events: int = 1) -> None:
        obj = held if type(held) is dict else self._json(held)  # a malformed event is reported here
        if not isinstance(obj, dict):
            return
        self.events += events
        try:
            self.on_event(obj)
        except Exception as exc:  # an event of an unexpected shape must not break the relay
            if self.on_error:
                self.on_error(f"SSE event not understood ({type(exc).__name__}: {exc}): {str(obj)[:200]!r}")

    def _overflow(self, chunk: bytes, out: bytes) -> bytes:
        """A partial event passed ``max_event``: stop parsing, relay everything from here on as is."""
        self.oversize = True
        self.settle()
        if self.on_error:
            self.on_error(f"SSE event longer than {self.max_event} bytes (max_decoded_size); not parsed, relayed as is")
        pending = bytes(self.buf)
        self.buf.clear()
        return chunk if not self.filters else (out + pending) or []

    def _drain(self, data: bytes | bytearray, pos: int, rewrite: bool) -> tuple[bytes, int]:
        """Take every complete event in ``data`` (their ends looked for from ``pos``); return them,
        rewritten if ``rewrite``, and how many bytes of ``data`` they took."""
        out = []
        start = 0  # where the current event begins
        while (sep := EVENT_END.search(data, pos)) is not None:
            end, pos = sep.span()
            block = bytes(data[start:end])
            new = self._parse_block(block)
            if rewrite and new != b"":  # (b"": dropped, its blank line too)
                out.append((block if new is None else new) + data[end:pos])
            start = pos
        return b"".join(out), start

    def _payload(self, block: bytes) -> tuple[bytes | None, list[bytes]]:
        if block.startswith(b"data:") and b"\n" not in block and b"\r" not in block:
            return block[5:].lstrip(b" "), []  # the usual shape: one data line, nothing else
        data, other = [], []
        for line in block.splitlines():
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            else:
                other.append(line)
        return (b"\n".join(data) if data else None), other

    def _parse_block(self, block: bytes) -> bytes | None:
        """Take one event; return its rewritten bytes, ending as ``block`` ended (a last line end
        upstream left there: the "\r" of a CRLF cut at "\n\r", a stream's unterminated last line),
        None: keep it as is, or b"": drop it."""
        body = block.rstrip(b"\r\n")
        payload, other = self._payload(body)
        if payload is None:
            return None
        new = self._event(payload, other)
        return new if not new else new + block[len(body):]

    def _event(self, payload: bytes, other: list[bytes] | tuple) -> bytes | None:
        """The event whose data is ``payload`` (``other``: its lines that are not data): held for the
        sink; with filters, parsed now and returned rewritten (None: relay it as is)."""
        if payload[:1] != b"{" and payload.strip() == b"[DONE]":
            self.done = True
            return None
        if not self.filters:
            self._hold(payload)
            return None
        obj = self._json(payload)  # a malformed event is reported here, and not held
        if not isinstance(obj, dict):
            return None
        self._hold(obj)  # filters return copies: the sink gets the event as sent
        new = obj
        for f in self.filters:
            new = f(new)
        if emptied(obj, new) and not other:
            return b""
        head = b"\n".join(other) + b"\n" if other else b""
        return head + b"data: " + fastjson.dumps_bytes(new)

    def _cut(self, payload: bytes) -> bytes | None:
        """The event rewritten by the filters' byte-level versions (``cut``), or None where one has
        none or declines the event (it is then parsed)."""
        cuts = self._every_filters("cut")
        if cuts is None:
            return None
        for cut in cuts:
            payload = cut(payload)
            if payload is None:
                return None
        return payload

    def _every_filters(self, attr: str) -> list | None:
        """Every filter's ``attr`` function (``cut``, ``token_edit``; [] without filters), or None where
        one has none. The list is live (rewrite may add filters later): looked up again when it grew."""
        looked_for, found = self._looked_up.get(attr, (-1, None))
        if looked_for != len(self.filters):
            found = [getattr(f, attr, None) for f in self.filters]
            found = None if None in found else found
            self._looked_up[attr] = (len(self.filters), found)
        return found

    @staticmethod
    def _loads(payload: bytes):
        """orjson's parse, or None where it fails (the general path then decides and reports)."""
        try:
            return fastjson.orjson.loads(payload)
        except Exception:  # no orjson (AttributeError), not UTF-8, or a value orjson refuses
            return None

    def _hold(self, event: bytes | dict | re.Match) -> None:
        if self.done:  # an event after [DONE] is none of the answer's: the clients stop reading there
            return
        self.pending.append(event)
        if len(self.pending) >= self.SETTLE_EVERY:
            self.settle()

    def _json(self, payload: bytes):
        """The event's JSON value, or None (reported) when it is not JSON; bytes that are not UTF-8
        are read with replacement characters."""
        if fastjson.orjson is not None:  # reads UTF-8 bytes as they are (no decoded copy first)
            try:
                return fastjson.orjson.loads(payload)
            except fastjson.orjson.JSONDecodeError:
                pass  # not UTF-8, or a value orjson refuses: the standard path below decides
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            text = payload.decode("utf-8", errors="replace")
            self.salvaged = True
        try:
            return fastjson.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
            if self.on_error:
                self.on_error(f"malformed SSE event ({exc}): {payload[:200]!r}")
            return None


def emptied_bytes(payload: bytes) -> bool:
    """``emptied`` for a stripped chunk rewritten as bytes (vLLM's compact JSON, its field order):
    its one choice ends with an empty delta and nothing but nulls after it."""
    return _EMPTIED_TAIL.search(payload, max(0, len(payload) - _EMPTIED_TAIL_MAX)) is not None


def emptied(sent: dict, new: dict) -> bool:
    """``new`` (``sent`` stripped of injected fields) is a chat chunk left with nothing for the
    harness: every choice has no delta, finish or stop reason or logprobs. The relay drops it."""
    choices = new.get("choices")  # (usage aside: with continuous usage stats every chunk has it, and vLLM
    # still sends none for such a token; the next chunk's usage counts it)
    return new is not sent and new.get("object") == "chat.completion.chunk" \
        and isinstance(choices, list) and bool(choices) and all(
            type(c) is dict and not c.get("delta") and c.get("finish_reason") is None and c.get("stop_reason") is None
            and c.get("logprobs") is None and c.keys() <= _CHOICE_KEYS for c in choices)
