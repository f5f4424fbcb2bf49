#!/usr/bin/env python
"""What long streamed answers cost the proxy while in flight: chat logprob entries held by the stream
assembler, packed (``assemble._Packed``, as shipped) against plain lists (never packed), same run.

Each variant runs in its own process (its own heap and collector): ``--streams`` assemblers each fed
``--tokens`` vLLM-shaped chat chunks (one token each, logprobs with ``bytes`` and ``top_logprobs``, as
vLLM streams them), all held at once as a proxy holds streams in flight. It prints the bytes a token
holds (tracemalloc), the objects a token leaves for the collector to walk, how long one full collection
takes with all of them held (every stream and call waits meanwhile: the proxy has one event loop), the
CPU of feeding a token and of ``result()`` at a stream's end, and the ratios packed/plain.

    .venv-proxy/bin/python scripts/bench_assembly.py                      # 64 streams x 13,000 tokens
    .venv-proxy/bin/python scripts/bench_assembly.py --streams 8 --tokens 4000
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def chunk(i: int) -> bytes:
    tok = f" w{i}"
    return json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": tok},
                     "logprobs": {"content": [{"token": tok, "logprob": -0.1 * (i % 7), "bytes": list(tok.encode()),
                                               "top_logprobs": []}]},
                     "finish_reason": None, "stop_reason": None, "token_ids": [1000 + i]}]},
        separators=(",", ":")).encode()


def measure(variant: str, streams: int, tokens: int) -> dict:
    """One variant, in this process: the figures of ``streams`` assemblers of ``tokens`` tokens."""
    from lightning_harness.proxy import assemble, fastjson

    if variant == "plain":
        assemble._Packed.PACK_AT = 1 << 62
    raw = [chunk(i) for i in range(tokens)]
    loads = fastjson.orjson.loads if fastjson.orjson is not None else json.loads

    def feed() -> list:
        held = []
        for _ in range(streams):
            asm = assemble.StreamAssembler(assemble.CHAT)
            for r in raw:
                asm.add(loads(r))
            held.append(asm)
        return held

    gc.collect()
    base = len(gc.get_objects())
    t = time.process_time()
    held = feed()
    add_us = (time.process_time() - t) / (streams * tokens) * 1e6
    gc.collect()
    tracked = (len(gc.get_objects()) - base) / (streams * tokens)
    full = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        full.append(time.perf_counter() - t)
    t = time.process_time()
    for asm in held[:4]:
        asm.result()
    result_ms = (time.process_time() - t) / min(4, streams) * 1e3
    del held
    gc.collect()
    tracemalloc.start()
    held = feed()
    size = tracemalloc.get_traced_memory()[0] / (streams * tokens)  # (while held)
    tracemalloc.stop()
    del held
    return {"bytes/token": size, "tracked objects/token": tracked, "full collection s": min(full),
            "feed us/token": add_us, "result() ms/stream": result_ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=13000)
    ap.add_argument("--variant", choices=["packed", "plain"], help=argparse.SUPPRESS)  # (one child's run)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(measure(a.variant, a.streams, a.tokens)))
        return 0
    got = {}
    for variant in ("plain", "packed"):
        print(f"{variant}: {a.streams} streams x {a.tokens:,} tokens ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--streams", str(a.streams),
                              "--tokens", str(a.tokens)], capture_output=True, text=True, check=True, cwd=ROOT)
        got[variant] = json.loads(out.stdout)
    print(f"{a.streams} streams x {a.tokens:,} tokens in flight ({a.streams * a.tokens:,} tokens)")
    print(f"{'':24} {'plain':>10} {'packed':>10} {'packed/plain':>13}")
    for key in got["plain"]:
        p, q = got["plain"][key], got["packed"][key]
        print(f"{key:24} {p:10.3f} {q:10.3f} {q / p if p else float('nan'):13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
