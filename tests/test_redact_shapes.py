"""Provider key shapes the redactor missed (found by review): OpenRouter / DeepSeek lowercase hex after
``sk-``, Hugging Face ``hf_``, Groq ``gsk_``, xAI ``xai-``, GitLab ``glpat-``; and a key after segments
that only looked like a JWT. Each kind is drawn at random (seeded): real-shaped keys are masked in JSON
text, after a ``\\n`` escape and at a string's start, near-misses stay byte-identical, and the hint scan
(``_has_key``) says what the whole pass does on generated text.
"""

from __future__ import annotations

import json
import random
import string

import pytest

from lightning_harness.proxy import keyshapes
from lightning_harness.proxy.redact import MASK, Redactor, decode_escapes

_RND = random.Random(20261207)
_HEX = "0123456789abcdef"
_ALNUM = string.ascii_letters + string.digits


def _draw(alphabet: str, n: int, rnd: random.Random = _RND) -> str:
    return "".join(rnd.choices(alphabet, k=n))


KINDS = {  # kind: (a random key's prefix, alphabet and body length; near-misses of that kind)
    "openrouter": ("sk-or-v1-", _HEX, 64, [
        "sk-or-v1-" + _draw(_HEX, 40), "sk-or-v1-" + "0" * 64, "sk-or-v1-model-list"]),
    "deepseek": ("sk-", _HEX, 32, [
        "sk-learn-datasets-and-models", "sk-" + _draw(_HEX, 40), "sk-" + _draw(_HEX, 31), "sk-" + _draw(_HEX, 48),
        "sk-deadbeefdeadbeefdeadbeefdeadbeef", "sk-0123456789abcdef0123456789abcdef", "sk-" + "a1" * 16 + "x"]),
    "huggingface": ("hf_", string.ascii_letters, 34, [
        "hf_hub_download", "hf_" + "a" * 34, "hf_ModelCardTemplateLoaderFactoryAb",
        "hf_" + _draw(string.ascii_letters, 33)]),
    "groq": ("gsk_", _ALNUM, 52, [
        "gsk_config_value", "gsk_" + _draw(_ALNUM, 40), "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"]),
    "xai": ("xai-", _ALNUM, 80, ["xai-grok-model-name", "xai-" + _draw(_ALNUM, 60), "xai-" + "x" * 80]),
    "gitlab": ("glpat-", _ALNUM + "_-", 20, [
        "glpat-personalaccesstoken", "glpat-PersonalAccessTokens", "glpat-ExampleTokenValue123",
        "glpat-xxxxxxxxxxxxxxxxxxxx", "glpat-" + _draw(_ALNUM, 12)]),
}
NEAR_MISSES = [w for *_, misses in KINDS.values() for w in misses]


def _new_keys(rnd: random.Random) -> list[str]:
    """One random key of each new kind (bodies as the providers make them)."""
    return [prefix + _draw(alphabet, n, rnd) for prefix, alphabet, n, _ in KINDS.values()]


def _texts(key: str) -> list[str]:
    """The key in JSON text, after a ``\\n`` escape (raw JSON), and at the start of a string."""
    return [json.dumps({"content": f"export KEY={key}\nok"}), '{"content": "line\\n' + key + ' end"}',
            json.dumps({"content": key})]


@pytest.mark.parametrize("kind", KINDS)
def test_new_provider_keys_are_masked_and_their_near_misses_are_not(kind):
    """Five keys of the kind drawn with a fixed seed (a body fails the randomness test by chance at
    ~1% for these lengths: measured in ``looks_random`` / ``looks_random_hex``), then its near-misses."""
    prefix, alphabet, n, near_misses = KINDS[kind]
    rnd = random.Random(f"{kind}-1207")
    r = Redactor()
    for key in (prefix + _draw(alphabet, n, rnd) for _ in range(5)):
        for text in _texts(key):
            assert keyshapes.mask_keys(text, MASK) == text.replace(key, MASK), text
            row = r.scrub_row({"request_json": text, "prompt_token_ids": [1]})
            assert key not in decode_escapes(row["request_json"]) and row["secret_detected"], text
            assert row["prompt_token_ids"] is None
    for word in near_misses:
        for text in _texts(word):
            assert keyshapes.mask_keys(text, MASK) is text and not keyshapes._has_key(text), text
            row = r.scrub_row({"request_json": text, "prompt_token_ids": [1]})
            assert row["request_json"] == text and row["secret_detected"] is False, text


def test_a_key_after_segments_that_only_look_like_a_jwt_is_masked():
    """The pass went on after a match that was no key, so an AWS key id right after two ``eyJ``
    segments that were no JWT (their header is no JSON) was kept in clear."""
    aws = "AKIAIOSFODNN7EXAMPLE"
    for glue in (".", ".eyJzdWIiOiIxMjM0NTY3ODkwIn0."):
        text = f"see eyJxxxxxxxxxxx.eyJxxxxxxxxxx{glue}{aws} here"
        assert keyshapes.mask_everywhere(text, MASK) == text.replace(aws, MASK), text
        assert keyshapes.mask_keys(text, MASK) == text.replace(aws, MASK), text


def test_the_hint_scan_agrees_with_the_whole_pass():
    """``_has_key`` (hints only) says yes exactly where the whole pattern masks something, on texts mixing
    new and old keys, near-misses, hints inside identifiers, escapes and code (seeded)."""
    rnd = random.Random(44)
    old = ["sk-proj-qg6YYZYn9ZhyiA4uoRgnatmUdjAWtGSUT3BlbkFJPtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA",
           "AKIAIOSFODNN7EXAMPLE", "ghp_r4Nd0mT0k3nV4lu3sXyZ9wQ2eR5tY8uI1oP3",
           "AIzaSy9D8f7G6h5J4k3L2z1X0c9V8b7N6m5Q4w3",
           "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"]
    code = ['printf("%4d items\\n", n);', "hf_hub_download(repo_id)", "self.gsk_client = None", "x = ghf_",
            "glpat-", "gsk_", "hf_", "xai-", "sk-or-v1-", "sk-", "sk_", "eyJ", ".", "\\n", "\\t", "\\", "-", "_", " ",
            "\n", "=", '"', "xoxai-", "ggsk_", "hhf_", "eyJxxxxxxxxxxx.eyJxxxxxxxxxx."]
    pieces = [*NEAR_MISSES, *code, *old]
    masked = 0
    for _ in range(3000):
        parts = []
        for _piece in range(rnd.randint(1, 8)):
            roll = rnd.random()
            if roll < 0.15:
                parts.append(rnd.choice(_new_keys(rnd)))
            elif roll < 0.75:
                parts.append(rnd.choice(pieces))
            else:
                parts.append(_draw(_HEX if rnd.random() < 0.3 else _ALNUM, rnd.randint(1, 70), rnd))
        text = "".join(parts)
        whole = keyshapes.mask_everywhere(text, "X")
        assert keyshapes._has_key(text) == (whole != text), text
        assert keyshapes.mask_keys(text, "X") == whole, text
        masked += whole != text
    assert 500 < masked < 2500  # (both kinds of text were made)
