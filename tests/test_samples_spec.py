"""The fast merge path (``build_samples``) follows the plain rule (``merge.merge_calls``) on many
generated rollouts: continued histories, tool turns, every break kind, missing or misfit logprobs,
error calls, several attempts, storage order shuffled. ``assert_samples_follow_the_rule`` is also
run on real captured traces (tests/test_samples_vllm.py: chat, Responses and Messages spans)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from fixtures_traces import rollout, span

from lightning_harness.schemas import read_table
from lightning_harness.trainer import merge as M
from lightning_harness.trainer.merge import merge_calls
from lightning_harness.trainer.samples import build_samples


def spec_samples(traces: Path) -> dict[str, tuple]:
    """sample id -> (prompt, response, mask, logprobs, n_calls) by the plain rule, from the stored
    spans (calls that ended in an error are not trained on, nor attempts that were retried)."""
    calls, last = defaultdict(list), defaultdict(int)
    for s in read_table(traces, "spans").to_pylist():
        last[s["rollout_id"]] = max(last[s["rollout_id"]], s["attempt"] or 0)
        if s["error_kind"] is None and s["rollout_id"] is not None:
            calls[(s["rollout_id"], s["attempt"] or 0)].append(s)
    out = {}
    for (rid, attempt), rows in calls.items():
        if attempt < last[rid]:
            continue
        rows.sort(key=lambda c: (c["seq"], c["started_at"]))
        merged = merge_calls((c["prompt_token_ids"], c["response_token_ids"], c["response_logprobs"]) for c in rows)
        out.update({f"{rid}~{attempt}~{i}": (m.prompt, m.response, m.mask, m.logprobs, m.n_calls)
                    for i, m in enumerate(merged)})
    return out


def assert_samples_follow_the_rule(traces: Path, **options) -> dict:
    """Build samples (no limits) and compare each with the rule's; returns the build statistics."""
    table, stats = build_samples(traces, **options)
    assert stats["retokenized_calls"] == 0 and stats["calls_dropped_no_token_ids"] == 0  # the rule needs ids
    want = spec_samples(traces)
    empty = {k for k, v in want.items() if sum(v[2]) == 0}  # no model token: dropped (counted)
    assert stats["samples_dropped_no_model_tokens"] == len(empty)
    got = {r["sample_id"]: r for r in table.to_pylist()}
    assert set(got) == set(want) - empty
    for key, r in got.items():
        prompt, response, mask, logprobs, n_calls = want[key]
        assert (r["prompt_token_ids"], r["response_token_ids"], r["response_mask"], r["n_calls"]) == (
            prompt, response, mask, n_calls), key
        np.testing.assert_array_equal(np.asarray(r["response_logprobs"], np.float32), np.asarray(logprobs, np.float32))
    return stats


def _rollout_spans(rng: np.random.Generator, rid: str, attempt: int) -> list[dict]:
    """One rollout attempt whose calls go on as a harness's would, with every way of breaking."""
    system = rng.integers(0, 60, rng.integers(8, 15)).tolist()
    prompt = system + rng.integers(0, 60, rng.integers(0, 6)).tolist()
    out = []
    for seq in range(int(rng.integers(1, 9))):
        response = rng.integers(0, 60, rng.integers(0, 7)).tolist()
        lp = (-rng.random(len(response))).astype(np.float32).tolist()
        lp = {0: lp, 1: lp, 2: lp, 3: None, 4: lp[:-1] or None}[int(rng.integers(0, 5))]  # missing / misfit
        error = "upstream_error" if rng.random() < 0.05 else None
        finish = "length" if rng.random() < 0.1 else "stop"
        out.append(span(rid, seq, prompt, response, attempt=attempt, logprobs=lp, error_kind=error,
                        finish_reason=finish))
        history = prompt + response
        kind = rng.choice(["tool", "tool", "user", "exact", "retokenized", "truncated", "template", "other"])
        if kind in ("tool", "user"):  # the harness adds a tool result or a user turn: context
            prompt = history + rng.integers(0, 60, rng.integers(1, 8)).tolist()
        elif kind == "exact":
            prompt = list(history)
        elif kind == "retokenized" and response:  # the answer sent back as text, tokenised otherwise
            prompt = history + [1]
            prompt[len(history) - 1 - int(rng.integers(0, len(response)))] += 100
        elif kind == "truncated":  # old turns dropped or compacted
            prompt = system + history[len(system) + int(rng.integers(1, 5)):]
        elif kind == "template" and len(history) >= len(system):  # the end of the system prompt edited
            prompt = history + [2]
            prompt[len(system) - 1] += 100
        else:  # a different conversation (a sub-agent, a summariser)
            prompt = rng.integers(100, 160, rng.integers(1, 12)).tolist()
    return out


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_follows_the_rule_on_generated_rollouts(make_traces, monkeypatch, seed):
    monkeypatch.setattr(M, "_CHUNK", [5, 64, 1 << 23][seed % 3])  # chunked paths run many times, or once
    rng = np.random.default_rng(seed)
    spans, rollouts = [], []
    for r in range(60):
        for attempt in range(1 + (r % 7 == 0)):
            spans += _rollout_spans(rng, f"r{r:03d}", attempt)
            state = "failed" if attempt == 0 and r % 7 == 0 else "succeeded"  # retried after a failure
            rollouts.append(rollout(f"r{r:03d}", attempt=attempt, state=state, reward=float(r % 3),
                                    group_id=f"g{r % 5}"))
    rng.shuffle(spans)  # storage order must not matter
    stats = assert_samples_follow_the_rule(make_traces(spans=spans, rollouts=rollouts))
    # every break kind and every path ran
    assert stats["calls_continuing_history"] > 50 and stats["calls_error"] > 0
    assert all(n > 0 for n in stats["breaks"].values()), stats["breaks"]
    assert stats["calls_without_logprobs"] > 0


def test_the_rule_by_hand():
    """A continued call adds its context (mask 0, logprob 0.0) then its response; a break starts over."""
    calls = [([1, 2], [3], [-0.5]), ([1, 2, 3, 9], [4, 5], None), ([7], [8], [-0.25])]
    a, b = merge_calls(calls)
    assert (a.prompt, a.response, a.mask, a.n_calls) == ([1, 2], [3, 9, 4, 5], [1, 0, 1, 1], 2)
    assert a.logprobs[:2] == [-0.5, 0.0] and np.isnan(a.logprobs[2:]).all()  # unknown: NaN
    assert (b.prompt, b.response, b.mask, b.logprobs) == ([7], [8], [1], [-0.25])
