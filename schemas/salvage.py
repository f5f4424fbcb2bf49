"""Turn buffered rows into an Arrow table even when some rows hold values the schema cannot encode.

Why: one hostile row (a lone surrogate or invalid UTF-8 in a body, an attempt number beyond 64
bits) used to make the whole batch fail to encode, and since failed batches were retried first,
every later row stayed in memory forever. Here the fast path encodes the batch in one go; only when
that fails is the batch split until the bad rows are isolated, and each is *salvaged* value by value:

- text: lone surrogates and undecodable bytes become U+FFFD (replacement character); other
  objects in a string column become their ``str()``;
- integers out of the column's range become null (a clamped value would look like a real
  attempt number or version); in a non-nullable integer column they are clamped instead;
- a number with a fraction or a bool in an integer column becomes null likewise (pyarrow truncated 1.5
  to 1 without a word); in a non-nullable one it is truncated. "A number" is any float (a subclass such
  as ``numpy.float64`` too) and any other real number that is no integer (``numpy.float32``, a
  ``Fraction``, a ``Decimal``), all of which pyarrow truncates alike; "a bool" includes numpy's;
- any other value that does not fit its column becomes null.

A salvaged row gets ``salvaged = True`` when the table has that column (``spans`` has). A row that
still cannot be encoded (e.g. null in a non-nullable column) is reported as lost with its error;
the caller counts and logs it, it is never dropped silently.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

# What encoding a value can raise. Any failure here comes from the data (the disk is not touched
# yet), so it must lead to salvage or a counted loss, never to a retry of the same batch. Except a lack
# of memory (MemoryError, pyarrow.ArrowMemoryError): no fault of the rows, which were salvaged one by one
# and dropped as lost; it is raised (every ``except ENCODE_ERRORS`` here comes after a MemoryError one)
# so the writer keeps the rows buffered and retries them after a backoff (PartWriter.flush).
ENCODE_ERRORS = (Exception,)

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Encoded:
    """The outcome of encoding a batch: the table, how many rows were salvaged, which were lost."""

    table: pa.Table
    rows: list[dict[str, Any]]  # the rows as encoded: salvaged copies in place, lost rows left out
    salvaged: int = 0
    lost: list[str] = field(default_factory=list)  # one error text per row that could not be encoded


def encode_rows(rows: list[dict[str, Any]], schema: pa.Schema) -> Encoded:
    """Encode ``rows`` with ``schema``; bad rows are salvaged or reported, never block the others.

    A batch that fails is split in halves until the bad rows are alone (one bad row in 5,000
    costs about two encodings of the batch, not 5,000 single-row ones).
    """
    try:
        return Encoded(_table(rows, schema=schema), rows)
    except MemoryError:
        raise
    except ENCODE_ERRORS:
        pass
    out = Encoded(schema.empty_table(), [])
    tables: list[pa.Table] = []
    _encode_split(rows, schema, tables, out)
    out.table = pa.concat_tables(tables) if tables else schema.empty_table()
    return out


def _encode_split(rows: list[dict[str, Any]], schema: pa.Schema, tables: list[pa.Table], out: Encoded) -> None:
    """Encode ``rows`` known to fail as a whole: halves that encode are kept, single rows salvaged."""
    if len(rows) == 1:
        try:
            fixed = salvage_row(rows[0], schema)
            tables.append(_table([fixed], schema=schema))
        except MemoryError:
            raise
        except ENCODE_ERRORS as exc:
            out.lost.append(f"{type(exc).__name__}: {exc}"[:500])
            return
        out.rows.append(fixed)
        out.salvaged += 1
        return
    mid = len(rows) // 2
    for half in (rows[:mid], rows[mid:]):
        try:
            tables.append(_table(half, schema=schema))
            out.rows.extend(half)
        except MemoryError:
            raise
        except ENCODE_ERRORS:
            _encode_split(half, schema, tables, out)


def _table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """``pa.Table.from_pylist``, plus the check it skips: no null in a non-nullable column (the
    Parquet writer would refuse the whole part later)."""
    table = pa.Table.from_pylist(rows, schema=schema)
    for f in schema:
        if not f.nullable and table.column(f.name).null_count:
            raise ValueError(f"column {f.name!r} cannot be null")
    ints = [f.name for f in schema if pa.types.is_integer(f.type)]  # lists of integers are not checked: too slow
    for row in rows:
        for name in ints:
            value = row.get(name)  # (an int or None, the usual values, costs no call)
            if value is not None and type(value) is not int and _not_an_integer(value):
                raise ValueError(f"column {name!r} holds integers, not {_short(value)}")
    return table


def _not_an_integer(value: Any) -> bool:
    """A value pyarrow would store in an integer column as another, real-looking one: a bool (numpy's
    too: pyarrow refuses Python's but stores ``numpy.True_`` as 1) or a number with a fraction."""
    return isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b" or _fraction(value)


def _fraction(value: Any) -> bool:
    """A number with a fraction (or not finite): pyarrow truncates 1.5 to 1 in an integer column, a seq or
    version that looks real, so it fits none. Every kind pyarrow truncates is caught, not only Python's
    float: its subclasses (``numpy.float64``; read through ``float.is_integer``, which a subclass cannot
    override), numpy's other floats (``numpy.float32`` is no float), ``Fraction`` and ``Decimal``, whose
    fraction is read exactly (``int(x) != x``: no rounding through a float; a Decimal is compared with
    its integral value instead, as ``int(Decimal('1e999999'))`` would build a million-digit number)."""
    if isinstance(value, float):
        return not float.is_integer(value)
    if isinstance(value, decimal.Decimal):
        return not value.is_finite() or value != value.to_integral_value()
    if value is None or isinstance(value, numbers.Integral) or not isinstance(value, numbers.Real):
        return False
    try:
        return bool(int(value) != value)
    except (ValueError, OverflowError, ArithmeticError):  # not a number, or not finite: no integer either
        return True


def salvage_row(row: dict[str, Any], schema: pa.Schema) -> dict[str, Any]:
    """A copy of ``row`` whose every value fits its column (see the module doc); raises if impossible."""
    out = dict(row)
    for name, value in row.items():
        f = schema.field(name)
        if value is not None and not _fits(value, f.type):
            out[name] = salvage_value(value, f.type, nullable=f.nullable)
        if out[name] is None and not f.nullable:
            raise ValueError(f"column {name!r} cannot be null and its value {_short(value)} cannot be salvaged")
    if "salvaged" in schema.names:
        out["salvaged"] = True
    return out


def salvage_value(value: Any, typ: pa.DataType, *, nullable: bool = True) -> Any:
    """The nearest value of ``typ`` to ``value`` (None when there is none)."""
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return clean_text(value)
    if pa.types.is_integer(typ):
        return _salvage_int(value, typ, nullable)
    if pa.types.is_floating(typ):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            return None
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        if not isinstance(value, (list, tuple)):
            return None
        inner = typ.value_type
        out = [v if v is None or _fits(v, inner) else salvage_value(v, inner) for v in value]
        # positions matter (token ids, their logprobs): a list with an element lost is no list
        return None if any(o is None and v is not None for o, v in zip(out, value)) else out
    if pa.types.is_boolean(typ):
        return value if isinstance(value, bool) else None
    if pa.types.is_timestamp(typ):
        return value if isinstance(value, (_dt.datetime, _dt.date)) else None
    return None


def clean_text(value: Any) -> str:
    """Valid UTF-8 text: lone surrogates and undecodable bytes become U+FFFD."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    text = value if isinstance(value, str) else str(value)
    return _SURROGATE.sub("\ufffd", text)  # one U+FFFD per lone surrogate (or surrogate-escaped byte)


def _salvage_int(value: Any, typ: pa.DataType, nullable: bool) -> int | None:
    if nullable and _not_an_integer(value):  # truncated, it would look like a real one
        return None
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    bits = typ.bit_width
    lo, hi = (0, 2**bits - 1) if pa.types.is_unsigned_integer(typ) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if lo <= n <= hi:
        return n
    return min(max(n, lo), hi) if not nullable else None


def _fits(value: Any, typ: pa.DataType) -> bool:
    if pa.types.is_integer(typ) and _not_an_integer(value):
        return False
    try:
        pa.array([value], type=typ)
        return True
    except MemoryError:
        raise
    except ENCODE_ERRORS:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
