"""Spans -> training samples: merging call histories, retokenising, advantages, loss weights.

``build_samples(traces_dir | con, ...)`` returns ``(pyarrow.Table with schemas.SAMPLES, stats)``.

Merging (``mode="trajectory"``, the default). Within a rollout attempt, calls are taken in ``seq``
order. Call *i* joins the sample of call *i-1* when its prompt ids start with the full token history
``prompt(i-1) + response(i-1)``; the tokens after that history (tool results, user turns the harness
inserted) become masked context (mask 0, logprob 0.0) followed by call *i*'s response (mask 1).
Because a merged call's prompt starts with the history, the history after call *i-1* is always
exactly ``prompt(i-1) + response(i-1)``: the test is pairwise between consecutive calls, so it is
done for all calls at once on the flat token arrays (numpy), with no loop over rows.

When a call does not continue the history, a new sample starts and records why (heuristics, checked
in order; ``lcp`` = longest common prefix of the new prompt and the history ``H``):

1. ``retokenization``: one of the two calls had its ids rebuilt here (upstream returned none), or
   the new prompt keeps the previous prompt whole and differs inside the previous response (the
   harness sent the answer back as text and the chat template tokenised it differently).
2. ``truncation``: the previous response was cut (``finish_reason == 'length'``), or the new prompt
   is shorter than ``H`` while sharing at least half of the conversation's opening (the first
   prompt of the current sample): the harness dropped or compacted old turns.
3. ``other``: the new prompt shares less than half of the conversation's opening: a different
   conversation (a sub-agent, a summariser, a restarted task).
4. ``template_change``: otherwise; the same conversation rendered differently earlier than the
   previous response (system prompt edited, tool list changed, reasoning of past turns stripped).

``mode="transition"``: one sample per call (no merging; ``break_reason`` is null; the ``breaks``
statistics still say what trajectory mode would have done).

Limits: a sample whose prompt exceeds ``max_prompt_len`` is dropped; a response longer than
``max_response_len`` is cut (``response_truncated``); a sample left without any model token is
dropped. All three are counted. Sample ids (``rollout~attempt~index``) keep their index in the
rollout even when an earlier sample was dropped.

Retokenisation: a span without token ids (an upstream that does not return them) is rebuilt from
``request_json``/``response_json`` with the tokenizer's chat template when ``tokenizer`` is given
(flagged ``retokenized``; its logprobs are NaN unless the response carried per-token logprobs of the
same length: the update must recompute them). Without a tokenizer such calls are dropped and
counted; the next call then usually still merges (its prompt contains the dropped exchange, which
becomes masked context). Where ids exist and a tokenizer is given, ``drift_check`` spans are also
retokenised and compared, and the drift is reported (prompt: ids differ; response: the returned
ids do not start the re-rendered assistant turn, which ends with the end-of-turn token).

Rewards, advantages and weights: see ``advantages.py`` (rollout-level, group-normalised, explicit
failure policy) and ``weights.py`` (rollout / token-mean / seq-mean). Every selected rollout that
passes the failure policy is a member of its group's statistics, even one without usable calls.
Calls that ended in an error are not trained on (counted).

Secrets: a span with ``secret_detected`` (the proxy masked a known credential or a provider key in
its request or response text and emptied its token ids) is left out (``calls_secret_detected``)
unless ``include_secret_spans=True`` (config ``samples.include_secret_spans``). Included, it has
no token ids and is retokenised from the masked text like any span without ids (so it needs a
tokenizer, and the model learns on ``[REDACTED]`` where the secret was, not on what it saw).

Speed: one DuckDB query (scan, join with the selected rollouts, sort) hands Arrow list columns to
numpy without copies; the merge test compares every prompt token once (boolean compress + one
vectorised comparison); assembly is array arithmetic. ``stats["timings_s"]``/``["cpu_s"]`` give
the phases; scripts/bench_samples.py measures the whole.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..proxy.anthropic import MESSAGES, to_chat
from ..schemas import SAMPLES
from . import advantages as adv_mod
from . import weights as w_mod
from .views import connect

MODES = ("trajectory", "transition")
BREAK_REASONS = ("template_change", "retokenization", "truncation", "other")
_CHUNK = 1 << 23  # tokens compared per numpy chunk (bounds temporary memory to ~100 MB)


# --------------------------------------------------------------------------------------------
# flat-array helpers: a list column as (values, offsets) numpy views, and segment operations
# --------------------------------------------------------------------------------------------
def _flat(col: pa.ChunkedArray | pa.Array, value_type: pa.DataType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, offsets[n+1], valid[n]) of a list column; null lists have length 0 and valid False."""
    if isinstance(col, pa.ChunkedArray):
        # combine_chunks copies even a single chunk (500 MB of prompts at 100k spans): avoid it
        arr = col.chunk(0) if col.num_chunks == 1 else (col.combine_chunks() if col.num_chunks else pa.array([], pa.list_(value_type)))
    else:
        arr = col
    arr = arr.cast(pa.list_(value_type)) if arr.type != pa.list_(value_type) else arr
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool) if len(arr) else np.zeros(0, bool)
    offsets = np.asarray(arr.offsets.to_numpy(), dtype=np.int64)
    base = offsets[0] if len(offsets) else 0
    values = arr.values.to_numpy(zero_copy_only=False)
    end = offsets[-1] if len(offsets) else 0
    values = values[base:end]
    offsets = offsets - base
    return values, offsets, valid


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """A view of a cached ``arange(n)``: building index arrays is then one pass, not two."""
    global _ARANGE
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, _CHUNK + 1), dtype=np.int64)
    return _ARANGE[:n]


def _segment_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + l)`` for every segment, without a Python loop."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_starts = np.cumsum(lens) - lens
    idx = np.repeat(np.asarray(starts, dtype=np.int64) - out_starts, lens)
    idx += _arange(total)
    return idx


def _first_mismatch(a: np.ndarray, a_starts: np.ndarray, b: np.ndarray, b_starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """For each segment k: the first j < lens[k] with a[a_starts+j] != b[b_starts+j], else lens[k].

    Chunked over segments so the temporary index arrays stay small.
    """
    lens = np.asarray(lens, dtype=np.int64)
    out = lens.copy()
    n = len(lens)
    k0 = 0
    while k0 < n:
        # take segments until about _CHUNK tokens (at least one segment)
        csum = np.cumsum(lens[k0:])
        k1 = k0 + max(1, int(np.searchsorted(csum, _CHUNK, side="right")))
        seg_lens = lens[k0:k1]
        total = int(seg_lens.sum())
        if total:
            ia = _segment_index(a_starts[k0:k1], seg_lens)
            va = a[ia]
            ia += np.repeat(b_starts[k0:k1] - a_starts[k0:k1], seg_lens)  # now indexes b
            bad = np.flatnonzero(va != b[ia])
            if len(bad):
                out_starts = np.cumsum(seg_lens) - seg_lens
                seg = np.searchsorted(out_starts, bad, side="right") - 1
                # several segments may start at the same output offset when some have length 0
                first_seg, first_pos = np.unique(seg, return_index=True)
                out[k0 + first_seg] = bad[first_pos] - out_starts[first_seg]
        k0 = k1
    return out


def _prompt_vs_previous_prompt(p_val: np.ndarray, p_off: np.ndarray, pl: np.ndarray, first: np.ndarray) -> np.ndarray:
    """For every call: length of the common prefix of its prompt and the previous call's prompt
    (over ``min`` of both lengths; 0 for the first call of a rollout).

    The prompts of consecutive calls lie next to each other in the flat array, so both sides are
    "the first k tokens of a row": each is one boolean compress of the flat array (masks built by
    ``np.repeat``), then one vectorised comparison; no index arrays. This is the hot loop of
    sample building (every prompt token is compared once). Chunks end at rollout boundaries.
    """
    n = len(pl)
    len1 = np.zeros(n, dtype=np.int64)
    if n > 1:
        len1[1:] = np.minimum(pl[1:], pl[:-1])
    len1[first] = 0
    out = len1.copy()
    starts = np.flatnonzero(first)
    bounds = np.append(starts, n)
    # greedy chunks of whole rollouts, about _CHUNK prompt tokens each
    ends_tokens = p_off[bounds]
    r0_i = 0
    while r0_i < len(bounds) - 1:
        limit = ends_tokens[r0_i] + _CHUNK
        r1_i = max(r0_i + 1, int(np.searchsorted(ends_tokens, limit, side="right")) - 1)
        r1_i = min(r1_i, len(bounds) - 1)
        r0, r1 = int(bounds[r0_i]), int(bounds[r1_i])
        seg = p_val[p_off[r0]:p_off[r1]]
        L1 = len1[r0:r1]
        PL = pl[r0:r1]
        NL = np.append(L1[1:], 0)  # the part of each prompt the next call compares against
        m = r1 - r0
        pattern = np.tile(np.array([1, 0], dtype=np.int8), m)
        lens_a = np.empty(2 * m, dtype=np.int64)
        lens_a[0::2], lens_a[1::2] = L1, PL - L1
        lens_b = np.empty(2 * m, dtype=np.int64)
        lens_b[0::2], lens_b[1::2] = NL, PL - NL
        a = seg[np.repeat(pattern, lens_a).view(bool)]
        b = seg[np.repeat(pattern, lens_b).view(bool)]
        bad = np.flatnonzero(a != b)
        if len(bad):
            seg_starts = np.cumsum(L1) - L1
            row = np.searchsorted(seg_starts, bad, side="right") - 1
            # rows with L1 == 0 share a start with the next row: searchsorted(right) picks the last
            u_row, u_pos = np.unique(row, return_index=True)
            out[r0 + u_row] = bad[u_pos] - seg_starts[u_row]
        r0_i = r1_i
    return out


# --------------------------------------------------------------------------------------------
# retokenisation
# --------------------------------------------------------------------------------------------
def load_tokenizer(path_or_tokenizer: Any) -> Any:
    """A tokenizer object from a local directory (never the hub), or the object itself."""
    if path_or_tokenizer is None or not isinstance(path_or_tokenizer, (str, os.PathLike)):
        return path_or_tokenizer
    from transformers import AutoTokenizer

    if not os.path.isdir(path_or_tokenizer):
        raise FileNotFoundError(f"tokenizer directory {str(path_or_tokenizer)!r} does not exist")
    return AutoTokenizer.from_pretrained(str(path_or_tokenizer), local_files_only=True)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def retokenize(tokenizer: Any, request_json: str | None, response_json: str | None,
               endpoint: str | None = None) -> tuple[list[int], list[int], list[float] | None]:
    """Rebuild (prompt ids, response ids, logprobs or None) of one call from its JSON bodies.

    Chat: prompt = chat template over ``messages`` (+ ``tools``) with the generation prompt; the
    response = what the template adds when the assistant message is appended (so it ends with the
    template's end-of-turn tokens, as the next prompt will show them), or the content's tokens plus
    EOS when the template cannot be split that way. Completions: ``prompt`` (text or ids) and
    ``choices[0].text``. Anthropic Messages (``endpoint='messages'``): the recorded Messages request
    is turned into the chat request the proxy sent upstream (the same translation), whose answer
    the span holds as a chat completion.
    """
    req = json.loads(request_json or "{}")
    resp = json.loads(response_json or "{}")
    if endpoint == MESSAGES:
        req = to_chat(req)
    if "input" in req and "messages" not in req and "prompt" not in req:  # Responses API call
        req, resp = responses_as_chat(req, resp)
    choice = (resp.get("choices") or [{}])[0]
    logprobs = None
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        content = lp.get("content")
        if isinstance(content, list):
            logprobs = [float(c.get("logprob", float("nan"))) for c in content]
        elif isinstance(lp.get("token_logprobs"), list):
            logprobs = [float("nan") if v is None else float(v) for v in lp["token_logprobs"]]
    if "messages" in req:
        messages = req["messages"]
        tools = req.get("tools")
        kw = {"tools": tools} if tools else {}
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        prompt = _encode(tokenizer, prompt_text)
        msg = dict(choice.get("message") or {})
        msg.setdefault("role", "assistant")
        msg = {k: v for k, v in msg.items() if v is not None}
        full_text = tokenizer.apply_chat_template(messages + [msg], tokenize=False, add_generation_prompt=False, **kw)
        if full_text.startswith(prompt_text):
            response = _encode(tokenizer, full_text[len(prompt_text):])
            eos = tokenizer.eos_token_id
            if eos is not None and eos in response:  # what follows the end-of-turn token (a
                response = response[: response.index(eos) + 1]  # newline) the model never generated
        else:
            response = _encode(tokenizer, msg.get("content") or "")
            if tokenizer.eos_token_id is not None:
                response.append(int(tokenizer.eos_token_id))
    else:
        p = req.get("prompt", "")
        if isinstance(p, list) and p and isinstance(p[0], list):
            p = p[0]
        prompt = [int(x) for x in p] if isinstance(p, list) else _encode(tokenizer, str(p))
        response = _encode(tokenizer, choice.get("text") or "")
    if logprobs is not None and len(logprobs) != len(response):
        logprobs = None
    return prompt, response, logprobs


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or () if isinstance(p, dict))


def responses_as_chat(req: dict, resp: dict) -> tuple[dict, dict]:
    """A Responses API request/response pair as the chat request/completion it renders like:
    ``instructions`` -> system message; ``input`` messages, ``function_call`` and
    ``function_call_output`` items -> chat messages, assistant ``tool_calls`` and tool messages;
    ``output`` -> the assistant message (output text logprobs kept)."""
    messages: list[dict] = []
    if req.get("instructions"):
        messages.append({"role": "system", "content": req["instructions"]})
    items = req.get("input")
    for it in [{"role": "user", "content": items}] if isinstance(items, str) else items or ():
        kind = it.get("type", "message")
        if kind == "message":
            messages.append({"role": it.get("role", "user"), "content": _text_of(it.get("content"))})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments") or ""}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": _text_of(it.get("output"))})
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in req.get("tools") or () if t.get("type") == "function"]
    text, calls, logprobs = [], [], []
    for it in resp.get("output") or ():
        if it.get("type") == "message":
            for part in it.get("content") or ():
                text.append(part.get("text") or "")
                logprobs += [{"logprob": lp.get("logprob")} for lp in part.get("logprobs") or ()]
        elif it.get("type") == "function_call":
            calls.append({"id": it.get("call_id"), "type": "function",
                          "function": {"name": it.get("name"), "arguments": it.get("arguments") or ""}})
    msg = {"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {})}
    chat_req = {"messages": messages, **({"tools": tools} if tools else {})}
    return chat_req, {"choices": [{"message": msg, "logprobs": {"content": logprobs} if logprobs else None}]}


# --------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------
def _steps_predicate(steps: int | Iterable[int] | None) -> str:
    if steps is None:
        return "TRUE"
    if isinstance(steps, (int, np.integer)):
        steps = [int(steps)]
    vals = [int(s) for s in steps]
    if not vals:
        return "FALSE"
    return "step IN (" + ", ".join(str(v) for v in vals) + ")"


def _select_rollouts(con: duckdb.DuckDBPyConnection, group_by: str, steps: Any, where: str | None) -> pa.Table:
    pred = _steps_predicate(steps)
    extra = f" AND ({where})" if where else ""
    sql = f"""
        SELECT rollout_id, attempt, task_id, step, state, reward,
               CAST(({group_by}) AS VARCHAR) AS group_key
        FROM rollouts WHERE ({pred}){extra}
        ORDER BY rollout_id, attempt
    """
    try:
        return con.sql(sql).to_arrow_table()
    except duckdb.Error as exc:
        raise ValueError(f"bad rollout selection (group_by={group_by!r}, where={where!r}): {exc}") from exc


# --------------------------------------------------------------------------------------------
# the builder
# --------------------------------------------------------------------------------------------
def build_samples(
    source: str | os.PathLike | duckdb.DuckDBPyConnection,
    *,
    mode: str = "trajectory",
    tokenizer: Any = None,
    group_by: str = "group_id",
    advantage: str = "grpo",
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    failed_policy: str = "drop",
    failed_reward: float | None = None,
    weight_mode: str = "rollout",
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    steps: int | Iterable[int] | None = None,
    where: str | None = None,
    drift_check: int = 256,
    include_secret_spans: bool = False,
    rollouts: Iterable[str] | None = None,
) -> tuple[pa.Table, dict]:
    """Build the ``samples`` table from a traces directory (or a connection from ``views.connect``).

    ``group_by``: SQL expression over the ``rollouts`` view giving the advantage group (default
    ``group_id``; a rollout whose group is null is its own group and is reported as a singleton).
    ``steps``: a step or steps to take rollouts from (None: all); ``where``: an extra SQL predicate
    on the ``rollouts`` view (e.g. ``"split = 'train'"``). ``include_secret_spans``: train on spans
    the proxy found a secret in (retokenised from the masked text). ``rollouts``: only these rollout
    ids can be selected; from a traces directory only their rows are read (``views.connect``), so
    the cost follows the rollouts selected, not the store's size. Other arguments: see the module doc,
    ``advantages.py`` and ``weights.py``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    if weight_mode not in w_mod.MODES:
        raise ValueError(f"unknown weight mode {weight_mode!r}; choose from {w_mod.MODES}")
    if advantage not in adv_mod.ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {advantage!r}; choose from {adv_mod.ESTIMATORS}")
    if failed_policy not in adv_mod.FAILED_POLICIES:
        raise ValueError(f"unknown failed policy {failed_policy!r}; choose from {adv_mod.FAILED_POLICIES}")
    for name, v in (("max_prompt_len", max_prompt_len), ("max_response_len", max_response_len)):
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    only = None if rollouts is None else sorted({str(r) for r in rollouts})
    con = source if isinstance(source, duckdb.DuckDBPyConnection) else connect(source, rollouts=only)
    if only is not None:  # on a caller's connection too (there without the read savings)
        ids = "rollout_id IN (" + (", ".join("'" + r.replace("'", "''") + "'" for r in only) or "NULL") + ")"
        where = f"({where}) AND {ids}" if where else ids
    tokenizer = load_tokenizer(tokenizer)
    stats: dict[str, Any] = {"mode": mode, "advantage": advantage, "weight_mode": weight_mode, "failed_policy": failed_policy}
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    clock = [time.perf_counter(), time.process_time()]

    def lap(name: str) -> None:  # wall and CPU seconds per phase (the machine may be shared)
        now, now_cpu = time.perf_counter(), time.process_time()
        timings[name] = round(timings.get(name, 0.0) + now - clock[0], 4)
        cpu[name] = round(cpu.get(name, 0.0) + now_cpu - clock[1], 4)
        clock[0], clock[1] = now, now_cpu

    # ---- rollouts: failure policy, group advantages (one row per rollout) -------------------
    ro = _select_rollouts(con, group_by, steps, where)
    n_ro = ro.num_rows
    rewards = ro["reward"].to_numpy(zero_copy_only=False).astype(np.float64) if n_ro else np.zeros(0)
    states = np.asarray(ro["state"].to_pylist(), dtype=object)
    keep, eff_reward, fcounts = adv_mod.apply_failure_policy(rewards, states, policy=failed_policy, failed_reward=failed_reward)
    # a rollout without a group (proxy used alone) is its own group: explicit, and reported
    raw_group = ro["group_key"].to_pylist()
    no_group = np.array([g is None for g in raw_group], dtype=bool)
    gkey = np.array([g if g is not None else f"rollout:{r}~{a}" for g, r, a in
                     zip(raw_group, ro["rollout_id"].to_pylist(), ro["attempt"].to_pylist())], dtype=object)
    ro = ro.set_column(ro.schema.get_field_index("group_key"), "group_key", pa.array(gkey.tolist(), pa.string()))
    kept_idx = np.flatnonzero(keep)
    adv_kept, adv_report = adv_mod.group_advantages(
        eff_reward[kept_idx], gkey[kept_idx].astype(str), method=advantage, epsilon=epsilon, norm_by_std=norm_by_std
    )
    stats["rollouts_selected"] = n_ro
    stats["rollouts_dropped"] = fcounts.pop("dropped")
    stats["rollouts_by_state"] = fcounts
    stats["rollouts_without_group"] = int(no_group[kept_idx].sum())
    stats.update({f"adv_{k}": v for k, v in adv_report.as_dict().items()})

    lap("rollouts")
    kept = ro.take(pa.array(kept_idx, type=pa.int64())).append_column("ridx", pa.array(np.arange(len(kept_idx)), pa.int64()))
    con.register("_lh_kept", kept.select(["rollout_id", "attempt", "ridx"]))
    try:
        calls = con.sql(
            f"""
            SELECT k.ridx, s.span_id, s.seq, s.model_version, s.finish_reason, s.error_kind,
                   s.prompt_token_ids, s.response_token_ids, s.response_logprobs,
                   {_secret_column(con)} AS secret_detected
            FROM spans s JOIN _lh_kept k ON s.rollout_id = k.rollout_id AND coalesce(s.attempt, 0) = k.attempt
            ORDER BY k.ridx, s.seq, s.started_at
            """
        ).to_arrow_table()
    finally:
        con.unregister("_lh_kept")
    lap("scan")
    stats["spans_read"] = calls.num_rows
    err = calls["error_kind"].is_valid().to_numpy(zero_copy_only=False) if calls.num_rows else np.zeros(0, bool)
    stats["calls_error"] = int(err.sum())
    if err.any():
        calls = calls.filter(pa.array(~err))
    calls = _leave_out_secret_spans(calls, include_secret_spans, stats)

    # ---- token ids: rebuild the missing ones, measure drift ---------------------------------
    calls, retok = _fill_token_ids(con, calls, tokenizer, stats, drift_check)
    lap("token_ids")

    n = calls.num_rows
    p_val, p_off, _ = _flat(calls["prompt_token_ids"], pa.int32())
    r_val, r_off, _ = _flat(calls["response_token_ids"], pa.int32())
    pl = np.diff(p_off)
    rl = np.diff(r_off)
    ridx = calls["ridx"].to_numpy().astype(np.int64) if n else np.zeros(0, np.int64)
    first = np.ones(n, dtype=bool)
    if n:
        first[1:] = ridx[1:] != ridx[:-1]

    # ---- merge test: prompt(i) starts with prompt(i-1) + response(i-1) ----------------------
    prev = np.flatnonzero(~first)  # rows with a predecessor in the same rollout
    lcp = np.zeros(n, dtype=np.int64)
    hist = np.zeros(n, dtype=np.int64)
    if len(prev):
        pp = prev - 1
        hist[prev] = pl[pp] + rl[pp]
        m1 = _prompt_vs_previous_prompt(p_val, p_off, pl, first)[prev]
        lcp[prev] = m1
        whole = (m1 == pl[pp]) & (pl[prev] > pl[pp])
        w = prev[whole]
        if len(w):
            len2 = np.minimum(pl[w] - pl[w - 1], rl[w - 1])
            m2 = _first_mismatch(p_val, p_off[w] + pl[w - 1], r_val, r_off[w - 1], len2)
            lcp[w] += m2
    continues = ~first & (lcp == hist)
    reason_code = _break_reasons(calls, first, continues, lcp, hist, pl, retok)

    if mode == "trajectory":
        new_sample = ~continues
    else:
        new_sample = np.ones(n, dtype=bool)
    stats["calls_used"] = n
    stats["calls_continuing_history"] = int(continues.sum())
    # in transition mode these say what trajectory mode would have done
    breaks = np.bincount(reason_code[reason_code >= 0].astype(np.int64), minlength=len(BREAK_REASONS))
    stats["breaks"] = {r: int(breaks[i]) for i, r in enumerate(BREAK_REASONS)}

    lap("merge")
    # ---- assemble samples on flat arrays ----------------------------------------------------
    table, sstats = _assemble(calls, kept, adv_kept, eff_reward[kept_idx], new_sample, mode,
                              p_val, p_off, r_val, r_off, pl, rl, hist, ridx, retok, reason_code,
                              weight_mode, max_prompt_len, max_response_len)
    stats.update(sstats)
    lap("assemble")
    stats["timings_s"] = timings
    stats["cpu_s"] = cpu
    return table, stats


def _secret_column(con: duckdb.DuckDBPyConnection) -> str:
    """``s.secret_detected``, or FALSE for traces written before the column existed."""
    cols = {r[0] for r in con.sql("DESCRIBE spans").fetchall()}
    return "coalesce(s.secret_detected, FALSE)" if "secret_detected" in cols else "FALSE"


def _leave_out_secret_spans(calls: pa.Table, include: bool, stats: dict) -> pa.Table:
    """Drop spans the proxy found a secret in, unless asked to train on them (counted either way)."""
    secret = calls["secret_detected"].to_numpy(zero_copy_only=False).astype(bool) if calls.num_rows else np.zeros(0, bool)
    stats["calls_secret_detected"] = int(secret.sum())
    stats["calls_dropped_secret"] = 0 if include else int(secret.sum())
    calls = calls.drop_columns(["secret_detected"])
    return calls if include or not secret.any() else calls.filter(pa.array(~secret))


def _fill_token_ids(con, calls: pa.Table, tokenizer: Any, stats: dict, drift_check: int) -> tuple[pa.Table, np.ndarray]:
    """Rebuild missing token ids (or drop those calls); count drift on a sample of the others."""
    n = calls.num_rows
    if n == 0:
        stats.update(calls_without_token_ids=0, retokenized_calls=0, drift_checked=0, drift_prompt=0, drift_response=0)
        return calls, np.zeros(0, dtype=bool)
    missing = (calls["prompt_token_ids"].is_null().to_numpy(zero_copy_only=False)
               | calls["response_token_ids"].is_null().to_numpy(zero_copy_only=False))
    stats["calls_without_token_ids"] = int(missing.sum())
    retok = np.zeros(n, dtype=bool)
    drift_rows = np.zeros(0, dtype=np.int64)
    if tokenizer is not None and drift_check > 0:
        have = np.flatnonzero(~missing)
        if len(have) > drift_check:
            have = np.sort(np.random.default_rng(0).choice(have, drift_check, replace=False))
        drift_rows = have
    need = np.flatnonzero(missing) if tokenizer is not None else np.zeros(0, dtype=np.int64)
    bodies: dict[str, tuple[str, str]] = {}
    rows = np.concatenate([need, drift_rows])
    if len(rows):
        ids = pa.table({"span_id": calls["span_id"].take(pa.array(rows))})
        con.register("_lh_ids", ids)
        try:
            got = con.sql("SELECT span_id, request_json, response_json, endpoint FROM spans JOIN _lh_ids USING (span_id)").fetchall()
        finally:
            con.unregister("_lh_ids")
        bodies = {sid: (rq, rs, ep) for sid, rq, rs, ep in got}
    span_ids = calls["span_id"]
    drift_p = drift_r = checked = 0
    for i in drift_rows:
        sid = span_ids[int(i)].as_py()
        if sid not in bodies:
            continue
        try:
            p, r, _ = retokenize(tokenizer, *bodies[sid])
        except Exception:
            continue
        checked += 1
        drift_p += p != calls["prompt_token_ids"][int(i)].as_py()
        # the returned ids must start the re-rendered turn (a response cut by max_tokens has no
        # end-of-turn token; a re-rendered one always has)
        got = calls["response_token_ids"][int(i)].as_py()
        drift_r += r[: len(got)] != got
    stats.update(drift_checked=checked, drift_prompt=int(drift_p), drift_response=int(drift_r))
    if len(need):
        # rebuild only the rows that need it, then splice them in with one take per column
        # (no conversion of the whole table to Python lists)
        cols = {"prompt_token_ids": [], "response_token_ids": [], "response_logprobs": []}
        rows_done: list[int] = []
        failed = []
        for i in need:
            i = int(i)
            sid = span_ids[i].as_py()
            try:
                p, r, lp = retokenize(tokenizer, *bodies.get(sid, (None, None, None)))
            except Exception as exc:  # a body we cannot render: drop the call, say why
                failed.append((sid, f"{type(exc).__name__}: {exc}"))
                continue
            if not p:
                failed.append((sid, "no request body to rebuild the prompt from"))
                continue
            old_p = calls["prompt_token_ids"][i].as_py()
            old_r = calls["response_token_ids"][i].as_py()
            cols["prompt_token_ids"].append(old_p if old_p is not None else p)
            if old_r is None:
                cols["response_token_ids"].append(r)
                cols["response_logprobs"].append(lp if lp is not None else [float("nan")] * len(r))
            else:
                cols["response_token_ids"].append(old_r)
                cols["response_logprobs"].append(calls["response_logprobs"][i].as_py())
            rows_done.append(i)
        stats["retokenize_failed"] = len(failed)
        if failed:
            stats["retokenize_errors"] = failed[:5]
        if rows_done:
            index = np.arange(n, dtype=np.int64)
            index[rows_done] = n + np.arange(len(rows_done))
            types = {"prompt_token_ids": pa.int32(), "response_token_ids": pa.int32(), "response_logprobs": pa.float32()}
            for name, values in cols.items():
                merged = pa.concat_arrays([*calls[name].cast(pa.list_(types[name])).chunks, pa.array(values, pa.list_(types[name]))])
                calls = calls.set_column(calls.schema.get_field_index(name), name, merged.take(pa.array(index)))
            retok[rows_done] = True
    stats["retokenized_calls"] = int(retok.sum())
    still = (calls["prompt_token_ids"].is_null().to_numpy(zero_copy_only=False)
             | calls["response_token_ids"].is_null().to_numpy(zero_copy_only=False))
    stats["calls_dropped_no_token_ids"] = int(still.sum())
    if still.any():
        calls = calls.filter(pa.array(~still))
        retok = retok[~still]
    return calls, retok


def _break_reasons(calls: pa.Table, first, continues, lcp, hist, pl, retok) -> np.ndarray:
    """Code (index into BREAK_REASONS, -1 = no break) for each call; heuristics in the module doc."""
    n = len(first)
    code = np.full(n, -1, dtype=np.int8)
    brk = np.flatnonzero(~first & ~continues)
    if not len(brk):
        return code
    pp = brk - 1
    fin = calls["finish_reason"].to_numpy(zero_copy_only=False)
    prev_len = np.asarray(fin[pp] == "length", dtype=bool)
    kept_prompt = lcp[brk] >= pl[pp]
    # the conversation's opening = first prompt of the sample the previous call belongs to
    start = np.maximum.accumulate(np.where(first | ~continues, np.arange(n), 0))
    shares_half = lcp[brk] * 2 >= pl[start[pp]]
    shorter = pl[brk] < hist[brk]
    conds = [
        retok[brk] | retok[pp] | (kept_prompt & ~prev_len),
        prev_len | (shorter & shares_half),
        ~shares_half,
    ]
    choices = [BREAK_REASONS.index("retokenization"), BREAK_REASONS.index("truncation"), BREAK_REASONS.index("other")]
    code[brk] = np.select(conds, choices, default=BREAK_REASONS.index("template_change"))
    return code


def _assemble(calls, kept, adv_kept, reward_kept, new_sample, mode, p_val, p_off, r_val, r_off, pl, rl,
              hist, ridx, retok, reason_code, weight_mode, max_prompt_len, max_response_len):
    """Build the samples table from per-call flags; every step is a numpy/pyarrow array op."""
    n = len(new_sample)
    st: dict[str, Any] = {}
    S = int(new_sample.sum())
    s_first = np.flatnonzero(new_sample)  # first call row of each sample
    s_ncalls = np.diff(np.append(s_first, n))
    # context tokens each merged call adds before its response
    ctx = np.where(new_sample, 0, pl - hist).astype(np.int64)
    ctx_start = p_off[:-1] + hist
    # output layout per row: [ctx tokens (mask 0)] [response tokens (mask 1)]
    seg_lens = np.empty(2 * n, dtype=np.int64)
    seg_lens[0::2] = ctx
    seg_lens[1::2] = rl
    seg_mask = np.tile(np.array([0, 1], dtype=np.int8), n)
    mask = np.repeat(seg_mask, seg_lens)
    total = len(mask)
    model = mask.view(bool)
    ids = np.empty(total, dtype=np.int32)
    ids[model] = r_val
    if int(ctx.sum()):
        ids[~model] = p_val[_segment_index(ctx_start, ctx)]
    # logprobs aligned with responses; NaN where missing or of the wrong length
    l_val, l_off, l_valid = _flat(calls["response_logprobs"], pa.float32()) if n else (np.zeros(0, np.float32), np.zeros(1, np.int64), np.zeros(0, bool))
    ll = np.diff(l_off)
    lp_ok = l_valid & (ll == rl)
    st["calls_without_logprobs"] = int((~lp_ok).sum())
    lps = np.zeros(total, dtype=np.float32)
    if lp_ok.all():
        resp_lp = l_val.astype(np.float32, copy=False)
    else:
        resp_lp = np.full(len(r_val), np.nan, dtype=np.float32)
        okr = np.flatnonzero(lp_ok)
        resp_lp[_segment_index(r_off[okr], rl[okr])] = l_val[_segment_index(l_off[okr], ll[okr])]
    lps[model] = resp_lp
    row_out = ctx + rl
    s_len = np.add.reduceat(row_out, s_first) if S else np.zeros(0, np.int64)
    s_off = np.concatenate([[0], np.cumsum(s_len)])
    model_tokens = np.add.reduceat(rl, s_first).astype(np.int64) if S else np.zeros(0, np.int64)

    # per-sample attributes
    s_ridx = ridx[s_first]
    s_prompt_len = pl[s_first]
    s_retok = np.maximum.reduceat(retok.astype(np.int8), s_first).astype(bool) if S else np.zeros(0, bool)
    mv = calls["model_version"].to_numpy(zero_copy_only=False).astype(np.float64) if n else np.zeros(0)
    mv_min = np.fmin.reduceat(mv, s_first) if S else np.zeros(0)
    mv_max = np.fmax.reduceat(mv, s_first) if S else np.zeros(0)
    s_index = np.arange(S) - np.searchsorted(s_ridx, s_ridx, side="left") if S else np.zeros(0, np.int64)
    s_reason = reason_code[s_first] if mode == "trajectory" else np.full(S, -1, np.int8)

    # limits: prompts too long drop the sample; responses too long are cut (token work only
    # for the samples concerned)
    keep_s = np.ones(S, dtype=bool)
    if max_prompt_len is not None:
        keep_s &= s_prompt_len <= max_prompt_len
    st["samples_dropped_prompt_too_long"] = int((~keep_s).sum())
    cut = np.zeros(S, dtype=np.int64)
    cut_idx = np.zeros(0, dtype=np.int64)
    if max_response_len is not None:
        cut = np.where(keep_s, np.maximum(s_len - max_response_len, 0), 0)
        tr = np.flatnonzero(cut)
        cut_idx = _segment_index(s_off[tr] + max_response_len, cut[tr])
        cut_model = np.bincount(np.repeat(tr, cut[tr]), weights=model[cut_idx], minlength=S).astype(np.int64)
        model_tokens = model_tokens - cut_model
        st["truncated_model_tokens"] = int(cut_model.sum())
    truncated = cut > 0
    st["samples_truncated"] = int(truncated.sum())
    empty = keep_s & (model_tokens == 0)
    st["samples_dropped_no_model_tokens"] = int(empty.sum())
    keep_s &= ~empty
    if not keep_s.all() or len(cut_idx):
        keep_tok = np.repeat(keep_s, s_len)
        keep_tok[cut_idx] = False
        ids, mask, lps = ids[keep_tok], mask[keep_tok], lps[keep_tok]
    ks = np.flatnonzero(keep_s)
    new_len = (s_len - cut)[ks]
    s_ridx_k = s_ridx[ks]
    model_tokens_k = model_tokens[ks]
    off = np.concatenate([[0], np.cumsum(new_len)]).astype(np.int32)
    s_ridx_k = s_ridx[ks]
    model_tokens_k = model_tokens[ks]

    # advantages and weights
    weights = w_mod.loss_weights(s_ridx_k, model_tokens_k, weight_mode)
    adv = adv_mod.broadcast(adv_kept, s_ridx_k).astype(np.float32)
    rew = adv_mod.broadcast(reward_kept, s_ridx_k)

    # span ids per sample: the calls rows of kept samples
    row_keep = np.repeat(keep_s, s_ncalls)
    span_ids = calls["span_id"].filter(pa.array(row_keep)) if n else pa.array([], pa.string())
    span_off = np.concatenate([[0], np.cumsum(s_ncalls[ks])]).astype(np.int32)

    take_r = pa.array(s_ridx_k, type=pa.int64())
    rid = kept["rollout_id"].take(take_r)
    att = kept["attempt"].take(take_r)
    idx_arr = pa.array(s_index[ks].astype(np.int32))
    sample_id = pc.binary_join_element_wise(rid, pc.cast(att, pa.string()), pc.cast(idx_arr, pa.string()), "~")
    prompts = calls["prompt_token_ids"].take(pa.array(s_first[ks], type=pa.int64())) if n else pa.array([], pa.list_(pa.int32()))
    reason_names = np.array([None, *BREAK_REASONS], dtype=object)[s_reason[ks].astype(np.int64) + 1]

    def _vers(a):
        return pa.array(np.where(np.isnan(a), 0, a).astype(np.int64), mask=np.isnan(a))

    cols = {
        "sample_id": sample_id,
        "rollout_id": rid,
        "attempt": att,
        "task_id": kept["task_id"].take(take_r),
        "group_id": kept["group_key"].take(take_r),
        "step": kept["step"].take(take_r),
        "index_in_rollout": idx_arr,
        "span_ids": pa.ListArray.from_arrays(pa.array(span_off), span_ids.combine_chunks() if isinstance(span_ids, pa.ChunkedArray) else span_ids),
        "n_calls": pa.array(s_ncalls[ks].astype(np.int32)),
        "merged": pa.array(s_ncalls[ks] > 1),
        "break_reason": pa.array(reason_names.tolist(), pa.string()),
        "retokenized": pa.array(s_retok[ks]),
        "prompt_token_ids": prompts,
        "response_token_ids": pa.ListArray.from_arrays(pa.array(off), pa.array(ids, pa.int32())),
        "response_mask": pa.ListArray.from_arrays(pa.array(off), pa.array(mask, pa.int8())),
        "response_logprobs": pa.ListArray.from_arrays(pa.array(off), pa.array(lps, pa.float32())),
        "reward": pa.array(rew, pa.float64()),
        "advantage": pa.array(adv, pa.float32()),
        "loss_weight": pa.array(weights, pa.float32()),
        "model_version_min": _vers(mv_min[ks]),
        "model_version_max": _vers(mv_max[ks]),
        "response_truncated": pa.array(truncated[ks]),
    }
    table = pa.table([cols[f.name] for f in SAMPLES], schema=SAMPLES)

    # merge statistics per rollout
    n_rollouts_with = len(np.unique(s_ridx_k))
    per_rollout = np.bincount(s_ridx_k)[np.unique(s_ridx_k)] if len(s_ridx_k) else np.zeros(0)
    st.update(
        samples=int(len(ks)),
        rollouts_with_samples=int(n_rollouts_with),
        samples_per_rollout=float(per_rollout.mean()) if len(per_rollout) else 0.0,
        single_sample_rollout_share=float((per_rollout == 1).mean()) if len(per_rollout) else 0.0,
        merged_samples=int((s_ncalls[ks] > 1).sum()),
        model_tokens=int(model_tokens_k.sum()),
        context_tokens=int((mask == 0).sum()),
        prompt_tokens=int(s_prompt_len[ks].sum()),
        n_units=w_mod.n_units(s_ridx_k, model_tokens_k, weight_mode),
    )
    return table, st
