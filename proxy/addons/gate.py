"""Pause: hold new model requests (never reject them) until resume.

Must be the first addon with a ``request`` hook: mitmproxy runs addons in order and waits for an
async hook, so nothing after the gate (routing, capture, model-version stamping) sees a held
request before it is released. A request whose client gave up while held is not forwarded.
"""

from __future__ import annotations

from mitmproxy import http

from ..state import META, MODEL, ProxyState


class Gate:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def request(self, flow: http.HTTPFlow) -> None:
        call = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.done or not self.state.paused:
            return
        self.state.held += 1
        try:
            while self.state.paused:
                await self.state.resume_event.wait()
        finally:
            self.state.held -= 1
