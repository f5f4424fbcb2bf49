"""Redaction, second review: ways a known secret still reached a trace or a log line.

Each test is one finding: junk credential-named values crowding the call's keys out of the
redactor's limit, percent-encoded secrets in JSON bodies, the Proxy-Authorization Basic blob,
``*-Key`` headers, refusals logged with their query or a credential in a malformed id, a secret's
start left by a length cut, and token ids kept in an answer cut short. Live where the defect is end
to end (the real proxy against the stub upstream), on the redactor alone where it is one function.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request

from fixtures_proxy import read_spans

from lightning_harness.proxy.redact import MASK, MAX_SECRETS, MIN_SECRET_LEN, Redactor, decode_escapes

GATEWAY_KEY = "team-gateway-credential-2741"  # no provider's shape: only known values catch it
OPENAI_SHAPED = "sk-proj-" + "qg6YYZYn9ZhyiA4uoRgnatmUdjAWtGSU" + "T3BlbkFJ" + "PtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA"


def _post(url: str, body, headers: dict | None = None, proxies: dict | None = None) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler(proxies or {})).open(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _credential(env: dict) -> str:
    """The attempt credential inside a printed harness environment."""
    return urllib.parse.unquote(env["OPENAI_BASE_URL"].split("/lh/")[1].split("/")[1])


def _assert_clean(span: dict, *secrets: str) -> None:
    """Flagged, token columns empty, and no secret in any column at any escape depth."""
    text = "\n".join(f"{k}={v}" for k, v in span.items())
    for form in (text, decode_escapes(text)):
        for s in secrets:
            assert s not in form, (s, span)
    assert span["secret_detected"] is True, span
    assert span["prompt_token_ids"] is None and span["response_token_ids"] is None


def test_junk_credential_values_cannot_crowd_the_keys_out(proxy):
    """64 long ``X-Trace-Token-N`` headers or ``?tN_token=`` values pushed the API key and the
    attempt credential out of the redactor's per-call limit, into the trace (found by review)."""
    env = proxy.env_for("crowd", api_key=GATEWAY_KEY)
    base, cred = env["OPENAI_BASE_URL"], _credential(env)
    prompt = {"model": "m", "messages": [{"role": "user", "content": f"cred={cred} key={GATEWAY_KEY}"}]}
    auth = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    junk = {f"X-Trace-Token-{i}": f"junk-{i:03d}-" + "z" * 60 for i in range(MAX_SECRETS)}
    assert _post(base + "/chat/completions", prompt, {**auth, **junk})[0] == 200
    query = "&".join(f"t{i}_token=junk-{i:03d}-{'z' * 60}" for i in range(MAX_SECRETS))
    assert _post(base + "/chat/completions?" + query, prompt, auth)[0] == 200
    assert _post(base + "/chat/completions?" + query, prompt, {"x-api-key": GATEWAY_KEY, **junk})[0] == 200
    spans = read_spans(proxy)
    assert len(spans) == 3
    for span in spans:
        _assert_clean(span, cred, GATEWAY_KEY)


def test_percent_encoded_secrets_in_a_json_body_are_found():
    """``team%2Dgateway-...`` or every character as %XX inside a JSON string: the redactor never looked
    (its cheap pre-check knew only ``\\u00XX`` escapes), though the path column was masked."""
    r = Redactor()
    full = "".join(f"%{b:02X}" for b in GATEWAY_KEY.encode())
    cases = [(GATEWAY_KEY.replace("-", "%2D", 1), {GATEWAY_KEY}), (full, {GATEWAY_KEY}),
             (GATEWAY_KEY.replace("-", "%252D", 1), {GATEWAY_KEY}),  # quoted twice
             (OPENAI_SHAPED.replace("-", "%2D", 1), set()),
             ("".join(f"%{b:02x}" for b in OPENAI_SHAPED.encode()), set())]
    for spelled, secrets in cases:
        doc = json.dumps({"messages": [{"role": "tool", "content": f"GET /cb?state={spelled}&x=1"}]})
        row = r.scrub_row({"request_json": doc, "prompt_token_ids": [1]}, secrets)
        assert row["secret_detected"] and row["prompt_token_ids"] is None, spelled
        assert json.loads(row["request_json"])["messages"][0]["content"] == f"GET /cb?state={MASK}&x=1"
    plain = json.dumps({"content": "100%25 sure, a%20b, 50%"})  # escapes of no key character: untouched
    assert r.scrub_json(plain, r.known({GATEWAY_KEY})) == (plain, False)


def test_the_proxy_authorization_blob_is_a_known_secret(proxy):
    """``curl -v`` through HTTP_PROXY prints ``Proxy-Authorization: Basic base64(rollout~0:credential)``;
    a later prompt holding that output kept the blob in clear (only the decoded credential was known)."""
    env = proxy.env_for("blob", api_key=GATEWAY_KEY)
    fwd = urllib.parse.urlsplit(env["HTTP_PROXY"])
    pair = f"{urllib.parse.unquote(fwd.username)}:{urllib.parse.unquote(fwd.password)}"
    blob = base64.b64encode(pair.encode()).decode()
    curl_v = f"> GET http://example.com/ HTTP/1.1\n> Proxy-Authorization: Basic {blob}\n> User-Agent: curl/8.5.0\n"
    body = {"model": "m", "messages": [{"role": "user", "content": f"{curl_v}\nuser:pass was {pair}"}]}
    auth = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    assert _post(env["OPENAI_BASE_URL"] + "/chat/completions", body, auth)[0] == 200  # reverse mode
    assert _post("http://api.openai.com/v1/chat/completions", body, auth,  # forward: sent in that header too
                 proxies={"http": env["HTTP_PROXY"]})[0] == 200
    spans = read_spans(proxy)
    assert [s["mode"] for s in spans] == ["reverse", "forward"]
    for span in spans:
        _assert_clean(span, blob, pair)
        assert "Proxy-Authorization: Basic " + MASK in json.loads(span["request_json"])["messages"][0]["content"]


def test_key_headers_of_any_vendor_are_known_secrets(proxy):
    """``Ocp-Apim-Subscription-Key`` (Azure API Management), ``X-Functions-Key`` were not collected; an
    ``Idempotency-Key`` (a retry id) is no credential and stays."""
    env = proxy.env_for("apim", api_key=GATEWAY_KEY)
    apim, functions, idem = "4f1c2b9e8d7a4c3b9e2f1a0b7c6d5e4f", "fn-key-0a1b2c3d4e5f6a7b", "retry-0f9e8d7c6b5a"
    body = {"model": "m", "messages": [{"role": "user", "content": f"keys {apim} {functions} id {idem}"}]}
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}", "Ocp-Apim-Subscription-Key": apim,
               "X-Functions-Key": functions, "Idempotency-Key": idem}
    assert _post(env["OPENAI_BASE_URL"] + "/chat/completions", body, headers)[0] == 200
    (span,) = read_spans(proxy)
    _assert_clean(span, apim, functions)
    assert json.loads(span["request_json"])["messages"][0]["content"] == f"keys {MASK} {MASK} id {idem}"


def test_refusals_log_no_query_credential_nor_a_credential_in_a_malformed_id(make_proxy):
    """Refused calls were logged with their full URL (``?key=``, ``?api-key=`` in clear) and with a
    ``why`` quoting a credential glued to the id behind ``%2F`` (found by review)."""
    proxy = make_proxy(max_body_size=4096)
    google = "AIza" + "Sy9D8f7G6h5J4k3L2z1X0c9V8b7N6m5Q4w3"
    env = proxy.env_for("logs", api_key=GATEWAY_KEY)
    base, cred = env["OPENAI_BASE_URL"], _credential(env)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert _post(base + f"/chat/completions?key={google}&api-key={GATEWAY_KEY}&api-version=2024-06-01", big)[0] == 413
    assert _post(base + f"/chat/completions?api-key={GATEWAY_KEY}", b"not gzip", {"Content-Encoding": "gzip"})[0] == 400
    assert _post(proxy.reverse_url + f"/lh/logs~0%2F{cred}/x/v1/chat/completions", {"model": "m"})[0] == 400
    assert _post(proxy.reverse_url + f"/lh/logs~0{cred}/x/v1/chat/completions", {"model": "m"})[0] == 400
    assert _post(f"http://api.openai.com/v1/chat/completions?key={google}", {"model": "m"},
                 proxies={"http": f"http://logs~0:wrong@127.0.0.1:{proxy.forward_port}"})[0] == 407
    assert len(read_spans(proxy)) == 2  # (refused by limits: recorded; by attribution: not)
    log = proxy.log_path.read_text()
    refused = [line for line in log.splitlines() if "refused POST" in line]
    assert len(refused) == 5, log
    for secret in (google, GATEWAY_KEY, cred, cred[:MIN_SECRET_LEN]):
        assert secret not in log
    assert f"?key={MASK}&api-key={MASK}&api-version=2024-06-01" in refused[0]
    assert "/lh/logs~0/***/***/v1/chat/completions (400): invalid attempt '0/***': an attempt is" in refused[2]
    assert "/lh/logs~***/***/v1/chat/completions (400): invalid attempt '***': an attempt is" in refused[3]


def test_a_secret_cut_at_a_length_leaves_no_head_in_free_text():
    """``Redactor.text`` (log lines, any free text) masks a secret's start left by a length cut, as the
    span's error column does; a whole JSON document is not cut, and keeps its bytes."""
    r = Redactor()
    assert r.text(f"upstream said: echo {GATEWAY_KEY[:-5]}", {GATEWAY_KEY}) == f"upstream said: echo {MASK}"
    assert r.text(f"{GATEWAY_KEY[:12]}...(300 chars) more", keys={GATEWAY_KEY}) == f"{MASK}...(300 chars) more"
    doc = json.dumps({"note": GATEWAY_KEY[:12]})
    assert r.json_text(doc, {GATEWAY_KEY}) == doc


def _cut_answer(answer: str, cut: int) -> bytes:
    prompt = "print the key"
    body = {"id": "c1", "object": "chat.completion", "model": "m", "prompt_token_ids": list(prompt.encode()),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop",
                         "token_ids": list(answer.encode()),
                         "logprobs": {"content": [{"token": chr(b), "logprob": -0.1,
                                                   "top_logprobs": [{"token": "]", "logprob": -2.0}]}
                                                  for b in answer.encode()]}}]}
    return json.dumps(body).encode()[:-cut]


def test_token_fields_go_from_an_answer_cut_short():
    """A body that does not parse kept ``token_ids`` and per-token logprobs in ``response_json``
    although the span held a secret: they spell it token by token. Their values become null."""
    r = Redactor()
    for cut in (3, 40, 400):
        row = r.scrub_row({"request_json": '{"messages": []}', "response_json": _cut_answer(f"key {GATEWAY_KEY}", cut)
                           .decode(), "response_token_ids": [1], "response_logprobs": [-0.1]}, {GATEWAY_KEY})
        body = row["response_json"]
        assert row["secret_detected"] and row["response_token_ids"] is None and row["response_logprobs"] is None
        assert GATEWAY_KEY not in body and '"token": ' not in body and not any(c.isdigit() for c in body.split("[")[-1])
        assert '"prompt_token_ids": null' in body and '"token_ids": null' in body and '"id": "c1"' in body
    tricky = ('{"content": "\\"token_ids\\": [1, 2] and ] }", "token_ids": [9, 8, {"a": "]}"}, 7], "n": 1, '
              '"logprobs": {"c')
    assert Redactor._null_token_values(tricky) == (
        '{"content": "\\"token_ids\\": [1, 2] and ] }", "token_ids": null, "n": 1, "logprobs": null')


def test_token_fields_go_from_a_live_answer_cut_short(make_proxy, upstream):
    """End to end: an upstream answer cut mid-body (a truncated span) whose text holds the key."""
    proxy = make_proxy(upstreams=[upstream.url])
    data = _cut_answer(f"the key is {GATEWAY_KEY}", 30)
    upstream.answer = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                       f"Connection: close\r\n\r\n").encode() + data
    env = proxy.env_for("cut", api_key=GATEWAY_KEY)
    body = {"model": "m", "messages": [{"role": "user", "content": "print the key"}]}
    _post(env["OPENAI_BASE_URL"] + "/chat/completions", body, {"Authorization": f"Bearer {GATEWAY_KEY}"})
    (span,) = read_spans(proxy)
    _assert_clean(span, GATEWAY_KEY)
    rj = span["response_json"]
    assert '"token_ids": null' in rj and '"prompt_token_ids": null' in rj and '"logprob"' not in rj, rj


def test_a_key_in_the_proxys_environment_is_masked_though_no_call_sends_it(make_proxy):
    """Found by review: a key harnesses are handed from the environment but never send in a header (a
    GitHub token, an AWS secret key: no provider shape to catch it) was recorded in clear when a tool
    printed it into a prompt. The proxy and the launcher take the values of their environment's
    variables named like secrets as known secrets."""
    import os

    from lightning_harness.proxy.redact import environment_secrets

    aws = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": aws, "GH_TOKEN": GATEWAY_KEY}
    p = make_proxy(env=env)
    base = p.env_for("env")["OPENAI_BASE_URL"]
    prompt = {"model": "m", "messages": [{"role": "user", "content": f"$ env\nAWS={aws}\nGH={GATEWAY_KEY}\n"}]}
    assert _post(base + "/chat/completions", prompt)[0] == 200
    (span,) = read_spans(p)
    _assert_clean(span, aws, GATEWAY_KEY)
    taken = {"OPENAI_API_KEY": "sk-x1" * 4, "HF_TOKEN": "hf_" + "a1" * 10, "PGPASSWORD": "hunter2-hunter2-x",
             "APIKEY": "k7" * 8, "AWS_SECRET_ACCESS_KEY": "/9kQ7rT1" + "Io" * 8, "X_SECRETS": "s3cr3t-" * 3}
    left = {"TOKENIZERS_PARALLELISM": "false-false-false", "SSH_AUTH_SOCK": "/tmp/ssh-abcdefgh/a1",
            "MONKEY_PATCH": "on-on-on-on-on-1", "GPG_KEY": "short1", "X_SECRET": "a:b/c=d!e:f/g=h:1/2",
            "SECRET_BACKEND": "kubernetes-cluster", "TOKEN_MODEL": "meta-llama/Llama-3-8B", "API_KEY": "kubernetes",
            "AUTH_TOKEN": "https://oauth2.example.com/t1", "SSL_KEY": "/etc/ssl/private/server1.key"[:0] + __file__,
            "AWS_SESSION_TOKEN": "a1" * 400, "DB_PASSWORD": "two words 1234567"}
    assert sorted(environment_secrets({**taken, **left})) == sorted(taken.values())


def test_a_key_split_over_two_messages_system_blocks_flags_the_span(proxy):
    """Found by review: the Messages translation joins a request's system blocks with nothing (as vLLM's
    /v1/messages does), so a key split over two blocks, in no recorded text whole, reached the engine
    whole and its prompt ids, kept, spelled it. The request as sent upstream is searched too."""
    half = len(GATEWAY_KEY) // 2
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "system": [{"type": "text", "text": "config: " + GATEWAY_KEY[:half]},
                       {"type": "text", "text": GATEWAY_KEY[half:] + " end"}]}
    env = proxy.env_for("split", api_key=GATEWAY_KEY)
    status, _ = _post(env["ANTHROPIC_BASE_URL"] + "/v1/messages", body,
                      {"x-api-key": GATEWAY_KEY, "anthropic-version": "2023-06-01"})
    assert status == 200
    (span,) = read_spans(proxy)
    assert span["endpoint"] == "messages" and span["secret_detected"] is True
    assert span["prompt_token_ids"] is None and span["response_token_ids"] is None


def test_a_key_an_attempt_sent_once_stays_known_in_its_later_calls(proxy):
    """Found by review: a key sent in one call's header was unknown in the attempt's next call, which
    sent a placeholder, so a tool output quoting it there was recorded in clear with its token ids."""
    env = proxy.env_for("cross", api_key=GATEWAY_KEY)
    base = env["OPENAI_BASE_URL"]
    hello = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert _post(base + "/chat/completions", hello, {"Authorization": f"Bearer {GATEWAY_KEY}"})[0] == 200
    quoted = {"model": "m", "messages": [{"role": "user", "content": f"$ cat .env\nKEY={GATEWAY_KEY}"}]}
    assert _post(base + "/chat/completions", quoted, {"Authorization": "Bearer placeholder-key-12345"})[0] == 200
    other = proxy.env_for("other")["OPENAI_BASE_URL"]  # another attempt never sent it: nothing to mask there
    assert _post(other + "/chat/completions", hello, {"Authorization": "Bearer placeholder-key-12345"})[0] == 200
    spans = {(s["rollout_id"], s["seq"]): s for s in read_spans(proxy)}
    assert spans[("cross", 0)]["secret_detected"] is False
    _assert_clean(spans[("cross", 1)], GATEWAY_KEY)
    assert spans[("other", 0)]["secret_detected"] is False


def test_junk_token_headers_cannot_crowd_a_vendors_credential_header_out(proxy):
    """Found by review: the 16 longest credential-named headers were kept, so 16 longer ``X-Junk-Token-N``
    headers pushed a real GitLab ``Private-Token`` or Google ``X-Goog-Api-Key`` out, and a prompt echoing
    it was recorded in clear. Vendors' credential headers are kept apart from the others."""
    env = proxy.env_for("vendor", api_key=GATEWAY_KEY)
    gitlab, google = "gitlab-deploy-credential-5521", "goog-project-credential-9083"  # no provider shape
    junk = {f"X-Junk-Token-{i}": f"junk-{i:03d}-" + "z" * 60 for i in range(20)}
    prompt = {"model": "m", "messages": [{"role": "user", "content": f"$ env\nGITLAB={gitlab}\nGOOGLE={google}"}]}
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}", **junk, "Private-Token": gitlab, "X-Goog-Api-Key": google}
    assert _post(env["OPENAI_BASE_URL"] + "/chat/completions", prompt, headers)[0] == 200
    (span,) = read_spans(proxy)
    _assert_clean(span, gitlab, google, GATEWAY_KEY)
    assert json.loads(span["request_json"])["messages"][0]["content"] == f"$ env\nGITLAB={MASK}\nGOOGLE={MASK}"


def test_a_basic_password_in_a_vendors_credential_header_stays_known(proxy):
    """Found by review of the test above's fix: each vendor header name kept its 2 longest values after
    expanding them, and a Basic value expands to 4 (value, base64, user:password, password): the password,
    the shortest, was dropped, so a prompt echoing it was recorded in clear. Values are capped as sent,
    then expanded."""
    env = proxy.env_for("vendor-basic", api_key=GATEWAY_KEY)
    password = "Zq8-hunter2-password-77"
    basic = "Basic " + base64.b64encode(f"svc:{password}".encode()).decode()
    prompt = {"model": "m", "messages": [{"role": "user", "content": f"the tool printed: password={password}"}]}
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}", "X-Auth-Token": basic}
    assert _post(env["OPENAI_BASE_URL"] + "/chat/completions", prompt, headers)[0] == 200
    (span,) = read_spans(proxy)
    _assert_clean(span, password, GATEWAY_KEY)
