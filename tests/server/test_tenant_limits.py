"""Per-tenant limits on reads, live streams and run creation (server/tenant_limits.py): the logic on its
own, then each limit on a real server with tokens (SQLite and PostgreSQL), and none on an open server."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from gradwatch.server import tenant_limits
from gradwatch.server.tenant_limits import TenantLimits

# -- the logic -------------------------------------------------------------------------------------


def test_reads_beyond_the_slots_wait_their_turn_in_order_and_a_full_queue_is_refused(monkeypatch):
    monkeypatch.setattr(tenant_limits, "READ_QUEUE", 2)

    async def scenario() -> list[str]:
        limits = TenantLimits(reads_in_flight=2)
        order: list[str] = []
        assert await limits.acquire_read("a") and await limits.acquire_read("a")

        async def wait(name: str) -> None:
            if await limits.acquire_read("a"):
                order.append(name)

        waiting = [asyncio.create_task(wait(n)) for n in ("first", "second")]
        await asyncio.sleep(0)
        assert not await limits.acquire_read("a")  # two in flight, two waiting: refused at once
        assert await limits.acquire_read("b")  # another tenant is not held by this one's reads
        limits.release_read("a")
        limits.release_read("a")
        await asyncio.gather(*waiting)
        return order

    assert asyncio.run(scenario()) == ["first", "second"]


def test_a_read_that_waits_too_long_is_refused_and_gives_its_place_back(monkeypatch):
    monkeypatch.setattr(tenant_limits, "READ_WAIT_S", 0.05)

    async def scenario() -> tuple[bool, bool]:
        limits = TenantLimits(reads_in_flight=1)
        assert await limits.acquire_read("a")
        timed_out = await limits.acquire_read("a")
        limits.release_read("a")
        return timed_out, await limits.acquire_read("a")

    assert asyncio.run(scenario()) == (False, True)


def test_refused_streams_are_held_for_spread_out_times(monkeypatch):
    """2,000 streams refused together and answered together made one turn of the event loop 0.3 s
    long: each refusal is held between half and all of STREAM_REFUSAL_HOLD_S, drawn apart."""
    holds: list[float] = []

    async def sleep(seconds: float) -> None:
        holds.append(seconds)

    monkeypatch.setattr(tenant_limits.asyncio, "sleep", sleep)

    async def scenario() -> None:
        limits = TenantLimits()
        for _ in range(200):
            assert await limits.refuse_stream("a")

    asyncio.run(scenario())
    hold = tenant_limits.STREAM_REFUSAL_HOLD_S
    assert all(hold / 2 <= seconds <= hold for seconds in holds)
    assert len(set(holds)) == 200
    assert max(holds) - min(holds) > hold / 4


def test_run_creation_is_a_bucket_per_tenant() -> None:
    now = [0.0]
    limits = TenantLimits(runs_per_s=2.0, run_burst=3.0, clock=lambda: now[0])
    assert [limits.take_run("a") for _ in range(4)] == [None, None, None, 1]
    assert limits.take_run("b") is None
    now[0] = 0.5  # one more run has flowed in
    assert limits.take_run("a") is None and limits.take_run("a") == 1


# -- on a real server ---------------------------------------------------------------------------------


def _limits(server) -> TenantLimits:
    return server.server.config.app.state.tenant_limits


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def test_run_creation_beyond_its_burst_is_answered_429_per_token(api_server, tokens):
    # A slow refill: at the shipped 2 runs/s, a loaded CI machine once took over half a second for
    # the four creations and the fourth was (rightly) let through.
    _limits(api_server).run_burst = 3
    _limits(api_server).runs_per_s = 0.01
    _, alpha = tokens.create("alpha", "ingest,read")
    _, beta = tokens.create("beta", "ingest,read")
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        made = [
            client.post("/api/v1/runs", json={"project": "alpha"}, headers=_headers(alpha)).status_code
            for _ in range(4)
        ]
        assert made == [201, 201, 201, 429], made
        refused = client.post("/api/v1/runs", json={"project": "alpha"}, headers=_headers(alpha))
        assert refused.json()["limit"] == "run_creation" and int(refused.headers["Retry-After"]) >= 1
        assert (
            client.post("/api/v1/runs", json={"project": "beta"}, headers=_headers(beta)).status_code == 201
        )


def test_reads_beyond_the_tenants_slots_are_refused_with_429_on_a_server_with_tokens(
    api_server, tokens, monkeypatch
):
    _, reader = tokens.create("alpha", "read")
    limits = _limits(api_server)
    limits.reads_in_flight = 0  # every read waits for a slot, and no place to wait is left
    monkeypatch.setattr(tenant_limits, "READ_QUEUE", 0)
    answer = httpx.get(f"{api_server.url}/api/v1/runs", headers=_headers(reader), timeout=30)
    assert answer.status_code == 429, answer.text
    assert answer.json()["limit"] == "reads" and answer.headers["Retry-After"] == "1"
    limits.reads_in_flight = 2
    assert httpx.get(f"{api_server.url}/api/v1/runs", headers=_headers(reader), timeout=30).status_code == 200


def test_an_open_server_does_not_limit_reads_or_run_creation(sqlite_server, monkeypatch):
    limits = _limits(sqlite_server)
    limits.reads_in_flight = 0
    limits.run_burst = 0
    monkeypatch.setattr(tenant_limits, "READ_QUEUE", 0)
    assert httpx.get(f"{sqlite_server.url}/api/v1/runs", timeout=30).status_code == 200
    assert (
        httpx.post(f"{sqlite_server.url}/api/v1/runs", json={"project": "p"}, timeout=30).status_code == 201
    )


def _live(server, run_id: str, token: str):
    url = f"ws://{server.url.removeprefix('http://')}/api/v1/runs/{run_id}/live?token={token}"
    return connect(url, proxy=None, open_timeout=10, close_timeout=2)


def _status(ws) -> str:
    import json

    return json.loads(ws.recv(timeout=10))["type"]


def test_live_streams_beyond_the_tenants_most_are_refused_and_a_closed_one_frees_its_place(
    api_server, tokens, monkeypatch
):
    monkeypatch.setattr(tenant_limits, "STREAM_REFUSAL_HOLD_S", 0.2)  # the refusal's hold, shortened
    limits = _limits(api_server)
    limits.streams_per_tenant = 2
    _, alpha = tokens.create("alpha", "ingest,read")
    _, other = tokens.create("alpha", "read")
    run_id = httpx.post(
        f"{api_server.url}/api/v1/runs", json={"project": "alpha"}, headers=_headers(alpha), timeout=30
    ).json()["id"]
    with contextlib.ExitStack() as open_streams:
        first = open_streams.enter_context(_live(api_server, run_id, alpha))
        second = open_streams.enter_context(_live(api_server, run_id, alpha))
        assert _status(first) == _status(second) == "status"
        with pytest.raises(InvalidStatus) as refused:  # refused before the handshake completes
            _live(api_server, run_id, alpha).__enter__()
        assert refused.value.response.status_code == 403
        with _live(api_server, run_id, other) as elsewhere:  # another token has its own
            assert _status(elsewhere) == "status"
        first.close()
        for _ in range(50):  # the server sees the close shortly after
            try:
                with _live(api_server, run_id, alpha) as again:
                    if _status(again) == "status":
                        break
            except (InvalidStatus, ConnectionClosed):
                continue
        else:
            pytest.fail("a closed stream's place was not given back")
