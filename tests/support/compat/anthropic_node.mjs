// An unmodified Node harness: the official `@anthropic-ai/sdk` npm package with its defaults (it
// reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment). Node's fetch ignores
// HTTP(S)_PROXY, so the proxy sees it through ANTHROPIC_BASE_URL (reverse mode).
// Usage: node anthropic_node.mjs MODEL [json|stream|tools]   -> prints one JSON line
import Anthropic from "@anthropic-ai/sdk";

const [model = "claude-hosted", how = "json"] = process.argv.slice(2);
const client = new Anthropic({ maxRetries: 0 });
const messages = [{ role: "user", content: "hello from node" }];
const tools = [{ name: "get_weather", description: "Weather of a city",
                 input_schema: { type: "object", properties: { arg: { type: "string" } }, required: ["arg"] } }];
const out = { how, baseURL: client.baseURL };

if (how === "stream") {
  const stream = client.messages.stream({ model, messages, max_tokens: 4, system: "be brief" });
  out.events = [];
  for await (const event of stream) out.events.push(event.type);
  const msg = await stream.finalMessage();
  Object.assign(out, { content: msg.content, model: msg.model, stop_reason: msg.stop_reason, usage: msg.usage });
} else {
  const extra = how === "tools" ? { tools, tool_choice: { type: "auto" } } : {};
  const msg = await client.messages.create({ model, messages, max_tokens: 4, ...extra });
  Object.assign(out, { content: msg.content, model: msg.model, stop_reason: msg.stop_reason, usage: msg.usage,
                       keys: Object.keys(msg) });
}
console.log(JSON.stringify(out));
