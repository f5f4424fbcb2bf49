"""Merging: how a rollout's model calls become trajectory samples.

The rule (:func:`merge_calls`, the specification). Within a rollout attempt, calls are taken in
``seq`` order. Call *i* joins the sample of call *i-1* when its prompt ids start with the full token
history ``prompt(i-1) + response(i-1)``; the tokens after that history (tool results, user turns
the harness inserted) become masked context (mask 0, logprob 0.0) followed by call *i*'s response
(mask 1). Otherwise a new sample starts with call *i*'s prompt.

The fast path (:func:`merge`) gives the same answer on flat token arrays: because a merged call's
prompt starts with the history, the history after call *i-1* is always exactly ``prompt(i-1) +
response(i-1)``, so the test is pairwise between consecutive calls and is done for all calls at
once (numpy), with no loop over rows. tests/test_samples_spec.py checks it against the rule.

When a call does not continue the history, the new sample records why (heuristics, checked in
order; ``lcp`` = longest common prefix of the new prompt and the history ``H``):

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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

MODES = ("trajectory", "transition")  # consecutive calls of a rollout merged into one sample, or not

BREAK_REASONS = ("template_change", "retokenization", "truncation", "other")
_CHUNK = 1 << 23  # tokens compared per numpy chunk (bounds temporary memory to ~100 MB)


# -- the rule, written plainly ---------------------------------------------------------------------
@dataclass
class MergedSample:
    """One trajectory sample: the first call's prompt, then every call's context and response."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 = a model token, 0 = context
    logprobs: list[float] = field(default_factory=list)  # 0.0 on context, NaN where unknown
    n_calls: int = 0

    def add(self, context: Sequence[int], response: Sequence[int], logprobs: Sequence[float] | None) -> None:
        if logprobs is None or len(logprobs) != len(response):  # unknown: the update recomputes them
            logprobs = [math.nan] * len(response)
        self.response += [*context, *response]
        self.mask += [0] * len(context) + [1] * len(response)
        self.logprobs += [0.0] * len(context) + [float(x) for x in logprobs]
        self.n_calls += 1


def merge_calls(calls: Iterable[tuple[Sequence[int], Sequence[int], Sequence[float] | None]]) -> list[MergedSample]:
    """The merge rule: one rollout attempt's calls ``(prompt ids, response ids, logprobs)`` in
    ``seq`` order -> its samples. A call whose prompt starts with the previous call's prompt +
    response continues that sample; any other call starts a new one."""
    samples: list[MergedSample] = []
    history: list[int] | None = None
    for prompt, response, logprobs in calls:
        prompt = list(prompt)
        if history is not None and prompt[: len(history)] == history:
            samples[-1].add(prompt[len(history):], response, logprobs)
        else:
            samples.append(MergedSample(prompt))
            samples[-1].add((), response, logprobs)
        history = prompt + list(response)
    return samples


# -- flat arrays: a list column as (values, offsets) numpy views, and segment operations -----------
def flat(col: pa.ChunkedArray | pa.Array, value_type: pa.DataType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, offsets[n+1], valid[n]) of a list column; null lists have length 0 and valid False."""
    arr = col
    # one chunk is taken as it is: combine_chunks would copy it (500 MB of prompts at 100k spans)
    if isinstance(col, pa.ChunkedArray):
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    arr = arr.cast(pa.list_(value_type)) if arr.type != pa.list_(value_type) else arr
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool) if len(arr) else np.zeros(0, bool)
    offsets = np.asarray(arr.offsets.to_numpy(), dtype=np.int64)  # n + 1 entries, even for n = 0
    return arr.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]], offsets - offsets[0], valid


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """A view of a cached ``arange(n)``: building index arrays is then one pass, not two."""
    global _ARANGE
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, _CHUNK + 1), dtype=np.int64)
    return _ARANGE[:n]


def segment_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + l)`` for every segment, without a Python loop."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_starts = np.cumsum(lens) - lens
    idx = np.repeat(np.asarray(starts, dtype=np.int64) - out_starts, lens)
    idx += _arange(total)
    return idx


def _first_bad(out: np.ndarray, row0: int, bad: np.ndarray, seg_starts: np.ndarray) -> None:
    """Write into ``out[row0 + k]`` the offset in segment k of its first mismatch (``bad``: the
    mismatching positions in the concatenated segments, which start at ``seg_starts``)."""
    if not len(bad):
        return
    seg = np.searchsorted(seg_starts, bad, side="right") - 1
    # several segments share a start when some have length 0: searchsorted(right) picks the last
    first_seg, first_pos = np.unique(seg, return_index=True)
    out[row0 + first_seg] = bad[first_pos] - seg_starts[first_seg]


def _first_mismatch(a: np.ndarray, a_starts: np.ndarray, b: np.ndarray, b_starts: np.ndarray,
                    lens: np.ndarray) -> np.ndarray:
    """For each segment k: the first j < lens[k] with a[a_starts+j] != b[b_starts+j], else lens[k].

    Chunked over segments so the temporary index arrays stay small.
    """
    lens = np.asarray(lens, dtype=np.int64)
    out = lens.copy()
    k0 = 0
    while k0 < len(lens):
        # take segments until about _CHUNK tokens (at least one segment)
        k1 = k0 + max(1, int(np.searchsorted(np.cumsum(lens[k0:]), _CHUNK, side="right")))
        seg_lens = lens[k0:k1]
        if int(seg_lens.sum()):
            ia = segment_index(a_starts[k0:k1], seg_lens)
            va = a[ia]
            ia += np.repeat(b_starts[k0:k1] - a_starts[k0:k1], seg_lens)  # now indexes b
            _first_bad(out, k0, np.flatnonzero(va != b[ia]), np.cumsum(seg_lens) - seg_lens)
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
    bounds = np.append(np.flatnonzero(first), n)
    ends_tokens = p_off[bounds]  # greedy chunks of whole rollouts, about _CHUNK prompt tokens each
    r0_i = 0
    while r0_i < len(bounds) - 1:
        r1_i = max(r0_i + 1, int(np.searchsorted(ends_tokens, ends_tokens[r0_i] + _CHUNK, side="right")) - 1)
        r1_i = min(r1_i, len(bounds) - 1)
        r0, r1 = int(bounds[r0_i]), int(bounds[r1_i])
        seg = p_val[p_off[r0]:p_off[r1]]
        L1, PL = len1[r0:r1], pl[r0:r1]
        NL = np.append(L1[1:], 0)  # the part of each prompt the next call compares against
        m = r1 - r0
        pattern = np.tile(np.array([1, 0], dtype=np.int8), m)
        lens_a = np.empty(2 * m, dtype=np.int64)
        lens_a[0::2], lens_a[1::2] = L1, PL - L1
        lens_b = np.empty(2 * m, dtype=np.int64)
        lens_b[0::2], lens_b[1::2] = NL, PL - NL
        a = seg[np.repeat(pattern, lens_a).view(bool)]
        b = seg[np.repeat(pattern, lens_b).view(bool)]
        _first_bad(out, r0, np.flatnonzero(a != b), np.cumsum(L1) - L1)
        r0_i = r1_i
    return out


# -- the fast path ---------------------------------------------------------------------------------
@dataclass
class TokenArrays:
    """The calls' token ids as flat arrays, one row per call in rollout then ``seq`` order
    (views of the Arrow buffers, no copies)."""

    p_val: np.ndarray  # prompt ids of all calls, concatenated; p_off[i]:p_off[i+1] is call i's
    p_off: np.ndarray
    r_val: np.ndarray  # response ids, likewise
    r_off: np.ndarray
    pl: np.ndarray  # prompt and response lengths
    rl: np.ndarray
    ridx: np.ndarray  # the rollout attempt each call belongs to
    first: np.ndarray  # the first call of its rollout attempt

    @classmethod
    def of(cls, calls: pa.Table) -> TokenArrays:
        p_val, p_off, _ = flat(calls["prompt_token_ids"], pa.int32())
        r_val, r_off, _ = flat(calls["response_token_ids"], pa.int32())
        ridx = calls["ridx"].to_numpy().astype(np.int64)
        first = np.ones(calls.num_rows, dtype=bool)
        first[1:] = ridx[1:] != ridx[:-1]
        return cls(p_val, p_off, r_val, r_off, np.diff(p_off), np.diff(r_off), ridx, first)


@dataclass
class Merge:
    """Per call: whether it continues the previous call's history, that history's length, and
    why not (index into BREAK_REASONS, -1 = no break)."""

    continues: np.ndarray
    hist: np.ndarray  # len(prompt(i-1) + response(i-1)); 0 for a rollout's first call
    reason: np.ndarray


def merge(tok: TokenArrays, finish_reason: np.ndarray, retok: np.ndarray) -> Merge:
    """The rule of :func:`merge_calls` for all calls at once: prompt(i) starts with prompt(i-1) +
    response(i-1). First the prompts are compared (``lcp`` of consecutive prompts); where the new
    prompt keeps the previous one whole, its next tokens are compared with the previous response."""
    n, pl, rl, first = len(tok.first), tok.pl, tok.rl, tok.first
    prev = np.flatnonzero(~first)  # rows with a predecessor in the same rollout
    lcp = np.zeros(n, dtype=np.int64)
    hist = np.zeros(n, dtype=np.int64)
    if len(prev):
        pp = prev - 1
        hist[prev] = pl[pp] + rl[pp]
        m1 = _prompt_vs_previous_prompt(tok.p_val, tok.p_off, pl, first)[prev]
        lcp[prev] = m1
        w = prev[(m1 == pl[pp]) & (pl[prev] > pl[pp])]
        if len(w):
            len2 = np.minimum(pl[w] - pl[w - 1], rl[w - 1])
            lcp[w] += _first_mismatch(tok.p_val, tok.p_off[w] + pl[w - 1], tok.r_val, tok.r_off[w - 1], len2)
    continues = ~first & (lcp == hist)
    return Merge(continues, hist, _break_reasons(finish_reason, first, continues, lcp, hist, pl, retok))


def _break_reasons(finish_reason, first, continues, lcp, hist, pl, retok) -> np.ndarray:
    """Code (index into BREAK_REASONS, -1 = no break) for each call; heuristics in the module doc."""
    n = len(first)
    code = np.full(n, -1, dtype=np.int8)
    brk = np.flatnonzero(~first & ~continues)
    if not len(brk):
        return code
    pp = brk - 1
    prev_len = np.asarray(finish_reason[pp] == "length", dtype=bool)
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
