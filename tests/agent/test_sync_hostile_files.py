"""`gradwatch sync` over files it should not trust (issue 39, items 6 and 11): a planted link named like a
.sent list, a FIFO named like a spool file, a line with a valid checksum over fields of the wrong type, a
run id that is not one path segment, a file a live run still writes, a .sent list from before a
database reset, and a batch line of tens of MB (held once). Real spool files, a real server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
import zlib
from pathlib import Path

import httpx

import gradwatch
from gradwatch._spool import spool_file_name
from gradwatch.sync import sync


def _offline_run(home: Path) -> tuple[gradwatch.Run, Path]:
    run = gradwatch.init(project="p", mode="offline", spool_dir=home / "offline")
    for step in range(30):
        run.log({"x": step * 0.25}, step=step)
    run.finish()
    return run, home / "offline" / spool_file_name(run.id, 0)


def _line(document: dict) -> bytes:
    payload = json.dumps(document).encode()
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def test_a_planted_sent_link_is_never_followed(tmp_path, sqlite_server):
    """The .sent list is appended to after each acknowledged batch: a link in its place made sync append
    to whatever it pointed at."""
    _run, spool = _offline_run(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    spool.with_name(spool.name + ".sent").symlink_to(victim)
    report = sync(spool, sqlite_server.url, keep=True, log=lambda _line: None)
    assert report.error is None and report.batches_sent >= 1
    assert victim.read_text() == "precious\n"


def test_a_fifo_named_like_a_spool_file_is_passed_over_not_waited_on(tmp_path, sqlite_server):
    """`gradwatch sync x.jsonl` where x.jsonl is a FIFO: reading it waited for ever."""
    fifo = tmp_path / "trap.jsonl"
    os.mkfifo(fifo)
    outcome: list = []
    syncing = threading.Thread(
        target=lambda: outcome.append(sync(fifo, sqlite_server.url, log=lambda _line: None)), daemon=True
    )
    syncing.start()
    syncing.join(120)  # a condition with a bound: before, this thread never returned
    assert not syncing.is_alive(), "sync is waiting on the FIFO"
    assert outcome[0].error is None and outcome[0].files == 0


def test_a_line_with_a_valid_checksum_and_fields_of_the_wrong_type_is_a_bad_line(tmp_path, sqlite_server):
    """Before, one such line stopped the sync of the whole folder with a traceback."""
    run, spool = _offline_run(tmp_path)
    with spool.open("ab") as file:
        file.write(_line({"type": "batch", "run_id": run.id, "batch": {"rank": "zero", "seq": "x"}}))
        file.write(_line({"type": "batch", "run_id": ["not", "a", "string"], "batch": {"seq": 99}}))
    report = sync(spool, sqlite_server.url, keep=True, log=lambda _line: None)
    assert report.error is None and report.bad_lines == 2
    with httpx.Client(base_url=sqlite_server.url) as client:
        assert client.get(f"/api/v1/runs/{run.id}").json()["last_step"] == 29


def test_a_run_id_that_is_not_one_path_segment_stays_one():
    """A spool file can name run u1/../../../alert-rules: its batches went to /api/v1/runs/u1/../../..
    (a proxy that resolves dot segments sends that to /api/v1/alert-rules/batches). The id is quoted as
    one path segment now."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gradwatch._transport import HttpTransport

    paths: list[str] = []

    class Recording(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            paths.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b'{"duplicate": false, "points": 0, "events": 0}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        transport = HttpTransport(f"http://127.0.0.1:{server.server_address[1]}")
        transport.send_batch("u1/../../../alert-rules", {"rank": 0, "seq": 0})
        transport.close()
    finally:
        server.shutdown()
        server.server_close()
    assert paths == ["/api/v1/runs/u1%2F..%2F..%2F..%2Falert-rules/batches"]


def test_a_run_id_with_cr_lf_is_refused_at_once_not_retried(tmp_path, sqlite_server):
    """An id with CR/LF made the request line invalid on our side (http.client refuses it), which sync
    took for an outage and retried for give_up_after seconds; quoted, the server answers and refuses it."""
    spool = tmp_path / "crlf.jsonl"
    spool.write_bytes(
        _line({"type": "batch", "run_id": "a\r\nb", "batch": {"rank": 0, "seq": 0, "scalars": []}})
    )
    report = sync(spool, sqlite_server.url, keep=True, give_up_after=600, log=lambda _line: None)
    assert report.error is None and report.batches_sent == 0
    assert report.refused and "404" in report.refused[0] and "a%0D%0Ab" in report.refused[0]


# -- issue 39, item 11 and the rest of item 6 ---------------------------------------------------------


def test_sync_leaves_a_file_a_live_run_is_writing_to_that_run(tmp_path, sqlite_server):
    """A live run holds a shared lock on its spool file; sync asks for an exclusive one and leaves the
    file alone (it deleted it under a run still appending before). Once the run finished, sync takes it."""
    run = gradwatch.init(project="p", mode="offline", spool_dir=tmp_path / "offline")
    for step in range(30):
        run.log({"x": float(step)}, step=step)
    spool = tmp_path / "offline" / spool_file_name(run.id, 0)
    deadline = time.monotonic() + 30
    while not spool.exists():  # the offline run writes its batches from its sender thread
        assert time.monotonic() < deadline
        run.log({"x": 1.0})
        time.sleep(0.05)
    report = sync(spool, sqlite_server.url, log=lambda _line: None)
    assert report.batches_sent == 0 and spool.exists()
    assert report.kept == [
        f"{spool}: a running process is writing it (it sends its own batches); sync it again once it ended"
    ]
    run.finish()
    done = sync(spool, sqlite_server.url, log=lambda _line: None)
    assert done.complete and done.removed == [str(spool)] and done.points_sent >= 30


def test_a_sent_list_from_before_a_database_reset_does_not_skip_batches(
    tmp_path, sqlite_server, database_url
):
    """The .sent list trusts the server to still hold what it acknowledged; for a run the server holds
    nothing of (a new database), every batch is sent again (a stale list skipped them all)."""
    from conftest import free_port

    from gradwatch.server.database import make_engine, prepare_schema
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    _run, spool = _offline_run(tmp_path)
    assert sync(spool, sqlite_server.url, keep=True, log=lambda _line: None).complete
    assert spool.with_name(spool.name + ".sent").read_text().count("\n") >= 1
    fresh_url = f"sqlite:///{tmp_path / 'fresh.db'}"  # the team's server came back on a new database
    prepare_schema(make_engine(fresh_url), fresh_url)
    fresh = BackgroundServer(Settings(database_url=fresh_url), "127.0.0.1", free_port(), with_dashboard=False)
    fresh.start()
    try:
        report = sync(spool, fresh.url, log=lambda _line: None)
        assert report.complete and report.skipped == 0 and report.points_sent == 30
        series = httpx.get(
            f"{fresh.url}/api/v1/runs/{_run.id}/series", params={"key": "x"}, timeout=30
        ).json()
        assert len(series["steps"]) == 30
    finally:
        fresh.stop()


def test_reading_a_batch_back_holds_it_once_not_twice(tmp_path):
    """A spool line of ~24 MB: scanning the file and reading the batch back each hold about one copy of
    it (they held two and three)."""
    from gradwatch._spool import Spool, read_batch_json, scan

    spool = Spool(tmp_path / "big-rank0.jsonl", {"id": "big", "project": "p"}, keep_file=True)
    steps = list(range(1_000_000))
    batch = {"rank": 0, "seq": 0, "scalars": [{"key": "x", "steps": steps, "values": [0.5] * len(steps)}]}
    spool.add(batch, len(steps), persist=True)
    spool.close()
    size = spool.path.stat().st_size
    assert size > 10_000_000
    tracemalloc.start()
    try:
        scanned = scan(spool.path)
        scan_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        [record] = [r for r in scanned.records if r.type == "batch"]
        body = read_batch_json(spool.path, record)
        read_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert body is not None and json.loads(body)["seq"] == 0
    assert scan_peak < 1.3 * size, (scan_peak, size)
    assert read_peak < 1.3 * size, (read_peak, size)
