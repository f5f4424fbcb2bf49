"""The proxy's configuration: one dataclass, loaded from YAML and overridden by CLI flags.

Kept free of mitmproxy so ``lightning-proxy env`` and tests can read the same file.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


# capture_failure: what the proxy does with new model calls while capture is unhealthy
CAPTURE_FAILURE_POLICIES = {
    # training (default): answer 503 + Retry-After, forward nothing that could not be recorded;
    # the harness retries, the trainer sees healthy=false in /_lh/state and stops
    "reject": "new model calls get 503 (Retry-After) while spans cannot be written",
    # production capture: keep serving; spans that cannot be buffered are counted (spans_dropped) and logged
    "serve": "model calls are forwarded; spans that cannot be recorded are counted and logged",
}


@dataclass
class Upstream:
    """One replica of the training upstream (an OpenAI-compatible server such as vLLM)."""

    url: str
    inject_token_ids: bool | None = None  # None: use ProxyConfig.inject_token_ids

    @property
    def parts(self) -> urllib.parse.SplitResult:
        return urllib.parse.urlsplit(self.url)

    @property
    def scheme(self) -> str:
        return self.parts.scheme or "http"

    @property
    def host(self) -> str:
        return self.parts.hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return self.parts.port or (443 if self.scheme == "https" else 80)

    @property
    def base_path(self) -> str:
        """Path prefix of the upstream (``/v1`` stripped: harness paths carry their own ``/v1``)."""
        path = self.parts.path.rstrip("/")
        return path[:-3] if path.endswith("/v1") else path

    @property
    def display(self) -> str:
        """URL without credentials, for spans."""
        return f"{self.scheme}://{self.host}:{self.port}{self.base_path}"


@dataclass
class ProxyConfig:
    """Everything ``lightning-proxy serve`` needs. YAML keys are the field names."""

    traces: str = "traces"
    listen_host: str = "127.0.0.1"
    forward_port: int = 8080
    reverse_port: int = 8081
    token: str | None = None
    control_token: str | None = None
    confdir: str | None = None
    # routing
    upstreams: list[Upstream] = field(default_factory=list)
    route_hosts: list[str] = field(default_factory=list)  # hosts whose model calls go to the pool; "*" = all
    model_map: dict[str, str] = field(default_factory=dict)  # harness model name -> served name
    served_model: str | None = None  # map every routed call to this name (after model_map)
    reverse_target: str | None = None  # reverse mode without a pool: forward here (e.g. https://api.openai.com)
    # hosts (regexes, mitmproxy ignore_hosts) tunnelled without TLS interception: never recorded
    no_intercept: list[str] = field(default_factory=list)
    # rewriting
    inject_token_ids: bool = True
    # policy version stamped on spans
    model_version: int = 0
    # seconds a connection may be idle (no bytes either way) before mitmproxy closes it; an upstream
    # that stops answering becomes a 'timeout' error span after this long
    idle_timeout: float = 600.0
    # bounds on model calls (hostile input): request body bytes, and bytes a compressed body (request,
    # response, one read of a compressed stream) or one SSE event may grow to; past them: 413 / error span
    max_body_size: int = 32 << 20
    max_decoded_size: int = 64 << 20
    # bytes of request bodies (64 KiB and up) processed at once; more wait their turn (not refused):
    # each costs several times its size while in flight
    max_inflight_bytes: int = 256 << 20
    # seconds SIGTERM waits for calls in flight before recording the rest as 'shutdown' error spans
    shutdown_grace: float = 5.0
    # upstream TLS
    ssl_insecure: bool = False
    upstream_ca: str | None = None
    # mitmproxy with only the built-in addons we need (False: stock DumpMaster)
    lean: bool = True
    # durability
    flush_seconds: float = 1.0
    flush_rows: int = 5000
    flush_bytes: int = 16 << 20
    fsync: bool = True
    # seconds between compactions of the proxy's tables (small parts -> few large ones,
    # schemas/compact.py); 0 = never (another process compacts, e.g. lightning-train)
    compact_seconds: float = 60.0
    # what happens to model calls while spans cannot be written (disk full, permissions), see
    # CAPTURE_FAILURE_POLICIES; and how many bytes of unwritten rows a writer may hold meanwhile
    capture_failure: str = "reject"
    max_buffer_bytes: int = 256 << 20

    @property
    def control_secret(self) -> str | None:
        """The control API's bearer token. Never falls back to ``token``: harness credentials are
        derived from that one, and the control token must stay out of every harness's reach."""
        return self.control_token or None

    @property
    def resolved_confdir(self) -> Path:
        if self.confdir:
            return Path(self.confdir).expanduser()
        from .client import default_confdir

        return default_confdir()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "ProxyConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown proxy config keys {sorted(unknown)}; known: {sorted(known)}")
        values = dict(data)
        if "upstreams" in values:
            values["upstreams"] = [parse_upstream(u) for u in values["upstreams"] or []]
        if "model_version" in values:
            from .credentials import check_model_version

            check_model_version(values["model_version"])
        if values.get("reverse_target"):
            parse_upstream(values["reverse_target"])  # fail early on a bad URL
        for key in ("route_hosts", "no_intercept"):
            if isinstance(values.get(key), str):
                values[key] = [values[key]]
        if values.get("capture_failure", "reject") not in CAPTURE_FAILURE_POLICIES:
            raise ValueError(f"capture_failure must be one of {sorted(CAPTURE_FAILURE_POLICIES)}, "
                             f"got {values['capture_failure']!r}")
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike | None, **overrides: Any) -> "ProxyConfig":
        """YAML file (optional) then overrides (CLI flags; ``None`` means "not given")."""
        data: dict[str, Any] = {}
        if path:
            text = Path(path).read_text()
            loaded = yaml.safe_load(text) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping of options, got {type(loaded).__name__}")
            data.update(loaded)
        for key, value in overrides.items():
            if value is None or value == () or value == []:
                continue
            data[key] = list(value) if isinstance(value, tuple) else value
        return cls.from_mapping(data)


def parse_upstream(value: Any) -> Upstream:
    if isinstance(value, Upstream):
        return value
    if isinstance(value, str):
        url = value if "://" in value else f"http://{value}"
        return _checked(Upstream(url=url))
    if isinstance(value, Mapping) and "url" in value:
        return _checked(Upstream(url=str(value["url"]), inject_token_ids=value.get("inject_token_ids")))
    raise ValueError(f"upstream must be a URL or {{url: ..., inject_token_ids: ...}}, got {value!r}")


def _checked(u: Upstream) -> Upstream:
    try:
        port = u.port
    except ValueError as exc:
        raise ValueError(f"upstream {u.url!r}: {exc}") from None
    if u.scheme not in ("http", "https") or not u.parts.hostname or not port:
        raise ValueError(f"upstream {u.url!r}: expected http(s)://host[:port][/v1]")
    return u


def parse_model_map(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--model-map expects NAME=SERVED, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out
