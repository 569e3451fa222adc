"""The transport's parts: wire merging, seqs, backoff, the spool file, the sender's threads and
failure handling, gzip on the wire (agent and server middleware), offline spools, fork, SIGTERM and
exit. The faults against a real server process are in test_transport_faults.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from training import RecordingTransport

import gradwatch
from gradwatch._buffer import StepBuffer
from gradwatch._sender import Sender
from gradwatch._spool import Spool, batch_record, read_batch_json, scan
from gradwatch._transport import Backoff, HttpTransport, TransportError
from gradwatch._wire import (
    SEQ_COUNTER_BITS,
    SeqAllocator,
    batch_points,
    dumps,
    group_fragments,
    merge_fragments,
)

RUN = {"id": "run-1", "project": "p", "name": "n", "config": {}, "metadata": {}}


def packet(step: int, status: str | None = None, derivers: list[Any] | None = None, **values: float) -> Any:
    buffer = StepBuffer()
    for key, value in values.items():
        buffer.add_scalar(key, step, value)
    return buffer.take(derivers or [], status)


def batch(seq: int, *steps: int, key: str = "x") -> dict[str, Any]:
    return {
        "rank": 0,
        "seq": seq,
        "scalars": [{"key": key, "steps": list(steps), "values": [s / 2 for s in steps]}],
        "events": [],
    }


def wait_for(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# -- wire ------------------------------------------------------------------------------------------


def test_merge_fragments_joins_series_keeps_the_later_value_and_orders_steps():
    first = {
        "scalars": [{"key": "a", "steps": [3, 4], "values": [1.0, 2.0]}],
        "events": [{"step": 3, "kind": "k"}],
    }
    second = {
        "scalars": [
            {"key": "a", "steps": [4, 5], "values": [9.0, 3.0]},
            {"key": "b", "steps": [1], "values": [0.5]},
        ],
        "events": [{"step": 5, "kind": "k"}],
        "status": "finished",
    }
    merged = merge_fragments([first, second])
    assert merged["scalars"] == [
        {"key": "a", "steps": [3, 4, 5], "values": [1.0, 9.0, 3.0]},
        {"key": "b", "steps": [1], "values": [0.5]},
    ]
    assert [e["step"] for e in merged["events"]] == [3, 5]
    assert merged["status"] == "finished"
    assert batch_points(merged) == 4


def test_merge_fragments_concatenates_series_whose_steps_follow_on():
    parts = [
        {"scalars": [{"key": "a", "steps": [1, 2, 2], "values": [1.0, 2.0, 3.0]}], "events": []},
        {"scalars": [{"key": "a", "steps": [5, 9], "values": [4.0, "NaN"]}], "events": []},
        {"scalars": [{"key": "a", "steps": [], "values": []}], "events": []},
        {"scalars": [{"key": "a", "steps": [10], "values": [5.0]}], "events": []},
    ]
    merged = merge_fragments(parts)
    # A step repeated inside one fragment travels as it came (the server keeps the later value).
    assert merged["scalars"] == [
        {"key": "a", "steps": [1, 2, 2, 5, 9, 10], "values": [1.0, 2.0, 3.0, 4.0, "NaN", 5.0]}
    ]
    out_of_order = merge_fragments([parts[1], parts[0]])
    assert out_of_order["scalars"] == [{"key": "a", "steps": [1, 2, 5, 9], "values": [1.0, 3.0, 4.0, "NaN"]}]


def test_host_columns_travel_as_columns_and_become_pairs_only_when_asked():
    import math

    from gradwatch._buffer import Resolved

    def resolved() -> Resolved:
        return Resolved(
            {"device": [(1, 1.0)], "both": [(2, 5.0)]},
            {},
            {},
            [],
            host_columns={
                "host": ([1, 2, 3], [1.0, math.inf, 3.0]),
                "both": ([1, 3], [4.0, 6.0]),
                "unordered": ([3, 1, 1], [3.0, 1.0, 2.0]),
                "_internal": ([1], [1.0]),
            },
        )

    expected = {
        "device": {"key": "device", "steps": [1], "values": [1.0]},
        "both": {"key": "both", "steps": [1, 2, 3], "values": [4.0, 5.0, 6.0]},
        "host": {"key": "host", "steps": [1, 2, 3], "values": [1.0, "Infinity", 3.0]},
        "unordered": {"key": "unordered", "steps": [1, 1, 3], "values": [1.0, 2.0, 3.0]},
    }
    columns = resolved()
    assert columns.scalar_points("both") == [(1, 4.0), (2, 5.0), (3, 6.0)]
    assert columns.scalar_points("unordered") == [(1, 1.0), (1, 2.0), (3, 3.0)]
    assert {s["key"]: s for s in columns.wire_fields()["scalars"]} == expected
    pairs = resolved()
    assert pairs.scalars["host"] == [(1, 1.0), (2, math.inf), (3, 3.0)]  # what derivers read
    pairs.scalars["derived"] = [(2, 0.5)]
    assert {s["key"]: s for s in pairs.wire_fields()["scalars"]} == expected | {
        "derived": {"key": "derived", "steps": [2], "values": [0.5]}
    }


def test_log_flushes_once_it_holds_flush_at_values_whatever_the_clock(tmp_path):
    from gradwatch._run import FLUSH_AT_VALUES

    run = gradwatch.init(project="p", mode="offline", spool_dir=str(tmp_path), flush_interval=3600.0)
    keys = [f"k{i}" for i in range(100)]
    steps = FLUSH_AT_VALUES // len(keys) + 50
    for step in range(steps):  # explicit steps: the optimizer step counter never moves
        run.log(dict.fromkeys(keys, float(step)), step=step)
    assert len(run.buffer) < FLUSH_AT_VALUES  # flushed on the way, not held for the hour
    run.finish()
    assert run.stats.dropped == 0


def test_group_fragments_keeps_status_last_unknown_fields_alone_and_a_size_cap():
    plain = {"scalars": [{"key": "a", "steps": [1, 2], "values": [1.0, 2.0]}], "events": []}
    unknown = {"scalars": [], "events": [], "future_field": [1]}
    done = {"scalars": [], "events": [], "status": "finished"}
    groups = group_fragments([plain, plain, unknown, plain, done, plain], max_points=100)
    assert [len(g) for g in groups] == [2, 1, 2, 1]
    assert [len(g) for g in group_fragments([plain] * 5, max_points=4)] == [2, 2, 1]
    layered = [{**plain, "layers": ["w"]}, {**plain, "layers": ["w"]}, {**plain, "layers": ["v"]}]
    assert [len(g) for g in group_fragments(layered, max_points=100)] == [2, 1]


def test_dumps_is_the_same_json_as_the_standard_library():
    document = {
        "rank": 0,
        "seq": 7,
        "scalars": [{"key": "a", "steps": [1], "values": ["NaN"]}] * 3,
        "events": [],
    }
    assert json.loads(dumps(document)) == document


def test_health_keys_are_not_counted_as_points():
    document = {
        "scalars": [
            {"key": "agent/sent", "steps": [1], "values": [5.0]},
            {"key": "loss", "steps": [1, 2], "values": [1.0, 2.0]},
        ],
        "vectors": [{"key": "grad/norm", "steps": [1], "values": [[1.0, 2.0]]}],
        "histograms": [{"key": "grad/hist", "step": 1}],
    }
    assert batch_points(document) == 4


# -- seqs and backoff ------------------------------------------------------------------------------


def test_seqs_never_repeat_across_senders_or_a_counter_rollover():
    first, second = SeqAllocator(), SeqAllocator()
    a = [first.next() for _ in range(3)]
    b = [second.next() for _ in range(3)]
    assert a == sorted(a) and b == sorted(b) and max(a) < min(b)  # a later process's namespace is newer
    second._count = 1 << SEQ_COUNTER_BITS  # exhausted: a fresh namespace, still increasing
    c = second.next()
    assert c > max(b) and c % (1 << SEQ_COUNTER_BITS) == 0
    assert c < 2**63  # fits the server's BIGINT


def test_backoff_doubles_with_jitter_up_to_its_cap():
    backoff = Backoff(base=1.0, cap=8.0)
    delays = [backoff.next_delay() for _ in range(6)]
    for n, delay in enumerate(delays):
        ceiling = min(8.0, 2.0**n)
        assert ceiling * 0.5 <= delay <= ceiling
    backoff.reset()
    assert backoff.next_delay() <= 1.0
    with pytest.raises(ValueError, match="base"):
        Backoff(base=0.0)


# -- the spool file --------------------------------------------------------------------------------


def test_spool_hands_out_the_oldest_batch_first_from_memory_and_file(tmp_path):
    spool = Spool(tmp_path / "s.jsonl", RUN)
    spool.add(batch(5, 5), 1, persist=False)
    spool.add(batch(7, 7), 1, persist=True)
    spool.add(batch(3, 3), 1, persist=False)  # an older batch that failed to send goes back in
    spool.persist()
    order = []
    while (head := spool.oldest()) is not None:
        seq, body, _ = head
        order.append(seq)
        assert json.loads(body) == batch(seq, seq)  # exactly what was written
        spool.remove(seq)
    assert order == [3, 5, 7]
    assert not (tmp_path / "s.jsonl").exists()  # everything sent: the online spool is gone


def test_a_torn_last_record_is_skipped_and_the_next_writer_starts_a_new_line(tmp_path, caplog):
    path = tmp_path / "s.jsonl"
    writer = Spool(path, RUN)
    for seq in (1, 2, 3):
        writer.add(batch(seq, seq), 1, persist=True)
    path.write_bytes(path.read_bytes()[:-20])  # a crash in the middle of the last write
    assert [r.seq for r in scan(path).records if r.type == "batch"] == [1, 2]

    resumed = Spool(path, RUN)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        assert resumed.recover() == 2
    assert "1 torn or corrupt line" in caplog.text
    resumed.add(batch(4, 4), 1, persist=True)
    result = scan(path)
    assert [r.seq for r in result.records if r.type == "batch"] == [1, 2, 4]
    assert result.bad_lines == 1
    assert resumed.oldest()[0] == 1


def test_spool_cap_warns_once_then_memory_then_drops_counted(tmp_path, caplog):
    one = len(batch_record("run-1", batch(1, 1), 1))
    spool = Spool(tmp_path / "s.jsonl", RUN, max_bytes=one * 3, max_memory_points=2)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        kept = [spool.add(batch(seq, seq), 1, persist=True) for seq in range(1, 8)]
    assert kept == [True, True, True, True, False, False, False]  # 2 in the file (+ run record), 2 in memory
    assert (spool.disk_points, spool.memory_points, spool.dropped_points) == (2, 2, 3)
    cap = [r for r in caplog.records if "reached its cap" in r.getMessage()]
    full = [r for r in caplog.records if "held in memory" in r.getMessage()]
    assert len(cap) == 1 and len(full) == 1


def test_an_unwritable_spool_warns_once_and_keeps_batches_in_memory(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    spool = Spool(tmp_path / "file" / "spool" / "s.jsonl", RUN)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        assert not spool.check_writable()
        assert spool.add(batch(1, 1), 1, persist=True)
        spool.persist()
    assert caplog.records[0].getMessage().startswith("gradwatch: cannot write the spool file")
    assert len(caplog.records) == 1
    assert spool.memory_points == 1 and spool.oldest()[0] == 1


def test_read_batch_json_refuses_bytes_that_changed(tmp_path):
    spool = Spool(tmp_path / "s.jsonl", RUN, keep_file=True)
    spool.add(batch(1, 1), 1, persist=True)
    record = next(r for r in scan(tmp_path / "s.jsonl").records if r.type == "batch")
    assert read_batch_json(tmp_path / "s.jsonl", record) == dumps(batch(1, 1)).encode()
    data = bytearray((tmp_path / "s.jsonl").read_bytes())
    data[-5] ^= 1
    (tmp_path / "s.jsonl").write_bytes(bytes(data))
    assert read_batch_json(tmp_path / "s.jsonl", record) is None


# -- the sender ------------------------------------------------------------------------------------


class ScriptedTransport(RecordingTransport):
    """Fails the first sends as scripted (TransportErrors), then records like RecordingTransport."""

    def __init__(
        self, failures: list[TransportError] | None = None, hold: threading.Event | None = None
    ) -> None:
        super().__init__()
        self.failures = list(failures or [])
        self.hold = hold
        self.attempts: list[int] = []

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> None:
        if self.hold is not None:
            self.hold.wait(30)
        self.attempts.append(batch["seq"])
        if self.failures:
            raise self.failures.pop(0)
        super().send_batch(run_id, batch)


def sender(transport: Any, **options: Any) -> Sender:
    return Sender(transport, RUN, 0, Spool(None, RUN), backoff=Backoff(base=0.01, cap=0.02), **options)


def test_retryable_failures_resend_the_same_seq_until_it_is_stored():
    failures = [
        TransportError("HTTP 503", True, 503),
        TransportError("HTTP 429", True, 429),
        TransportError("HTTP 408", True, 408),
        TransportError("refused", True),
    ]
    transport = ScriptedTransport(failures)
    s = sender(transport)
    s.submit(packet(0, x=1.0))
    assert s.close(timeout=10)
    assert transport.attempts[:5] == [transport.attempts[0]] * 5  # the same seq until it is stored
    assert len(transport.attempts) == 6  # then finish()'s final counters, once
    assert {series["key"] for series in transport.batches[-1]["scalars"]} <= {
        "agent/queued",
        "agent/sent",
        "agent/spooled",
        "agent/dropped",
    }
    assert transport.series("x") == {0: 1.0}
    assert s.stats.sent == 1 and s.stats.dropped == 0 and "refused" in s.stats.last_error


def test_client_errors_are_tried_a_bounded_number_of_times_then_dropped_without_a_dead_letter_file():
    # A memory-only spool has no dead-letter file beside it: the refused batch is dropped and counted
    # (with a spool file it is dead-lettered: tests/agent/test_finish_and_dead_letters.py).
    refusal = TransportError('HTTP 422: {"detail": "bad key"}', False, 422)
    transport = ScriptedTransport([refusal] * 3)
    s = sender(transport)
    s.submit(packet(0, x=1.0, y=2.0))
    wait_for(lambda: len(transport.attempts) >= 3)
    s.submit(packet(1, x=3.0))
    assert s.close(timeout=10)
    assert transport.series("x") == {1: 3.0}
    assert transport.attempts[:3] == [transport.attempts[0]] * 3  # the same batch, three tries
    assert s.stats.dropped == 2 and s.stats.sent == 1 and s.stats.dead_lettered == 0
    assert "bad key" in s.stats.last_error
    notices = [e for b in transport.batches for e in b.get("events", []) if e["kind"] == "dead_letter"]
    assert len(notices) == 1 and "bad key" in notices[0]["data"]["reason"]


def test_submit_never_waits_while_the_server_hangs_and_merges_what_piles_up():
    hold = threading.Event()
    transport = ScriptedTransport(hold=hold)
    s = sender(transport, max_queue=64)
    for step in range(200):  # more packets than the inbox holds: the collector keeps draining it
        assert s.submit(packet(step, x=float(step)))
        time.sleep(0.003)
    wait_for(lambda: s.stats.queued == 200)
    hold.set()
    assert s.close(timeout=20)
    assert transport.series("x") == {step: float(step) for step in range(200)}
    assert len(transport.batches) < 20  # one request for everything that waited
    assert s.stats.dropped == 0 and s.stats.sent == 200


def test_a_full_inbox_drops_the_packet_counts_its_points_and_warns_once(caplog):
    stuck = threading.Event()
    transport = RecordingTransport()
    s = sender(transport, max_queue=2)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        s.submit(packet(0, derivers=[lambda _resolved: stuck.wait(30)], x=0.0))  # blocks the collector
        wait_for(lambda: not s._inbox)
        accepted = [s.submit(packet(step, x=1.0, y=2.0)) for step in range(1, 6)]
    assert accepted == [True, True, False, False, False]
    assert s.stats.dropped == 6
    assert len([r for r in caplog.records if "queue is full" in r.getMessage()]) == 1
    stuck.set()
    assert s.close(timeout=10)
    assert sorted(transport.series("x")) == [0, 1, 2]


def test_each_batch_carries_the_agents_health_at_its_last_step():
    transport = RecordingTransport()
    s = sender(transport)
    s.submit(packet(4, x=1.0))
    assert s.close(timeout=10)
    keys = {series["key"]: series for series in transport.batches[0]["scalars"]}
    assert {"agent/queued", "agent/sent", "agent/spooled", "agent/dropped"} <= set(keys)
    assert keys["agent/queued"]["steps"] == [4]


class Down:
    def create_run(self, run: dict[str, Any]) -> None:
        raise TransportError("POST /api/v1/runs: connection refused", True)

    send_batch = create_run


def test_finish_spools_what_is_unsent_and_a_resumed_run_sends_it_first(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        first = gradwatch.init(
            project="p", run_id="resumed", transport=Down(), spool_dir=tmp_path, flush_interval=0.01
        )
        for step in range(50):
            first.log({"x": float(step)}, step=step)
        first.finish(timeout=0.5)
    spool_file = tmp_path / "resumed-rank0.jsonl"
    assert first.stats.spooled == 50 and first.stats.queued == 0
    assert f"50 points wait in {spool_file}" in caplog.text and "gradwatch sync" in caplog.text

    transport = RecordingTransport()
    with gradwatch.init(project="p", run_id="resumed", transport=transport, spool_dir=tmp_path) as second:
        for step in range(50, 60):
            second.log({"x": float(step)}, step=step)
    assert transport.series("x") == {step: float(step) for step in range(60)}
    seqs = [b["seq"] for b in transport.batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # the older process's batches first
    assert second.stats.sent == 60 and second.stats.spooled == 0
    assert not spool_file.exists()


# -- HTTP: gzip on the wire, dedupe on the server ----------------------------------------------


class _Capture(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    answer = (200, b'{"duplicate": false, "points": 1, "events": 0}')

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append((dict(self.headers), body))
        status, payload = self.answer
        if status == 422 and self.headers.get("Content-Encoding") != "gzip":
            status, payload = 200, b"{}"
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def capture() -> Iterator[tuple[str, type[_Capture]]]:
    handler = type("Handler", (_Capture,), {"seen": []})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()
    thread.join()


def test_batches_travel_gzip_compressed(capture):
    url, handler = capture
    big = batch(1, *range(500))
    assert HttpTransport(url, compress=True).send_batch("r", big) == {
        "duplicate": False,
        "points": 1,
        "events": 0,
    }
    headers, body = handler.seen[0]
    assert headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(body)) == big
    assert len(body) < len(dumps(big)) / 2


def test_batches_to_a_server_on_this_machine_travel_plain_by_default(capture):
    url, handler = capture
    big = batch(1, *range(500))
    HttpTransport(url).send_batch("r", big)
    headers, body = handler.seen[0]
    assert "Content-Encoding" not in headers
    assert json.loads(body) == big
    assert not HttpTransport("http://localhost:1").compress
    assert not HttpTransport("http://[::1]:1").compress
    assert HttpTransport("https://gradwatch.example.org").compress
    assert HttpTransport("http://10.0.0.7:8765").compress


def test_a_server_that_cannot_read_gzip_gets_plain_json_from_then_on(capture):
    url, handler = capture
    handler.answer = (422, b'{"detail": "JSON decode error"}')
    transport = HttpTransport(url, compress=True)
    transport.send_batch("r", batch(1, *range(500)))
    transport.send_batch("r", batch(2, *range(500)))
    encodings = [headers.get("Content-Encoding") for headers, _ in handler.seen]
    assert encodings == ["gzip", None, None]


def test_a_batch_stored_before_its_answer_was_lost_is_stored_once(sqlite_server):
    import httpx

    class AnswerLost(HttpTransport):
        lost = False
        answers: ClassVar[list[dict[str, Any]]] = []

        def send_batch(self, run_id: str, batch: dict[str, Any]) -> dict[str, Any]:
            answer = super().send_batch(run_id, batch)
            self.answers.append(answer)
            if not self.lost:
                self.lost = True
                raise TransportError("connection reset after the server stored the batch", True)
            return answer

    transport = AnswerLost(sqlite_server.url)
    run = gradwatch.init(project="p", transport=transport, max_backoff=0.05)
    buffer_steps = range(20)
    for step in buffer_steps:
        run.log({"x": float(step)}, step=step)
    run.finish(timeout=20)
    # The batch, its resend (a duplicate, stored once), then finish()'s final counters.
    assert [a["duplicate"] for a in transport.answers] == [False, True, False]
    with httpx.Client(base_url=sqlite_server.url) as client:
        series = client.get(f"/api/v1/runs/{run.id}/series", params={"key": "x"}).json()
    assert series["steps"] == list(buffer_steps)
    assert run.stats.sent == 20 and run.stats.dropped == 0


# -- the server's gzip middleware (pure ASGI) --------------------------------------------------


def _call_middleware(
    body_parts: list[bytes], encoding: str | None, max_bytes: int = 1000
) -> tuple[int, bytes, Any]:
    from gradwatch.server.compression import GzipRequestBody

    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen["body"] = message["body"]
        seen["headers"] = dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    headers = [(b"content-type", b"application/json")]
    if encoding is not None:
        headers.append((b"content-encoding", encoding.encode()))
    messages = [
        {"type": "http.request", "body": part, "more_body": i < len(body_parts) - 1}
        for i, part in enumerate(body_parts)
    ]
    sent: list[Any] = []

    async def receive() -> Any:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/v1/runs/r/batches", "headers": headers}
    asyncio.run(GzipRequestBody(app, max_bytes)(scope, receive, send))
    return sent[0]["status"], sent[1]["body"], seen


def test_middleware_inflates_gzip_bodies_even_in_pieces_and_several_members():
    payload = json.dumps({"a": list(range(50))}).encode()
    compressed = gzip.compress(payload[:40]) + gzip.compress(payload[40:])
    status, _, seen = _call_middleware([compressed[:10], compressed[10:]], "gzip")
    assert status == 200 and seen["body"] == payload
    assert seen["headers"][b"content-length"] == str(len(payload)).encode()
    assert b"content-encoding" not in seen["headers"]
    status, _, seen = _call_middleware([payload], None)
    assert status == 200 and seen["body"] == payload


def test_middleware_refuses_bombs_corrupt_data_and_unknown_encodings():
    bomb = gzip.compress(b"0" * 100_000)
    status, body, seen = _call_middleware([bomb], "gzip", max_bytes=1000)
    assert status == 413 and b"larger than 1000 bytes once decompressed" in body and not seen
    status, body, _ = _call_middleware([b"not gzip at all"], "gzip")
    assert status == 400 and b"invalid gzip body" in body
    status, body, _ = _call_middleware([gzip.compress(b"{}")[:-6]], "gzip")
    assert status == 400 and b"invalid gzip body" in body
    status, body, _ = _call_middleware([zlib.compress(b"{}")], "br")
    assert status == 415 and b"unsupported Content-Encoding 'br'" in body


def test_the_api_accepts_gzip_batches_and_caps_their_inflated_size(sqlite_server):
    import httpx

    with httpx.Client(base_url=sqlite_server.url) as client:
        client.post("/api/v1/runs", json={"id": "gz", "project": "p"}).raise_for_status()
        body = gzip.compress(dumps(batch(1, *range(100))).encode())
        answer = client.post(
            "/api/v1/runs/gz/batches",
            content=body,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert answer.status_code == 200 and answer.json()["points"] == 100
        corrupt = client.post(
            "/api/v1/runs/gz/batches",
            content=b"\x1f\x8b garbage",
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert corrupt.status_code == 400 and "invalid gzip body" in corrupt.json()["detail"]
        bomb = gzip.compress(b" " * (33 * 1024 * 1024))
        too_big = client.post(
            "/api/v1/runs/gz/batches",
            content=bomb,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert too_big.status_code == 413 and "once decompressed" in too_big.json()["detail"]


# -- offline mode ----------------------------------------------------------------------------------


def test_offline_run_writes_the_spool_only_and_sync_uploads_it_once(tmp_path, sqlite_server, monkeypatch):
    import httpx

    from gradwatch.sync import sync

    monkeypatch.setenv("GRADWATCH_HOME", str(tmp_path))
    with gradwatch.init(project="p", mode="offline") as run:
        for step in range(30):
            run.log({"x": step * 0.25}, step=step)
    spool_file = tmp_path / "offline" / f"{run.id}-rank0.jsonl"
    assert run.stats.spooled == 30 and run.stats.sent == 0
    report = sync(tmp_path / "offline", sqlite_server.url, keep=True, log=lambda _line: None)
    assert report.complete and report.points_sent == 30 and spool_file.exists()
    again = sync(spool_file, sqlite_server.url, log=lambda _line: None)  # without keep: the file goes
    assert again.points_sent == 0 and again.skipped == report.batches_sent
    assert again.removed == [str(spool_file)] and not spool_file.exists()
    with httpx.Client(base_url=sqlite_server.url) as client:
        stored = client.get(f"/api/v1/runs/{run.id}").json()
        series = client.get(f"/api/v1/runs/{run.id}/series", params={"key": "x"}).json()
    assert stored["status"] == "finished"
    assert series["steps"] == list(range(30)) and series["values"] == [s * 0.25 for s in range(30)]
    with pytest.raises(ValueError, match="takes no transport"):
        gradwatch.init(project="p", mode="offline", transport=RecordingTransport())


# -- process life: fork, SIGTERM, exit -------------------------------------------------------------


def test_a_forked_child_gets_an_inert_run_without_threads():
    transport = RecordingTransport()
    run = gradwatch.init(project="p", transport=transport, flush_interval=60)
    run.log({"x": 1.0}, step=0)  # buffered in the parent at fork time
    pid = os.fork()
    if pid == 0:  # the child: like a DataLoader worker
        code = 1
        try:
            run.log({"x": 2.0}, step=1)
            run.finish(timeout=1)
            alive = [t.name for t in threading.enumerate() if t.name.startswith("gradwatch")]
            code = 0 if not alive and len(run.buffer) == 0 and run._sender.submit(None) is False else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    run.log({"x": 3.0}, step=2)
    run.finish(timeout=10)
    assert transport.series("x") == {0: 1.0, 2: 3.0}
    seqs = [b["seq"] for b in transport.batches]
    assert len(seqs) == len(set(seqs))


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = os.environ | {"GRADWATCH_HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, str(script)], env=env, check=False, capture_output=True, text=True, timeout=120
    )


def _spooled(tmp_path: Path) -> tuple[dict[int, float], list[str]]:
    points: dict[int, float] = {}
    statuses = []
    [spool_file] = (tmp_path / "offline").glob("*.jsonl")
    for record in scan(spool_file).records:
        if record.type == "batch":
            document = json.loads(read_batch_json(spool_file, record))
            for series in document["scalars"]:
                if series["key"] == "x":
                    points.update(zip(series["steps"], series["values"], strict=True))
            if "status" in document:
                statuses.append(document["status"])
    return points, statuses


def test_sigterm_flushes_then_dies_by_the_signal_as_before(tmp_path):
    done = _script(
        tmp_path,
        """
        import os, signal, gradwatch
        run = gradwatch.init(project="p", mode="offline", flush_interval=3600)
        for step in range(10):
            run.log({"x": float(step)}, step=step)
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached")
    """,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "not reached" not in done.stdout
    points, statuses = _spooled(tmp_path)
    assert points == {step: float(step) for step in range(10)} and statuses == ["crashed"]


def test_sigterm_flushes_then_calls_the_users_own_handler(tmp_path):
    done = _script(
        tmp_path,
        """
        import os, signal, sys, gradwatch
        def mine(signum, frame):
            print("user handler ran")
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)
        run = gradwatch.init(project="p", mode="offline", flush_interval=3600)
        run.log({"x": 1.0}, step=0)
        os.kill(os.getpid(), signal.SIGTERM)
    """,
    )
    assert done.returncode == 7 and "user handler ran" in done.stdout, done.stderr
    assert _spooled(tmp_path) == ({0: 1.0}, ["crashed"])


def test_exit_without_finish_flushes_and_an_uncaught_error_marks_the_run_crashed(tmp_path):
    (tmp_path / "clean").mkdir()
    clean = _script(
        tmp_path / "clean",
        """
        import gradwatch
        run = gradwatch.init(project="p", mode="offline", flush_interval=3600)
        run.log({"x": 1.0}, step=0)
    """,
    )
    assert clean.returncode == 0, clean.stderr
    assert _spooled(tmp_path / "clean") == ({0: 1.0}, ["finished"])
    (tmp_path / "crash").mkdir()
    crash = _script(
        tmp_path / "crash",
        """
        import gradwatch
        run = gradwatch.init(project="p", mode="offline", flush_interval=3600)
        run.log({"x": 2.0}, step=0)
        raise RuntimeError("training failed")
    """,
    )
    assert crash.returncode == 1 and "training failed" in crash.stderr
    assert _spooled(tmp_path / "crash") == ({0: 2.0}, ["crashed"])


def test_a_batch_the_server_cut_for_a_later_resume_is_told_once(caplog):
    from training import RecordingTransport

    class Superseded(RecordingTransport):
        def send_batch(self, run_id, batch):
            super().send_batch(run_id, batch)
            return {"duplicate": False, "points": 0, "events": 0, "superseded_from": 3}

    transport = Superseded()
    with (
        caplog.at_level("WARNING", logger="gradwatch"),
        gradwatch.init(project="cut", transport=transport, flush_interval=0.01) as run,
    ):
        for step in range(3):
            run.log({"loss": 1.0}, step=step)
            time.sleep(0.05)
    told = [r for r in caplog.records if "was resumed by another process at step 3" in r.getMessage()]
    assert len(transport.batches) >= 2 and len(told) == 1


@pytest.mark.parametrize(
    "bad_key", ["k" * 251, "nul\x00key", "lone\ud800", ""], ids=["too-long", "nul", "surrogate", "empty"]
)
def test_one_key_the_server_would_refuse_is_left_out_and_the_rest_stored(sqlite_server, bad_key):
    good = {f"metric/{i}": float(i) for i in range(495)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.init(project="keys", server=sqlite_server.url) as run:
            for step in range(3):
                run.log({**good, bad_key: 1.0}, step=step)
    assert len([w for w in caught if "left out the key" in str(w.message)]) == 1  # once per key
    assert run.stats.dead_lettered == 0 and run.stats.dropped == 0
    with httpx.Client(base_url=sqlite_server.url, timeout=30) as client:
        keys = client.get(f"/api/v1/runs/{run.id}/keys").json()["data"]
        assert set(good) <= set(keys)
        series = client.get(f"/api/v1/runs/{run.id}/series", params={"key": "metric/494"}).json()
        assert series["steps"] == [0, 1, 2] and series["values"] == [494.0] * 3


def test_a_finished_runs_last_counters_are_its_final_ones_on_the_server(sqlite_server):
    """Each batch carries the counters as they stood before it was sent; finish() then sends the final
    ones (no data), so the run's last agent/sent on the server is what run.stats.sent says at the end
    (the run page shows it)."""
    import httpx

    import gradwatch

    run = gradwatch.init(project="counters", server=sqlite_server.url, flush_interval=0.05)
    for step in range(40):
        run.log({"loss": 1.0 / (step + 1), "lr": 1e-3}, step=step)
        if step % 10 == 9:
            run._flush(None)
    run.finish()
    assert run.stats.sent == 80 and run.stats.queued == run.stats.spooled == run.stats.dropped == 0
    for key, expected in (("agent/sent", 80.0), ("agent/queued", 0.0), ("agent/spooled", 0.0)):
        series = httpx.get(
            f"{sqlite_server.url}/api/v1/runs/{run.id}/series", params={"key": key}, timeout=30
        ).json()
        assert series["steps"][-1] == 39 and series["values"][-1] == expected, (key, series)
    status = httpx.get(f"{sqlite_server.url}/api/v1/runs/{run.id}", timeout=30).json()["status"]
    assert status == "finished"  # the counters after the status leave the run finished
