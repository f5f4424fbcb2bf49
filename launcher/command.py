"""The harness command: an argv list or a shell template, with ``{placeholders}`` from the rollout and task.

Why: the same harness runs for every task, and only its arguments differ (``--task {task_id}``,
``--question {question}``). Only known names are replaced, so literal braces (JSON in an argument)
survive; in shell templates every value is shell-quoted, so task text cannot inject commands.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def substitute(template: str, values: Mapping[str, Any], *, quote: bool = False) -> str:
    """Replace ``{name}`` for every known name; unknown names and other braces stay as they are."""

    def repl(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            return m.group(0)
        text = _text(values[name])
        return shlex.quote(text) if quote else text

    return _PLACEHOLDER.sub(repl, template)


def render_command(harness: Sequence[str] | str, values: Mapping[str, Any]) -> list[str] | str:
    """argv list -> argv list (each item substituted); string -> shell command line (values quoted)."""
    if isinstance(harness, str):
        return substitute(harness, values, quote=True)
    if not harness:
        raise ValueError("empty harness command")
    return [substitute(str(a), values) for a in harness]

