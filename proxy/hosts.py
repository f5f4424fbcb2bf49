"""Which machine a host name means, so the pool and the proxy's own listener are known however a
harness spells them.

A forward-mode request names its destination; the routing addon sends calls for the pool through
its filters (administration refused, token ids injected) and the attribution addon serves a call
for the proxy's own reverse listener itself. Both compare addresses, not spellings: ``127.1``,
``LOCALHOST``, ``0.0.0.0``, ``2130706433`` and ``[::ffff:127.0.0.1]`` all reach this machine's
loopback (``canonical_host``), and a name can stand for it too (``/etc/hosts`` gives the machine's
own name ``127.0.0.1``), which only a lookup shows (``HostAddresses``); a connection to such a
name then uses the address the lookup gave (``HostAddresses.addresses``, routing's ``server_connect``),
so a name cannot answer one way to the check and another to the connection. What no lookup can show
(another address of a remote engine, its pod's IP) stays the network's to close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import re
import socket
import time

LOCAL = "localhost"  # canonical_host's name for this machine, however it is spelled
_INET_ATON = re.compile(r"[0-9a-fx.]+")  # the numeric forms the resolver takes (127.1, 2130706433, 0x7f.1)


def _address(h: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(h.partition("%")[0])
    except ValueError:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(h)) if _INET_ATON.fullmatch(h) else None
        except OSError:
            return None


def canonical_host(host: str) -> str:
    """The host a connection to ``host`` reaches, where that needs no name lookup: every spelling of
    this machine's loopback (and the unspecified address, which reaches it too) is ``LOCAL``, an
    address is its plain form, a name is lowercased without a final dot."""
    h = host.strip().lower().rstrip(".")
    if h[:1] == "[" and h[-1:] == "]":
        h = h[1:-1]
    if h == LOCAL or h.endswith("." + LOCAL):
        return LOCAL
    ip = _address(h)
    if ip is None:
        return h
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return LOCAL if ip.is_loopback or ip.is_unspecified else str(ip)


def is_name(canonical: str) -> bool:
    """A canonical host that is a name to look up, not an address."""
    return canonical != LOCAL and _address(canonical) is None


class HostAddresses:
    """The canonical addresses a host stands for, looked up without blocking the proxy's loop and
    remembered ``TTL`` seconds (at most ``MAX`` names: then forgotten all at once).

    A harness chooses the names, so a lookup must not stall anyone else: lookups run on threads of
    their own (``WORKERS``, not the loop's default executor that mitmproxy's connections and the
    control API use), one at a time per name, for at most ``TIMEOUT`` seconds. A name that cannot be
    looked up gives None, remembered only if the resolver said so (a timeout is asked again): the
    caller decides what an unknown name is (routing refuses the call rather than guess)."""

    TTL = 10.0
    MAX = 1024
    TIMEOUT = 2.0
    WORKERS = 4

    def __init__(self) -> None:
        self.cache: dict[str, tuple[float, tuple[str, ...] | None]] = {}
        self.pending: dict[str, asyncio.Future] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(self.WORKERS, thread_name_prefix="lh-lookup")

    async def of(self, host: str) -> frozenset[str] | None:
        """The canonical hosts ``host`` reaches (itself if it needs no lookup), None if unknown."""
        name = canonical_host(host)
        if not is_name(name):
            return frozenset((name,))
        found = await self.addresses(name)
        return None if found is None else frozenset(map(canonical_host, found))

    async def addresses(self, name: str) -> tuple[str, ...] | None:
        """The addresses a name stands for, in the resolver's order (what a connection to it should
        use: the same answer the checks saw), None if unknown."""
        name = canonical_host(name)
        hit = self.cache.get(name)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        if name not in self.pending:  # one lookup per name at a time; others wait for it
            self.pending[name] = asyncio.ensure_future(self._look_up(name))
        return await asyncio.shield(self.pending[name])

    async def _look_up(self, name: str) -> tuple[str, ...] | None:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.run_in_executor(
                self.executor, socket.getaddrinfo, name, None, 0, socket.SOCK_STREAM), self.TIMEOUT)
            found: tuple[str, ...] | None = tuple(dict.fromkeys(info[4][0] for info in infos))
        except TimeoutError:
            return None  # (not remembered: the resolver may answer next time)
        except (OSError, UnicodeError):
            found = None
        finally:
            self.pending.pop(name, None)
        if len(self.cache) >= self.MAX:
            self.cache.clear()
        self.cache[name] = (time.monotonic() + self.TTL, found)
        return found

    def close(self) -> None:
        """At shutdown: a lookup still hanging must not hold the process's exit."""
        self.executor.shutdown(wait=False, cancel_futures=True)
