"""Sample building from hand-built traces whose correct samples are written down here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fixtures_traces import TINY_CHAT_TEMPLATE, chat_bodies, rollout, span, tiny_ids

from lightning_harness.schemas import SAMPLES
from lightning_harness.trainer.samples import build_samples


def _by_id(table):
    return {r["sample_id"]: r for r in table.to_pylist()}


def _approx_list(xs, ys):
    assert len(xs) == len(ys), (xs, ys)
    for x, y in zip(xs, ys):
        assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, abs=1e-6), (xs, ys)


def test_continuous_history_merges_into_one_sample(make_traces):
    d = make_traces(
        spans=[
            span("r1", 0, [1, 2, 3], [10, 11]),
            span("r1", 1, [1, 2, 3, 10, 11, 20, 21], [12]),
            span("r1", 2, [1, 2, 3, 10, 11, 20, 21, 12, 22], [13, 14], model_version=1),
        ],
        rollouts=[rollout("r1", reward=1.0), rollout("r0", reward=0.0)],
    )
    table, stats = build_samples(d)
    assert table.schema == SAMPLES
    assert table.num_rows == 1
    s = table.to_pylist()[0]
    assert s["sample_id"] == "r1~0~0"
    assert s["prompt_token_ids"] == [1, 2, 3]
    assert s["response_token_ids"] == [10, 11, 20, 21, 12, 22, 13, 14]
    assert s["response_mask"] == [1, 1, 0, 0, 1, 0, 1, 1]
    _approx_list(s["response_logprobs"], [-1.0, -1.01, 0.0, 0.0, -2.0, 0.0, -3.0, -3.01])
    assert (s["n_calls"], s["merged"], s["break_reason"], s["retokenized"]) == (3, True, None, False)
    assert (s["model_version_min"], s["model_version_max"]) == (0, 1)
    assert len(s["span_ids"]) == 3
    # r0 has a reward but no spans: it still counts in the group statistics
    assert s["advantage"] == pytest.approx((1.0 - 0.5) / (math.sqrt(0.5) + 1e-6), rel=1e-6)
    assert s["loss_weight"] == pytest.approx(1 / 5)
    assert stats["samples"] == 1 and stats["single_sample_rollout_share"] == 1.0
    assert stats["calls_continuing_history"] == 2
    assert stats["context_tokens"] == 3 and stats["model_tokens"] == 5


@pytest.mark.parametrize(
    "calls, reason",
    [
        # prompt keeps the previous prompt, differs inside the previous response
        ([([1, 2, 3], [10, 11], "stop"), ([1, 2, 3, 10, 99, 20], [12], "stop")], "retokenization"),
        # diverges inside the previous prompt, same conversation, not shorter
        ([([1, 2, 3, 4], [10], "stop"), ([1, 2, 3, 7, 10, 20], [12], "stop")], "template_change"),
        # shorter than the history, shares the opening: old turns dropped
        ([([1, 2, 3, 4, 5, 6], [10, 11], "stop"), ([1, 2, 3, 4, 20], [12], "stop")], "truncation"),
        # previous response was cut by the length limit
        ([([1, 2], [10, 11], "length"), ([1, 2, 10, 12, 20], [13], "stop")], "truncation"),
        # a different conversation
        ([([1, 2, 3, 4], [10], "stop"), ([50, 51], [12], "stop")], "other"),
    ],
)
def test_broken_prefix_starts_new_sample_with_reason(make_traces, calls, reason):
    spans = [span("r", i, p, r, finish_reason=f) for i, (p, r, f) in enumerate(calls)]
    d = make_traces(spans=spans, rollouts=[rollout("r", reward=1.0)])
    table, stats = build_samples(d)
    rows = _by_id(table)
    assert list(rows) == ["r~0~0", "r~0~1"]
    assert rows["r~0~0"]["break_reason"] is None
    second = rows["r~0~1"]
    assert second["break_reason"] == reason
    assert second["prompt_token_ids"] == calls[1][0]
    assert second["response_token_ids"] == calls[1][1]
    assert second["response_mask"] == [1] * len(calls[1][1])
    assert stats["breaks"][reason] == 1 and sum(stats["breaks"].values()) == 1
    assert stats["samples_per_rollout"] == 2.0 and stats["single_sample_rollout_share"] == 0.0


def test_merging_resumes_after_a_break_and_transition_mode(make_traces):
    spans = [
        span("r", 0, [1, 2, 3], [10, 11]),
        span("r", 1, [1, 2, 3, 10, 99, 20], [12]),       # retokenised history: new sample
        span("r", 2, [1, 2, 3, 10, 99, 20, 12, 30], [13]),  # continues the new sample
    ]
    d = make_traces(spans=spans, rollouts=[rollout("r", reward=1.0)])
    table, _ = build_samples(d)
    rows = _by_id(table)
    assert rows["r~0~1"]["response_token_ids"] == [12, 30, 13]
    assert rows["r~0~1"]["response_mask"] == [1, 0, 1]
    assert rows["r~0~1"]["n_calls"] == 2
    # per-rollout weights: 2 + 2 model tokens in the rollout
    assert [r["loss_weight"] for r in rows.values()] == [0.25, 0.25]

    table, stats = build_samples(d, mode="transition")
    rows = table.to_pylist()
    assert [r["prompt_token_ids"] for r in rows] == [s["prompt_token_ids"] for s in spans]
    assert [r["response_token_ids"] for r in rows] == [s["response_token_ids"] for s in spans]
    assert all(r["break_reason"] is None and r["n_calls"] == 1 and not r["merged"] for r in rows)
    assert all(set(r["response_mask"]) == {1} for r in rows)
    assert stats["samples"] == 3


def test_retokenised_call_merges_and_is_flagged(make_traces, tiny_tokenizer_dir):
    p0 = tiny_ids("<|im_start|>", "user", "hello", "<|im_end|>", "<|im_start|>", "assistant")
    r0 = tiny_ids("hi", "there", "<|im_end|>")
    msgs = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "what is two plus three"},
    ]
    d = make_traces(
        spans=[
            span("r", 0, p0, r0),
            span("r", 1, None, None, logprobs=None,
                 **chat_bodies(msgs, "five", logprobs=[-0.5, -0.25], tokens=["five", "<|im_end|>"])),
        ],
        rollouts=[rollout("r", reward=1.0)],
    )
    table, stats = build_samples(d, tokenizer=str(tiny_tokenizer_dir))
    assert table.num_rows == 1
    s = table.to_pylist()[0]
    inserted = tiny_ids("<|im_start|>", "user", "what", "is", "two", "plus", "three", "<|im_end|>", "<|im_start|>",
                        "assistant")
    assert s["prompt_token_ids"] == p0
    assert s["response_token_ids"] == r0 + inserted + tiny_ids("five", "<|im_end|>")
    assert s["response_mask"] == [1] * 3 + [0] * len(inserted) + [1, 1]
    _approx_list(s["response_logprobs"], [-1.0, -1.01, -1.02] + [0.0] * len(inserted) + [-0.5, -0.25])
    assert s["retokenized"] is True and s["n_calls"] == 2
    assert stats["retokenized_calls"] == 1 and stats["calls_without_token_ids"] == 1

    # without a tokenizer the call is dropped and said so; the rest still builds
    table, stats = build_samples(d)
    assert table.num_rows == 1 and table.to_pylist()[0]["response_token_ids"] == r0
    assert stats["calls_dropped_no_token_ids"] == 1 and stats["retokenized_calls"] == 0


def test_retokenised_without_logprobs_gets_nan_not_zero(make_traces, tiny_tokenizer_dir):
    msgs = [{"role": "user", "content": "hello"}]
    d = make_traces(spans=[span("r", 0, None, None, logprobs=None, **chat_bodies(msgs, "hi"))],
                    rollouts=[rollout("r", reward=1.0)])
    s = build_samples(d, tokenizer=str(tiny_tokenizer_dir))[0].to_pylist()[0]
    assert s["response_token_ids"] == tiny_ids("hi", "<|im_end|>")
    assert all(math.isnan(x) for x in s["response_logprobs"])


def test_drift_between_returned_and_retokenised_ids_is_counted(make_traces, tiny_tokenizer_dir):
    msgs = [{"role": "user", "content": "hello"}]
    p = tiny_ids("<|im_start|>", "user", "hello", "<|im_end|>", "<|im_start|>", "assistant")
    d = make_traces(
        spans=[
            span("a", 0, p, tiny_ids("hi", "<|im_end|>"), **chat_bodies(msgs, "hi")),  # agrees
            span("b", 0, p, tiny_ids("hi", "hi", "<|im_end|>"), **chat_bodies(msgs, "hi")),  # response drifts
        ],
        rollouts=[rollout("a", reward=1.0), rollout("b", reward=0.0)],
    )
    _, stats = build_samples(d, tokenizer=str(tiny_tokenizer_dir))
    assert (stats["drift_checked"], stats["drift_prompt"], stats["drift_response"]) == (2, 0, 1)


def test_failed_calls_are_not_trained_on(make_traces):
    d = make_traces(
        spans=[
            span("r", 0, [1, 2], [10]),
            span("r", 1, [1, 2, 10, 5], None, error_kind="upstream_status"),
            span("r", 2, [1, 2, 10, 5], [11]),
        ],
        rollouts=[rollout("r", reward=1.0)],
    )
    table, stats = build_samples(d)
    s = table.to_pylist()[0]
    assert s["response_token_ids"] == [10, 5, 11] and s["response_mask"] == [1, 0, 1]
    assert stats["calls_error"] == 1 and table.num_rows == 1


def test_limits_drop_long_prompts_and_truncate_responses(make_traces):
    spans = [
        span("r", 0, [1, 2, 3], [10, 11]),
        span("r", 1, [1, 2, 3, 10, 11, 20, 21], [12]),
        span("r", 2, [1, 2, 3, 10, 11, 20, 21, 12, 22], [13, 14]),
        span("q", 0, [1, 2, 3, 4, 5, 6], [7]),
        span("q", 1, [9], [8, 8]),
    ]
    d = make_traces(spans=spans, rollouts=[rollout("r", reward=1.0), rollout("q", reward=0.0)])
    table, stats = build_samples(d, max_response_len=4, max_prompt_len=5)
    rows = _by_id(table)
    assert sorted(rows) == ["q~0~1", "r~0~0"]
    r = rows["r~0~0"]
    assert r["response_token_ids"] == [10, 11, 20, 21] and r["response_mask"] == [1, 1, 0, 0]
    assert r["response_truncated"] is True and len(r["response_logprobs"]) == 4
    assert r["loss_weight"] == pytest.approx(0.5)  # 2 model tokens left in rollout r
    assert rows["q~0~1"]["loss_weight"] == pytest.approx(0.5)  # q keeps 2 model tokens
    assert stats["samples_dropped_prompt_too_long"] == 1
    assert stats["samples_truncated"] == 1 and stats["truncated_model_tokens"] == 3


def test_empty_traces_give_an_empty_table(tmp_path):
    table, stats = build_samples(tmp_path)
    assert table.num_rows == 0 and table.schema == SAMPLES
    assert stats["samples"] == 0


def test_bad_arguments_fail_clearly(make_traces):
    d = make_traces(spans=[span("r", 0, [1], [2])], rollouts=[rollout("r", reward=1.0)])
    with pytest.raises(ValueError, match="mode"):
        build_samples(d, mode="sequence")
    with pytest.raises(ValueError, match="failed_reward"):
        build_samples(d, failed_policy="penalize")
    with pytest.raises(ValueError, match="group_by"):
        build_samples(d, group_by="no_such_column")
    with pytest.raises(FileNotFoundError):
        build_samples(d / "missing")


def test_a_token_list_with_a_null_element_counts_as_missing(make_traces):
    """A list with a hole (a value lost on the way) is no list: its call counts as without token ids
    (dropped, as no tokenizer is given) or without logprobs, never trained on a made-up token."""
    import pyarrow as pa

    from lightning_harness.schemas import TABLES, PartWriter

    d = make_traces(spans=[span("b", 0, [1, 2], [9])], rollouts=[rollout(r, reward=float(r == "b")) for r in "abcp"])
    holed = [span("a", 0, [1, 2], [5, None, 7]), span("p", 0, [1, None], [8]),  # written as is: no salvage
             span("c", 0, [1, 2], [5, 6], logprobs=[-0.5, None])]
    PartWriter(d, "spans", background=False).write_table(pa.Table.from_pylist(holed, schema=TABLES["spans"]))
    table, stats = build_samples(d)
    rows = {r["rollout_id"]: r for r in table.to_pylist()}
    assert not any(None in r[k] or -(2**31) in r[k] for r in rows.values()
                   for k in ("prompt_token_ids", "response_token_ids"))
    assert sorted(rows) == ["b", "c"]
    assert stats["calls_without_token_ids"] == stats["calls_dropped_no_token_ids"] == 2
    assert rows["c"]["response_token_ids"] == [5, 6] and all(map(math.isnan, rows["c"]["response_logprobs"]))
    assert stats["calls_without_logprobs"] == 1


def test_a_prefill_call_is_retokenised_as_the_engine_continued_it(tiny_tokenizer_dir):
    """A Messages call whose last message is the assistant's (a prefill) goes upstream with
    continue_final_message: the prompt ends inside the assistant turn and the answer continues it.
    Rendered with a generation prompt instead, the prompt closed the prefill's turn and opened another."""
    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import retokenize

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    request = {"model": "policy", "max_tokens": 4,
               "messages": [{"role": "user", "content": "what is two plus three"},
                            {"role": "assistant", "content": "answer"}]}
    answer = {"id": "x", "object": "chat.completion",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": " five"}, "finish_reason": "stop"}]}
    prompt, response, _ = retokenize(tok, json.dumps(request), json.dumps(answer), "messages")
    assert prompt == tiny_ids("<|im_start|>", "user", "what", "is", "two", "plus", "three", "<|im_end|>",
                              "<|im_start|>", "assistant", "answer")
    assert response == tiny_ids("five", "<|im_end|>")
    # a chat call's own flag, read as vLLM reads it: "true" continues the turn, "false" does not
    chat = {**request, "add_generation_prompt": False}
    assert retokenize(tok, json.dumps({**chat, "continue_final_message": "true"}), json.dumps(answer)) \
        == (prompt, response, None)
    with pytest.raises(ValueError, match="add_generation_prompt: false"):  # before the fix: read as a prefill
        retokenize(tok, json.dumps({**chat, "continue_final_message": "false"}), json.dumps(answer))


def test_a_call_is_retokenised_with_its_chat_template_kwargs(tiny_tokenizer_dir):
    """vLLM renders a chat call's prompt with the request's ``chat_template_kwargs`` (Qwen's
    ``enable_thinking: false`` adds an empty think block): rendered without them, the rebuilt prompt
    was not the one the engine saw. Keys that would change how the rebuild renders are ignored."""
    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import retokenize

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant"
                         "{% if enable_thinking is defined and not enable_thinking %} five{% endif %}{% endif %}")
    answer = {"id": "x", "object": "chat.completion",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "two"}, "finish_reason": "stop"}]}
    request = {"model": "policy", "messages": [{"role": "user", "content": "three"}]}
    plain, _, _ = retokenize(tok, json.dumps(request), json.dumps(answer))
    thinking_off = {**request, "chat_template_kwargs": {"enable_thinking": False, "tokenize": True,
                                                         "add_generation_prompt": False}}
    prompt, _, _ = retokenize(tok, json.dumps(thinking_off), json.dumps(answer))
    assert prompt == plain + tiny_ids("five")  # before the fix: equal to plain


def test_retokenising_an_echoed_completion_keeps_only_the_generated_text(tiny_tokenizer_dir):
    """A completions call with echo (sent without token ids: vLLM would blank the echo) has the prompt
    at the start of its text; rebuilt as it was, the prompt counted as generated tokens. A chat call
    with include_reasoning: false hid reasoning the model generated: it cannot be rebuilt."""
    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import retokenize

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    answer = {"object": "text_completion", "choices": [{"index": 0, "text": "two plus five", "finish_reason": "stop"}]}
    _, plain, _ = retokenize(tok, json.dumps({"prompt": "two plus", "max_tokens": 2}),
                             json.dumps({**answer, "choices": [{"index": 0, "text": " five"}]}))
    _, echoed, _ = retokenize(tok, json.dumps({"prompt": "two plus", "echo": True}), json.dumps(answer))
    assert echoed == plain == tiny_ids("five")  # before the fix: "two plus five"
    _, echo_off, _ = retokenize(tok, json.dumps({"prompt": "two plus", "echo": "false"}),
                                json.dumps({**answer, "choices": [{"index": 0, "text": " five"}]}))
    assert echo_off == plain  # (read as vLLM reads it; before: the prompt looked for, the call dropped)
    for hidden in (False, "false", 0, "off"):  # read as vLLM reads it
        with pytest.raises(ValueError, match="include_reasoning"):
            retokenize(tok, json.dumps({"messages": [{"role": "user", "content": "two"}], "include_reasoning": hidden}),
                       json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "three"}}]}))


SWE_MODEL = Path(__file__).resolve().parent.parent / "examples" / "swe" / "model"  # a byte-level BPE tokenizer


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace: a word's leading space is its piece's ``▁``), whose
    decode of one token drops that space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "a", "\u2581a", "b", "\u2581b", "\u2581", "\u2581\u2581b"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.mark.parametrize("which", ["byte-level", "metaspace"])
def test_a_token_is_spelled_as_vllm_spells_it_in_its_logprob_entries(which):
    """The builder keeps a retokenised call's logprobs only where each entry names its rebuilt token,
    which it reads as vLLM writes it: checked against vLLM's own function on every token of both
    kinds of tokenizer (a SentencePiece decode drops a leading space vLLM gives back)."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    from lightning_harness.trainer.samples import _as_vllm_spells

    tok = AutoTokenizer.from_pretrained(str(SWE_MODEL)) if which == "byte-level" else _metaspace_tokenizer()
    ids = list(range(min(len(tok), 2000)))
    assert [_as_vllm_spells(tok, i) for i in ids] == convert_ids_list_to_tokens(tok, ids)
    if which == "metaspace":
        assert _as_vllm_spells(tok, 5) == " b" and _as_vllm_spells(tok, 7) == "  b" and _as_vllm_spells(tok, 4) == "b"


def test_logprobs_of_tokens_that_spell_the_same_text_otherwise_are_not_kept():
    """The engine generated 'a', '    ' (four spaces), 'b'; the text rebuilds as 'a', '   ', ' b': the
    same text, other tokens. Compared without their whitespace every entry matched, and the logprob
    of 'b' went onto ' b'. Entries that spell the rebuilt tokens keep theirs."""
    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import retokenize

    tok = AutoTokenizer.from_pretrained(str(SWE_MODEL))
    generated = [tok.convert_tokens_to_ids(t) for t in ("a", "\u0120\u0120\u0120\u0120", "b")] + [tok.eos_token_id]
    assert tok.decode(generated[:3]) == "a    b"
    lps = [-0.1, -0.2, -0.3, -0.4]
    body = chat_bodies([{"role": "user", "content": "hi"}], "a    b", logprobs=lps,
                       tokens=[tok.decode([i]) for i in generated])
    _, response, kept = retokenize(tok, body["request_json"], body["response_json"])
    assert response != generated and tok.decode(response[:3]) == "a    b"
    assert kept is None  # before the fix: [-0.1, -0.2, -0.3, -0.4], on other tokens
    body = chat_bodies([{"role": "user", "content": "hi"}], "a    b", logprobs=lps,
                       tokens=[tok.decode([i]) for i in response])
    assert retokenize(tok, body["request_json"], body["response_json"])[2] == lps


def test_a_completions_prompt_is_read_as_the_engine_reads_it(tiny_tokenizer_dir):
    """vLLM reads a list of strings as text prompts (a batch; the first choice is the first's), never
    as numbers: ``["12"]`` was rebuilt as the token id 12. What is neither text nor ids is refused."""
    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import retokenize

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    answer = json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": " five"}]})
    text = tiny_ids("two", "plus", "three")
    for prompt, want in [("two plus three", text), (["two plus three"], text), (["two plus three", "hello"], text),
                         ([[12, 13, 14]], [12, 13, 14]), ([12, 13, 14], [12, 13, 14]), (["12"], tiny_ids("[UNK]"))]:
        assert retokenize(tok, json.dumps({"prompt": prompt}), answer)[0] == want, prompt
    for prompt in ([12, "13"], [1.5], {"a": 1}, [True]):
        with pytest.raises(ValueError, match="neither text nor token ids"):
            retokenize(tok, json.dumps({"prompt": prompt}), answer)


def test_a_chat_call_without_the_generation_prompt_is_not_rebuilt(make_traces, tiny_tokenizer_dir):
    """With ``add_generation_prompt: false`` vLLM renders no assistant header: the model writes it, and
    its answer's text does not show it. Rebuilt with the header, the answer was trained on a context
    the engine never saw; the call is dropped and counted instead."""
    body = chat_bodies([{"role": "user", "content": "hello"}], "hi")
    request = json.loads(body["request_json"])
    d = make_traces(spans=[span("r", 0, None, None, logprobs=None,
                                **{**body, "request_json": json.dumps({**request, "add_generation_prompt": False})}),
                           span("s", 0, None, None, logprobs=None, **body),
                           span("t", 0, None, None, logprobs=None,  # read as vLLM reads it: true
                                **{**body, "request_json": json.dumps({**request, "add_generation_prompt": "true"})})],
                    rollouts=[rollout("r", reward=1.0), rollout("s", reward=0.0), rollout("t", reward=0.0)])
    table, stats = build_samples(d, tokenizer=str(tiny_tokenizer_dir))
    assert sorted(r["rollout_id"] for r in table.to_pylist()) == ["s", "t"]
    assert stats["retokenize_failed"] == 1


def test_a_call_with_an_empty_prompt_is_dropped_not_the_step(make_traces):
    """No engine serves an empty prompt, yet a span may say so: its sample made the update refuse the
    whole table ("empty prompt_token_ids"), stopping the loop. Such a call counts as one without token
    ids: dropped and counted."""
    from lightning_harness.trainer.update import table_to_samples

    d = make_traces(spans=[span("a", 0, [], [5, 6]), span("b", 0, [1], [2])],
                    rollouts=[rollout("a", reward=1.0), rollout("b", reward=0.0)])
    table, stats = build_samples(d)
    assert [r["rollout_id"] for r in table.to_pylist()] == ["b"] and stats["calls_dropped_no_token_ids"] == 1
    samples, _ = table_to_samples(table, None)
    assert [s.rollout_id for s in samples] == ["b~0"]


def test_a_rebuilt_prompt_renders_developer_messages_and_text_parts_as_vllm_does(tiny_tokenizer_dir):
    """vLLM 0.32 renders a ``developer`` message (the OpenAI SDK's, Codex's) for a template that never
    names that role as a system message, every system message merged into one at the start; the
    rebuilt prompt kept a ``developer`` turn (or, with a Qwen-style template, lost its text). A
    completions prompt gets the tokenizer's BOS as vLLM encodes it (add_special_tokens defaults to
    true there); parts vLLM reads as text (refusal) or as a tool's name (tool_reference) are read so."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from lightning_harness.trainer.samples import _engine_message, retokenize

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    answer = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "five"}}]})
    request = {"messages": [{"role": "system", "content": "two"}, {"role": "user", "content": "what"},
                            {"role": "developer", "content": [{"type": "text", "text": "three"}]}]}
    prompt, _, _ = retokenize(tok, json.dumps(request), answer)
    assert prompt == tiny_ids("<|im_start|>", "system", "two", "three", "<|im_end|>", "<|im_start|>", "user", "what",
                              "<|im_end|>", "<|im_start|>", "assistant")  # before: a developer turn, [UNK]
    tok.chat_template = TINY_CHAT_TEMPLATE.replace("m['role']", "'system' if m['role'] == 'developer' else m['role']")
    assert retokenize(tok, json.dumps(request), answer)[0] == tiny_ids(  # a template naming the role: as it is
        "<|im_start|>", "system", "two", "<|im_end|>", "<|im_start|>", "user", "what", "<|im_end|>",
        "<|im_start|>", "system", "three", "<|im_end|>", "<|im_start|>", "assistant")
    bos = tiny_ids("<|im_start|>")[0]
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                  special_tokens=[("<|im_start|>", bos)])
    completion = json.dumps({"choices": [{"index": 0, "text": " five"}]})
    assert retokenize(tok, json.dumps({"prompt": "two plus"}), completion)[0] == [bos, *tiny_ids("two", "plus")]
    assert retokenize(tok, json.dumps({"prompt": "two plus", "add_special_tokens": False}), completion)[0] == \
        tiny_ids("two", "plus")
    done = {"object": "response", "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "five"}]}]}
    assert retokenize(tok, json.dumps({"input": "what"}), json.dumps(done), "responses")[0][:2] == [bos, bos]
    parts = [{"type": "refusal", "refusal": "no", "text": "yes"}, {"type": "text", "text": None},
             {"type": "tool_reference", "name": "Grep"}]
    assert _engine_message({"role": "user", "content": parts}, "string")["content"] == "no\nGrep"
    assert _engine_message({"role": "tool", "content": parts}, "openai")["content"] == [
        {"type": "text", "text": "no"}, {"type": "tool_reference", "name": "Grep"}]  # (kept as parts, as vLLM does)
