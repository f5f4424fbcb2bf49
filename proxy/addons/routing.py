"""Where a call goes: hosts and model names configured for training go to the training upstream.

A harness configured for a hosted model (``api.openai.com``, model ``gpt-4o``) is served by the
model under training: requests to a route host (``route_hosts``, ``*`` for all), to a replica of
the pool itself, or arriving in reverse mode go to the pool. The pool may hold several replicas;
each rollout sticks to one (prefix-cache reuse). Model names are mapped (``model_map``, then
``served_model``) by the rewrite addon, which edits the body once. Besides model calls only a
client's reads (GET, HEAD: ``/v1/models``, ``/health``, ``/version``, a stored response), token counts
(``/tokenize``, ``count_tokens``) and a harness's own stored responses (``POST
/v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``) reach the pool; anything else is the
engine's administration (vLLM's dev mode reloads weights, pauses, sleeps, tells its configuration)
and gets 403, as does a model path the proxy did not recognise (``/v1/chat/completion%73``, which
the engine would decode and serve unrecorded). Paths are matched whole and a model call is sent to
the engine's own path for it (``_MODEL_PATHS``): a prefix or suffix around an allowed one
(``/metrics/v1/responses/x``, vLLM's ``/metrics`` mount) reaches no other route. The pool is
recognised by address however it is spelled or named (``127.1``, ``LOCALHOST``, the machine's own
name: ``hosts.py``): a forward-mode request to an alias of it is routed and filtered like any other,
and a name on a replica's port is dialled at the address it was judged by (``server_connect``);
an address of the engine no lookup shows (another interface, a pod's IP) is the network's to close.
"""

from __future__ import annotations

import fnmatch
import re
import urllib.parse

from mitmproxy import http
from mitmproxy.proxy import server_hooks

from ..assemble import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from ..config import Upstream, parse_upstream
from ..hosts import canonical_host, is_name
from ..state import META, MODEL, OTHER, ProxyState
from .answers import json_answer

READ_METHODS = ("GET", "HEAD")  # besides model calls, what a harness may send the training engine: these reads,
# (GET /v1/responses: Codex tries its Responses WebSocket there first and falls back on the engine's 405)
_READS = re.compile(r"(?:/v1)?/models(?:/(?!\.\.?(?:/|\Z))[^/]+)*|(?:/v1)?/responses|/health|/ping|/version"
                    r"|/tokenizer_info")
_QUESTIONS = re.compile(r"(?:/v1)?/(?:tokenize|detokenize|embeddings|count_tokens|messages/count_tokens)")  # and these


_RESPONSE = re.compile(r"(?:/v1)?/responses/(?!\.\.?(?:/|\Z))([^/?]+)(/cancel)?/?")  # (an id of dots: another path)
# the path each model call is sent to at the pool, below its base path: vLLM serves exactly these (a
# prefix or suffix around them, '/metrics/v1/chat/completions', would reach another of its routes)
_MODEL_PATHS = {CHAT: "/chat/completions", COMPLETIONS: "/completions", RESPONSES: "/responses", MESSAGES: "/messages"}
_RESPONSE_ACTIONS = {("GET", False): "read", ("POST", True): "cancel", ("DELETE", False): "delete"}


def response_action(method: str, path: str) -> tuple[str, str] | None:
    """``(response id, 'read' | 'cancel' | 'delete')`` for a request about a stored Responses answer
    (``GET`` or ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``), else None."""
    m = _RESPONSE.fullmatch(path.split("?", 1)[0])
    action = _RESPONSE_ACTIONS.get((method, m.group(2) is not None)) if m else None
    return (m.group(1), action) if action else None


def harmless(method: str, path: str) -> bool:
    """A request that is not a model call but may reach the training engine: a read a client makes
    (models, health, version, the tokenizer), a question that changes nothing, or a harness's stored
    response read, cancelled or deleted (the Responses API it uses). Other reads are the engine's
    to tell the trainer (vLLM's dev mode ``/server_info``: its whole configuration and paths;
    ``/is_sleeping``: when weights swap). A path with escapes is none: the engine would decode it
    into another."""
    path = path.split("?", 1)[0]
    bare = path.rstrip("/")
    return "%" not in path and ((method in READ_METHODS and _READS.fullmatch(bare) is not None)
                                or (method == "POST" and _QUESTIONS.fullmatch(bare) is not None)
                                or response_action(method, path) is not None)


class Routing:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        cfg = state.config
        self.pool_addrs = {(canonical_host(u.host), u.port) for u in cfg.upstreams}
        self.pool_ports = {u.port for u in cfg.upstreams}
        self.patterns = [h.lower() for h in cfg.route_hosts]
        self.reverse_target: Upstream | None = parse_upstream(cfg.reverse_target) if cfg.reverse_target else None

    def in_pool(self, host: str, port: int) -> bool:
        """A replica of the pool, however its address is spelled (``127.1``, ``LOCALHOST``: see
        ``canonical_host``); otherwise such a request would reach the engine unfiltered."""
        return (canonical_host(host), port) in self.pool_addrs

    async def pool_role(self, host: str, port: int) -> str | None:
        """What a forward-mode destination is to the pool: ``"replica"`` (``in_pool``, or a name a
        lookup shows to be a replica's: the machine's own name for a pool on loopback), ``"stand-in"``
        (a route host the pool serves), ``"unknown"`` (a name on a replica's port without an answer:
        it might be one), or None (elsewhere)."""
        if self.in_pool(host, port):
            return "replica"
        if self.route_host(host):
            return "stand-in"
        return {True: "replica", None: "unknown", False: None}[await self.is_replica(host, port)]

    async def is_replica(self, host: str, port: int) -> bool | None:
        """``host:port`` reaches a replica (True), does not (False), or might (None: a name without an
        answer, or a replica's name without one). Looked up only for a port a replica listens on."""
        if self.in_pool(host, port):
            return True
        ports = [u for u in self.state.config.upstreams if u.port == port]
        if not ports:
            return False
        dest = await self.state.hosts.of(host)
        if dest is None:
            return None
        for u in ports:
            pool = await self.state.hosts.of(u.host)
            if pool is None or not dest.isdisjoint(pool):
                return True if pool is not None else None
        return False

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """Dial the address the checks saw, not a second lookup's (DNS rebinding). A name on a
        replica's port was judged by its looked-up address; mitmproxy would look it up again to
        connect, and a name whose answer changed in between (a resolver the harness controls, or an
        answer remembered past its time while the call was held) reached the engine unfiltered. Such
        a connection is pinned to the name's first address (the Host header and TLS name stay the
        name), and refused if that address is a replica's. A replica's own configured address is
        dialled as it is."""
        host, port = data.server.address
        if port not in self.pool_ports or self.in_pool(host, port) or not is_name(canonical_host(host)):
            return
        found = await self.state.hosts.addresses(host)
        if not found or await self.is_replica(found[0], port) is not False:
            data.server.error = (f"lightning-proxy: {host[:200]} " + ("could not be looked up" if not found else
                                 "now stands for the training engine; only calls routed to it may reach it"))
            return
        data.server.address = (found[0], port)

    def route_host(self, host: str) -> bool:
        """A host configured for training (``route_hosts``): a hosted API the pool stands in for."""
        host = host.lower()
        return any(p == "*" or p == host or fnmatch.fnmatch(host, p) for p in self.patterns)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Other traffic through the forward proxy to a host that is not the pool's streams its body
        through (an upload: ``git push``, a file sent to a service). Nothing here reads such a body,
        and mitmproxy would otherwise hold it whole, as large as a harness likes (a 64 MiB upload
        raised the proxy's peak by 209 MiB). Decided on the headers, where the destination's role is
        known; the connection is still pinned to the address judged (``server_connect``)."""
        call = flow.metadata.get(META)
        if call is None or call.kind != OTHER or call.mode != "forward" or flow.response is not None or call.done:
            return
        req = flow.request
        if self.state.config.upstreams and await self.pool_role(req.host, req.port) is not None:
            return  # the pool's (a read, or refused): decided once the body is in, as ever
        call.upstream_display = f"{req.scheme}://{req.host}:{req.port}"
        req.stream = True

    async def request(self, flow: http.HTTPFlow) -> None:
        call = flow.metadata.get(META)
        if call is None or call.kind not in (MODEL, OTHER) or flow.response is not None or call.done \
                or flow.request.stream:  # (streamed through: sent on already, see requestheaders)
            return
        req = flow.request
        cfg = self.state.config
        if call.mode == "reverse":
            if cfg.upstreams:
                target = self.state.replica_for(call.rollout_id)
            elif self.reverse_target is not None:
                self._send(req, self.reverse_target)
                call.upstream_display = self.reverse_target.display
                call.routed = True
                return
            else:
                json_answer(flow, 502, {"error": {"message": "lightning-proxy: no upstream configured (--upstream)"}})
                return
        elif cfg.upstreams and (role := await self.pool_role(req.host, req.port)) is not None:
            if role == "unknown":  # neither let through unfiltered nor sent to the pool on a guess
                json_answer(flow, 502, {"error": {"message": f"lightning-proxy: {req.host[:200]} could not be "
                                                  "looked up in time; retry"}})
                return
            target = self.state.replica_for(call.rollout_id)
            call.hosted = role == "stand-in"
        else:  # forward mode elsewhere: a route host without a pool (capture only) is the operator's
            # choice; any other host the harness chose, and its answer is that server's, not the policy's
            call.upstream_display = f"{req.scheme}://{req.host}:{req.port}"
            call.routed = not cfg.upstreams and self.route_host(req.host)
            return
        if call.kind == OTHER and not harmless(req.method, req.path):
            self._refuse_admin(flow)
            return
        if call.kind == MODEL:  # the engine's own path for it ('.../chat/completions/': vLLM answered a redirect)
            _, sep, query = req.path.partition("?")
            req.path = target.base_path + "/v1" + _MODEL_PATHS[call.endpoint] + sep + query
        self._send(req, target)
        call.upstream, call.routed = target, True
        call.upstream_display = target.display
        call.inject = target.inject_token_ids if target.inject_token_ids is not None else cfg.inject_token_ids
        if call.kind == MODEL:
            call.served_model = None  # decided by rewrite once the body is parsed

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A redirect from the pool names a path, not the engine: vLLM answers '/v1/models/' with a
        307 to 'http://<its own address>/v1/models', which told the harness where to reach the
        engine around the proxy. Its Location keeps the path and query (a client follows it
        through the proxy, as it came)."""
        call, resp = flow.metadata.get(META), flow.response
        if call is None or call.upstream is None or resp is None or not 300 <= resp.status_code < 400 \
                or not (where := urllib.parse.urlsplit(resp.headers.get("Location", ""))).hostname:
            return
        try:
            port = where.port or {"http": 80, "https": 443}.get(where.scheme.lower())
        except ValueError:  # not a port: not the engine's address either
            return
        if self.in_pool(where.hostname, port):
            path = "/" + where.path.lstrip("/")  # (one slash: '//host/x' would name another host)
            resp.headers["Location"] = urllib.parse.urlunsplit(("", "", path, where.query, where.fragment))

    @staticmethod
    def _refuse_admin(flow: http.HTTPFlow) -> None:
        """The engine's other endpoints change it (vLLM's dev mode: weight reload, pause, sleep):
        the trainer's alone, reached directly. A harness gets model calls and reads (``/v1/models``)."""
        req = flow.request
        json_answer(flow, 403, {"error": {
            "type": "forbidden", "message": f"lightning-proxy: {req.method} {req.path.split('?')[0]} is not a model "
            "call; only model calls, a client's reads (/v1/models, /health, /version, a stored response), token "
            "counts and a stored response's cancel or delete are forwarded to the training engine"}})

    @staticmethod
    def _send(req: http.Request, target: Upstream) -> None:
        req.scheme = target.scheme
        req.host = target.host
        req.port = target.port
        if target.base_path and not req.path.startswith(target.base_path + "/"):
            req.path = target.base_path + req.path
