"""httpx with HTTP/2 (``http2=True``, needs the `h2` package); proxy and CA from the environment.

Usage: python httpx_h2_client.py URL [--stop-at-finish | --stop-at-first]  -> one JSON line {http_version, content}

``--stop-at-finish``: stream the answer and close it as soon as the chunk with the finish reason has
arrived, before the stream ends, over HTTP/2 only (closing resets the stream: RST_STREAM CANCEL,
what Codex does once it has ``response.completed``). ``--stop-at-first``: the same after the first
content chunk (a harness giving up mid-answer).
"""

import json
import os
import ssl
import sys

import httpx


class H2First(ssl.SSLContext):
    """ALPN with h2 offered first, as Rust and Go clients offer it (httpx offers http/1.1 first
    through a proxy tunnel, and mitmproxy takes the client's first choice)."""

    def set_alpn_protocols(self, protocols):
        super().set_alpn_protocols(sorted(protocols, key=lambda p: p != "h2"))


body = {"model": "policy", "messages": [{"role": "user", "content": "h2"}], "max_tokens": 3}
stop_at_first = "--stop-at-first" in sys.argv
stop_at_finish = stop_at_first or "--stop-at-finish" in sys.argv
verify = True
if stop_at_finish:
    verify = H2First(ssl.PROTOCOL_TLS_CLIENT)
    verify.load_verify_locations(cafile=os.environ["SSL_CERT_FILE"])
with httpx.Client(http2=True, verify=verify, timeout=120) as c:
    if not stop_at_finish:
        r = c.post(sys.argv[1], json=body, headers={"Authorization": "Bearer sk-h2"})
        r.raise_for_status()
        print(json.dumps({"http_version": r.http_version, "content": r.json()["choices"][0]["message"]["content"]}))
        sys.exit()
    text = []
    with c.stream("POST", sys.argv[1], json={**body, "stream": True}, headers={"Authorization": "Bearer sk-h2"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            text.append((choice.get("delta") or {}).get("content") or "")
            if choice.get("finish_reason") or (stop_at_first and "".join(text)):
                break  # leaving the block closes the response mid-stream
    print(json.dumps({"http_version": r.http_version, "content": "".join(text)}))
