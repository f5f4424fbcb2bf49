"""A bound on the client connections the proxy holds open, so that no harness can take them all.

Why: each connection costs the proxy a file descriptor (two once it dials upstream), and the
open-file limit is shared by all the proxy does: accepting, dialling the engine, writing Parquet
parts. A harness (hostile: the policy writes its commands) that opened connections and sent
nothing held each for ``idle_timeout`` (600 s); at the limit every accept failed, so every other
harness's calls and the trainer's control calls hung until then.

Nothing on a new connection says whose it is (harnesses all reach the proxy from loopback), so a
connection cannot be refused by owner. Instead, past ``max_connections`` the oldest connection of
whoever holds the most is closed (on a tie, the unnamed holder's: at the bound with one connection
each, a newcomer that has sent nothing is the one closed). A connection counts for a rollout once a
request on it (or the CONNECT that opened its tunnel) was admitted for that rollout; the trainer's
authenticated control calls count apart; every other connection (nothing sent yet, refused, no
credentials) counts for one holder, ``UNKNOWN``. A harness opening connections thus closes its own:
a legitimate client sends its request as it connects, and counts for its rollout within milliseconds.

The listeners' accept queues are raised too (``widen_accept_queues``): many harnesses connecting at
once must not wait for the kernel to retry their handshakes.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from pathlib import Path

from mitmproxy import connection, ctx, http

from ..state import CONTROL, META, ProxyState

log = logging.getLogger("lightning.proxy")

UNKNOWN = "(no rollout)"  # holder of connections no admitted request has named (never a rollout id: spaces)
CONTROLLER = "(control)"  # holder of connections carrying the trainer's authenticated control calls
DERIVED_AT_MOST = 8192  # max_connections: 0 never derives more (~17 KiB a connection held idle)
FD_RESERVE = 128  # descriptors kept for the engine's sockets, Parquet parts, logs, the listeners
ACCEPT_QUEUE = 65535  # a listener's backlog: the kernel caps it at net.core.somaxconn (4096 by default)


def connection_bound(configured: int) -> int:
    """``configured``, or for 0 what the open-file limit allows: half of it (a connection and its
    upstream) less a reserve, at most ``DERIVED_AT_MOST``. The soft limit is raised first, up to the
    hard one, as far as that bound needs."""
    if configured:
        return configured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * DERIVED_AT_MOST + FD_RESERVE
    if soft < wanted and (hard == resource.RLIM_INFINITY or soft < hard):
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return max(16, min(DERIVED_AT_MOST, (soft - FD_RESERVE) // 2))


def widen_accept_queues() -> int:
    """Raise the backlog of every listening socket of this process to ``ACCEPT_QUEUE``; returns how many.

    Why: mitmproxy listens with asyncio's default backlog, 100. A handshake that arrives while 100
    connections wait to be accepted is dropped, and the client's kernel retries it after 1 s (then 3,
    7 s...). 1,000 connections opened at once to the reverse listener: 651 took over a second (3,000:
    p50 1.0 s, slowest 3.1 s); with the queue raised the slowest took 42 ms (157 ms). 2,000 requests
    at once, each on a new connection: the last answer came after 29.5 s, now 3.9 s (the proxy's pace).
    ``listen()`` on a listening socket changes only its backlog. The sockets are found among the
    process's descriptors (Linux ``/proc``; elsewhere nothing changes), not through mitmproxy's
    internals."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    widened = 0
    for fd in fds:
        try:
            dup = os.dup(fd)
        except OSError:  # (the descriptor that listed the folder is gone by now)
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # not a socket
            os.close(dup)
            continue
        with sock:
            if sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.listen(ACCEPT_QUEUE)
                widened += 1
    return widened


class Connections:
    def __init__(self, state: ProxyState, attribution) -> None:
        self.state = state
        self.attribution = attribution  # its ``by_conn``: the rollout a CONNECT tunnel was opened for
        self.limit = connection_bound(state.config.max_connections)
        self.holder_of: dict[str, str] = {}  # client connection id -> holder
        self.by_holder: dict[str, dict[str, connection.Client]] = {}  # holder -> its connections, oldest first
        self.quiet_until = 0.0  # one warning per 10 s under a flood, not one per connection

    def running(self) -> None:
        """The listeners are up (mitmproxy starts them before this hook)."""
        try:
            cap = min(ACCEPT_QUEUE, int(Path("/proc/sys/net/core/somaxconn").read_text()))
        except (OSError, ValueError):
            cap = ACCEPT_QUEUE
        log.info("accept queues of %d listening sockets raised to %d", widen_accept_queues(), cap)

    def client_connected(self, client: connection.Client) -> None:
        self._add(client, UNKNOWN)
        while len(self.holder_of) > self.limit:
            self._close_oldest_of_most(client)

    def client_disconnected(self, client: connection.Client) -> None:
        self._release(client.id)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        ident = self.attribution.by_conn.get(flow.client_conn.id)
        if flow.response is None and ident is not None and ident.rollout_id is not None:
            self._move(flow.client_conn, ident.rollout_id)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """After attribution and the control token's check: an admitted request names its holder."""
        call = flow.metadata.get(META)
        if call is None or flow.response is not None:
            return
        holder = call.rollout_id if call.rollout_id is not None else CONTROLLER if call.kind == CONTROL else None
        if holder is not None:
            self._move(flow.client_conn, holder)

    def _move(self, client: connection.Client, holder: str) -> None:
        """Count a held connection for ``holder``. One no longer held (closed here, or gone) stays out:
        mitmproxy runs each request hook as a task of its own, so a request read before its connection
        was closed here still reaches this hook afterwards, and counting it again would hold a slot for
        a connection that no longer exists (under a flood, dozens a second)."""
        if self.holder_of.get(client.id, holder) == holder:
            return
        self._release(client.id)
        self._add(client, holder)

    def _add(self, client: connection.Client, holder: str) -> None:
        self.holder_of[client.id] = holder
        self.by_holder.setdefault(holder, {})[client.id] = client

    def _release(self, client_id: str) -> None:
        holder = self.holder_of.pop(client_id, None)
        if holder is not None:
            held = self.by_holder[holder]
            del held[client_id]
            if not held:
                del self.by_holder[holder]

    def _close_oldest_of_most(self, new: connection.Client) -> None:
        # the most; on a tie the unnamed (a rollout's connection is worth more than a silent one)
        holder = max(self.by_holder, key=lambda h: (len(self.by_holder[h]), h == UNKNOWN))
        victim = next(iter(self.by_holder[holder].values()))
        self._release(victim.id)
        if victim is new:  # (in its own client_connected hook: refused before it starts)
            new.error = "max_connections"
        elif not _abort(victim):
            return  # gone already (its slot was freed above): nothing closed, nothing counted
        self.state.connections_closed += 1
        if time.monotonic() >= self.quiet_until:
            self.quiet_until = time.monotonic() + 10
            log.warning("max_connections (%d) reached: closed the oldest of the %d connections of %s "
                        "(%d closed so far)", self.limit, len(self.by_holder.get(holder, ())) + 1, holder,
                        self.state.connections_closed)


def _abort(client: connection.Client) -> bool:
    """Close a client connection mitmproxy still serves; False if it serves it no more.

    mitmproxy 11 has no command that closes a client connection. Its socket is aborted, which
    mitmproxy then reads as the client gone (cancelling its task instead missed the connections
    accepted but not yet started: their task does not exist until their first event is handled)."""
    handler = ctx.master.addons.get("proxyserver").connections.get(client.id)
    io = handler.transports.get(handler.client) if handler is not None else None
    if io is None or io.writer is None:
        return False
    io.writer.transport.abort()
    return True
