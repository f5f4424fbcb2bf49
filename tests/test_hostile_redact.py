"""Redaction is exact (issue 10): known secrets never reach any column, ordinary text is untouched.

Against the real proxy process and the stub upstream, with the official openai client configured
only by environment (a harness whose OPENAI_API_KEY is a real-looking key) and with raw HTTP where
exact request bytes matter. Each span is checked column by column; the stub's prompt token ids
are the prompt's bytes, so a span that kept its token ids would still hold the secret.
"""

from __future__ import annotations

import base64
import json
import random
import string
import urllib.parse
import urllib.request

import pytest
from fixtures_proxy import read_rewards, read_spans

from lightning_harness.proxy import keyshapes
from lightning_harness.proxy.redact import MASK, MAX_SECRETS, MIN_SECRET_LEN, Redactor, decode_escapes, spellings
from lightning_harness.proxy.sse import SSERelay

KEY = "sk-real-Q7fGh2KpX9vLm4Ns8TbW1cYd"  # the harness's OPENAI_API_KEY
GATEWAY_KEY = "team-gateway-credential-2741"  # a key of no provider's shape: only known values catch it
BASIC_USER, BASIC_PW = "deploy-bot", "pa55/w0rd+Bäckerei!"  # '/', '+', non-ASCII: escape-prone
INNOCENT = [
    "sk-learn-datasets-and-models",
    "Bearer authentication is described in RFC 6750",
    "cookie_policy",
    "the api_key field and the password field",
    "sk-Project-Name-Version-2-Release",
    "AKIA is not a key",
]
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "login",
        "description": "Log in with a password; see cookie_policy.",
        "parameters": {
            "type": "object",
            "properties": {"password": {"type": "string"}, "api_key": {"type": "string"}, "cookie": {"type": "string"}},
            "required": ["password"],
        },
    },
}


def _columns_text(span: dict) -> str:
    """Every column of a span as text (lists and numbers included)."""
    return "\n".join(f"{k}={v}" for k, v in span.items())


def _assert_absent(span: dict, *secrets: str) -> None:
    """No secret in any column, in any spelling (escapes decoded at every nesting level)."""
    text = _columns_text(span)
    for form in (text, decode_escapes(text), decode_escapes(text.replace("\\\\", "\\"))):
        for s in secrets:
            assert s not in form and urllib.parse.quote(s, safe="") not in form, (s, span)


def _assert_scrubbed(span: dict) -> None:
    """Flagged, and nothing left that spells the text token by token (columns or response body)."""
    assert span["secret_detected"] is True, span
    assert span["prompt_token_ids"] is None and span["response_token_ids"] is None and span["response_logprobs"] is None
    body = span["response_json"]
    assert body and not any(f'"{k}"' in body for k in ("prompt_token_ids", "token_ids", "logprobs")), body


def test_known_secrets_leave_no_trace_in_any_column(proxy, openai_from_env, stub_server):
    client = openai_from_env(proxy.env_for("sec", api_key=KEY))
    basic = base64.b64encode(f"{BASIC_USER}:{BASIC_PW}".encode()).decode()
    tool_result = json.dumps({"api_key": KEY, "note": "rotate me"})  # JSON in a JSON string
    cases = [
        ([{"role": "user", "content": f"my key is {KEY}, please keep it"}], {}),
        ([{"role": "user", "content": "call the tool"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "login", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c1", "content": tool_result}], {}),
        ([{"role": "user", "content": f"curl -u {BASIC_USER}:{BASIC_PW} ... header Basic {basic}"},
          {"role": "user", "content": json.dumps({"password": BASIC_PW})}],  # escaped twice on the wire
         {"Authorization": f"Basic {basic}"}),
        ([{"role": "user", "content": f"env: HTTPS_PROXY={proxy.env_for('sec')['HTTPS_PROXY']} token {proxy.token}"}],
         {}),
    ]
    for messages, headers in cases:
        client.chat.completions.create(model="m", messages=messages, extra_headers=headers)
    # the upstream got the real credentials: the proxy only keeps them out of the trace
    sent = stub_server.requests()[-len(cases):]
    assert KEY in sent[0]["_auth"] and basic in sent[2]["_auth"]
    spans = read_spans(proxy)
    assert len(spans) == len(cases)
    for span in spans:  # each call's own credential and the proxy's
        _assert_absent(span, KEY if span is not spans[2] else basic, BASIC_PW, f"{BASIC_USER}:{BASIC_PW}", proxy.token)
        _assert_scrubbed(span)
        assert MASK in span["request_json"]
    _assert_absent(spans[2], basic)
    assert "rotate me" in spans[1]["request_json"] and "curl -u" in spans[2]["request_json"]


def test_a_secret_only_in_a_streamed_answer_is_masked_in_the_assembled_response(make_proxy, openai_from_env):
    """The proxy serves 'gpt-4o' as a model whose name holds the key; the stub echoes the served
    name into every SSE chunk, so the key is in the upstream's answer only (the harness sees
    'gpt-4o'): the assembled response is masked and the span flagged."""
    proxy = make_proxy(model_map={"gpt-4o": f"ft:{GATEWAY_KEY}"})
    client = openai_from_env(proxy.env_for("sse", api_key=GATEWAY_KEY))
    stream = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert {c.model for c in stream} == {"gpt-4o"}
    (span,) = read_spans(proxy)
    _assert_absent(span, GATEWAY_KEY)
    _assert_scrubbed(span)
    assert json.loads(span["response_json"])["model"] == f"ft:{MASK}" and span["served_model"] == f"ft:{MASK}"


def test_forward_https_key_in_the_tunnel_and_in_the_prompt(proxy, openai_from_env):
    """Forward mode through TLS interception: the key is read from the decrypted headers."""
    env = proxy.env_for("fwd-tls", api_key=GATEWAY_KEY)
    env["OPENAI_BASE_URL"] = "https://api.openai.com/v1"
    client = openai_from_env(env)
    stream = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": f"k={GATEWAY_KEY}"}],
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    (span,) = read_spans(proxy)
    assert span["scheme"] == "https" and span["mode"] == "forward"
    _assert_absent(span, GATEWAY_KEY, proxy.token)
    _assert_scrubbed(span)


def test_ordinary_words_stay_byte_identical(proxy):
    """No masking by key names or words: the recorded request is the harness's exact bytes."""
    env = proxy.env_for("words", api_key=KEY)
    body = {
        "model": "m",
        "tools": [TOOL_SCHEMA],
        "messages": [{"role": "user", "content": "; ".join(INNOCENT)},
                     {"role": "user",
                      "content": json.dumps({"cookie_policy": "strict", "password": "<your password>"})}],
    }
    for raw in (json.dumps(body).encode(), json.dumps(body, ensure_ascii=False, indent=1).encode()):
        req = urllib.request.Request(env["OPENAI_BASE_URL"] + "/chat/completions", data=raw, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=30) as r:
            assert r.status == 200
    spans = read_spans(proxy)
    assert [s["request_json"] for s in spans] == [json.dumps(body), json.dumps(body, ensure_ascii=False, indent=1)]
    for span in spans:
        assert span["secret_detected"] is False and MASK not in _columns_text(span)
        assert span["prompt_token_ids"] and span["response_token_ids"] and span["response_logprobs"]


def test_credential_headers_and_query_values_are_masked(proxy, openai_from_env):
    """api-key / x-api-key / cookie headers and ``?api-key=`` are known secrets for the call."""
    client = openai_from_env(proxy.env_for("hdr", api_key=KEY))
    azure, anth, cookie, query = "azure-Key-0123456789", "anth-Key-9876543210", "sess-5f2b9c7e1a", "query-Key-13579"
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": f"keys: {azure} {anth} {cookie} {query}"}],
        extra_headers={"api-key": azure, "x-api-key": anth, "Cookie": f"lang=en-US; session={cookie}"},
        extra_query={"api-key": query},
    )
    (span,) = read_spans(proxy)
    _assert_absent(span, azure, anth, cookie, query, KEY)
    _assert_scrubbed(span)
    assert "api-key=" in span["path"] and MASK in span["path"]


def test_a_harness_reward_info_holding_its_own_key_is_masked(proxy):
    """A self-reported reward's ``info`` is text the harness chose: its credentials are masked there too."""
    env = proxy.env_for("rw", api_key=GATEWAY_KEY)
    body = json.dumps({"reward": 1.0, "info": {"note": f"key was {GATEWAY_KEY}", "steps": 3}}).encode()
    req = urllib.request.Request(env["LIGHTNING_REWARD_URL"], data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {GATEWAY_KEY}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as answer:
        assert answer.status == 200
    proxy.control.flush()
    (row,) = read_rewards(proxy)
    assert GATEWAY_KEY not in row["info_json"] and MASK in row["info_json"]
    assert json.loads(row["info_json"])["steps"] == 3


# -- the redactor alone: encodings a secret can take ------------------------------------------------------
SECRET = 'Zq9/"Wx+é\\<tag>&k1'  # every character class JSON or URL encoders rewrite


@pytest.mark.parametrize("ascii_only", [True, False])
@pytest.mark.parametrize("nest,prose", [(0, "out: "), (1, "out: "), (2, "out: "), (6, "")])
def test_every_spelling_json_can_produce_is_masked(ascii_only, nest, prose):
    """JSON in prose: three escape levels; a tool result that is JSON: any depth."""
    text = SECRET
    for _ in range(nest):  # a tool result holding JSON holding JSON ...
        text = json.dumps({"v": text}, ensure_ascii=ascii_only)
    doc = json.dumps({"messages": [{"role": "tool", "content": prose + text}]}, ensure_ascii=ascii_only)
    variants = [doc, doc.replace("/", "\\/"), doc.replace("&", "\\u0026")]
    r = Redactor()
    for v in variants:
        out, hit = r.scrub_json(v, r.known([SECRET]))
        assert hit and decode_escapes(out).count(SECRET) == 0 and json.loads(out), v
    every = '{"c": "' + "".join(f"\\u{ord(c):04x}" for c in SECRET) + '"}'  # all chars \u-escaped
    out, hit = r.scrub_json(every, r.known([SECRET]))
    assert hit and json.loads(out) == {"c": MASK}


def test_spellings_cover_url_and_json_forms():
    forms = spellings(SECRET)
    assert SECRET in forms and json.dumps(SECRET)[1:-1] in forms
    assert urllib.parse.quote(SECRET, safe="") in forms and json.dumps(SECRET)[1:-1].replace("/", "\\/") in forms


def test_short_and_placeholder_values_are_not_secrets():
    r = Redactor(["abc"])
    row = r.scrub_row({"request_json": json.dumps({"c": "abc sk-lightning-placeholder pass"})},
                      {"pass", "sk-lightning-placeholder"})
    assert row["secret_detected"] is False and MASK not in row["request_json"]


def test_a_secret_spanning_json_structure_or_as_a_number_is_still_masked():
    r = Redactor()
    row = r.scrub_row({"request_json": '{"max_tokens": 1234567890123}', "prompt_token_ids": [1]}, {"1234567890123"})
    assert row["secret_detected"] and "1234567890123" not in row["request_json"] and row["prompt_token_ids"] is None
    out, hit = r.scrub_json('{"a": "xx", "b": "yy"}', r.known(['xx", "b"']))
    assert hit and 'xx", "b"' not in out


def test_malformed_body_path_and_error_are_masked():
    r = Redactor(["proxy-token-0000"])
    row = r.scrub_row({"request_json": '{"broken": "' + KEY, "path": f"/v1/chat/completions?key={KEY}",
                       "error": f"upstream answered HTTP 401: bad key {KEY[:6]}... proxy-token-0000",
                       "prompt_token_ids": [1]}, {KEY}, request_is_json=False)
    assert KEY not in row["request_json"] and KEY not in row["path"] and "proxy-token-0000" not in row["error"]
    assert row["secret_detected"] and row["prompt_token_ids"] is None


def test_an_error_cut_inside_a_secret_keeps_no_part_of_it():
    r = Redactor()
    row = r.scrub_row({"error": f"upstream answered HTTP 400: echo {KEY[:-5]}"}, {KEY})
    assert row["error"] == f"upstream answered HTTP 400: echo {MASK}"
    # the relay's own messages quote an excerpt cut at 200 bytes and go on after it (found by review)
    secret = "corp-internal-9f8e7d6c5b4a3f2e1d0c"
    head = b'{"choices":[{"delta":{"content":"my key is '
    event = head + b"x" * (188 - len(head)) + secret.encode() + b'"}, BROKEN'
    errors = []
    relay = SSERelay(lambda e: None, [], on_error=errors.append)
    relay(b"data: " + event + b"\n\n")
    relay(b"")
    assert errors and secret[:12] in errors[0] and secret not in errors[0]  # cut inside the secret, then quoted
    masked = r.scrub_row({"error": errors[0]}, {secret})["error"]
    assert secret[:MIN_SECRET_LEN] not in masked and masked.endswith(MASK + "'")


def test_a_jar_of_long_cookies_cannot_crowd_the_api_key_out(proxy, openai_from_env):
    """The redactor keeps a call's MAX_SECRETS longest values; cookies are capped first (found by review:
    64 long cookies pushed a short api-key, with no provider shape, out of the set and into the trace)."""
    client = openai_from_env(proxy.env_for("jar", api_key=KEY))
    azure = "azure-9f8e7d6c5b4a3f2e1d0c"
    jar = "; ".join(f"c{i}=session-{i:04d}-" + "a1" * 20 for i in range(2 * MAX_SECRETS))
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"AZURE_KEY={azure}"}],
                                   extra_headers={"api-key": azure, "Cookie": jar})
    (span,) = read_spans(proxy)
    _assert_absent(span, azure, KEY)
    _assert_scrubbed(span)


# -- provider key shapes ---------------------------------------------------------------------------------
REAL_SHAPES = [  # bodies drawn at random (hand-typed patterns look like CamelCase and are not keys)
    "sk-" + "T3BlbkFJ" + "q8Xv2LmN4pR7sW1yB5dF9hJ3kZ6cG0aE",
    "sk-proj-" + "qg6YYZYn9ZhyiA4uoRgnatmUdjAWtGSU" + "T3BlbkFJ" + "PtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA",
    "sk-ant-api03-" + "PtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA-2O76UMFxFkM-R5Kjp1vRt_1fjORS-6ilI8ihN5KXSc7Tvo"
    + "-hBKqFY" + "AA",
    "sk_live_" + "z63FfkCzJr4i0B3JrTAwR4y9",
    "AKIAIOSFODNN7EXAMPLE",
    "ghp_" + "r4Nd0mT0k3nV4lu3sXyZ9wQ2eR5tY8uI1oP3",
    "github_pat_11ABCDEFG0" + "aB3cD4eF5gH6iJ7kL8mN9oP0qR1sT2uV3wX4yZ5aB6cD7eF8gH9iJ0kL1mN2oP3qR4",
    "xoxb-123456789012-1234567890123-" + "ojfljoQoaF1LlqsajAIxNKu8",
    "AIza" + "Sy9D8f7G6h5J4k3L2z1X0c9V8b7N6m5Q4w3",
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
    "-----END OPENSSH PRIVATE KEY-----",
]


@pytest.mark.parametrize("key", REAL_SHAPES, ids=lambda k: k[:7])
def test_provider_keys_are_masked_and_flag_the_span(key):
    r = Redactor()
    for text in (json.dumps({"content": f"export KEY={key}\nok"}),
                 '{"content": "line\\n' + key.replace("\n", "\\n") + '"}'):
        row = r.scrub_row({"request_json": text, "prompt_token_ids": [1]})
        assert key not in decode_escapes(row["request_json"]) and row["secret_detected"], text
        assert row["prompt_token_ids"] is None


@pytest.mark.parametrize("word", INNOCENT + [
    "XMLHttpRequest2Factory", "sk-TensorFlowModelCheckpointV2", "sk-proj-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "AIzaSyXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "sk_test_YOUR_SECRET_KEY_HERE", "xoxb-your-bot-token",
    "eyJhbGciOi.eyJzdWIiOiIx.not-a-signature",
    "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0\n-----END PUBLIC KEY-----",
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "QAHAEwAAQAAAAAAAgAHAGQAAQAAAAAAAwAaAKIAAQAAAAAABAAHAM0AAQAAAAAABQA8AU8AAQAAAA",  # AKIA inside base64
])
def test_words_placeholders_and_blobs_are_not_keys(word):
    r = Redactor()
    for text in (json.dumps({"content": word}), json.dumps({"content": word}, ensure_ascii=False)):
        row = r.scrub_row({"request_json": text, "prompt_token_ids": [1]})
        assert row["request_json"] == text and row["secret_detected"] is False and row["prompt_token_ids"] == [1]


def test_looking_only_at_hints_masks_what_the_whole_pattern_masks():
    """Texts built from keys, hints inside identifiers (``work_``, ``task-``), hints that overlap
    (``xoxox``, ``AKIAKIA``), escapes before keys, near-misses and random runs: the same masking."""
    rnd = random.Random(7)
    alnum = string.ascii_letters + string.digits
    pieces = [*REAL_SHAPES, "work_dir", "task-id", "mask_keys", "xoxox", "AKIAKIA", "gsk-", "rk_", "sk_",
              "\\n", "\\t", "\\", "-", "_", " ", "\n", "=", '"', "eyJ", "ghp_", "github_pat_", "AIza",
              "PRIVATE KEY", "-----BEGIN ", "sk-proj-", "xoxb-123456789012-", "sk_live_", "sk-ant-api03-"]
    masked = 0
    for _ in range(3000):
        text = "".join(rnd.choice(pieces) if rnd.random() < 0.7 else "".join(rnd.choices(alnum, k=rnd.randint(1, 60)))
                       for _ in range(rnd.randint(1, 8)))
        want = keyshapes.mask_everywhere(text, "X")
        assert keyshapes.mask_keys(text, "X") == want, text
        masked += want != text
    assert masked > 500  # (the texts do hold keys)


def test_decode_escapes_skips_only_steps_that_change_nothing():
    """The decoder checks before each step whether it can change anything; the plain three passes
    (every step every time) are the specification: the same text on generated escape soup."""
    import re
    import urllib.parse

    from lightning_harness.proxy.redact import decode_escapes

    def plain(text):
        for _ in range(3):
            new = re.sub(r"\\u([0-9a-fA-F]{4})|\\/", lambda m: chr(int(m.group(1), 16)) if m.group(1) else "/", text)
            new = urllib.parse.unquote(new) if "%" in new else new
            if re.search("[\ud800-\udfff]", new):
                new = new.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            if new == text:
                break
            text = new
        return text

    rnd = random.Random(3)
    pieces = ["\\ud83d", "\\ude00", "\\uD800", "\\u0073", "\\\\u0073", "\\u005cu0073", "%5Cu0073", "%73", "%",
              "%zz", "%e2%82", "\\/", "\\", "\ud800", "\udfff", "é", "€", "sk-", "x", " ", "%25", "\\u00"]
    for _ in range(3000):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 10)))
        assert decode_escapes(text) == plain(text), ascii(text)


def test_a_key_hidden_behind_ascii_escapes_is_found():
    key = REAL_SHAPES[0]
    hidden = "".join(f"\\u{ord(c):04x}" if i % 3 == 0 else c for i, c in enumerate(key))
    row = Redactor().scrub_row({"request_json": '{"content": "' + hidden + '"}'})
    assert row["secret_detected"] and json.loads(row["request_json"]) == {"content": MASK}


def test_a_secret_without_any_plain_ascii_run_is_found_behind_escapes():
    secret = "ÄÖÜ€äöü߀ÄÖ"
    doc = json.dumps({"content": f"pw {secret}"})  # ensure_ascii: only \\u escapes on the wire
    row = Redactor().scrub_row({"request_json": doc}, {secret})
    assert row["secret_detected"] and json.loads(row["request_json"]) == {"content": f"pw {MASK}"}


def test_hostile_text_never_breaks_the_row():
    """Lone surrogates (valid JSON escapes, undecodable header bytes), deep nesting, thousands of
    cookies: the row is still written as UTF-8 and masked."""
    r = Redactor()
    row = r.scrub_row({"request_json": '{"c": "\\ud800 ' + KEY + '"}', "prompt_token_ids": [1]}, {"abc\udcffdefghij"})
    assert row["secret_detected"] and KEY not in row["request_json"]
    row["request_json"].encode("utf-8")  # storable
    deep = '{"c": ' * 5000 + '"' + KEY + '"' + "}" * 5000
    row = r.scrub_row({"request_json": deep, "prompt_token_ids": [1]})
    assert KEY not in row["request_json"] and row["secret_detected"]
    many = r.known({f"cookie-value-{i:06d}" for i in range(5000)})
    assert len(many.values) == MAX_SECRETS
