"""Durable Parquet output: SIGTERM flushes everything, SIGKILL leaves only readable files,
DuckDB reads the partitioned tables, and no secret reaches a trace."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path

import duckdb
import httpx
import pyarrow.parquet as pq
import pytest
from fixtures_proxy import read_spans

from lightning_harness.schemas import SCHEMA_VERSION, read_table

pytestmark = pytest.mark.timeout(300)

MSG = [{"role": "user", "content": "hi"}]


def _calls(p, rollout: str, n: int) -> None:
    url = p.env_for(rollout)["OPENAI_BASE_URL"] + "/chat/completions"
    with httpx.Client(trust_env=False, timeout=60) as c:
        for _ in range(n):
            assert c.post(url, json={"model": "m", "messages": MSG, "max_tokens": 2}).status_code == 200


def test_sigterm_flushes_everything(make_proxy, tmp_path):
    p = make_proxy(flush_seconds=3600)  # only a row/byte threshold or shutdown would write
    _calls(p, "term", 25)
    p.control.reward("term", 0, 1.0)
    st = p.control.state()
    assert st["spans_written"] == 0 and st["spans_buffered"] == 25 and st["rewards_written"] == 0
    assert not list((tmp_path / "traces").glob("spans/**/*.parquet"))
    assert p.stop() == 0
    spans = read_table(tmp_path / "traces", "spans")
    assert spans.num_rows == 25 and sorted(spans.column("seq").to_pylist()) == list(range(25))
    assert read_table(tmp_path / "traces", "rewards").num_rows == 1


def test_flushes_within_a_second_by_default(proxy):
    _calls(proxy, "tick", 3)
    deadline = time.monotonic() + 10
    while proxy.control.state()["spans_written"] < 3:
        assert time.monotonic() < deadline, "spans were not written within the flush interval"
        time.sleep(0.1)
    files = list(proxy.traces_dir.glob("spans/day=*/part-*.parquet"))
    assert files


def test_sigkill_leaves_only_readable_files(make_proxy, tmp_path):
    p = make_proxy(flush_seconds=0.2)
    _calls(p, "before", 20)
    deadline = time.monotonic() + 20
    while p.control.state()["spans_written"] < 20:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stop = threading.Event()

    def load(i):
        url = p.env_for(f"load-{i}")["OPENAI_BASE_URL"] + "/chat/completions"
        with httpx.Client(trust_env=False, timeout=10) as c:
            while not stop.is_set():
                try:
                    c.post(url, json={"model": "m", "messages": MSG, "max_tokens": 2})
                except httpx.HTTPError:
                    return

    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(load, i) for i in range(4)]
        time.sleep(1.5)  # several flushes happen under load
        p.kill()
        stop.set()
        for f in futs:
            f.result(timeout=30)
    files = sorted((tmp_path / "traces").glob("spans/**/*.parquet"))
    assert len(files) >= 2
    total = 0
    for f in files:  # every visible file is complete and carries the schema version
        t = pq.read_table(f)
        total += t.num_rows
        assert t.schema.metadata[b"lightning.schema_version"] == str(SCHEMA_VERSION).encode()
    rows = read_table(tmp_path / "traces", "spans").to_pylist()
    assert len(rows) == total and sum(r["rollout_id"] == "before" for r in rows) == 20
    # temporary files (if the kill hit a write) are hidden from every *.parquet glob
    assert all(not f.name.startswith(".") for f in files)


def test_duckdb_reads_partitioned_output(proxy):
    _calls(proxy, "duck", 4)
    proxy.control.reward("duck", 0, 0.25)
    proxy.control.flush()
    root = proxy.traces_dir
    con = duckdb.connect()
    n, rid, day = con.execute(
        "select count(*), any_value(rollout_id), any_value(day) "
        f"from read_parquet('{root}/spans/**/*.parquet', hive_partitioning=true)"
    ).fetchone()
    assert n == 4 and rid == "duck" and len(str(day)) == 10
    joined = con.execute(
        f"""select s.rollout_id, count(*), any_value(r.reward), sum(len(s.response_token_ids))
            from read_parquet('{root}/spans/**/*.parquet', hive_partitioning=true) s
            join read_parquet('{root}/rewards/**/*.parquet', hive_partitioning=true) r using (rollout_id, attempt)
            group by 1"""
    ).fetchall()
    assert joined == [("duck", 4, 0.25, 8)]


def test_no_secrets_in_parquet(proxy, openai_from_env, stub_server):
    secret_key = "sk-proj-SECRETSECRETSECRET1234567890"
    env = proxy.env_for("secret", api_key=secret_key)
    client = openai_from_env(env)
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": f"my key is {secret_key}"}],
        extra_body={"api_key": "hunter2-plain", "metadata": {"password": "pw-123456", "note": "keep"}},
        extra_headers={"Cookie": "session=cookie-value-123", "api-key": "azure-key-123456"},
        extra_query={"api-key": "query-key-123456"},
    )
    # the upstream still got the harness's real credentials
    assert secret_key in stub_server.requests()[-1]["_auth"]
    proxy.control.reward("secret", 0, 1.0, {"token": proxy.token})
    proxy.control.flush()
    blob = b"".join(f.read_bytes() for f in Path(proxy.traces_dir).glob("**/*.parquet"))
    text = "\n".join(str(r) for r in read_spans(proxy)) + "\n".join(
        str(r) for r in read_table(proxy.traces_dir, "rewards").to_pylist()
    )
    for s in (secret_key, "cookie-value-123", "azure-key-123456", "query-key-123456", proxy.token):
        assert s not in text and s.encode() not in blob, s
    # values under secret-sounding names that are no credential of the call stay (no masking by name)
    assert "keep" in text and "[REDACTED]" in text and "hunter2-plain" in text and "pw-123456" in text
