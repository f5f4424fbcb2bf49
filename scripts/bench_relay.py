#!/usr/bin/env python
"""What relaying and assembling one streamed answer costs, in a loop: the token path (a vLLM token
chunk matched whole, ``proxy/tokenchunk.py``) against the parsing path every other event takes, same
run, same answer.

The answer is the test stub's (vLLM's shape: compact JSON, its field order, token ids and logprobs
asked for), relayed by ``SSERelay`` with the filters the proxy uses when the harness asked for
neither (token ids and logprobs stripped, the model renamed) and folded by the span's
``StreamAssembler``. The parsing path is the same filters wrapped, so that none offers the byte-level
edits. Each answer is timed in thread CPU; "cold" first walks 8 MiB of memory, as the proxy's other
work evicts the caches between one answer's events (in the proxy, costs come out at about the cold
figures). Run it with the proxy's environment (orjson):

    .venv-proxy/bin/python scripts/bench_relay.py
    .venv-proxy/bin/python scripts/bench_relay.py --tokens 500 --answers 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "support")]


def answer(tokens: int) -> list[bytes]:
    """The stub's streamed chat answer as SSE events, ending with ``[DONE]``."""
    import stub_upstream

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": tokens,
            "logprobs": True, "return_token_ids": True}
    events = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
              for e in stub_upstream.chat_chunks(body)]
    return events + [b"data: [DONE]\n\n"]


def relay_once(events: list[bytes], filters: list) -> float:
    """Thread CPU seconds to relay ``events`` and build the span's answer."""
    from lightning_harness.proxy.assemble import StreamAssembler
    from lightning_harness.proxy.sse import SSERelay

    t0 = time.thread_time()
    asm = StreamAssembler("chat")
    relay = SSERelay(asm.add, filters)
    for e in events:
        relay(e)
    relay(b"")
    asm.result()
    return time.thread_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--answers", type=int, default=1000, help="answers per path and setting")
    a = ap.parse_args()
    from lightning_harness.proxy import fastjson
    from lightning_harness.proxy.filters import make_model_restorer, make_stripper

    events = answer(a.tokens)
    strip, restore = make_stripper(token_ids=True, logprobs=True), make_model_restorer("gpt-4o")
    paths = {"token path (shipped)": [strip, restore],
             "parsing path": [lambda o: strip(o), lambda o: restore(o)]}
    junk = bytearray(8 << 20)
    zeros = bytes(len(junk[::64]))  # one byte of every cache line
    print(f"{a.tokens}-token answer, {len(events)} events, {sum(map(len, events))} bytes; "
          f"orjson: {fastjson.orjson is not None}; median of {a.answers} answers (thread CPU)")
    for setting in ("hot", "cold"):
        got = {}
        for name, filters in paths.items():
            times = []
            for _ in range(a.answers):
                if setting == "cold":
                    junk[::64] = zeros
                times.append(relay_once(events, filters))
            got[name] = statistics.median(times) * 1e6
            print(f"  {setting:4}  {name:22} {got[name]:8.1f} us an answer")
        token, parsing = got.values()
        print(f"  {setting:4}  token / parsing: {token / parsing:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
