"""Content codings without mitmproxy: what a client accepts, and incremental decoding of a stream.

Used by the encoding addon to decompress an event stream on the fly (mitmproxy hands streamed
bodies over raw) and to decide whether a whole body may keep its coding for this client, and by the
limits and capture addons to decode untrusted bodies with a cap (mitmproxy's own decoding has none:
a 200 KB gzip body can expand to gigabytes) and to turn bytes into text without losing any call.
"""

from __future__ import annotations

import importlib.util
import json
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


def client_accepts(header: str | None, coding: str) -> bool:
    """Whether a client whose ``Accept-Encoding`` is ``header`` can take a body in ``coding``."""
    ok = accepted(header)
    return coding in ok or "*" in ok


class TooLarge(ValueError):
    """Decoding would produce more bytes than allowed (a decompression bomb, or just too big)."""


# brotli and zstd offer no output cap per call: feeding them a few bytes at a time bounds what one
# call can produce (a brotli byte can stand for ~1 MB of zeros, a zstd byte for ~32 KB)
_PIECE = {"br": 16, "zstd": 64}


class StreamDecoder:
    """Incremental decoder for gzip, deflate, br and zstd bodies (``None`` from :meth:`make` if unknown).

    ``limit`` caps the bytes one :meth:`feed` (or :meth:`end`) may return, and ``total`` the bytes
    over the whole body; going over raises :class:`TooLarge` before the excess is held in memory,
    so an untrusted compressed body never expands past the cap (never call an uncapped decode on one).
    """

    def __init__(self, coding: str, limit: int | None = None, total: int | None = None) -> None:
        self.coding = "gzip" if coding == "x-gzip" else coding
        self.limit = limit
        self.total = total
        self.produced = 0
        self._d = None
        self._head = b""
        if self.coding == "br":
            import brotli  # a mitmproxy dependency

            self._d = brotli.Decompressor()
        elif self.coding == "zstd":
            import zstandard  # a mitmproxy dependency

            self._d = zstandard.ZstdDecompressor().decompressobj()
        elif self.coding == "gzip":
            self._d = zlib.decompressobj(wbits=47)  # gzip (or zlib) header
        # deflate: zlib-wrapped (per RFC) or raw (what some servers send), told by bytes 1-2 in feed

    @classmethod
    def make(cls, coding: str, limit: int | None = None, total: int | None = None) -> StreamDecoder | None:
        coding = coding.strip().lower()
        if coding not in ("gzip", "x-gzip", "deflate", "br", "zstd"):
            return None
        if coding in ("br", "zstd") and importlib.util.find_spec("brotli" if coding == "br" else "zstandard") is None:
            return None  # mitmproxy's dependencies; another environment may lack them
        return cls(coding, limit, total)

    def _budget(self) -> int | None:
        caps = [c for c in (self.limit, None if self.total is None else self.total - self.produced) if c is not None]
        return min(caps) if caps else None

    def _check(self, n: int, budget: int | None) -> None:
        if budget is not None and n > budget:
            caps = " / ".join(f"{c} bytes" for c in (self.limit, self.total) if c is not None)
            raise TooLarge(f"{self.coding} body expands past the limit of {caps}")

    def feed(self, chunk: bytes) -> bytes:
        if self._d is None:  # deflate: wait for the 2 header bytes
            self._head += chunk
            if len(self._head) < 2:
                return b""
            chunk, h = self._head, self._head
            zlib_wrapped = (h[0] & 0x0F) == 8 and ((h[0] << 8) | h[1]) % 31 == 0
            self._d = zlib.decompressobj(wbits=15 if zlib_wrapped else -15)
        budget = self._budget()
        if self.coding in _PIECE:
            return self._feed_pieces(chunk, budget)
        return self._feed_zlib(chunk, budget)

    def _feed_zlib(self, data: bytes, budget: int | None) -> bytes:
        out, n = [], 0
        while data:
            piece = self._d.decompress(data, 0 if budget is None else budget - n + 1)
            n += len(piece)
            self._check(n, budget)
            out.append(piece)
            data = self._d.unconsumed_tail
        self.produced += n
        return b"".join(out)

    def _feed_pieces(self, data: bytes, budget: int | None) -> bytes:
        step = _PIECE[self.coding] if budget is not None else max(len(data), 1)
        process = self._d.process if self.coding == "br" else self._d.decompress
        out, n = [], 0
        for i in range(0, len(data), step):
            piece = process(data[i : i + step])
            n += len(piece)
            self._check(n, budget)
            out.append(piece)
        self.produced += n
        return b"".join(out)

    def end(self) -> bytes:
        if self._d is None or self.coding in _PIECE:
            return b""
        rest = self._d.flush()
        self._check(len(rest), self._budget())
        self.produced += len(rest)
        return rest


_MEASURE_STEP = 1024  # input bytes per step when measuring: zlib turns 1 KiB into at most ~1 MiB


def decoded_size(raw: bytes, coding: str, limit: int) -> int:
    """How many bytes ``raw`` decodes to, without holding them: :class:`TooLarge` once past
    ``limit``. A bomb is thus refused with ~1 MiB in memory instead of ``limit`` bytes."""
    dec = StreamDecoder.make(coding, total=limit)
    if dec is None:
        raise ValueError(f"unsupported Content-Encoding {coding!r}")
    for i in range(0, len(raw), _MEASURE_STEP):
        dec.feed(raw[i : i + _MEASURE_STEP])  # output dropped at once; dec.produced keeps count
    dec.end()
    return dec.produced


def decode_body(raw: bytes, coding: str, limit: int) -> bytes:
    """A whole ``Content-Encoding`` body decoded, at most ``limit`` bytes (:class:`TooLarge` past it;
    ``ValueError`` for an unknown coding or corrupt data). Measured first (:func:`decoded_size`),
    then decoded: twice the CPU for a legitimate compressed body (rare, and small), a bounded
    footprint for a hostile one. Several codings (``gzip, br``) are undone last first (RFC 9110)."""
    for name in reversed([c.strip().lower() for c in coding.split(",") if c.strip()]):
        if name == "identity":
            continue
        try:
            decoded_size(raw, name, limit)
            dec = StreamDecoder.make(name, total=limit)
            raw = dec.feed(raw) + dec.end()
        except (TooLarge, ValueError) as exc:
            if isinstance(exc, TooLarge) or "unsupported" in str(exc):
                raise
            raise ValueError(f"cannot decode {name} body: {exc}") from None
        except Exception as exc:  # zlib.error, brotli.error, zstd.ZstdError
            raise ValueError(f"cannot decode {name} body: {exc}") from None
    return raw


def join_chunks(*parts) -> bytes | list[bytes]:
    """Combine relay outputs (bytes or list of bytes); an empty list means 'nothing yet'."""
    out = [p for part in parts for p in (part if isinstance(part, list) else [part]) if p]
    return b"".join(out) if out else []


def json_text(raw: bytes) -> tuple[str, bool]:
    """A request body as the engine's JSON reader takes it (FastAPI's ``json.loads`` of the bytes:
    UTF-8 with or without a byte-order mark, or UTF-16/32, lone surrogates let through), and whether
    it is no text in that encoding at all (the engine answers 400; the text keeps U+FFFD there)."""
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding, "surrogatepass"), False
    except UnicodeDecodeError:
        return raw.decode(encoding, "replace"), True


def utf8_text(raw: bytes) -> tuple[str, bool]:
    """``raw`` as text, and whether it had to be salvaged: bytes that are not UTF-8 become U+FFFD
    (a span keeps the call instead of losing it, and Parquet only takes valid UTF-8). mitmproxy's
    ``get_text`` is not used: it may guess another charset or keep bad bytes as lone surrogates."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True
