"""A small, fast OpenAI-compatible upstream for tests and benchmarks (stdlib only, any venv).

Speaks ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, and SSE with
``"stream": true``; events as vLLM writes them: compact JSON, its field order), ``GET /v1/models``
and ``GET /health``. Like vLLM, it returns token ids only
when asked (``"return_token_ids": true`` -> ``prompt_token_ids`` and ``choices[0].token_ids``) and
logprobs only when asked (chat: ``"logprobs": true`` -> ``choices[0].logprobs.content[j].logprob``;
completions: ``"logprobs": N`` -> ``choices[0].logprobs.token_logprobs``). Output is deterministic:
``max_tokens`` (default 8, option --tokens) tokens with ids ``100+i``, text ``"w<i> "``,
logprob ``-0.01*(i+1)``; prompt ids are the prompt's UTF-8 bytes (at most 64). A chat request with
``tools`` (and ``tool_choice`` not ``"none"``) is answered with one call of the first tool whose
arguments are ``{"arg": "<the generated text>"}`` (``finish_reason: "tool_calls"``; streamed as
argument pieces, one per token, like real servers).

Usage::

    python tests/support/stub_upstream.py --port P [--host H] [--tls CERT KEY]
        [--tls-self-signed DIR] [--delay S] [--chunk-delay S] [--tokens N] [--model NAME]

    --tls CERT KEY          serve HTTPS with this certificate
    --tls-self-signed DIR   make (or reuse) DIR/stub-cert.pem + DIR/stub-key.pem for 127.0.0.1/localhost
                            and serve HTTPS with them (needs the `cryptography` package)
    --delay S               sleep S seconds before every model response
    --chunk-delay S         sleep S seconds between SSE chunks
    --tokens N              default number of generated tokens (max_tokens overrides)

Misbehaviour on demand, per request with headers or for all requests with
``POST /_stub/config {"fail": 500, "delay": 1.0, "malformed": true, "drop": true, "encoding": "gzip"}``
(``{}`` resets):
    X-Stub-Fail: CODE       answer HTTP CODE with an OpenAI-style error body
    X-Stub-Delay: S         sleep S seconds before answering
    X-Stub-Malformed: 1     answer 200 with a body that is not JSON (or a broken SSE event)
    X-Stub-Drop: 1          close the connection mid-response
    X-Stub-Encoding: E      compress the body with E (gzip, deflate or br; br needs `brotli`) whatever
                            the request's Accept-Encoding says (a misbehaving upstream or CDN)
    X-Stub-Truncate: 1      end the answer early but cleanly: JSON cut mid-value (Content-Length of
                            what is sent), SSE without its last events, finish_reason and [DONE]
    X-Stub-Bad-Utf8: 1      put a byte that is not UTF-8 (0xff) in the generated text (JSON and SSE)
    X-Stub-Event-Bytes: N   SSE: one content event of N bytes, written in 64 KiB pieces
    X-Stub-Pad: N           JSON: N spaces of padding inside the answer (with X-Stub-Encoding: a bomb)
``GET /_stub/blob?bytes=N`` sends N zero bytes (a big download through the proxy).
``GET /_stub/requests`` returns the last 200 model-call bodies received (what the proxy sent);
``POST /_stub/reset`` clears them. Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import ssl
import sys
import time
import urllib.parse
from pathlib import Path

DEFAULTS = {"tokens": 8, "delay": 0.0, "chunk_delay": 0.0, "model": "stub-model"}
CONFIG: dict = {}
REQUESTS: collections.deque = collections.deque(maxlen=200)


def self_signed(folder: str | os.PathLike) -> tuple[str, str]:
    """(cert, key) paths of a self-signed certificate for 127.0.0.1 / localhost, made once."""
    folder = Path(folder)
    cert, key = folder / "stub-cert.pem", folder / "stub-key.pem"
    if cert.exists() and key.exists():
        return str(cert), str(key)
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stub-upstream")])
    now = datetime.datetime.now(datetime.UTC)
    crt = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pkey.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(pkey, hashes.SHA256())
    )
    key.write_bytes(
        pkey.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    return str(cert), str(key)


# -- OpenAI-shaped bodies ---------------------------------------------------------------------------
def _prompt_ids(body: dict, chat: bool) -> list[int]:
    if chat:
        text = "".join(str(m.get("content") or "") for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        p = body.get("prompt")
        text = p if isinstance(p, str) else json.dumps(p)
    return list(text.encode()[:64]) or [0]


def _n_tokens(body: dict) -> int:
    n = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULTS["tokens"]
    return max(1, min(int(n), 4096))


def _tok(i: int) -> tuple[int, str, float]:
    return 100 + i, f"w{i} ", round(-0.01 * (i + 1), 6)


def _want_chat_logprobs(body: dict) -> bool:
    return bool(body.get("logprobs"))


def _want_cmpl_logprobs(body: dict) -> bool:
    return body.get("logprobs") is not None and body.get("logprobs") is not False


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _tool_name(body: dict) -> str | None:
    """The tool the stub 'decides' to call: the forced one, else the first; None: answer text."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    first = tools[0] if isinstance(tools[0], dict) else {}
    return (first.get("function") or {}).get("name") or "tool"


def _arg_pieces(toks) -> list[str]:
    """Tool-call arguments split one piece per token: '{"arg": "' + w0 ... + '"}'."""
    pieces = [t[1] for t in toks]
    pieces[0] = '{"arg": "' + pieces[0]
    pieces[-1] = pieces[-1] + '"}'
    return pieces


def chat_json(body: dict) -> dict:
    n, pids = _n_tokens(body), _prompt_ids(body, True)
    toks = [_tok(i) for i in range(n)]
    tool = _tool_name(body)
    message = {"role": "assistant", "content": "".join(t[1] for t in toks)}
    if tool:
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_stub_0", "type": "function",
             "function": {"name": tool, "arguments": "".join(_arg_pieces(toks))}}]}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": [{"token": t[1], "logprob": t[2], "bytes": None, "top_logprobs": []} for t in toks]}
        if _want_chat_logprobs(body) else None,
        "finish_reason": "tool_calls" if tool else "length" if body.get("max_tokens") else "stop",
    }
    out = {"id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion", "created": int(time.time()),
           "model": body.get("model") or DEFAULTS["model"], "choices": [choice], "usage": _usage(len(pids), n)}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = pids
        choice["token_ids"] = [t[0] for t in toks]
    return out


def cmpl_json(body: dict) -> dict:
    n, pids = _n_tokens(body), _prompt_ids(body, False)
    toks = [_tok(i) for i in range(n)]
    choice = {"index": 0, "text": "".join(t[1] for t in toks), "finish_reason": "length", "logprobs": None}
    if _want_cmpl_logprobs(body):
        choice["logprobs"] = {"tokens": [t[1] for t in toks], "token_logprobs": [t[2] for t in toks],
                              "top_logprobs": [{} for _ in toks], "text_offset": [3 * i for i in range(n)]}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = pids
        choice["token_ids"] = [t[0] for t in toks]
    return {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or DEFAULTS["model"], "choices": [choice], "usage": _usage(len(pids), n)}


def chat_chunks(body: dict):
    n, pids = _n_tokens(body), _prompt_ids(body, True)
    base = {"id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.get("model") or DEFAULTS["model"]}
    ids = bool(body.get("return_token_ids"))
    tool = _tool_name(body)
    pieces = _arg_pieces([_tok(i) for i in range(n)]) if tool else []
    first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None if tool else ""},
                                  "logprobs": None, "finish_reason": None}]}
    if ids:
        first["prompt_token_ids"] = pids
    yield first
    for i in range(n):
        t = _tok(i)
        delta = {"content": t[1]}
        if tool:
            tc = {"index": 0, "function": {"arguments": pieces[i]}}
            if i == 0:
                tc.update(id="call_stub_0", type="function", function={"name": tool, "arguments": pieces[i]})
            delta = {"tool_calls": [tc]}
        last = "tool_calls" if tool else "length"
        ch = {"index": 0, "delta": delta,  # vLLM's field order
              "logprobs": {"content": [{"token": t[1], "logprob": t[2], "bytes": None, "top_logprobs": []}]}
              if _want_chat_logprobs(body) else None,
              "finish_reason": last if i == n - 1 else None}
        if ids:
            ch["token_ids"] = [t[0]]
        yield {**base, "choices": [ch]}
    if (body.get("stream_options") or {}).get("include_usage"):
        yield {**base, "choices": [], "usage": _usage(len(pids), n)}


def cmpl_chunks(body: dict):
    n, pids = _n_tokens(body), _prompt_ids(body, False)
    base = {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or DEFAULTS["model"]}
    ids = bool(body.get("return_token_ids"))
    for i in range(n):
        t = _tok(i)
        ch = {"index": 0, "text": t[1], "finish_reason": "length" if i == n - 1 else None, "logprobs": None}
        if _want_cmpl_logprobs(body):
            ch["logprobs"] = {"tokens": [t[1]], "token_logprobs": [t[2]], "top_logprobs": [{}], "text_offset": [3 * i]}
        if ids:
            ch["token_ids"] = [t[0]]
            if i == 0:
                ch["prompt_token_ids"] = pids
        yield {**base, "choices": [ch]}
    if (body.get("stream_options") or {}).get("include_usage"):
        yield {**base, "choices": [], "usage": _usage(len(pids), n)}


# -- HTTP/1.1 on asyncio streams -----------------------------------------------------------------------
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests",
           500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


def _head(status: int, headers: dict) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class _Encoder:
    """Incremental body compression (gzip, deflate, br), flushed per write so SSE stays live."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "br":
            import brotli

            self._c = brotli.Compressor()
            self.feed = lambda b: self._c.process(b) + self._c.flush()
            self.finish = self._c.finish
        else:
            import zlib

            self._c = zlib.compressobj(wbits=31 if name == "gzip" else 15)
            self.feed = lambda b: self._c.compress(b) + self._c.flush(zlib.Z_SYNC_FLUSH)
            self.finish = self._c.flush


async def _send_json(w: asyncio.StreamWriter, status: int, obj, raw: bytes | None = None,
                     encoding: str | None = None) -> None:
    data = raw if raw is not None else json.dumps(obj).encode()
    headers = {"Content-Type": "application/json"}
    if encoding:
        enc = _Encoder(encoding)
        data = enc.feed(data) + enc.finish()
        headers["Content-Encoding"] = encoding
    w.write(_head(status, {**headers, "Content-Length": len(data)}) + data)
    await w.drain()


async def _send_sse(w: asyncio.StreamWriter, chunks, malformed: bool, drop: bool, encoding: str | None = None,
                    truncate: bool = False, bad_utf8: bool = False) -> None:
    headers = {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked", "Cache-Control": "no-cache"}
    enc = _Encoder(encoding) if encoding else None
    if enc:
        headers["Content-Encoding"] = encoding
    w.write(_head(200, headers))
    delay = float(CONFIG.get("chunk_delay", DEFAULTS["chunk_delay"]))
    for i, obj in enumerate(chunks):
        if drop and i == 2:
            await w.drain()
            w.transport.abort()
            raise ConnectionResetError("stub dropped the connection (X-Stub-Drop)")
        if truncate and i == 2:
            w.write(b"0\r\n\r\n")  # a clean end of the body, without the rest of the events
            await w.drain()
            return
        data = b"{not json" if malformed and i == 1 else json.dumps(obj, separators=(",", ":")).encode()  # as vLLM
        if bad_utf8 and i == 1:
            data = data.replace(b"w0 ", b"w0\xff ")
        payload = b"data: " + data + b"\n\n"
        if enc:
            payload = enc.feed(payload)
        w.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        await w.drain()
        if delay:
            await asyncio.sleep(delay)
    end = b"data: [DONE]\n\n"
    if enc:
        end = enc.feed(end) + enc.finish()
    w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
    await w.drain()


async def _model_call(w, path: str, headers: dict, raw: bytes) -> None:
    opts = {**CONFIG}
    for h, key in (("x-stub-fail", "fail"), ("x-stub-delay", "delay"), ("x-stub-malformed", "malformed"),
                   ("x-stub-drop", "drop"),
                   ("x-stub-encoding", "encoding"), ("x-stub-truncate", "truncate"), ("x-stub-bad-utf8", "bad_utf8"),
                   ("x-stub-event-bytes", "event_bytes"), ("x-stub-pad", "pad")):
        if h in headers:
            opts[key] = headers[h]
    try:
        body = json.loads(raw or b"{}")
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
    except (ValueError, RecursionError) as exc:
        REQUESTS.append({"_raw": raw.decode(errors="replace"), "_path": path})
        return await _send_json(w, 400, {"error": {"message": f"invalid JSON body: {exc}", "type": "BadRequestError",
                                                   "code": 400}})
    REQUESTS.append({**body, "_path": path, "_auth": headers.get("authorization")})
    delay = float(opts.get("delay") or DEFAULTS["delay"])
    if delay:
        await asyncio.sleep(delay)
    if opts.get("fail"):
        code = int(opts["fail"])
        return await _send_json(w, code,
                                {"error": {"message": f"stub failure {code}", "type": "stub_error", "code": code}})
    chat = path.rstrip("/").endswith("/chat/completions")
    malformed, drop, encoding = bool(opts.get("malformed")), bool(opts.get("drop")), opts.get("encoding") or None
    truncate, bad_utf8 = bool(opts.get("truncate")), bool(opts.get("bad_utf8"))
    if body.get("stream") and opts.get("event_bytes"):
        return await _send_big_event(w, body, int(opts["event_bytes"]))
    if body.get("stream"):
        chunks = chat_chunks(body) if chat else cmpl_chunks(body)
        return await _send_sse(w, chunks, malformed, drop, encoding, truncate, bad_utf8)
    if drop:
        w.write(_head(200, {"Content-Type": "application/json", "Content-Length": 1000}) + b'{"id": "x", ')
        await w.drain()
        w.transport.abort()
        raise ConnectionResetError("stub dropped the connection (X-Stub-Drop)")
    if malformed:
        return await _send_json(w, 200, None, raw=b'{"id": "broken", "choices": [}')
    answer = json.dumps(chat_json(body) if chat else cmpl_json(body)).encode()
    if truncate:
        answer = answer[: len(answer) // 2]
    if bad_utf8:
        answer = answer.replace(b"w0 ", b"w0\xff ")
    if opts.get("pad"):
        answer = answer[:-1] + b" " * int(opts["pad"]) + answer[-1:]
    await _send_json(w, 200, None, raw=answer, encoding=encoding)


async def _send_big_event(w: asyncio.StreamWriter, body: dict, n: int) -> None:
    """One chat chunk whose content is ``n`` bytes, written in 64 KiB pieces (the SSE benchmark)."""
    base = {"id": "chatcmpl-big", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.get("model")}
    big = json.dumps({**base,
                      "choices": [{"index": 0, "delta": {"content": "x" * n}, "finish_reason": "stop"}]}).encode()
    w.write(_head(200, {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"}))
    data = b"data: " + big + b"\n\ndata: [DONE]\n\n"
    for i in range(0, len(data), 65536):
        piece = data[i : i + 65536]
        w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await w.drain()
    w.write(b"0\r\n\r\n")
    await w.drain()


async def _send_blob(w: asyncio.StreamWriter, n: int) -> None:
    """``n`` bytes of octets (a download that is not a model call), written 1 MiB at a time."""
    w.write(_head(200, {"Content-Type": "application/octet-stream", "Content-Length": n}))
    piece = b"\0" * (1 << 20)
    while n > 0:
        w.write(piece[:n])
        n -= len(piece)
        await w.drain()


async def _handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await r.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            raw = b""
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await r.readline()).split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        await r.readline()
                        break
                    raw += await r.readexactly(size)
                    await r.readline()
            elif headers.get("content-length"):
                raw = await r.readexactly(int(headers["content-length"]))
            path = target.split("?", 1)[0]
            if "://" in path:  # absolute-form (someone used us as a proxy)
                path = "/" + path.split("://", 1)[1].split("/", 1)[-1]
            if method == "POST" and (path.endswith("/chat/completions") or path.endswith("/completions")):
                await _model_call(w, path, headers, raw)
            elif path == "/_stub/blob":
                await _send_blob(w, int(urllib.parse.parse_qs(target.split("?", 1)[-1]).get("bytes", ["0"])[0]))
            elif path in ("/health", "/v1/health"):
                await _send_json(w, 200, {"ok": True})
            elif path.endswith("/models"):
                await _send_json(w, 200, {"object": "list",
                                          "data": [{"id": DEFAULTS["model"], "object": "model", "owned_by": "stub"}]})
            elif path == "/_stub/requests":
                await _send_json(w, 200, list(REQUESTS))
            elif path == "/_stub/reset" and method == "POST":
                REQUESTS.clear()
                await _send_json(w, 200, {"ok": True})
            elif path == "/_stub/config" and method == "POST":
                CONFIG.clear()
                CONFIG.update(json.loads(raw or b"{}"))
                await _send_json(w, 200, CONFIG)
            else:
                await _send_json(w, 404, {"error": {"message": f"stub: no route {method} {path}"}})
            if headers.get("connection", "").lower() == "close":
                break
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            w.close()
        except Exception:
            pass


async def serve(host: str, port: int, ssl_ctx: ssl.SSLContext | None) -> None:
    server = await asyncio.start_server(_handle, host, port, ssl=ssl_ctx, backlog=1024)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub upstream on {'https' if ssl_ctx else 'http'}://{host}:{port}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    ap.add_argument("--tls-self-signed", metavar="DIR")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--chunk-delay", type=float, default=0.0)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--model", default="stub-model")
    a = ap.parse_args(argv)
    DEFAULTS.update(tokens=a.tokens, delay=a.delay, chunk_delay=a.chunk_delay, model=a.model)
    ctx = None
    tls = a.tls or (self_signed(a.tls_self_signed) if a.tls_self_signed else None)
    if tls:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(*tls)
    asyncio.run(serve(a.host, a.port, ctx))


if __name__ == "__main__":
    sys.exit(main())
