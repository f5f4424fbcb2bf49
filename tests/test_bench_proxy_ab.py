"""scripts/bench_proxy_ab.py: a side run from a git revision really runs that revision's code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_proxy_ab  # noqa: E402


def test_source_tree_of_a_revision_is_what_a_proxy_process_imports(tmp_path):
    tree = bench_proxy_ab.source_tree("HEAD", tmp_path / "head")
    # started from a folder that is not the repository, as the script does (`python -m` puts the
    # working folder first on sys.path: from the repository root its own package would win)
    code = "import lightning_harness.proxy.sse as m, lightning_harness.schemas as s; print(m.__file__, s.__file__)"
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tree)},
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert all(path.startswith(str(tree)) for path in got.stdout.split()), got.stdout
    assert (tree / "proxy" / "sse.py").read_bytes() == subprocess.run(
        ["git", "-C", str(ROOT), "show", "HEAD:proxy/sse.py"], capture_output=True, check=True).stdout


def test_context_body_is_a_json_call_of_that_many_kilobytes_of_source():
    import json

    body = json.loads(bench_proxy_ab.request_body(50, 400))
    text = body["messages"][0]["content"]
    assert len(text) == 400_000 and "stream" not in body and "$ cat proxy/" in text and "def " in text
    assert json.loads(bench_proxy_ab.request_body(7, 0))["stream"] is True
