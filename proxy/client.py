"""Talk to a running proxy from any environment: control API, harness environment, subprocess.

No mitmproxy import (the standard library and the proxy's option declarations): the launcher
and trainer (training environment) import this; the proxy itself runs from its own environment
(:func:`lightning_harness.proxy.locate.proxy_python`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning_harness.process import StartupError, direct_env, free_port, start_in_session, stop_group, wait_ready

from .config import CONTROL_TOKEN_VAR, TOKEN_VAR, ProxyConfig, option_argv
from .credentials import attempt_credential, check_attempt, check_model_version, check_rollout_id, rollout_user
from .locate import proxy_python

PLACEHOLDER_API_KEY = "sk-lightning-placeholder"
NO_TOKEN = "-"  # path segment used in reverse URLs when the proxy runs without a token
BUNDLE_NAME = "lightning-ca-bundle.pem"
CONTROL_TOKEN_FILE = "control-token-{port}"  # in the confdir, 0600: written by `serve` when it generates one

class ProxyError(RuntimeError):
    """The proxy answered a control call with an error (message includes its body)."""

# -- control API --------------------------------------------------------------------------------
class ProxyControl:
    """Client of the proxy control API (Contract 3): ``/_lh/*`` on the reverse listener.

    Bypasses any ``HTTP(S)_PROXY`` in the environment (the trainer may run inside a harness-like
    environment) and authenticates with ``Authorization: Bearer <token>``.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with self._opener.open(req, timeout=timeout or self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ProxyError(f"{method} {path}: HTTP {exc.code}: {detail}") from None

    def state(self, timeout: float | None = None) -> dict:
        """``{"paused", "in_flight", "held", "spans_written", "model_version", "rewards_written", ...}``"""
        return self._call("GET", "/_lh/state", timeout=timeout)

    def pause(self) -> dict:
        """Hold (not reject) new model requests until :meth:`resume`."""
        return self._call("POST", "/_lh/pause", {})

    def resume(self) -> dict:
        """Release every held request."""
        return self._call("POST", "/_lh/resume", {})

    def drain(self, timeout: float = 60.0) -> dict:
        """Wait until in-flight model calls reach 0: ``{"drained", "in_flight", "waited_s"}``."""
        return self._call("POST", f"/_lh/drain?timeout={timeout}", {}, timeout=timeout + 30)

    def set_model_version(self, n: int) -> dict:
        """Stamp ``n`` on every span forwarded from now on."""
        return self._call("POST", "/_lh/model_version", {"version": check_model_version(n)})

    def reward(self, rollout_id: str, attempt: int, reward: float, info: Mapping | None = None) -> dict:
        """Append a reward row for ``(rollout_id, attempt)`` (source ``api``)."""
        body = {"rollout_id": check_rollout_id(rollout_id), "attempt": check_attempt(attempt),
                "reward": float(reward), "info": info or {}}
        return self._call("POST", "/_lh/reward", body)

    def end(self, rollout_id: str, attempt: int) -> dict:
        """Revoke the attempt's credential: its model calls and reward posts are refused from now on."""
        body = {"rollout_id": check_rollout_id(rollout_id), "attempt": check_attempt(attempt)}
        return self._call("POST", "/_lh/end", body)

    def flush(self) -> dict:
        """Write buffered spans and rewards to Parquet now."""
        return self._call("POST", "/_lh/flush", {})

def control_token_path(confdir: str | os.PathLike, reverse_port: int) -> Path:
    """Where `lightning-proxy serve` keeps the control token it generated (one file per listener)."""
    return Path(confdir) / CONTROL_TOKEN_FILE.format(port=int(reverse_port))

def read_control_token(confdir: str | os.PathLike, reverse_port: int) -> str | None:
    """The generated control token of the proxy on ``reverse_port``, if its file is readable."""
    try:
        return control_token_path(confdir, reverse_port).read_text().strip() or None
    except OSError:
        return None

# -- Contract 2: the harness environment -------------------------------------------------------
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE")


def harness_env(rollout_id: str, attempt: int, token: str | None, forward_url: str, reverse_url: str,
                ca_bundle: str | os.PathLike, api_key: str | None = None,
                anthropic_api_key: str | None = None) -> dict[str, str]:
    """The environment that sends an unmodified harness through the proxy (Contract 2).

    ``forward_url``/``reverse_url`` are the proxy listeners as the harness reaches them (e.g.
    ``http://127.0.0.1:PORT``). The launcher adds its part (``launcher/attempt.py contract_env``:
    ``LIGHTNING_TASK``, ``LIGHTNING_OUTPUT_DIR`` etc.); a Kubernetes Job reads every value but the
    public ones (``launcher/k8s.py is_public_var``) from the attempt's Secret.
    ``token`` is the proxy token; the harness gets only the credential derived from it for this
    attempt (the harness is untrusted: it may run model-written commands).
    """
    user = rollout_user(rollout_id, attempt)
    secret = attempt_credential(token, rollout_id, attempt) if token else NO_TOKEN
    fwd = urllib.parse.urlsplit(forward_url)
    userinfo = f"{urllib.parse.quote(user, safe='~')}:{urllib.parse.quote(secret, safe='')}"
    proxy = f"{fwd.scheme or 'http'}://{userinfo}@{fwd.netloc}"
    prefix = f"{reverse_url.rstrip('/')}/lh/{urllib.parse.quote(user, safe='~')}/{urllib.parse.quote(secret, safe='')}"
    return {
        **dict.fromkeys(PROXY_VARS, proxy), "NO_PROXY": "", "no_proxy": "", **dict.fromkeys(CA_VARS, str(ca_bundle)),
        "OPENAI_BASE_URL": f"{prefix}/v1",
        "OPENAI_API_KEY": api_key or PLACEHOLDER_API_KEY,
        # Anthropic SDKs append /v1/messages to the base URL; the key is the user's, else the placeholder
        "ANTHROPIC_BASE_URL": prefix,
        "ANTHROPIC_API_KEY": anthropic_api_key or PLACEHOLDER_API_KEY,
        "LIGHTNING_ROLLOUT_ID": rollout_id,
        "LIGHTNING_ATTEMPT": str(attempt),
        "LIGHTNING_REWARD_URL": f"{prefix}/reward",
    }

# -- the proxy as a subprocess -------------------------------------------------------------------

class ProxyProcess:
    """``lightning-proxy serve`` as a subprocess in its own process group.

    Picks free ports, waits until the control API answers, and stops with SIGTERM (the proxy then
    flushes every buffered row). Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        config: ProxyConfig | str | os.PathLike,
        *,
        log_path: str | os.PathLike | None = None,
        public_host: str | None = None,
        extra_args: Iterable[str] = (),
        python: str | None = None,
        ready_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> None:
        """``config``: the proxy's options, or its traces folder with ``options`` named as in
        :class:`ProxyConfig` (``ProxyProcess("traces", upstreams=[url])``). Ports are picked at start;
        the token and the control token (never given to a harness; "" = no auth) are generated
        unless set. The rest is about the process: its log, the host harnesses reach it at."""
        base = dataclasses.asdict(config) if isinstance(config, ProxyConfig) else {"traces": config}
        options = {k: v for k, v in options.items() if v is not None}  # None: not given, as for flags
        config = ProxyConfig.from_mapping({**base, **options})
        self.config = dataclasses.replace(
            config, confdir=str(config.resolved_confdir),
            token=config.token if config.token is not None else secrets.token_urlsafe(18),
            control_token=config.control_token if config.control_token is not None else secrets.token_urlsafe(24))
        self.log_path = Path(log_path) if log_path else self.traces_dir.parent / "proxy.log"
        self.public_host = public_host or config.local_host
        self.extra_args = list(extra_args)
        self.python = python or proxy_python()
        self.ready_timeout = ready_timeout
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen | None = None

    # the options a caller reads back (ports once started)
    traces_dir = property(lambda self: Path(self.config.traces))
    confdir = property(lambda self: Path(self.config.confdir))
    token = property(lambda self: self.config.token)
    control_token = property(lambda self: self.config.control_token)
    forward_port = property(lambda self: self.config.forward_port)
    reverse_port = property(lambda self: self.config.reverse_port)

    # URLs as a harness on this machine reaches them
    @property
    def forward_url(self) -> str:
        return f"http://{self.public_host}:{self.forward_port}"

    @property
    def reverse_url(self) -> str:
        return f"http://{self.public_host}:{self.reverse_port}"

    @property
    def ca_bundle(self) -> Path:
        return self.confdir / BUNDLE_NAME

    @property
    def control(self) -> ProxyControl:
        return ProxyControl(self.reverse_url, self.control_token or None)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def env_for(self, rollout_id: str, attempt: int = 0, api_key: str | None = None) -> dict[str, str]:
        """Contract 2 environment for one rollout attempt against this proxy."""
        return harness_env(rollout_id, attempt, self.token, self.forward_url, self.reverse_url, self.ca_bundle, api_key)

    def command(self) -> list[str]:
        """``serve`` with every option that differs from its default (secrets: see :meth:`_child_env`)."""
        return [self.python, "-m", "lightning_harness.proxy", "serve", *option_argv(self.config)[0], *self.extra_args]

    def _child_env(self) -> dict[str, str]:
        env = direct_env(os.environ if self.env is None else self.env)  # it reaches upstreams directly
        for var in (TOKEN_VAR, CONTROL_TOKEN_VAR):  # secrets travel by environment, not argv
            env.pop(var, None)
        env.update(option_argv(self.config)[1])
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self) -> ProxyProcess:
        """Start and wait until ready; retries with new ports if a port was taken meanwhile."""
        self.traces_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        host = self.config.local_host
        for tries_left in (2, 1, 0):
            port = free_port(host)
            self.config.forward_port = self.config.reverse_port = port
            while self.config.reverse_port == port:
                self.config.reverse_port = free_port(host)
            self.proc = start_in_session(self.command(), self.log_path, self._child_env())
            try:
                wait_ready(self._ready, self.ready_timeout, what="lightning-proxy", proc=self.proc,
                           log_path=self.log_path)
                return self
            except StartupError as exc:
                stop_group(self.proc, grace=0)
                if not tries_left or "in use" not in str(exc).lower():
                    raise

    def _ready(self) -> bool:
        """The control API answers and the CA bundle a harness needs is written."""
        self.control.state(timeout=2)
        return self.ca_bundle.exists()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the proxy flushes everything and exits), wait, SIGKILL if it hangs."""
        return stop_group(self.proc, grace=timeout) if self.proc else None

    def kill(self) -> None:
        """SIGKILL the proxy (what a crash looks like); buffered rows of the last interval are lost."""
        if self.proc:
            stop_group(self.proc, grace=0)

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

