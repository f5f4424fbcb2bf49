"""Turn OpenAI responses into span fields: assemble SSE chunks, extract token ids and logprobs.

Pure functions over JSON values; no mitmproxy. vLLM returns token ids as ``prompt_token_ids``
(top level for chat, per choice for completions) and ``choices[i].token_ids``; logprobs as
``choices[i].logprobs.content[j].logprob`` (chat) or ``choices[i].logprobs.token_logprobs``
(completions). Streams carry the same fields per chunk.
"""

from __future__ import annotations

from typing import Any

CHAT = "chat.completions"
COMPLETIONS = "completions"


def endpoint_of(path: str) -> str | None:
    """'chat.completions' / 'completions' for an OpenAI model-call path, else None."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/completions"):
        return COMPLETIONS
    return None


def _concat(dst: dict, key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):
        dst[key] = (dst.get(key) or "") + value
    elif isinstance(value, list):
        dst.setdefault(key, None)
        dst[key] = (dst[key] or []) + value
    else:
        dst[key] = value


class StreamAssembler:
    """Folds ``chat.completion.chunk`` / ``text_completion`` chunks into one completion object."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict | None = None
        self.prompt_token_ids: list | None = None
        self.chunks = 0

    def add(self, chunk: dict) -> None:
        self.chunks += 1
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in self.head:
                self.head[key] = chunk[key]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for ch in chunk.get("choices") or ():
            idx = ch.get("index", 0)
            acc = self.choices.get(idx)
            if acc is None:
                acc = self.choices[idx] = {"index": idx}
            if ch.get("finish_reason") is not None:
                acc["finish_reason"] = ch["finish_reason"]
            if ch.get("stop_reason") is not None:
                acc["stop_reason"] = ch["stop_reason"]
            if ch.get("token_ids") is not None:
                acc["token_ids"] = (acc.get("token_ids") or []) + list(ch["token_ids"])
            if ch.get("prompt_token_ids") is not None and "prompt_token_ids" not in acc:
                acc["prompt_token_ids"] = ch["prompt_token_ids"]
            lp = ch.get("logprobs")
            if lp:
                self._add_logprobs(acc, lp)
            if self.endpoint == CHAT:
                self._add_delta(acc, ch.get("delta") or {})
            else:
                _concat(acc, "text", ch.get("text"))

    def _add_logprobs(self, acc: dict, lp: dict) -> None:
        dst = acc.setdefault("logprobs", {})
        for key, value in lp.items():
            if isinstance(value, list):
                dst[key] = (dst.get(key) or []) + value
            elif key not in dst:
                dst[key] = value

    def _add_delta(self, acc: dict, delta: dict) -> None:
        msg = acc.setdefault("message", {"role": "assistant", "content": None})
        for key, value in delta.items():
            if key == "role":
                msg["role"] = value or msg["role"]
            elif key == "tool_calls" and value:
                calls = msg.setdefault("tool_calls", [])
                for tc in value:
                    i = tc.get("index", len(calls))
                    while len(calls) <= i:
                        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    dst = calls[i]
                    if tc.get("id"):
                        dst["id"] = tc["id"]
                    if tc.get("type"):
                        dst["type"] = tc["type"]
                    fn = tc.get("function") or {}
                    if fn.get("name"):
                        dst["function"]["name"] += fn["name"]
                    if fn.get("arguments"):
                        dst["function"]["arguments"] += fn["arguments"]
            elif isinstance(value, str):
                msg[key] = (msg.get(key) or "") + value
            elif value is not None:
                msg[key] = value

    def result(self) -> dict:
        obj: dict[str, Any] = dict(self.head)
        obj["object"] = "chat.completion" if self.endpoint == CHAT else "text_completion"
        obj["choices"] = [self.choices[i] for i in sorted(self.choices)]
        if self.prompt_token_ids is not None:
            obj["prompt_token_ids"] = self.prompt_token_ids
        if self.usage is not None:
            obj["usage"] = self.usage
        return obj


def token_fields(obj: dict | None, endpoint: str | None) -> dict[str, Any]:
    """Span fields derived from a (possibly assembled) completion object."""
    out: dict[str, Any] = {
        "prompt_token_ids": None,
        "response_token_ids": None,
        "response_logprobs": None,
        "finish_reason": None,
        "n_choices": None,
        "prompt_tokens": None,
        "completion_tokens": None,
    }
    if not isinstance(obj, dict):
        return out
    choices = obj.get("choices") or []
    out["n_choices"] = len(choices) if isinstance(choices, list) else None
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt = obj.get("prompt_token_ids")
    if prompt is None:
        prompt = first.get("prompt_token_ids")
    out["prompt_token_ids"] = _ints(prompt)
    out["response_token_ids"] = _ints(first.get("token_ids"))
    out["finish_reason"] = first.get("finish_reason")
    lp = first.get("logprobs")
    if isinstance(lp, dict):
        if isinstance(lp.get("content"), list):
            out["response_logprobs"] = _floats([c.get("logprob") for c in lp["content"] if isinstance(c, dict)])
        elif isinstance(lp.get("token_logprobs"), list):
            out["response_logprobs"] = _floats(lp["token_logprobs"])
    usage = obj.get("usage")
    if isinstance(usage, dict):
        out["prompt_tokens"] = usage.get("prompt_tokens")
        out["completion_tokens"] = usage.get("completion_tokens")
    if out["prompt_tokens"] is None and out["prompt_token_ids"] is not None:
        out["prompt_tokens"] = len(out["prompt_token_ids"])
    if out["completion_tokens"] is None and out["response_token_ids"] is not None and len(choices) == 1:
        out["completion_tokens"] = len(out["response_token_ids"])
    return out


def _ints(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        return None


def _floats(value: list) -> list[float] | None:
    try:
        # -inf / None logprobs (vLLM can emit them for impossible tokens) are kept as -inf / NaN
        return [float("nan") if v is None else float(v) for v in value]
    except (TypeError, ValueError):
        return None
