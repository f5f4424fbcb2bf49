"""Who is calling: map every flow to a rollout attempt, or refuse it.

Forward mode: clients send ``Proxy-Authorization: Basic <rollout~attempt:credential>`` with every
plain-http request but only on the CONNECT of an HTTPS tunnel, so it is read in ``http_connect``
and remembered per client connection. Reverse mode: a path prefix
``/lh/<rollout~attempt>/<credential>/`` or ``X-Lightning-Rollout`` / ``X-Lightning-Token`` headers.

The credential is derived from the proxy token for that one attempt (``credentials.py``): the
harness is untrusted, so it can only act as itself. With a token configured, a request with a
wrong credential, or one of an attempt ended by ``/_lh/end`` (checked on every request, also
inside an open tunnel), gets 407 (forward) or 401 (reverse); an id outside the rules gets 400.
Nothing refused is recorded or forwarded. Credentials are removed before anything is forwarded,
and log lines carry neither credentials nor raw control characters.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import urllib.parse
from dataclasses import dataclass

from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode

from ..assemble import endpoint_of
from ..client import NO_TOKEN
from ..credentials import InvalidId, credential_ok, log_safe, parse_user
from ..hosts import LOCAL, canonical_host
from ..state import CONTROL, META, MODEL, OTHER, REWARD, Call, ProxyState
from .answers import error_answer

log = logging.getLogger("lightning.proxy")

CONTROL_HOST = "lightning.proxy"
MAX_REMEMBERED = 4096  # credentials remembered as checked; more (attempts in flight at once) start over
_CRED_SEGMENT = re.compile(r"(/lh/[^/?#]*/)[^/?#]*", re.IGNORECASE)
# a request target that is not a plain path and query: a fragment is never sent in HTTP, and the
# engine's parser ends the path at '#' ('/collective_rpc#/tokenize' would be classified by what
# follows it and served as what precedes it); no client sends the others unescaped either
_ODD_TARGET = re.compile(r"[#\\\x00-\x20\x7f-\U0010ffff]")


@dataclass(frozen=True)
class Identity:
    rollout_id: str | None
    attempt: int
    ok: bool  # credentials valid (or no token configured)
    why: str = ""
    malformed: bool = False  # the id broke a rule (400), rather than a wrong/revoked credential
    secret: str | None = None  # the credential presented (masked from traces)


def is_control_path(path: str) -> bool:
    """``/_lh`` and everything below it: answered by the proxy itself, never forwarded."""
    path = path.split("?", 1)[0]
    return path == "/_lh" or path.startswith("/_lh/")


def loggable_url(flow: http.HTTPFlow) -> str:
    """The request URL for a log line: credential segment masked, control characters escaped."""
    return log_safe(_CRED_SEGMENT.sub(r"\1***", flow.request.pretty_url))


class Attribution:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.token = state.config.token
        self.by_conn: dict[str, Identity] = {}
        self.passed: set[tuple[str, int, str]] = set()  # credentials already checked (_credential_ok)

    # -- credential checks ------------------------------------------------------------------
    def identify(self, user: str | None, secret: str | None) -> Identity:
        if not user:
            if self.token:
                return Identity(None, 0, False, "no rollout credentials")
            return Identity(None, 0, True)
        try:
            rid, att = parse_user(user)
        except InvalidId as exc:
            return Identity(None, 0, False, str(exc), malformed=True)
        given = urllib.parse.unquote(secret or "")
        if self.token and not self._credential_ok(rid, att, given):
            return Identity(rid, att, False, f"invalid credential for {rid}~{att}")
        return self.still_valid(Identity(rid, att, True, secret=given if self.token else None))

    def _credential_ok(self, rollout_id: str, attempt: int, given: str) -> bool:
        """:func:`credential_ok`, remembering the credentials that passed (a harness presents the
        same one on every call; the HMAC is then computed once per attempt, not per request).
        Only exact matches are remembered, so a wrong credential is always checked again; an ended
        attempt is refused by :meth:`still_valid`, which is never cached."""
        key = (rollout_id, attempt, given)
        if key in self.passed:
            return True
        if not credential_ok(self.token, rollout_id, attempt, given):
            return False
        if len(self.passed) >= MAX_REMEMBERED:
            self.passed.clear()
        self.passed.add(key)
        return True

    def still_valid(self, ident: Identity) -> Identity:
        """``ident``, or a refusal once its attempt has ended (``/_lh/end``)."""
        if ident.ok and ident.rollout_id is not None and (ident.rollout_id, ident.attempt) in self.state.revoked:
            return Identity(ident.rollout_id, ident.attempt, False,
                            f"attempt {ident.rollout_id}~{ident.attempt} has ended")
        return ident

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
            self._deny(flow, ident, 407)
            return
        self.by_conn[flow.client_conn.id] = ident

    def client_disconnected(self, client) -> None:
        self.by_conn.pop(client.id, None)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:  # already answered (e.g. refused CONNECT)
            return
        if flow.request.method != "CONNECT" and _ODD_TARGET.search(flow.request.path):
            flow.metadata.setdefault(META, Call())
            self._refuse(flow, 400, "a request target is a path and query only: no '#', '\\', space, "
                         "control or non-ASCII character (escape it)")
            return
        try:
            if isinstance(flow.client_conn.proxy_mode, ReverseMode):
                self._reverse(flow)
            else:
                await self._forward(flow)
        except Exception as exc:  # never let a request we could not classify through unchecked
            log.exception("attribution failed")
            flow.metadata.setdefault(META, Call())
            self._refuse(flow, 400, f"request not understood: {type(exc).__name__}")

    def request(self, flow: http.HTTPFlow) -> None:
        """Checked again once the body is in: a request begun before ``/_lh/end`` whose body comes
        after it (a stalled reward POST) is refused too; the gate calls it again after a hold."""
        call = flow.metadata.get(META)
        if call is None or call.done or flow.response is not None or call.rollout_id is None:
            return
        if call.kind == CONTROL or flow.request.stream:  # (an upload streamed through: checked on its headers)
            return
        ident = self.still_valid(Identity(call.rollout_id, call.attempt, True))
        if not ident.ok:
            self._refuse(flow, 407 if call.mode == "forward" else 401, ident.why)

    # -- modes ------------------------------------------------------------------------------
    async def _forward(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        call = Call(mode="forward", scheme=req.scheme, host=req.pretty_host, path=req.path)
        flow.metadata[META] = call
        header = req.headers.pop("Proxy-Authorization", None)
        if header is not None:
            ident = self.from_proxy_auth(header)
        else:
            ident = self.still_valid(self.by_conn.get(flow.client_conn.id) or self.identify(None, None))
        if req.host.lower().rstrip(".") == CONTROL_HOST:
            call.kind = REWARD if req.path.split("?")[0].rstrip("/") == "/reward" else CONTROL
            if call.kind == CONTROL:
                return  # answered by the control addon, which checks its own bearer token
        if not ident.ok:
            self._deny(flow, ident, 407)
            return
        self._admit(call, ident)
        if call.kind == REWARD:
            return
        if req.port == self.state.config.reverse_port and await self._is_own(req.host, flow.client_conn.sockname):
            # A base-URL harness whose HTTP_PROXY also points here (NO_PROXY is empty): served as the
            # reverse listener would, right here, not dialled (which records the call twice).
            self._reverse(flow)
            return
        self._classify(flow, call)

    async def _is_own(self, host: str, sock) -> bool:
        """``host`` is this proxy, however spelled or named (the reverse listener's port is checked
        by the caller): this machine's loopback, the listen address, a ``public_hosts`` name, or the
        address the client reached the forward listener at."""
        cfg = self.state.config
        own = {LOCAL, canonical_host(cfg.listen_host), *map(canonical_host, cfg.public_hosts)}
        own |= {canonical_host(sock[0])} if sock else set()
        return canonical_host(host) in own or not own.isdisjoint(await self.state.hosts.of(host) or ())

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
        if is_control_path(path):
            call.kind, call.path = CONTROL, path.split("?")[0]
            return
        user = req.headers.pop("X-Lightning-Rollout", None)
        secret = req.headers.pop("X-Lightning-Token", None)
        if path.startswith("/lh/"):
            parts = path.split("/", 4)  # ['', 'lh', user, credential, rest]
            if len(parts) < 4 or not parts[2]:
                self._refuse(flow, 401, "malformed /lh/<rollout~attempt>/<credential>/ prefix")
                return
            user, secret = parts[2], parts[3]
            path = "/" + (parts[4] if len(parts) > 4 else "")
        if secret == NO_TOKEN and not self.token:
            secret = None
        ident = self.identify(user, secret)
        if not ident.ok:
            self._deny(flow, ident, 401)  # logged with the /lh/<user>/*** prefix it came with
            return
        req.path = path
        self._admit(call, ident)
        call.path = path
        if is_control_path(path):  # /lh/<user>/<credential>/_lh/...: still ours, never forwarded
            call.kind, call.path = CONTROL, path.split("?")[0]
            return
        if path.split("?")[0].rstrip("/") == "/reward" and user:
            call.kind = REWARD
            return
        self._classify(flow, call)

    @staticmethod
    def _admit(call: Call, ident: Identity) -> None:
        call.rollout_id, call.attempt = ident.rollout_id, ident.attempt
        if ident.secret:
            call.secrets.add(ident.secret)  # masked wherever it might appear in the trace

    def _classify(self, flow: http.HTTPFlow, call: Call) -> None:
        call.path = call.path or flow.request.path
        endpoint = endpoint_of(flow.request.path) if flow.request.method == "POST" else None
        if endpoint:
            call.kind, call.endpoint = MODEL, endpoint
        else:
            call.kind = OTHER

    def _deny(self, flow: http.HTTPFlow, ident: Identity, auth_status: int) -> None:
        """400 for an id that breaks a rule, else the credential status (401 or 407)."""
        self._refuse(flow, 400 if ident.malformed else auth_status, ident.why)

    def _refuse(self, flow: http.HTTPFlow, status: int, why: str) -> None:
        self.state.rejected += 1
        call = flow.metadata.get(META)
        if call is not None:
            call.kind = OTHER
            call.done = True
        challenge = {407: {"Proxy-Authenticate": 'Basic realm="lightning-proxy"'},
                     401: {"WWW-Authenticate": 'Bearer realm="lightning-proxy"'}}.get(status)
        hint = "use the environment printed by `lightning-proxy env ROLLOUT_ID`"
        error_answer(flow, status, "proxy_auth" if challenge else "invalid_request", f"lightning-proxy: {why}; {hint}",
                     challenge)
        log.info("refused %s %s (%s): %s", log_safe(flow.request.method, 20), loggable_url(flow), status, log_safe(why))
