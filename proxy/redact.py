"""Secrets never reach a trace: mask them in every text column of a span, and nothing else.

Headers are never stored. Text is masked from two sources only:

1. Known secret values, exactly: the proxy and control tokens and the values of the proxy's
   environment variables named like secrets (process-wide, :func:`environment_secrets`), and the call's own
   credentials: ``Call.key_secrets`` (its proxy credential, Authorization Bearer/Basic decoded,
   x-api-key, api-key: always all kept) and ``Call.secrets`` (other credential-named header,
   cookie and query values, the ``MAX_SECRETS`` longest kept), collected by ``addons/secrets.py``.
   A value is found in every spelling recorded text can hold it: raw, JSON string escapes
   (``json.dumps`` with and without ``ensure_ascii``, ``\\/``, HTML-safe ``\\u003c``), URL-encoded,
   and those applied twice (JSON inside a JSON string); any other ``\\uXXXX`` / ``%XX`` spelling is
   found by decoding the JSON strings (and escapes inside them) before looking, and a string that
   is itself JSON (a tool result) is parsed and masked at any depth. Values shorter than 8
   characters (a short proxy token too) and the documented placeholder key are not secrets.
2. Provider key formats (``keyshapes.py``), which need a real key's shape.

No masking by key name or ordinary word: a tool schema property ``password``, ``cookie_policy``,
``Bearer authentication`` or ``sk-learn-datasets`` stays byte-identical, so the samples builder
never retokenises altered text. A span whose request or response text held a secret gets
``secret_detected = True``, empty token id / logprob columns and a response body without its
token-by-token fields (ids, logprob entries with token strings: they encode the secret); its
JSON text is then re-serialised from the masked parse - the only case where a column's bytes
change beyond the mask (a body that does not parse, e.g. cut short, loses the values of those
fields in its text instead). ``error`` (cut to a length by capture) and any text given to
:meth:`Redactor.text` (log lines) also lose a secret's start left where a length cut ended it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import string
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from .client import PLACEHOLDER_API_KEY
from .keyshapes import mask_keys

MASK = "[REDACTED]"
MIN_SECRET_LEN = 8  # shorter values cannot be told from words; a credential that short is not one
# per call, of its other values (longest kept): thousands of cookies must not cost seconds; above what
# addons/secrets.py keeps of a request (3 x 16, and 8 vendor header names x 2 values x 4 forms: 112)
MAX_SECRETS = 128
MAX_SPELLED_LEN = 4096  # longer values are masked in their raw spelling only
PUBLIC_VALUES = frozenset({PLACEHOLDER_API_KEY})  # documented placeholders, not secrets
JSON_COLUMNS = ("request_json", "response_json")
TOKEN_COLUMNS = ("prompt_token_ids", "response_token_ids", "response_logprobs")
# fields of a response body that spell its text token by token (vLLM ids, per-token logprob
# entries with their token strings and bytes, Responses API message tokens): a secret split
# over them is in no single string, so they go whenever the span held a secret
TOKEN_FIELDS = frozenset({"prompt_token_ids", "token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "tokens"})
TRUNCATED_COLUMNS = ("error",)  # cut to a length by capture: may end inside a secret

_JSON_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})|\\/")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PERCENT_ESCAPE = re.compile(r"%[0-9a-fA-F]{2}")  # what unquote decodes (it leaves any other % as is)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# what a value's core and a key shape are made of: the characters no encoder rewrites (a '-' after it)
_KEY_SET = "A-Za-z0-9_.~"
_SAFE_RUN = re.compile(f"[{_KEY_SET}-]+")
# \u escape of a char a core or key may hold, or of a '%' (the JSON string then holds a %XX to decode)
_ASCII_ESCAPE = re.compile(r"\\u00(?:2[5dDeE]|[3-7][0-9a-fA-F])")
# %XX (or %25XX: quoted twice or more) of a character a core or key may hold: [A-Za-z0-9_.~-], not the
# ':' '/' '=' '{' of ordinary URLs (text with those alone is not parsed and searched: 4x the cost), or
# of a '\' (``%5Cu0073`` decodes to ``\u0073``, then to 's')
_ASCII_PERCENT_TAIL = r"(?:25)*(?:2[dDeE]|3[0-9]|4[1-9a-fA-F]|5[0-9aAcCfF]|6[1-9a-fA-F]|7[0-9aAeE])"
# one raw piece of a run of key characters: any %XX (which decodes to one character at most), a key
# character, or a bare '%', which decoding may join with the escaped hex digits after it into a new
# escape ('%%36%31' -> '%61' -> 'a'; '%6%31' likewise: found by review)
_RUN_PIECE = f"(?:%[0-9a-fA-F]{{2}}|[{_KEY_SET}%-])"
# such a %XX with a piece right before or after it (a printf '%4d' has none: it is not looked at twice),
# or any %XX right before a run as long as the shortest key shape (an AWS key id): decoded (``%3D``
# '=', ``%0A``) it may give that key the boundary it lacks. One pattern, whose lookbehind comes after
# the '%', so that the search jumps from '%' to '%' once
_PERCENT_SUSPECT = re.compile(rf"%(?:(?P<before_key>[0-9a-fA-F]{{2}}[{_KEY_SET}-]{{20}})"
                              rf"|(?<=[{_KEY_SET}%-]%){_ASCII_PERCENT_TAIL}|{_ASCII_PERCENT_TAIL}(?={_RUN_PIECE}))")
_HEX = frozenset("0123456789abcdefABCDEF")
_KEY_CHARS = frozenset(string.ascii_letters + string.digits + "_.~-%")  # _RUN_PIECE's characters (a bare '%' too)
MIN_CORE = 4  # a core shorter than this makes KnownSecrets.always true: such a set looks at every text
# a \u escape of any character right before a run as long as a key: decoded (``\u000a`` a newline,
# ``\u00e9``) it may give that key the boundary it lacks (as ``_PERCENT_SUSPECT``'s first branch)
_U_ESCAPE_BEFORE_KEY = re.compile(rf"\\u[0-9a-fA-F]{{4}}[{_KEY_SET}-]{{20}}")
# JSON text that may be cut short: its strings (the closing quote may be missing), a key's colon
# before a container value, and what a container scan steps over
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_TO_CONTAINER = re.compile(r"\s*:\s*(?=[\[{])")
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)
_TOKEN_KEYS = frozenset(f'"{k}"' for k in TOKEN_FIELDS)


def _one_level(s: str) -> set[str]:
    """The spellings one encoder step can give ``s`` (JSON string body, URL component)."""
    out = set()
    for ascii_only in (True, False):
        e = json.dumps(s, ensure_ascii=ascii_only)[1:-1]
        html = e.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        out |= {e, e.replace("/", "\\/"), html}
    try:
        quoted = (urllib.parse.quote(s, safe=""), urllib.parse.quote_plus(s, safe=""), urllib.parse.quote(s))
    except UnicodeEncodeError:  # lone surrogates (undecodable header bytes) have no URL form
        quoted = ()
    for q in quoted:
        out |= {q, re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), q)}
    return out


@functools.lru_cache(maxsize=4096)  # the process's secrets are in every call's set: spelled once
def spellings(secret: str) -> frozenset[str]:
    """Every literal form of ``secret`` in recorded text: raw, encoded, encoded twice."""
    forms = {secret}
    if len(secret) > MAX_SPELLED_LEN:
        return frozenset(forms)
    for _ in range(2):
        for f in list(forms):
            forms |= _one_level(f)
    return frozenset(forms)


def dumps(obj: Any) -> str:
    """JSON text as capture writes it (UTF-8 kept); ASCII escapes where a string holds a lone
    surrogate (``"\\ud800"`` is valid JSON but has no UTF-8 form: Parquet could not store it)."""
    out = json.dumps(obj, ensure_ascii=False)
    return json.dumps(obj) if _SURROGATE.search(out) else out


def _pieces_before(text: str, end: int, most: int) -> int:
    """How many run pieces (``_RUN_PIECE``) end right at ``end``, counted back up to ``most``. A '%'
    followed by two hex digits always starts an escape (decoding reads left to right and no escape
    ends in a '%'), so reading back a %XX first counts what decoding counts."""
    n, i = 0, end
    while n < most and i > 0:
        if i >= 3 and text[i - 3] == "%" and text[i - 2] in _HEX and text[i - 1] in _HEX:
            i -= 3
        elif text[i - 1] in _KEY_CHARS:
            i -= 1
        else:
            break
        n += 1
    return n


_PIECES_AFTER = [re.compile(_RUN_PIECE + f"{{{k}}}") for k in range(MIN_CORE)]


def percent_may_hide(text: str) -> bool:
    """May decoding the %XX escapes of ``text`` show a secret its raw text hides? Only where a %XX of
    a key character is in a run of at least ``MIN_CORE`` pieces: each decodes to one character at
    most, and a secret hidden behind escapes decodes to a run of key characters at least that long
    (a core, whose own spelling would be in the raw text, is ``MIN_CORE`` long at least; a shorter
    one looks at every text anyway; a key shape is longer) holding a character an escape gave.
    Why: printf formats (``%4d`` is 'M', ``%2d`` '-', ``%6f`` 'o') stand alone or next to a space
    or a quote; code full of them was parsed and searched: 1.3 -> 3.8 ms for a 170 KB request.
    Any %XX right before a run as long as a key may give that key its boundary (``%3Dsk-...``)."""
    for m in _PERCENT_SUSPECT.finditer(text):
        if m.group("before_key") is not None:
            return True
        need = MIN_CORE - 1 - _pieces_before(text, m.start(), MIN_CORE - 1)
        if need <= 0 or _PIECES_AFTER[need].match(text, m.end()) is not None:
            return True
    return False


def decode_escapes(text: str) -> str:
    """``text`` with ``\\uXXXX``, ``\\/`` and ``%XX`` decoded, three levels deep (nested JSON).

    Lenient on purpose (a stray escape is decoded wherever it sits): used only to look for
    secrets, and the decoded text replaces the original only when it held one.
    """
    # each step only where it can change something (a 400 KB context cost 9 ms): surrogates come
    # from the text itself or from decoding an escape of one (unquote gives none), and are gone
    # after the repair, so the text is searched for them once
    lone = not text.isascii() and _SURROGATE.search(text) is not None
    for _ in range(3):
        lone = lone or _SURROGATE_ESCAPE.search(text) is not None
        new = _JSON_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)) if m.group(1) else "/", text)
        if "%" in new and _PERCENT_ESCAPE.search(new):
            new = urllib.parse.unquote(new)
        if lone:  # (pairs joined, lone halves replaced; without any, the same text)
            new, lone = new.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), False
        if new == text:
            break
        text = new
    return text


# a variable whose name ends by saying its value is a secret (OPENAI_API_KEY, HF_TOKEN, PGPASSWORD,
# AWS_SECRET_ACCESS_KEY; not TOKEN_ENDPOINT, SSH_KEY_TYPE, KEY_VAULT_NAME, TOKENIZERS_PARALLELISM)
_SECRET_VAR = re.compile(r"(?:(?:^|_)(?:API_?KEY|KEY|TOKEN|SECRETS?|CREDENTIALS?)|PASSW(?:OR)?D)$")
_ENV_CORE = 8  # a value without a run this long of [A-Za-z0-9_.~-] cannot be looked for cheaply: not taken
_ENV_LENGTHS = (16, 256)  # a credential's; longer ones (a PEM block: a key shape anyway) cost every call's set
_LETTER_AND_DIGIT = re.compile(r"(?=.*[A-Za-z])(?=.*[0-9])", re.DOTALL)


def environment_secrets(environ: Mapping[str, str]) -> list[str]:
    """The values of ``environ``'s variables named like secrets that look like credentials. Why: the
    proxy and the launcher run in the environment harnesses are handed keys from (``pass_env``), and a
    key a harness never sends in a header (a GitHub token, an AWS secret key: no provider shape) was
    masked nowhere when a tool printed it into a prompt. Taken: 16-256 characters, no whitespace,
    letters and digits, not a URL nor an existing path, with a run of ``_ENV_CORE`` plain characters
    (else every text is a suspect: the slow path for every span). Words (``kubernetes``), URLs and
    paths were masked wherever a prompt or a log line said them, dropping the spans' token ids."""
    def credential(v: str) -> bool:
        return (_ENV_LENGTHS[0] <= len(v) <= _ENV_LENGTHS[1] and not any(c.isspace() for c in v)
                and "://" not in v and _LETTER_AND_DIGIT.match(v) is not None
                and max(map(len, _SAFE_RUN.findall(v)), default=0) >= _ENV_CORE and not os.path.exists(v))
    return [v for k, v in environ.items() if v and _SECRET_VAR.search(k.upper()) and credential(v)]


class KnownSecrets:
    """A set of secret values and all their spellings, to find and mask in text."""

    def __init__(self, values: Iterable[str | None], always: Iterable[str | None] = (),
                 keys: Iterable[str | None] = ()) -> None:
        """``values`` (a call's other credentials): the ``MAX_SECRETS`` longest kept; ``keys`` (a call's
        API key and proxy credential) and ``always`` (the process's): all. Why keys apart: a request
        with 64 long junk credential-named headers or query values pushed its real API key and its
        proxy credential out of a common cap, into the trace (found by review)."""
        def usable(vs):
            return {v for v in vs if v and len(v) >= MIN_SECRET_LEN and v not in PUBLIC_VALUES}
        kept = usable(always) | usable(keys)
        capped = sorted(usable(values) - kept, key=len, reverse=True)[:MAX_SECRETS]
        self.values = sorted(kept.union(capped))
        # the longest run of each value that no encoder rewrites: every spelling contains it, so a
        # text without it holds the value at no escape depth (the cheap test before any other)
        by_core: dict[str, set[str]] = {}
        for v in self.values:
            by_core.setdefault(max(_SAFE_RUN.findall(v) or [""], key=len), set()).update(spellings(v))
        self._by_core = sorted(by_core.items())
        self.cores = [c for c, _ in self._by_core]
        self.always = any(len(c) < MIN_CORE for c in self.cores)  # a value made of escapable characters
        self.forms = sorted(set().union(*by_core.values()), key=len, reverse=True) if by_core else []
        self._re = re.compile("|".join(map(re.escape, self.forms))) if self.forms else None  # longest first

    def present(self, text: str) -> bool:
        """A literal spelling of a value is in ``text`` (spellings checked only under their core)."""
        return any(f in text for c, fs in self._by_core if c in text for f in fs)

    def maybe(self, text: str) -> bool:
        """A value may be in ``text`` behind escapes of any depth (cheap; then look exactly)."""
        return any(c in text for c in self.cores)

    def mask(self, text: str) -> str:
        return self._re.sub(MASK, text) if self._re is not None and self.present(text) else text


class Redactor:
    """Masks known secrets and provider keys in span rows (capture) and reward info (control)."""

    def __init__(self, extra_secrets: Iterable[str | None] = ()) -> None:
        self._process = tuple(s for s in extra_secrets if s)
        self._cache: dict[frozenset, KnownSecrets] = {}

    def known(self, secrets: Iterable[str] = (), keys: Iterable[str] = ()) -> KnownSecrets:
        """The process's secrets plus a call's (cached: a harness sends the same key every call);
        ``keys``: the call's own keys, kept whatever ``secrets`` holds (:class:`KnownSecrets`)."""
        key = (frozenset(secrets), frozenset(keys))
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) > 1024:
                self._cache.clear()
            got = self._cache[key] = KnownSecrets(key[0], always=self._process, keys=key[1])
        return got

    # -- one string ---------------------------------------------------------------------------
    def mask_string(self, s: str, known: KnownSecrets) -> str:
        """``s`` with secrets masked; the same object when none was found."""
        out = mask_keys(known.mask(s), MASK)
        if "\\" in out or "%" in out:
            dec = decode_escapes(out)
            if dec != out:
                masked = mask_keys(known.mask(dec), MASK)
                if masked != dec:  # a secret hidden behind escapes: keep the decoded, masked text
                    out = masked
        return out if out != s else s

    # -- documents ----------------------------------------------------------------------------
    def scrub_json(self, text: str, known: KnownSecrets) -> tuple[str, bool]:
        """(text, found) for a JSON document: byte-identical unless a secret was in it."""
        if not self._suspect(text, known):
            return text, False
        try:
            new, hit = self._walk(json.loads(text), known)
        except (ValueError, RecursionError):
            return self.scrub_text(text, known)
        out = dumps(new) if hit else text
        if known.present(out):  # a value spanning JSON structure: mask the text itself
            out, hit = known.mask(out), True
        return out, hit

    @staticmethod
    def _suspect(text: str, known: KnownSecrets) -> bool:
        """Cheap: may ``text`` hold a secret? (False means surely not; True means look exactly.)

        A value's core and every key shape are ASCII, so they hide only behind escapes of ASCII
        characters (``\\u0073``, ``%73``), never behind the ``\\u00e9`` of ordinary non-ASCII text,
        and behind a %XX only inside a run of key characters (:func:`percent_may_hide`). An escape of
        any character may end right before a key: decoded, it gives the key its boundary.
        """
        return (known.always or known.maybe(text) or mask_keys(text, MASK) is not text
                or _ASCII_ESCAPE.search(text) is not None
                or ("%" in text and percent_may_hide(text))
                or _U_ESCAPE_BEFORE_KEY.search(text) is not None)

    def scrub_text(self, text: str, known: KnownSecrets) -> tuple[str, bool]:
        """(text, found) for text that is not JSON (path, error, a malformed body)."""
        out = self.mask_string(text, known)
        return out, out is not text

    def _walk(self, obj: Any, known: KnownSecrets, depth: int = 0) -> tuple[Any, bool]:
        if isinstance(obj, str):
            new = self.mask_string(obj, known)
            if depth < 8 and new[:1] in "{[" and known.maybe(new):
                new = self._nested(new, known, depth)
            return new, new is not obj
        if isinstance(obj, dict):
            items = [(self._walk(k, known, depth), self._walk(v, known, depth)) for k, v in obj.items()]
            return {k: v for (k, _), (v, _) in items}, any(hk or hv for (_, hk), (_, hv) in items)
        if isinstance(obj, list):
            items = [self._walk(v, known, depth) for v in obj]
            return [v for v, _ in items], any(h for _, h in items)
        if isinstance(obj, (int, float)) and not isinstance(obj, bool) and known.present(str(obj)):
            return MASK, True  # a numeric secret written as a JSON number
        return obj, False

    def _nested(self, s: str, known: KnownSecrets, depth: int) -> str:
        """A string that is itself a JSON document (a tool result): masked at any escape depth."""
        try:
            inner, hit = self._walk(json.loads(s), known, depth + 1)
        except (ValueError, RecursionError):
            return s
        return dumps(inner) if hit else s

    @staticmethod
    def drop_token_fields(text: str) -> str:
        """A response body without its token-by-token fields (``TOKEN_FIELDS``)."""
        def strip(o: Any) -> Any:
            if isinstance(o, dict):
                return {k: strip(v) for k, v in o.items() if k not in TOKEN_FIELDS}
            if isinstance(o, list):
                return [strip(v) for v in o]
            return o

        try:
            return dumps(strip(json.loads(text)))
        except (ValueError, RecursionError):
            return Redactor._null_token_values(text)

    @staticmethod
    def _null_token_values(text: str) -> str:
        """``text``, JSON that does not parse (an answer cut short), with the array or object value of
        every ``TOKEN_FIELDS`` key replaced by ``null`` (to the text's end where it was cut there).
        Why not drop the column: the masked text is what is left of the answer, and the fields go
        as surely: the scan steps over whole strings, so a key's spelling inside one is never cut."""
        out, done, pos = [], 0, 0
        while (m := _STRING.search(text, pos)) is not None:
            pos = m.end()
            colon = _TO_CONTAINER.match(text, pos) if m.group() in _TOKEN_KEYS else None
            if colon is None:
                continue
            depth, end = 0, len(text)
            for t in _STRING_OR_BRACKET.finditer(text, colon.end()):
                depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(t.group(), 0)
                if depth == 0:
                    end = t.end()
                    break
            out += [text[done:colon.end()], "null"]
            done = pos = end
        return "".join(out) + text[done:] if out else text

    @staticmethod
    def cut_starts(text: str, known: KnownSecrets) -> str:
        """Mask the start of a secret that a length cut left anywhere in ``text``: an error message
        quotes an excerpt cut at a length (``{payload[:200]!r}``) and goes on after it, so the cut
        is not only at the text's end. Any run of at least ``MIN_SECRET_LEN`` characters that begins
        a spelling of a secret is masked (in an error text, an innocent run is the rarer loss)."""
        for f in known.forms:
            start = f[:MIN_SECRET_LEN]
            i = text.find(start)
            while i >= 0:
                k = len(start)
                while k < len(f) and i + k < len(text) and text[i + k] == f[k]:
                    k += 1
                text = text[:i] + MASK + text[i + k:]
                i = text.find(start, i + len(MASK))
        return text

    # -- what the addons call -----------------------------------------------------------------
    def scrub_row(self, row: dict, secrets: Iterable[str] = (), *, keys: Iterable[str] = (),
                  request_is_json: bool = True, sent: str | None = None) -> dict:
        """A span row with secrets masked in every text column (the one place capture calls).

        ``secrets``, ``keys``: values known to be secret for this call (``Call.secrets``,
        ``Call.key_secrets``). A hit in the request or response text sets ``secret_detected`` and
        empties the token id columns. ``sent``: the request as the proxy sent it upstream where that
        is not ``request_json`` (a translated Messages call), searched, not recorded: a hit there
        flags the span too (its prompt ids spell what the engine was sent).
        """
        known = self.known(secrets, keys)
        detected = False
        for col, val in list(row.items()):
            if not isinstance(val, str) or not val:
                continue
            as_json = col == "response_json" or (col == "request_json" and request_is_json)
            row[col], hit = self.scrub_json(val, known) if as_json else self.scrub_text(val, known)
            if col in TRUNCATED_COLUMNS:
                row[col] = self.cut_starts(row[col], known)
            detected |= hit and col in JSON_COLUMNS
        if sent and not detected:
            detected = self.scrub_json(sent, known)[1]
        row["secret_detected"] = detected = detected or bool(row.get("secret_detected"))
        if detected:
            for col in TOKEN_COLUMNS:
                row[col] = None
            if row.get("response_json"):
                row["response_json"] = self.drop_token_fields(row["response_json"])
        return row

    def json_text(self, text: str | None, secrets: Iterable[str] = (), keys: Iterable[str] = ()) -> str | None:
        """A JSON document (e.g. a reward's info) with secrets masked. Not :meth:`cut_starts`: the
        document is whole (a reward's info is refused, never cut, past its bound), and masking a run
        that merely begins a spelling could split an escape and leave text that no longer parses."""
        return self.scrub_json(text, self.known(secrets, keys))[0] if text else text

    def text(self, text: str | None, secrets: Iterable[str] = (), keys: Iterable[str] = ()) -> str | None:
        """Any text with secrets masked, a secret's start left by a length cut too (:meth:`cut_starts`:
        free text, such as a log line or an error, is what gets cut at a length)."""
        if not text:
            return text
        known = self.known(secrets, keys)
        return self.cut_starts(self.scrub_text(text, known)[0], known)
