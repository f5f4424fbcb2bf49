// An unmodified Node harness: the official `openai` npm package with its defaults (it reads
// OPENAI_BASE_URL and OPENAI_API_KEY from the environment). Node's fetch ignores HTTP(S)_PROXY,
// so the proxy sees it through OPENAI_BASE_URL (reverse mode).
// Usage: node openai_node.mjs MODEL [json|stream|tools]   -> prints one JSON line
import OpenAI from "openai";

const [model = "policy", how = "json"] = process.argv.slice(2);
const client = new OpenAI({ maxRetries: 0 });
const messages = [{ role: "user", content: "hello from node" }];
const out = { how, baseURL: client.baseURL };

if (how === "stream") {
  const stream = await client.chat.completions.create({
    model, messages, max_tokens: 4, stream: true, stream_options: { include_usage: true },
  });
  out.chunks = 0; out.content = ""; out.models = []; out.extra = [];
  for await (const chunk of stream) {
    out.chunks += 1;
    out.models.push(chunk.model);
    if (chunk.usage) out.usage = chunk.usage;
    if (chunk.prompt_token_ids != null) out.extra.push("prompt_token_ids");  // (null: as plain vLLM says)
    for (const ch of chunk.choices) {
      out.content += ch.delta?.content ?? "";
      if (ch.finish_reason) out.finish_reason = ch.finish_reason;
      if (ch.token_ids != null) out.extra.push("token_ids");
      if (ch.logprobs) out.extra.push("logprobs");
    }
  }
} else {
  const r = await client.chat.completions.create({ model, messages, max_tokens: 3 });
  out.content = r.choices[0].message.content;
  out.model = r.model;
  out.finish_reason = r.choices[0].finish_reason;
  out.logprobs = r.choices[0].logprobs ?? null;
  out.keys = Object.keys(r).concat(Object.keys(r.choices[0]));
  out.token_ids = [r.prompt_token_ids, r.choices[0].token_ids];  // undefined (left out) or null
  out.usage = r.usage;
}
console.log(JSON.stringify(out));
