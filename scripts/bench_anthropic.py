"""Cost of answering a streamed call in the Messages format: the chat-completions SSE relay alone
(what a chat call pays) against the same relay wrapped by the Messages event translation, on one
stream of N vLLM-like chunks (token ids and logprobs injected, stripped by the relay's filter).
Prints microseconds per chunk for both and their ratio, measured in the same run.

    .venv/bin/python scripts/bench_anthropic.py [--chunks 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time

from lightning_harness.proxy.anthropic import EventStream, EventTranslator
from lightning_harness.proxy.assemble import CHAT, assembler_for
from lightning_harness.proxy.filters import make_stripper
from lightning_harness.proxy.sse import SSERelay


def stream_bytes(n: int) -> list[bytes]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "prompt_token_ids": list(range(200))}
    out = [b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                              "content": ""}}]}).encode() + b"\n\n"]
    for i in range(n):
        ch = {"index": 0, "delta": {"content": f" w{i}"}, "token_ids": [i],
              "finish_reason": "length" if i == n - 1 else None,
              "logprobs": {"content": [{"token": f" w{i}", "logprob": -0.5, "bytes": None, "top_logprobs": []}]}}
        out.append(b"data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
                                           "choices": [ch], "usage": {"prompt_tokens": 200,
                                                                      "completion_tokens": i + 1}}).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def run(chunks: list[bytes], translate: bool) -> float:
    relay = SSERelay(assembler_for(CHAT).add, [make_stripper(True, True)])
    fn = EventStream(relay, EventTranslator("claude")) if translate else relay
    t0 = time.process_time()
    for c in chunks:
        fn(c)
    fn(b"")
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    chunks = stream_bytes(a.chunks)
    chat = min(run(chunks, False) for _ in range(a.repeat))
    messages = min(run(chunks, True) for _ in range(a.repeat))
    per = 1e6 / len(chunks)
    print(json.dumps({"chunks": len(chunks), "chat_relay_us_per_chunk": round(chat * per, 2),
                      "messages_relay_us_per_chunk": round(messages * per, 2), "ratio": round(messages / chat, 2)}))


if __name__ == "__main__":
    main()
