"""Who is calling: map every flow to a rollout attempt, or refuse it.

Forward mode: clients send ``Proxy-Authorization: Basic <rollout~attempt:token>`` with every
plain-http request but only on the CONNECT of an HTTPS tunnel, so it is read in ``http_connect``
and remembered per client connection. Reverse mode: a path prefix ``/lh/<rollout~attempt>/<token>/``
or ``X-Lightning-Rollout`` / ``X-Lightning-Token`` headers. With a token configured, a request
without valid credentials gets 407 (forward) or 401 (reverse) and nothing is recorded. Credentials
are removed before anything is forwarded.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import urllib.parse
from dataclasses import dataclass

from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode

from ..assemble import endpoint_of
from ..client import NO_TOKEN
from ..state import CONTROL, META, MODEL, OTHER, REWARD, Call, ProxyState

log = logging.getLogger("lightning.proxy")

CONTROL_HOST = "lightning.proxy"
LOCAL_NAMES = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


@dataclass(frozen=True)
class Identity:
    rollout_id: str | None
    attempt: int
    ok: bool  # credentials valid (or no token configured)
    why: str = ""


def parse_user(user: str) -> tuple[str, int]:
    """``rollout~attempt`` (attempt optional, default 0)."""
    user = urllib.parse.unquote(user)
    rid, sep, att = user.rpartition("~")
    if sep and rid and att.isdigit():
        return rid, int(att)
    return user, 0


class Attribution:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.token = state.config.token
        self.by_conn: dict[str, Identity] = {}

    # -- credential checks ------------------------------------------------------------------
    def identify(self, user: str | None, secret: str | None) -> Identity:
        if not user:
            if self.token:
                return Identity(None, 0, False, "no rollout credentials")
            return Identity(None, 0, True)
        rid, att = parse_user(user)
        if self.token:
            given = urllib.parse.unquote(secret or "")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return Identity(rid, att, False, "invalid proxy token")
        return Identity(rid, att, True)

    def from_proxy_auth(self, value: str | None) -> Identity:
        if not value:
            return self.identify(None, None)
        scheme, _, b64 = value.partition(" ")
        if scheme.lower() != "basic":
            return Identity(None, 0, False, "Proxy-Authorization must be Basic")
        try:
            user, _, secret = base64.b64decode(b64.strip()).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return Identity(None, 0, False, "malformed Proxy-Authorization")
        return self.identify(user, secret)

    # -- hooks ------------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow) -> None:
        ident = self.from_proxy_auth(flow.request.headers.get("Proxy-Authorization"))
        flow.request.headers.pop("Proxy-Authorization", None)
        if not ident.ok:
            self._refuse(flow, 407, ident.why)
            return
        self.by_conn[flow.client_conn.id] = ident

    def client_disconnected(self, client) -> None:
        self.by_conn.pop(client.id, None)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:  # already answered (e.g. refused CONNECT)
            return
        if isinstance(flow.client_conn.proxy_mode, ReverseMode):
            self._reverse(flow)
        else:
            self._forward(flow)

    # -- modes ------------------------------------------------------------------------------
    def _forward(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        call = Call(mode="forward", scheme=req.scheme, host=req.pretty_host, path=req.path)
        flow.metadata[META] = call
        header = req.headers.pop("Proxy-Authorization", None)
        if header is not None:
            ident = self.from_proxy_auth(header)
        else:
            ident = self.by_conn.get(flow.client_conn.id) or self.identify(None, None)
        if req.host == CONTROL_HOST:
            call.kind = REWARD if req.path.split("?")[0].rstrip("/") == "/reward" else CONTROL
            if call.kind == CONTROL:
                return  # the control addon checks its own bearer token
        if not ident.ok:
            self._refuse(flow, 407, ident.why)
            return
        call.rollout_id, call.attempt = ident.rollout_id, ident.attempt
        if call.kind == REWARD:
            return
        cfg = self.state.config
        sock = flow.client_conn.sockname
        own = LOCAL_NAMES | {cfg.listen_host} | ({sock[0]} if sock else set())
        if req.port == cfg.reverse_port and req.host in own:
            # A base-URL harness whose HTTP_PROXY also points here (NO_PROXY is empty): mitmproxy
            # refuses to dial itself, so serve it as the reverse listener would, right here.
            self._reverse(flow)
            return
        self._classify(flow, call)

    def _reverse(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        if isinstance(flow.client_conn.proxy_mode, ReverseMode):
            sock = flow.client_conn.sockname
            host = f"{sock[0]}:{sock[1]}" if sock else None
        else:
            host = f"{req.host}:{req.port}"
        call = Call(mode="reverse", scheme=req.scheme if req.scheme else "http", host=host)
        flow.metadata[META] = call
        req.headers.pop("Proxy-Authorization", None)
        path = req.path
        if path.startswith("/_lh/") or path == "/_lh":
            call.kind, call.path = CONTROL, path.split("?")[0]
            return
        user = req.headers.pop("X-Lightning-Rollout", None)
        secret = req.headers.pop("X-Lightning-Token", None)
        if path.startswith("/lh/"):
            parts = path.split("/", 4)  # ['', 'lh', user, token, rest]
            if len(parts) < 4 or not parts[2]:
                self._refuse(flow, 401, "malformed /lh/<rollout~attempt>/<token>/ prefix")
                return
            user, secret = parts[2], parts[3]
            path = "/" + (parts[4] if len(parts) > 4 else "")
            req.path = path
        if secret == NO_TOKEN and not self.token:
            secret = None
        ident = self.identify(user, secret)
        if not ident.ok:
            self._refuse(flow, 401, ident.why)
            return
        call.rollout_id, call.attempt = ident.rollout_id, ident.attempt
        call.path = path
        if path.split("?")[0].rstrip("/") == "/reward" and user:
            call.kind = REWARD
            return
        self._classify(flow, call)

    def _classify(self, flow: http.HTTPFlow, call: Call) -> None:
        call.path = call.path or flow.request.path
        endpoint = endpoint_of(flow.request.path) if flow.request.method == "POST" else None
        if endpoint:
            call.kind, call.endpoint = MODEL, endpoint
        else:
            call.kind = OTHER

    def _refuse(self, flow: http.HTTPFlow, status: int, why: str) -> None:
        self.state.rejected += 1
        call = flow.metadata.get(META)
        if call is not None:
            call.kind = OTHER
            call.done = True
        headers = {"Content-Type": "application/json"}
        if status == 407:
            headers["Proxy-Authenticate"] = 'Basic realm="lightning-proxy"'
        else:
            headers["WWW-Authenticate"] = 'Bearer realm="lightning-proxy"'
        msg = (
            f'{{"error": {{"message": "lightning-proxy: {why}; use the environment printed by '
            f'`lightning-proxy env ROLLOUT_ID`", "type": "proxy_auth", "code": {status}}}}}'
        )
        flow.response = http.Response.make(status, msg.encode(), headers)
        log.info("refused %s %s: %s", flow.request.method, flow.request.pretty_url, why)
