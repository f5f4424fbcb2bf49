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
and log lines carry neither credentials nor raw control characters: the ``/lh/`` credential segment,
a malformed user segment or id (a credential glued on behind an escaped ``/`` or a ``~``),
credential-named query values and the call's known secrets are masked (:func:`loggable_url`,
:func:`log_masked`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
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
from ..redact import MASK, MIN_SECRET_LEN, Redactor, decode_escapes
from ..state import CONTROL, META, MODEL, OTHER, REWARD, Call, ProxyState
from .answers import error_answer
from .secrets import CREDENTIAL_QUERY

log = logging.getLogger("lightning.proxy")

CONTROL_HOST = "lightning.proxy"
MAX_REMEMBERED = 4096  # credentials remembered as checked; more (attempts in flight at once) start over
_LH_SEGMENTS = re.compile(r"(/lh/)([^/?#]*)(/[^/?#]*)?", re.IGNORECASE)  # /lh/<user>/<credential>
_CREDENTIAL_RUN = re.compile(f"[A-Za-z0-9_-]{{{MIN_SECRET_LEN},}}")  # a credential (url-safe base64) or a part
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
    spelled: tuple[str, ...] = ()  # what carried it, masked too (the Basic blob, ``user:credential``)
    logged: str | None = None  # ``why`` for the log, where ``why`` quotes what the client sent


def is_control_path(path: str) -> bool:
    """``/_lh`` and everything below it: answered by the proxy itself, never forwarded."""
    path = path.split("?", 1)[0]
    return path == "/_lh" or path.startswith("/_lh/")


def _runs_masked(text: str) -> str:
    """A malformed id (or what quotes one) for a log line: every run that could be a credential or a
    part of one masked, escapes decoded first (``r~0%2F<credential>``, ``%252D`` between its parts)."""
    return _CREDENTIAL_RUN.sub("***", decode_escapes(text))


def _lh_masked(m: re.Match) -> str:
    """``/lh/<user>/***``: the user as sent if well-formed, else with its credential-like runs masked."""
    try:
        parse_user(m.group(2))
        user = m.group(2)
    except InvalidId:
        user = _runs_masked(m.group(2))
    return m.group(1) + user + ("/***" if m.group(3) else "")


def loggable_url(flow: http.HTTPFlow, redactor: Redactor | None = None) -> str:
    """The request URL for a log line: the ``/lh/`` credential segment (and a malformed user segment)
    masked, credential-named query values masked as in a span's path (``?key=``, ``?api-key=``), then
    as :func:`log_masked`. Why: refused calls are logged, and their URL is the harness's text."""
    url, sep, query = flow.request.pretty_url.partition("?")
    if sep:
        query = "&".join(f"{n}={MASK}" if s and CREDENTIAL_QUERY.match(urllib.parse.unquote_plus(n)) else n + s + v
                         for n, s, v in (p.partition("=") for p in query.split("&")))
    return log_masked(flow, _LH_SEGMENTS.sub(_lh_masked, url) + sep + query, redactor)


def log_masked(flow: http.HTTPFlow, text: str, redactor: Redactor | None = None, limit: int = 300) -> str:
    """``text`` for a log line about ``flow``: the proxy's and the call's known secrets and provider
    keys masked (with ``redactor``), control characters escaped, cut at ``limit``, and a secret's
    start that the cut left masked too."""
    if redactor is None:
        return log_safe(text, limit)
    call = flow.metadata.get(META)
    known = redactor.known(call.secrets, call.key_secrets) if call is not None else redactor.known()
    return redactor.cut_starts(log_safe(redactor.scrub_text(text, known)[0], limit), known)


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
        except InvalidId as exc:  # the message quotes the id, which may carry a credential: masked in the log
            quoted, _, rule = str(exc).rpartition(": ")
            return Identity(None, 0, False, str(exc), malformed=True, logged=f"{_runs_masked(quoted)}: {rule}")
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
            pair = base64.b64decode(b64.strip()).decode()
        except (binascii.Error, UnicodeDecodeError):
            return Identity(None, 0, False, "malformed Proxy-Authorization")
        user, _, secret = pair.partition(":")
        ident = self.identify(user, secret)
        # the blob and the pair spell the credential too (``curl -v`` prints the header in a later prompt)
        return dataclasses.replace(ident, spelled=(b64.strip(), pair)) if ident.secret else ident

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
        if ident.secret:  # masked wherever it might appear in the trace, however many other values the call has
            # with what a forward-mode client sends it in (``curl -v`` prints the header into a later prompt):
            # ``Basic base64(rollout~attempt:credential)`` as the printed HTTP_PROXY gives it, and as sent
            pair = f"{ident.rollout_id}~{ident.attempt}:{ident.secret}"
            call.key_secrets.update((ident.secret, pair, base64.b64encode(pair.encode()).decode(), *ident.spelled))

    def _classify(self, flow: http.HTTPFlow, call: Call) -> None:
        call.path = call.path or flow.request.path
        endpoint = endpoint_of(flow.request.path) if flow.request.method == "POST" else None
        if endpoint:
            call.kind, call.endpoint = MODEL, endpoint
        else:
            call.kind = OTHER

    def _deny(self, flow: http.HTTPFlow, ident: Identity, auth_status: int) -> None:
        """400 for an id that breaks a rule, else the credential status (401 or 407)."""
        self._refuse(flow, 400 if ident.malformed else auth_status, ident.why, ident.logged)

    def _refuse(self, flow: http.HTTPFlow, status: int, why: str, logged: str | None = None) -> None:
        """Answer ``status`` with ``why``; the log line says ``logged`` instead where given."""
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
        redactor = self.state.redactor
        log.info("refused %s %s (%s): %s", log_safe(flow.request.method, 20), loggable_url(flow, redactor), status,
                 log_masked(flow, logged or why, redactor))
