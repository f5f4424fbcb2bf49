"""Collect each model call's credentials into ``Call.key_secrets`` / ``Call.secrets`` so redaction can
mask them exactly.

A harness's API key reaches the proxy in its headers; the same value may then show up in its
prompts (a tool that prints the environment, a config file read into context) or in the model's
answer. Knowing the exact value lets ``redact.py`` mask it in every spelling without guessing by
key names. Collected: Authorization (Bearer; Basic decoded to ``user:password`` and the
password), x-api-key, api-key (the call's keys: ``Call.key_secrets``, which the redactor always
keeps), and into ``Call.secrets``: any other header whose name says token/secret/auth/password or
ends in ``-key`` (``Ocp-Apim-Subscription-Key``, ``X-Functions-Key``), cookie values that look like
credentials, and query values named like credentials (``?api-key=``, ``?key=``, ``?token=``,
``?sig=``). Each of those three kinds is capped (the longest kept) below the redactor's per-call
limit, so no number of junk values can push a real one out (found by review: 64 ``X-Trace-Token-N``
headers pushed the API key and the proxy credential out, into the trace). The vendors' own
credential headers (``WELL_KNOWN_HEADERS``: ``X-Goog-Api-Key``, GitLab's ``Private-Token``, ...) are
kept apart from other credential-named headers, each name's ``PER_WELL_KNOWN_NAME`` longest values:
16 longer ``X-Junk-Token`` values pushed a real ``Private-Token`` out of the header cap, and a prompt
echoing it was recorded in clear (found by review). Bounded still: the list is fixed, and all four
kinds together stay within the redactor's ``MAX_SECRETS``.

Order: right after Attribution, whose ``requestheaders`` creates the :class:`Call` (so this hook
has one to fill) and pops ``Proxy-Authorization`` / ``X-Lightning-Token`` first. Those carry the
proxy credential only: the proxy token is a process-wide secret of the Redactor, and a
per-attempt credential is put into ``Call.key_secrets`` by Attribution itself; a Proxy-Authorization
that is still present (one Attribution let through) is read here like Authorization.
"""

from __future__ import annotations

import base64
import binascii
import collections
import re

from mitmproxy import http

from ..redact import MAX_SECRETS
from ..state import META, MODEL, REWARD, Call, keep_newest

MAX_COOKIE_SECRETS = MAX_HEADER_SECRETS = MAX_QUERY_SECRETS = 16  # per request, each (see MAX_SECRETS)
# credential headers that vendors define (Google, GitLab, OpenStack/Keystone, AWS session, Azure API
# Management, Azure Functions, HashiCorp Vault, Cloudflare Access): a junk header of another name cannot
# push their values out; each name keeps its PER_WELL_KNOWN_NAME longest as sent (a real request sends
# one), each expanded after (a Basic value gives 4 forms, its password the shortest: found by review)
WELL_KNOWN_HEADERS = ("x-goog-api-key", "private-token", "x-auth-token", "x-amz-security-token",
                      "ocp-apim-subscription-key", "x-functions-key", "x-vault-token", "cf-access-client-secret")
PER_WELL_KNOWN_NAME = 2
assert 3 * 16 + len(WELL_KNOWN_HEADERS) * PER_WELL_KNOWN_NAME * 4 <= MAX_SECRETS  # the redactor keeps them all
# the call's own keys: the redactor keeps them whatever else the call holds (the MAX_SECRETS longest:
# a request holds no more real ones, and the cost stays bounded)
KEY_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key"})
# header names whose values are credentials (Authorization, X-Api-Key, Api-Key, X-Goog-Api-Key,
# X-Amz-Security-Token, Private-Token, X-Auth-Token, Ocp-Apim-Subscription-Key, X-Functions-Key, ...);
# not session ids, not Idempotency-Key (a retry id the client makes up) nor Sec-WebSocket-Key (a
# handshake nonce sent in clear by design): ids that are no credential
_CREDENTIAL_HEADER = re.compile(r"auth|token|secret|api-?key|apikey|access-?key|password"
                                r"|(?:^|(?<!idempotency)(?<!sec-websocket)-)key$", re.IGNORECASE)
CREDENTIAL_QUERY = re.compile(r"^(?:key|sig|signature|code|subscription-key"
                              r"|[\w-]*(?:api[-_]?key|token|secret|password))$", re.IGNORECASE)


def from_authorization(value: str) -> set[str]:
    """Secret parts of an ``Authorization``-style value: the credentials; Basic decoded too."""
    scheme, _, cred = value.strip().partition(" ")
    if not cred:
        return {scheme}
    cred = cred.strip()
    out = {cred}
    if scheme.lower() == "basic":
        try:
            pair = base64.b64decode(cred, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return out
        out.add(pair)
        out.add(pair.partition(":")[2])  # the password; a user name alone is not secret
    return out


def from_cookie(value: str) -> set[str]:
    """Cookie values that are credentials: long, and not plain words (``lang=en-US`` stays)."""
    out = set()
    for part in value.split(";"):
        v = part.partition("=")[2].strip().strip('"')
        if len(v) >= 12 and re.search(r"[^A-Za-z\- ]", v):
            out.add(v)
    return out


def _forms(value: str) -> set[str]:
    """A credential header's value and what it holds (an Authorization scheme's token, Basic decoded)."""
    return {value.strip()} | from_authorization(value)


def longest(values: set[str] | frozenset[str], n: int) -> list[str]:
    """The ``n`` longest of ``values``: what each cap on a call's credential values keeps."""
    return sorted(values, key=len, reverse=True)[:n]


def credentials(headers: http.Headers, query=None) -> tuple[set[str], set[str]]:
    """(keys, others): the credential values of one request (headers and URL query; None: the URL
    has none). Keys: the ``KEY_HEADERS`` values; others: the longest of each other kind only (of each
    ``WELL_KNOWN_HEADERS`` name apart)."""
    keys: set[str] = set()
    others: set[str] = set()
    cookies: set[str] = set()
    well_known: dict[str, set[str]] = {n: set() for n in WELL_KNOWN_HEADERS}
    for name, value in headers.items(multi=True):
        low = name.lower()
        if low == "cookie":
            cookies |= from_cookie(value)
        elif low in KEY_HEADERS:
            keys |= _forms(value)
        elif low in well_known:
            well_known[low].add(value)  # capped as sent, then expanded (a Basic value's password is shorter)
        elif _CREDENTIAL_HEADER.search(low):
            others |= _forms(value)
    queried = {v for n, v in (query.items(multi=True) if query is not None else ()) if v and CREDENTIAL_QUERY.match(n)}

    out = {*longest(others, MAX_HEADER_SECRETS), *longest(queried, MAX_QUERY_SECRETS),
           *longest(cookies, MAX_COOKIE_SECRETS)}
    for values in well_known.values():
        for value in longest(values, PER_WELL_KNOWN_NAME):
            out |= _forms(value)
    # keys are bounded by the redactor's own limit only: a request cannot hold more real keys
    return {v for v in longest(keys, MAX_SECRETS) if v}, {v for v in out if v}


class Secrets:
    """Fills ``Call.key_secrets`` / ``Call.secrets`` of model calls and harness rewards from their request
    headers and URL. An attempt's keys stay known in its later calls (the ``REMEMBERED_KEYS`` longest of
    each of the last ``REMEMBERED`` attempts): a harness that sent its key in one call's header and
    a placeholder in the next had the key recorded in clear there, where a tool printed it (found by
    review)."""

    REMEMBERED, REMEMBERED_KEYS = 4096, 8

    def __init__(self) -> None:
        self._keys: collections.OrderedDict[tuple[str, int], frozenset[str]] = collections.OrderedDict()

    def _remembered(self, call: Call, keys: set[str]) -> frozenset[str]:
        """This call's keys with those its attempt sent before (most recently used attempts kept)."""
        if call.rollout_id is None:
            return frozenset(keys)
        ident = (call.rollout_id, call.attempt)
        known = self._keys.get(ident, frozenset()) | keys
        if len(known) > self.REMEMBERED_KEYS:
            known = frozenset(longest(known, self.REMEMBERED_KEYS))
        return keep_newest(self._keys, ident, known, self.REMEMBERED)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind not in (MODEL, REWARD) or flow.response is not None:
            return
        req = flow.request
        # the query is parsed only when there is one (most model calls have none)
        keys, others = credentials(req.headers, req.query if "?" in req.path else None)
        call.key_secrets |= self._remembered(call, keys)
        call.secrets |= others
