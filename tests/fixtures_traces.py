"""Hand-built trace directories (spans, rewards, rollouts Parquet via schemas.PartWriter) and a tiny
local tokenizer with a chat template, for the sample-building, views and SQL tests.

Plain helpers (``span``, ``rollout``, ``reward``, ``write_traces``) are importable
(``from fixtures_traces import span``); the fixtures wrap them with ``tmp_path``.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from lightning_harness.schemas import PartWriter

T0 = dt.datetime(2026, 11, 30, 3, 0, tzinfo=dt.UTC)
_clock = itertools.count()


def default_logprobs(response: list[int] | None, seq: int) -> list[float] | None:
    """Distinct, recognisable logprobs: -(seq + 1) - k/100 for the k-th token of call seq."""
    if response is None:
        return None
    return [-(seq + 1) - k / 100 for k in range(len(response))]


def span(
    rollout_id: str | None,
    seq: int,
    prompt: list[int] | None,
    response: list[int] | None,
    *,
    attempt: int = 0,
    logprobs: Any = "default",
    model_version: int = 0,
    finish_reason: str = "stop",
    error_kind: str | None = None,
    upstream: str = "http://127.0.0.1:9/v1",
    latency_ms: float | None = None,
    **extra: Any,
) -> dict:
    started = T0 + dt.timedelta(milliseconds=10 * next(_clock))
    lat = float(latency_ms if latency_ms is not None else 100 + 10 * seq)
    row = {
        "span_id": uuid.uuid4().hex,
        "rollout_id": rollout_id,
        "attempt": attempt,
        "seq": seq,
        "started_at": started,
        "ended_at": started + dt.timedelta(milliseconds=lat),
        "latency_ms": lat,
        "mode": "reverse",
        "endpoint": "chat.completions",
        "method": "POST",
        "upstream": upstream,
        "model": "policy",
        "model_version": model_version,
        "status_code": 200 if error_kind is None else 502,
        "stream": False,
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_logprobs": default_logprobs(response, seq) if logprobs == "default" else logprobs,
        "finish_reason": finish_reason if error_kind is None else None,
        "n_choices": 1,
        "prompt_tokens": len(prompt) if prompt is not None else None,
        "completion_tokens": len(response) if response is not None else None,
        "error_kind": error_kind,
        "error": None if error_kind is None else f"{error_kind} (test)",
    }
    row.update(extra)
    return row


def rollout(
    rollout_id: str,
    *,
    attempt: int = 0,
    task_id: str = "task-a",
    group_id: str | None = "g0",
    step: int = 0,
    state: str = "succeeded",
    reward: float | None = None,
    **extra: Any,
) -> dict:
    row = {
        "rollout_id": rollout_id,
        "attempt": attempt,
        "run_id": "run-test",
        "task_id": task_id,
        "group_id": group_id,
        "step": step,
        "split": "train",
        "state": state,
        "reward": reward,
        "reward_source": None if reward is None else "file",
        "started_at": T0,
        "ended_at": T0 + dt.timedelta(seconds=5),
        "duration_s": 5.0,
        "model_version": 0,
        "runner": "local",
    }
    row.update(extra)
    return row


def reward(rollout_id: str, value: float, *, attempt: int = 0, at_s: float = 0.0, source: str = "proxy") -> dict:
    return {
        "reward_id": uuid.uuid4().hex,
        "rollout_id": rollout_id,
        "attempt": attempt,
        "reward": float(value),
        "created_at": T0 + dt.timedelta(seconds=at_s),
        "source": source,
        "info_json": "{}",
    }


def write_traces(root: str | Path, spans: Iterable[dict] = (), rollouts: Iterable[dict] = (),
                 rewards: Iterable[dict] = ()) -> Path:
    """Write the rows as real Parquet parts (one part per table per call)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for table, rows in (("spans", spans), ("rollouts", rollouts), ("rewards", rewards)):
        rows = list(rows)
        if rows:
            with PartWriter(root, table, background=False, fsync=False) as w:
                w.extend(rows)
    return root


def drop_column(root: str | Path, table: str, column: str) -> None:
    """Rewrite every part of ``table`` without ``column``: a store written before the column existed."""
    import pyarrow.parquet as pq

    for part in (Path(root) / table).glob("**/*.parquet"):
        pq.write_table(pq.read_table(part).drop_columns([column]), part)


@pytest.fixture
def make_traces(tmp_path):
    """``make_traces(spans=[...], rollouts=[...], rewards=[...]) -> Path`` in a fresh directory."""
    counter = itertools.count()

    def _make(spans=(), rollouts=(), rewards=()) -> Path:
        return write_traces(tmp_path / f"traces{next(counter)}", spans, rollouts, rewards)

    return _make


# ---- a tiny word-level tokenizer with a ChatML-like template -----------------------------------
TINY_VOCAB = [
    "[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "tool",
    "hello", "hi", "there", "what", "is", "two", "plus", "three", "five", "answer", "ok", "thanks",
]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_ids(*words: str) -> list[int]:
    """Token ids of words in the tiny vocabulary (what the tokenizer must produce)."""
    return [TINY_VOCAB.index(w) for w in words]


def build_tiny_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        eos_token="<|im_end|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def chat_bodies(messages: list[dict], answer: str, *, logprobs: list[float] | None = None,
                tokens: list[str] | None = None) -> dict:
    """request_json / response_json of a chat call without token ids (for retokenisation); ``tokens``:
    the logprob entries' token strings (the builder keeps logprobs only where they name its tokens)."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
    if logprobs is not None:
        names = tokens or ["?"] * len(logprobs)
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp} for t, lp in zip(names, logprobs)]}
    return {
        "request_json": json.dumps({"model": "policy", "messages": messages}),
        "response_json": json.dumps({"id": "x", "object": "chat.completion", "choices": [choice]}),
    }
