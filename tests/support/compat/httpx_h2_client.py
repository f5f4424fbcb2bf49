"""httpx with HTTP/2 (``http2=True``, needs the `h2` package); proxy and CA from the environment.

Usage: python httpx_h2_client.py URL  -> one JSON line {http_version, content}
"""

import json
import sys

import httpx

with httpx.Client(http2=True, timeout=120) as c:
    r = c.post(sys.argv[1], json={"model": "policy", "messages": [{"role": "user", "content": "h2"}], "max_tokens": 3},
               headers={"Authorization": "Bearer sk-h2"})
    r.raise_for_status()
    print(json.dumps({"http_version": r.http_version, "content": r.json()["choices"][0]["message"]["content"]}))
