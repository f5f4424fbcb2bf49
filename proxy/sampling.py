"""What a request asked of the sampler: the settings that shape the distribution its tokens were drawn from.

The engine records the logprobs of the distribution it sampled from (``--logprobs-mode
processed_logprobs``, launcher/engine.py): after temperature, top-k/p/min-p, penalties, logit_bias
and output constraints. The update computes the policy's logprobs at one temperature over the whole
vocabulary. A call sampled otherwise (a harness that sends ``temperature: 0.7`` or ``top_p: 0.95``
while the update assumes 1.0, a ``tool_choice: "required"`` grammar) is trained with importance
weights far from 1 from the first step: clipped, or weighted down, for reasons that have nothing to
do with learning. The proxy cannot change what a harness asks; it records it (span column
``sampling_json``), and the samples builder counts the calls the update does not reproduce.

Values are read as vLLM reads them (lax numbers: ``"0.7"`` is 0.7) and kept normalised: the
temperature whenever one is given, any other setting only where it is not neutral, lists and maps
by their size and constraints by their kind (never the harness's text: this column is not redacted).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .assemble import _engine_float, engine_flag

# neutral value of each numeric setting (vLLM's defaults with --generation-config vllm); top_k: 0 and -1 are off
_NUMERIC = {"top_p": 1.0, "top_k": 0.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "min_tokens": 0.0}
_SIZED = ("logit_bias", "allowed_token_ids", "bad_words")  # a non-empty one masks or shifts logits
_GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_FORMATS = ("json_object", "json_schema", "structural_tag", "grammar", "regex", "choice")


def _finite(value: float) -> float | str:
    """A number JSON can hold; NaN and infinities as text (vLLM refuses them: the call is an error)."""
    return value if math.isfinite(value) else str(value)


def _neutral(name: str, value: float) -> bool:
    return value in (0.0, -1.0) if name == "top_k" else value == _NUMERIC[name]


def _constraint(request: dict) -> str | None:
    """The kind of output constraint a request sets (a grammar masks the logits), or None."""
    rf = request.get("response_format")
    text = request.get("text")
    for fmt in (rf, text.get("format") if isinstance(text, dict) else None):  # chat/completions, Responses
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in (None, "text"):
            return kind if kind in _FORMATS else "other"
    choice = request.get("tool_choice")
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") in ("function", "tool", "any")):
        return "tool_choice"
    return next((k for k in _GUIDED if request.get(k) not in (None, "", {}, [])), None)


def sampling_settings(request: Any) -> dict[str, Any]:
    """The settings of ``request`` (a chat, completions, Responses or Messages body) that shape the
    sampling distribution, normalised (see the module doc); ``{}``: the engine's defaults."""
    if not isinstance(request, dict):
        return {}
    out: dict[str, Any] = {}
    t = _engine_float(request.get("temperature"))
    if t is not None:
        out["temperature"] = _finite(t)
    for name in _NUMERIC:
        v = _engine_float(request.get(name))
        if v is not None and not _neutral(name, v):
            out[name] = _finite(v)
    for name in _SIZED:
        v = request.get(name)
        if isinstance(v, (dict, list)) and v:
            out[name] = len(v)
    if engine_flag(request.get("use_beam_search")):
        out["use_beam_search"] = True
    kind = _constraint(request)
    if kind is not None:
        out["constraint"] = kind
    return out


def sampling_json(request: Any) -> str | None:
    """:func:`sampling_settings` as the span's ``sampling_json`` (None when it is empty)."""
    s = sampling_settings(request)
    return json.dumps(s, separators=(",", ":"), sort_keys=True) if s else None


def unlike_update(settings: dict[str, Any], temperature: float, default_temperature: float = 1.0) -> list[str]:
    """The settings (recorded by :func:`sampling_settings`) by which a call's sampling distribution
    differs from the one the update computes: the policy at ``temperature``, whole vocabulary, no
    penalty or constraint. A call that gave no temperature was sampled at the engine's
    ``default_temperature`` (1, or what it was started with: launcher/engine.py)."""
    t = settings.get("temperature", default_temperature)
    same = isinstance(t, (int, float)) and abs(t - temperature) <= 1e-6 * max(1.0, abs(temperature))
    off = [] if same else ["temperature"]
    return off + sorted(k for k in settings if k != "temperature")
