"""Where a call goes: hosts and model names configured for training go to the training upstream.

A harness configured for a hosted model (``api.openai.com``, model ``gpt-4o``) is served by the
model under training: requests to a route host (``route_hosts``, ``*`` for all), to a replica of
the pool itself, or arriving in reverse mode go to the pool. The pool may hold several replicas;
each rollout sticks to one (prefix-cache reuse). Model names are mapped (``model_map``, then
``served_model``) by the rewrite addon, which edits the body once.
"""

from __future__ import annotations

import fnmatch

from mitmproxy import http

from ..config import Upstream, parse_upstream
from ..state import META, MODEL, OTHER, ProxyState
from .answers import json_answer


class Routing:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        cfg = state.config
        self.pool_addrs = {(u.host, u.port) for u in cfg.upstreams}
        self.patterns = [h.lower() for h in cfg.route_hosts]
        self.reverse_target: Upstream | None = parse_upstream(cfg.reverse_target) if cfg.reverse_target else None

    def routes(self, host: str, port: int) -> bool:
        if (host, port) in self.pool_addrs:
            return True
        host = host.lower()
        return any(p == "*" or p == host or fnmatch.fnmatch(host, p) for p in self.patterns)

    def request(self, flow: http.HTTPFlow) -> None:
        call = flow.metadata.get(META)
        if call is None or call.kind not in (MODEL, OTHER) or flow.response is not None or call.done:
            return
        req = flow.request
        cfg = self.state.config
        if call.mode == "reverse":
            if cfg.upstreams:
                target = self.state.replica_for(call.rollout_id)
            elif self.reverse_target is not None:
                self._send(req, self.reverse_target)
                call.upstream_display = self.reverse_target.display
                return
            else:
                json_answer(flow, 502, {"error": {"message": "lightning-proxy: no upstream configured (--upstream)"}})
                return
        elif cfg.upstreams and self.routes(req.host, req.port):
            target = self.state.replica_for(call.rollout_id)
        else:
            call.upstream_display = f"{req.scheme}://{req.host}:{req.port}"
            return
        self._send(req, target)
        call.upstream = target
        call.upstream_display = target.display
        call.inject = target.inject_token_ids if target.inject_token_ids is not None else cfg.inject_token_ids
        if call.kind == MODEL:
            call.served_model = None  # decided by rewrite once the body is parsed

    @staticmethod
    def _send(req: http.Request, target: Upstream) -> None:
        req.scheme = target.scheme
        req.host = target.host
        req.port = target.port
        if target.base_path and not req.path.startswith(target.base_path + "/"):
            req.path = target.base_path + req.path
