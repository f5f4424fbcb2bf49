#!/usr/bin/env python
"""A small calculator agent, written the way people write agents.

It talks to any OpenAI-compatible endpoint with the official ``openai`` client, which reads
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (or the proxy environment) by itself. The agent loop is
plain text: the model replies ``CALC: 37+48`` to use the calculator, the harness runs the tool and
answers ``RESULT: 85``, and the model finishes with ``ANSWER: 85``. The final answer is printed to
stdout. Nothing here knows about training: it is an ordinary agent run on one task.

The task comes from ``LIGHTNING_TASK`` (JSON), ``LIGHTNING_TASK_FILE`` (path to JSON), or argv
(``--question "What is 3+4?"`` or a JSON string / path as the only argument).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import sys
from pathlib import Path

SYSTEM_PROMPT = "Solve the problem. To compute, reply CALC: expression. Then reply ANSWER: number."
TOOL_RESULT = "RESULT: {result}"
MAX_TURNS = 4

_CALL = re.compile(r"CALC:\s*(.+)")
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The calculator tool: integer arithmetic on + - * / and parentheses, nothing else."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")
    # (OverflowError: the expression is model text, and `<400 digits>/3` or float(<400 digits>) overflows;
    # ValueError: an integer past Python's 4,300-digit str limit)
    try:
        value = ev(ast.parse(expression.strip().replace("x", "*"), mode="eval"))
        if isinstance(value, int):
            return str(value)
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, OverflowError, MemoryError):
        return "error"


def load_task(argv_task: str | None, question: str | None) -> dict:
    """The task row: argv first, then LIGHTNING_TASK, then LIGHTNING_TASK_FILE."""
    if question:
        return {"question": question}
    raw = argv_task or os.environ.get("LIGHTNING_TASK")
    if raw is None and os.environ.get("LIGHTNING_TASK_FILE"):
        raw = Path(os.environ["LIGHTNING_TASK_FILE"]).read_text()
    if raw is None:
        sys.exit("no task: pass --question, a JSON task, or set LIGHTNING_TASK / LIGHTNING_TASK_FILE")
    if not raw.lstrip().startswith("{") and Path(raw).is_file():
        raw = Path(raw).read_text()
    return json.loads(raw)


class MalformedReply(RuntimeError):
    """The endpoint answered 200 with a body that is not a completion (no choices, no message)."""


def ask(client, api: str, model: str, messages: list[dict], temperature: float, max_tokens: int) -> str:
    """One model call through the Chat Completions API or the Responses API (same conversation).
    The client does not check the body's shape, so a reply without choices is a MalformedReply here
    rather than an IndexError deep in the loop."""
    if api == "responses":
        reply = client.responses.create(model=model, input=messages, temperature=temperature,
                                        max_output_tokens=max_tokens)
        try:
            text = reply.output_text
        except (TypeError, AttributeError):  # (its property walks `output`, which may be missing)
            raise MalformedReply(f"the response has no output: {str(reply)[:200]}") from None
    else:
        reply = client.chat.completions.create(model=model, messages=messages,
                                               temperature=temperature, max_tokens=max_tokens)
        choices = getattr(reply, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise MalformedReply(f"the chat completion has no choices: {str(reply)[:200]}")
        text = getattr(getattr(choices[0], "message", None), "content", None)
    return text if isinstance(text, str) else ""


def run(task: dict, model: str, temperature: float, max_tokens: int, api: str = "chat") -> str | None:
    """One episode: ask, call the calculator when asked, stop at the first ANSWER."""
    from openai import OpenAI

    client = OpenAI(max_retries=2, timeout=300)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task["question"]}]
    for _ in range(MAX_TURNS):
        text = ask(client, api, model, messages, temperature, max_tokens).strip()
        print(f"[assistant] {text}", file=sys.stderr)
        messages.append({"role": "assistant", "content": text})
        answer = _ANSWER.search(text)
        if answer:
            return answer.group(1)
        call = _CALL.search(text)
        if not call:
            return None
        result = TOOL_RESULT.format(result=calculate(call.group(1)))
        print(f"[tool] {result}", file=sys.stderr)
        messages.append({"role": "user", "content": result})
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", nargs="?", help="task as JSON or a path to a JSON file")
    parser.add_argument("--question", help="ask this question instead of a task row")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "calc-tiny"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--api", choices=["chat", "responses"], default="chat",
                        help="the OpenAI API the agent calls: Chat Completions or Responses")
    args = parser.parse_args()
    from openai import OpenAIError

    try:
        answer = run(load_task(args.task, args.question), args.model, args.temperature, args.max_tokens, args.api)
    except (OpenAIError, MalformedReply) as exc:  # one clear line, not a traceback; exit status 1
        sys.exit(f"harness.py: the model call failed: {type(exc).__name__}: {str(exc)[:500]}")
    print(f"ANSWER: {answer}" if answer is not None else "NO ANSWER")


if __name__ == "__main__":
    main()
