"""Content codings without mitmproxy: what a client accepts, and incremental decoding of a stream.

Used by the encoding addon to decompress an event stream on the fly (mitmproxy hands streamed
bodies over raw) and to decide whether a whole body may keep its coding for this client.
"""

from __future__ import annotations

import zlib


def accepted(header: str | None) -> set[str]:
    """Codings a client accepts (``q=0`` excluded); no header means identity only."""
    out = set()
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        name = name.strip().lower()
        if not name:
            continue
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k.strip() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        if q > 0:
            out.add(name)
    return out


class StreamDecoder:
    """Incremental decoder for gzip, deflate and br bodies (``None`` from :meth:`make` if unknown)."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        if coding == "br":
            import brotli  # a mitmproxy dependency

            self._d = brotli.Decompressor()
            self._feed = self._d.process
            self._end = lambda: b""
        elif coding == "deflate":
            self._d = None  # zlib-wrapped (per RFC) or raw (what some servers send): told by bytes 1-2
            self._head = b""
            self._feed = self._deflate
            self._end = lambda: self._d.flush() if self._d else b""
        else:
            self._d = zlib.decompressobj(wbits=47)  # gzip (or zlib) header
            self._feed = self._d.decompress
            self._end = self._d.flush

    def _deflate(self, chunk: bytes) -> bytes:
        if self._d is None:
            self._head += chunk
            if len(self._head) < 2:
                return b""
            chunk, h = self._head, self._head
            zlib_wrapped = (h[0] & 0x0F) == 8 and ((h[0] << 8) | h[1]) % 31 == 0
            self._d = zlib.decompressobj(wbits=15 if zlib_wrapped else -15)
        return self._d.decompress(chunk)

    @classmethod
    def make(cls, coding: str) -> "StreamDecoder | None":
        coding = coding.strip().lower()
        return cls(coding) if coding in ("gzip", "x-gzip", "deflate", "br") else None

    def feed(self, chunk: bytes) -> bytes:
        return self._feed(chunk)

    def end(self) -> bytes:
        return self._end()


def join_chunks(*parts) -> bytes | list[bytes]:
    """Combine relay outputs (bytes or list of bytes); an empty list means 'nothing yet'."""
    out = [p for part in parts for p in (part if isinstance(part, list) else [part]) if p]
    return b"".join(out) if out else []
