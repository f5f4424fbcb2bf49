"""`lightning-train report RUN_DIR`: one self-contained HTML page to read what a run's agent did.

Why one file: a page that needs no server and no network can be mailed, attached to an issue or
opened from a cluster's scratch disk. Everything is inside it: CSS and JS inline, the run's data as
one JSON block, the reward curve as inline SVG.

What it shows: the reward curve (train and held-out), the per-step metrics table, and every rollout
as a conversation (messages, tool calls, each model answer) with its reward and advantage, and the
tokens each model call generated, shaded by their logprob; a rollout's training samples show which
tokens were trained (mask 1, shaded by logprob) and which the harness inserted (mask 0).

Safety: the content is model- and harness-written. It reaches the page only as JSON inside a
``<script type="application/json">`` block (Jinja's ``tojson`` escapes ``<``, ``>``, ``&`` and ``'``),
and the page's script puts it into the DOM with ``textContent`` only; everything else in the page
goes through Jinja's autoescaping. DuckDB reads the traces with bound parameters.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import yaml

from ..proxy.assemble import as_chat
from .plot import EVAL_KEY, TRAIN_KEY
from .views import connect, past_damaged_parts

# metrics shown first in the step table (the rest follow, sorted)
KEY_METRICS = ("train/reward_mean", "train/success", "eval/reward_mean", "eval/success", "update/loss",
               "update/grad_norm", "train/rollouts", "train/failed", "time/step_s")


PICK_ROLLOUTS = """
CREATE OR REPLACE TEMP TABLE picked AS
SELECT r.rollout_id, r.attempt, r.run_id, r.task_id, r.group_id, r.sample_index, r.step, r.split, r.state,
       r.reward, r.reward_source, r.model_version, r.n_calls, r.n_errors, r.prompt_tokens, r.response_tokens,
       r.duration_s, r.error, s.advantage, coalesce(s.n_samples, 0) AS n_samples
FROM rollouts r
LEFT JOIN (SELECT rollout_id, coalesce(attempt, 0) AS attempt, any_value(advantage) AS advantage,
                  count(*) AS n_samples
           FROM samples GROUP BY ALL) s USING (rollout_id, attempt)
WHERE (CAST($split AS VARCHAR) IS NULL OR r.split = $split)
  AND (CAST($step AS BIGINT) IS NULL OR r.step = $step)
ORDER BY r.step NULLS FIRST, r.split, r.group_id, r.sample_index, r.rollout_id, r.attempt
LIMIT $limit
"""

PICKED_CALLS = """
SELECT s.rollout_id, coalesce(s.attempt, 0) AS attempt, s.seq, s.span_id, s.endpoint, s.model_version,
       s.latency_ms, s.finish_reason, s.error_kind, s.error, s.request_json, s.response_json,
       s.response_token_ids, s.response_logprobs, s.secret_detected
FROM spans s JOIN picked p ON s.rollout_id = p.rollout_id AND coalesce(s.attempt, 0) = p.attempt
ORDER BY s.rollout_id, coalesce(s.attempt, 0), s.seq NULLS LAST, s.started_at
"""

PICKED_SAMPLES = """
SELECT sa.rollout_id, coalesce(sa.attempt, 0) AS attempt, sa.index_in_rollout, sa.span_ids, sa.advantage,
       sa.break_reason, sa.response_token_ids, sa.response_mask, sa.response_logprobs
FROM samples sa JOIN picked p ON sa.rollout_id = p.rollout_id AND coalesce(sa.attempt, 0) = p.attempt
QUALIFY row_number() OVER (PARTITION BY sa.sample_id ORDER BY sa.step DESC NULLS LAST) = 1
ORDER BY sa.rollout_id, sa.attempt, sa.index_in_rollout
"""

LATEST_METRICS = """
SELECT step, name, value FROM metrics
WHERE step IS NOT NULL AND (CAST($run_id AS VARCHAR) IS NULL OR run_id = $run_id)
QUALIFY row_number() OVER (PARTITION BY run_id, step, name ORDER BY "at" DESC) = 1
ORDER BY step, name
"""


class ReportError(ValueError):
    """The folder is not a run (or a traces directory); the message says what was expected."""


def traces_of(run_dir: Path) -> Path:
    """A run folder's traces (RUN/traces), or the folder itself when it is a traces directory."""
    if (run_dir / "traces").is_dir():
        return run_dir / "traces"
    if any((run_dir / t).is_dir() for t in ("spans", "rollouts", "metrics")):
        return run_dir
    raise ReportError(f"{run_dir} holds no traces (expected RUN_DIR/traces/ from lightning-train run, "
                      f"or a traces directory with spans/ or rollouts/)")


def _read_mapping(path: Path, load=json.loads) -> dict:
    """A run file's mapping (``load``: json.loads or yaml.safe_load); {} when missing or damaged."""
    try:
        data = load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


# -- token text ------------------------------------------------------------------------------------
class TokenText:
    """Token id -> its text, through the run's tokenizer (``tokenizer.json``); ids alone without one.

    The page carries each used token's text once (``vocab``); a strip is three parallel lists."""

    def __init__(self, folder: str | os.PathLike | None) -> None:
        self.tokenizer = None
        self.source = None
        if folder and (Path(folder) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
            self.source = str(folder)
        self.vocab: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self.vocab:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None
            self.vocab[token_id] = text if text else f"⟨{token_id}⟩"
        return self.vocab[token_id]

    def strip(self, ids, logprobs=None, mask=None) -> dict[str, list]:
        """``{"ids": [...], "lp": [logprob|None...], "mask": [0/1...] or None}`` for a token strip."""
        ids = [int(t) for t in ids or []]
        for t in ids:
            self(t)
        lps = list(logprobs or [])
        lp = [round(v, 4) if (v := _num(lps[i] if i < len(lps) else None)) is not None else None
              for i in range(len(ids))]
        return {"ids": ids, "lp": lp, "mask": [int(m) for m in mask] if mask is not None else None}


def tokenizer_folder(run_dir: Path, state: dict, config: dict, explicit: str | None) -> str | None:
    """Where the run's tokenizer lives: --tokenizer, the run's base model, its configured model."""
    candidates = [explicit, state.get("base_model"), state.get("checkpoint")]
    model = config.get("model")
    if model:
        base = Path(config.get("base_dir") or run_dir)
        candidates += [model, str(base / model)]
    for c in candidates:
        if c and (Path(c) / "tokenizer.json").is_file():
            return str(c)
    return None


def _num(v: Any) -> float | None:
    """A JSON-safe number (NaN and infinities have no JSON form)."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


# -- conversations: every API's request/response normalised to messages ----------------------------
def _text(content: Any) -> str:
    """Message content as text: a string, or a list of parts (text kept, other parts named)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                out.append(str(part.get("text") if part.get("text") is not None else f"[{part.get('type', 'part')}]"))
            else:
                out.append(str(part))
        return "\n".join(out)  # (as vLLM joins them for a template that takes text)
    return json.dumps(content, ensure_ascii=False)


def _tool_calls(calls: Any) -> list[dict]:
    out = []
    for c in calls if isinstance(calls, list) else []:  # a recorded body can hold anything
        if not isinstance(c, dict):
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else c
        args = fn.get("arguments")
        out.append({"id": str(c.get("id") or c.get("call_id") or ""), "name": str(fn.get("name") or ""),
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
    return out


def _message(m: Any) -> dict:
    if not isinstance(m, dict):
        return {"role": "user", "content": _text(m), "tool_calls": []}
    out = {"role": str(m.get("role") or m.get("type") or "user"), "content": _text(m.get("content")),
           "tool_calls": _tool_calls(m.get("tool_calls"))}
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def _chat_form(endpoint: str | None, request: dict, response: dict) -> tuple[dict, dict]:
    """A call in its chat form (``proxy.assemble.as_chat``: the code that knows the Messages and
    Responses formats); a body too malformed to convert is shown as it is."""
    try:
        return as_chat(endpoint, request, response)
    except Exception:  # hostile or damaged bodies: the page shows what it can
        return request, response


def request_messages(endpoint: str | None, request: dict) -> list[dict]:
    """The conversation a call sent, whatever the API (chat, Messages, Responses, completions)."""
    request = _chat_form(endpoint, request, {})[0]
    if "messages" in request:
        messages = request.get("messages") or []
        return [_message(m) for m in (messages if isinstance(messages, list) else [messages])]
    if "prompt" in request:
        return [{"role": "prompt", "content": _text(request.get("prompt")), "tool_calls": []}]
    return []


def response_message(response: dict) -> dict:
    """The model's answer (choice 0, or the Responses API's output items) as one assistant message."""
    if "output" in response and "choices" not in response:
        response = _chat_form("responses", {"input": []}, response)[1]
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        c = choices[0]
        if isinstance(c.get("message"), dict):
            m = c["message"]
            return {"role": "assistant", "content": _text(m.get("content")),
                    "reasoning": _text(m.get("reasoning_content") or m.get("reasoning")),
                    "tool_calls": _tool_calls(m.get("tool_calls"))}
        return {"role": "assistant", "content": _text(c.get("text")), "tool_calls": []}
    return {"role": "assistant", "content": "", "tool_calls": []}


def _same(a: dict, b: dict) -> bool:
    return (a["role"] == b["role"] and a["content"].strip() == b["content"].strip()
            and [c["name"] for c in a["tool_calls"]] == [c["name"] for c in b["tool_calls"]])


def _loads(text: str | None) -> dict:
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        return {"unparsed": text}
    return data if isinstance(data, dict) else {}


def conversation(calls: list[dict], tokens: TokenText, trained_spans: dict[str, int]) -> list[dict]:
    """One entry per model call: the messages it added to the conversation (a call that repeats the
    previous context plus the previous answer shows only what is new), its answer, its tokens."""
    out, context = [], []
    for c in calls:
        msgs = request_messages(c["endpoint"], _loads(c["request_json"]))
        k = 0
        while k < min(len(msgs), len(context)) and _same(msgs[k], context[k]):
            k += 1
        answer = response_message(_loads(c["response_json"]))
        out.append({
            "seq": c["seq"], "span_id": c["span_id"], "endpoint": c["endpoint"], "model_version": c["model_version"],
            "latency_ms": _num(c["latency_ms"]), "finish_reason": c["finish_reason"],
            "error": (f"{c['error_kind']}: {c['error']}" if c["error_kind"] else None),
            "secret_detected": bool(c["secret_detected"]),
            "new_context": bool(context) and k == 0, "messages": msgs[k:], "answer": answer,
            "tokens": tokens.strip(c["response_token_ids"], c["response_logprobs"]),
            "sample": trained_spans.get(c["span_id"]),
        })
        context = msgs + [answer]
    return out


# -- the run's data, through DuckDB ----------------------------------------------------------------
def _rows(con, sql: str, params: dict | None = None) -> list[dict]:
    cur = con.execute(sql, params or {})
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def step_table(con, run_id: str | None) -> dict[str, Any]:
    """``{"columns": [...], "rows": [[step, v, ...]], "series": {name: [[step, v]]}}``."""
    by_step: dict[int, dict[str, float | None]] = {}
    for r in _rows(con, LATEST_METRICS, {"run_id": run_id}):
        by_step.setdefault(int(r["step"]), {})[r["name"]] = _num(r["value"])
    names = sorted({n for v in by_step.values() for n in v})
    columns = [n for n in KEY_METRICS if n in names] + [n for n in names if n not in KEY_METRICS]
    rows = [[step] + [by_step[step].get(n) for n in columns] for step in sorted(by_step)]
    series = {k: [[s, by_step[s][k]] for s in sorted(by_step) if by_step[s].get(k) is not None]
              for k in (TRAIN_KEY, EVAL_KEY)}
    return {"columns": columns, "rows": rows, "series": series}


def _by_rollout(cur, batch: int = 16) -> Iterator[tuple[tuple, list[dict]]]:
    """``(key, calls)`` per rollout attempt from a cursor ordered by it. Why: every call's request
    holds the whole context so far; held for all picked rollouts at once they are gigabytes, while
    the conversation kept from them (what each call added) is a small part."""
    names = [d[0] for d in cur.description]
    key, group = None, []
    while rows := cur.fetchmany(batch):
        for row in rows:
            c = dict(zip(names, row))
            if group and (c["rollout_id"], c["attempt"]) != key:
                yield key, group
                group = []
            key = (c["rollout_id"], c["attempt"])
            group.append(c)
    if group:
        yield key, group


def rollouts_with_calls(con, tokens: TokenText, *, split: str | None, step: int | None,
                        limit: int) -> list[dict]:
    """The picked rollouts, each with its calls as a conversation and its training samples."""
    con.execute(PICK_ROLLOUTS, {"split": split, "step": step, "limit": int(limit)})
    rollouts = _rows(con, "SELECT * FROM picked")
    samples: dict[tuple, list] = {}
    for s in _rows(con, PICKED_SAMPLES):
        samples.setdefault((s["rollout_id"], s["attempt"]), []).append(s)
    trained = {key: {sid: s["index_in_rollout"] for s in ss for sid in s["span_ids"] or []}
               for key, ss in samples.items()}
    convs = {key: conversation(calls, tokens, trained.get(key, {}))
             for key, calls in _by_rollout(con.execute(PICKED_CALLS))}
    out = []
    for r in rollouts:
        key = (r["rollout_id"], r["attempt"])
        out.append({
            **{k: (_num(v) if isinstance(v, float) else v) for k, v in r.items()},
            "calls": convs.get(key, []),
            "samples": [{"index": s["index_in_rollout"], "advantage": _num(s["advantage"]),
                         "break_reason": s["break_reason"], "n_calls": len(s["span_ids"] or []),
                         "tokens": tokens.strip(s["response_token_ids"], s["response_logprobs"],
                                                s["response_mask"])}
                        for s in samples.get(key, [])],
        })
    return out


# -- the reward curve as inline SVG ----------------------------------------------------------------
def curve(series: dict[str, list], width: int = 640, height: int = 260) -> dict[str, Any]:
    """Screen coordinates of the train and held-out reward series (the template draws them)."""
    left, right, top, bottom = 48, 16, 12, 36
    points = [p for s in series.values() for p in s]
    if not points:
        return {"empty": True, "width": width, "height": height}
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(min(ys), 0.0), max(max(ys), 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    sx = lambda x: left + (x - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    half_span = y1 / 2 - y0 / 2  # in halves: y1 - y0 of two huge finite rewards is inf (NaN coordinates)
    sy = lambda y: top + (1 - (y / 2 - y0 / 2) / (half_span or 1.0)) * (height - top - bottom)  # noqa: E731
    lines = []
    for key, label, cls in ((TRAIN_KEY, "train reward", "train"), (EVAL_KEY, "held-out reward", "eval")):
        pts = [(round(sx(s), 1), round(sy(v), 1), s, v) for s, v in series.get(key, [])]
        if pts:
            lines.append({"label": label, "cls": cls, "points": pts,
                          "path": " ".join(f"{x},{y}" for x, y, _, _ in pts)})
    steps = sorted(set(xs))
    every = max(1, math.ceil(len(steps) / 10))
    return {"empty": False, "width": width, "height": height, "left": left, "right": width - right,
            "top": top, "bottom": height - bottom, "lines": lines,
            "yticks": [(round(sy(v), 1), f"{v:.3g}") for v in (y0 * (1 - i / 4) + y1 * (i / 4) for i in range(5))],
            "xticks": [(round(sx(s), 1), s) for s in steps[::every]]}


# -- the page --------------------------------------------------------------------------------------
def collect(run_dir: str | os.PathLike, *, tokenizer: str | None = None, split: str | None = None,
            step: int | None = None, max_rollouts: int = 1000) -> dict[str, Any]:
    """Everything the page shows, as plain data."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ReportError(f"{run} is not a folder (expected a run folder from lightning-train run)")
    traces = traces_of(run)
    state, config = _read_mapping(run / "state.json"), _read_mapping(run / "config.yaml", yaml.safe_load)
    summary = _read_mapping(run / "summary.json")
    run_id = state.get("run_id") or config.get("name") or None
    tokens = TokenText(tokenizer_folder(run, state, config, tokenizer))
    def query() -> tuple:
        con = connect(traces)
        try:
            steps = step_table(con, run_id)
            if not steps["rows"] and run_id:  # metrics under another id (a renamed run): show them all
                steps = step_table(con, None)
            rollouts = rollouts_with_calls(con, tokens, split=split, step=step, limit=max_rollouts)
            return steps, rollouts, con.execute("SELECT count(*) FROM rollouts").fetchone()[0]
        finally:
            con.close()

    steps, rollouts, total = past_damaged_parts(query, lambda: None)  # a damaged part is skipped (reconnects)
    return {
        "run": {"run_id": run_id or run.name, "folder": str(run.resolve()), "steps_done": state.get("step"),
                "steps_planned": config.get("steps"), "model_version": state.get("model_version"),
                "model": config.get("model"), "tokenizer": tokens.source,
                "evals": summary.get("evals") or state.get("evals") or {},
                "generated_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "rollouts_total": int(total), "rollouts_shown": len(rollouts),
                "filters": {"split": split, "step": step, "max_rollouts": max_rollouts}},
        "steps": steps, "rollouts": rollouts, "vocab": {str(k): v for k, v in tokens.vocab.items()},
    }


def render(data: dict[str, Any]) -> str:
    """The page's HTML: autoescaped template, data as escaped JSON, curve as SVG."""
    import jinja2

    from .report_page import PAGE

    # plain JSON only: timestamps as text, NaN and infinities (no JSON form) as null
    data = json.loads(json.dumps(data, default=str), parse_constant=lambda _: None)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(PAGE).render(run=data["run"], steps=data["steps"], data=data,
                                        curve=curve(data["steps"]["series"]), fmt=_fmt)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, **options: Any) -> Path:
    """Write the page (default RUN_DIR/report.html) and return its path."""
    html = render(collect(run_dir, **options))
    path = Path(out) if out else Path(run_dir) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(html, encoding="utf-8", errors="replace")  # a folder name not in UTF-8 is shown with '?'
    os.replace(tmp, path)
    return path


@click.command("report", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Where to write the page (default RUN_DIR/report.html).")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=None,
              help="Folder with tokenizer.json to show token text (default: the run's model).")
@click.option("--split", default=None, help="Only rollouts of this split ('train', 'eval').")
@click.option("--step", type=int, default=None, help="Only rollouts launched at this training step.")
@click.option("--max-rollouts", type=click.IntRange(min=1), default=1000, show_default=True,
              help="At most this many rollouts on the page (in step order).")
def report_command(run_dir, output, tokenizer, split, step, max_rollouts):
    """Write one self-contained HTML page to read a run: reward curve, per-step metrics, and every
    rollout as a conversation with its tool calls, reward, advantage and trained tokens.

    \b
    The page needs no server and no network (open it from disk). RUN_DIR is a run folder of
    `lightning-train run` (or a bare traces directory).

    \b
    Example:
      lightning-train report runs/calc -o calc.html --split train
    """
    try:
        path = write_report(run_dir, output, tokenizer=tokenizer, split=split, step=step,
                            max_rollouts=max_rollouts)
    except (ReportError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")

