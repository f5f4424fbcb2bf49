"""A harness's request values as vLLM reads them.

vLLM's request models are lax pydantic: ``"false"``, ``0`` and ``"off"`` are false, ``"4"`` and
``4.0`` are the integer 4. The proxy reads what it acts on the same way, or it acts on another
request than the engine serves: ``return_token_ids: "false"`` was taken as set (nothing was
injected), and a Messages call's ``stream: "false"`` was answered as a stream where vLLM's own
``/v1/messages`` answers JSON.
"""

from __future__ import annotations

import math
import re
from typing import Any

_INT_TEXT = re.compile(r"([+-]?)([0-9](?:_?[0-9])*)(?:\.0+)?", re.ASCII)
_SPACES = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
    "\u2028\u2029\u202f\u205f\u3000"  # what pydantic strips around a number (Unicode White_Space)
_MAX_DIGITS = 4300  # an integer's digits past its leading zeros: pydantic's limit, and Python's int()
_BOOL_WORDS = frozenset(("0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"))


def engine_flag(value: Any) -> bool:
    """A request flag as the engine reads it (``"yes"``, ``1``, ``1.0`` true; anything else false)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or (type(value) in (int, float) and value == 1)


def reads_as_bool(value: Any) -> bool:
    """Whether the engine reads ``value`` as a boolean or null; it refuses anything else (``"maybe"``,
    ``2``, ``" true"``) with 400."""
    if value is None or isinstance(value, bool):
        return True
    if type(value) in (int, float):
        return value in (0, 1)
    return isinstance(value, str) and value.lower() in _BOOL_WORDS


def engine_int(value: Any) -> int | None:
    """An integer as the engine reads it (``21``, ``21.0``, ``"21"``, ``" 21.0 "``, ``"00021"``,
    ``true``), or None where it would refuse the value (``21.5``, ``"1e3"``, a list, 4,301 digits)."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2.0**63 else None
    m = _INT_TEXT.fullmatch(value.strip(_SPACES)) if isinstance(value, str) else None
    digits = m[2].replace("_", "").lstrip("0") or "0" if m else ""
    return int(m[1] + digits) if m and len(digits) <= _MAX_DIGITS else None


def engine_float(value: Any) -> float | None:
    """A number as the engine reads it (``"0"``, ``false`` and ``0`` are all 0.0), or None."""
    try:
        return float(value.strip() if isinstance(value, str) else value) if value is not None else None
    except OverflowError:  # an integer of 309 digits or more: beyond every float
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        return None
