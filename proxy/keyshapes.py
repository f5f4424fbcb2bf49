"""Provider key formats: secrets nobody told the proxy about, recognised by their exact shape.

Why shapes and not names: masking the value of every ``password`` / ``api_key`` property or every
word after ``Bearer`` rewrites ordinary text (tool schemas, prose, ``sk-learn-...``), and the
samples builder would then train on text the model never saw. A shape here needs the provider's
prefix at a token boundary, its length, and a body that reads as random (digits, both cases, many
character-class switches), so words and identifiers never match. Known secret values (headers,
proxy tokens) are masked exactly elsewhere (``redact.py``); these formats are the safety net.

Covered: OpenAI (``sk-``, ``sk-proj-``, ``sk-svcacct-``, ``sk-admin-``), Anthropic (``sk-ant-...``),
Stripe (``sk_live_``/``sk_test_``/``rk_...``), AWS access key ids (``AKIA``/``ASIA``), GitHub
(``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_``, ``github_pat_``), Slack (``xox?-``), Google API keys
(``AIza``), JWTs (two base64url JSON segments whose header names an ``alg``/``typ``, plus a
signature) and PEM private key blocks. Not covered: formats without a prefix (AWS secret keys,
hex tokens) - they cannot be told from data without a key name.
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
_SHAPES = re.compile(
    _START + r"(?:"
    r"(?P<sk>sk-(?:proj-|svcacct-|admin-|ant-[a-z]+\d\d-)?(?P<sk_body>[A-Za-z0-9_\-]{20,}))"
    r"|(?P<stripe>(?:sk|rk)_(?:live|test)_(?P<stripe_body>[A-Za-z0-9]{20,}))"
    r"|(?P<aws>(?:AKIA|ASIA)[A-Z0-9]{16})"
    r"|(?P<gh>gh[pousr]_(?P<gh_body>[A-Za-z0-9]{36,}))"
    r"|(?P<ghpat>github_pat_(?P<ghpat_body>[A-Za-z0-9_]{50,}))"
    r"|(?P<slack>xox[abposr]-(?:[0-9]{6,}-){1,3}(?P<slack_body>[A-Za-z0-9]{16,}))"
    r"|(?P<google>AIza(?P<google_body>[A-Za-z0-9_\-]{35}))"
    r"|(?P<jwt>(?P<jwt_head>eyJ[A-Za-z0-9_\-]{8,})\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{16,})"
    r")" + _END
    + r"|(?P<pem>-----BEGIN [A-Z ]{0,20}PRIVATE KEY-----(?:(?!-----)[\s\S]){16,8000}?-----END [A-Z ]{0,20}PRIVATE "
      r"KEY-----)"
)
# a run every key but a PEM block holds near its start (sk-, sk_, rk_ -> k-, k_; gh?_ -> h?_; github_pat_
# -> hub_pat_; eyJ -> yJ), led by a letter rarer than s, r, g, e (a scan for the full prefixes tried
# far more places in code, and took twice as long); _BACK: how far before it the key starts
_HINTS = re.compile(r"k[-_]|A(?:KIA|SIA|Iza)|h[pousr]_|hub_pat_|xox|yJ")
_BACK = {"k": 1, "A": 0, "h": 1, "x": 0, "y": 1, "hub_pat_": 3}
_PEM_START = "-----BEGIN"


def _char_class(c: str) -> int:
    return 0 if c.islower() else 1 if c.isupper() else 2 if c.isdigit() else 3


def looks_random(body: str, *, min_alnum: int = 20, min_digits: int = 1, both_cases: bool = True) -> bool:
    """True for a machine-made key body, false for words and identifiers.

    Random base62 switches character class (lower/upper/digit) at ~60% of positions; words and
    ``name-v2`` style identifiers switch far less often, and in CamelCase nearly every capital
    starts a lowercase run (random text: ~40%). Separators are ignored. The price, measured on
    20,000 random base62 bodies each: missed 0.03% at 48 chars (OpenAI), 0.5% at 36 (GitHub), 0.9%
    for Google's 35, 4% at 24 (old Stripe); the keys a harness sends in its headers are masked
    exactly anyway.
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
    return switches >= 0.3 * len(pairs) and not (upper >= 3 and capitalised >= upper - 1)


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
    return looks_random(body)


_KINDS = ("sk", "stripe", "aws", "gh", "ghpat", "slack", "google", "jwt", "pem")


def mask_keys(text: str, mask: str) -> str:
    """``text`` with every provider key replaced by ``mask`` (the same object when none)."""
    return mask_everywhere(text, mask) if _has_key(text) else text


def mask_everywhere(text: str, mask: str) -> str:
    """The pass itself: the whole pattern over the whole text (the same object when no key)."""
    hit = False

    def sub(m: re.Match) -> str:
        nonlocal hit
        if _is_key(m):
            hit = True
            return mask
        return m.group(0)

    out = _SHAPES.sub(sub, text)
    return out if hit else text


def _has_key(text: str) -> bool:
    """Would :func:`mask_everywhere` mask anything? The pattern is tried only where a key can
    start. Why: code is full of prefixes (``work_``, ``task_``, ``mask-``), and one sent the whole
    pattern over the whole text at ~100 ns a character (36 ms for a 360 KB agent context, every
    call), against ~5 for the hint scan. Each key has its hint at a fixed distance after its start
    (a PEM block starts with ``-----BEGIN``), so the pass would find it at a position tried here,
    where ``match`` tries what the pass tries there. The scan reports hints that do not overlap, yet
    never hides a key's hint inside an earlier one: hints hold only ``[A-Za-z0-9_-]``; the character
    before a key is either none of those or the letter of a ``\\n``-style escape (no hint starts
    with n, r, t, b or f); and from a key's start to its hint (``s``, ``r``, ``g``, ``e``, ``git``)
    no hint starts. A PEM block needs no boundary: each ``-----BEGIN`` is tried."""
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
