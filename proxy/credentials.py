"""Rollout identities and per-attempt credentials: the one definition used by proxy and launcher.

Why: the harness runs model-written commands and must be treated as hostile. It therefore never
receives the proxy token (the master secret) nor the control token; it receives a credential
derived from the proxy token and bound to its own ``<rollout_id>~<attempt>``. The proxy checks
it by recomputing the HMAC (no table to keep, so it works for the launcher, ``lightning-proxy env``
and Kubernetes pods alike). A credential authorises the model calls and the reward of its own
attempt only, until the attempt is revoked (``POST /_lh/end``).

Ids travel inside proxy credentials, URL paths and log lines, and land in Parquet columns
(``attempt`` is int32, ``model_version`` int64), so they are checked here, at the door.
Standard library only (imported by the training environment and the proxy alike).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import operator
import re
import urllib.parse

ROLLOUT_ID_CHARS = "A-Za-z0-9._-"
MAX_ROLLOUT_ID_LEN = 255
MAX_ATTEMPT = 2**31 - 1  # int32 column
MAX_MODEL_VERSION = 2**63 - 1  # int64 column
CREDENTIAL_CHARS = 32  # url-safe base64 characters kept of the HMAC-SHA256 (192 bits)
ROLLOUT_ID_RULE = f"a rollout id is 1..{MAX_ROLLOUT_ID_LEN} characters of [{ROLLOUT_ID_CHARS}]"
ATTEMPT_RULE = f"an attempt is an integer 0..{MAX_ATTEMPT}"
MODEL_VERSION_RULE = f"a model version is an integer 0..{MAX_MODEL_VERSION}"

_ROLLOUT_ID = re.compile(f"[{ROLLOUT_ID_CHARS}]{{1,{MAX_ROLLOUT_ID_LEN}}}")
_DIGITS = re.compile(r"[0-9]{1,10}")  # 2**31 - 1 has 10 digits; longer strings are refused unparsed


class InvalidId(ValueError):
    """A rollout id, attempt or model version outside its rule (the message names the rule)."""


def check_rollout_id(value: object) -> str:
    """``value`` if it follows :data:`ROLLOUT_ID_RULE`, else :class:`InvalidId`."""
    if not isinstance(value, str) or not _ROLLOUT_ID.fullmatch(value):
        raise InvalidId(f"invalid rollout id {short_repr(value)}: {ROLLOUT_ID_RULE}")
    return value


def _bounded(value: object, top: int, what: str, rule: str) -> int:
    """Any integral value (int, numpy integer) within 0..``top`` as int; bools, floats and strings refused."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or not 0 <= n <= top:
        raise InvalidId(f"invalid {what} {short_repr(value)}: {rule}")
    return n


def check_attempt(value: object) -> int:
    """An integer within 0..2**31-1 (the ``attempt`` column is int32)."""
    return _bounded(value, MAX_ATTEMPT, "attempt", ATTEMPT_RULE)


def check_model_version(value: object) -> int:
    """An integer within 0..2**63-1 (the ``model_version`` column is int64)."""
    return _bounded(value, MAX_MODEL_VERSION, "model version", MODEL_VERSION_RULE)


def rollout_user(rollout_id: str, attempt: int = 0) -> str:
    """``<rollout_id>~<attempt>``: proxy username, URL segment and the HMAC message."""
    return f"{check_rollout_id(rollout_id)}~{check_attempt(attempt)}"


def parse_user(user: str) -> tuple[str, int]:
    """``rollout~attempt`` (``~attempt`` optional, default 0), percent-decoded; InvalidId if bad."""
    user = urllib.parse.unquote(user)
    rid, sep, att = user.rpartition("~")
    if not sep:
        return check_rollout_id(user), 0
    if not _DIGITS.fullmatch(att):
        raise InvalidId(f"invalid attempt {short_repr(att)}: {ATTEMPT_RULE}")
    return check_rollout_id(rid), check_attempt(int(att))


def attempt_credential(token: str, rollout_id: str, attempt: int) -> str:
    """The secret one attempt presents: HMAC-SHA256(token, ``rollout~attempt``), url-safe base64."""
    mac = hmac.new(token.encode(), rollout_user(rollout_id, attempt).encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode()[:CREDENTIAL_CHARS]


def credential_ok(token: str, rollout_id: str, attempt: int, given: str) -> bool:
    """Constant-time check of ``given`` against the credential of ``(rollout_id, attempt)``."""
    expected = attempt_credential(token, rollout_id, attempt)
    return hmac.compare_digest(given.encode(errors="replace"), expected.encode())


def short_repr(value: object, limit: int = 60) -> str:
    """A safe, short rendering for messages and logs: control characters escaped, long text cut."""
    text = ascii(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(str(value))} chars)"


class Revocations:
    """Attempts whose credentials were revoked (``POST /_lh/end``), bounded in memory.

    Why bounded: a proxy serves millions of attempts over a long run. The newest
    :attr:`limit` revocations are kept (16-byte digests, 89 bytes each measured: 23 MB at the
    default 262,144); the oldest is forgotten first. Forgetting is safe in the normal flow because the
    launcher revokes an attempt only after its harness was killed; it only reopens a credential
    that something leaked and kept using for ``limit`` later attempt ends.
    """

    def __init__(self, limit: int = 1 << 18) -> None:
        self.limit = limit
        self._keys: dict[bytes, None] = {}  # insertion-ordered: the first key is the oldest
        self.forgotten = 0

    @staticmethod
    def _key(rollout_id: str, attempt: int) -> bytes:
        return hashlib.blake2b(f"{rollout_id}~{attempt}".encode(), digest_size=16).digest()

    def revoke(self, rollout_id: str, attempt: int) -> None:
        key = self._key(rollout_id, attempt)
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self.limit:
            del self._keys[next(iter(self._keys))]
            self.forgotten += 1

    def __contains__(self, item: tuple[str, int]) -> bool:
        return self._key(*item) in self._keys

    def __len__(self) -> int:
        return len(self._keys)


def log_safe(text: str, limit: int = 300) -> str:
    """``text`` for one log line: non-printable characters escaped (no forged lines), cut at ``limit``."""
    out = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text[: limit + 1])
    return out if len(text) <= limit else f"{out[:limit]}...({len(text)} chars)"
