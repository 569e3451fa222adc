"""The live WebSocket (/api/v1/runs/{id}/live) against real uvicorn servers on 127.0.0.1: one server
on a SQLite file and on PostgreSQL; two servers (in-process, and `gradwatch server` subprocesses) on
one PostgreSQL database, where every process's viewers see every point through LISTEN/NOTIFY."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from conftest import free_port, server_process
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

# Wait this long at most, so that a broken stream fails instead of hanging. How soon a point arrives
# (the promise: within a second of its POST returning) is measured by bench/live_latency.py, not here:
# on a loaded 2-core CI machine a healthy server can be starved for a second.
RECEIVE_S = 10.0


def _ws_url(http_url: str, run_id: str, **params: Any) -> str:
    query = urlencode(params, doseq=True)
    url = f"ws://{http_url.removeprefix('http://')}/api/v1/runs/{run_id}/live"
    return f"{url}?{query}" if query else url


def _connect(http_url: str, run_id: str, **kwargs: Any) -> ClientConnection:
    params = kwargs.pop("params", {})
    url = _ws_url(http_url, run_id, **params)
    return connect(url, proxy=None, open_timeout=10, close_timeout=2, **kwargs)  # proxy=None: loopback only


class Viewer:
    """A WebSocket client that records what it received; points by (key, rank) in arrival order."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.points: dict[tuple[str, int], list[tuple[int, Any]]] = defaultdict(list)
        self.events: list[dict[str, Any]] = []
        self.statuses: list[dict[str, Any]] = []

    def receive(self, timeout: float = RECEIVE_S) -> dict[str, Any]:
        message = json.loads(self.ws.recv(timeout=timeout))
        if message["type"] == "points":
            assert len(message["steps"]) == len(message["values"]) > 0, message
            self.points[(message["key"], message["rank"])].extend(
                zip(message["steps"], message["values"], strict=True)
            )
        elif message["type"] == "events":
            self.events.extend(message["data"])
        else:
            assert message["type"] == "status", message
            self.statuses.append(message)
        return message

    def point_count(self) -> int:
        return sum(len(points) for points in self.points.values())

    def wait_for(self, points: int = 0, events: int = 0, timeout: float = RECEIVE_S) -> None:
        deadline = time.monotonic() + timeout
        while self.point_count() < points or len(self.events) < events:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"received {self.point_count()}/{points} points and {len(self.events)}/{events} events "
                    f"within {timeout} s"
                )
            self.receive(remaining)

    def assert_quiet(self, seconds: float = 0.3) -> None:
        """Nothing but status messages arrives for a while (no doubles, nothing filtered out)."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                message = self.receive(remaining)
            except TimeoutError:
                return
            assert message["type"] == "status", message


@contextlib.contextmanager
def viewer(http_url: str, run_id: str, **params: Any) -> Iterator[Viewer]:
    """A connected viewer whose subscription is live (its first status message has arrived)."""
    with _connect(http_url, run_id, params=params) as ws:
        watching = Viewer(ws)
        assert watching.receive()["type"] == "status"
        yield watching


def _create_run(url: str, run_id: str, project: str = "live") -> None:
    response = httpx.post(f"{url}/api/v1/runs", json={"id": run_id, "project": project}, timeout=30)
    assert response.status_code == 201, response.text


def _post(url: str, run_id: str, batch: dict[str, Any], client: httpx.Client | None = None) -> dict[str, Any]:
    body = json.dumps(batch)  # JSON's NaN/Infinity literals, as the agent sends them
    post = client.post if client is not None else httpx.post
    response = post(
        f"{url}/api/v1/runs/{run_id}/batches",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()


def _scalars(
    seq: int, steps: range | list[int], rank: int = 0, keys: tuple[str, ...] = ("loss",), **extra: Any
) -> dict[str, Any]:
    """An agent batch: `keys` at `steps` of one rank, with _value's values."""
    scalars = [
        {"key": key, "steps": list(steps), "values": [_value(key, rank, step) for step in steps]}
        for key in keys
    ]
    return {"seq": seq, "rank": rank, "scalars": scalars, **extra}


def _value(key: str, rank: int, step: int) -> float:
    """A distinct value per point, with all 17 digits; every 7th step non-finite."""
    if step % 7 == 3:
        return (math.nan, math.inf, -math.inf)[(step + rank) % 3]
    return step * 1.001 + rank / 7 + len(key) / 1024


def _wire(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _expected(keys: tuple[str, ...], ranks: tuple[int, ...], steps: range) -> dict[tuple[str, int], list]:
    return {(key, rank): [(s, _wire(_value(key, rank, s))) for s in steps] for key in keys for rank in ranks}


# -- reading what is new, without a server ---------------------------------------------------------


def test_a_backlog_is_read_in_pieces_each_point_once_in_step_order(database_url):
    from gradwatch.server.database import make_engine, prepare_schema
    from gradwatch.server.schemas import BatchIn, RunIn
    from gradwatch.server.storage import Store

    engine = make_engine(database_url)
    try:
        prepare_schema(engine, database_url)
        store = Store(engine)
        store.create_run(RunIn(id="run-1", project="live"))
        keys, ranks = ("loss", "lr", "amp/scale"), (0, 1, 2)
        for rank in ranks:
            for seq, steps in enumerate((range(30), range(30, 50))):
                store.ingest(
                    "run-1",
                    BatchIn.model_validate(
                        _scalars(
                            seq, steps, rank=rank, keys=keys, events=[{"step": steps[-1], "kind": "skip"}]
                        )
                    ),
                )
        received: dict[tuple[str, int], list] = defaultdict(list)
        events = []
        cursor = store.live.open_cursor("run-1", None, None, since=9)
        for _ in range(100):
            update = store.live.read_new(cursor, max_points=7, max_events=2)
            for chunk in update.points:
                assert 0 < len(chunk.steps) <= 7
                received[(chunk.key, chunk.rank)].extend(
                    zip(chunk.steps, map(_wire, chunk.values), strict=True)
                )
            events.extend((event.rank, event.step) for event in update.events)
            if not update.more:
                break
        assert dict(received) == _expected(keys, ranks, range(10, 50))
        assert sorted(events) == [(rank, step) for rank in ranks for step in (29, 49)]
        empty = store.live.read_new(cursor)
        assert (empty.points, empty.events, empty.more) == ([], [], False)
    finally:
        engine.dispose()


# -- one server: SQLite file and PostgreSQL ---------------------------------------------------------


def test_points_events_and_status_arrive_in_order_with_exact_values(api_server):
    _create_run(api_server.url, "run-1")
    with viewer(api_server.url, "run-1") as watching:
        batch = {
            "seq": 0,
            "scalars": [
                {
                    "key": "loss",
                    "steps": [0, 1, 2, 3, 4],
                    "values": [1.5, math.nan, math.inf, -math.inf, 5e-324],
                }
            ],
            "events": [{"step": 2, "kind": "skip", "data": {"scale_before": 65536.0, "layers": ["a.w"]}}],
        }
        _post(api_server.url, "run-1", batch)
        assert watching.receive() == {
            "type": "points",
            "key": "loss",
            "rank": 0,
            "steps": [0, 1, 2, 3, 4],
            "values": [1.5, "NaN", "Infinity", "-Infinity", 5e-324],
        }
        skip = {"step": 2, "kind": "skip", "rank": 0, "data": batch["events"][0]["data"]}
        assert watching.receive() == {"type": "events", "data": [skip]}
        assert watching.receive() == {"type": "status", "status": "running", "last_step": 4}

        _post(api_server.url, "run-1", _scalars(1, [5], keys=("loss", "grad/global_norm"), status="finished"))
        watching.wait_for(points=7)
        assert watching.points[("grad/global_norm", 0)] == [(5, _wire(_value("grad/global_norm", 0, 5)))]
        assert watching.receive() == {"type": "status", "status": "finished", "last_step": 5}
        _post(api_server.url, "run-1", _scalars(1, [5]))  # a retried batch: acknowledged, not stored again
        watching.assert_quiet()


def test_the_first_status_message_describes_the_run(api_server):
    _create_run(api_server.url, "run-1")
    _post(api_server.url, "run-1", _scalars(0, range(10)))
    with _connect(api_server.url, "run-1") as ws:
        first = json.loads(ws.recv(timeout=RECEIVE_S))
    assert first == {"type": "status", "status": "running", "last_step": 9}


def test_key_rank_and_since_select_what_is_sent(api_server):
    url = api_server.url
    _create_run(url, "run-1")
    for rank in (0, 1):
        _post(
            url,
            "run-1",
            _scalars(
                0,
                range(10),
                rank=rank,
                keys=("loss", "lr"),
                events=[{"step": 2, "kind": "skip"}, {"step": 8, "kind": "skip"}],
            ),
        )
    with (
        viewer(url, "run-1", key="loss", since=4) as loss_since_4,
        viewer(url, "run-1", rank=1, since=-1) as rank_1,
        viewer(url, "run-1", key=["lr", "grad/global_norm"]) as lr_and_norm,
        viewer(url, "run-1") as everything,
    ):
        loss_since_4.wait_for(points=10, events=2)  # history after step 4, both ranks
        assert dict(loss_since_4.points) == _expected(("loss",), (0, 1), range(5, 10))
        assert [(e["step"], e["rank"]) for e in loss_since_4.events] == [(8, 0), (8, 1)]
        rank_1.wait_for(points=20, events=2)  # the whole run, rank 1 only
        assert dict(rank_1.points) == _expected(("loss", "lr"), (1,), range(10))
        assert [(e["step"], e["rank"]) for e in rank_1.events] == [(2, 1), (8, 1)]
        for watching in (lr_and_norm, everything):  # no since: nothing of what was stored before
            watching.assert_quiet()
            assert watching.point_count() == 0 and watching.events == []

        # New steps of both ranks; a key that is new; rank 0 lagging behind rank 1.
        _post(url, "run-1", _scalars(1, range(10, 13), rank=1, keys=("loss", "lr", "grad/global_norm")))
        _post(
            url,
            "run-1",
            _scalars(
                1,
                range(10, 12),
                rank=0,
                keys=("loss", "lr", "grad/global_norm"),
                events=[{"step": 11, "kind": "skip"}],
            ),
        )
        everything.wait_for(points=15, events=1)
        assert dict(everything.points) == (
            _expected(("loss", "lr", "grad/global_norm"), (1,), range(10, 13))
            | _expected(("loss", "lr", "grad/global_norm"), (0,), range(10, 12))
        )
        lr_and_norm.wait_for(points=10, events=1)
        assert lr_and_norm.events == [{"step": 11, "kind": "skip", "rank": 0, "data": {}}]
        assert dict(lr_and_norm.points) == (
            _expected(("lr", "grad/global_norm"), (1,), range(10, 13))
            | _expected(("lr", "grad/global_norm"), (0,), range(10, 12))
        )
        loss_since_4.wait_for(points=15, events=3)
        assert loss_since_4.points[("loss", 0)] == _expected(("loss",), (0,), range(5, 12))[("loss", 0)]
        assert loss_since_4.points[("loss", 1)] == _expected(("loss",), (1,), range(5, 13))[("loss", 1)]
        rank_1.wait_for(points=29)
        assert set(rank_1.points) == {("loss", 1), ("lr", 1), ("grad/global_norm", 1)}
        for watching in (loss_since_4, rank_1, lr_and_norm, everything):
            watching.assert_quiet()
        assert len(rank_1.events) == 2


def test_unknown_run_and_bad_parameters_close_with_a_reason(api_server):
    cases = [
        ("nope", {}, 4404, "run 'nope' does not exist"),
        ("run-1", {"rank": -1}, 4400, "rank must be between 0 and 2**62, not -1"),
        ("run-1", {"since": "yesterday"}, 4400, "since must be an integer, not 'yesterday'"),
        ("run-1", {"keys": "loss"}, 4400, "unknown query parameter 'keys'; expected key, rank, since, token"),
        ("run-1", {"rank": [0, 1]}, 4400, "rank may be given once, not 2 times"),
    ]
    _create_run(api_server.url, "run-1")
    for run_id, params, code, reason in cases:
        with _connect(api_server.url, run_id, params=params) as ws, pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=RECEIVE_S)
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (code, reason)


def test_a_server_with_tokens_streams_only_to_readers_of_the_project(database_url, api_server):
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine

    engine = make_engine(database_url)
    try:
        tokens = Tokens(engine)
        write = tokens.create("alpha", "ingest")[1]
        read = tokens.create("alpha", "read")[1]
        other = tokens.create("beta", "read")[1]
        revoked_record, revoked = tokens.create("alpha", "read")
        tokens.revoke(revoked_record.id)
    finally:
        engine.dispose()
    url = api_server.url
    created = httpx.post(
        f"{url}/api/v1/runs",
        json={"id": "run-1", "project": "alpha"},
        headers={"Authorization": f"Bearer {write}"},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    refused = [
        ({}, {}, 4401, "this server requires a token"),
        ({"token": revoked}, {}, 4401, "the token is not recognised or has been revoked"),
        ({}, {"Authorization": "Basic abc"}, 4401, "the Authorization header must be 'Bearer <token>'"),
        ({"token": other}, {}, 4404, "run 'run-1' does not exist"),  # another project's: as if absent
    ]
    for params, headers, code, reason in refused:
        with (
            _connect(url, "run-1", params=params, additional_headers=headers) as ws,
            pytest.raises(ConnectionClosed) as closed,
        ):
            ws.recv(timeout=RECEIVE_S)
        assert closed.value.rcvd.code == code and closed.value.rcvd.reason.startswith(reason), closed.value
    with _connect(url, "nope", params={"token": read}) as ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=RECEIVE_S)
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4404, "run 'nope' does not exist")

    with (
        viewer(url, "run-1", token=read) as by_query,
        _connect(url, "run-1", additional_headers={"Authorization": f"Bearer {read}"}) as ws,
    ):
        by_header = Viewer(ws)
        assert by_header.receive()["type"] == "status"
        response = httpx.post(
            f"{url}/api/v1/runs/run-1/batches",
            json=_scalars(0, [0, 1]),
            headers={"Authorization": f"Bearer {write}"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        for watching in (by_query, by_header):
            watching.wait_for(points=2)
            assert dict(watching.points) == _expected(("loss",), (0,), range(2))


def test_a_deleted_run_closes_its_streams(api_server):
    api_server.server.config.app.state.live.refresh_interval_s = 0.2  # deletion sends no notification
    _create_run(api_server.url, "run-1")
    with _connect(api_server.url, "run-1") as ws:
        assert json.loads(ws.recv(timeout=RECEIVE_S))["type"] == "status"
        assert httpx.delete(f"{api_server.url}/api/v1/runs/run-1").status_code == 204
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=RECEIVE_S)
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4404, "run 'run-1' was deleted")


def test_a_client_that_does_not_read_blocks_neither_ingest_nor_other_viewers(api_server):
    url = api_server.url
    _create_run(url, "run-1")
    steps_per_batch, batches = 25_000, 8  # 5 MB of JSON: more than the server's socket buffers hold (4 MB)
    total = steps_per_batch * batches
    # A small receive buffer, no compression and a one-message queue: the client stops reading at once.
    small = socket.socket()
    small.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16_384)  # before connecting: no autotuning
    small.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    # ping_interval=None: a client that reads nothing also answers no pings; its own keepalive would
    # close it after ~40 s, which says nothing about the server.
    with (
        _connect(
            url, "run-1", sock=small, compression=None, max_queue=1, max_size=None, ping_interval=None
        ) as stalled,
        viewer(url, "run-1", key="progress") as reader,
        httpx.Client(timeout=30) as client,
    ):
        stalled.recv(timeout=RECEIVE_S)  # its subscription is live; from now on it reads nothing
        for seq in range(batches):
            # A key no alert rule reads: this test is about streaming, not about rule evaluation's cost.
            batch = _scalars(seq, range(seq * steps_per_batch, (seq + 1) * steps_per_batch), keys=("bulk",))
            batch["scalars"].append({"key": "progress", "steps": [seq], "values": [seq]})
            _post(url, "run-1", batch, client)
            reader.wait_for(points=seq + 1)  # the other viewer keeps up, batch by batch
        hub = api_server.server.config.app.state.live
        assert hub.subscriber_count("run-1") == 2
        # The stalled client's backlog was never queued on the server: it is read from the database
        # whenever it can be sent, so reading late still gives every point once.
        late = Viewer(stalled)
        late.wait_for(points=total + batches, timeout=60)
        late.assert_quiet()
        assert late.points[("bulk", 0)] == _expected(("bulk",), (0,), range(total))[("bulk", 0)]
        assert late.points[("progress", 0)] == [(seq, seq) for seq in range(batches)]
    deadline = time.monotonic() + RECEIVE_S
    while hub.subscriber_count() and time.monotonic() < deadline:  # both streams ended cleanly
        time.sleep(0.05)
    assert hub.subscriber_count() == 0


# -- several server processes on one PostgreSQL database ---------------------------------------------


def _in_process_server(database_url: str):
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    settings = Settings(database_url=database_url)
    return BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False)


@pytest.mark.postgres
def test_notify_reaches_the_other_server_and_survives_a_dropped_listener(postgres_url):
    """Two servers with the safety-net refresh off: what reaches the other server's viewer came by
    NOTIFY; after the listeners' connections are killed they reconnect and streaming goes on."""
    import psycopg

    first = _in_process_server(postgres_url).start()
    second = _in_process_server(postgres_url).start()
    try:
        hubs = [server.server.config.app.state.live for server in (first, second)]
        for hub in hubs:
            hub.refresh_interval_s = 3600.0
            assert hub.relay is not None and hub.relay.connected.wait(RECEIVE_S)
        _create_run(first.url, "run-1")
        with viewer(first.url, "run-1") as on_first, viewer(second.url, "run-1") as on_second:
            _post(second.url, "run-1", _scalars(0, range(3)))
            _post(first.url, "run-1", _scalars(0, range(3), rank=1))
            for watching in (on_first, on_second):
                watching.wait_for(points=6)
                assert dict(watching.points) == _expected(("loss",), (0, 1), range(3))

            conninfo = postgres_url.replace("postgresql+psycopg://", "postgresql://")
            with psycopg.connect(conninfo, autocommit=True) as admin:
                killed = admin.execute(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'gradwatch-live' AND datname = current_database()"
                ).fetchone()
            assert killed == (2,)
            # Whatever is stored while nobody listens is read when the listeners are back…
            _post(first.url, "run-1", _scalars(1, range(3, 6)))
            for watching in (on_first, on_second):
                watching.wait_for(points=9)
            # …and from then on NOTIFY works again.
            for hub in hubs:
                assert hub.relay.connected.wait(RECEIVE_S)
            _post(second.url, "run-1", _scalars(1, range(3, 6), rank=1))
            for watching in (on_first, on_second):
                watching.wait_for(points=12)
                assert dict(watching.points) == _expected(("loss",), (0, 1), range(6))
                watching.assert_quiet()
    finally:
        second.stop()
        first.stop()


@pytest.mark.postgres
def test_two_server_processes_stream_every_point_exactly_once(postgres_url, tmp_path):
    keys, ranks, batches, steps_per_batch = ("loss", "lr", "amp/scale"), (0, 1, 2, 3), 25, 4
    # The first server migrates the empty database before the second starts.
    with server_process(postgres_url, tmp_path) as first, server_process(postgres_url, tmp_path) as second:
        urls = (first, second)
        _create_run(first, "job")
        _create_run(second, "other")
        with (
            viewer(first, "job") as on_first,
            viewer(second, "job") as on_second,
            viewer(first, "other") as other_run,
        ):

            def agent(rank: int) -> None:
                """Rank r posts to server r % 2, and every 5th batch once more to the other
                server, as a retry after a lost acknowledgement would."""
                with httpx.Client(timeout=30) as client:
                    for seq in range(batches):
                        steps = range(seq * steps_per_batch, (seq + 1) * steps_per_batch)
                        events = [{"step": steps[-1], "kind": "skip"}] if seq % 4 == 0 else []
                        batch = _scalars(seq, steps, rank=rank, keys=keys, events=events)
                        assert not _post(urls[rank % 2], "job", batch, client)["duplicate"]
                        if seq % 5 == 0:
                            assert _post(urls[1 - rank % 2], "job", batch, client)["duplicate"]

            failures: list[BaseException] = []

            def run_agent(rank: int) -> None:
                try:
                    agent(rank)
                except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                    failures.append(exc)

            agents = [threading.Thread(target=run_agent, args=(rank,)) for rank in ranks]
            for thread in agents:
                thread.start()
            for thread in agents:
                thread.join(120)
            assert not failures, failures
            total_steps = range(batches * steps_per_batch)
            expected = _expected(keys, ranks, total_steps)
            expected_events = Counter(
                (rank, seq * steps_per_batch + steps_per_batch - 1)
                for rank in ranks
                for seq in range(0, batches, 4)
            )
            for watching in (on_first, on_second):
                watching.wait_for(
                    points=len(keys) * len(ranks) * len(total_steps),
                    events=sum(expected_events.values()),
                    timeout=30,
                )
                watching.assert_quiet(0.5)
                assert dict(watching.points) == expected  # each point once, in step order
                assert Counter((e["rank"], e["step"]) for e in watching.events) == expected_events
                assert watching.statuses[-1] == {
                    "type": "status",
                    "status": "running",
                    "last_step": total_steps[-1],
                }
            assert other_run.point_count() == 0 and other_run.events == []

        with httpx.Client(base_url=second, timeout=30) as client:  # and the database has each point once
            for key in keys:
                for rank in ranks:
                    series = client.get(
                        "/api/v1/runs/job/series", params={"key": key, "rank": rank, "max_points": 10_000}
                    ).json()
                    assert list(zip(series["steps"], series["values"], strict=True)) == expected[(key, rank)]
            events = client.get("/api/v1/runs/job/events").json()
            assert Counter((e["rank"], e["step"]) for e in events["data"]) == expected_events


def test_revoking_a_token_closes_its_open_streams(database_url, api_server):
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine

    engine = make_engine(database_url)
    tokens = Tokens(engine)
    write = tokens.create("alpha", "ingest")[1]
    record, read = tokens.create("alpha", "read")
    created = httpx.post(
        f"{api_server.url}/api/v1/runs",
        json={"id": "run-1", "project": "alpha"},
        headers={"Authorization": f"Bearer {write}"},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    with _connect(api_server.url, "run-1", params={"token": read}) as ws:
        assert json.loads(ws.recv(timeout=RECEIVE_S))["type"] == "status"
        tokens.revoke(record.id)
        engine.dispose()
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=RECEIVE_S)  # within ACCESS_RECHECK_S (2 s), not RECEIVE_S
    assert closed.value.rcvd.code == 4401 and "revoked" in closed.value.rcvd.reason


def test_the_dashboards_doorbell_tells_the_signed_in_reader_status_and_events_but_no_points(database_url):
    """/dashboard/live/{run} (the run page's doorbell) authenticates with the dashboard's sign-in cookie,
    as /api/v1/runs/{run}/live does with a token; it sends status changes and events, never points; a
    page of another site cannot open it."""
    from websockets.exceptions import InvalidStatus

    from gradwatch.dashboard.pages.signin import COOKIE
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(Settings(database_url=database_url), "127.0.0.1", free_port()).start()
    engine = make_engine(database_url)
    try:
        tokens = Tokens(engine)
        write = tokens.create("alpha", "ingest")[1]
        read = tokens.create("alpha", "read")[1]
        other = tokens.create("beta", "read")[1]
        url = server.url
        bearer = {"Authorization": f"Bearer {write}"}
        created = httpx.post(f"{url}/api/v1/runs", json={"id": "run-1", "project": "alpha"}, headers=bearer)
        assert created.status_code == 201, created.text
        doorbell = f"ws://{url.removeprefix('http://')}/dashboard/live/run-1"

        def ring(cookie: str | None = None, **headers: str) -> ClientConnection:
            if cookie is not None:
                headers["Cookie"] = f"{COOKIE}={cookie}"
            return connect(doorbell, proxy=None, open_timeout=10, close_timeout=2, additional_headers=headers)

        for cookie, code in ((None, 4401), ("gw_nonsense", 4401), (other, 4404)):
            with ring(cookie) as ws, pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=RECEIVE_S)
            assert closed.value.rcvd.code == code, (cookie, closed.value)
        with pytest.raises(InvalidStatus) as refused:
            ring(read, Origin="http://elsewhere.example").close()
        assert refused.value.response.status_code == 403

        with ring(read) as ws:
            watching = Viewer(ws)
            assert watching.receive() == {"type": "status", "status": "running", "last_step": None}
            batch = _scalars(0, [0, 1, 2], events=[{"step": 2, "kind": "skip", "data": {"scale": 1024.0}}])
            response = httpx.post(f"{url}/api/v1/runs/run-1/batches", json=batch, headers=bearer, timeout=30)
            assert response.status_code == 200, response.text
            watching.wait_for(events=1)
            while not watching.statuses or watching.statuses[-1]["last_step"] != 2:
                watching.receive()
            assert [event["kind"] for event in watching.events] == ["skip"]
            assert watching.point_count() == 0  # the page reads the points itself when rung
    finally:
        engine.dispose()
        server.stop()


def test_the_runs_lists_doorbell_rings_for_the_readers_projects_only(database_url):
    """/dashboard/live (the runs list's doorbell): {"type": "runs"} once open, then when a run of the
    signed-in token's project moves; another project's activity rings nothing; a token that may not
    read is refused."""
    from gradwatch.dashboard.pages.signin import COOKIE
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(Settings(database_url=database_url), "127.0.0.1", free_port()).start()
    engine = make_engine(database_url)
    try:
        tokens = Tokens(engine)
        writes = {project: tokens.create(project, "ingest")[1] for project in ("alpha", "beta")}
        read = tokens.create("alpha", "read")[1]
        url = server.url
        for project in ("alpha", "beta"):
            created = httpx.post(
                f"{url}/api/v1/runs",
                json={"id": f"{project}-run", "project": project},
                headers={"Authorization": f"Bearer {writes[project]}"},
            )
            assert created.status_code == 201, created.text

        def doorbell(cookie: str) -> ClientConnection:
            return connect(
                f"ws://{url.removeprefix('http://')}/dashboard/live",
                proxy=None,
                open_timeout=10,
                close_timeout=2,
                additional_headers={"Cookie": f"{COOKIE}={cookie}"},
            )

        with doorbell(writes["alpha"]) as ws, pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=RECEIVE_S)
        assert closed.value.rcvd.code == 4403  # an ingest token does not read the runs list

        def post(project: str, seq: int) -> None:
            response = httpx.post(
                f"{url}/api/v1/runs/{project}-run/batches",
                json=_scalars(seq, [seq]),
                headers={"Authorization": f"Bearer {writes[project]}"},
                timeout=30,
            )
            assert response.status_code == 200, response.text

        with doorbell(read) as ws:
            assert json.loads(ws.recv(timeout=RECEIVE_S)) == {"type": "runs"}  # open: the list reads now
            for seq in range(3):
                post("beta", seq)
            with pytest.raises(TimeoutError):
                ws.recv(timeout=2.5)  # beta's runs are not alpha's reader's business
            post("alpha", 0)
            assert json.loads(ws.recv(timeout=RECEIVE_S)) == {"type": "runs"}
    finally:
        engine.dispose()
        server.stop()


def test_a_status_never_names_a_step_whose_points_the_same_read_missed(database_url, monkeypatch):
    """A batch that commits in the middle of a live read (between its points and its events, here)
    must not make that read's status announce steps whose points it did not see: on SQLite each
    SELECT has its own snapshot, so the status is read first."""
    from gradwatch.server.database import make_engine, prepare_schema
    from gradwatch.server.schemas import BatchIn, RunIn
    from gradwatch.server.storage import Store
    from gradwatch.server.storage import live as live_reads

    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    try:
        store = Store(engine)
        store.create_run(RunIn(project="p", id="run-1"))
        cursor = store.live.open_cursor("run-1", None, None, None)
        read_events = live_reads._new_events
        committed = []

        def events_after_a_commit(*args: Any, **kwargs: Any) -> Any:
            if not committed:  # another request's batch commits right now
                store.ingest("run-1", BatchIn.model_validate(_scalars(0, [0, 1, 2, 3, 4])))
                committed.append(True)
            return read_events(*args, **kwargs)

        monkeypatch.setattr(live_reads, "_new_events", events_after_a_commit)
        update = store.live.read_new(cursor)
        seen = max((step for chunk in update.points for step in chunk.steps), default=None)
        if update.status is not None and update.status[1] is not None:
            assert seen is not None and update.status[1] <= seen, (update.status, seen)
        monkeypatch.setattr(live_reads, "_new_events", read_events)
        after = store.live.read_new(cursor)  # the next read brings the rest, and then the status
        steps = sorted(s for u in (update, after) for chunk in u.points for s in chunk.steps)
        assert steps == [0, 1, 2, 3, 4] and cursor.status == ("running", 4)
    finally:
        engine.dispose()


def test_a_batch_committed_during_a_read_comes_whole_in_one_message_set(database_url, monkeypatch):
    """A batch of points and events that commits in the middle of a live read (after its points were
    read, before its events) comes whole with the next read, not its events now and its points then:
    a read is one snapshot on SQLite too (pysqlite begins no transaction for SELECTs; seen in CI as an
    events message before the points of its batch)."""
    from gradwatch.server.database import make_engine, prepare_schema
    from gradwatch.server.schemas import BatchIn, RunIn
    from gradwatch.server.storage import Store
    from gradwatch.server.storage import live as live_reads

    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    try:
        store = Store(engine)
        store.create_run(RunIn(project="p", id="run-1"))
        store.ingest("run-1", BatchIn.model_validate(_scalars(0, [0])))
        cursor = store.live.open_cursor("run-1", None, None, None)
        read_events = live_reads._new_events
        batch = _scalars(1, [1, 2, 3]) | {"events": [{"step": 2, "kind": "skip", "data": {}}]}

        def events_after_a_commit(*args: Any, **kwargs: Any) -> Any:
            monkeypatch.setattr(live_reads, "_new_events", read_events)
            store.ingest("run-1", BatchIn.model_validate(batch))  # another request's batch commits now
            return read_events(*args, **kwargs)

        monkeypatch.setattr(live_reads, "_new_events", events_after_a_commit)
        during = store.live.read_new(cursor)
        assert (during.points, during.events) == ([], []), during
        after = store.live.read_new(cursor)
        assert [s for chunk in after.points for s in chunk.steps] == [1, 2, 3]
        assert [(e.step, e.kind) for e in after.events] == [(2, "skip")]
    finally:
        engine.dispose()
