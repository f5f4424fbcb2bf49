"""How the launcher reaches a capture proxy: one it started (ProxyProcess) or one already running.

Why: the batch code needs three things from a proxy, whoever started it: the Contract 2
environment for an attempt, the control API (flush, model version, ending an attempt) and where
its rewards land. The link holds both secrets; a harness gets only its attempt's credential
(``env_for``), never the proxy token nor the control token.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_harness.proxy.client import (
    BUNDLE_NAME,
    ProxyControl,
    ProxyError,
    ProxyProcess,
    harness_env,
    read_control_token,
)
from lightning_harness.proxy.config import default_confdir


@dataclass(frozen=True)
class ProxyLink:
    forward_url: str
    reverse_url: str
    token: str | None
    ca_bundle: str
    control_token: str | None = None
    api_key: str | None = None

    @classmethod
    def from_process(cls, proc: ProxyProcess, api_key: str | None = None) -> ProxyLink:
        return cls(proc.forward_url, proc.reverse_url, proc.token, str(proc.ca_bundle), proc.control_token, api_key)

    @classmethod
    def attach(
        cls,
        reverse_url: str,
        token: str | None,
        *,
        forward_url: str | None = None,
        ca_bundle: str | os.PathLike | None = None,
        control_token: str | None = None,
        api_key: str | None = None,
    ) -> ProxyLink:
        """A running proxy: ``reverse_url`` is its reverse listener (where ``/_lh/`` lives).

        The forward listener is taken from ``forward_url``, else from the proxy's state
        (``forward_port``, same host as ``reverse_url``). ``control_token`` defaults to the one a
        local ``lightning-proxy serve`` generated into its confdir (the CA bundle's folder).
        """
        reverse_url = reverse_url.rstrip("/")
        bundle = Path(ca_bundle) if ca_bundle else default_confdir() / BUNDLE_NAME
        if control_token is None:
            port = urllib.parse.urlsplit(reverse_url).port or 80
            control_token = read_control_token(bundle.parent, port)
        if forward_url is None:
            state = ProxyControl(reverse_url, control_token).state(timeout=10)
            port = state.get("forward_port")
            if not port:
                raise ValueError(f"the proxy at {reverse_url} does not report its forward port; give its forward URL")
            host = urllib.parse.urlsplit(reverse_url).hostname or "127.0.0.1"
            forward_url = f"http://{host}:{port}"
        return cls(forward_url.rstrip("/"), reverse_url, token, str(bundle), control_token, api_key)

    @property
    def control(self) -> ProxyControl:
        """The control API with the control token (never the proxy token: no fallback)."""
        return ProxyControl(self.reverse_url, self.control_token)

    def env_for(self, rollout_id: str, attempt: int) -> dict[str, str]:
        """Contract 2 for one attempt: its own credential, derived from the token."""
        return harness_env(rollout_id, attempt, self.token, self.forward_url, self.reverse_url, self.ca_bundle,
                           self.api_key)

    def end_attempt(self, rollout_id: str, attempt: int) -> str | None:
        """Revoke the attempt's credential once its harness is gone (before any reward is read), so
        nothing it left behind can still record calls or post its reward. Returns an error message
        instead of raising: a proxy that cannot be reached has nothing left to refuse."""
        try:
            self.control.end(rollout_id, attempt)
            return None
        except (OSError, ProxyError, ValueError) as exc:
            return f"could not end {rollout_id}~{attempt} at the proxy: {exc}"

    def with_host(self, host: str, *, ca_bundle: str | None = None) -> ProxyLink:
        """The same proxy as seen from elsewhere (a pod): host replaced, optionally another CA path."""

        def swap(url: str) -> str:
            parts = urllib.parse.urlsplit(url)
            netloc = f"{host}:{parts.port}" if parts.port else host
            return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

        return replace(self, forward_url=swap(self.forward_url), reverse_url=swap(self.reverse_url),
                       ca_bundle=ca_bundle or self.ca_bundle)
