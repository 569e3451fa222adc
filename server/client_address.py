"""Who a client is, for the per-client caps: an IPv4 address, or an IPv6 address's network.

One IPv6 host commonly holds a whole /64 (SLAAC; privacy addresses rotate within it, and any address
of it can be chosen per connection), so a cap counted per /128 would let one machine open unbounded
connections by walking its own /64. The caps keyed by client (connections per address in
server.listener, request heads waiting per address in server.connections, the address's tenant
before authentication in server.ingest_limits) count an IPv6 client by its network of
`ipv6_prefix_length` bits: 64 by default; 128 counts each address (many clients sharing a cloud
subnet's /64 with no proxy in front), 56 or 48 a whole site. An IPv4-mapped IPv6 address
(::ffff:a.b.c.d, from a dual-stack socket) is its IPv4 address.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache

DEFAULT_IPV6_PREFIX_LENGTH = 64


@lru_cache(maxsize=4096)
def client_key(host: str | None, ipv6_prefix_length: int = DEFAULT_IPV6_PREFIX_LENGTH) -> str | None:
    """The key a client's caps are counted under: `host` itself for an IPv4 address or anything that
    is no IP address (a unix socket's name, None), the network "addr/len" for an IPv6 one."""
    if not host or ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])  # a scope id (fe80::1%eth0) is no part of it
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if ipv6_prefix_length >= 128:
        return str(address)
    return str(ipaddress.IPv6Network((address, ipv6_prefix_length), strict=False))
