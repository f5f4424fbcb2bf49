"""Spans -> training samples: selecting rollouts, retokenising, merging, advantages, loss weights.

``build_samples(traces_dir | con, options=None, **keywords)`` returns ``(pyarrow.Table with
schemas.SAMPLES, stats)``; the settings are one :class:`SampleOptions` (its fields may be given as
keywords).

Merging (``mode="trajectory"``, the default): consecutive calls of a rollout whose prompt extends
the previous prompt + response become one sample; the rule, its fast path and the break reasons
are in ``merge.py``. ``mode="transition"``: one sample per call (no merging; ``break_reason`` is
null; the ``breaks`` statistics still say what trajectory mode would have done).

Limits: a sample whose prompt exceeds ``max_prompt_len`` is dropped; a response longer than
``max_response_len`` is cut (``response_truncated``); a sample left without any model token is
dropped. All three are counted. Sample ids (``rollout~attempt~index``) keep their index in the
rollout even when an earlier sample was dropped.

Samples per rollout: a rollout keeps at most ``max_samples_per_rollout`` samples (default 256; 0 or
None: no cap). Why: per-rollout loss weights make a rollout of N samples weigh as much as one of
one, but the update's cost still grows with N, so a harness that repeats a call N times, or
breaks its history at every call so that nothing merges, could make every update as slow as it
likes. A rollout over the cap (after the limits above) keeps a uniform random subset of that many
samples, in their order, drawn with a generator seeded from the rollout's key (a rebuild keeps the
same ones); its loss weights are then computed over what it kept, like any rollout's.
Counted (``rollouts_capped``, ``samples_capped``) and logged once per build.

Retokenisation: a span without token ids (an upstream that does not return them) is rebuilt from
``request_json``/``response_json`` with the tokenizer's chat template when ``tokenizer`` is given
(flagged ``retokenized``; its logprobs are NaN unless the response carried per-token logprobs of the
same length: the update must recompute them). Messages and Responses calls are first put in their
chat form by ``proxy.assemble.as_chat`` (the code that knows those formats). The messages reach the
template as vLLM 0.32's chat renderer hands them (``_as_engine_reads``: content as text or as parts,
by vLLM's reading of the template; reasoning under both names; tool call arguments as objects; the
reasoning effort; ``developer`` messages as system ones where the template does not name the role),
and prompts are encoded with the tokenizer's BOS where vLLM adds it (completions, unless
``add_special_tokens`` is false), so the rebuilt prompt is the engine's. Engine flags the trainer
does not see (``--default-chat-template-kwargs``, ``--chat-template-content-format``) are not
modelled. Without a tokenizer
such calls are dropped and counted; the next call then usually still merges (its prompt contains
the dropped exchange, which becomes masked context). Where ids exist and a tokenizer is given,
``drift_check`` spans are also retokenised and compared, and the drift is reported (prompt: ids
differ; response: the returned ids do not start the re-rendered assistant turn, which ends with the
end-of-turn token).

Rewards, advantages and weights: see ``advantages.py`` (rollout-level, group-normalised, explicit
failure policy) and ``weights.py`` (rollout / token-mean / seq-mean). Every selected rollout that
passes the failure policy is a member of its group's statistics, even one without usable calls.
Calls that ended in an error are not trained on (counted), nor calls that asked for several
choices (``n > 1``: the span holds choice 0, the harness may have gone on with another;
``calls_multi_choice``), nor calls to a host the harness chose itself through the forward proxy
(``spans.routed`` false: that server's answer, not the policy's; ``calls_unrouted``).

Sampling: a call sampled otherwise than the update computes its policy (another temperature than
``temperature``, top-p/k, min-p, penalties, logit_bias, an output constraint; the proxy records what
the request set, ``spans.sampling_json``, proxy/sampling.py) is trained on, but counted
(``calls_other_sampling``, per setting in ``other_sampling``) and logged: its recorded logprobs are
those of another distribution, so its importance weights stray from 1 from the first step.

Secrets: a span with ``secret_detected`` (the proxy masked a known credential or a provider key in
its request or response text and emptied its token ids) is left out (``calls_secret_detected``)
unless ``include_secret_spans=True`` (config ``samples.include_secret_spans``). Included, it has
no token ids and is retokenised from the masked text like any span without ids (so it needs a
tokenizer, and the model learns on ``[REDACTED]`` where the secret was, not on what it saw).

Speed: one DuckDB query hands Arrow list columns to numpy without copies; merging and assembly
are array arithmetic. ``stats["timings_s"]``/``["cpu_s"]`` give the phases; scripts/bench_samples.py
measures the whole.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..proxy.anthropic import BILLING_HEADER
from ..proxy.assemble import CHAT, TEXT_PARTS, as_chat, token_fields
from ..proxy.lax import engine_flag
from ..proxy.sampling import unlike_update
from ..schemas import SAMPLES
from . import advantages as adv_mod
from . import weights as w_mod
from .merge import BREAK_REASONS, MODES, Merge, TokenArrays, flat, merge, segment_index
from .views import connect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleOptions:
    """How samples are built; checked when made (a bad value fails before any data is read).

    ``group_by``: SQL expression over the ``rollouts`` view giving the advantage group (default
    ``group_id``; a rollout whose group is null is its own group and is reported as a singleton).
    ``steps``: a step or steps to take rollouts from (None: all); ``where``: an extra SQL predicate
    on the ``rollouts`` view (e.g. ``"split = 'train'"``). Both are SQL the operator writes; the
    values given here (steps, rollout ids) are bound as parameters. ``include_secret_spans``: train
    on spans the proxy found a secret in (retokenised from the masked text). ``rollouts``: only
    these rollout ids can be selected; from a traces directory only their rows are read
    (``views.connect``), so the cost follows the rollouts selected, not the store's size. Others:
    see the module doc, ``advantages.py`` and ``weights.py``.
    """

    mode: str = "trajectory"
    tokenizer: Any = None  # a local tokenizer directory or object (retokenisation, drift check)
    group_by: str = "group_id"
    advantage: str = "grpo"
    norm_by_std: bool = True
    epsilon: float = 1e-6
    failed_policy: str = "drop"
    failed_reward: float | None = None
    # (low, high): every reward (a penalty too) clipped into it before the group advantages; None: as reported
    reward_clip: tuple[float, float] | None = None
    weight_mode: str = "rollout"
    max_prompt_len: int | None = None
    max_response_len: int | None = None
    steps: int | Iterable[int] | None = None
    where: str | None = None
    drift_check: int = 256
    include_secret_spans: bool = False
    rollouts: Iterable[str] | None = None
    max_samples_per_rollout: int | None = 256  # 0 or None: no cap (see the module doc)
    temperature: float = 1.0  # the update's; calls sampled otherwise are counted (``calls_other_sampling``)
    # what the engine applies to a call that gives no sampling setting (VLLMEngine.default_sampling;
    # None: not known)
    engine_defaults: Mapping[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.engine_defaults is not None and not isinstance(self.engine_defaults, Mapping):
            raise ValueError(f"engine_defaults must be a mapping or None, got {self.engine_defaults!r}")
        for name, value, known in (("mode", self.mode, MODES), ("weight mode", self.weight_mode, w_mod.MODES),
                                   ("advantage estimator", self.advantage, adv_mod.ESTIMATORS),
                                   ("failed policy", self.failed_policy, adv_mod.FAILED_POLICIES)):
            if value not in known:
                raise ValueError(f"unknown {name} {value!r}; choose from {known}")
        for name in ("max_prompt_len", "max_response_len"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_numbers()
        steps = self.steps  # kept as tuples: an iterator given once is read once
        if steps is not None:
            object.__setattr__(self, "steps",
                               (int(steps),) if isinstance(steps, (int, np.integer)) else tuple(int(s) for s in steps))
        if self.rollouts is not None:
            object.__setattr__(self, "rollouts", tuple(sorted({str(r) for r in self.rollouts})))

    def _check_numbers(self) -> None:
        """The numeric options, checked here so that a config's ``samples.extra`` fails when it loads
        (``config._check_sample_options``), not at the first update after a step's rollouts."""
        cap = self.max_samples_per_rollout
        if cap is not None and not (_whole_number(cap) and cap >= 0):
            raise ValueError(f"max_samples_per_rollout must be a whole number >= 0 (0 or null: no cap), got {cap!r}")
        if not (_whole_number(self.drift_check) and self.drift_check >= 0):
            raise ValueError(f"drift_check must be a whole number >= 0, got {self.drift_check!r}")
        if not (_real_number(self.epsilon) and 0 <= self.epsilon < math.inf):
            raise ValueError(f"epsilon must be a finite number >= 0, got {self.epsilon!r}")
        penalty = self.failed_reward
        if penalty is not None and not (_real_number(penalty) and math.isfinite(penalty)):
            raise ValueError(f"failed_reward must be a finite number, got {penalty!r}")
        if self.failed_policy == "penalize" and penalty is None:
            raise ValueError("failed_policy 'penalize' needs an explicit finite failed_reward")
        clip = self.reward_clip
        if clip is None:
            return
        pair = list(clip) if isinstance(clip, Iterable) and not isinstance(clip, (str, bytes, Mapping)) else []
        if len(pair) != 2 or not all(map(_real_number, pair)):
            raise ValueError(f"reward_clip must be two numbers [low, high] (or null), got {clip!r}")
        low, high = (float(v) for v in pair)
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"reward_clip must be two finite numbers with low < high, got {clip!r}")
        object.__setattr__(self, "reward_clip", (low, high))


def _real_number(value: Any) -> bool:
    """A real number as JSON or YAML gives one (a bool is not)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _whole_number(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


# -- retokenisation --------------------------------------------------------------------------------
def load_tokenizer(path_or_tokenizer: Any) -> Any:
    """A tokenizer object from a local directory (never the hub), or the object itself."""
    if path_or_tokenizer is None or not isinstance(path_or_tokenizer, (str, os.PathLike)):
        return path_or_tokenizer
    from transformers import AutoTokenizer

    if not os.path.isdir(path_or_tokenizer):
        raise FileNotFoundError(f"tokenizer directory {str(path_or_tokenizer)!r} does not exist")
    return AutoTokenizer.from_pretrained(str(path_or_tokenizer), local_files_only=True)


def _encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """``text``'s ids; ``special``: with the tokenizer's own (BOS), as vLLM encodes a completions
    prompt unless it says ``add_special_tokens: false`` (a chat prompt's template writes its own)."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _template_kwargs(req: dict) -> dict[str, Any]:
    """What the engine rendered the chat template with besides the messages: the tools, the
    request's ``chat_template_kwargs`` (``enable_thinking: false`` changes the prompt), less any that
    would override how this function renders, and its ``reasoning_effort`` as vLLM 0.32 adds it."""
    extra = req.get("chat_template_kwargs")
    kw = {k: v for k, v in extra.items() if isinstance(k, str) and k not in _RENDER_KEYS} \
        if isinstance(extra, dict) else {}
    effort = req.get("reasoning_effort")
    if effort is not None:  # vLLM hands it to the template, and thinking on unless "none" (a Messages
        kw["reasoning_effort"] = effort  # call's output_config.effort, or thinking disabled)
        if not (isinstance(extra, dict) and "enable_thinking" in extra):
            kw["enable_thinking"] = effort != "none"
    if req.get("tools"):
        kw["tools"] = [_tool_as_engine_reads(t) for t in req["tools"]] if isinstance(req["tools"], list) \
            else req["tools"]
    return kw


def _tool_as_engine_reads(tool: Any) -> Any:
    """A chat tool as vLLM (0.32) hands it to the template, its request model's dump: the function's
    ``name``, ``description`` and ``parameters`` in that order (null when absent), ``strict`` and
    ``defer_loading`` where set, nothing else. A template that writes the tools as JSON shows
    exactly that (the Messages translation, for one, puts the description after the parameters)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict):
        return tool
    defer = tool.get("defer_loading")
    out = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}
    own = fn.get("defer_loading")
    for key, value in (("strict", fn.get("strict")), ("defer_loading", defer if own is None else own)):
        if value is not None:
            out[key] = engine_flag(value)  # (its model's bool: "true" or 1 reach the template as true)
    return {"type": "function", "function": out,
            **({"defer_loading": engine_flag(defer)} if defer is not None else {})}


def _as_engine_reads(messages: Any, content_format: str = "string") -> Any:
    """``messages`` as vLLM's chat renderer (0.32, ``chat_utils.parse_chat_messages``) hands them to
    the template: a system text (or text part) starting with Claude Code's billing header loses that
    first line (a per-request hash); each message goes through :func:`_engine_message`."""
    if not isinstance(messages, list):
        return messages
    return [_engine_message({**m, "content": _without_billing_header(m.get("content"))}
                            if isinstance(m, dict) and m.get("role") == "system" else m, content_format)
            for m in messages]


def _engine_message(message: Any, content_format: str) -> Any:
    """One chat message as vLLM hands it to the template: its content as :func:`_engine_content`
    gives it (a tool message's texts always joined: vLLM's templates take a tool result as text), an
    assistant's ``reasoning`` (or the older ``reasoning_content``) under both names, as a template
    may read either (a Messages turn's thinking blocks arrive as ``reasoning``), its tool calls'
    arguments as objects."""
    if not isinstance(message, dict):
        return message
    role = message.get("role")
    content = _engine_content(message.get("content"), content_format)
    if role == "tool" and isinstance(content, list) and all(p.get("type") == "text" for p in content):
        content = "\n".join(p["text"] for p in content)  # (parts named otherwise, tool_reference, stay)
    out = {**message, "content": content}
    if role == "assistant":
        reasoning = message.get("reasoning")
        reasoning = message.get("reasoning_content") if reasoning is None else reasoning
        out.pop("reasoning", None)
        out.pop("reasoning_content", None)
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
        if isinstance(out.get("tool_calls"), list):
            out["tool_calls"] = [_engine_tool_call(c) for c in out["tool_calls"]]
            if not out["tool_calls"]:
                del out["tool_calls"]  # (vLLM drops an empty list: the template's plain assistant path)
    return out


def _engine_tool_call(call: Any) -> Any:
    """A tool call as vLLM hands it to the template: its arguments a JSON object (``{}`` where they are
    empty, not JSON or not an object): a template that writes them as JSON shows vLLM's spelling."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
    return {**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}


_KNOWN_PART_FIELDS = frozenset({  # a part's fields vLLM 0.32 reads itself; the others reach the template
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
    "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url"})


def _engine_content(content: Any, content_format: str) -> Any:
    """A message's content as vLLM's renderer passes it: for a ``string`` template the texts joined
    with newlines (none: ``""``), for an ``openai`` one (it iterates over the parts) the list of
    parts (a string is one text part). Parts vLLM reads as text (``refusal``, ``thinking``,
    ``input_text``...) are text parts, a text or refusal part without its text is left out, and a
    ``tool_reference`` (Claude Code's tool search) is its tool's name. Content with other parts
    (images) is left as it is: vLLM puts the model's placeholders there, which only the engine knows."""
    if content is None:
        content = []
    if isinstance(content, str):
        return content if content_format == "string" else [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return content
    parts = []
    for p in content:
        p = {"type": "text", "text": p} if isinstance(p, str) else p
        kind = p.get("type") if isinstance(p, dict) else None
        text = p.get(TEXT_PARTS[kind]) if kind in TEXT_PARTS else None
        if kind in ("text", "refusal") and text is None:
            continue
        if isinstance(text, str):
            extra = {k: v for k, v in p.items() if k not in _KNOWN_PART_FIELDS}
            parts.append({"type": "text", "text": text, **extra})
        elif kind == "tool_reference" and isinstance(p.get("name"), str):
            parts.append({"type": "tool_reference", "name": p["name"]})
        else:
            return content
    if content_format == "string":
        return "\n".join(p.get("text", p.get("name")) for p in parts)
    return parts


def _chat_template(tokenizer: Any, tools: Any) -> str | None:
    """The template the tokenizer picks for these tools, as vLLM picks it."""
    try:
        template = tokenizer.get_chat_template(None, tools or None)
    except Exception:  # no template (apply_chat_template then says so) or an older tokenizer class
        template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def _developer_as_system(messages: list, template: str | None) -> list:
    """``developer`` messages (the OpenAI SDK's, Codex's) as vLLM 0.32 renders them for a template
    that never names that role (renderers/hf.py): system messages, then every system message merged
    into one at the start (texts joined by a blank line) unless there is one, first. A template
    that names the role gets them as they are."""
    if template is None or '"developer"' in template or "'developer'" in template \
            or not any(isinstance(m, dict) and m.get("role") == "developer" for m in messages):
        return messages
    converted = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
                 if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]
    texts, rest, merge = [], [], False
    for i, m in enumerate(converted):
        if not (isinstance(m, dict) and m.get("role") == "system"):
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else converted


@functools.lru_cache(maxsize=32)
def _template_content_format(template: str) -> str:
    """``openai`` or ``string`` for a template's source, by vLLM 0.32's rule (renderers/hf.py
    ``_detect_content_format``): a ``for`` loop over ``<message>.content`` (a message being a loop
    variable over ``messages`` or a name set from it), over a name ``content`` outside macros, or, in a
    macro, over a parameter that a call passes a message's content to. Unparsable: ``string``."""
    from jinja2 import nodes

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        root = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return "string"
    messages = _names_bound_to(root, "messages")
    items = {loop.target.name for loop in root.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, m) for m in messages)}
    params: dict[int, set[str]] = {}
    in_macro: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        passed = _content_params(root, macro, items)
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if passed:
                params[id(loop)] = passed
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if any(_reads(it, m, "content") for m in items) or isinstance(it, nodes.Name) and (
                it.name in params.get(id(loop), ()) or id(loop) not in in_macro and it.name == "content"):
            return "openai"
    return "string"


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """Whether a template expression reads the variable ``name`` (its item ``key`` when given),
    through filters, tests and slices (``messages[1:]``, ``message.content | list``)."""
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            node = node.node
        elif isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _names_bound_to(root: Any, name: str) -> set[str]:
    """``name`` and every name a template sets from it, or from such a name (``{% set m = messages %}``)."""
    from jinja2 import nodes

    names, queue = {name}, [name]
    while queue:
        current = queue.pop()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _reads(assign.node, current):
                names.add(target.name)
                queue.append(target.name)
    return names


def _content_params(root: Any, macro: Any, items: set[str]) -> set[str]:
    """The parameters of ``macro`` that a call passes a message's content to (by position or name)."""
    from jinja2 import nodes

    names = [a.name for a in macro.args]
    out = set()
    for call in root.find_all(nodes.Call):
        if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
            continue
        for i, arg in enumerate(call.args[:len(names)]):
            if any(_reads(arg, m, "content") for m in items):
                out.add(names[i])
        for kw in call.kwargs:
            if kw.key in names and any(_reads(kw.value, m, "content") for m in items):
                out.add(kw.key)
    return out


def _without_billing_header(content: Any) -> Any:
    def strip(text: Any) -> Any:
        return text.partition("\n")[2] if isinstance(text, str) and text.startswith(BILLING_HEADER) else text

    if not isinstance(content, list):
        return strip(content)
    out = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else part
        rest = strip(text)
        if rest is text:
            out.append(part)
        elif rest:  # a part that was the header line alone is left out
            out.append({**part, "text": rest} if isinstance(part, dict) else rest)
    return out


_RENDER_KEYS = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                          "return_dict", "return_tensors", "chat_template", "messages"})


def retokenize(tokenizer: Any, request_json: str | None, response_json: str | None,
               endpoint: str | None = None) -> tuple[list[int], list[int], list[float] | None]:
    """Rebuild (prompt ids, response ids, logprobs or None) of one call from its JSON bodies.

    Chat: prompt = chat template over ``messages`` (+ ``tools``) with the generation prompt; the
    response = what the template adds when the assistant message is appended (so it ends with the
    template's end-of-turn tokens, as the next prompt will show them), or the content's tokens plus
    EOS when the template cannot be split that way. Completions: ``prompt`` (text or ids) and
    ``choices[0].text``. Anthropic Messages (``endpoint='messages'``): the recorded Messages request
    is turned into the chat request the proxy sent upstream (the same translation), whose answer
    the span holds as a chat completion; a Responses call into the chat exchange vLLM renders it
    as (``proxy.assemble.as_chat``), or ``ValueError`` where that is not the prompt the engine saw
    or no whole answer (history by ``previous_response_id``, images, a queued or failed response).
    A request with ``continue_final_message`` (a Messages prefill) is
    rendered as the engine did: the last assistant message left open, the answer continuing it.
    """
    req = json.loads(request_json or "{}")
    resp = json.loads(response_json or "{}")
    req, resp = as_chat(endpoint, req, resp, strict=True)  # (a Responses call it cannot rebuild: ValueError)
    choice = (resp.get("choices") or [{}])[0]
    logprobs = token_fields(resp, CHAT)["response_logprobs"]  # read as the proxy reads an answer
    if "messages" in req:
        prompt, response = _rebuild_chat(tokenizer, req, choice)
    else:
        prompt = _completion_prompt(tokenizer, req.get("prompt", ""), engine_flag(req.get("add_special_tokens", True)))
        response = _encode(tokenizer, _answer_text(req, choice.get("text") or ""))
        ended = choice.get("finish_reason") == "stop" and "stop_reason" in choice and choice["stop_reason"] is None
        if ended and tokenizer.eos_token_id is not None:  # vLLM stopped on EOS, which the text does not show
            response.append(int(tokenizer.eos_token_id))
    if logprobs is not None and not _spelled_alike(tokenizer, _logprob_tokens(choice), response):
        logprobs = None  # the engine's logprobs belong to other tokens than the rebuilt ones
    return prompt, response, logprobs


def _completion_prompt(tokenizer: Any, p: Any, special: bool = True) -> list[int]:
    """A completions call's prompt as the engine read it for its first choice: text, token ids, or a
    batch of either (its first: the first choice's). vLLM reads a list of strings as text prompts,
    never as numbers."""
    if isinstance(p, list) and p and isinstance(p[0], list | str):
        p = p[0]
    if isinstance(p, str):
        return _encode(tokenizer, p, special)
    if isinstance(p, list) and all(type(x) is int for x in p):
        return list(p)
    raise ValueError(f"a completions prompt of {type(p).__name__} is neither text nor token ids")


def _rebuild_chat(tokenizer: Any, req: dict, choice: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a chat call: the messages rendered as vLLM rendered them (see
    :func:`_as_engine_reads`), with the generation prompt, and the answer as what the template adds
    when the assistant message is appended (it ends with the end-of-turn token), or its content's
    tokens plus EOS when the template cannot be split that way. A request with
    ``continue_final_message`` (a Messages prefill) is rendered as the engine did: the last
    assistant message left open, the answer continuing it."""
    if not engine_flag(req.get("include_reasoning", True)):  # the engine generated reasoning the answer does not show
        raise ValueError("include_reasoning: false hides tokens the model generated; its answer cannot be rebuilt")
    kw = _template_kwargs(req)
    template = _chat_template(tokenizer, kw.get("tools"))
    # how vLLM hands content to it (``--chat-template-content-format auto``): the list of parts where
    # the template loops over a message's content, else text
    content_format = _template_content_format(template) if template is not None else "string"
    messages = _developer_as_system(_as_engine_reads(req["messages"], content_format), template)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    # a prefill (an Anthropic call's last assistant message): the answer continues it, in its turn
    prefill = engine_flag(req.get("continue_final_message")) and last.get("role") == "assistant" and isinstance(
        last.get("content"), (str, list))
    if not engine_flag(req.get("add_generation_prompt", True)) and not prefill:  # (the request's own flag)
        raise ValueError("add_generation_prompt: false: the model wrote its turn's header itself, which "
                         "its answer's text does not show; it cannot be rebuilt")
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefill,
                                                **({"continue_final_message": True} if prefill else {}), **kw)
    prompt = _encode(tokenizer, prompt_text, engine_flag(req.get("add_special_tokens", False)))
    answer = {k: v for k, v in (choice.get("message") or {}).items() if v is not None}
    # the answer's text as text (not a part a template may decorate): the tokens the model generated
    msg = _engine_message({"role": "assistant", **answer}, "string")
    done = messages[:-1] + [_continued(last, msg, str(answer.get("content") or ""))] if prefill \
        else messages + [msg]
    full_text = tokenizer.apply_chat_template(done, tokenize=False, add_generation_prompt=False, **kw)
    if full_text.startswith(prompt_text):
        response = _encode(tokenizer, full_text[len(prompt_text):])
        eos = tokenizer.eos_token_id
        if eos is not None and eos in response:  # what follows the end-of-turn token (a
            response = response[: response.index(eos) + 1]  # newline) the model never generated
    else:
        response = _encode(tokenizer, answer.get("content") or "")
        if tokenizer.eos_token_id is not None:
            response.append(int(tokenizer.eos_token_id))
    return prompt, response


def _continued(prefill: dict, answer: dict, text: str) -> dict:
    """The answer message of a prefilled call: the prefill's content with the answer's text after it
    (after its last text part, where the content is a list of parts: where the engine continued)."""
    content = prefill.get("content")
    if isinstance(content, str):
        return {**answer, "content": content + text}
    parts = list(content)
    texts = [i for i, part in enumerate(parts) if isinstance(part, dict) and part.get("type") == "text"]
    at = texts[-1] if texts else None
    if at is None:
        return {**answer, "content": parts + [{"type": "text", "text": text}]}
    parts[at] = {**parts[at], "text": str(parts[at].get("text") or "") + text}
    return {**answer, "content": parts}


def _logprob_tokens(choice: dict) -> list | None:
    """The token strings of an answer's logprob entries (chat ``content[].token``, completions ``tokens``)."""
    lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
    if isinstance(lp.get("content"), list):
        return [c.get("token") if isinstance(c, dict) else None for c in lp["content"]]
    return lp.get("tokens") if isinstance(lp.get("tokens"), list) else None


def _spelled_alike(tokenizer: Any, spelled: list | None, ids: list[int]) -> bool:
    """Whether the engine's logprob entries name the rebuilt tokens, one by one: an equal count is not
    enough (a stop string left out of the text rebuilt the end-of-turn token where the engine had
    generated the stop token: the stop token's logprob went onto a token never generated). Each entry
    must be the token as vLLM spells it, exactly: ``decode([id])``, with the leading spaces a
    SentencePiece tokenizer's decode drops given back (its piece's leading ``▁``). Whitespace is no
    exception: spaces moved between neighbouring tokens (``'    ', 'b'`` generated, ``'   ', ' b'``
    rebuilt) spell the same text with other tokens."""
    if spelled is None or len(spelled) != len(ids):
        return False
    return all(isinstance(s, str) and (s == f"token_id:{i}" or s == _as_vllm_spells(tokenizer, i))
               for s, i in zip(spelled, ids))


def _as_vllm_spells(tokenizer: Any, token_id: int) -> str:
    """A token's text in vLLM's logprob entries (``convert_ids_list_to_tokens``)."""
    text = tokenizer.decode([token_id])
    piece = tokenizer.convert_ids_to_tokens(token_id)
    markers = len(piece) - len(piece.lstrip("\u2581")) if isinstance(piece, str) else 0
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _answer_text(req: dict, text: str) -> str:
    """A completion's generated text: with ``echo`` the text starts with the prompt, which the model
    did not generate (the proxy does not ask such a call for token ids: vLLM would blank the echo)."""
    if not engine_flag(req.get("echo")):
        return text
    prompt = req.get("prompt")
    if not isinstance(prompt, str) or not text.startswith(prompt):
        raise ValueError("echo: the answer does not start with a text prompt; the generated part is unknown")
    return text[len(prompt):]


# -- the builder -----------------------------------------------------------------------------------
class _PhaseClock:
    """Wall and CPU seconds per phase (the machine may be shared: CPU time is the steadier one)."""

    def __init__(self) -> None:
        self.wall, self.cpu, self._last = {}, {}, (time.perf_counter(), time.process_time())

    def lap(self, name: str) -> None:
        now = (time.perf_counter(), time.process_time())
        self.wall[name] = round(self.wall.get(name, 0.0) + now[0] - self._last[0], 4)
        self.cpu[name] = round(self.cpu.get(name, 0.0) + now[1] - self._last[1], 4)
        self._last = now


def build_samples(source: str | os.PathLike | duckdb.DuckDBPyConnection, options: SampleOptions | None = None,
                  **keywords: Any) -> tuple[pa.Table, dict]:
    """Build the ``samples`` table from a traces directory (or a connection from ``views.connect``).

    ``keywords`` set fields of :class:`SampleOptions` (an unknown one is a ``TypeError``)."""
    opts = replace(options or SampleOptions(), **keywords)
    con = source if isinstance(source, duckdb.DuckDBPyConnection) else connect(source, rollouts=opts.rollouts)
    tokenizer = load_tokenizer(opts.tokenizer)
    stats: dict[str, Any] = {"mode": opts.mode, "advantage": opts.advantage, "weight_mode": opts.weight_mode,
                             "failed_policy": opts.failed_policy}
    clock = _PhaseClock()
    kept = _kept_rollouts(con, opts, stats)
    clock.lap("rollouts")
    calls = _read_calls(con, kept.table, opts.include_secret_spans, stats)
    calls = _count_other_sampling(calls, opts, stats)
    clock.lap("scan")
    calls, retok = _fill_token_ids(con, calls, tokenizer, stats, opts.drift_check)
    clock.lap("token_ids")
    tok = TokenArrays.of(calls)
    m = merge(tok, calls["finish_reason"].to_numpy(zero_copy_only=False), retok)
    new_sample = ~m.continues if opts.mode == "trajectory" else np.ones(calls.num_rows, dtype=bool)
    stats["calls_used"] = calls.num_rows
    stats["calls_continuing_history"] = int(m.continues.sum())
    # in transition mode these say what trajectory mode would have done
    breaks = np.bincount(m.reason[m.reason >= 0].astype(np.int64), minlength=len(BREAK_REASONS))
    stats["breaks"] = {r: int(breaks[i]) for i, r in enumerate(BREAK_REASONS)}
    clock.lap("merge")
    table = _assemble(calls, kept, tok, m, new_sample, retok, opts, stats)
    clock.lap("assemble")
    stats["timings_s"], stats["cpu_s"] = clock.wall, clock.cpu
    return table, stats


# -- selection: rollouts (failure policy, group advantages), then their calls ----------------------
def _select_rollouts(con: duckdb.DuckDBPyConnection, opts: SampleOptions) -> pa.Table:
    """The selected rollouts; steps and rollout ids are bound parameters, ``group_by`` and ``where``
    are the operator's SQL expressions."""
    preds, params = [], {}
    if opts.steps is not None:
        preds.append("list_contains($steps, step)")
        params["steps"] = list(opts.steps)
    if opts.rollouts is not None:  # on a caller's connection too (there without the read savings)
        preds.append("rollout_id IN (SELECT unnest($rollouts))")
        params["rollouts"] = list(opts.rollouts)
    if opts.where:
        preds.append(f"({opts.where})")
    # an attempt followed by another of the same rollout (a retry) is superseded: the retry took its
    # place in the group, so it is no member of it whatever the failure policy says of its state
    sql = f"""
        SELECT rollout_id, attempt, task_id, step, state, reward, CAST(({opts.group_by}) AS VARCHAR) AS group_key,
               superseded
        FROM (SELECT *, attempt < max(attempt) OVER (PARTITION BY rollout_id) AS superseded FROM rollouts)
        WHERE {" AND ".join(preds) or "TRUE"}
        ORDER BY rollout_id, attempt
    """
    try:
        return con.sql(sql, params=params).to_arrow_table()
    except (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException) as exc:  # the expressions'
        # fault; a damaged part's error stays a duckdb.Error, for views.past_damaged_parts to skip it
        raise ValueError(f"bad rollout selection (group_by={opts.group_by!r}, where={opts.where!r}): {exc}") from exc


@dataclass
class _Kept:
    """The rollouts that passed the failure policy (row ``ridx``), with their reward and advantage."""

    table: pa.Table
    reward: np.ndarray
    advantage: np.ndarray


def _kept_rollouts(con: duckdb.DuckDBPyConnection, opts: SampleOptions, stats: dict) -> _Kept:
    """Failure policy and group advantages, one row per rollout (its last attempt)."""
    ro = _select_rollouts(con, opts)
    superseded = ro["superseded"].to_numpy(zero_copy_only=False)
    stats["rollouts_superseded"] = int(superseded.sum())
    ro = ro.filter(pa.array(~superseded)).drop_columns(["superseded"])
    rewards = ro["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
    states = np.asarray(ro["state"].to_pylist(), dtype=object)
    keep, eff_reward, fcounts = adv_mod.apply_failure_policy(rewards, states, policy=opts.failed_policy,
                                                             failed_reward=opts.failed_reward)
    stats["rollouts_reward_clipped"] = 0  # of the rollouts the policy kept
    if opts.reward_clip is not None:
        outside = keep & ((eff_reward < opts.reward_clip[0]) | (eff_reward > opts.reward_clip[1]))
        stats["rollouts_reward_clipped"] = int(outside.sum())
        eff_reward = np.clip(eff_reward, *opts.reward_clip)
    # a rollout without a group (proxy used alone) is its own group: explicit, and reported
    raw_group = ro["group_key"].to_pylist()
    no_group = np.array([g is None for g in raw_group], dtype=bool)
    gkey = np.array([g if g is not None else f"rollout:{w_mod.rollout_key(r, a)}" for g, r, a in
                     zip(raw_group, ro["rollout_id"].to_pylist(), ro["attempt"].to_pylist())], dtype=object)
    ro = ro.set_column(ro.schema.get_field_index("group_key"), "group_key", pa.array(gkey.tolist(), pa.string()))
    kept_idx = np.flatnonzero(keep)
    adv, adv_report = adv_mod.group_advantages(eff_reward[kept_idx], gkey[kept_idx], method=opts.advantage,
                                               epsilon=opts.epsilon, norm_by_std=opts.norm_by_std)
    alone = adv_mod.cut_to_one(gkey, keep)  # no baseline left: no signal (advantages.py)
    adv[alone] = 0.0
    stats["adv_groups_cut_to_one"] = int(alone.sum())
    stats["rollouts_selected"] = ro.num_rows
    stats["rollouts_dropped"] = fcounts.pop("dropped")
    stats["rollouts_by_state"] = fcounts
    stats["rollouts_without_group"] = int(no_group[kept_idx].sum())
    stats.update({f"adv_{k}": v for k, v in asdict(adv_report).items()})
    table = ro.take(pa.array(kept_idx, type=pa.int64()))
    table = table.append_column("ridx", pa.array(np.arange(len(kept_idx)), pa.int64()))
    return _Kept(table, eff_reward[kept_idx], adv)


def _optional_columns(con: duckdb.DuckDBPyConnection) -> str:
    """``secret_detected``, ``n_choices``, ``routed`` and ``sampling_json`` as SQL, with their defaults
    for traces written before the columns existed."""
    cols = {r[0] for r in con.sql("DESCRIBE spans").fetchall()}
    secret = "coalesce(s.secret_detected, FALSE)" if "secret_detected" in cols else "FALSE"
    choices = "coalesce(s.n_choices, 1)" if "n_choices" in cols else "1"
    routed = "coalesce(s.routed, TRUE)" if "routed" in cols else "TRUE"
    sampling = "s.sampling_json" if "sampling_json" in cols else "NULL::VARCHAR"
    return (f"{secret} AS secret_detected, {choices} AS n_choices, {routed} AS routed, "
            f"{sampling} AS sampling_json")


def _read_calls(con: duckdb.DuckDBPyConnection, kept: pa.Table, include_secret_spans: bool, stats: dict) -> pa.Table:
    """The kept rollouts' calls in rollout then ``seq`` order, without error calls and (unless
    asked) spans the proxy found a secret in; both counted."""
    con.register("_lh_kept", kept.select(["rollout_id", "attempt", "ridx"]))
    try:
        calls = con.sql(f"""
            SELECT k.ridx, s.span_id, s.seq, s.model_version, s.finish_reason, s.error_kind,
                   {", ".join(f"{_whole(c)} AS {c}" for c in _TOKEN_TYPES)},
                   {_optional_columns(con)}
            FROM spans s JOIN _lh_kept k ON s.rollout_id = k.rollout_id AND coalesce(s.attempt, 0) = k.attempt
            ORDER BY k.ridx, s.seq, s.started_at
        """).to_arrow_table()
    finally:
        con.unregister("_lh_kept")
    stats["spans_read"] = calls.num_rows
    err = calls["error_kind"].is_valid().to_numpy(zero_copy_only=False)
    stats["calls_error"] = int(err.sum())
    # several choices (n > 1): the span holds choice 0, but the harness may have gone on with another,
    # and the rollout's reward would then be credited to tokens it did not use
    multi = calls["n_choices"].to_numpy(zero_copy_only=False) > 1
    stats["calls_multi_choice"] = int((multi & ~err).sum())
    # a host the harness chose through the forward proxy: its answer is that server's, whatever the
    # harness wanted the policy pushed towards, never the policy's own
    unrouted = ~calls["routed"].to_numpy(zero_copy_only=False).astype(bool)
    stats["calls_unrouted"] = int((unrouted & ~err & ~multi).sum())
    if err.any() or multi.any() or unrouted.any():
        calls = calls.filter(pa.array(~(err | multi | unrouted)))
    secret = calls["secret_detected"].to_numpy(zero_copy_only=False).astype(bool)
    stats["calls_secret_detected"] = int(secret.sum())
    stats["calls_dropped_secret"] = 0 if include_secret_spans else int(secret.sum())
    calls = calls.drop_columns(["secret_detected", "n_choices", "routed"])
    return calls if include_secret_spans or not secret.any() else calls.filter(pa.array(~secret))


def _count_other_sampling(calls: pa.Table, opts: SampleOptions, stats: dict) -> pa.Table:
    """Count (and log) the calls whose sampling the update does not reproduce; return ``calls``
    without the column. Read per distinct recorded value: a run's calls share a handful."""
    off: dict[str | None, list[str]] = {}
    by_setting: dict[str, int] = {}
    n = 0
    for entry in pc.value_counts(calls["sampling_json"]).to_pylist():
        value, count = entry["values"], entry["counts"]
        # a call that set nothing was sampled at the engine's defaults (its temperature, nothing else)
        off[value] = unlike_update(_settings(value) if value is not None else {}, opts.temperature,
                                   opts.engine_defaults)
        n += count if off[value] else 0
        for name in off[value]:
            by_setting[name] = by_setting.get(name, 0) + count
    stats["calls_other_sampling"] = n
    stats["other_sampling"] = dict(sorted(by_setting.items()))
    if n:
        seen = ", ".join(f"{v or 'nothing set'}" for v in off if off[v])
        log.warning("%d of %d calls were sampled otherwise than the update computes (temperature %g, whole "
                    "vocabulary): %s; their recorded logprobs are another distribution's (requests set: %s)",
                    n, calls.num_rows, opts.temperature, stats["other_sampling"], seen[:500])
    return calls.drop_columns(["sampling_json"])


def _settings(value: str) -> dict:
    try:
        settings = json.loads(value)
    except ValueError:
        return {"unreadable": True}
    return settings if isinstance(settings, dict) else {"unreadable": True}


_TOKEN_TYPES = {"prompt_token_ids": pa.int32(), "response_token_ids": pa.int32(), "response_logprobs": pa.float32()}


def _whole(column: str) -> str:
    """SQL: the list, or NULL when an element of it is NULL (positions matter: such a list counts as
    missing, like one the proxy never got, instead of shifting or zeroing a token)."""
    return f"CASE WHEN list_count(s.{column}) = len(s.{column}) THEN s.{column} END"


def _without_ids(calls: pa.Table) -> np.ndarray:
    """Calls without usable token ids: none recorded, or a prompt of none (no engine serves one; the
    update would refuse the whole step for it)."""
    empty = pc.fill_null(pc.equal(pc.list_value_length(calls["prompt_token_ids"]), 0), False)
    return (calls["prompt_token_ids"].is_null().to_numpy(zero_copy_only=False)
            | calls["response_token_ids"].is_null().to_numpy(zero_copy_only=False)
            | empty.to_numpy(zero_copy_only=False))


def _fill_token_ids(con, calls: pa.Table, tokenizer: Any, stats: dict, drift_check: int) -> tuple[pa.Table, np.ndarray]:
    """Rebuild missing token ids (or drop those calls); count drift on a sample of the others."""
    missing = _without_ids(calls)
    stats["calls_without_token_ids"] = int(missing.sum())
    need = drift_rows = np.zeros(0, dtype=np.int64)
    if tokenizer is not None:
        need = np.flatnonzero(missing)
        if drift_check > 0:
            drift_rows = np.flatnonzero(~missing)
            if len(drift_rows) > drift_check:
                drift_rows = np.sort(np.random.default_rng(0).choice(drift_rows, drift_check, replace=False))
    bodies = _bodies(con, calls, np.concatenate([need, drift_rows]))
    _count_drift(calls, drift_rows, bodies, tokenizer, stats)
    calls, retok = _retokenize_rows(calls, need, bodies, tokenizer, stats)
    stats["retokenized_calls"] = int(retok.sum())
    still = _without_ids(calls)
    stats["calls_dropped_no_token_ids"] = int(still.sum())
    if still.any():
        calls = calls.filter(pa.array(~still))
        retok = retok[~still]
    return calls, retok


def _bodies(con, calls: pa.Table, rows: np.ndarray) -> dict[str, tuple]:
    """span id -> (request_json, response_json, endpoint) of the given rows (bodies are not read
    by the scan: they are large and most builds need none)."""
    if not len(rows):
        return {}
    con.register("_lh_ids", pa.table({"span_id": calls["span_id"].take(pa.array(rows))}))
    try:
        got = con.sql("SELECT span_id, request_json, response_json, endpoint "
                      "FROM spans JOIN _lh_ids USING (span_id)").fetchall()
    finally:
        con.unregister("_lh_ids")
    return {sid: (rq, rs, ep) for sid, rq, rs, ep in got}


def _count_drift(calls: pa.Table, rows: np.ndarray, bodies: dict, tokenizer: Any, stats: dict) -> None:
    drift_p = drift_r = checked = 0
    for i in map(int, rows):
        sid = calls["span_id"][i].as_py()
        if sid not in bodies:
            continue
        try:
            p, r, _ = retokenize(tokenizer, *bodies[sid])
        except Exception:
            continue
        checked += 1
        drift_p += p != calls["prompt_token_ids"][i].as_py()
        # the returned ids must start the re-rendered turn (a response cut by max_tokens has no
        # end-of-turn token; a re-rendered one always has)
        got = calls["response_token_ids"][i].as_py()
        drift_r += r[: len(got)] != got
    stats.update(drift_checked=checked, drift_prompt=int(drift_p), drift_response=int(drift_r))


def _retokenize_rows(calls: pa.Table, need: np.ndarray, bodies: dict, tokenizer: Any,
                     stats: dict) -> tuple[pa.Table, np.ndarray]:
    """Rebuild only the rows that need it, then splice them in with one take per column (no
    conversion of the whole table to Python lists); a row that cannot be rebuilt keeps its nulls."""
    n = calls.num_rows
    retok = np.zeros(n, dtype=bool)
    if not len(need):
        return calls, retok
    cols: dict[str, list] = {name: [] for name in _TOKEN_TYPES}
    rows_done, failed = [], []
    for i in map(int, need):
        sid = calls["span_id"][i].as_py()
        try:
            p, r, lp = retokenize(tokenizer, *bodies.get(sid, (None, None, None)))
        except Exception as exc:  # a body we cannot render: drop the call, say why
            failed.append((sid, f"{type(exc).__name__}: {exc}"))
            continue
        if not p:
            failed.append((sid, "no request body to rebuild the prompt from"))
            continue
        old_p, old_r = calls["prompt_token_ids"][i].as_py(), calls["response_token_ids"][i].as_py()
        if old_r is not None:  # only the prompt was missing: the recorded answer stands
            r, lp = old_r, calls["response_logprobs"][i].as_py()
        cols["prompt_token_ids"].append(old_p if old_p is not None else p)
        cols["response_token_ids"].append(r)
        cols["response_logprobs"].append(lp if lp is not None or old_r is not None else [float("nan")] * len(r))
        rows_done.append(i)
    stats["retokenize_failed"] = len(failed)
    if failed:
        stats["retokenize_errors"] = failed[:5]
    if rows_done:
        index = np.arange(n, dtype=np.int64)
        index[rows_done] = n + np.arange(len(rows_done))
        for name, values in cols.items():
            typ = pa.list_(_TOKEN_TYPES[name])
            merged = pa.concat_arrays([*calls[name].cast(typ).chunks, pa.array(values, typ)])
            calls = calls.set_column(calls.schema.get_field_index(name), name, merged.take(pa.array(index)))
        retok[rows_done] = True
    return calls, retok


# -- assembly: per-call flags -> the samples table, as array operations ----------------------------
@dataclass
class _Layout:
    """Every sample's tokens after its prompt, concatenated: per call ``[context (mask 0)]
    [response (mask 1)]``; per sample its first call row, call count, length and model tokens."""

    ids: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    first: np.ndarray
    n_calls: np.ndarray
    length: np.ndarray
    model_tokens: np.ndarray


def _layout(calls: pa.Table, tok: TokenArrays, hist: np.ndarray, new_sample: np.ndarray, stats: dict) -> _Layout:
    n, pl, rl = len(new_sample), tok.pl, tok.rl
    s_first = np.flatnonzero(new_sample)  # first call row of each sample
    ctx = np.where(new_sample, 0, pl - hist).astype(np.int64)  # context tokens a merged call adds
    seg_lens = np.empty(2 * n, dtype=np.int64)
    seg_lens[0::2], seg_lens[1::2] = ctx, rl
    mask = np.repeat(np.tile(np.array([0, 1], dtype=np.int8), n), seg_lens)
    model = mask.view(bool)
    ids = np.empty(len(mask), dtype=np.int32)
    ids[model] = tok.r_val
    if int(ctx.sum()):
        ids[~model] = tok.p_val[segment_index(tok.p_off[:-1] + hist, ctx)]
    # logprobs aligned with responses; NaN where missing or of the wrong length
    l_val, l_off, l_valid = flat(calls["response_logprobs"], pa.float32())
    ll = np.diff(l_off)
    lp_ok = l_valid & (ll == rl)
    stats["calls_without_logprobs"] = int((~lp_ok).sum())
    if lp_ok.all():
        resp_lp = l_val.astype(np.float32, copy=False)
    else:
        resp_lp = np.full(len(tok.r_val), np.nan, dtype=np.float32)
        okr = np.flatnonzero(lp_ok)
        resp_lp[segment_index(tok.r_off[okr], rl[okr])] = l_val[segment_index(l_off[okr], ll[okr])]
    lps = np.zeros(len(mask), dtype=np.float32)
    lps[model] = resp_lp
    any_s = len(s_first) > 0
    return _Layout(ids, mask, lps, s_first, np.diff(np.append(s_first, n)),
                   np.add.reduceat(ctx + rl, s_first) if any_s else np.zeros(0, np.int64),
                   np.add.reduceat(rl, s_first).astype(np.int64) if any_s else np.zeros(0, np.int64))


def _apply_limits(lay: _Layout, prompt_len: np.ndarray, s_ridx: np.ndarray, rollouts: pa.Table,
                  opts: SampleOptions, stats: dict) -> tuple[np.ndarray, np.ndarray]:
    """Prompts too long drop the sample; responses too long are cut (token work only for the
    samples concerned); samples left without a model token are dropped; then a rollout with more
    samples than ``max_samples_per_rollout`` left keeps a random subset of them
    (:func:`_cap_per_rollout`). Returns (kept, cut)."""
    keep_s = np.ones(len(lay.first), dtype=bool)
    if opts.max_prompt_len is not None:
        keep_s &= prompt_len <= opts.max_prompt_len
    stats["samples_dropped_prompt_too_long"] = int((~keep_s).sum())
    cut = np.zeros(len(lay.first), dtype=np.int64)
    cut_idx = np.zeros(0, dtype=np.int64)
    if opts.max_response_len is not None:
        cut = np.where(keep_s, np.maximum(lay.length - opts.max_response_len, 0), 0)
        tr = np.flatnonzero(cut)
        s_off = np.cumsum(lay.length) - lay.length
        cut_idx = segment_index(s_off[tr] + opts.max_response_len, cut[tr])
        cut_model = np.bincount(np.repeat(tr, cut[tr]), weights=lay.mask.view(bool)[cut_idx],
                                minlength=len(cut)).astype(np.int64)
        lay.model_tokens = lay.model_tokens - cut_model
        stats["truncated_model_tokens"] = int(cut_model.sum())
    stats["samples_truncated"] = int((cut > 0).sum())
    empty = keep_s & (lay.model_tokens == 0)
    stats["samples_dropped_no_model_tokens"] = int(empty.sum())
    keep_s &= ~empty
    keep_s = _cap_per_rollout(keep_s, s_ridx, rollouts, opts.max_samples_per_rollout, stats)
    if not keep_s.all() or len(cut_idx):
        keep_tok = np.repeat(keep_s, lay.length)
        keep_tok[cut_idx] = False
        lay.ids, lay.mask, lay.logprobs = lay.ids[keep_tok], lay.mask[keep_tok], lay.logprobs[keep_tok]
    return keep_s, cut


def _cap_per_rollout(keep_s: np.ndarray, s_ridx: np.ndarray, rollouts: pa.Table, cap: int | None,
                     stats: dict) -> np.ndarray:
    """``keep_s`` with, in every rollout that keeps more than ``cap`` samples, all but a uniform random
    ``cap`` of them left out. Why: the update's cost grows with a rollout's samples while its weight
    does not, so a harness could otherwise stall every update (module doc). Each rollout's draw is
    seeded from its key, so a rebuild of the same traces keeps the same samples; ``s_ridx`` (each
    sample's rollout row in ``rollouts``) is sorted, as the calls are."""
    stats["rollouts_capped"] = stats["samples_capped"] = 0
    if not cap:
        return keep_s
    counts = np.bincount(s_ridx[keep_s])
    over = np.flatnonzero(counts > cap)
    if not len(over):
        return keep_s
    keep_s = keep_s.copy()
    keys = []
    for r in map(int, over):
        lo, hi = np.searchsorted(s_ridx, [r, r + 1])
        rows = lo + np.flatnonzero(keep_s[lo:hi])
        keys.append(w_mod.rollout_key(rollouts["rollout_id"][r].as_py(), rollouts["attempt"][r].as_py()))
        chosen = _seeded(keys[-1]).choice(len(rows), size=cap, replace=False)
        keep_s[rows] = False
        keep_s[rows[chosen]] = True  # (a mask: the kept ones stay in their order)
    stats["rollouts_capped"], stats["samples_capped"] = len(over), int((counts[over] - cap).sum())
    log.warning("%d rollout(s) made more than max_samples_per_rollout=%d samples: each keeps a random %d of "
                "them (%d samples left out): %s", len(over), cap, cap, stats["samples_capped"],
                ", ".join(f"{k} ({n})" for k, n in zip(keys[:5], counts[over][:5].tolist()))
                + (", ..." if len(over) > 5 else ""))
    return keep_s


def _seeded(key: str) -> np.random.Generator:
    """A generator seeded from ``key`` alone (not Python's ``hash``, which changes between processes)."""
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:16],
                                                "big"))


def _assemble(calls: pa.Table, kept: _Kept, tok: TokenArrays, m: Merge, new_sample: np.ndarray, retok: np.ndarray,
              opts: SampleOptions, stats: dict) -> pa.Table:
    """The samples table: token layout, limits, then one column per field of schemas.SAMPLES."""
    lay = _layout(calls, tok, m.hist, new_sample, stats)
    S, first = len(lay.first), lay.first
    prompt_len, all_ridx = tok.pl[first], tok.ridx[first]
    keep_s, cut = _apply_limits(lay, prompt_len, all_ridx, kept.table, opts, stats)
    ks = np.flatnonzero(keep_s)
    s_ridx = all_ridx[ks]
    model_tokens = lay.model_tokens[ks]
    n_calls = lay.n_calls[ks]
    off = pa.array(np.concatenate([[0], np.cumsum((lay.length - cut)[ks])]).astype(np.int32))
    s_index = (np.arange(S) - np.searchsorted(all_ridx, all_ridx, side="left"))[ks]
    reason = m.reason[first][ks] if opts.mode == "trajectory" else np.full(len(ks), -1, np.int8)
    mv = calls["model_version"].to_numpy(zero_copy_only=False).astype(np.float64)

    def reduce(ufunc, values):  # per kept sample, over its calls
        return ufunc.reduceat(values, first)[ks] if S else values[:0]

    def version(a):
        return pa.array(np.where(np.isnan(a), 0, a).astype(np.int64), mask=np.isnan(a))

    def per_token(values, typ):
        return pa.ListArray.from_arrays(off, pa.array(values, typ))

    take_r = pa.array(s_ridx, type=pa.int64())
    rid, att = kept.table["rollout_id"].take(take_r), kept.table["attempt"].take(take_r)
    idx_arr = pa.array(s_index.astype(np.int32))
    span_ids = calls["span_id"].filter(pa.array(np.repeat(keep_s, lay.n_calls))).combine_chunks()
    cols = {
        "sample_id": pc.binary_join_element_wise(rid, pc.cast(att, pa.string()), pc.cast(idx_arr, pa.string()), "~"),
        "rollout_id": rid,
        "attempt": att,
        "task_id": kept.table["task_id"].take(take_r),
        "group_id": kept.table["group_key"].take(take_r),
        "step": kept.table["step"].take(take_r),
        "index_in_rollout": idx_arr,
        "span_ids": pa.ListArray.from_arrays(
            pa.array(np.concatenate([[0], np.cumsum(n_calls)]).astype(np.int32)),
            span_ids),
        "n_calls": pa.array(n_calls.astype(np.int32)),
        "merged": pa.array(n_calls > 1),
        "break_reason": pa.array(np.array([None, *BREAK_REASONS], dtype=object)[reason.astype(np.int64) + 1].tolist(),
                                 pa.string()),
        "retokenized": pa.array(reduce(np.maximum, retok.astype(np.int8)).astype(bool)),
        "prompt_token_ids": calls["prompt_token_ids"].take(pa.array(first[ks], type=pa.int64())),
        "response_token_ids": per_token(lay.ids, pa.int32()),
        "response_mask": per_token(lay.mask, pa.int8()),
        "response_logprobs": per_token(lay.logprobs, pa.float32()),
        "reward": pa.array(adv_mod.broadcast(kept.reward, s_ridx), pa.float64()),
        "advantage": pa.array(adv_mod.broadcast(kept.advantage, s_ridx).astype(np.float32), pa.float32()),
        "loss_weight": pa.array(w_mod.loss_weights(s_ridx, model_tokens, opts.weight_mode), pa.float32()),
        "model_version_min": version(reduce(np.fmin, mv)),
        "model_version_max": version(reduce(np.fmax, mv)),
        "response_truncated": pa.array(cut[ks] > 0),
    }
    _merge_stats(stats, s_ridx, model_tokens, n_calls, lay.mask, prompt_len[ks], opts.weight_mode)
    return pa.table([cols[f.name] for f in SAMPLES], schema=SAMPLES)


def _merge_stats(stats: dict, s_ridx, model_tokens, n_calls, mask, prompt_len, weight_mode: str) -> None:
    """Samples per rollout, merged samples and token counts of the kept samples."""
    per_rollout = np.bincount(s_ridx)[np.unique(s_ridx)] if len(s_ridx) else np.zeros(0)
    stats.update(
        samples=int(len(s_ridx)),
        rollouts_with_samples=int(len(np.unique(s_ridx))),
        samples_per_rollout=float(per_rollout.mean()) if len(per_rollout) else 0.0,
        single_sample_rollout_share=float((per_rollout == 1).mean()) if len(per_rollout) else 0.0,
        merged_samples=int((n_calls > 1).sum()),
        model_tokens=int(model_tokens.sum()),
        context_tokens=int((mask == 0).sum()),
        prompt_tokens=int(prompt_len.sum()),
        n_units=w_mod.n_units(s_ridx, model_tokens, weight_mode),
    )
