"""What happens to a connection before it has a protocol: the listening socket.

GuardedServer is uvicorn's server listening on GuardedListener sockets, which bound two things that
uvicorn and asyncio leave open to a connection flood (measured in bench/ingest_isolation.py: a victim's
batch p95 rose from ~10 ms to 0.3-0.5 s under floods straight at the server, with the server's CPU
two-thirds idle):

- Accepts per turn of the event loop: asyncio accepts up to the backlog (uvicorn: 2,048) connections
  each time the listening socket is ready, and each one schedules its transport and its protocol on
  the next turns, so one turn set up thousands of connections while the requests on connections
  already open, an agent's batch, waited behind them. At most ACCEPTS_PER_TURN are accepted per turn
  now: a flood is still accepted as fast as the process can, a few connections between each round
  of the open connections' work.
- Connections per client address (CONNECTIONS_PER_ADDRESS, as the shipped nginx.conf's limit_conn):
  one machine holding 2,000 WebSockets kept ~400,000 Python objects alive, and each full garbage
  collection then stopped the event loop for 0.1-0.4 s. A connection beyond its address's most is
  closed as it is accepted: no transport, no protocol, no object left. Addresses uvicorn trusts as
  proxies (forwarded_allow_ips; default 127.0.0.1 and ::1) carry many clients' connections and are
  not capped (the proxy limits its clients: nginx.conf does, per address).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import struct
import sys
import time
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from .client_address import DEFAULT_IPV6_PREFIX_LENGTH, client_key

logger = logging.getLogger("uvicorn.error")

ACCEPTS_PER_TURN = 16  # new connections handed to asyncio per turn of the event loop
REFUSALS_PER_TURN = 64  # connections over their address's most, closed per turn
CONNECTIONS_PER_ADDRESS = 256
REFUSAL_LOG_EVERY_S = 60.0


class _Counted(socket.socket):
    """An accepted connection that gives its address's place back when it is closed (asyncio's
    transport closes it) or, failing that, collected."""

    __slots__ = ("_address", "_listener")
    _address: str
    _listener: GuardedListener | None

    def release(self) -> None:
        listener, self._listener = getattr(self, "_listener", None), None
        if listener is not None:
            listener.released(self._address)

    def close(self) -> None:
        self.release()
        super().close()

    def __del__(self) -> None:
        self.release()
        super().__del__()  # type: ignore[misc]  # the C socket's own finalizer closes the descriptor


class GuardedListener(socket.socket):
    """A listening socket whose accept() hands asyncio at most accepts_per_turn connections per turn of
    the event loop (then it says "none waiting", BlockingIOError, and asyncio's next readiness check,
    after the other ready callbacks have run, accepts the next ones), and closes at once a connection
    whose address already holds per_address connections (0: no cap; trusted addresses exempt)."""

    accepts_per_turn = ACCEPTS_PER_TURN
    refusals_per_turn = REFUSALS_PER_TURN

    def __init__(
        self,
        listening: socket.socket,
        per_address: int,
        trusted: TrustedProxies,
        ipv6_prefix_length: int = DEFAULT_IPV6_PREFIX_LENGTH,
    ) -> None:
        super().__init__(fileno=listening.detach())
        self.per_address = per_address
        self.trusted = trusted
        self.ipv6_prefix_length = ipv6_prefix_length
        self.held: dict[str, int] = {}  # open connections per capped client (an IPv6 one by its network)
        self.refused = 0  # connections closed at accept, over their address's most (for tests, logs)
        self._accepted = 0
        self._refused_this_turn = 0
        self._logged: dict[str, float] = {}  # when each address's refusals were last logged

    def accept(self) -> tuple[socket.socket, Any]:
        while self._accepted < self.accepts_per_turn and self._refused_this_turn < self.refusals_per_turn:
            fd, address = self._accept()  # type: ignore[attr-defined]  # BlockingIOError: none waiting
            if self._accepted == 0 and self._refused_this_turn == 0:
                # Runs at the start of the loop's next turn, before that turn's readiness callbacks.
                asyncio.get_running_loop().call_soon(self._next_turn)
            peer = address[0] if isinstance(address, tuple) else ""
            capped = bool(self.per_address) and peer not in self.trusted
            host = client_key(peer, self.ipv6_prefix_length) or ""
            if capped and self.held.get(host, 0) >= self.per_address:
                self._refused_this_turn += 1
                self.refused += 1
                _close_now(fd)
                self._log_refusal(host)
                continue
            self._accepted += 1
            connection = _Counted(self.family, self.type, self.proto, fileno=fd)
            if capped:
                self.held[host] = self.held.get(host, 0) + 1
                connection._listener, connection._address = self, host
            return connection, address
        raise BlockingIOError(errno.EAGAIN, "accepted enough this turn")

    def released(self, host: str) -> None:
        held = self.held.get(host, 0) - 1
        if held > 0:
            self.held[host] = held
        else:
            self.held.pop(host, None)

    def _next_turn(self) -> None:
        self._accepted = self._refused_this_turn = 0

    def _log_refusal(self, host: str) -> None:
        """Say so in the log, once a minute per address (a NAT address with many clients behind it
        needs the setting; a flood must not fill the log)."""
        now = time.monotonic()
        if now - self._logged.get(host, -REFUSAL_LOG_EVERY_S) < REFUSAL_LOG_EVERY_S:
            return
        if len(self._logged) > 4096:
            self._logged.clear()
        self._logged[host] = now
        logger.warning(
            "gradwatch: connections from %s refused: it holds its most, %d at once"
            " (GRADWATCH_CONNECTIONS_PER_ADDRESS; many clients behind one address need more)",
            host,
            self.per_address,
        )


def _close_now(fd: int) -> None:
    """Close a refused connection with a reset (SO_LINGER 0): no FIN handshake, no TIME_WAIT here."""
    refused = socket.socket(fileno=fd)
    try:
        refused.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    refused.close()


class TrustedProxies:
    """The addresses uvicorn trusts as proxies, read as its ProxyHeadersMiddleware reads its
    forwarded_allow_ips: exactly "*" is everyone; else addresses and (strict) networks, anything else
    a literal name; none at all when proxy headers are off. (uvicorn's own reader, _TrustedHosts, is
    private: not part of its API, so not relied on here.)"""

    def __init__(self, allowed: list[str] | str) -> None:
        self.everyone = allowed in ("*", ["*"])
        entries = [e.strip() for e in (allowed.split(",") if isinstance(allowed, str) else allowed)]
        self.networks = []
        self.literals = set()
        for entry in filter(None, entries):
            try:
                self.networks.append(ipaddress.ip_network(entry))  # an address is a network of one
            except ValueError:
                self.literals.add(entry)  # a unix socket's name, a host name, a network with host bits
        self._known: dict[str, bool] = {}

    def __contains__(self, host: str) -> bool:
        if self.everyone:
            return True
        known = self._known.get(host)
        if known is None:
            try:
                address = ipaddress.ip_address(host)
            except ValueError:
                known = host in self.literals
            else:
                known = any(address in network for network in self.networks)
            if len(self._known) > 4096:
                self._known.clear()
            self._known[host] = known
        return known


def listening_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for host:port, one per address the name has, as asyncio's create_server binds
    them (listening at once: with SO_REUSEADDR another server could bind the port until then); OSError
    when one cannot be bound (the port is in use)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
    except OSError:
        for sock in bound:
            sock.close()
        raise
    return bound


class GuardedServer(uvicorn.Server):
    """uvicorn's server on GuardedListener sockets for its host and port (a unix socket or an inherited
    descriptor is served as uvicorn serves it). connections_per_address: 0 for no cap."""

    def __init__(
        self,
        config: uvicorn.Config,
        connections_per_address: int = CONNECTIONS_PER_ADDRESS,
        ipv6_prefix_length: int = DEFAULT_IPV6_PREFIX_LENGTH,
    ) -> None:
        super().__init__(config)
        self.connections_per_address = connections_per_address
        self.ipv6_prefix_length = ipv6_prefix_length
        # read by server.connections' protocol: its heads waiting are counted per client the same way
        self.server_state.gradwatch_ipv6_prefix_length = ipv6_prefix_length  # type: ignore[attr-defined]
        self.listeners: list[GuardedListener] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        if sockets is not None or config.uds is not None or config.fd is not None:
            await super().startup(sockets)
            return
        try:
            bound = listening_sockets(config.host, config.port, config.backlog)
        except OSError as exc:
            logger.error("cannot listen on %s:%s: %s", config.host, config.port, exc)
            sys.exit(STARTUP_FAILURE)
        trusted = TrustedProxies(config.forwarded_allow_ips if config.proxy_headers else [])
        self.listeners = [
            GuardedListener(sock, self.connections_per_address, trusted, self.ipv6_prefix_length)
            for sock in bound
        ]
        try:
            await super().startup(list(self.listeners))
        except BaseException:  # the app's startup failed (or exited): its sockets go with it
            for listener in self.listeners:
                listener.close()
            raise
        self._log_started_message(self.listeners)  # uvicorn logs "running on" only for sockets it bound
