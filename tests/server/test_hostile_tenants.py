"""Hostile tenants and hostile bytes, round two: what a leaked token or one bad string may not do to
the history of a team server (real server, SQLite and PostgreSQL)."""

from __future__ import annotations

import time

import httpx
import pytest

SEQ_SHIFT = 20  # the agent's seq layout: (the sender's start in ms << 20) + a counter


def _seq(started: float, counter: int = 0) -> int:
    return (int(started * 1000) << SEQ_SHIFT) + counter


def _client(server, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def _finished_run(client: httpx.Client, steps: int = 50) -> tuple[str, int]:
    """A run that trained `steps` steps and finished, as the agent sends it; returns its id and the
    agent's next seq."""
    started = time.time() - 60
    run = client.post("/api/v1/runs", json={"project": "alpha", "name": "done"}).json()
    batch = {
        "seq": _seq(started),
        "scalars": [
            {"key": "loss", "steps": list(range(steps)), "values": [1.0 / (s + 1) for s in range(steps)]}
        ],
        "events": [{"step": 3, "kind": "skip", "data": {}}],
    }
    assert client.post(f"/api/v1/runs/{run['id']}/batches", json=batch).status_code == 200
    end = {"seq": _seq(started, 1), "status": "finished"}
    assert client.post(f"/api/v1/runs/{run['id']}/batches", json=end).status_code == 200
    return run["id"], _seq(started, 2)


def _points(client: httpx.Client, run_id: str) -> list[int]:
    return client.get(f"/api/v1/runs/{run_id}/series", params={"key": "loss"}).json()["steps"]


def test_an_ingest_token_cannot_erase_or_silence_a_finished_run(api_server, tokens):
    _, ingest = tokens.create("alpha", "ingest,read")  # a job that also reads its own runs
    _, admin = tokens.create("alpha", "ingest,read,admin")
    with _client(api_server, ingest) as client:
        run_id, next_seq = _finished_run(client)
        url = f"/api/v1/runs/{run_id}/batches"
        # The attack as reported: a resume at step 0 under the largest seq there is.
        attack = client.post(url, json={"seq": 2**63 - 1, "events": [{"step": 0, "kind": "resume"}]})
        assert attack.status_code == 422, attack.text
        assert "seq" in attack.json()["detail"] and "clock" in attack.json()["detail"]
        # The same with a seq of now: it would replace a finished run's history.
        now = client.post(url, json={"seq": _seq(time.time()), "events": [{"step": 0, "kind": "resume"}]})
        assert now.status_code == 409, now.text
        assert "admin" in now.json()["detail"] and "finished at step 49" in now.json()["detail"]
        assert _points(client, run_id) == list(range(50))  # nothing was lost
        # The job's own later batches are still stored, and its status still moves.
        later = {"seq": next_seq, "scalars": [{"key": "loss", "steps": [50], "values": [0.01]}]}
        answer = client.post(url, json=later)
        assert (
            answer.status_code == 200
            and answer.json()["points"] == 1
            and "superseded_from" not in answer.json()
        )
        assert _points(client, run_id) == list(range(51))
        # Continuing a finished run after its last step is no rewrite: allowed with the job's token.
        onward = {"seq": _seq(time.time(), 5), "events": [{"step": 51, "kind": "resume"}]}
        assert client.post(url, json=onward).status_code == 200
        assert _points(client, run_id) == list(range(51))
    with _client(api_server, admin) as client:
        # An admin may rewrite the history (a deliberate restart from an earlier checkpoint).
        rewind = {"seq": _seq(time.time(), 9), "events": [{"step": 40, "kind": "resume"}]}
        assert client.post(f"/api/v1/runs/{run_id}/batches", json=rewind).status_code == 200
        assert _points(client, run_id) == list(range(40))


def test_a_batch_cut_by_a_later_resume_says_so(api_server):
    with _client(api_server, None) as client:
        run = client.post("/api/v1/runs", json={"project": "alpha", "name": "crashed"}).json()
        url = f"/api/v1/runs/{run['id']}/batches"
        first = time.time() - 120
        batch = {
            "seq": _seq(first),
            "scalars": [{"key": "loss", "steps": [0, 1, 2], "values": [3.0, 2.0, 1.0]}],
        }
        assert client.post(url, json=batch).status_code == 200
        resumed = {"seq": _seq(time.time()), "events": [{"step": 2, "kind": "resume"}]}
        assert client.post(url, json=resumed).status_code == 200
        late = {"seq": _seq(first, 1), "scalars": [{"key": "loss", "steps": [3, 4], "values": [0.5, 0.4]}]}
        answer = client.post(url, json=late)
        assert answer.status_code == 200 and answer.json()["superseded_from"] == 2
        assert _points(client, run["id"]) == [0, 1]


def _raw_post(client: httpx.Client, path: str, body: str) -> httpx.Response:
    """A JSON body written by hand: a lone surrogate escape (\\ud800) as a client may send it."""
    return client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


def test_one_lone_surrogate_is_refused_and_cannot_break_a_project(api_server):
    with _client(api_server, None) as client:
        before = client.get("/api/v1/runs", params={"project": "alpha"}).json()["count"]
        refused = _raw_post(client, "/api/v1/runs", '{"project": "alpha", "config": {"note": "x\\ud800"}}')
        assert refused.status_code == 422 and "lone surrogate" in refused.text
        listing = client.get("/api/v1/runs", params={"project": "alpha"})
        assert listing.status_code == 200 and listing.json()["count"] == before  # nothing was stored
        run = client.post("/api/v1/runs", json={"project": "alpha", "name": "ok"}).json()
        url = f"/api/v1/runs/{run['id']}/batches"
        event = '{"seq": 1, "events": [{"step": 0, "kind": "note", "data": {"text": ["\\udc00"]}}]}'
        assert _raw_post(client, url, event).status_code == 422
        crash = (
            '{"seq": 2, "status": "crashed", "events": [{"step": 0, "kind": "crash", '
            '"data": {"type": "ValueError", "message": "bad \\ud83d"}}]}'
        )
        assert _raw_post(client, url, crash).status_code == 422
        # A proper pair (an emoji) is text like any other.
        fine = '{"seq": 3, "events": [{"step": 0, "kind": "note", "data": {"text": "\\ud83d\\ude00"}}]}'
        assert _raw_post(client, url, fine).status_code == 200
        events = client.get(f"/api/v1/runs/{run['id']}/events")
        assert events.status_code == 200 and events.json()["data"][0]["data"]["text"] == "\U0001f600"


def test_a_lone_surrogate_an_earlier_version_stored_still_renders(api_server, database_url):
    # What a database written before the check holds: read back, answered as an escape, not a 500.
    from gradwatch.server.database import make_engine
    from gradwatch.server.schemas import RunIn
    from gradwatch.server.storage import Store

    engine = make_engine(database_url)
    try:
        run = RunIn.model_construct(project="legacy", name="old", config={"note": "x\ud800"})
        stored = Store(engine).create_run(run)
    finally:
        engine.dispose()
    with _client(api_server, None) as client:
        listing = client.get("/api/v1/runs", params={"project": "legacy"})
        assert listing.status_code == 200, listing.text
        assert "\\ud800" in listing.text and listing.json()["data"][0]["id"] == stored.id


def test_an_empty_body_is_a_clear_422_not_a_500(api_server):
    with _client(api_server, None) as client:
        run = client.post("/api/v1/runs", json={"project": "alpha", "name": "empty"}).json()
        for path in (f"/api/v1/runs/{run['id']}/batches", "/api/v1/runs"):
            answer = client.post(path, content=b"", headers={"Content-Type": "application/json"})
            assert answer.status_code == 422, (path, answer.status_code, answer.text)
            assert "body" in answer.text


@pytest.mark.postgres
def test_a_read_only_postgresql_answers_503_and_keeps_what_it_has(postgres_url):
    import psycopg
    from conftest import free_port
    from sqlalchemy.engine import make_url

    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    url = make_url(postgres_url)
    database = url.database
    admin = psycopg.connect(
        url.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False),
        autocommit=True,
    )
    server = BackgroundServer(
        Settings(database_url=postgres_url), "127.0.0.1", free_port(), with_dashboard=False
    ).start()
    engine = server.server.config.app.state.store.engine
    try:
        with _client(server, None) as client:
            run = client.post("/api/v1/runs", json={"project": "alpha", "name": "ro"}).json()
            url_batches = f"/api/v1/runs/{run['id']}/batches"
            first = {"seq": 1, "scalars": [{"key": "loss", "steps": [0], "values": [1.0]}]}
            assert client.post(url_batches, json=first).status_code == 200
            admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
            engine.dispose()  # new connections take the setting (a failover to a standby)
            second = {"seq": 2, "scalars": [{"key": "loss", "steps": [1], "values": [0.5]}]}
            refused = client.post(url_batches, json=second)
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"] and "read-only" in refused.json()["detail"]
            assert _points(client, run["id"]) == [0]  # reads still work
            admin.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
            engine.dispose()
            assert client.post(url_batches, json=second).status_code == 200  # the agent's retry
            assert _points(client, run["id"]) == [0, 1]
    finally:
        admin.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        admin.close()
        server.stop()
