"""Ingest isolation: per-tenant limits (server.ingest_limits), batch caps, SQLite's write lock
answering 503, the agent honouring Retry-After and splitting batches, and one tenant doing its
worst through the API while another sends small batches like an agent.

The scenario of the last test (tests/support/ingest_attack.py: Victim, Hostile, run_scenario) is
shared with bench/ingest_isolation.py, which runs it with the limits on and off side by side and
reports the figures; the test here asserts that the victim sees no error and stays within noise of
its own baseline.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from conftest import free_port, server_process
from ingest_attack import get_json, make_tokens, post, run_scenario

from gradwatch._sender import Sender
from gradwatch._transport import MAX_RETRY_AFTER, Backoff, HttpTransport, TransportError, parse_retry_after
from gradwatch._wire import MAX_BATCH_VALUES, batch_points, split_by_steps
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


def test_a_tenant_back_before_its_retry_after_is_held_and_an_honest_one_never(monkeypatch) -> None:
    """IngestLimits.hold: a 429 to a tenant that was told to wait and came back early is held until
    its Retry-After is up (at most HOLD_AT_MOST_S); one that waited is answered at once; beyond
    HELD_PER_TENANT held at once, the rest are answered at once (to be closed)."""
    from gradwatch.server import ingest_limits

    # A hold of 1 s against "at once" meaning under 0.5 s: far apart on a loaded machine too.
    monkeypatch.setattr(ingest_limits, "HOLD_AT_MOST_S", 1.0)
    monkeypatch.setattr(ingest_limits, "HELD_PER_TENANT", 3)
    clock = FakeClock()
    limits = IngestLimits(points_per_s=1000, burst_points=1000, clock=clock)

    async def timed(key: str, retry_after: int) -> tuple[bool, float]:
        started = time.perf_counter()
        answered = await limits.hold(key, retry_after)
        return answered, time.perf_counter() - started

    async def scenario() -> None:
        assert (await timed("token:1", 2))[1] < 0.5  # a first refusal: told to come back in 2 s
        clock.now += 0.5  # back after 0.5 s: held, by at most HOLD_AT_MOST_S
        answered, waited = await timed("token:1", 2)
        assert answered and 0.99 <= waited < 3.0, waited
        clock.now += 10  # an agent that waited its Retry-After out
        assert (await timed("token:1", 2))[1] < 0.5
        assert (await timed("token:2", 2))[1] < 0.5  # another tenant's refusal is its own
        # A flood while told to wait: three are held, the rest answered at once (closed by the caller).
        results = await asyncio.gather(*(timed("token:1", 2) for _ in range(6)))
        assert sorted(answered for answered, _ in results) == [False] * 3 + [True] * 3
        assert all(waited < 0.5 for answered, waited in results if not answered)
        assert limits._tenant("token:1").held == 0

    asyncio.run(scenario())


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
    waits = [b - a for a, b in zip(transport.attempts, transport.attempts[1:], strict=False)]
    # Two refusals, the batch, then close()'s final counters (no data, sent right after).
    assert len(waits) == 3 and min(waits[:2]) >= 0.6, waits  # backoff alone would have waited ~0.01 s
    assert {s["key"] for s in transport.stored[-1]["scalars"]} <= {
        "agent/queued",
        "agent/sent",
        "agent/spooled",
        "agent/dropped",
    }
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


def _small_limits(sqlite_url: str) -> Any:
    from gradwatch.server.settings import Settings

    return Settings(
        database_url=sqlite_url,
        max_batch_points=1000,
        max_batch_values=5000,
        max_body_bytes=200_000,
        ingest_points_per_s=1,  # a slow refill: the 429 below must not depend on how long requests take
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


def test_a_hostile_tenant_neither_stalls_nor_fails_another_tenants_ingest(database_url, tmp_path) -> None:
    """Default limits, a real server process: the victim posts 1-point batches 4 times a second; the
    hostile token does its worst for 10 s. The victim sees no error and its latency stays within noise
    of its own baseline; the hostile is answered 429 with Retry-After, and coming back before it is up
    is held back, so it cannot buy the server's time with a flood of cheap refusals."""
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
    refusals_per_s = hostile.statuses.get(429, 0) / result.attack_seconds
    print(
        f"\nvictim baseline: {base}\nvictim attack:   {attack}\nhostile: statuses {dict(hostile.statuses)}, "
        f"limits {dict(hostile.limits_named)}, "
        f"accepted {hostile.accepted_points / result.attack_seconds:,.0f} points/s, "
        f"429s {refusals_per_s:.1f}/s, rule {hostile.rule_status}"
    )
    assert base.samples >= 5 and attack.samples >= 5
    assert base.errors == 0 and attack.errors == 0 and attack.server_errors == 0, attack
    # Not stalled: a stalled victim waits behind the hostile's backlog for seconds a request. How close
    # to its own baseline it stays is measured by bench/ingest_isolation.py (7 ms alone, 7 ms under
    # attack on a quiet machine), not here: on a loaded CI machine both medians move by 10x (seen:
    # 0.16 s alone, 0.48 s under attack on PostgreSQL at a load average of 10 on 2 cores), so the
    # bounds scale with the victim's own baseline in this run.
    assert attack.p50 < 3 * base.p50 + 1.0, (base, attack)
    # The tail may meet one maximal hostile batch holding SQLite's write lock (~0.5-2 s).
    assert attack.p95 < 3 * base.p95 + 3.0, (base, attack)  # ~40 samples: p95 is the second worst
    # Without the hold the hostile's 12 threads got ~700 refusals a second (each ~1 ms of the event loop).
    assert 0 < refusals_per_s < 20, hostile.statuses
    assert hostile.retry_after and all(int(v) >= 1 for v in hostile.retry_after)
    assert "rate" in hostile.limits_named  # (its oversized batches meet 413 only while it is not in debt)
    # Its large bodies refused before they are read have their connection closed (status 0 here).
    assert not [status for status in hostile.statuses if status >= 500], hostile.statuses
    assert hostile.rule_status == 403  # an ingest token cannot create rules


def test_the_servers_first_batch_pays_its_own_warm_up_not_the_tenant() -> None:
    """The first batch a server stores also compiles its SQL statements and loads modules (~1 s of CPU
    on PostgreSQL under load): charged to the tenant, it left a 52,000-point debt that refused the
    tenant's next small batch for a moment (a CI flake). The server's first batch is not surcharged;
    the next expensive one is."""
    from gradwatch.server import ingest_limits

    limits = IngestLimits(concurrency=0, points_per_s=1000, burst_points=100_000, clock=FakeClock())
    cost = limits.charge("token:1", 10, 10)
    limits.settle("token:1", cost, cpu_s=ingest_limits.FREE_CPU_S + 1.0)
    assert limits._tenants["token:1"].balance == 100_000 - 10
    asyncio.run(limits.admit("token:1"))  # the next batch is admitted at once
    limits.release("token:1")
    cost = limits.charge("token:2", 10, 10)
    limits.settle("token:2", cost, cpu_s=ingest_limits.FREE_CPU_S + 1.0)
    assert limits._tenants["token:2"].balance == pytest.approx(100_000 - ingest_limits.POINTS_PER_CPU_S)
