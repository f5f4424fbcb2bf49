"""The proxy's configuration: one dataclass, loaded from YAML and overridden by CLI flags.

Each option is declared once (:func:`option`); the YAML keys, the ``serve`` flags
(``cli.proxy_options``) and the command line ``ProxyProcess`` starts (:func:`option_argv`) all
derive from that declaration.

Kept free of mitmproxy so ``lightning-proxy env`` and tests can read the same file.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# capture_failure: what the proxy does with new model calls while capture is unhealthy
CAPTURE_FAILURE_POLICIES = {
    # training (default): answer 503 + Retry-After, forward nothing that could not be recorded;
    # the harness retries, the trainer sees healthy=false in /_lh/state and stops
    "reject": "new model calls get 503 (Retry-After) while spans cannot be written",
    # production capture: keep serving; spans that cannot be buffered are counted (spans_dropped) and logged
    "serve": "model calls are forwarded; spans that cannot be recorded are counted and logged",
}


@dataclass(frozen=True)
class Upstream:
    """One replica of the training upstream (an OpenAI-compatible server such as vLLM). Frozen, so
    its URL is split once (routing reads its parts on every request)."""

    url: str
    inject_token_ids: bool | None = None  # None: use ProxyConfig.inject_token_ids

    @functools.cached_property
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


def option(default: Any, help: str, *, flag: str | None = None, off: str | None = None, envvar: str | None = None,
           shown: str | None = None, choices: Iterable[str] | None = None, is_file: bool = False,
           minimum: float | None = None, maximum: float | None = None, above: float | None = None) -> Any:
    """Declare one proxy option (mitmproxy's ``loader.add_option`` in dataclass form): its default
    and help. The YAML key is the field name, the ``serve`` flag ``--name-with-dashes`` (or ``flag``;
    ``off`` names a boolean's negative flag), and :func:`option_argv` writes the command line back.
    ``envvar``: a secret read from this variable, passed to a child by environment, never argv, and
    never quoted in an error. ``minimum``/``maximum`` (inclusive) and ``above`` (exclusive) bound a
    number, checked however the value came (file, flag, keyword)."""
    meta = {"help": help, "flag": flag, "off": off, "envvar": envvar, "shown": shown,
            "choices": tuple(choices) if choices else None, "is_file": is_file,
            "minimum": minimum, "maximum": maximum, "above": above}
    if isinstance(default, (list, dict)):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


MiB = 1 << 20
TOKEN_VAR, CONTROL_TOKEN_VAR = "LIGHTNING_PROXY_TOKEN", "LIGHTNING_PROXY_CONTROL_TOKEN"  # secrets travel by environment


@dataclass
class ProxyConfig:
    """Everything ``lightning-proxy serve`` needs, each option declared once (:func:`option`)."""

    traces: str = option("traces", "Traces root: spans/ and rewards/ Parquet parts go below it.")
    listen_host: str = option("127.0.0.1", "Interface both listeners bind to (0.0.0.0 for pods).")
    forward_port: int = option(8080, "Forward-proxy port (HTTP_PROXY/HTTPS_PROXY); 0: any free one.",
                               minimum=0, maximum=65535)
    reverse_port: int = option(8081, "Reverse-proxy port (OPENAI_BASE_URL) and control API; 0: any free one.",
                               minimum=0, maximum=65535)
    token: str | None = option(None, "Token harnesses must present (else anyone may write traces).", envvar=TOKEN_VAR)
    control_token: str | None = option(
        None, "Bearer token of the control API, never given to harnesses ('' leaves it open).",
        envvar=CONTROL_TOKEN_VAR, shown="generated, written to CONFDIR/control-token-<reverse port> (0600)")
    confdir: str | None = option(None, "mitmproxy confdir (the CA).", shown="~/.cache/lightning-harness/proxy-conf")
    public_hosts: list[str] = option(
        [], "Another name harnesses reach this proxy by (a Kubernetes Service): a forward-mode call to it at the "
        "reverse port is served in place, not dialled and recorded twice. Repeatable.", flag="--public-host")
    # routing
    upstreams: list[Upstream] = option([], "Upstream URL (repeat: a pool; a rollout sticks to one).", flag="--upstream")
    route_hosts: list[str] = option([], "Host whose calls go to the pool ('*' = all). Repeatable.", flag="--route-host")
    model_map: dict[str, str] = option({}, "NAME=SERVED: rename the model of routed calls. Repeatable.")
    served_model: str | None = option(None, "Model name every routed call is sent with (after --model-map).")
    reverse_target: str | None = option(None, "Reverse-mode target without --upstream (e.g. https://api.openai.com).")
    no_intercept: list[str] = option(
        [], "Regex of host:port tunnelled without TLS interception (cert-pinned clients); never recorded. Repeatable.")
    inject_token_ids: bool = option(True, "Ask the pool for token ids and logprobs (hidden from harnesses not asking).")
    model_version: int = option(0, "Policy version stamped on spans until changed over the control API.")
    idle_timeout: float = option(
        600.0, "Seconds without a byte either way before a connection is closed (a hung upstream becomes a "
        "'timeout' error span).", above=0)
    # bounds on model calls (hostile input)
    max_body_size: int = option(32 * MiB, "Largest model-call request body in bytes; larger ones get 413.",
                                minimum=1)
    max_decoded_size: int = option(
        64 * MiB, "Bytes a compressed body (or one SSE event) may expand to; past it: 413 / error span.",
        minimum=1)
    max_inflight_bytes: int = option(
        256 * MiB, "Bytes of large request bodies (64 KiB and up, each costs several times its size while in "
        "flight) processed at once; more calls wait their turn. A rollout's calls beyond its first in flight "
        "only use the first half, so one rollout cannot stall the others. Also what one rollout's bodies may "
        "hold at once, however many connections it opens (past it: 413, connection closed).", minimum=1)
    max_connections: int = option(
        0, "Client connections held open at once; past it the oldest connection of whoever holds the most "
        "(a rollout, the controller, or all connections no admitted request has named) is closed. 0: from the "
        "open-file limit (half of it, less 128; at most 8192).", minimum=0)
    shutdown_grace: float = option(
        5.0, "Seconds SIGTERM waits for calls in flight (the rest: 'shutdown' error spans).", minimum=0)
    ssl_insecure: bool = option(False, "Do not verify upstream TLS certificates (test upstreams only).")
    upstream_ca: str | None = option(None, "PEM file of extra CAs trusted for upstream TLS.", is_file=True)
    lean: bool = option(True, "Load only the mitmproxy built-ins a capture proxy needs, without two of mitmproxy's "
                        "per-call costs (its debug-only type checks, a header lookup per body chunk): faster; or "
                        "stock DumpMaster's.", off="--full-mitmproxy")
    gc_young: int = option(
        10_000, "Allocations between collections of Python's youngest generation (Python's default: 700; "
        "0 keeps it). Parsed stream events live until their span is written: at 700 the collector took "
        "~8% of the proxy's CPU on streamed answers, at 10,000 ~5%.", minimum=0)
    # durability
    flush_seconds: float = option(1.0, "Longest time a span waits in memory (what a SIGKILL can lose).", above=0)
    flush_rows: int = option(5000, "Write a part after this many rows.", minimum=1)
    flush_bytes: int = option(16 * MiB, "Write a part after this many buffered bytes.", minimum=1)
    fsync: bool = option(True, "fsync every part before it counts as written.")
    compact_seconds: float = option(
        60.0, "Seconds between compactions of spans/ and rewards/ (many small parts -> a few large ones, "
        "schemas/compact.py); 0: never (another process compacts).", minimum=0)
    capture_failure: str = option(
        "reject", "While spans cannot be written (disk full): 'reject' new model calls with 503 + Retry-After "
        "(nothing unrecorded), or 'serve' them and count what is not recorded.", choices=CAPTURE_FAILURE_POLICIES)
    max_buffer_bytes: int = option(
        256 * MiB, "Most bytes of unwritten rows held per table while writes fail; past it new spans are "
        "refused/dropped.", minimum=1)

    @property
    def control_secret(self) -> str | None:
        """The control API's bearer token. Never falls back to ``token``: harness credentials are
        derived from that one, and the control token must stay out of every harness's reach."""
        return self.control_token or None

    @property
    def local_host(self) -> str:
        """Where this machine reaches the listeners: the listen host, or 127.0.0.1 for a wildcard one."""
        return "127.0.0.1" if self.listen_host in ("0.0.0.0", "::") else self.listen_host

    @property
    def resolved_confdir(self) -> Path:
        return Path(self.confdir).expanduser() if self.confdir else default_confdir()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ProxyConfig:
        """The config from YAML keys / flag values / keywords; a ValueError naming each bad option."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown proxy config keys {sorted(unknown)}; known: {sorted(known)}")
        values = {k: os.fspath(v) if isinstance(v, os.PathLike) else list(v) if isinstance(v, tuple) else v
                  for k, v in data.items()}  # paths and repeated flags (tuples) as YAML would give them
        for key in ("route_hosts", "no_intercept", "upstreams", "public_hosts"):
            if isinstance(values.get(key), str):
                values[key] = [values[key]]
        if isinstance(values.get("model_map"), list):  # repeated --model-map NAME=SERVED
            values["model_map"] = parse_pairs(values["model_map"], "--model-map", "NAME=SERVED", strip=True)
        problems = [p for f in dataclasses.fields(cls) if f.name in values
                    for p in [check_option(f, values[f.name])] if p]
        if problems:
            raise ValueError("bad proxy option" + ("s" if len(problems) > 1 else "") + ": " + "; ".join(problems))
        if "upstreams" in values:
            values["upstreams"] = [parse_upstream(u) for u in values["upstreams"] or []]
        if "model_version" in values:
            from .credentials import check_model_version

            check_model_version(values["model_version"])
        if values.get("reverse_target"):
            parse_upstream(values["reverse_target"])  # fail early on a bad URL
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike | None, **overrides: Any) -> ProxyConfig:
        """YAML file (optional) then overrides (CLI flags; ``None`` means "not given")."""
        data: dict[str, Any] = {}
        if path:
            text = Path(path).read_text()
            try:
                loaded = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not YAML: {exc}") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping of options, got {type(loaded).__name__}")
            data.update(loaded)
        data.update({key: value for key, value in overrides.items() if value not in (None, (), [])})
        return cls.from_mapping(data)


_KINDS = {  # the declared type of an option -> (check, what it must be)
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "dict[str, str]": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in (*v, *v.values())),
                       "a mapping of strings to strings"),
    "list[Upstream]": (lambda v: isinstance(v, list), "a list of URLs"),
}


def check_option(f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with ``value`` for option ``f`` (its declared type, bounds, choices, file), or
    None. A secret option's value is never quoted (the message goes to a terminal and to logs)."""
    meta = f.metadata
    shown = "(value hidden)" if meta["envvar"] else repr(value)
    check, kind = _KINDS[f.type]
    if not check(value):
        return f"{f.name} must be {kind}, got {shown}"
    if meta["choices"] and value not in meta["choices"]:
        return f"{f.name} must be one of {sorted(meta['choices'])}, got {shown}"
    low, high, above = meta["minimum"], meta["maximum"], meta["above"]
    if (low is not None and value < low) or (high is not None and value > high) or (above is not None
                                                                                     and value <= above):
        bounds = [f">= {low:g}" if low is not None else f"> {above:g}" if above is not None else "",
                  f"<= {high:g}" if high is not None else ""]
        return f"{f.name} must be {' and '.join(b for b in bounds if b)}, got {shown}"
    return _check_path(f.name, value, meta["is_file"])


def _check_path(name: str, value: Any, is_file: bool) -> str | None:
    """Paths that must be a file or a folder, and regexes, are checked now, not when a call needs them."""
    if is_file and value is not None and not Path(value).expanduser().is_file():
        return f"{name}: {value!r} is not a readable file"
    if name in ("traces", "confdir") and value and Path(value).expanduser().exists() \
            and not Path(value).expanduser().is_dir():
        return f"{name}: {value!r} exists and is not a directory"
    if name == "no_intercept":
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                return f"no_intercept: {pattern!r} is not a regular expression ({exc})"
    return None


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
        raise ValueError(f"upstream {_without_userinfo(u.url)!r}: {exc}") from None
    if u.scheme not in ("http", "https") or not u.parts.hostname or not port:
        raise ValueError(f"upstream {_without_userinfo(u.url)!r}: expected http(s)://host[:port][/v1]")
    return u


def _without_userinfo(url: str) -> str:
    """A URL for an error message: ``user:key@`` (a credential) replaced by ``***@``."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}{sep}{netloc}{slash}{path}"


def parse_pairs(items: Iterable[str], flag: str, shape: str = "KEY=VALUE", *, strip: bool = False) -> dict[str, str]:
    """Repeated ``KEY=VALUE`` flags as a dict (split at the first ``=``); an item without one is a
    ValueError naming the flag. The launcher's ``--env`` and the proxy's ``--model-map`` use it."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} expects {shape}, got {item!r}")
        out[key.strip() if strip else key] = value.strip() if strip else value
    return out


def default_confdir() -> Path:
    """Where the proxy keeps its CA unless told otherwise (stable, so printed envs stay valid)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning-harness" / "proxy-conf"


def flag_names(f: dataclasses.Field, prefix: str = "") -> tuple[str, str | None]:
    """The ``serve`` flag of a declared option (``--upstream``) and, for a boolean, its negative."""
    flag = "--" + prefix + (f.metadata["flag"] or "--" + f.name.replace("_", "-"))[2:]
    if f.type != "bool":
        return flag, None
    return flag, f.metadata["off"] or "--no-" + flag[2:]


def option_argv(config: ProxyConfig) -> tuple[list[str], dict[str, str]]:
    """The ``serve`` flags that give ``config`` back, and the environment that carries its secrets
    (argv is readable by every user). Options at their default are left out, so a ``--config``
    file passed as well keeps its say."""
    argv: list[str] = []
    env: dict[str, str] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == (f.default_factory() if f.default is dataclasses.MISSING else f.default):
            continue
        flag, off = flag_names(f)
        if f.metadata["envvar"] and value:
            env[f.metadata["envvar"]] = value
        elif off:
            argv.append(flag if value else off)
        elif isinstance(value, dict):
            argv += [a for k, v in value.items() for a in (flag, f"{k}={v}")]
        elif isinstance(value, list):
            argv += [a for item in value for a in (flag, _flag_text(item))]
        else:
            argv += [flag, str(value)]
    return argv, env


def _flag_text(item: Any) -> str:
    if not isinstance(item, Upstream):
        return str(item)
    if item.inject_token_ids is not None:
        raise ValueError(f"upstream {item.display}: a per-upstream inject_token_ids has no flag; use a --config file")
    return item.url
