"""A harness written for a hosted provider: the official `openai` client with an explicit https
base URL and the provider's model name (what a user would put in a config file); proxy and CA come
from the environment only.

Usage: python openai_hosted.py BASE_URL MODEL json|stream|tools|tools-stream
Prints one JSON line with what the harness saw.
"""

import json
import sys

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def main() -> None:
    base_url, model, how = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: dict = {"model": model, "messages": messages, "max_tokens": 4}
    if how.startswith("tools"):
        kw.update(tools=TOOLS, tool_choice="auto")
    out: dict = {"how": how}
    if how.endswith("stream"):
        kw.update(stream=True, stream_options={"include_usage": True})
        models, content, calls, usage, finish, extra = [], "", {}, None, None, set()
        for chunk in client.chat.completions.create(**kw):
            models.append(chunk.model)
            if (chunk.model_extra or {}).get("prompt_token_ids") is not None:
                extra.add("prompt_token_ids")  # an injected field leaked to the harness
            usage = chunk.usage.model_dump() if chunk.usage else usage
            for ch in chunk.choices:
                if (ch.model_extra or {}).get("token_ids") is not None:
                    extra.add("token_ids")
                if ch.logprobs is not None:
                    extra.add("logprobs")
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or ():
                    c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    if tc.function:
                        c["name"] += tc.function.name or ""
                        c["arguments"] += tc.function.arguments or ""
        out.update(models=sorted(set(models)), content=content, tool_calls=[calls[i] for i in sorted(calls)],
                   usage=usage, finish_reason=finish, extra=sorted(extra))
    else:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        out.update(model=r.model, content=msg.content, finish_reason=r.choices[0].finish_reason,
                   tool_calls=[{"id": t.id, "name": t.function.name,
                                "arguments": t.function.arguments} for t in msg.tool_calls or ()],
                   logprobs=r.choices[0].logprobs,
                   extra=sorted(set(r.model_extra or {}) | set(r.choices[0].model_extra or {})))
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
