"""Where webhooks may be sent: never to the server's own machine or network (SSRF protection).

A webhook URL is anyone's text, so unchecked it could make the server POST to 127.0.0.1:5432, a cloud
metadata service (169.254.169.254) or a host on the LAN. One rule, refusal(), judged twice:

- when a webhook is created (check_literal): a host that is an address literal, in any spelling the
  resolver accepts (2130706433, 0x7f000001, 0177.0.0.1, 127.1, [::ffff:127.0.0.1]);
- when it is sent (PinnedTransport): the host is resolved once with socket.getaddrinfo, as the HTTP
  client would; it is refused if ANY of its addresses is, and otherwise the TCP connection goes to the
  checked address itself. The request keeps its URL's Host header, and for https its TLS SNI and
  certificate check are against the host name (httpcore's `sni_hostname` request extension). There is
  no second lookup, so a DNS answer that changes after the check (rebinding) cannot redirect it.

Refused: loopback, private (RFC 1918, fc00::/7, fec0::/10), link-local, multicast, unspecified
(0.0.0.0/8, ::), reserved (240.0.0.0/4 and IPv6's reserved blocks) and shared (CGNAT, 100.64.0.0/10)
addresses. IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible (::a.b.c.d) and NAT64 (64:ff9b::/96) IPv6
addresses are judged as the IPv4 address they stand for; 6to4 (2002::/16) and Teredo (2001::/32) ones
also by the IPv4 addresses they tunnel to.
Settings.webhook_allow_private (GRADWATCH_WEBHOOK_ALLOW_PRIVATE=1) lifts the rule for receivers on
your own network; requests are pinned all the same.

EgressRefused (a ValueError) is permanent: a refused delivery is failed, not retried.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import httpx

from ..._errors import GradwatchError

__all__ = [
    "ALLOW_PRIVATE_HINT",
    "EgressRefused",
    "HostNotPublic",
    "PinnedTransport",
    "check_literal",
    "refusal",
    "resolve",
]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
ALLOW_PRIVATE_HINT = "set GRADWATCH_WEBHOOK_ALLOW_PRIVATE=1 to allow private targets"

_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_PRIVATE = tuple(
    ipaddress.ip_network(net)
    for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7", "fec0::/10")
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class EgressRefused(GradwatchError, ValueError):
    """A webhook host that is, or resolves to, an address the server must not send to."""


def _translated_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address this IPv6 address stands for: IPv4-mapped, IPv4-compatible or NAT64."""
    as_int = int(address)
    if address.ipv4_mapped is not None or address in _NAT64 or 1 < as_int < 2**32:
        return ipaddress.IPv4Address(as_int & 0xFFFFFFFF)
    return None


def refusal(address: Address) -> str | None:
    """What kind of address the server refuses this is ("a loopback address", …); None when allowed."""
    if isinstance(address, ipaddress.IPv6Address):
        translated = _translated_ipv4(address)
        if translated is not None:  # judged as the IPv4 address it is (::ffff:8.8.8.8 is fine)
            return refusal(translated)
        for tunnelled in (address.sixtofour, *(address.teredo or ())):  # 6to4, Teredo: also the IPv4 end
            kind = refusal(tunnelled) if tunnelled is not None else None
            if kind is not None:
                return kind
    if address.is_unspecified or address in _THIS_NETWORK:
        return "an unspecified address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast:
        return "a multicast address"
    if any(address in net for net in _PRIVATE):
        return "a private address"
    if address in _SHARED:
        return "a shared (CGNAT) address"
    if address.is_reserved:
        return "a reserved address"
    return None


def _literal(host: str) -> Address | None:
    """The address a host spells without DNS (as the resolver reads it: 127.1 is 127.0.0.1); None for a
    name."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        return None
    return ipaddress.ip_address(infos[0][4][0])


def check_literal(host: str) -> None:
    """EgressRefused when host is an address literal the server refuses; host names pass (checked at send)."""
    address = _literal(host)
    kind = refusal(address) if address is not None else None
    if kind is not None:
        raise EgressRefused(f"webhook host {host} is {kind}; {ALLOW_PRIVATE_HINT}")


def resolve(
    host: str, port: int, *, allow_private: bool = False, getaddrinfo: Callable[..., Any] | None = None
) -> list[str]:
    """The addresses to connect to for host:port, each checked (resolver order, no duplicates).

    EgressRefused when any is refused (unless allow_private); OSError (socket.gaierror) when host does not
    resolve. The message names the host and the kind of address, never the address a name resolved to."""
    infos = (getaddrinfo or socket.getaddrinfo)(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not allow_private:
        for text in addresses:
            kind = refusal(ipaddress.ip_address(text))
            if kind is not None:
                verb = "is" if _literal(host) is not None else "resolves to"
                raise EgressRefused(f"webhook host {host} {verb} {kind}; {ALLOW_PRIVATE_HINT}")
    return addresses


class HostNotPublic(httpx.ConnectError, GradwatchError):
    """A webhook host name that resolves to no public address: it does not resolve at all, or only to
    an address refused above. One message and one outcome (a retried delivery) for both, so that a
    webhook's delivery log does not tell its project's admins which of the server's internal names
    exist (a name that does not resolve may resolve later: it is retried, and so is the other)."""

    def __init__(self, host: str, request: httpx.Request) -> None:
        super().__init__(
            f"webhook host {host} does not resolve to a public address (no such name, or only a private,"
            f" loopback or reserved one); {ALLOW_PRIVATE_HINT}",
            request=request,
        )


class PinnedTransport(httpx.BaseTransport):
    """An httpx transport whose every connection goes to an address resolve() checked just before.

    allow_private: skip the check (receivers on your own network). getaddrinfo: the resolver, default
    socket.getaddrinfo (looked up per request, so tests can patch it). Other keyword arguments go to
    httpx.HTTPTransport (e.g. verify=). Keep-alive is off: the pool keys connections by address, and a
    TLS connection opened for one host name must not carry a request for another at the same address."""

    def __init__(
        self, allow_private: bool = False, *, getaddrinfo: Callable[..., Any] | None = None, **options: Any
    ) -> None:
        self.allow_private = allow_private
        self._getaddrinfo = getaddrinfo
        options.setdefault("limits", httpx.Limits(max_keepalive_connections=0))
        self._transport = httpx.HTTPTransport(**options)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        host = url.raw_host.decode("ascii")  # what the client would resolve: IDNA-encoded, no brackets
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            addresses = resolve(host, port, allow_private=self.allow_private, getaddrinfo=self._getaddrinfo)
        except EgressRefused:
            if _literal(host) is not None:
                raise  # an address written in the URL: refused for good, as when the webhook was made
            raise HostNotPublic(host, request) from None
        except OSError as exc:
            if not self.allow_private:
                raise HostNotPublic(host, request) from None
            raise httpx.ConnectError(f"cannot resolve {host}", request=request) from exc
        if url.scheme == "https":
            request.extensions = {**request.extensions, "sni_hostname": host}
        failure = httpx.ConnectError(f"no address for {host}", request=request)
        try:
            for address in addresses:  # like socket.create_connection: the next address if one refuses
                request.url = url.copy_with(host=address)  # the Host header was set from the original URL
                try:
                    return self._transport.handle_request(request)
                except httpx.ConnectError as exc:
                    failure = exc
        finally:
            request.url = url
        raise failure

    def close(self) -> None:
        self._transport.close()
