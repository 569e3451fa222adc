"""`gradwatch sync` over files it should not trust (issue 39, item 6): a planted link named like a .sent
list, a FIFO named like a spool file, a line with a valid checksum over fields of the wrong type, and a
run id that is not one path segment. Real spool files, a real server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import threading
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
