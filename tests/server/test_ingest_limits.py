"""Ingest isolation: per-tenant limits (server.ingest_limits), batch caps, SQLite's write lock
answering 503, the agent honouring Retry-After and splitting batches, and one tenant doing its
worst through the API while another sends small batches like an agent.

The scenario at the end (Victim, Hostile, run_scenario) is shared with bench/ingest_isolation.py,
which runs it with the limits on and off side by side and reports the figures; the test here only
asserts that the victim sees no error and stays within a tolerance of its own baseline.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import math
import multiprocessing
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from conftest import free_port, server_process

from gradwatch._sender import MAX_BATCH_VALUES, Backoff, Sender, split_by_steps
from gradwatch._transport import MAX_RETRY_AFTER, HttpTransport, TransportError, parse_retry_after
from gradwatch._wire import batch_points
from gradwatch.server.ingest_limits import IngestLimited, IngestLimits, batch_size

RUN = {"id": "run-1", "project": "p", "name": "n", "config": {}, "metadata": {}}


def _scalars(first_step: int, steps: int, keys: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "key": key,
            "steps": list(range(first_step, first_step + steps)),
            "values": [0.5 + 0.01 * (s % 7) for s in range(first_step, first_step + steps)],
        }
        for key in keys
    ]


# -- the limiter (a fake clock) ---------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_batch_size_counts_points_as_the_agent_does_and_every_number() -> None:
    document = {
        "scalars": [{"key": "loss", "steps": [1, 2, 3], "values": [1.0, 2.0, 3.0]}],
        "vectors": [{"key": "grad/norm", "steps": [1, 2], "values": [[0.1] * 5, [0.2] * 5]}],
        "histograms": [
            {"key": "grad/hist", "step": 1, "exponent_min": 0, "exponent_max": 0, "counts": [[1, 2, 3]] * 4}
        ],
    }
    assert batch_size(document) == (3 + 2 + 1, 3 + 10 + 12)
    assert batch_size(document)[0] == batch_points(document)
    assert batch_size([1, 2]) == (0, 0)
    assert batch_size({"scalars": "x", "vectors": [7, {"values": 3}]}) == (0, 0)  # shapes left to validation


def test_rate_limit_refuses_with_retry_after_until_the_bucket_can_pay() -> None:
    clock = FakeClock()
    limits = IngestLimits(
        concurrency=0, points_per_s=1000, burst_points=2000, max_batch_points=10_000, clock=clock
    )
    limits.charge("token:1", 1500, 1500)  # a full bucket pays
    with pytest.raises(IngestLimited) as refused:
        limits.charge("token:1", 1500, 1500)  # 500 left
    assert (refused.value.status, refused.value.limit, refused.value.retry_after) == (429, "rate", 1)
    assert "1,000 points/s per token" in refused.value.detail and "retry in 1 s" in refused.value.detail
    with pytest.raises(IngestLimited):  # before the body is read: the last batch cost 1500
        asyncio.run(limits.admit("token:1"))
    clock.now += 1.0
    asyncio.run(limits.admit("token:1"))  # 1500 again
    limits.release("token:1")
    limits.charge("token:1", 1500, 1500)
    limits.charge("token:2", 1500, 1500)  # another tenant's bucket is its own
    # A batch larger than the bucket is taken when the bucket is full, and leaves it in debt.
    clock.now += 10
    limits.charge("token:1", 5000, 5000)
    with pytest.raises(IngestLimited) as refused:
        asyncio.run(limits.admit("token:1"))
    assert refused.value.retry_after == 5  # from -3000 to the 2000 a batch like the last one needs
    response = refused.value.response()
    assert response.status_code == 429 and response.headers["Retry-After"] == "5"
    assert json.loads(response.body) == {"detail": refused.value.detail, "limit": "rate", "retry_after_s": 5}


def test_caps_refuse_413_and_charge_the_refused_batch() -> None:
    clock = FakeClock()
    limits = IngestLimits(
        points_per_s=100, burst_points=1000, max_batch_points=500, max_batch_values=2000, clock=clock
    )
    with pytest.raises(IngestLimited) as refused:
        limits.charge("token:1", 501, 501)
    assert (refused.value.status, refused.value.limit, refused.value.retry_after) == (
        413,
        "batch_points",
        None,
    )
    assert "501 points" in refused.value.detail and "at most 500" in refused.value.detail
    with pytest.raises(IngestLimited) as refused:
        limits.charge("token:1", 10, 2001)
    assert (refused.value.status, refused.value.limit) == (413, "batch_values")
    with pytest.raises(IngestLimited) as refused:  # both were charged: 1000 - 501 - 100 < 100
        limits.charge("token:1", 400, 400)
    assert refused.value.status == 429
    off = IngestLimits(0, 0, 0, 0, 0)
    off.charge("token:1", 10**9, 10**10)  # every limit off
    with pytest.raises(ValueError, match="points_per_s must be a number >= 0"):
        IngestLimits(points_per_s=-1)


def test_a_batch_that_costs_more_cpu_than_its_points_is_charged_the_cpu() -> None:
    from gradwatch.server import ingest_limits

    clock = FakeClock()
    limits = IngestLimits(concurrency=0, points_per_s=1000, burst_points=100_000, clock=clock)
    cost = limits.charge("token:1", 1000, 1000)
    limits.settle("token:1", cost, cpu_s=0.04)  # within the free CPU of a request: nothing more
    limits.settle(
        "token:1", cost, cpu_s=ingest_limits.FREE_CPU_S + 900 / ingest_limits.POINTS_PER_CPU_S
    )  # < its points
    assert limits._tenants["token:1"].balance == 99_000
    limits.settle(
        "token:1", cost, cpu_s=ingest_limits.FREE_CPU_S + 2.0
    )  # the alert rules fired on every step, say
    assert limits._tenants["token:1"].balance == pytest.approx(
        99_000 - (2 * ingest_limits.POINTS_PER_CPU_S - 1000), abs=1e-6
    )
    with pytest.raises(IngestLimited) as refused:
        asyncio.run(limits.admit("token:1"))
    assert f"the last batch cost {2 * ingest_limits.POINTS_PER_CPU_S:,}" in refused.value.detail

    ticket = ingest_limits._Ticket()

    def busy() -> int:
        deadline = time.thread_time() + 0.05
        while time.thread_time() < deadline:
            pass
        return 7

    measured = ingest_limits._measuring(busy)
    assert measured() == 7 and ticket.cpu_s == 0  # no request's ticket in this context
    token = ingest_limits._current_ticket.set(ticket)
    try:
        assert measured() == 7
    finally:
        ingest_limits._current_ticket.reset(token)
    assert 0.05 <= ticket.cpu_s < 1


def test_concurrency_slots_are_handed_to_waiters_in_order_and_a_full_queue_is_refused(monkeypatch) -> None:
    monkeypatch.setattr("gradwatch.server.ingest_limits.QUEUE_PER_SLOT", 4)
    limits = IngestLimits(concurrency=1, points_per_s=0)
    order: list[str] = []

    async def request(name: str, hold: float) -> None:
        try:
            await limits.admit("token:1")
        except IngestLimited as refused:
            order.append(f"{name} refused {refused.limit} {refused.retry_after}")
            return
        order.append(f"{name} in")
        await asyncio.sleep(hold)
        limits.release("token:1")

    async def main() -> None:
        first = asyncio.create_task(request("a", 0.05))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(request(name, 0.0)) for name in "bcde"]  # 4 per slot may wait
        await asyncio.sleep(0)
        await request("f", 0.0)  # the fifth waiter
        await asyncio.gather(first, *waiters)
        await limits.admit("token:2")  # another tenant's slots are its own
        limits.release("token:2")

    asyncio.run(main())
    assert order == ["a in", "f refused concurrency 1", "b in", "c in", "d in", "e in"]
    assert limits._tenants["token:1"].in_flight == 0


def test_a_request_waiting_too_long_for_a_slot_is_refused(monkeypatch) -> None:
    monkeypatch.setattr("gradwatch.server.ingest_limits.QUEUE_WAIT_S", 0.05)
    limits = IngestLimits(concurrency=1, points_per_s=0)

    async def main() -> None:
        await limits.admit("address:10.0.0.1")
        with pytest.raises(IngestLimited) as refused:
            await limits.admit("address:10.0.0.1")
        assert "per client address" in refused.value.detail
        limits.release("address:10.0.0.1")
        await limits.admit("address:10.0.0.1")  # the slot came back, and the given-up waiter is gone

    asyncio.run(main())
    assert not limits._tenants["address:10.0.0.1"].waiters


def test_only_tokens_seen_authenticating_have_a_tenant_of_their_own() -> None:
    limits = IngestLimits()
    assert limits.request_key("Bearer gw_made_up", "10.0.0.7") == "address:10.0.0.7"
    limits.learn("gw_real", "token:42")
    assert limits.request_key("Bearer gw_real", "10.0.0.7") == "token:42"
    assert limits.request_key("Basic abc", "10.0.0.7") == "address:10.0.0.7"  # authentication answers 401


# -- the agent: Retry-After and batches within the caps ----------------------------------------------


def test_parse_retry_after_is_bounded_and_ignores_dates() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("86400") == MAX_RETRY_AFTER
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("nan") is None


class _Answers(BaseHTTPRequestHandler):
    """Answers each POST with the next (status, headers) of the server's `answers`."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, headers = self.server.answers.pop(0) if self.server.answers else (200, {})  # type: ignore[attr-defined]
        body = b'{"detail": "slow down"}' if status >= 400 else b"{}"
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def answering_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Answers)
    server.answers = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def test_http_transport_reads_retry_after_of_429_and_503(answering_server) -> None:
    answering_server.answers += [
        (429, {"Retry-After": "12"}),
        (503, {"Retry-After": "100000"}),
        (500, {"Retry-After": "5"}),
        (429, {}),
    ]
    transport = HttpTransport(f"http://127.0.0.1:{answering_server.server_port}")
    seen = []
    for _ in range(4):
        with pytest.raises(TransportError) as failed:
            transport.send_batch("r", {"rank": 0, "seq": 1, "scalars": []})
        seen.append((failed.value.status, failed.value.retryable, failed.value.retry_after))
    assert seen == [(429, True, 12.0), (503, True, MAX_RETRY_AFTER), (500, True, None), (429, True, None)]


class _LimitedTransport:
    """Refuses the first `refusals` batches with 429 and a Retry-After, then stores them."""

    def __init__(self, refusals: int, retry_after: float) -> None:
        self.refusals = refusals
        self.retry_after = retry_after
        self.attempts: list[float] = []
        self.stored: list[dict[str, Any]] = []

    def create_run(self, run: dict[str, Any]) -> dict[str, Any]:
        return run

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        self.attempts.append(time.monotonic())
        if len(self.attempts) <= self.refusals:
            raise TransportError("POST: HTTP 429: ingest rate limit", True, 429, self.retry_after)
        self.stored.append(batch)
        return {}


def test_sender_waits_the_servers_retry_after_and_drops_nothing(tmp_path) -> None:
    from gradwatch._buffer import StepBuffer
    from gradwatch._spool import Spool

    transport = _LimitedTransport(refusals=2, retry_after=0.6)
    sender = Sender(
        transport, RUN, 0, Spool(tmp_path / "spool.jsonl", RUN, 0), backoff=Backoff(base=0.01, cap=0.01)
    )
    buffer = StepBuffer()
    for step in range(10):
        buffer.add_scalar("loss", step, 1.0 / (step + 1))
    sender.submit(buffer.take([], None))
    assert sender.close(timeout=10)
    waits = [b - a for a, b in zip(transport.attempts, transport.attempts[1:])]
    assert len(waits) == 2 and min(waits) >= 0.6, waits  # backoff alone would have waited ~0.01 s
    stats = sender.stats
    assert (stats.sent, stats.dropped) == (10, 0)
    assert next(s for b in transport.stored for s in b["scalars"] if s["key"] == "loss")["steps"] == list(
        range(10)
    )


def _batch(steps: int, keys: int, layers: int = 0, histogram_every: int = 0) -> dict[str, Any]:
    names = [f"k{i}" for i in range(keys)]
    batch: dict[str, Any] = {
        "scalars": _scalars(0, steps, names),
        "events": [{"step": s, "kind": "skip", "data": {}} for s in range(0, steps, 7)],
    }
    if layers:
        batch["layers"] = [f"layer{i}" for i in range(layers)]
        batch["vectors"] = [
            {
                "key": "grad/norm",
                "steps": list(range(0, steps, 3)),
                "values": [[0.1] * layers for _ in range(0, steps, 3)],
            }
        ]
    if histogram_every:
        batch["histograms"] = [
            {
                "key": "grad/hist",
                "step": s,
                "exponent_min": -2,
                "exponent_max": 2,
                "counts": [[1, 0, 0, 0, 0, 0, 0]] * layers,
            }
            for s in range(0, steps, histogram_every)
        ]
    batch["status"] = "finished"
    return batch


def test_split_by_steps_keeps_each_step_whole_and_every_piece_within_both_caps() -> None:
    batch = _batch(steps=300, keys=5, layers=40, histogram_every=50)
    assert split_by_steps(batch, 10**6, 10**7) == [batch]
    pieces = split_by_steps(batch, max_points=400, max_values=3000)
    assert len(pieces) > 3
    for piece in pieces:
        points, values = batch_size(piece)
        assert points <= 400 and values <= 3000
        assert piece["layers"] == batch["layers"]
    assert all("status" not in piece for piece in pieces[:-1]) and pieces[-1]["status"] == "finished"
    # Each step's keys travel together, and nothing is lost or repeated.
    owner: dict[int, int] = {}
    for index, piece in enumerate(pieces):
        for series in piece["scalars"] + piece.get("vectors", []):
            for step in series["steps"]:
                assert owner.setdefault(step, index) == index
        for item in piece["events"] + piece.get("histograms", []):
            assert owner.setdefault(item["step"], index) == index
    assert sum(batch_size(p)[0] for p in pieces) == batch_size(batch)[0]
    assert sorted(e["step"] for p in pieces for e in p["events"]) == [e["step"] for e in batch["events"]]
    # A single step larger than the caps travels alone.
    wide = {"scalars": _scalars(0, 1, [f"k{i}" for i in range(50)]) + _scalars(1, 1, ["k0"]), "events": []}
    assert [batch_size(p)[0] for p in split_by_steps(wide, max_points=10, max_values=10)] == [50, 1]


def test_sender_seals_a_flush_larger_than_the_caps_into_several_batches() -> None:
    from training import RecordingTransport  # imports torch: not at module level (the scenario's process)

    from gradwatch._buffer import StepBuffer

    transport = RecordingTransport()
    sender = Sender(transport, RUN, 0, max_batch_points=1000)
    buffer = StepBuffer()
    for step in range(50):  # one flush of 50 steps x 60 keys = 3000 points
        for key in range(60):
            buffer.add_scalar(f"k{key}", step, float(step))
    sender.submit(buffer.take([], None))
    assert sender.close(timeout=10)
    assert len(transport.batches) >= 3
    assert all(batch_points(b) <= 1000 for b in transport.batches)
    assert sum(batch_points(b) for b in transport.batches) == 3000
    assert len({b["seq"] for b in transport.batches}) == len(transport.batches)
    assert MAX_BATCH_VALUES <= IngestLimits().max_batch_values  # the agent's batches fit the server's default


# -- a real server: caps, and SQLite's lock answering 503 --------------------------------------------


def post(
    url: str, path: str, body: bytes, token: str | None = None, gzipped: bool = False, timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    """One POST on a new connection: (status, headers, body); (0, {}, error text) when it failed."""
    host, port = url.removeprefix("http://").split(":")
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    except OSError as exc:
        return 0, {}, f"{type(exc).__name__}: {exc}".encode()
    finally:
        connection.close()


def get_json(url: str, path: str, token: str | None = None) -> Any:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def _small_limits(sqlite_url: str) -> Any:
    from gradwatch.server.settings import Settings

    return Settings(
        database_url=sqlite_url,
        max_batch_points=1000,
        max_batch_values=5000,
        max_body_bytes=200_000,
        ingest_points_per_s=100,
        ingest_burst_points=1500,
        alert_worker=False,
    )


@pytest.fixture
def small_limits_server(sqlite_url) -> Iterator[tuple[str, str]]:
    """A server with small limits and a token (rates are metered per token; an open server meters none)."""
    from gradwatch.server.serve import BackgroundServer

    server = BackgroundServer(
        _small_limits(sqlite_url), "127.0.0.1", free_port(), with_dashboard=False
    ).start()
    _, token = server.server.config.app.state.tokens.create("p", "*")
    yield server.url, token
    server.stop()


def test_oversized_batches_are_refused_413_before_anything_is_stored(small_limits_server) -> None:
    url, token = small_limits_server
    assert post(url, "/api/v1/runs", json.dumps({"id": "r", "project": "p"}).encode(), token=token)[0] == 201
    too_many_values = {
        "rank": 0,
        "seq": 1,
        "vectors": [{"key": "grad/norm", "steps": [0, 1], "values": [[0.0] * 3000] * 2}],
    }
    status, _, body = post(
        url,
        "/api/v1/runs/r/batches",
        gzip.compress(json.dumps(too_many_values).encode()),
        gzipped=True,
        token=token,
    )
    assert status == 413 and json.loads(body)["limit"] == "batch_values", body
    assert "6,000 numbers" in json.loads(body)["detail"]
    too_many_points = {"rank": 0, "seq": 2, "scalars": _scalars(0, 1001, ["loss"])}
    status, headers, body = post(
        url, "/api/v1/runs/r/batches", json.dumps(too_many_points).encode(), token=token
    )
    assert status == 413 and json.loads(body)["limit"] == "batch_points", body
    assert "1,001 points" in json.loads(body)["detail"]
    assert get_json(url, "/api/v1/runs/r/series?key=loss", token)["steps"] == []
    assert get_json(url, "/api/v1/runs/r/keys?kind=vector", token)["data"] == []
    # The refused batches were charged (6000 numbers / 20, then 1001 points): 1500 - 1301 < 1001, what the
    # last one cost, so the next is refused before its body is read.
    status, headers, body = post(
        url, "/api/v1/runs/r/batches", json.dumps({"rank": 0, "seq": 3}).encode(), token=token
    )
    assert status == 429 and int(headers["retry-after"]) >= 1 and json.loads(body)["limit"] == "rate", body


def test_bodies_refused_before_they_could_be_counted_cost_their_time(small_limits_server) -> None:
    url, token = small_limits_server
    assert post(url, "/api/v1/runs", json.dumps({"id": "r", "project": "p"}).encode(), token=token)[0] == 201
    bomb = gzip.compress(b'{"rank":0,"seq":1,"scalars":[{"key":"x","steps":[' + b"0," * 500_000 + b"0]}]}")
    answers = [post(url, "/api/v1/runs/r/batches", bomb, gzipped=True, token=token) for _ in range(30)]
    assert answers[0][0] == 413 and b"once decompressed" in answers[0][2], answers[0]
    refused = [answer for answer in answers if answer[0] == 429]
    assert refused, [answer[0] for answer in answers]  # inflating each one took the event loop's time
    assert json.loads(refused[0][2])["limit"] == "rate" and int(refused[0][1]["retry-after"]) >= 1


def test_an_open_server_meters_no_rate_but_keeps_the_caps(sqlite_url) -> None:
    """One user on an open local server has no one to be isolated from: a backlog uploads as fast as
    it is stored, while a batch over the caps is still refused."""
    from gradwatch.server.serve import BackgroundServer

    server = BackgroundServer(
        _small_limits(sqlite_url), "127.0.0.1", free_port(), with_dashboard=False
    ).start()
    try:
        assert post(server.url, "/api/v1/runs", json.dumps({"id": "r", "project": "p"}).encode())[0] == 201
        for seq in range(5):  # 5 x 900 points, three times the burst of 1500
            batch = {"rank": 0, "seq": seq, "scalars": _scalars(seq * 900, 900, ["loss"])}
            status, _, body = post(server.url, "/api/v1/runs/r/batches", json.dumps(batch).encode())
            assert status == 200, body
        too_many = {"rank": 0, "seq": 9, "scalars": _scalars(0, 1001, ["loss"])}
        status, _, body = post(server.url, "/api/v1/runs/r/batches", json.dumps(too_many).encode())
        assert status == 413 and json.loads(body)["limit"] == "batch_points", body
    finally:
        server.stop()


def test_a_write_that_waits_too_long_for_sqlites_lock_is_answered_503(tmp_path, monkeypatch) -> None:
    from gradwatch.server import database
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_S", 0.3)
    path = tmp_path / "locked.db"
    server = BackgroundServer(
        Settings(database_url=f"sqlite:///{path}", alert_worker=False),
        "127.0.0.1",
        free_port(),
        with_dashboard=False,
    ).start()
    try:
        assert post(server.url, "/api/v1/runs", json.dumps({"id": "r", "project": "p"}).encode())[0] == 201
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another writer keeps the lock
        try:
            batch = {"rank": 0, "seq": 1, "scalars": _scalars(0, 3, ["loss"])}
            status, headers, body = post(server.url, "/api/v1/runs/r/batches", json.dumps(batch).encode())
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert status == 503 and headers["retry-after"] == "2", body
        assert "busy" in json.loads(body)["detail"]
        status, _, body = post(server.url, "/api/v1/runs/r/batches", json.dumps(batch).encode())  # the retry
        assert status == 200, body
    finally:
        server.stop()


# -- the scenario: a victim tenant and a hostile one -------------------------------------------------

RULE_KEYS = ["loss", "lr", "amp/scale", "amp/skipped", "grad/global_norm"]  # what the default rules read


@dataclass
class Sample:
    at: float  # seconds since the scenario started
    latency: float
    status: int | None
    error: str | None = None


class Victim(threading.Thread):
    """Another project's agent: one small batch (`points` points) every `interval` seconds through
    the agent's own HttpTransport, each answer's latency and status recorded."""

    def __init__(
        self, url: str, token: str | None, run_id: str, interval: float = 0.25, points: int = 1
    ) -> None:
        super().__init__(name="victim", daemon=True)
        self.transport = HttpTransport(url, token)
        self.run_id = run_id
        self.interval = interval
        self.points = points
        self.samples: list[Sample] = []
        self.started_at = time.monotonic()
        self.stop = threading.Event()

    def run(self) -> None:
        step = 0
        next_send = time.monotonic()
        while not self.stop.is_set():
            batch = {
                "rank": 0,
                "seq": step,
                "scalars": [
                    {
                        "key": "loss",
                        "steps": [step + i for i in range(self.points)],
                        "values": [1.0 / (step + 1)] * self.points,
                    }
                ],
            }
            began = time.monotonic()
            status: int | None = 200
            error = None
            try:
                self.transport.send_batch(self.run_id, batch)
            except TransportError as exc:
                status, error = exc.status, str(exc)[:200]
            self.samples.append(Sample(began - self.started_at, time.monotonic() - began, status, error))
            step += self.points
            next_send = max(next_send + self.interval, time.monotonic())
            self.stop.wait(next_send - time.monotonic())

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.at < end]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


@dataclass
class Summary:
    samples: int
    p50: float
    p95: float
    worst: float
    errors: int
    server_errors: int

    @classmethod
    def of(cls, samples: list[Sample]) -> Summary:
        latencies = [s.latency for s in samples]
        return cls(
            len(samples),
            percentile(latencies, 0.5),
            percentile(latencies, 0.95),
            max(latencies, default=math.nan),
            sum(1 for s in samples if s.error is not None or s.status != 200),
            sum(1 for s in samples if s.status is not None and s.status >= 500),
        )


def _json_array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def healthy(key: str, step: int) -> float:
    """`key` at `step` in a healthy fp16 run (no alert rule fires on it), as bench/server_ingest.py has it."""
    wiggle = 0.05 * math.sin(0.1 * step + len(key))
    return {
        "loss": 2.0 + 8.0 / (1.0 + step / 500) + wiggle,
        "lr": 3e-4,
        "amp/scale": 65536.0 * 2.0 ** (step // 2000),
        "amp/skipped": 0.0,
    }.get(key, 0.8 * (1.0 + wiggle))


def firing(key: str, step: int) -> float:
    """`key` at `step` in a run whose every optimizer step is skipped: rules fire on each of them."""
    return 1.0 if key == "amp/skipped" else 0.8 * (1.0 + 0.05 * math.sin(0.1 * step + len(key)))


def scalar_body(
    rank: int, first_step: int, points: int, keys: list[str], value: Any = healthy
) -> tuple[bytes, bytes]:
    """A batch of `points` scalar points over `keys` as JSON text around its seq: (before, after)."""
    steps = points // len(keys)
    step_text = _json_array([str(s) for s in range(first_step, first_step + steps)])
    series = []
    for key in keys:
        values = [repr(value(key, s)) for s in range(first_step, first_step + steps)]
        series.append(f'{{"key":{json.dumps(key)},"steps":{step_text},"values":{_json_array(values)}}}')
    return f'{{"rank":{rank},"seq":'.encode(), f',"scalars":{_json_array(series)}}}'.encode()


def vector_body(rank: int, first_step: int, rows: int, width: int) -> tuple[bytes, bytes]:
    """A batch of per-layer vectors of zeros: `rows` points, rows x width numbers (the cheapest JSON
    per number, the dearest to validate)."""
    row = _json_array(["0"] * width)
    steps = _json_array([str(s) for s in range(first_step, first_step + rows)])
    return (
        f'{{"rank":{rank},"seq":'.encode(),
        f',"vectors":[{{"key":"grad/norm","steps":{steps},"values":{_json_array([row] * rows)}}}]}}'.encode(),
    )


@dataclass
class Hostile:
    """A tenant doing its worst through the API for `seconds`: `max_workers` threads posting batches
    at the server's caps back to back (scalars of the keys the alert rules read, on rank 0 and others;
    one thread per-layer vectors at the numbers cap), one posting oversized batches (over the points
    cap, and a gzip body inflating past the byte limit), `swarm` threads of concurrent medium batches,
    and an alert rule with the largest windows. It ignores Retry-After. Its values are a healthy run's
    unless `firing`: then rank 0 skips every step and the alert rules fire on each (the alert engine
    writes per firing step inside the batch's transaction: see bench/ingest_isolation.py --firing)."""

    url: str
    token: str | None
    run_id: str
    max_batch_points: int = 100_000
    max_batch_values: int = 2_000_000
    max_body_bytes: int = 32 * 1024 * 1024
    max_workers: int = 3
    swarm: int = 8
    firing: bool = False  # rank 0's batches skip every step, so that alert rules fire on each one
    statuses: Counter[int] = field(default_factory=Counter)
    retry_after: list[str] = field(default_factory=list)
    limits_named: Counter[str] = field(default_factory=Counter)
    accepted_points: int = 0
    rule_status: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def prepare(self) -> None:
        """Build every body before the clock starts (the client must not compete for the CPU)."""
        steps_per_body = self.max_batch_points // len(RULE_KEYS)
        self.bodies: dict[str, list[tuple[bytes, bytes, int]]] = {}
        for worker in range(self.max_workers):
            rank = worker  # rank 0 is the one the alert rules judge
            if worker == self.max_workers - 1 and self.max_batch_values:
                width = 1000
                rows = self.max_batch_values // width
                self.bodies[f"max{worker}"] = [
                    (*vector_body(rank, i * rows, rows, width), rows) for i in range(2)
                ]
            else:
                value = firing if self.firing and rank == 0 else healthy
                self.bodies[f"max{worker}"] = [
                    (
                        *scalar_body(rank, i * steps_per_body, self.max_batch_points, RULE_KEYS, value),
                        self.max_batch_points,
                    )
                    for i in range(3)
                ]
        over = self.max_batch_points + self.max_batch_points // 2
        self.bodies["oversize"] = [(*scalar_body(90, 0, over, ["loss"]), over)]
        self.bomb = gzip.compress(
            b'{"rank":0,"seq":1,"scalars":[{"key":"x","steps":['
            + b"0," * (self.max_body_bytes // 2)
            + b"0]}]}",
            6,
        )
        self.bodies["swarm"] = [
            (*scalar_body(91 + i, 0, 2000, ["loss", "lr"]), 2000) for i in range(self.swarm)
        ]

    def _send(self, body: bytes, points: int, gzipped: bool = False) -> None:
        status, headers, answer = post(
            self.url, f"/api/v1/runs/{self.run_id}/batches", body, self.token, gzipped
        )
        with self._lock:
            self.statuses[status] += 1
            if status == 200:
                self.accepted_points += points
            elif status in (413, 429):
                if "retry-after" in headers:
                    self.retry_after.append(headers["retry-after"])
                try:
                    self.limits_named[json.loads(answer).get("limit", "?")] += 1
                except ValueError:
                    self.limits_named["?"] += 1

    def report(self) -> HostileReport:
        return HostileReport(
            dict(self.statuses),
            list(self.retry_after),
            dict(self.limits_named),
            self.accepted_points,
            self.rule_status,
        )

    def run(self, seconds: float) -> None:
        seqs = iter(range(10**9))
        seq_lock = threading.Lock()
        deadline = time.monotonic() + seconds

        def next_seq() -> bytes:
            with seq_lock:
                return str(next(seqs)).encode()

        def loop(name: str, index: int = 0) -> None:
            bodies = self.bodies[name]
            turn = 0
            while time.monotonic() < deadline:
                if name == "oversize" and turn % 2:
                    self._send(self.bomb, 0, gzipped=True)
                else:
                    before, after, points = bodies[(index + turn) % len(bodies)]
                    self._send(before + next_seq() + after, points)
                turn += 1

        self.rule_status = post(
            self.url,
            "/api/v1/alert-rules",
            json.dumps(
                {
                    "project": "hostile",
                    "type": "grad_norm_spike",
                    "params": {"window": 10_000, "warmup": 10_000},
                }
            ).encode(),
            self.token,
        )[0]
        threads = [
            threading.Thread(target=loop, args=(name,), daemon=True)
            for name in self.bodies
            if name.startswith("max")
        ]
        threads.append(threading.Thread(target=loop, args=("oversize",), daemon=True))
        threads += [threading.Thread(target=loop, args=("swarm", i), daemon=True) for i in range(self.swarm)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0) + 120)


@dataclass
class HostileReport:
    statuses: dict[int, int]
    retry_after: list[str]
    limits_named: dict[str, int]
    accepted_points: int
    rule_status: int | None


def _hostile_process(
    connection: Any, url: str, token: str | None, run_id: str, options: dict[str, Any]
) -> None:
    """The hostile tenant in a process of its own, so that its threads never hold the victim's GIL:
    builds its bodies, says "ready", attacks for the seconds it is sent, sends its HostileReport."""
    hostile = Hostile(url, token, run_id, **options)
    hostile.prepare()
    connection.send("ready")
    hostile.run(connection.recv())
    connection.send(hostile.report())


@dataclass
class ScenarioResult:
    baseline: Summary
    attack: Summary
    hostile: HostileReport
    attack_seconds: float
    victim: Victim
    attack_start: float


def run_scenario(
    url: str,
    victim_token: str | None,
    hostile_token: str | None,
    baseline_s: float,
    attack_s: float,
    **hostile_options: Any,
) -> ScenarioResult:
    """Create the two runs, measure the victim alone for baseline_s, then under attack for attack_s."""
    for token, project, run_id in (
        (victim_token, "victim", "victim-run"),
        (hostile_token, "hostile", "hostile-run"),
    ):
        status, _, body = post(
            url, "/api/v1/runs", json.dumps({"id": run_id, "project": project}).encode(), token
        )
        assert status == 201, body
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_hostile_process,
        args=(theirs, url, hostile_token, "hostile-run", hostile_options),
        name="hostile",
        daemon=True,
    )
    process.start()
    try:
        assert ours.poll(180) and ours.recv() == "ready", "the hostile process did not start"
        victim = Victim(url, victim_token, "victim-run")
        victim.start()
        time.sleep(baseline_s)
        attack_start = time.monotonic() - victim.started_at
        ours.send(attack_s)
        assert ours.poll(attack_s + 180), "the hostile process did not finish"
        hostile: HostileReport = ours.recv()
        attack_end = time.monotonic() - victim.started_at
        victim.stop.set()
        victim.join(30)
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
        ours.close()
        theirs.close()
    return ScenarioResult(
        Summary.of(victim.between(0.5, attack_start)),  # the first requests warm up
        Summary.of(victim.between(attack_start, attack_end)),
        hostile,
        attack_end - attack_start,
        victim,
        attack_start,
    )


def make_tokens(database_url: str) -> tuple[str, str]:
    """(victim, hostile) tokens with the agents' scope, created before the server starts."""
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine, prepare_schema

    engine = make_engine(database_url)
    try:
        prepare_schema(engine, database_url)
        tokens = Tokens(engine)
        return tokens.create("victim", "ingest")[1], tokens.create("hostile", "ingest")[1]
    finally:
        engine.dispose()


def test_a_hostile_tenant_neither_stalls_nor_fails_another_tenants_ingest(database_url, tmp_path) -> None:
    """Default limits, a real server process: the victim posts 1-point batches 4 times a second; the
    hostile token does its worst for 10 s. The victim sees no error and its median latency stays near
    its own baseline; the hostile is answered 429 with Retry-After."""
    from gradwatch.server.settings import Settings

    defaults = Settings(database_url=database_url)  # what `gradwatch server` runs with
    victim_token, hostile_token = make_tokens(database_url)
    with server_process(database_url, tmp_path) as url:
        result = run_scenario(
            url,
            victim_token,
            hostile_token,
            baseline_s=4.0,
            attack_s=10.0,
            swarm=6,
            max_batch_points=defaults.max_batch_points,
            max_batch_values=defaults.max_batch_values,
            max_body_bytes=defaults.max_body_bytes,
        )
    base, attack, hostile = result.baseline, result.attack, result.hostile
    print(
        f"\nvictim baseline: {base}\nvictim attack:   {attack}\nhostile: statuses {dict(hostile.statuses)}, "
        f"limits {dict(hostile.limits_named)}, accepted {hostile.accepted_points / result.attack_seconds:,.0f} points/s, "
        f"rule {hostile.rule_status}"
    )
    assert base.samples >= 10 and attack.samples >= 10
    assert base.errors == 0 and attack.errors == 0 and attack.server_errors == 0, attack
    assert attack.p50 < max(5 * base.p50, base.p50 + 0.25), (base, attack)
    assert attack.p95 < base.p95 + 6.0, (base, attack)  # a maximal batch holds SQLite's lock for seconds
    assert (
        hostile.statuses.get(429, 0) > 0
        and hostile.retry_after
        and all(int(v) >= 1 for v in hostile.retry_after)
    )
    assert "rate" in hostile.limits_named  # (its oversized batches meet 413 only while it is not in debt)
    # Its large bodies refused before they are read have their connection closed (status 0 here).
    assert not [status for status in hostile.statuses if status >= 500], hostile.statuses
    assert hostile.rule_status == 403  # an ingest token cannot create rules
