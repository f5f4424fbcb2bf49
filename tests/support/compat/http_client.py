"""A harness using plain `requests`, `httpx`, stdlib `urllib` or `aiohttp` with their defaults (proxy
and CA from the environment; aiohttp's default ``trust_env=False`` ignores both).

Usage: python http_client.py requests|httpx|urllib|aiohttp URL MODEL [--stream] [--gzip]
Prints one JSON line: status, headers of interest, the parsed body (or the SSE events).
`--gzip` sends `Accept-Encoding: gzip` explicitly (httpx/requests send it anyway; this pins it).
"""

import json
import sys


def main() -> None:
    lib, url, model, *flags = sys.argv[1:]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    if "--stream" in flags:
        body["stream"] = True
    headers = {"Authorization": "Bearer sk-compat-test", "Content-Type": "application/json"}
    if "--gzip" in flags:
        headers["Accept-Encoding"] = "gzip"
    if lib == "requests":
        import requests

        r = requests.post(url, data=json.dumps(body), headers=headers, timeout=120)
        status, text, hdrs = r.status_code, r.text, r.headers
    elif lib == "urllib":
        import urllib.request

        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:  # proxies from the env; CA: SSL_CERT_FILE
            status, text, hdrs = r.status, r.read().decode(), r.headers
    elif lib == "aiohttp":
        import asyncio

        import aiohttp

        async def go():
            async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body), headers=headers) as r:
                return r.status, await r.text(), r.headers

        status, text, hdrs = asyncio.run(go())
    else:
        import httpx

        with httpx.Client(timeout=120) as c:  # trust_env: HTTPS_PROXY, SSL_CERT_FILE
            r = c.post(url, content=json.dumps(body), headers=headers)
            status, text, hdrs = r.status_code, r.text, r.headers
    out = {"status": status, "content_type": hdrs.get("content-type"), "content_encoding": hdrs.get("content-encoding")}
    if "--stream" in flags:
        out["events"] = [json.loads(ln[5:]) for ln in text.splitlines()
                         if ln.startswith("data:") and "[DONE]" not in ln]
        out["done"] = "data: [DONE]" in text
    else:
        out["body"] = json.loads(text)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
