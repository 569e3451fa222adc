"""The listening socket (server.listener): connections are accepted a few per turn of the event loop,
and one client address may hold only so many at once (real sockets; a real server for the cap)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from gradwatch.server.listener import ACCEPTS_PER_TURN, GuardedListener, TrustedProxies


def _listening(per_address: int = 0, trusted: str = "") -> GuardedListener:
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    listener = GuardedListener(bound, per_address, TrustedProxies(trusted))
    listener.listen(512)
    listener.setblocking(False)
    return listener


def _connect(port: int, source: str = "127.0.0.2") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def test_a_flood_is_accepted_a_few_connections_per_turn_of_the_event_loop():
    """100 connections waiting: asyncio asks accept() until it says "none waiting"; it hands over
    ACCEPTS_PER_TURN, then the next ones only on the loop's next turn (before: all 100 in one turn, and
    each of them set up on the turns after while open connections' requests waited)."""
    listener = _listening()
    clients = [_connect(listener.getsockname()[1]) for _ in range(100)]

    async def turns() -> list[int]:
        accepted: list[socket.socket] = []
        per_turn = []
        while len(accepted) < len(clients):
            before = len(accepted)
            while True:  # as asyncio's _accept_connection does, once per readiness
                try:
                    accepted.append(listener.accept()[0])
                except BlockingIOError:
                    break
            per_turn.append(len(accepted) - before)
            await asyncio.sleep(0)  # the loop's next turn
        for connection in accepted:
            connection.close()
        return per_turn

    try:
        per_turn = asyncio.run(asyncio.wait_for(turns(), 30))
    finally:
        for client in clients:
            client.close()
        listener.close()
    assert sum(per_turn) == 100
    assert max(per_turn) == ACCEPTS_PER_TURN
    assert len(per_turn) >= 100 // ACCEPTS_PER_TURN


def test_asyncios_own_accept_loop_sets_up_at_most_16_connections_a_turn():
    """The same through a real asyncio server: a ticker counts the loop's turns, and the protocols'
    connection_made calls of a 200-connection flood are spread over them, at most 16 in any turn."""
    listener = _listening()
    port = listener.getsockname()[1]
    made: list[int] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        turn = 0

        def tick() -> None:
            nonlocal turn
            turn += 1
            loop.call_soon(tick)

        class Counting(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.append(turn)
                transport.close()

        clients = [_connect(port) for _ in range(200)]  # queued by the kernel before the loop accepts
        server = await loop.create_server(Counting, sock=listener, backlog=512)
        tick()
        deadline = loop.time() + 30
        while len(made) < len(clients) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        server.close()
        for client in clients:
            client.close()

    asyncio.run(scenario())
    assert len(made) == 200
    per_turn = [made.count(turn) for turn in set(made)]
    assert max(per_turn) <= ACCEPTS_PER_TURN
    assert len(per_turn) >= 200 // ACCEPTS_PER_TURN


def test_a_connection_collected_without_close_gives_its_place_and_its_descriptor_back():
    import gc
    import os
    import warnings

    listener = _listening(per_address=3)
    client = _connect(listener.getsockname()[1])

    async def accept_one() -> socket.socket:
        await asyncio.sleep(0.1)
        return listener.accept()[0]

    try:
        accepted = asyncio.run(accept_one())
        fd = accepted.fileno()
        assert listener.held == {"127.0.0.2": 1}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # "unclosed socket": this test's point
            del accepted
            gc.collect()
        assert listener.held == {}
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (unless the number was reused at once: nothing here opens files)
        client.settimeout(5)
        assert client.recv(1) == b""  # the peer sees the close
    finally:
        client.close()
        listener.close()


async def _accept_all(listener: GuardedListener) -> list[socket.socket]:
    """What the listener accepts over ten turns of the event loop, once the kernel has the connects."""
    kept = []
    await asyncio.sleep(0.2)
    for _ in range(10):
        while True:
            try:
                kept.append(listener.accept()[0])
            except BlockingIOError:
                break
        await asyncio.sleep(0)
    return kept


def test_an_address_over_its_most_connections_is_closed_at_accept_and_a_closed_one_gives_its_place_back():
    listener = _listening(per_address=3, trusted="127.0.0.1")
    port = listener.getsockname()[1]

    flood = [_connect(port) for _ in range(5)]
    others = [_connect(port, "127.0.0.3"), _connect(port, "127.0.0.1"), _connect(port, "127.0.0.1")]
    trusted = [_connect(port, "127.0.0.1") for _ in range(4)]
    try:
        kept = asyncio.run(_accept_all(listener))
        by_address = sorted(connection.getpeername()[0] for connection in kept)
        assert by_address == ["127.0.0.1"] * 6 + ["127.0.0.2"] * 3 + ["127.0.0.3"]  # proxies: no cap
        assert listener.refused == 2
        assert listener.held == {"127.0.0.2": 3, "127.0.0.3": 1}
        for client in flood[3:]:  # the two over the cap were reset, without a byte
            client.settimeout(5)
            with pytest.raises(ConnectionResetError):
                client.recv(1)
        next(c for c in kept if c.getpeername()[0] == "127.0.0.2").close()
        assert listener.held["127.0.0.2"] == 2
        again = _connect(port)
        kept += asyncio.run(_accept_all(listener))
        assert listener.held["127.0.0.2"] == 3 and listener.refused == 2
        again.close()
        for connection in kept:
            connection.close()
        assert listener.held == {}
    finally:
        for client in flood + others + trusted:
            client.close()
        listener.close()


def test_trusted_proxies_are_uvicorns_forwarded_allow_ips():
    """Read as uvicorn's ProxyHeadersMiddleware reads them: only "*" alone trusts everyone; networks
    are strict (host bits set: a literal, which no peer address equals)."""
    trusted = TrustedProxies("127.0.0.1, ::1, 10.1.0.0/16,/tmp/gw.sock,10.9.2.3/16")
    assert "127.0.0.1" in trusted and "::1" in trusted and "10.1.200.3" in trusted
    assert "127.0.0.2" not in trusted and "10.2.0.1" not in trusted and "" not in trusted
    assert "10.9.0.1" not in trusted and "10.9.2.3" not in trusted
    assert "203.0.113.9" in TrustedProxies(["*"]) and "203.0.113.9" in TrustedProxies("*")
    assert "203.0.113.9" not in TrustedProxies("127.0.0.1,*")
    assert "127.0.0.1" not in TrustedProxies([])


def test_the_server_caps_one_addresss_connections_and_serves_everyone_else(sqlite_url):
    """A real server (`gradwatch server`'s listener): 127.0.0.2 holds its most kept-alive connections;
    its next one is closed at once; another address, and 127.0.0.1 (trusted: a proxy's address), are
    served; a closed connection gives its place back."""
    from conftest import free_port

    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(
        Settings(database_url=sqlite_url, connections_per_address=4),
        "127.0.0.1",
        free_port(),
        with_dashboard=False,
    ).start()
    port = int(server.url.rsplit(":", 1)[1])
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    def answered(sock: socket.socket) -> bool:
        try:
            sock.sendall(head)
            return sock.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:  # reset, or no answer within the socket's timeout
            return False

    held = [_connect(port) for _ in range(4)]
    try:
        assert all(answered(sock) for sock in held)  # kept alive: each holds its place
        try:
            extra = _connect(port)
        except OSError:  # closed at once: under load the reset can reach the connect itself
            extra = None
        if extra is not None:
            assert not answered(extra)
            extra.close()
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200  # 127.0.0.1: not capped
        elsewhere = _connect(port, "127.0.0.3")
        assert answered(elsewhere)
        elsewhere.close()
        listener = server.server.listeners[0]
        assert listener.refused == 1 and listener.held["127.0.0.2"] == 4
        held.pop().close()
        deadline = time.monotonic() + 10
        while listener.held.get("127.0.0.2") != 3 and time.monotonic() < deadline:
            time.sleep(0.02)  # the server sees the close (not a keep-alive timeout: 3 stay held)
        assert listener.held["127.0.0.2"] == 3
        again = _connect(port)
        assert answered(again)
        again.close()
    finally:
        for sock in held:
            sock.close()
        server.stop()


class _PresentedAs(GuardedListener):
    """Real connections (from 127.0.0.2) presented to the cap as coming from `peers`, one each, in
    order: only ::1 is on a loopback here, so two addresses of one IPv6 /64 cannot connect for real."""

    def __init__(self, *args, peers, **kwargs):
        super().__init__(*args, **kwargs)
        self.peers = iter(peers)

    def _accept(self):
        fd, _ = super()._accept()
        return fd, (next(self.peers), 0, 0, 0)


@pytest.mark.parametrize("prefix", [64, 128])
def test_an_ipv6_client_is_capped_by_its_network_not_by_each_address_it_can_choose(prefix):
    """One IPv6 host holds a whole /64 and may use any address of it per connection: the cap counts
    it by its /64 (the default), or by each address when told so (GRADWATCH_IPV6_PREFIX_LENGTH=128)."""
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    same_64 = [f"2001:db8:1:2::{i:x}" for i in range(1, 6)]
    peers = [*same_64, "2001:db8:1:3::1", "::ffff:127.0.0.9"]
    listener = _PresentedAs(bound, 3, TrustedProxies(""), prefix, peers=peers)
    listener.listen(64)
    listener.setblocking(False)
    port = listener.getsockname()[1]

    clients = []
    try:
        for _ in peers:  # one at a time: each real connection meets its presented address in order
            clients.append(_connect(port))
        kept = asyncio.run(_accept_all(listener))
        if prefix == 64:
            assert listener.refused == 2 and len(kept) == 5
            assert listener.held == {"2001:db8:1:2::/64": 3, "2001:db8:1:3::/64": 1, "127.0.0.9": 1}
        else:
            assert listener.refused == 0 and len(kept) == 7
            assert listener.held == {**dict.fromkeys(same_64, 1), "2001:db8:1:3::1": 1, "127.0.0.9": 1}
        for connection in kept:
            connection.close()
        assert listener.held == {}
    finally:
        for client in clients:
            client.close()
        listener.close()


def test_client_keys_and_the_prefix_setting(monkeypatch):
    from gradwatch.server.client_address import client_key
    from gradwatch.server.ingest_limits import IngestLimits
    from gradwatch.server.settings import Settings

    assert client_key("203.0.113.9") == "203.0.113.9" and client_key(None) is None
    assert client_key("2001:db8:1:2:aaaa:bbbb:cccc:dddd") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:2:aaaa::1", 56) == "2001:db8:1::/56"
    assert client_key("2001:db8::1", 128) == "2001:db8::1" and client_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert client_key("fe80::1%eth0") == "fe80::/64" and client_key("/tmp/gw.sock") == "/tmp/gw.sock"
    limits = IngestLimits()  # an IPv6 client without a token: one tenant per /64
    assert limits.request_key(None, "2001:db8:1:2::1") == limits.request_key(None, "2001:db8:1:2::ff")
    assert limits.request_key(None, "2001:db8:1:2::1") != limits.request_key(None, "2001:db8:1:3::1")
    assert Settings().ipv6_prefix_length == 64
    monkeypatch.setenv("GRADWATCH_IPV6_PREFIX_LENGTH", "128")
    assert Settings().ipv6_prefix_length == 128
    assert IngestLimits.from_settings(Settings()).ipv6_prefix_length == 128
    for bad in ("0", "129", "64.5", "x"):
        monkeypatch.setenv("GRADWATCH_IPV6_PREFIX_LENGTH", bad)
        with pytest.raises(
            ValueError, match="GRADWATCH_IPV6_PREFIX_LENGTH must be a whole number from 1 to 128"
        ):
            Settings()
