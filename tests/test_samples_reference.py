"""The vectorised merge equals a plain Python reference on random traces (small chunks forced, so
the chunked numpy paths run many times)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures_traces import rollout, span

from lightning_harness.trainer import merge as M
from lightning_harness.trainer import samples as S


def reference_samples(spans: list[dict]) -> dict[str, tuple]:
    """The merge rule written the obvious way: one rollout, one call at a time."""
    out: dict[str, tuple] = {}
    by_rollout: dict[str, list[dict]] = {}
    for s in spans:
        by_rollout.setdefault(s["rollout_id"], []).append(s)
    for rid, calls in by_rollout.items():
        calls.sort(key=lambda c: c["seq"])
        cur = None
        index = -1
        for c in calls:
            P, R, L = c["prompt_token_ids"], c["response_token_ids"], c["response_logprobs"]
            if cur is not None and P[: len(cur["hist"])] == cur["hist"]:
                ctx = P[len(cur["hist"]):]
                cur["resp"] += ctx + R
                cur["mask"] += [0] * len(ctx) + [1] * len(R)
                cur["lp"] += [0.0] * len(ctx) + list(L)
            else:
                index += 1
                cur = {"prompt": list(P), "resp": list(R), "mask": [1] * len(R), "lp": list(L)}
                out[f"{rid}~0~{index}"] = cur
            cur["hist"] = list(P) + list(R)
    return {k: (v["prompt"], v["resp"], v["mask"], v["lp"]) for k, v in out.items()}


def random_spans(rng: np.random.Generator, n_rollouts: int) -> list[dict]:
    spans = []
    for r in range(n_rollouts):
        rid = f"r{r:03d}"
        P = rng.integers(0, 50, rng.integers(1, 12)).tolist()
        for seq in range(int(rng.integers(1, 7))):
            R = rng.integers(0, 50, rng.integers(0, 6)).tolist()
            spans.append(span(rid, seq, P, R, logprobs=(-rng.random(len(R))).astype(np.float32).tolist()))
            H = P + R
            kind = rng.choice(["continue", "continue", "flip", "cut", "new", "exact"])
            if kind == "continue":
                P = H + rng.integers(0, 50, rng.integers(0, 5)).tolist()
            elif kind == "exact":
                P = list(H)
            elif kind == "flip" and H:
                P = H + [7]
                P[int(rng.integers(0, len(H)))] += 100
            elif kind == "cut":
                P = H[: int(rng.integers(0, len(H) + 1))]
                if not P:
                    P = [1]
            else:
                P = rng.integers(0, 50, rng.integers(1, 10)).tolist()
    rng.shuffle(spans)  # storage order must not matter
    return spans


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_merge_equals_reference(make_traces, monkeypatch, seed):
    monkeypatch.setattr(M, "_CHUNK", 7)  # the fast path lives in merge.py
    rng = np.random.default_rng(seed)
    spans = random_spans(rng, 40)
    rollouts = [rollout(f"r{r:03d}", reward=float(r % 3)) for r in range(40)]
    table, stats = S.build_samples(make_traces(spans=spans, rollouts=rollouts))
    want = reference_samples(spans)
    got = {r["sample_id"]: (r["prompt_token_ids"], r["response_token_ids"], r["response_mask"], r["response_logprobs"])
           for r in table.to_pylist()}
    # samples without any model token are dropped (and counted); the reference keeps them
    dropped = {k for k, v in want.items() if sum(v[2]) == 0}
    assert stats["samples_dropped_no_model_tokens"] == len(dropped)
    # sample ids keep their position in the rollout even when an earlier sample was dropped
    assert set(got) == set(want) - dropped
    for k, (p, r, m, lp) in got.items():
        wp, wr, wm, wlp = want[k]
        assert (p, r, m) == (wp, wr, wm), k
        assert lp == pytest.approx(wlp), k
    assert len(got) + len(dropped) == len(want)
    assert stats["calls_continuing_history"] > 10 and sum(stats["breaks"].values()) > 10  # both paths ran
