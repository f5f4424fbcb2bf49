"""An app written with the OpenAI Agents SDK, unmodified: an Agent run by the Runner, once to
completion and once streamed. It reads only its environment (OPENAI_BASE_URL / proxy variables /
CA bundle / OPENAI_API_KEY), as any deployment would configure it. Prints one JSON line."""

import asyncio
import json
import sys

from agents import Agent, Runner


async def main(model: str) -> dict:
    agent = Agent(name="calc", instructions="Answer briefly.", model=model)
    done = await Runner.run(agent, "What is 2+3?")
    streamed = Runner.run_streamed(agent, "What is 4+4?")
    deltas = []
    async for event in streamed.stream_events():
        if event.type == "raw_response_event" and getattr(event.data, "type", "") == "response.output_text.delta":
            deltas.append(event.data.delta)
    return {"final": done.final_output, "streamed_final": streamed.final_output, "deltas": "".join(deltas),
            "output_tokens": [r.usage.output_tokens for r in done.raw_responses]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
