"""numpy numbers in integer columns: pyarrow truncates ``numpy.float32(2.5)`` to 2 (and stores
``numpy.True_`` as 1) without a word, where a Python 2.5 is caught and salvaged to null. The writer
must treat them alike: a seq or version that merely looks real is worse than none."""

from __future__ import annotations

import decimal
import fractions

import numpy as np
import pyarrow as pa
import pytest
from fixtures_traces import rollout, span

from lightning_harness.schemas import PartWriter, read_table
from lightning_harness.schemas.salvage import encode_rows


class _AlwaysWhole(float):
    """A float subclass that lies about itself."""

    def is_integer(self) -> bool:
        return True


@pytest.mark.parametrize("value", [np.float32(2.5), np.float16(1.5), np.float64(1.5), np.longdouble(7.25),
                                   np.float32("nan"), np.True_, _AlwaysWhole(1.5), fractions.Fraction(3, 2),
                                   decimal.Decimal("1.5")],
                         ids=repr)
def test_a_number_with_a_fraction_in_an_integer_column_is_salvaged_to_null(tmp_path, value):
    """Written through the real writer and read back from its Parquet part."""
    with PartWriter(tmp_path, "spans", background=False, fsync=False) as w:
        w.extend([{**span("bad", 0, [1], [2]), "seq": value}, span("ok", 3, [1], [2]),
                  {**span("whole", 0, [1], [2]), "seq": np.float32(4.0), "model_version": np.int64(2)}])
    rows = {r["rollout_id"]: r for r in read_table(tmp_path, "spans").to_pylist()}
    assert (rows["bad"]["seq"], rows["bad"]["salvaged"]) == (None, True)  # before the fix (float32): (2, None)
    assert (rows["ok"]["seq"], rows["ok"]["salvaged"]) == (3, None)
    # a whole numpy float is an integer, and numpy integers are integers: the fast path keeps them
    assert (rows["whole"]["seq"], rows["whole"]["model_version"], rows["whole"]["salvaged"]) == (4, 2, None)
    assert w.health()["rows_lost"] == 0


def test_a_non_nullable_integer_column_truncates_a_numpy_fraction_and_says_so(tmp_path):
    """``rollouts.attempt`` cannot be null: the value is truncated there, but the row is marked salvaged
    by going the salvage way (before the fix the fast path stored it as if it were whole)."""
    enc = encode_rows([rollout("r1", attempt=np.float32(1.5)), rollout("r2", attempt=2)],
                      _schema_of("rollouts"))
    assert enc.salvaged == 1 and not enc.lost  # before the fix: 0 salvaged
    assert enc.table["attempt"].to_pylist() == [1, 2]


def test_ordinary_rows_take_the_fast_path(tmp_path):
    rows = [span(f"r{i}", i, [1, 2], [3]) for i in range(50)]
    enc = encode_rows(rows, _schema_of("spans"))
    assert enc.salvaged == 0 and enc.rows is rows and enc.table["seq"].to_pylist() == list(range(50))


def _schema_of(table: str) -> pa.Schema:
    from lightning_harness.schemas import TABLES

    return TABLES[table]
