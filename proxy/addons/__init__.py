"""The mitmproxy addons of the capture proxy, one class per concern.

Order matters: mitmproxy calls each hook on every addon in list order and awaits async hooks.
The gate comes after the last addon that can make a request wait (the byte budget of limits) and
before routing and capture: nothing after it sees a held request, and a request that waited for
the budget is held too when a pause began meanwhile (it would reach the paused engine stamped
with the old model version). Attribution acts in the earlier
``http_connect`` / ``requestheaders`` hooks; secrets follows it (it fills the Call attribution
made with the request's credentials, before routing may replace them); capture precedes rewrite so the span keeps the
request as the harness sent it and the response with its token ids; encoding sits between them
(it wraps capture's SSE relay with a decompressor and decodes bodies before rewrite edits them).
Connections follows control (a connection counts for whoever an admitted request names).
Limits (body size, decompression bombs, shutdown) answers before routing dials upstream.
The two Messages addons bracket rewrite: the Anthropic request becomes a chat request before
rewrite injects into it, and the stripped chat answer becomes a Messages answer after.
"""

from __future__ import annotations

from ..state import ProxyState
from .attribution import Attribution
from .capture import Capture
from .connections import Connections
from .control import Control
from .encoding import Encoding
from .gate import Gate
from .limits import Limits
from .messages import MessagesRequest, MessagesResponse
from .rewrite import Rewrite
from .routing import Routing
from .secrets import Secrets


def build_addons(state: ProxyState) -> list:
    return [
        attribution := Attribution(state), Secrets(), Control(state), Connections(state, attribution), Limits(state),
        Gate(state, attribution),
        Routing(state), Capture(state), Encoding(state), MessagesRequest(), Rewrite(state), MessagesResponse(),
    ]


__all__ = ["Attribution", "Capture", "Connections", "Control", "Encoding", "Gate", "Limits", "MessagesRequest",
           "MessagesResponse", "Rewrite", "Routing", "Secrets", "build_addons"]
