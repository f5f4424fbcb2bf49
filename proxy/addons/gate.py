"""Pause: hold new model requests (never reject them) until resume. Capture health: reject them
while spans cannot be written, under the ``capture_failure: reject`` policy.

Placed after every addon whose ``request`` hook can wait (limits' byte budget) and before routing
and capture: mitmproxy runs addons in order and waits for an async hook, so nothing after the gate
(routing, capture, model-version stamping) sees a held request before it is released, and a
request that waited elsewhere meets the pause here. The attempt's credential is checked again
after a hold (the attempt may have ended meanwhile). A request whose client gave up while held is
not forwarded.

Why reject while capture is unhealthy (disk full, no permission, buffer bound reached): a call
forwarded but not recorded is training data lost without anyone noticing. A 503 with
``Retry-After`` makes the harness's client retry until the writer has recovered, and the trainer
sees ``healthy: false`` in ``/_lh/state``. Under ``capture_failure: serve`` calls go on and what
cannot be recorded is counted (``spans_dropped``) instead.
"""

from __future__ import annotations

from mitmproxy import http

from ..state import META, MODEL, Call, ProxyState
from .answers import error_answer


class Gate:
    def __init__(self, state: ProxyState, attribution=None) -> None:
        self.state = state
        self.attribution = attribution  # its request hook refuses an attempt that ended while held

    async def request(self, flow: http.HTTPFlow) -> None:
        call = flow.metadata.get(META)
        if call is None or call.kind != MODEL or call.done:
            return
        if not self._still_admitted(flow, call):  # the byte budget may have kept it waiting
            return
        if self._reject_unrecorded(flow, call) or not self.state.paused:
            return
        self.state.holding.add(flow)
        try:
            while self.state.paused:
                await self.state.resume_event.wait()
        finally:
            self.state.holding.discard(flow)
        if self._still_admitted(flow, call):
            self._reject_unrecorded(flow, call)  # health may have changed while held

    def _still_admitted(self, flow: http.HTTPFlow, call: Call) -> bool:
        """False once the call was refused: its attempt ended (``/_lh/end``) while it waited."""
        if self.attribution is not None:
            self.attribution.request(flow)
        return not call.done and flow.response is None

    def _reject_unrecorded(self, flow: http.HTTPFlow, call: Call) -> bool:
        """Answer 503 (policy ``reject``) when the call could not be recorded; True if answered."""
        st = self.state
        if st.config.capture_failure != "reject" or st.capture_healthy():
            return False
        st.capture_rejected += 1
        call.done = True  # nothing downstream records or forwards it
        health = st.capture_health()
        error_answer(flow, 503, "capture_unavailable", "lightning-proxy cannot record model calls right now "
                     f"({health['capture_error'] or 'buffer full'}); retry later",
                     {"Retry-After": str(st.retry_after_s())})
        return True
