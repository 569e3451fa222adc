"""finish() drains while the server makes progress; batches the server will not take go to the
dead-letter file instead of blocking the queue; the spool fsyncs at most once a second.

Real parts only: a real uvicorn server on 127.0.0.1 (sqlite_server) behind `Gate`, a real HTTP proxy
on 127.0.0.1 that passes requests on, or answers them as a misbehaving server would (500 forever to
one batch, 422, 413, 401, 503), or holds them to throttle the upload. The agent talks to it with its
own HttpTransport; what reached storage is read back through the server's HTTP API.
"""

from __future__ import annotations

import gzip
import http.client
import itertools
import json
import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import gradwatch
from gradwatch._dead_letters import REFUSAL_TRIES, SERVER_ERROR_TRIES
from gradwatch._sender import PROGRESS_EVERY
from gradwatch._spool import Spool, dead_letter_path, scan, spool_file_name
from gradwatch._wire import unpack_values
from gradwatch.sync import sync

# -- a real proxy in front of the real server ----------------------------------------------------------


@dataclass
class Request:
    """One request the gate saw: its path, the batch it carried (decoded), and how it was answered."""

    path: str
    batch: dict[str, Any] | None
    gzip: bool
    status: int = 0

    @property
    def seq(self) -> int | None:
        return None if self.batch is None else self.batch.get("seq")

    @property
    def keys(self) -> set[str]:
        return {series["key"] for series in (self.batch or {}).get("scalars", ())}

    @property
    def points(self) -> int:
        """As the agent counts them: scalar points without the agent's health keys."""
        series = unpack_values(self.batch or {}).get("scalars", ())  # steps_i64 as a list again
        return sum(len(s["steps"]) for s in series if not s["key"].startswith("agent/"))


Answer = tuple[int, str] | None  # (status, detail) answers the request; None passes it on


@dataclass
class Gate:
    """An HTTP proxy on 127.0.0.1: `rule(request)` decides each batch's answer, `delay(request)` how
    long it is held first (throttling); everything else goes to the real server at `upstream`."""

    upstream: str
    rule: Callable[[Request], Answer] = lambda _request: None
    delay: Callable[[Request], float] = lambda _request: 0.0
    seen: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        gate = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                gate._relay(self)

            def do_POST(self) -> None:
                gate._relay(self)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()

    def batches(self, seq: int | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.seen if r.batch is not None and (seq is None or r.seq == seq)]

    def _relay(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        compressed = handler.headers.get("Content-Encoding") == "gzip"
        batch = None
        if handler.command == "POST" and handler.path.endswith("/batches"):
            batch = json.loads(gzip.decompress(body) if compressed else body)
        request = Request(handler.path, batch, compressed)
        with self._lock:
            self.seen.append(request)
        answer = self.rule(request) if batch is not None else None
        if answer is not None:
            request.status = answer[0]
            self._answer(handler, answer[0], json.dumps({"detail": answer[1]}).encode())
            return
        if batch is not None:
            time.sleep(self.delay(request))
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")}
        upstream = urllib.parse.urlsplit(self.upstream)
        connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
        try:
            connection.request(handler.command, handler.path, body=body or None, headers=headers)
            response = connection.getresponse()
            request.status = response.status
            self._answer(handler, response.status, response.read())
        finally:
            connection.close()

    @staticmethod
    def _answer(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=30)


@pytest.fixture
def gate(sqlite_server: Any) -> Iterator[Gate]:
    g = Gate(sqlite_server.url)
    yield g
    g.close()


def _get(base: str, path: str, **params: Any) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{base}{path}{query}", timeout=30) as response:
        return json.loads(response.read())


def stored(base: str, run_id: str, key: str) -> dict[int, float]:
    series = _get(base, f"/api/v1/runs/{run_id}/series", key=key, max_points=100_000)
    return dict(zip(series["steps"], series["values"], strict=True))


def events(base: str, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in _get(base, f"/api/v1/runs/{run_id}/events")["data"] if e["kind"] == kind]


def gradwatch_warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "gradwatch")


def spooled_points(path: Path) -> int:
    scanned = scan(path)
    retired = scanned.retired()
    return sum(
        r.points for r in scanned.records if r.type == "batch" and (r.run_id, r.rank, r.seq) not in retired
    )


# -- finish() drains while the server makes progress ---------------------------------------------------

KEYS, STEPS = 100, 3000  # 300,000 points: six 50,000-point batches


def _fast_logger(run: Any, keys: int = KEYS, steps: int = STEPS) -> int:
    for step in range(steps):
        run.log({f"k{i:03d}": float(step + i) for i in range(keys)}, step=step)
    return keys * steps


def test_a_fast_loggers_finish_drains_everything_and_prints_progress(gate, tmp_path, capsys, caplog):
    # Each batch is held until finish() begins, then 2 s on top of what the real server needs to
    # store it: the whole upload (six batches, over 12 s) happens inside finish() and is longer than
    # stall_timeout -- finish() goes on because every batch is progress.
    finishing = threading.Event()
    # Each batch: 2 s held, plus the real server's time (up to ~2 s for 50,000 points on a loaded
    # machine); stall_timeout 6 s leaves each batch room, and six batches (over 12 s) exceed it.
    gate.delay = lambda request: 2.0 if finishing.wait(60) else 0.0
    run = gradwatch.init(project="p", server=gate.url, spool_dir=tmp_path)
    points = _fast_logger(run)
    started = time.monotonic()
    finishing.set()
    run.finish(stall_timeout=6.0)
    took = time.monotonic() - started
    print(f"finish took {took:.1f} s for {points:,} points in {run.stats.sent_batches} batches")

    assert run.stats.sent == points and run.stats.spooled == 0 and run.stats.queued == 0
    assert not (tmp_path / spool_file_name(run.id, 0)).exists()
    assert took > 6.0  # past stall_timeout: the server kept making progress
    assert len(stored(gate.url, run.id, "k000")) == STEPS and len(stored(gate.url, run.id, "k099")) == STEPS
    lines = [line for line in capsys.readouterr().err.splitlines() if "uploading" in line]
    assert lines, "no progress line"
    assert lines[0].startswith(f"gradwatch: run {run.id}: uploading ") and lines[0].endswith("%")
    assert f"{points:,} points" in lines[0] or "points," in lines[0]
    assert len(lines) <= took / PROGRESS_EVERY + 1
    assert "did not take" not in gradwatch_warnings(caplog) and "None" not in gradwatch_warnings(caplog)


def test_a_small_finish_prints_nothing(gate, tmp_path, capsys):
    run = gradwatch.init(project="p", server=gate.url, spool_dir=tmp_path)
    _fast_logger(run, keys=3, steps=50)
    started = time.monotonic()
    run.finish()
    took = time.monotonic() - started
    assert run.stats.sent == 150
    err = capsys.readouterr().err
    # The promise is about time: a finish done within PROGRESS_EVERY says nothing. (On a CI machine
    # loaded past its cores, 150 points once took longer, and the progress line was then right.)
    if took < PROGRESS_EVERY:
        assert "gradwatch" not in err
    else:
        assert "gradwatch" not in err.replace(f"gradwatch: run {run.id}: uploading", "")


def _refuse_batches(status: int, detail: str) -> Callable[[Request], Answer]:
    return lambda request: (status, detail)


@pytest.mark.parametrize(
    ("status", "detail"),
    [(503, "injected: database is locked"), (500, "injected: the database is gone")],
    ids=["503", "500-for-every-batch"],
)
def test_a_server_that_takes_nothing_ends_finish_after_the_stall_bound_with_the_reason(
    gate, tmp_path, caplog, status, detail
):
    # 500 to every batch, the dead-letter notice included: the server is broken, not the batch --
    # nothing may be dead-lettered however often it is tried.
    gate.rule = _refuse_batches(status, detail)
    run = gradwatch.init(
        project="p", server=gate.url, spool_dir=tmp_path, max_backoff=0.05, flush_interval=0.02
    )
    for step in range(50):
        run.log({"x": float(step)}, step=step)
        time.sleep(0.002)
    started = time.monotonic()
    run.finish(stall_timeout=3.0)  # tried about 60 times in that while (backoff 50 ms), more than enough
    took = time.monotonic() - started

    assert 3.0 <= took < 30
    spool = tmp_path / spool_file_name(run.id, 0)
    assert spooled_points(spool) == 50 and run.stats.spooled == 50
    assert run.stats.dead_lettered == 0 and run.stats.dropped == 0
    assert not dead_letter_path(spool).exists()
    text = gradwatch_warnings(caplog)
    assert f"the server took nothing for 3 s (POST /api/v1/runs/{run.id}/batches: HTTP {status}" in text
    assert detail in text and f"50 points wait in {spool}" in text
    assert "None" not in text
    if status == 500:
        assert len(gate.batches()) > SERVER_ERROR_TRIES + 1  # tried, and the notice probe failed too
        assert not stored(gate.url, run.id, "x")


def test_finish_timeout_caps_the_wait_and_what_is_left_is_synced_later(gate, tmp_path, caplog):
    finishing = threading.Event()  # batches held until finish() begins, then 1 s each
    gate.delay = lambda request: 1.0 if finishing.wait(60) else 0.0
    run = gradwatch.init(project="p", server=gate.url, spool_dir=tmp_path)
    points = _fast_logger(run, keys=100, steps=2000)  # four 50,000-point batches, 1 s or more each
    started = time.monotonic()
    finishing.set()
    run.finish(timeout=1.5)
    took = time.monotonic() - started

    assert 1.5 <= took < 30  # the timeout, then writing what is left (seconds on a loaded machine)
    spool = tmp_path / spool_file_name(run.id, 0)
    assert run.stats.spooled >= 100_000  # the two last batches at least
    text = gradwatch_warnings(caplog)
    assert "finish(timeout=1.5) ran out while the server was still taking data" in text
    assert f"wait in {spool}" in text and "None" not in text
    gate.delay = lambda request: 0.0
    time.sleep(1.5)  # the request in flight when finish() returned ends
    report = sync(spool, gate.url, log=lambda _line: None)
    assert report.complete
    assert len(stored(gate.url, run.id, "k000")) == 2000 and len(stored(gate.url, run.id, "k099")) == 2000
    assert run.stats.sent + report.points_sent >= points


# -- dead letters ---------------------------------------------------------------------------------------


def _poisoned(request: Request) -> Answer:
    return (500, "injected: this batch crashes the server") if "poison" in request.keys else None


def _log_in_a_batch_of_its_own(run, gate, key: str, *, at: int, steps: int) -> None:
    """Log x at steps 0..steps-1, with `key` beside it at step `at` alone in its batch: before it, wait
    until the earlier steps are stored (until the first batch is, the sender holds everything, and a
    slow machine merged every step into the one refused batch); after it, until the gate saw it."""
    for step in range(at):
        run.log({"x": float(step)}, step=step)
    run._flush(None)
    _wait_until(lambda: run.stats.sent >= at)
    run.log({"x": float(at), key: 1.0}, step=at)
    run._flush(None)
    _wait_until(lambda: any(key in r.keys for r in gate.batches()))
    for step in range(at + 1, steps):
        run.log({"x": float(step)}, step=step)
        time.sleep(0.005)


def test_a_poison_batch_is_dead_lettered_and_no_longer_blocks_the_batches_after_it(gate, tmp_path, caplog):
    from gradwatch.dashboard.pages.run_views import run_header

    gate.rule = _poisoned
    run = gradwatch.init(
        project="p", server=gate.url, spool_dir=tmp_path, max_backoff=0.05, flush_interval=0.02
    )
    _log_in_a_batch_of_its_own(run, gate, "poison", at=20, steps=60)
    run.finish()

    poisoned = [r for r in gate.batches() if "poison" in r.keys]
    assert {r.seq for r in poisoned} == {poisoned[0].seq}  # one batch...
    assert len(poisoned) == SERVER_ERROR_TRIES and {r.status for r in poisoned} == {500}  # ...tried 6 times
    dead_points = poisoned[0].points
    assert run.stats.dead_lettered == dead_points and run.stats.dead_lettered_batches == 1
    assert run.stats.dropped == 0 and run.stats.spooled == 0
    assert run.stats.sent + dead_points == 61
    # The batches after it are stored: the queue went on.
    dead_steps = {step for s in poisoned[0].batch["scalars"] if s["key"] == "x" for step in s["steps"]}
    x = stored(gate.url, run.id, "x")
    assert set(x) == set(range(60)) - dead_steps and max(x) == 59
    later = [r for r in gate.batches() if r.seq is not None and r.seq > poisoned[0].seq and r.status == 200]
    assert later
    # Beside the spool, for `gradwatch sync`; the server was told (event + health key), the run page shows it.
    spool = tmp_path / spool_file_name(run.id, 0)
    dead = dead_letter_path(spool)
    assert not spool.exists() and dead.exists()
    records = scan(dead).records
    assert [r.type for r in records] == ["run", "dead_letter", "batch"]
    assert records[2].seq == poisoned[0].seq and "HTTP 500" in (records[1].reason or "")
    [notice] = events(gate.url, run.id, "dead_letter")
    first_step = min(step for series in poisoned[0].batch["scalars"] for step in series["steps"])
    assert (notice["step"], notice["data"]["points"]) == (first_step, dead_points)
    assert "injected: this batch crashes the server" in notice["data"]["reason"]
    assert str(dead) in notice["data"]["hint"]
    health = {"dead-lettered": stored(gate.url, run.id, "agent/dead_lettered")}
    assert set(health["dead-lettered"].values()) == {float(dead_points)}
    header = json.dumps(
        run_header({"id": run.id, "name": "n"}, {"dead-lettered": float(dead_points)}).to_plotly_json(),
        default=str,
    )
    assert "dead-lettered" in header
    text = gradwatch_warnings(caplog)
    assert (
        f"is moved to {dead}" in text
        and f"1 batches ({dead_points} points) the server would not take" in text
    )

    # The server is fixed: `gradwatch sync` of the spool folder retries the dead letter, once; the
    # dead-letter file goes once the server has it (kept here for the second sync).
    gate.rule = lambda request: None
    report = sync(tmp_path, gate.url, keep=True, log=lambda _line: None)
    assert report.complete and report.dead_letters_sent == 1 and report.points_sent == dead_points
    assert set(stored(gate.url, run.id, "x")) == set(range(60))
    assert stored(gate.url, run.id, "poison") == {20: 1.0}
    again = sync(tmp_path, gate.url, log=lambda _line: None)
    assert again.batches_sent == 0 and again.skipped == 1
    assert again.removed == [str(dead)] and not dead.exists()
    assert len(events(gate.url, run.id, "dead_letter")) == 1


def test_a_4xx_refusal_is_dead_lettered_after_a_bounded_number_of_tries(gate, tmp_path):
    gate.rule = lambda r: (422, "scalars.0.key: unknown") if "bad" in r.keys else None
    run = gradwatch.init(
        project="p", server=gate.url, spool_dir=tmp_path, max_backoff=0.05, flush_interval=0.02
    )
    _log_in_a_batch_of_its_own(run, gate, "bad", at=10, steps=40)
    run.finish()

    refused = [r for r in gate.batches() if "bad" in r.keys]
    seq = refused[0].seq
    assert {r.seq for r in refused} == {seq} and {r.status for r in refused} == {422}
    tries = [r for r in refused if r.gzip] or refused  # a refused gzip body is re-sent plain at once
    assert len(tries) == REFUSAL_TRIES
    assert run.stats.dead_lettered_batches == 1 and run.stats.dead_lettered == refused[0].points
    assert max(stored(gate.url, run.id, "x")) == 39
    assert [
        r.seq
        for r in scan(dead_letter_path(tmp_path / spool_file_name(run.id, 0))).records
        if r.type == "batch"
    ] == [seq]
    assert "unknown" in events(gate.url, run.id, "dead_letter")[0]["data"]["reason"]


def test_an_auth_refusal_is_never_dead_lettered_the_batches_wait_for_a_fixed_token(gate, tmp_path, caplog):
    gate.rule = _refuse_batches(401, "invalid or expired token")
    run = gradwatch.init(
        project="p", server=gate.url, spool_dir=tmp_path, max_backoff=0.05, flush_interval=0.02
    )
    for step in range(30):
        run.log({"x": float(step)}, step=step)
        time.sleep(0.005)
    run.finish(stall_timeout=3.0)

    spool = tmp_path / spool_file_name(run.id, 0)
    assert len(gate.batches()) > REFUSAL_TRIES + SERVER_ERROR_TRIES  # tried on and on
    assert run.stats.dead_lettered == 0 and run.stats.dropped == 0 and run.stats.spooled == 30
    assert not dead_letter_path(spool).exists()
    text = gradwatch_warnings(caplog)
    assert "refused the token" in text and "GRADWATCH_TOKEN" in text and "--token" in text
    # With a good token (here: the gate lets it through), sync sends everything.
    gate.rule = lambda request: None
    assert sync(spool, gate.url, log=lambda _line: None).complete
    assert set(stored(gate.url, run.id, "x")) == set(range(30))


def test_a_413_splits_the_batch_until_it_fits_and_a_single_step_too_large_is_dead_lettered(gate, tmp_path):
    gate.rule = lambda r: (413, "the batch has too many points") if r.points > 150 else None
    run = gradwatch.init(project="p", server=gate.url, spool_dir=tmp_path, max_backoff=0.05)
    for step in range(100):
        run.log({f"k{i}": float(step) for i in range(10)}, step=step)  # 1,000 points, one batch
    run.log({f"wide{i}": 1.0 for i in range(200)}, step=100)  # one step of 200 points: cannot be split
    run.finish()

    assert run.stats.dead_lettered == 200 and run.stats.dead_lettered_batches == 1
    assert run.stats.sent == 1000 and run.stats.dropped == 0
    assert set(stored(gate.url, run.id, "k0")) == set(range(100)) == set(stored(gate.url, run.id, "k9"))
    assert max(r.points for r in gate.batches() if r.status == 200) <= 150
    [dead] = [
        r for r in scan(dead_letter_path(tmp_path / spool_file_name(run.id, 0))).records if r.type == "batch"
    ]
    assert dead.points == 200


def test_sync_leaves_a_batch_that_keeps_failing_for_later_and_goes_on(gate, tmp_path):
    # An offline spool with a poison batch in the middle: sync reports it and uploads the others. Three
    # offline sessions of one run, each its own batch (an offline run seals a batch a second, and a
    # slow machine could merge all 30 steps into one).
    run_id = f"offline-{time.monotonic_ns()}"
    for steps in (range(15), range(15, 16), range(16, 30)):
        run = gradwatch.init(project="p", run_id=run_id, mode="offline", spool_dir=tmp_path)
        for step in steps:
            run.log({"x": float(step)} | ({"poison": 1.0} if step == 15 else {}), step=step)
        run.finish()
    gate.rule = _poisoned
    report = sync(tmp_path, gate.url, max_backoff=0.05, log=lambda _line: None)
    assert len(report.failed) == 1 and report.error is None and not report.complete
    assert report.batches_sent >= 1
    poisoned = {r.seq for r in gate.batches() if "poison" in r.keys}
    assert len(poisoned) == 1 and len(gate.batches(poisoned.pop())) == SERVER_ERROR_TRIES
    x = stored(gate.url, run.id, "x")
    assert 15 not in x and max(x) == 29
    gate.rule = lambda request: None
    assert sync(tmp_path, gate.url, log=lambda _line: None).complete  # the failed batch, now
    assert set(stored(gate.url, run.id, "x")) == set(range(30))


def test_sync_can_leave_dead_letters_out(gate, tmp_path):
    gate.rule = _poisoned
    run = gradwatch.init(
        project="p", server=gate.url, spool_dir=tmp_path, max_backoff=0.05, flush_interval=0.02
    )
    for step in range(20):
        run.log({"x": float(step)} | ({"poison": 1.0} if step == 5 else {}), step=step)
        time.sleep(0.005)
    run.finish()
    assert run.stats.dead_lettered_batches == 1
    gate.rule = lambda request: None
    assert sync(tmp_path, gate.url, dead_letters=False, log=lambda _line: None).batches_sent == 0
    assert (
        sync(tmp_path / spool_file_name(run.id, 0), gate.url, log=lambda _line: None).dead_letters_sent == 1
    )


# -- the spool file: retire records, fsync ----------------------------------------------------------------

RUN = {"id": "run-1", "project": "p", "name": "n", "config": {}, "metadata": {}}


def _batch(seq: int, *steps: int) -> dict[str, Any]:
    return {
        "rank": 0,
        "seq": seq,
        "scalars": [{"key": "x", "steps": list(steps), "values": [0.5] * len(steps)}],
        "events": [],
    }


def test_split_and_dead_lettered_batches_in_the_file_are_not_replayed(tmp_path):
    path = tmp_path / "run-1-rank0.jsonl"
    spool = Spool(path, RUN)
    for seq in (1, 2, 3):
        spool.add(_batch(seq, seq * 10, seq * 10 + 1), 2, persist=True)
    spool.replace(2, [(_batch(10, 20), 1), (_batch(11, 21), 1)])  # split: the halves queue in its place
    assert [spool.oldest()[0]] == [1]
    spool.remove(1)
    assert spool.oldest()[0] == 10
    spool.retire(3, "dead_letter")
    assert len(spool) == 2 and spool.points == 2

    resumed = Spool(path, RUN)
    assert resumed.recover() == 4  # batch 1 (sent: the server dedupes a replay) and the two halves
    assert sorted(resumed._entries) == [1, 10, 11]
    scanned = scan(path)
    assert scanned.bad_lines == 0 and scanned.retired() == {("run-1", 0, 2), ("run-1", 0, 3)}


def test_the_spool_fsyncs_while_it_is_written_at_most_once_a_second(tmp_path, monkeypatch):
    from gradwatch._buffer import StepBuffer
    from gradwatch._sender import Sender

    calls: list[float] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(time.monotonic())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    path = tmp_path / "run-1-rank0.jsonl"
    # Offline (no transport), sealing what it has every 50 ms: ~20 appends a second to the file.
    sender = Sender(None, RUN, 0, Spool(path, RUN), spill_after=0.05)
    started = time.monotonic()
    step = 0
    # At least 3.3 s, and on a loaded machine on until the third fsync (a starved collector is late).
    while (elapsed := time.monotonic() - started) < 3.3 or (len(calls) < 3 and elapsed < 30):
        buffer = StepBuffer()
        buffer.add_scalar("x", step, float(step))
        sender.submit(buffer.take([], None))
        step += 1
        time.sleep(0.005)
    during = list(calls)
    assert sender.close()

    appends = sum(1 for r in scan(path).records if r.type == "batch")
    gaps = [b - a for a, b in itertools.pairwise(during)]
    print(f"{appends} appends, {len(during)} fsyncs in {elapsed:.1f} s; gaps {[round(g, 2) for g in gaps]}")
    assert appends >= 10 and len(during) >= 3  # written data reaches the disk within about a second
    assert min(gaps) >= 0.95  # but an fsync at most once a second, however often it is written
    assert len(calls) <= len(during) + 1  # close() adds one
    assert spooled_points(path) == step


def test_an_idle_run_keeps_telling_the_server_it_is_alive(sqlite_server, monkeypatch):
    """A long evaluation or checkpoint save logs nothing: the sender still sends the agent's health
    counters every KEEPALIVE_S, so the server's liveness sweep (silent runs become "crashed: no
    heartbeat") does not take the job for dead. Nothing else is sent, and no step is added."""
    from gradwatch import _sender

    monkeypatch.setattr(_sender, "KEEPALIVE_S", 0.3)
    with gradwatch.init(project="idle", name="eval", server=sqlite_server.url, flush_interval=0.05) as run:
        run.log({"loss": 1.0}, step=0)
        time.sleep(0.1)  # the next log() is past flush_interval: both are flushed
        run.log({"loss": 0.5}, step=1)
        deadline = time.monotonic() + 10
        while run.stats.sent < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

        def updated_at() -> str:
            with urllib.request.urlopen(f"{sqlite_server.url}/api/v1/runs/{run.id}") as answer:
                return str(json.loads(answer.read())["updated_at"])

        first = updated_at()
        deadline = time.monotonic() + 10  # idle: a keep-alive every 0.3 s, however loaded the machine
        while updated_at() == first and time.monotonic() < deadline:
            time.sleep(0.1)
        assert updated_at() > first
    with urllib.request.urlopen(f"{sqlite_server.url}/api/v1/runs/{run.id}/series?key=loss") as answer:
        series = json.loads(answer.read())
    assert series["steps"] == [0, 1] and series["values"] == [1.0, 0.5]
    assert run.stats.dropped == 0


def _wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
