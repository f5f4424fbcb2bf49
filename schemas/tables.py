"""Arrow schemas of every trace table, each field documented.

Identity of a rollout attempt is the pair ``(rollout_id, attempt)``: the launcher keeps
``rollout_id`` stable across retries of the same (task, sample) and bumps ``attempt``.
Timestamps are UTC microseconds. Token ids are int32, logprobs float32.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

_TS = pa.timestamp("us", tz="UTC")


def _f(name: str, type_: pa.DataType, doc: str, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={"doc": doc})


def _schema(table: str, doc: str, fields: list[pa.Field]) -> pa.Schema:
    meta = {"lightning.table": table, "lightning.schema_version": str(SCHEMA_VERSION), "doc": doc}
    return pa.schema(fields, metadata=meta)


SPANS = _schema(
    "spans",
    "One row per captured model call (chat/completions or completions), written by the proxy.",
    [
        _f("span_id", pa.string(), "Unique id of this model call (uuid4 hex).", False),
        _f("rollout_id", pa.string(), "Rollout the call belongs to (from proxy credentials); null if unattributed."),
        _f("attempt", pa.int32(), "Attempt number of the rollout (0 = first try)."),
        _f("seq", pa.int32(),
           "Order of the call within (rollout_id, attempt), from 0, assigned when the request arrives."),
        _f("started_at", _TS, "When the proxy received the request."),
        _f("ended_at", _TS, "When the response (or error) finished."),
        _f("latency_ms", pa.float64(), "ended_at - started_at in milliseconds."),
        _f("ttft_ms", pa.float64(), "Time to the first response byte from upstream, in milliseconds."),
        _f("mode", pa.string(),
           "How the harness reached the proxy: 'forward' (HTTP(S)_PROXY) or 'reverse' (base URL)."),
        _f("endpoint", pa.string(),
           "'chat.completions', 'completions', 'responses' (the Responses API) or 'messages' (Anthropic Messages)."),
        _f("method", pa.string(), "HTTP method."),
        _f("scheme", pa.string(), "Scheme the harness used ('http' or 'https')."),
        _f("host", pa.string(), "Host the harness addressed (before routing)."),
        _f("path", pa.string(), "Request path the harness used (credentials removed)."),
        _f("upstream", pa.string(), "Base URL the call was actually sent to (after routing), no credentials."),
        _f("routed", pa.bool_(),
           "True when the proxy sent the call where its configuration says (the training pool, for a pool member "
           "or a route host; the reverse target; without a pool, a route host itself); false for a host the "
           "harness chose itself through the forward proxy (its answer is that server's, so its token ids and "
           "logprobs are not kept and training leaves it out) or a call answered before routing. Null in traces "
           "written before the column existed (read as routed)."),
        _f("model", pa.string(), "Model name the harness asked for."),
        _f("served_model", pa.string(), "Model name sent upstream (after model mapping)."),
        _f("model_version", pa.int64(),
           "Policy version the proxy had when the call was forwarded (bumped after each update)."),
        _f("status_code", pa.int32(), "HTTP status returned to the harness; null if none was returned."),
        _f("stream", pa.bool_(), "True when the harness asked for server-sent events."),
        _f("request_json", pa.string(), "Request body as the harness sent it, secrets removed."),
        _f("response_json", pa.string(),
           "Response body from upstream (SSE streams assembled into one completion object), secrets removed."),
        _f("prompt_token_ids", pa.list_(pa.int32()),
           "Token ids of the prompt as the engine saw it (after chat template)."),
        _f("response_token_ids", pa.list_(pa.int32()), "Token ids the engine generated for choice 0."),
        _f("response_logprobs", pa.list_(pa.float32()),
           "Logprob of each generated token of choice 0 under the serving policy."),
        _f("finish_reason", pa.string(), "finish_reason of choice 0 ('stop', 'length', 'tool_calls', ...)."),
        _f("n_choices", pa.int32(), "Number of choices returned (token ids are kept for choice 0)."),
        _f("prompt_tokens", pa.int32(), "usage.prompt_tokens reported by upstream."),
        _f("completion_tokens", pa.int32(), "usage.completion_tokens reported by upstream."),
        _f("sampling_json", pa.string(),
           "What the request set that shapes the distribution its tokens were drawn from, as JSON (proxy/sampling.py), "
           "read as vLLM reads the endpoint's request: every numeric setting given (temperature, top_p, top_k, "
           "min_p, the penalties, min_tokens, thinking_token_budget), the sizes of "
           "logit_bias/allowed_token_ids/bad_words, use_beam_search, "
           "and the kind of output constraint ('constraint': a response_format or text.format type, "
           "structured_outputs, tool_choice 'required' or named, strict tools, parallel_tool_calls false); "
           "null: none (the engine's defaults)."),
        _f("token_ids_injected", pa.bool_(),
           "True when the proxy added return_token_ids/logprobs the harness did not ask for."),
        _f("error_kind", pa.string(),
           "Null on success; else 'upstream_status' (an answer >= 400: upstream's, or the proxy's own refusal, whose "
           "error then says 'the proxy answered'), 'upstream_unreachable' (connect "
           "failure or drop), 'timeout', 'client_disconnect' (the harness hung up mid-request-body or mid-response; "
           "seq is still assigned), 'malformed_request', 'malformed_response', 'truncated' (a stream ended without "
           "[DONE] or finish_reason, a JSON body stops mid-value, or the engine aborted the answer, "
           "finish_reason 'abort': the answer is incomplete), 'too_large' (body over "
           "max_body_size, or a compressed body / SSE event expanding past max_decoded_size: refused with 413 or not "
           "parsed), 'shutdown' (still in flight when the proxy stopped after its shutdown_grace, or refused with 503 "
           "while it drained), 'version_changed' (the model version was changed while the call was in flight: a "
           "weight swap whose drain did not wait for it; its tokens may come from either weights)."),
        _f("error", pa.string(), "Human-readable error message; null on success."),
        _f("salvaged", pa.bool_(),
           "True when the call's bytes were not valid UTF-8 (or a field was out of range) and were recorded with "
           "replacement characters instead of being lost."),
        _f("secret_detected", pa.bool_(),
           "True when a known secret (API key, proxy credential, a header's credential) or a provider key shape "
           "appeared in the call's request or response text: it is masked in every text column, the token id and "
           "logprob columns (and the response body's token-by-token fields) are emptied, and training leaves the call "
           "out by default."),
    ],
)

REWARDS = _schema(
    "rewards",
    "One row per reward reported for a rollout attempt. Which one counts (the rollouts view, the launcher): "
    "a verifier report (source 'command' or 'api') outranks a self-report ('proxy', 'file'), the latest wins "
    "within a rank, and once the launcher judged an attempt only a later verifier report changes it.",
    [
        _f("reward_id", pa.string(), "Unique id of this reward report.", False),
        _f("rollout_id", pa.string(), "Rollout the reward is for.", False),
        _f("attempt", pa.int32(), "Attempt of the rollout."),
        _f("reward", pa.float64(), "Scalar reward.", False),
        _f("created_at", _TS, "When the reward was recorded."),
        _f("source", pa.string(),
           "Who reported it. Verifier rank: 'command' (the run's --reward-cmd) and 'api' (the operator, over the "
           "proxy's control API). Self-reports, which never outrank the verifier and count only for runs without "
           "--reward-cmd and with --self-reward: 'proxy' (the harness POSTed to LIGHTNING_REWARD_URL) and 'file' (the "
           "harness's LIGHTNING_REWARD_FILE)."),
        _f("info_json", pa.string(), "Free-form JSON the reporter attached (e.g. correctness details)."),
    ],
)

ROLLOUTS = _schema(
    "rollouts",
    "One row per finished rollout attempt, written by the launcher.",
    [
        _f("rollout_id", pa.string(), "Stable id of the (task, group, sample) rollout.", False),
        _f("attempt", pa.int32(), "Attempt number (0 = first try); retries get a new attempt.", False),
        _f("run_id", pa.string(), "Launcher batch/run this rollout belongs to."),
        _f("task_id", pa.string(), "Task id from the task file."),
        _f("group_id", pa.string(), "Group for advantage normalisation (task id + step by default)."),
        _f("sample_index", pa.int32(), "Index of the sample within its group."),
        _f("step", pa.int64(), "Training step that launched it; null outside training."),
        _f("split", pa.string(), "'train' or 'eval' (or a user label)."),
        _f("state", pa.string(), "'succeeded', 'failed', 'timed_out', 'no_reward' or 'cancelled'."),
        _f("exit_code", pa.int32(), "Harness exit code (negative: killed by signal); null if never exited."),
        _f("started_at", _TS, "When the harness started."),
        _f("ended_at", _TS, "When the harness ended (or was killed)."),
        _f("duration_s", pa.float64(), "Wall time of the attempt in seconds."),
        _f("reward", pa.float64(), "Reward of the attempt; null when none was reported (never silently 0)."),
        _f("reward_source", pa.string(),
           "Where the launcher's reward came from ('command', 'api', 'file', 'proxy'; see rewards.source); null if "
           "none."),
        _f("error", pa.string(), "Why the attempt failed, if it did."),
        _f("log_path", pa.string(), "File holding the tail of the harness's stdout/stderr."),
        _f("model_version", pa.int64(), "Policy version when the attempt started."),
        _f("runner", pa.string(), "'local' or 'k8s'."),
        _f("task_json", pa.string(), "The task row as JSON, without its private fields."),
    ],
)

SAMPLES = _schema(
    "samples",
    "Training samples built from spans: one per merged call sequence, with advantages and loss weights.",
    [
        _f("sample_id", pa.string(), "Unique id: rollout_id, attempt and index within the rollout.", False),
        _f("rollout_id", pa.string(), "Rollout the sample came from.", False),
        _f("attempt", pa.int32(), "Attempt of the rollout."),
        _f("task_id", pa.string(), "Task id."),
        _f("group_id", pa.string(), "Advantage group."),
        _f("step", pa.int64(), "Training step the rollout belongs to."),
        _f("index_in_rollout", pa.int32(), "Position of this sample within its rollout (0-based)."),
        _f("span_ids", pa.list_(pa.string()), "Spans merged into this sample, in call order."),
        _f("n_calls", pa.int32(), "Number of model calls merged into this sample."),
        _f("merged", pa.bool_(), "True when more than one call was merged into the sample."),
        _f("break_reason", pa.string(),
           "Why this sample did not continue the previous one: null for the first sample; 'template_change', "
           "'retokenization', 'truncation', 'other'."),
        _f("retokenized", pa.bool_(),
           "True when some token ids were rebuilt with the tokenizer (upstream returned none)."),
        _f("prompt_token_ids", pa.list_(pa.int32()), "Prompt of the first merged call."),
        _f("response_token_ids", pa.list_(pa.int32()),
           "Everything after the prompt: model tokens and inserted context tokens."),
        _f("response_mask", pa.list_(pa.int8()),
           "1 = token generated by the model (trained), 0 = inserted by the harness between calls."),
        _f("response_logprobs", pa.list_(pa.float32()),
           "Behaviour-policy logprob per response token (0.0 where mask is 0)."),
        _f("reward", pa.float64(), "Reward of the rollout."),
        _f("advantage", pa.float32(), "Rollout-level advantage, broadcast to every sample of the rollout."),
        _f("loss_weight", pa.float32(),
           "Weight per model token: sums to 1 over all model tokens of the rollout (rollout mode)."),
        _f("model_version_min", pa.int64(), "Oldest policy version among the merged calls."),
        _f("model_version_max", pa.int64(), "Newest policy version among the merged calls."),
        _f("response_truncated", pa.bool_(), "True when the response was cut to the configured maximum length."),
    ],
)

METRICS = _schema(
    "metrics",
    "Long-format metrics: one row per (step, name); written by the trainer and launcher.",
    [
        _f("run_id", pa.string(), "Training run id."),
        _f("step", pa.int64(), "Training step."),
        _f("name", pa.string(), "Metric name, e.g. 'train/reward_mean', 'eval/success', 'time/drain_s'.", False),
        _f("value", pa.float64(), "Metric value."),
        _f("at", _TS, "When it was recorded."),
    ],
)

TABLES: dict[str, pa.Schema] = {
    "spans": SPANS,
    "rewards": REWARDS,
    "rollouts": ROLLOUTS,
    "samples": SAMPLES,
    "metrics": METRICS,
}


def describe(table: str) -> list[tuple[str, str, str]]:
    """(name, type, doc) for each field of a table: the data dictionary users read."""
    schema = TABLES[table]
    return [(f.name, str(f.type), (f.metadata or {}).get(b"doc", b"").decode()) for f in schema]
