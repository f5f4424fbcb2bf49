"""Collect each model call's credentials into ``Call.secrets`` so redaction can mask them exactly.

A harness's API key reaches the proxy in its headers; the same value may then show up in its
prompts (a tool that prints the environment, a config file read into context) or in the model's
answer. Knowing the exact value lets ``redact.py`` mask it in every spelling without guessing by
key names. Collected: Authorization (Bearer; Basic decoded to ``user:password`` and the
password), x-api-key, api-key and any header whose name says key/token/secret/auth/password,
cookie values that look like credentials, and query values named like credentials
(``?api-key=``, ``?key=``, ``?token=``, ``?sig=``).

Order: right after Attribution, whose ``requestheaders`` creates the :class:`Call` (so this hook
has one to fill) and pops ``Proxy-Authorization`` / ``X-Lightning-Token`` first. Those carry the
proxy credential only: the proxy token is a process-wide secret of the Redactor, and a
per-attempt credential is put into ``Call.secrets`` by Attribution itself; a Proxy-Authorization
that is still present (one Attribution let through) is read here like Authorization.
"""

from __future__ import annotations

import base64
import binascii
import re

from mitmproxy import http

from ..state import META, MODEL, REWARD, Call

MAX_COOKIE_SECRETS = 16  # per request
# header names whose values are credentials (Authorization, X-Api-Key, Api-Key, X-Goog-Api-Key,
# X-Amz-Security-Token, Private-Token, X-Auth-Token, ...); not Idempotency-Key, not session ids
_CREDENTIAL_HEADER = re.compile(r"auth|token|secret|api-?key|apikey|access-?key|password", re.IGNORECASE)
_CREDENTIAL_QUERY = re.compile(r"^(?:key|sig|signature|code|[\w-]*(?:api[-_]?key|token|secret|password))$",
                               re.IGNORECASE)


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


def credentials(headers: http.Headers, query=None) -> set[str]:
    """All credential values of one request (headers and URL query; None: the URL has none)."""
    out: set[str] = set()
    cookies: set[str] = set()
    for name, value in headers.items(multi=True):
        low = name.lower()
        if low == "cookie":
            cookies |= from_cookie(value)
        elif _CREDENTIAL_HEADER.search(low):
            out |= {value.strip()} | from_authorization(value)
    for name, value in query.items(multi=True) if query is not None else ():
        if value and _CREDENTIAL_QUERY.match(name):
            out.add(value)
    # the longest cookies only: a jar of long cookies must not crowd the call's API key out of the
    # redactor's per-call limit (redact.MAX_SECRETS)
    out.update(sorted(cookies, key=len, reverse=True)[:MAX_COOKIE_SECRETS])
    return {v for v in out if v}


class Secrets:
    """Fills ``Call.secrets`` of model calls and harness rewards from their request headers and URL."""

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(META)
        if call is None or call.kind not in (MODEL, REWARD) or flow.response is not None:
            return
        req = flow.request
        # the query is parsed only when there is one (most model calls have none)
        call.secrets |= credentials(req.headers, req.query if "?" in req.path else None)
