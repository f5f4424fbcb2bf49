"""Provider key formats: secrets nobody told the proxy about, recognised by their exact shape.

Why shapes and not names: masking the value of every ``password`` / ``api_key`` property or every
word after ``Bearer`` rewrites ordinary text (tool schemas, prose, ``sk-learn-...``), and the
samples builder would then train on text the model never saw. A shape here needs the provider's
prefix at a token boundary, its length, and a body that reads as random (digits, both cases, many
character-class switches), so words and identifiers never match. Known secret values (headers,
proxy tokens) are masked exactly elsewhere (``redact.py``); these formats are the safety net.

Covered: OpenAI (``sk-``, ``sk-proj-``, ``sk-svcacct-``, ``sk-admin-``), Anthropic (``sk-ant-...``),
lowercase hex after ``sk-`` / ``sk-or-v1-`` (DeepSeek-style 32, OpenRouter 64 characters), Stripe
(``sk_live_``/``sk_test_``/``rk_...``), AWS access key ids (``AKIA``/``ASIA``), GitHub
(``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_``, ``github_pat_``), GitLab (``glpat-``), Hugging Face
(``hf_`` + 34), Groq (``gsk_`` + 52), xAI (``xai-`` + 80), Slack (``xox?-``), Google API keys
(``AIza``), JWTs (two base64url JSON segments whose header names an ``alg``/``typ``, plus a
signature) and PEM private key blocks. Not covered: formats without a prefix (AWS secret keys,
hex tokens) - they cannot be told from data without a key name. A hex body is random by its
letter/digit mix alone (:func:`looks_random_hex`): ``sk-`` + a 40-character git hash stays.
"""

from __future__ import annotations

import base64
import binascii
import json
import re

# a key starts at a token boundary: not after a word character or '-', but after an escape such
# as the 'n' of '\n' in raw JSON text it may
_START = r"(?:(?<![A-Za-z0-9_\-])|(?<=\\[nrtbf]))"
_END = r"(?![A-Za-z0-9_\-])"
# every key starts with one of these (PEM with its '-'): tested first, it spares every other position
# the boundary lookbehinds and the try of each kind (the whole pass: 3.6x faster on code)
_FIRST = r"(?=[-sgrAxhe])"
_SHAPES = re.compile(
    _FIRST + r"(?:" + _START + r"(?:"
    # before ``sk``: a hex body that is not a key must not be tried as an ``sk`` body (that one needs
    # both cases, so it is none either: the order changes nothing the pass masks)
    r"(?P<skhex>sk-(?:or-v1-)?(?P<skhex_body>[0-9a-f]{64}|[0-9a-f]{32}))"
    r"|(?P<sk>sk-(?:proj-|svcacct-|admin-|ant-[a-z]+\d\d-)?(?P<sk_body>[A-Za-z0-9_\-]{20,}))"
    r"|(?P<stripe>(?:sk|rk)_(?:live|test)_(?P<stripe_body>[A-Za-z0-9]{20,}))"
    r"|(?P<aws>(?:AKIA|ASIA)[A-Z0-9]{16})"
    r"|(?P<gh>gh[pousr]_(?P<gh_body>[A-Za-z0-9]{36,}))"
    r"|(?P<ghpat>github_pat_(?P<ghpat_body>[A-Za-z0-9_]{50,}))"
    r"|(?P<glpat>glpat-(?P<glpat_body>[A-Za-z0-9_\-]{20,}))"
    r"|(?P<hf>hf_(?P<hf_body>[A-Za-z0-9]{34}))"
    r"|(?P<groq>gsk_(?P<groq_body>[A-Za-z0-9]{52}))"
    r"|(?P<xai>xai-(?P<xai_body>[A-Za-z0-9]{80}))"
    r"|(?P<slack>xox[abposr]-(?:[0-9]{6,}-){1,3}(?P<slack_body>[A-Za-z0-9]{16,}))"
    r"|(?P<google>AIza(?P<google_body>[A-Za-z0-9_\-]{35}))"
    r"|(?P<jwt>(?P<jwt_head>eyJ[A-Za-z0-9_\-]{8,})\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{16,})"
    r")" + _END
    + r"|(?P<pem>-----BEGIN [A-Z ]{0,20}PRIVATE KEY-----(?:(?!-----)[\s\S]){16,8000}?-----END [A-Z ]{0,20}PRIVATE "
      r"KEY-----))"
)
# a run every key but a PEM block holds near its start (sk-, sk_, rk_ -> k-, k_; gh?_ -> h?_; github_pat_
# -> hub_pat_; eyJ -> yJ), led by a letter rarer than the key's first (a scan for the full prefixes
# tried far more places in code, and took twice as long); gsk_, glpat-, hf_, xai- are whole hints
# (their g, h or x counts only with the letters after it); _BACK: how far before its hint a key
# starts, by the hint's text, else by its first letter
_HINTS = re.compile(r"k[-_]|A(?:KIA|SIA|Iza)|h(?:[pousr]_|f_|ub_pat_)|g(?:sk_|lpat-)|x(?:ox|ai-)|yJ")
_BACK = {"k": 1, "A": 0, "h": 1, "g": 0, "x": 0, "y": 1, "hub_pat_": 3, "hf_": 0}
_PEM_START = "-----BEGIN"


def _char_class(c: str) -> int:
    return 0 if c.islower() else 1 if c.isupper() else 2 if c.isdigit() else 3


def looks_random(body: str, *, min_alnum: int = 20, min_digits: int = 1, both_cases: bool = True,
                 min_switches: float = 0.3, camel_slack: int = 1) -> bool:
    """True for a machine-made key body, false for words and identifiers.

    Random base62 switches character class (lower/upper/digit) at ~60% of positions; words and
    ``name-v2`` style identifiers switch far less often, and in CamelCase nearly every capital
    starts a lowercase run (random text: ~40%). Separators are ignored. The price, measured on
    20,000 random base62 bodies each: missed 0.03% at 48 chars (OpenAI), 0.5% at 36 (GitHub), 0.9%
    for Google's 35, 4% at 24 (old Stripe); the keys a harness sends in its headers are masked
    exactly anyway. ``min_switches``: the share of switches asked (letters only switch at ~50%:
    Hugging Face's 34 letters ask 0.25, missing 0.7%); ``camel_slack``: how many capitals may start
    no lowercase run in a CamelCase word (GitLab's 20 characters hold too few capitals for 1: 0
    misses 2% of them, 1 would miss 7%). Groq's 52 and xAI's 80 take the defaults (missed 0.03%, 0).
    """
    alnum = [c for c in body if c.isascii() and c.isalnum()]
    if len(alnum) < min_alnum or sum(c.isdigit() for c in alnum) < min_digits:
        return False
    if both_cases and not (any(c.islower() for c in alnum) and any(c.isupper() for c in alnum)):
        return False
    classes = [_char_class(c) for c in alnum]
    pairs = list(zip(classes, classes[1:]))
    switches = sum(a != b for a, b in pairs)
    upper = sum(a == 1 for a, _ in pairs)
    capitalised = sum(a == 1 and b == 0 for a, b in pairs)  # 'Word': CamelCase has ~all, random ~40%
    return switches >= min_switches * len(pairs) and not (upper >= 3 and capitalised >= upper - camel_slack)


def looks_random_hex(body: str) -> bool:
    """True for a random lowercase hex body (32 or 64 characters), false for words (``deadbeef``,
    ``facade``: no digits), counters and placeholders (``0123456789abcdef...``: few switches).
    Random hex is 3/8 letters and switches letter/digit at ~47% of positions; asked: an eighth
    each of letters and digits and a quarter of the positions switching. The price, measured on
    20,000 random bodies each: missed 0.8% at 32, 0.03% at 64."""
    digits = sum(c.isdigit() for c in body)
    switches = sum(a.isdigit() != b.isdigit() for a, b in zip(body, body[1:]))
    return min(digits, len(body) - digits) >= len(body) // 8 and switches >= 0.25 * (len(body) - 1)


def _jwt_header(segment: str) -> bool:
    """The first JWT segment decodes to a JSON object naming ``alg`` or ``typ``."""
    try:
        head = json.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return False
    return isinstance(head, dict) and ("alg" in head or "typ" in head)


def _is_key(m: re.Match) -> bool:
    kind = next(k for k in _KINDS if m.group(k))
    body = m.groupdict().get(f"{kind}_body") or ""
    if kind in ("aws", "pem"):
        return True
    if kind == "jwt":
        return _jwt_header(m.group("jwt_head"))
    if kind == "slack":
        return looks_random(body, min_alnum=16)
    if kind == "google":
        return looks_random(body, min_alnum=30)
    if kind == "skhex":
        return looks_random_hex(body)
    if kind == "hf":
        return looks_random(body, min_digits=0, min_switches=0.25)
    if kind == "glpat":
        return looks_random(body, min_alnum=16, min_digits=0, camel_slack=0)
    return looks_random(body)


_KINDS = ("skhex", "sk", "stripe", "aws", "gh", "ghpat", "glpat", "hf", "groq", "xai", "slack", "google", "jwt",
          "pem")


def mask_keys(text: str, mask: str) -> str:
    """``text`` with every provider key replaced by ``mask`` (the same object when none)."""
    return mask_everywhere(text, mask) if _has_key(text) else text


def mask_everywhere(text: str, mask: str) -> str:
    """The pass itself: the whole pattern tried at every position (the same object when no key).

    A match that is no key is stepped into, not over: with ``re.sub`` (which goes on after each
    match) ``eyJ...`` segments that are no JWT hid the ``.AKIA...`` key after them, and a key was
    kept in clear though :func:`_has_key` had seen it (found by review)."""
    out: list[str] = []
    done = pos = 0
    while (m := _SHAPES.search(text, pos)) is not None:
        if _is_key(m):
            out += [text[done:m.start()], mask]
            done = pos = m.end()
        else:
            pos = m.start() + 1
    return "".join(out) + text[done:] if out else text


def _has_key(text: str) -> bool:
    """Would :func:`mask_everywhere` mask anything? The pattern is tried only where a key can
    start. Why: code is full of prefixes (``work_``, ``task_``, ``mask-``), and one sent the whole
    pattern over the whole text at ~100 ns a character (36 ms for a 360 KB agent context, every
    call), against ~5 for the hint scan. Each key kind has its hint at a fixed distance after its
    start (``_BACK``; a PEM block starts with ``-----BEGIN``), so the pass would find it at a
    position tried here, where ``match`` tries what the pass tries there. The scan reports hints
    that do not overlap, yet never hides a key's hint inside an earlier one: hints hold only
    ``[A-Za-z0-9_-]``; the character before a key is either none of those or the letter of a
    ``\\n``-style escape (no hint starts with n, r, t, b or f); and from a key's start to its hint
    (``s``, ``r``, ``g``, ``e``, ``git``; nothing for ``gsk_``, ``glpat-``, ``hf_``, ``xai-``, ``AKIA``,
    ``AIza``, ``xox``, whose hint is their start) no hint starts (the ``g`` hints need ``sk_`` or
    ``lpat-`` next, never the ``gh`` / ``git`` of GitHub's keys). A PEM block needs no boundary: each
    ``-----BEGIN`` is tried. Any change to ``_SHAPES`` or ``_HINTS`` must keep these true (the
    property tests in ``tests/test_redact_shapes.py`` compare this with the pass)."""
    for hint in _HINTS.finditer(text):
        found = hint.group()
        start = hint.start() - _BACK.get(found, _BACK[found[0]])
        m = _SHAPES.match(text, start) if start >= 0 else None
        if m is not None and _is_key(m):
            return True
    i = text.find(_PEM_START)
    while i >= 0:
        if _SHAPES.match(text, i) is not None:  # (a PEM block is always a key)
            return True
        i = text.find(_PEM_START, i + 1)
    return False
