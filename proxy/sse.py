"""Relay a server-sent-event stream chunk by chunk while capturing (and optionally rewriting) it.

Installed as ``flow.response.stream``: mitmproxy calls it with each upstream chunk and ``b""`` at
the end. Without rewriting, every chunk is forwarded unchanged the moment it arrives and a copy is
parsed for the span. With rewriting (stripping injected token ids / logprobs), only complete
events can be rewritten, so a partial event waits for its end (never longer than the upstream takes
to send it). An empty list, never ``b""``, means "nothing to send yet": ``b""`` ends an HTTP/1.1 body.
The sink sees each event as upstream sent it; the filters then rewrite that same object in place, so
a sink that keeps parts of an event must copy them (the Responses assembler does).
"""

from __future__ import annotations

import json
from typing import Callable

EventSink = Callable[[dict], None]
EventFilter = Callable[[dict], None]


class SSERelay:
    def __init__(self, on_event: EventSink, filters: list[EventFilter] | None = None, on_error=None) -> None:
        self.on_event = on_event
        self.filters = filters if filters is not None else []  # live list: rewrite may add later
        self.on_error = on_error
        self.buf = b""
        self.done = False  # saw data: [DONE]
        self.events = 0
        self.bytes = 0

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        if not chunk:  # end of stream
            rest, self.buf = self.buf, b""
            if rest.strip():
                self._parse_block(rest)  # a last event without its blank line
            return rest if rest else []
        self.bytes += len(chunk)
        self.buf += chunk
        if not self.filters:
            self._drain(rewrite=False)
            return chunk
        out = self._drain(rewrite=True)
        return out if out else []

    def _drain(self, rewrite: bool) -> bytes:
        out = []
        buf = self.buf
        while True:
            i = buf.find(b"\n\n")
            j = buf.find(b"\r\n\r\n")
            if i < 0 and j < 0:
                break
            if j >= 0 and (i < 0 or j < i):
                block, buf = buf[:j], buf[j + 4 :]
                sep = b"\r\n\r\n"
            else:
                block, buf = buf[:i], buf[i + 2 :]
                sep = b"\n\n"
            new = self._parse_block(block, rewrite)
            out.append((new if new is not None else block) + sep)
        self.buf = buf
        return b"".join(out) if rewrite else b""

    def _parse_block(self, block: bytes, rewrite: bool = False) -> bytes | None:
        """Feed one event to the sink; return its rewritten bytes (None: keep as is)."""
        data = []
        other = []
        for line in block.splitlines():
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            else:
                other.append(line)
        if not data:
            return None
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            self.done = True
            return None
        try:
            obj = json.loads(payload)
        except ValueError as exc:
            if self.on_error:
                self.on_error(f"malformed SSE event ({exc}): {payload[:200]!r}")
            return None
        if not isinstance(obj, dict):
            return None
        self.events += 1
        self.on_event(obj)
        if not rewrite:
            return None
        for f in self.filters:
            f(obj)
        head = b"\n".join(other) + b"\n" if other else b""
        return head + b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
