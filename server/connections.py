"""Connections that never finish their request head cannot hold the server's file descriptors.

uvicorn reads a request's head (its request line and headers) with no time limit, and accepts
connections until the process runs out of file descriptors: 20,000 connections that sent half a head
and then nothing kept a server at its limit (every new connection, /healthz included, failed with
"Too many open files"). GuardedH11Protocol, uvicorn's h11 protocol with two bounds:

- a head timeout: a connection has HEAD_TIMEOUT_S from its first byte (or from being accepted) to
  finish the head of each request, else it is closed; keep-alive idling between requests stays
  uvicorn's own timeout_keep_alive;
- a connection cap (max_connections(): below the process's descriptor limit): at the cap, a new
  connection evicts the oldest one still waiting for its head, so a flood of half-open connections
  makes room for a client that sends its request at once; if none is waiting, the new one is closed;
- per client address at most HEAD_WAITING_PER_ADDRESS connections waiting for their head: a new one
  evicts that address's oldest, so one machine's flood never evicts another's connections.

Used by `gradwatch server` and BackgroundServer: uvicorn.Config(http=GuardedH11Protocol), served by
server.listener.GuardedServer (which bounds what happens before a connection has a protocol).
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .client_address import DEFAULT_IPV6_PREFIX_LENGTH, client_key

HEAD_TIMEOUT_S = 15.0
HEAD_WAITING_PER_ADDRESS = 256  # connections of one client address still waiting for their request head
_RESERVED_DESCRIPTORS = 128  # for the database, log files, webhooks and the listening sockets
_CAP_AT_MOST = 10_000


def max_connections() -> int:
    """How many connections the server keeps open at once: the descriptor limit less a reserve."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _CAP_AT_MOST
    return max(32, min(_CAP_AT_MOST, soft - _RESERVED_DESCRIPTORS))


class GuardedH11Protocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    head_waiting_per_address = HEAD_WAITING_PER_ADDRESS
    cap = max_connections()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        # This server's connections still waiting for a request head, oldest first (an ordered set).
        waiting = getattr(self.server_state, "gradwatch_waiting", None)
        if waiting is None:
            waiting = self.server_state.gradwatch_waiting = {}  # type: ignore[attr-defined]
        self._waiting: dict[GuardedH11Protocol, None] = waiting
        # The same per client address, so that one address's flood is bounded without a scan.
        by_address = getattr(self.server_state, "gradwatch_waiting_by_address", None)
        if by_address is None:
            by_address = self.server_state.gradwatch_waiting_by_address = {}  # type: ignore[attr-defined]
        peer = transport.get_extra_info("peername")
        prefix = getattr(self.server_state, "gradwatch_ipv6_prefix_length", DEFAULT_IPV6_PREFIX_LENGTH)
        address = client_key(peer[0], prefix) if isinstance(peer, tuple) and peer else None
        self._same_address: dict[GuardedH11Protocol, None] = by_address.setdefault(address, {})
        self._by_address: dict[Any, dict[GuardedH11Protocol, None]] = by_address
        self._address = address
        if len(self.connections) > self.cap and not self._evict_one():
            transport.close()  # nothing to make room with: this one goes
            return
        if len(self._same_address) >= self.head_waiting_per_address:
            # Its address's oldest connection without a head makes room: no other client's is evicted.
            oldest = next(iter(self._same_address))
            oldest._head_arrived()
            oldest.transport.close()
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._await_head()  # a head begun (or a next request after keep-alive): the clock runs
        else:
            self._head_arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
            self._waiting[self] = None
            self._same_address[self] = None

    def _head_arrived(self) -> None:
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()
            self._forget()

    def _forget(self) -> None:
        self._waiting.pop(self, None)
        self._same_address.pop(self, None)
        if not self._same_address and self._by_address.get(self._address) is self._same_address:
            del self._by_address[self._address]

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()

    def _evict_one(self) -> bool:
        """Close the oldest connection still waiting for its head of the address that has the most of
        them (a flood pays for itself, not the client that opened a connection before it); False when
        there is none."""
        busiest = max(self._by_address.values(), key=len, default={})
        for waiting in (*busiest, *self._waiting):
            if waiting is not self:
                waiting._head_arrived()
                waiting.transport.close()
                return True
        return False


def uvicorn_options() -> dict[str, Any]:
    """What uvicorn.Config needs to serve with these bounds (served by listener.GuardedServer, whose
    listening socket needs asyncio's own loop: uvloop, when installed, would accept in C past it)."""
    return {"http": GuardedH11Protocol, "loop": "asyncio"}
