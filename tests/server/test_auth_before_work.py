"""Authentication before any work (issue 39, item 2): a compressed body is inflated only where a body is
expected, after the token and the write's scope are verified; a read with a made-up token is refused
before the per-tenant read limits count it; one address's token lookups are bounded. A real uvicorn
server with tokens, on SQLite and PostgreSQL; the per-address gate also on its own (asyncio)."""

from __future__ import annotations

import asyncio
import gzip
import json
import secrets

import httpx
import pytest

from gradwatch.server.auth_first import AddressGate

NOT_GZIP = b"\x1f\x8b\x08\x00this is no gzip stream at all" * 100  # inflating it would answer 400


@pytest.fixture
def made(api_server, tokens) -> dict[str, str]:
    return {scope: tokens.create("alpha", scope, scope)[1] for scope in ("ingest", "read", "*")}


def _headers(token: str | None, gzipped: bool = True) -> dict[str, str]:
    headers = {"Content-Encoding": "gzip"} if gzipped else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def test_a_compressed_body_is_never_read_where_no_body_is_expected(api_server, made):
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        # /healthz and a read take no body: a corrupt gzip body is not even looked at.
        assert client.request("GET", "/healthz", content=NOT_GZIP, headers=_headers(None)).status_code == 200
        runs = client.request("GET", "/api/v1/runs", content=NOT_GZIP, headers=_headers(made["read"]))
        assert runs.status_code == 200, runs.text
        # Without a token a read is refused before anything (was: the body inflated first).
        refused = client.request("GET", "/api/v1/runs", content=NOT_GZIP, headers=_headers(None))
        assert refused.status_code == 401 and "requires a token" in refused.json()["detail"]
        # A compressed body outside /api/ is refused, not inflated.
        outside = client.request("POST", "/dashboard/x", content=NOT_GZIP, headers=_headers(made["*"]))
        assert outside.status_code == 415 and "under /api/ only" in outside.json()["detail"]


def test_a_write_is_refused_for_its_scope_before_its_body_is_inflated(api_server, made):
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        run = client.post(
            "/api/v1/runs", json={"project": "alpha"}, headers=_headers(made["*"], False)
        ).json()
        batches = f"/api/v1/runs/{run['id']}/batches"
        read_only = client.post(batches, content=NOT_GZIP, headers=_headers(made["read"]))
        assert (
            read_only.status_code == 403 and "needs a token with ingest scope" in read_only.json()["detail"]
        )
        assert read_only.headers["connection"] == "close"
        job = client.patch(f"/api/v1/runs/{run['id']}", content=NOT_GZIP, headers=_headers(made["ingest"]))
        assert job.status_code == 403 and "needs a token with admin scope" in job.json()["detail"]
        # With the scope it needs, the body is inflated (and this one is no gzip): 400 says so.
        corrupt = client.post(batches, content=NOT_GZIP, headers=_headers(made["ingest"]))
        assert corrupt.status_code == 400 and "invalid gzip body" in corrupt.json()["detail"]
        good = gzip.compress(b'{"seq": 1, "scalars": [{"key": "loss", "steps": [0], "values": [1.0]}]}')
        sent = {**_headers(made["ingest"]), "Content-Type": "application/json"}
        stored = client.post(batches, content=good, headers=sent)
        assert stored.status_code == 200 and stored.json()["points"] == 1, stored.text


def test_reads_with_made_up_tokens_are_refused_before_the_read_limits_count_them(api_server, made):
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        for _ in range(40):
            answer = client.get("/api/v1/runs", headers=_headers("gw_" + secrets.token_hex(16), False))
            assert answer.status_code == 401 and "not recognised" in answer.json()["detail"]
        assert client.get("/api/v1/runs", headers=_headers(made["read"], False)).status_code == 200
    # The per-tenant read limits saw only the verified token (a made-up token per request escaped them).
    limits = api_server.server.config.app.state.tenant_limits  # uvicorn's Config holds the FastAPI app
    assert len([key for key in limits._tenants if key.startswith("token:")]) == 1


def test_one_address_has_a_bounded_number_of_token_lookups_at_once():
    async def scenario() -> None:
        gate = AddressGate(in_flight=2, queue=1)
        release = asyncio.Event()
        admitted: list[bool] = []

        async def lookup(address: str) -> None:
            async with gate.slot(address) as ok:
                admitted.append(ok)
                if ok:
                    await release.wait()

        running = [asyncio.create_task(lookup("10.0.0.1")) for _ in range(3)]  # two in, one waiting
        await asyncio.sleep(0.01)
        assert admitted == [True, True]
        await lookup("10.0.0.1")  # a fourth: refused at once, nothing held
        assert admitted == [True, True, False]
        other = asyncio.create_task(lookup("10.0.0.2"))  # another address is not held up by it
        await asyncio.sleep(0.01)
        assert admitted == [True, True, False, True]
        release.set()
        await asyncio.gather(*running, other)
        assert admitted == [True, True, False, True, True] and gate._gates == {}

    asyncio.run(scenario())


def test_streams_and_doorbells_without_a_valid_token_never_take_a_stream_place(database_url):
    """A stream's place among the process's (512) and its tenant's is taken only once its token is
    known good: doorbells without a cookie, with a made-up one or a malformed header are closed 4401
    without one (they filled the per-process places and real doorbells waited up to 3.3 s)."""
    from conftest import free_port
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from gradwatch.dashboard.pages.signin import COOKIE
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(Settings(database_url=database_url), "127.0.0.1", free_port()).start()
    engine = make_engine(database_url)
    try:
        read = Tokens(engine).create("alpha", "*")[1]
        created = httpx.post(
            f"{server.url}/api/v1/runs",
            json={"id": "run-1", "project": "alpha"},
            headers={"Authorization": f"Bearer {read}"},
            timeout=30,
        )
        assert created.status_code == 201, created.text
        limits = server.server.config.app.state.tenant_limits
        places: list[str] = []
        open_stream = limits.open_stream

        def counted(key: str) -> str | None:  # a spy on the real TenantLimits: every place asked for
            places.append(key)
            return open_stream(key)

        limits.open_stream = counted
        host = server.url.removeprefix("http://")
        attempts = [
            (f"ws://{host}/dashboard/live/run-1", {}),
            (f"ws://{host}/dashboard/live/run-1", {"Cookie": f"{COOKIE}=gw_{secrets.token_hex(16)}"}),
            (f"ws://{host}/dashboard/live", {}),
            (f"ws://{host}/dashboard/live", {"Cookie": f"{COOKIE}=gw_{secrets.token_hex(16)}"}),
            (f"ws://{host}/api/v1/runs/run-1/live", {}),
            (f"ws://{host}/api/v1/runs/run-1/live?token=gw_{secrets.token_hex(16)}", {}),
            (f"ws://{host}/api/v1/runs/run-1/live", {"Authorization": "Basic abc"}),
        ]
        for address, headers in attempts * 3:
            with (
                connect(address, proxy=None, open_timeout=10, additional_headers=headers) as ws,
                pytest.raises(ConnectionClosed) as closed,
            ):
                ws.recv(timeout=10)
            assert closed.value.rcvd.code == 4401, (address, headers, closed.value)
        assert places == []
        assert limits.streams == 0
        with connect(
            f"ws://{host}/dashboard/live/run-1", proxy=None, additional_headers={"Cookie": f"{COOKIE}={read}"}
        ) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "status"
            assert len(places) == 1 and limits.streams == 1
    finally:
        engine.dispose()
        server.stop()
