"""Secrets never reach a trace: scrub request/response text before it becomes a span.

Headers are never stored at all (Authorization, api-key, cookies stay out by construction). Bodies
can still carry keys (``"api_key": ...`` in tool configs, ``sk-...`` strings pasted into prompts,
our own proxy token): keys that look secret get their values replaced, and known secret shapes
are masked anywhere in the text.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

MASK = "[REDACTED]"

# key names whose values are secrets (matched on the lower-cased key, '-' and '_' ignored)
_SECRET_KEY = re.compile(
    r"(apikey|secret|password|passwd|authorization|accesstoken|authtoken|refreshtoken|idtoken|"
    r"bearer|cookie|credential|privatekey|sessiontoken|xapikey)"
)
# quick pre-check on lower-cased raw text (plain substring tests run at C speed; a hit only
# means the exact key walk runs)
_SECRET_WORDS = (
    "key", "secret", "passw", "auth", "access", "refresh", "id_token", "idtoken", "id-token", "session",
    "bearer", "cookie", "credential",
)  # every _SECRET_KEY match contains one of these (a bare "token" key, as in logprobs, does not)
# secret shapes masked wherever they appear
_SECRET_SHAPES = re.compile(
    r"(sk-[A-Za-z0-9_\-]{12,}|sk_(?:live|test)_[A-Za-z0-9]{12,}|"
    r"(?<=Bearer )[A-Za-z0-9._\-+/=]{12,}|AKIA[0-9A-Z]{16}|ghp_[A-Za-z0-9]{20,}|xox[abp]-[A-Za-z0-9-]{10,})"
)
_SHAPE_HINTS = ("sk-", "sk_", "Bearer ", "AKIA", "ghp_", "xox")
_QUERY_SECRET = re.compile(r"([?&](?:api[-_]?key|key|token|access_token|sig|signature)=)[^&#]*", re.IGNORECASE)
_FORM_SECRET = re.compile(
    r"((?:api[_-]?key|secret|password|token)\s*[=:]\s*)[^\s&,;]+", re.IGNORECASE
)


def _is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key.lower().replace("-", "").replace("_", "")))


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON value with the values of secret-looking keys masked."""
    if isinstance(obj, dict):
        return {k: (MASK if _is_secret_key(k) and v not in (None, "") else redact_obj(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_obj(v) for v in obj]
    return obj


class Redactor:
    """Scrubs text with the generic rules plus this process's own secrets (proxy tokens)."""

    def __init__(self, extra_secrets: Iterable[str | None] = ()) -> None:
        secrets = sorted({s for s in extra_secrets if s and len(s) >= 4}, key=len, reverse=True)
        self._secrets = secrets
        self._extra = re.compile("|".join(re.escape(s) for s in secrets)) if secrets else None

    def text(self, text: str | None) -> str | None:
        """Mask secret shapes and our own tokens anywhere in a string."""
        if not text:
            return text
        if any(h in text for h in _SHAPE_HINTS):
            text = _SECRET_SHAPES.sub(MASK, text)
        if self._extra is not None and any(s in text for s in self._secrets):
            text = self._extra.sub(MASK, text)
        return text

    def json_text(self, text: str | None) -> str | None:
        """A JSON document as text with secret keys masked; re-serialised only when needed."""
        if not text:
            return text
        low = text.lower()
        if any(w in low for w in _SECRET_WORDS):
            try:
                text = json.dumps(redact_obj(json.loads(text)), ensure_ascii=False)
            except ValueError:
                text = _FORM_SECRET.sub(lambda m: m.group(1) + MASK, text)
        return self.text(text)

    def raw_text(self, text: str | None) -> str | None:
        """A body that is not JSON (malformed requests): mask ``key=value`` style secrets too."""
        if not text:
            return text
        return self.text(_FORM_SECRET.sub(lambda m: m.group(1) + MASK, text))

    def path(self, path: str | None) -> str | None:
        """A request path with secret query parameters (``?api-key=``) masked."""
        if not path:
            return path
        return self.text(_QUERY_SECRET.sub(lambda m: m.group(1) + MASK, path))

    def scrub_row(self, row: dict, secrets: Iterable[str] = (), *, request_is_json: bool = True) -> dict:
        """A span row with secrets removed from every text column (the one place capture calls).

        ``secrets``: values known to be secret for this call (its credentials, header keys).
        """
        req = row.get("request_json")
        row["request_json"] = self.json_text(req) if request_is_json else self.raw_text(req)
        if row.get("response_json"):
            row["response_json"] = self.json_text(row["response_json"])
        row["path"] = self.path(row.get("path"))
        row["error"] = self.text(row.get("error"))
        return row
