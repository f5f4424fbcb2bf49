"""The harness command: an argv list or a shell template, with ``{placeholders}`` from the rollout and task.

Why: the same harness runs for every task, and only its arguments differ (``--task {task_id}``,
``--question {question}``). Only known names are replaced, so literal braces (JSON in an argument)
survive; in shell templates every value is shell-quoted, so task text cannot inject commands
(and a placeholder written inside quotes, where that quoting would not hold, is refused).
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


def quoted_placeholders(template: str, names) -> list[str]:
    """The ``{name}`` placeholders of ``names`` that stand inside shell quotes in ``template``. There a
    shell-quoted value is not safe (``"{q}"`` with ``$(...)`` in the value runs it: single quotes are
    literal inside double ones), so :func:`substitute` refuses them."""
    found, state, i = [], "", 0
    while i < len(template):
        c = template[i]
        if c == "\\" and state != "'":
            i += 2
            continue
        if c in "'\"" and state in ("", c):
            state = "" if state == c else c
        elif state and (m := _PLACEHOLDER.match(template, i)) and m.group(1) in names:
            found.append(m.group(0))
        i += 1
    return found


def substitute(template: str, values: Mapping[str, Any], *, quote: bool = False) -> str:
    """Replace ``{name}`` for every known name; unknown names and other braces stay as they are. With
    ``quote`` (a shell line) each value is shell-quoted, and a placeholder inside quotes is a ValueError."""
    inside = quoted_placeholders(template, values) if quote else []
    if inside:
        raise ValueError(f"{', '.join(inside)} stands inside quotes in the command line {template!r}: write it "
                         "without quotes (every value is shell-quoted for you)")

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

