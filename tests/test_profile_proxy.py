"""scripts/profile_proxy.py: py-spy's raw stacks folded into time per function and per package."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import profile_proxy  # noqa: E402

SITE = "/x/.venv-proxy/lib/python3.11/site-packages"
RUN = "_run_once (/usr/lib/python3.11/asyncio/base_events.py:1922)"
SEND = f"Http1Server.send ({SITE}/mitmproxy/proxy/layers/http/_http1.py:250)"
GET = f"Headers.get_all ({SITE}/mitmproxy/http.py:155)"
RELAY = f"SSERelay.__call__ ({ROOT}/proxy/sse.py:64)"
LOADS = f"SSERelay._loads ({ROOT}/proxy/sse.py:160)"


def test_samples_fold_into_inclusive_self_and_package_time():
    raw = "\n".join([
        f"thread (1): MainThread;{RUN};{SEND};{GET} 3",
        f"thread (1): MainThread;{RUN};{RELAY};{LOADS} 2",
        f"thread (1): MainThread;{RUN};{RELAY};{RELAY} 1",  # recursion counts once inclusive
        "thread (1): MainThread 5",  # no Python frame (C code holding the GIL): not a function's time
        "",
    ])
    incl, self_, pkg, total = profile_proxy.aggregate(raw)
    assert total == 6
    names = {k.split(" (")[0]: k for k in incl}
    assert incl[names["_run_once"]] == 6 and incl[names["SSERelay.__call__"]] == 3
    assert self_[names["Headers.get_all"]] == 3 and self_[names["SSERelay._loads"]] == 2
    assert self_[names["SSERelay.__call__"]] == 1 and self_[names["Http1Server.send"]] == 0
    assert dict(pkg) == {"mitmproxy": 3, "lightning_harness": 3}


def test_frames_are_named_by_package_path_not_by_machine():
    assert profile_proxy.frame_name(SEND) == ("Http1Server.send (mitmproxy/proxy/layers/http/_http1.py)", "mitmproxy")
    assert profile_proxy.frame_name(RELAY) == ("SSERelay.__call__ (lightning_harness/proxy/sse.py)",
                                               "lightning_harness")
    assert profile_proxy.frame_name(RUN) == ("_run_once (asyncio/base_events.py)", "asyncio")
    assert profile_proxy.frame_name("<frozen runpy>") == ("<frozen runpy>", "other")
