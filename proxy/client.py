"""Talk to a running proxy from any environment: control API, harness environment, subprocess.

No mitmproxy import and only the standard library: the launcher and trainer (training
environment) import this; the proxy itself runs from its own environment
(:func:`lightning_harness.proxy.locate.proxy_python`).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Mapping

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
# the variables whose values embed the attempt's credential or the user's API key (a k8s Secret holds them)
SECRET_VARS = PROXY_VARS + ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "LIGHTNING_REWARD_URL")


def harness_env(rollout_id: str, attempt: int, token: str | None, forward_url: str, reverse_url: str,
                ca_bundle: str | os.PathLike, api_key: str | None = None, anthropic_api_key: str | None = None) -> dict[str, str]:
    """The environment that sends an unmodified harness through the proxy (Contract 2).

    ``forward_url``/``reverse_url`` are the proxy listeners as the harness reaches them (e.g.
    ``http://127.0.0.1:PORT``). The launcher adds its part (``launcher/attempt.py contract_env``:
    ``LIGHTNING_TASK``, ``LIGHTNING_OUTPUT_DIR`` etc.); :data:`SECRET_VARS` names the secret ones.
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
def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_confdir() -> Path:
    """Where the proxy keeps its CA unless told otherwise (stable, so printed envs stay valid)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning-harness" / "proxy-conf"


class ProxyProcess:
    """``lightning-proxy serve`` as a subprocess in its own process group.

    Picks free ports, waits until the control API answers, and stops with SIGTERM (the proxy then
    flushes every buffered row). Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        traces_dir: str | os.PathLike,
        upstreams: Iterable[str] = (),
        token: str | None = None,
        served_model: str | None = None,
        route_hosts: Iterable[str] = (),
        inject_token_ids: bool = True,
        model_version: int = 0,
        confdir: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None,
        *,
        model_map: Mapping[str, str] | None = None,
        listen_host: str = "127.0.0.1",
        public_host: str | None = None,
        control_token: str | None = None,
        ssl_insecure: bool = False,
        upstream_ca: str | os.PathLike | None = None,
        flush_seconds: float | None = None,
        extra_args: Iterable[str] = (),
        python: str | None = None,
        ready_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.traces_dir = Path(traces_dir)
        self.upstreams = list(upstreams)
        self.token = token if token is not None else secrets.token_urlsafe(18)
        self.served_model = served_model
        self.route_hosts = list(route_hosts)
        self.inject_token_ids = inject_token_ids
        self.model_version = model_version
        self.confdir = Path(confdir) if confdir else default_confdir()
        self.log_path = Path(log_path) if log_path else self.traces_dir.parent / "proxy.log"
        self.model_map = dict(model_map or {})
        self.listen_host = listen_host
        self.public_host = public_host or ("127.0.0.1" if listen_host in ("0.0.0.0", "::") else listen_host)
        # separate from the token and never given to a harness; "" = control API without auth
        self.control_token = control_token if control_token is not None else secrets.token_urlsafe(24)
        self.ssl_insecure = ssl_insecure
        self.upstream_ca = upstream_ca
        self.flush_seconds = flush_seconds
        self.extra_args = list(extra_args)
        self.python = python or proxy_python()
        self.ready_timeout = ready_timeout
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen | None = None
        self.forward_port = 0
        self.reverse_port = 0

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
        cmd = [
            self.python, "-m", "lightning_harness.proxy", "serve",
            "--traces", str(self.traces_dir),
            "--listen-host", self.listen_host,
            "--forward-port", str(self.forward_port),
            "--reverse-port", str(self.reverse_port),
            "--confdir", str(self.confdir),
            "--model-version", str(self.model_version),
            "--inject-token-ids" if self.inject_token_ids else "--no-inject-token-ids",
        ]
        for url in self.upstreams:
            cmd += ["--upstream", url]
        for host in self.route_hosts:
            cmd += ["--route-host", host]
        for src, dst in self.model_map.items():
            cmd += ["--model-map", f"{src}={dst}"]
        if self.served_model:
            cmd += ["--served-model", self.served_model]
        if self.ssl_insecure:
            cmd += ["--ssl-insecure"]
        if self.upstream_ca:
            cmd += ["--upstream-ca", str(self.upstream_ca)]
        if self.flush_seconds is not None:
            cmd += ["--flush-seconds", str(self.flush_seconds)]
        if self.control_token == "":
            cmd += ["--control-token", ""]  # explicitly none (not a secret, so argv is fine)
        return cmd + self.extra_args

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ if self.env is None else self.env)
        env["LIGHTNING_PROXY_TOKEN"] = self.token  # secrets travel by environment, not argv
        env.pop("LIGHTNING_PROXY_CONTROL_TOKEN", None)
        if self.control_token:
            env["LIGHTNING_PROXY_CONTROL_TOKEN"] = self.control_token
        env["PYTHONUNBUFFERED"] = "1"
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(k, None)  # the proxy itself must reach upstreams directly
        return env

    def start(self) -> "ProxyProcess":
        """Start and wait until ready; retries with new ports if a port was taken meanwhile."""
        self.traces_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(3):
            self.forward_port = _free_port(self.listen_host if self.listen_host != "0.0.0.0" else "127.0.0.1")
            self.reverse_port = _free_port(self.listen_host if self.listen_host != "0.0.0.0" else "127.0.0.1")
            if self.forward_port == self.reverse_port:
                continue
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=self._child_env(), start_new_session=True,
                )
            finally:
                log.close()
            ok, last = self._wait_ready()
            if ok:
                return self
            self._kill_group(signal.SIGKILL)
            if "in use" not in last.lower():
                break
        raise RuntimeError(f"lightning-proxy did not start; log {self.log_path}:\n{last}")

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _wait_ready(self) -> tuple[bool, str]:
        deadline = time.monotonic() + self.ready_timeout
        ctl = self.control
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False, self._log_tail()
            try:
                ctl.state(timeout=2)
                if self.ca_bundle.exists():
                    return True, ""
            except (OSError, ProxyError, ValueError):
                pass
            time.sleep(0.1)
        return False, "timed out waiting for the control API\n" + self._log_tail()

    def _kill_group(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the proxy flushes everything and exits), wait, SIGKILL if it hangs."""
        if not self.proc:
            return None
        self._kill_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill_group(signal.SIGKILL)
            self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the proxy (what a crash looks like); buffered rows of the last interval are lost."""
        self._kill_group(signal.SIGKILL)
        if self.proc:
            self.proc.wait(10)

    def __enter__(self) -> "ProxyProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

