"""The read clients (gradwatch.Api and the CLI, through gradwatch._http's standard-library send) against a
hostile or broken server on 127.0.0.1 (issue 39, items 4 and 5): the token never follows a redirect to
another origin; an answer is bounded in size as sent and once inflated, and in time as a whole."""

from __future__ import annotations

import gzip
import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from gradwatch._errors import ApiUnreachable
from gradwatch._http import MAX_ANSWER_BYTES, READ_API, HttpCore


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class Elsewhere(BaseHTTPRequestHandler):
    """Another origin: records the Authorization header each request brought."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        body = b'{"data": [], "count": 0}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def elsewhere() -> Iterator[ThreadingHTTPServer]:
    Elsewhere.seen = []
    yield from _serve(Elsewhere)


def _redirecting(target: str) -> type[BaseHTTPRequestHandler]:
    class Redirecting(BaseHTTPRequestHandler):
        seen: ClassVar[list[str | None]] = []

        def do_GET(self) -> None:
            type(self).seen.append(self.headers.get("Authorization"))
            if self.path.startswith("/api/v1/runs"):
                self.send_response(302)
                self.send_header("Location", target if target else "/moved/api")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = b'{"data": [], "count": 0}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Redirecting


def test_the_token_never_follows_a_redirect_to_another_origin(elsewhere):
    """urllib's own redirect handler copies Authorization to wherever the server points: another host
    (or port) would get the project's token."""
    other = f"http://127.0.0.1:{elsewhere.server_address[1]}/api/v1/runs"
    handler = _redirecting(other)
    for server in _serve(handler):
        core = HttpCore(
            f"http://127.0.0.1:{server.server_address[1]}", token="gw_secret", timeout=10, wording=READ_API
        )
        assert core.request("GET", "/api/v1/runs") == {"data": [], "count": 0}
    assert handler.seen == ["Bearer gw_secret"] and Elsewhere.seen == [None]


def test_a_redirect_within_the_origin_keeps_the_token():
    handler = _redirecting("")  # a relative Location: the same server
    for server in _serve(handler):
        core = HttpCore(
            f"http://127.0.0.1:{server.server_address[1]}", token="gw_secret", timeout=10, wording=READ_API
        )
        core.request("GET", "/api/v1/runs")
    assert handler.seen == ["Bearer gw_secret", "Bearer gw_secret"]


class Bomb(BaseHTTPRequestHandler):
    """A small gzip answer that inflates past the cap (65 MiB of zeros, ~65 KB on the wire)."""

    body = gzip.compress(b"\0" * (MAX_ANSWER_BYTES + 2**20), compresslevel=9)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_gzip_bomb_is_refused_without_taking_the_memory_it_would_inflate_to():
    for server in _serve(Bomb):
        core = HttpCore(f"http://127.0.0.1:{server.server_address[1]}", timeout=30, wording=READ_API)
        tracemalloc.start()
        try:
            with pytest.raises(ApiUnreachable, match="inflates to more than 64 MiB"):
                core.request("GET", "/api/v1/runs")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 2 * MAX_ANSWER_BYTES  # gzip.decompress of the whole would have taken 65 MiB and more


class Drip(BaseHTTPRequestHandler):
    """Headers at once, then one byte of body every 0.2 s for ever (each read well within any timeout)."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(10**6))
        self.end_headers()
        try:
            while True:
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


def test_a_dripping_server_cannot_hold_a_request_past_its_timeout():
    outcome: list[BaseException] = []
    for server in _serve(Drip):
        core = HttpCore(f"http://127.0.0.1:{server.server_address[1]}", timeout=2, wording=READ_API)

        def ask(core: HttpCore = core) -> None:
            try:
                core.request("GET", "/api/v1/runs")
            except BaseException as exc:  # noqa: BLE001 - kept for the assertion
                outcome.append(exc)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(60)  # a condition with a bound: before, this request never ended
        assert not asking.is_alive(), "the request is still reading a byte every 0.2 s"
    assert isinstance(outcome[0], ApiUnreachable) and "did not arrive in time" in str(outcome[0])


def _answering(body: bytes) -> type[BaseHTTPRequestHandler]:
    class Answering(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Answering


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"data": [1], "count": 1}', "is not shaped as a gradwatch server's"),
        (b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b', "count": 1}', "not JSON"),
    ],
    ids=["wrong shape", "nested 100k deep"],
)
def test_the_cli_says_one_line_on_json_of_another_shape_or_depth(body, said):
    """`gradwatch runs` against a server answering JSON that is no gradwatch answer printed a traceback
    (AttributeError on {"data": [1]}; RecursionError on deep nesting): now one line and exit status 1."""
    import subprocess
    import sys

    for server in _serve(_answering(body)):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gradwatch.cli",
                "runs",
                "--server",
                f"http://127.0.0.1:{server.server_address[1]}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
