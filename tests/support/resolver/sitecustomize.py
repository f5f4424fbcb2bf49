"""Test-only name answers for a process started with this directory on PYTHONPATH (the proxy):
``LH_TEST_ANSWERS='name=a1,a2;other=b'`` makes ``socket.getaddrinfo`` answer ``name`` with ``a1``
the first time and ``a2`` from then on (the last answer repeats): a name whose answer changes, as
under DNS rebinding, without a DNS server. ``LH_TEST_LOOKUP_TTL`` sets how long the proxy remembers
an answer (``HostAddresses.TTL``)."""

import os
import socket

_answers = {name: addrs.split(",") for name, _, addrs in
            (item.partition("=") for item in os.environ.get("LH_TEST_ANSWERS", "").split(";") if item)}
_real_getaddrinfo = socket.getaddrinfo


def _getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
    queue = _answers.get(host.decode() if isinstance(host, bytes) else host)
    if not queue:
        return _real_getaddrinfo(host, port, family, type, proto, flags)
    address = queue.pop(0) if len(queue) > 1 else queue[0]
    return _real_getaddrinfo(address, port, family, type, proto, flags | socket.AI_NUMERICHOST)


if _answers:
    socket.getaddrinfo = _getaddrinfo
if "LH_TEST_LOOKUP_TTL" in os.environ:
    from lightning_harness.proxy.hosts import HostAddresses

    HostAddresses.TTL = float(os.environ["LH_TEST_LOOKUP_TTL"])
