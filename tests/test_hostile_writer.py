"""PartWriter against hostile rows and failing disks, and readers against corrupt parts (no proxy).

Real Parquet files, a real full filesystem (tmpfs, fixtures_disk.py), no mocks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_harness.schemas import BufferFull, PartWriter, finished_parts, read_table

pytestmark = pytest.mark.timeout(120)


def span(i: int, **kw) -> dict:
    return {"span_id": f"s{i}", "rollout_id": "r", "attempt": 0, "seq": i, **kw}


def parts(root: Path, table: str) -> list[Path]:
    return sorted((root / table).glob("**/*.parquet"))


def test_one_unencodable_row_never_blocks_the_others(tmp_path):
    w = PartWriter(tmp_path, "spans", background=False)
    w.extend([span(0, request_json="fine")])
    w.append(span(1, request_json="lone \ud800 surrogate", response_json=b"bad \xff byte"))
    w.append(span(2, attempt=2**70, model_version=2**64))
    w.extend([span(i) for i in range(3, 6)])
    w.flush()
    rows = {r["span_id"]: r for r in read_table(tmp_path, "spans").to_pylist()}
    assert sorted(rows) == [f"s{i}" for i in range(6)]
    assert rows["s1"]["request_json"] == "lone \ufffd surrogate" and rows["s1"]["response_json"] == "bad \ufffd byte"
    assert rows["s2"]["attempt"] is None and rows["s2"]["model_version"] is None  # nulled, not clamped
    assert rows["s1"]["salvaged"] is True and rows["s2"]["salvaged"] is True
    assert not any(rows[f"s{i}"]["salvaged"] for i in (0, 3, 4, 5))
    h = w.health()
    assert h["rows_salvaged"] == 2 and h["rows_lost"] == 0 and h["healthy"] and h["rows_pending"] == 0
    # the next flush is not held up either
    w.append(span(6))
    w.flush()
    assert read_table(tmp_path, "spans").num_rows == 7


def test_a_row_that_cannot_be_salvaged_is_counted_lost_and_logged(tmp_path, caplog):
    w = PartWriter(tmp_path, "rewards", background=False)
    w.append({"reward_id": "a", "rollout_id": "r", "reward": 1.0})
    w.append({"reward_id": "b", "rollout_id": "r", "reward": "not a number"})  # non-nullable double
    w.append({"reward_id": None, "rollout_id": "r", "reward": 1.0})  # Parquet would refuse the whole part
    w.append({"rollout_id": "r", "reward": 1.0})  # same, key missing
    w.append({"reward_id": "c", "rollout_id": "r", "reward": 0.5})
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        w.flush()
    assert [r["reward_id"] for r in read_table(tmp_path, "rewards").to_pylist()] == ["a", "c"]
    assert w.health()["rows_lost"] == 3 and w.healthy and w.buffered == 0
    assert any("could not be encoded" in m and "reward" in m for m in caplog.messages)


def test_storage_failure_keeps_rows_backs_off_and_recovers(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the traces folder should be")
    w = PartWriter(blocked, "spans", flush_seconds=0.05, retry_min_seconds=0.4, retry_max_seconds=0.8)
    try:
        w.extend([span(i) for i in range(3)])
        deadline = time.monotonic() + 10
        while w.healthy:
            assert time.monotonic() < deadline, "the failing write was never noticed"
            time.sleep(0.02)
        h = w.health()
        assert h["rows_pending"] == 3 and h["write_failures"] >= 1 and h["last_error"] and h["last_error_at"]
        time.sleep(1.5)  # the ticker runs every 12 ms; backoff 0.4 -> 0.8 s allows ~3 attempts
        assert 2 <= w.write_failures <= 4, w.write_failures
        w.root = tmp_path / "ok"  # space / permission returns
        deadline = time.monotonic() + 10
        while not w.healthy or w.buffered:
            assert time.monotonic() < deadline, "the writer did not recover by itself"
            time.sleep(0.05)
        assert read_table(tmp_path / "ok", "spans").num_rows == 3
    finally:
        w.close()


def test_full_disk_leaves_no_temp_file_and_retries_in_bounded_parts(small_disk):
    root = small_disk.path / "traces"
    w = PartWriter(root, "spans", background=False, flush_rows=10, max_buffer_bytes=64 << 20)
    w.extend([span(i) for i in range(5)])
    w.flush()
    small_disk.fill()
    w.extend([span(i, request_json="x" * 2000) for i in range(5, 45)])
    for _ in range(3):
        with pytest.raises(OSError):
            w.flush()
        assert small_disk.temp_files() == []
    assert w.buffered == 40 and not w.healthy and "No space" in w.health()["last_error"]
    small_disk.free()
    w.flush()
    assert w.healthy and w.buffered == 0
    assert sorted(r["seq"] for r in read_table(root, "spans").to_pylist()) == list(range(45))
    assert max(pq.read_metadata(p).num_rows for p in parts(root, "spans")) <= 10


def test_full_buffer_refuses_new_rows(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    w = PartWriter(blocked, "spans", background=False, max_buffer_bytes=20_000)
    w.append(span(0, request_json="x" * 15_000))
    with pytest.raises(OSError):
        w.flush()
    with pytest.raises(BufferFull, match="max_buffer_bytes"):
        w.append(span(1, request_json="y" * 10_000))
    assert w.buffered == 1 and w.health()["rows_refused"] == 1
    refused = []
    w.on_full = lambda rows, exc: refused.extend(rows)
    w.append(span(2, request_json="z" * 10_000))
    assert [r["seq"] for r in refused] == [2]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_read_table_skips_a_truncated_part_with_one_warning(tmp_path, caplog):
    w = PartWriter(tmp_path, "spans", background=False)
    for i in range(3):
        w.append(span(i))
        w.flush()
    bad = parts(tmp_path, "spans")[1]
    _truncate(bad)
    with caplog.at_level(logging.WARNING, logger="lightning.schemas"):
        rows = read_table(tmp_path, "spans").to_pylist()
        read_table(tmp_path, "spans")  # cached: no second warning
    assert sorted(r["seq"] for r in rows) == [0, 2]
    warnings = [m for m in caplog.messages if str(bad) in m]
    assert len(warnings) == 1 and "corrupt" in warnings[0]
    good, skipped = finished_parts(tmp_path, "spans")
    assert skipped == [bad] and len(good) == 2
    bad.unlink()  # replaced by a good file: checked again
    w.append(span(1))
    w.flush()
    assert finished_parts(tmp_path, "spans")[1] == []


def test_many_bad_rows_among_good_ones_keep_their_order(tmp_path):
    w = PartWriter(tmp_path, "spans", background=False)
    w.extend([span(i, request_json="bad \udcff" if i % 7 == 3 else "ok", attempt=2**40 if i % 11 == 5 else 0)
              for i in range(1000)])
    w.flush()
    rows = read_table(tmp_path, "spans").to_pylist()
    assert [r["seq"] for r in rows] == list(range(1000))
    bad = {i for i in range(1000) if i % 7 == 3 or i % 11 == 5}
    assert {r["seq"] for r in rows if r["salvaged"]} == bad and w.rows_salvaged == len(bad)
    assert all(r["request_json"] == ("bad \ufffd" if r["seq"] % 7 == 3 else "ok") for r in rows)
    assert all(r["attempt"] == (None if r["seq"] % 11 == 5 else 0) for r in rows)


def test_a_list_with_an_element_it_cannot_store_is_salvaged_whole_to_null(tmp_path):
    """Positions matter (token ids, their logprobs): a lost element nulls the list, not the element."""
    from lightning_harness.schemas.salvage import salvage_value

    w = PartWriter(tmp_path, "spans", background=False)
    w.append(span(0, prompt_token_ids=[1, 2], response_token_ids=[5, 2**40, 7], response_logprobs=[-0.1, -0.2, -0.3]))
    w.append(span(1, prompt_token_ids=[1, 2], response_token_ids=[5, 6], response_logprobs=[-0.1, "x"]))
    w.flush()
    rows = {r["span_id"]: r for r in read_table(tmp_path, "spans").to_pylist()}
    assert rows["s0"]["response_token_ids"] is None and rows["s0"]["prompt_token_ids"] == [1, 2]
    assert rows["s0"]["response_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert rows["s1"]["response_logprobs"] is None and rows["s1"]["response_token_ids"] == [5, 6]
    assert rows["s0"]["salvaged"] is True and rows["s1"]["salvaged"] is True
    assert salvage_value([5, None, 7], pa.list_(pa.int32())) == [5, None, 7]  # a null sent as null stays
