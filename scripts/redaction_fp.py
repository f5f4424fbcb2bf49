#!/usr/bin/env python
"""Count false positives of redaction: masks applied where no known secret was present.

Runs the proxy's redactor (``proxy/redact.py``, provider key shapes of ``proxy/keyshapes.py``)
with no known secrets over every string of:

- spans Parquet files (traces directories or files given on the command line): every text column,
  JSON columns the way capture scrubs them; spans already recorded with a mask or with
  ``secret_detected`` are reported too (the recording proxy masked something there);
- text files (``--files``: e.g. the repository's own code and docs, real text an agent reads);
- a built-in corpus of hostile-but-innocent texts (words and placeholders that look like
  secrets: ``sk-learn-...``, ``Bearer authentication``, ``cookie_policy``, key prefixes in docs,
  CamelCase identifiers, base64/base64url blobs, hashes, UUIDs, PEM public blocks, escapes), each
  also inside a chat request serialised with and without ``ensure_ascii``.

Every mask found is printed with its context; a real key among them is a true positive (judge by
eye). Exit status 1 when any mask was applied.

    .venv/bin/python scripts/redaction_fp.py --corpus --files 'docs/*.md' 'proxy/**/*.py' \\
        --traces /tmp/lh-fp-traces
"""

from __future__ import annotations

import argparse
import base64
import glob
import json
import os
import random
import sys
import uuid
from pathlib import Path

from lightning_harness.proxy import keyshapes
from lightning_harness.proxy.redact import JSON_COLUMNS, MASK, Redactor

ROOT = Path(__file__).resolve().parent.parent

WORDS = [
    "sk-learn-datasets-and-models", "pip install scikit-learn  # sk-learn-0.24.2", "task-sk-8f3a2b1c9d0e7f6a5b4c",
    "Bearer authentication (RFC 6750)", "Authorization: Bearer <token>", "Authorization: Bearer YOUR_API_KEY",
    "Authorization: Bearer ${OPENAI_API_KEY}", "Basic auth: curl -u user:password https://example.com",
    "cookie_policy", "Set-Cookie: session=<value>; HttpOnly", "api_key", "password", "x-api-key", "client_secret",
    "AKIA is the prefix of AWS access key ids", "AKIAEXAMPLE", "ghp_ tokens and github_pat_ tokens",
    "xoxb-your-bot-token", "AIzaSyXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "sk_test_YOUR_SECRET_KEY_HERE",
    "sk-proj-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "sk-ant-api03-...", "sk-...abcd (your key, redacted)",
    "sk-TensorFlowModelCheckpointV2", "sk-Project-Name-Version-2-Release", "risk-assessment-2024-Q3-Report-Final-v2",
    "desk-lamp-LED-Model-X200-Warm-White", "gpt-4o-mini-2024-07-18", "claude-3-5-sonnet-20241022",
    "eyJhbGciOi (the start of a JWT)", "data:application/json;base64,eyJmb28iOiJiYXIifQ==",
    "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----",
    "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----",
    "50% off, 100%25 sure, %E2%9C%93 and \\u00e9 \\/ escapes", "const apiKey = process.env.OPENAI_API_KEY;",
    'os.environ["AWS_SECRET_ACCESS_KEY"]', "token_ids", "logprobs", "session_id", "access_token: null",
    "The password field must be at least 12 characters.", "XMLHttpRequest2FactoryBean3Impl",
]


def corpus(seed: int = 0) -> list[str]:
    """Innocent strings that look like secrets, plus random blobs and ids an agent sees every day."""
    rng = random.Random(seed)
    blobs = [base64.b64encode(rng.randbytes(3000)).decode() for _ in range(20)]
    blobs += [base64.urlsafe_b64encode(rng.randbytes(3000)).decode() for _ in range(20)]
    ids = ([uuid.UUID(int=rng.getrandbits(128)).hex for _ in range(200)]
           + [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(200)])
    ids += [rng.randbytes(32).hex() for _ in range(200)]
    texts = WORDS + blobs + ["data:image/png;base64," + b for b in blobs[:5]] + [" ".join(ids)]
    return texts


def as_requests(texts: list[str]) -> list[str]:
    """Each text as a chat request with a tool schema, serialised both ways a client may."""
    tool = {"type": "function", "function": {"name": "login", "parameters": {"type": "object", "properties": {
        "password": {"type": "string"}, "api_key": {"type": "string"}, "cookie_policy": {"type": "string"}}}}}
    out = []
    for t in texts:
        body = {"model": "m", "tools": [tool], "messages": [{"role": "user", "content": t},
                                                           {"role": "tool", "content": json.dumps({"out": t})}]}
        out += [json.dumps(body), json.dumps(body, ensure_ascii=False)]
    return out


class Tally:
    """Strings, bytes and masks seen per source; keeps the first examples."""

    def __init__(self, show: int) -> None:
        self.show, self.rows, self.examples = show, {}, []

    def add(self, source: str, before: str, after: str) -> None:
        n = after.count(MASK) - before.count(MASK)
        row = self.rows.setdefault(source, [0, 0, 0])
        row[0] += 1
        row[1] += len(before)
        row[2] += max(n, 0)
        if n > 0 and len(self.examples) < self.show:
            i = after.find(MASK)
            self.examples.append((source, after[max(0, i - 80): i + 90]))

    def note(self, source: str, what: str) -> None:
        self.rows.setdefault(source, [0, 0, 0])[2] += 1
        if len(self.examples) < self.show:
            self.examples.append((source, what))

    def report(self) -> int:
        total = [0, 0, 0]
        print(f"{'source':60} {'strings':>9} {'MB':>8} {'masks':>6}")
        for src, row in self.rows.items():
            print(f"{src[-60:]:60} {row[0]:9,} {row[1] / 1e6:8.2f} {row[2]:6}")
            total = [a + b for a, b in zip(total, row)]
        print(f"{'total':60} {total[0]:9,} {total[1] / 1e6:8.2f} {total[2]:6}")
        total = total[2]
        for src, ex in self.examples:
            print(f"--- {src}: ...{ex!r}...")
        print(f"false positives (masks with no known secret present): {total}")
        return total


def scan_spans(path: Path, root: Path, red: Redactor, tally: Tally) -> None:
    import pyarrow.parquet as pq

    known = red.known()
    rel = path.relative_to(root).parts if root in path.parents else (path.name,)
    src = f"spans:{root.name}/{rel[0]}"
    for row in pq.read_table(path).to_pylist():
        if row.get("secret_detected") or any(isinstance(v, str) and MASK in v for v in row.values()):
            tally.note(src, f"recorded with a mask / secret_detected (rollout {row.get('rollout_id')})")
        for col, val in row.items():
            if isinstance(val, str) and val:
                after = red.scrub_json(val, known)[0] if col in JSON_COLUMNS else red.scrub_text(val, known)[0]
                tally.add(src, val, after)


def calc_traces(n: int, out: Path) -> Path:
    """Record ``n`` tasks of the calc demo harness (examples/calc) through a real proxy and the
    stub upstream (tests/support); returns the traces directory."""
    import subprocess

    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_proxy import StubServer

    from lightning_harness.proxy.client import ProxyProcess

    out.mkdir(parents=True, exist_ok=True)
    stub = StubServer(out)
    proxy = ProxyProcess(out / "traces", upstreams=[stub.url], route_hosts=["api.openai.com"],
                         confdir=out / "conf", log_path=out / "proxy.log").start()
    try:
        rows = (ROOT / "examples/calc/tasks_train.jsonl").read_text().splitlines()[:n]
        base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
        for i, row in enumerate(rows):
            env = {**base, **proxy.env_for(f"calc-{i}"), "LIGHTNING_TASK": row}
            subprocess.run([sys.executable, str(ROOT / "examples/calc/harness.py")], env=env, timeout=120,
                           capture_output=True, check=False)
    finally:  # stop() is a SIGTERM: the proxy flushes everything before it exits
        proxy.stop()
        stub.stop()
    return out / "traces"


def timing(red: Redactor) -> None:
    """CPU time of ``scrub_row`` per call on chat requests of 7 KB and 300 KB, with a known key."""
    import time

    resp = json.dumps({"choices": [{"message": {"content": "ok " * 50}, "token_ids": list(range(100))}],
                       "prompt_token_ids": list(range(2000))})
    for n in (5, 200):
        for ascii_only in (False, True):
            msgs = [{"role": "user",
                     "content": f"Ünïcode prose about api key rotation, line {i}. " * 20} for i in range(n)]
            body = json.dumps({"model": "m", "messages": msgs}, ensure_ascii=ascii_only)
            t0, reps = time.process_time(), 40
            for _ in range(reps):
                red.scrub_row({"request_json": body, "response_json": resp, "path": "/v1/chat/completions"},
                              {"sk-real-" + "Q7fGh2KpX9vLm4Ns8TbW1cYd"})  # (split: no key in this file)
            ms = (time.process_time() - t0) / reps * 1000
            encoding = "ASCII-escaped" if ascii_only else "UTF-8"
            print(f"scrub_row: {len(body):>8,} B request ({encoding}): {ms:.2f} ms CPU")
    # source code, as a coding agent resends what it read: full of hints (work_, task_, mask-)
    code = json.dumps("".join(f.read_text() for f in sorted((ROOT / "proxy").rglob("*.py"))))
    per_call = {}
    for name, fn in (("mask_keys", keyshapes.mask_keys), ("the whole pattern", keyshapes.mask_everywhere)):
        t0 = time.process_time()
        for _ in range(5):
            fn(code, MASK)
        per_call[name] = (time.process_time() - t0) / 5 * 1000
    print(f"provider keys in {len(code):,} B of this repository's proxy/ source: mask_keys "
          f"{per_call['mask_keys']:.1f} ms CPU, the whole pattern {per_call['the whole pattern']:.1f} ms "
          f"({per_call['the whole pattern'] / per_call['mask_keys']:.1f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="*", default=[], help="traces directories or spans Parquet files")
    ap.add_argument("--files", nargs="*", default=[], help="text file globs (recursive **), relative to the repo")
    ap.add_argument("--corpus", action="store_true", help="the built-in hostile-but-innocent corpus")
    ap.add_argument("--run-calc", type=int, default=0, metavar="N",
                    help="first record N calc-demo tasks through a real proxy (stub upstream) and scan them")
    ap.add_argument("--workdir", default=None, help="where --run-calc records (default: a temporary directory)")
    ap.add_argument("--show", type=int, default=20, help="examples to print")
    ap.add_argument("--timing", action="store_true", help="also print the redactor's CPU time per call")
    a = ap.parse_args(argv)
    red, tally = Redactor(), Tally(a.show)
    if a.timing:
        timing(red)
    known = red.known()
    if a.run_calc:
        import tempfile

        work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="lh-redaction-fp-"))
        a.traces.append(str(calc_traces(a.run_calc, work)))
    for t in a.traces:
        p = Path(t)
        for f in sorted(p.glob("**/spans/**/*.parquet")) if p.is_dir() else [p]:
            scan_spans(f, p if p.is_dir() else p.parent, red, tally)
    for pattern in a.files:
        for f in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            if not os.path.isfile(f) or os.path.getsize(f) > 50_000_000 or b"\0" in Path(f).read_bytes()[:8192]:
                continue  # folders, weights and other binaries
            text = Path(f).read_text(errors="replace")
            tally.add(f"file:{Path(f).relative_to(ROOT).parts[0]}", text, red.scrub_text(text, known)[0])
    if a.corpus:
        texts = corpus()
        for t in texts:
            tally.add("corpus:text", t, red.scrub_text(t, known)[0])
        for body in as_requests(texts):
            tally.add("corpus:request_json", body, red.scrub_json(body, known)[0])
    return 1 if tally.report() else 0


if __name__ == "__main__":
    sys.exit(main())
