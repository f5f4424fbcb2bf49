"""Content-Encoding of model calls: ask upstream for plain bodies, cope with ones that compress anyway.

Model calls go upstream with ``Accept-Encoding: identity`` (SSE must be parsed chunk by chunk, and
bodies are rewritten). Some upstreams, gateways and CDNs compress regardless. Then:
- a streamed (SSE) body is decompressed on the fly before the relay parses it, and sent to the
  harness uncompressed (its chunks stay live; the span gets decoded events);
- a whole body keeps its encoding only if the harness's own ``Accept-Encoding`` allowed it,
  otherwise it is decoded (a client that asked for gzip must never get brotli).
Both decodings are capped at ``max_decoded_size`` (per read of a stream, for a whole body): a
decompression bomb from upstream ends the stream's parsing (``too_large`` span) or is answered 502.
Runs after capture (which set the request up) and before rewrite (which re-encodes on write).
"""

from __future__ import annotations

import logging

from mitmproxy import http

from ..codec import StreamDecoder, TooLarge, client_accepts, decode_body, join_chunks
from ..state import META, MODEL, Call, ProxyState
from .answers import error_answer

log = logging.getLogger("lightning.proxy")


class Encoding:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or not call.in_flight:
            return
        call.accept_encoding = flow.request.headers.get("Accept-Encoding")
        flow.request.headers["Accept-Encoding"] = "identity"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or not call.in_flight or call.sse is None:
            return
        coding = flow.response.headers.get("Content-Encoding", "").strip().lower()
        if not coding or coding == "identity":
            return
        decoder = StreamDecoder.make(coding, limit=self.state.config.max_decoded_size)
        if decoder is None:
            log.warning("cannot decode a %r-encoded event stream; it is relayed as is", coding)
            return
        relay = flow.response.stream

        failed = []  # after a decoding error the rest of the stream is dropped (it cannot be parsed)

        def stream(chunk: bytes, decoder=decoder, relay=relay, call=call):
            if failed:
                return [] if chunk else relay(b"")
            try:
                if chunk:
                    data = decoder.feed(chunk)
                    return relay(data) if data else []
                rest = decoder.end()
            except Exception as exc:  # TooLarge, zlib.error, brotli.error, zstd.ZstdError
                failed.append(exc)
                if isinstance(exc, TooLarge):
                    call.sse[0].oversize = True  # capture records too_large
                call.answer_failed(f"cannot decode {coding} event stream: {exc}")
                return [] if chunk else relay(b"")
            return join_chunks(relay(rest) if rest else [], relay(b""))

        flow.response.stream = stream
        del flow.response.headers["Content-Encoding"]
        flow.response.headers.pop("Content-Length", None)

    def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.sse is not None or flow.response is None:
            return
        coding = flow.response.headers.get("Content-Encoding", "").strip().lower()
        if not coding or coding == "identity":
            return
        if client_accepts(call.accept_encoding, coding):
            return
        try:
            body = decode_body(flow.response.raw_content or b"", coding, self.state.config.max_decoded_size)
        except TooLarge as exc:
            error_answer(flow, 502, "too_large", f"lightning-proxy: upstream answer {exc} (max_decoded_size)")
            return
        except ValueError as exc:
            log.warning("cannot decode a %r-encoded response: %s", coding, exc)
            return
        del flow.response.headers["Content-Encoding"]
        flow.response.content = body
