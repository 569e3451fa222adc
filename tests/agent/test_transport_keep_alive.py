"""The HTTP transport keeps its connection between requests: one TCP connection for many batches, a
connection the server closed while it idled replaced at once (the request not lost), and a proxy named
by the environment still used (through urllib, as before)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gradwatch._transport import HttpTransport, TransportError


class Recorder:
    """A real HTTP/1.1 server on 127.0.0.1 that answers every POST with 200 and `{"ok": true}`, and
    records each request's line and the client's port (one port per TCP connection).
    `idle_close_s`: a connection idle that long is closed by the server without a word (keep-alive's
    timeout, as uvicorn's)."""

    def __init__(self, idle_close_s: float | None = None) -> None:
        self.requests: list[tuple[str, int]] = []
        self.bodies: list[bytes] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_close_s

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.requests.append((self.requestline, self.client_address[1]))
                recorder.bodies.append(body)
                answer = b'{"ok": true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def shutdown_request(self, request: Any) -> None:
                super().shutdown_request(request)
                recorder.closed += 1  # a connection this server has closed (idle, or the client's)

        self.closed = 0
        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()

    def wait_closed(self, count: int = 1, timeout: float = 30.0) -> None:
        """Until the server has closed `count` connections (the idle timeout's thread may run late on
        a loaded machine: a fixed wait could send the next request before it did)."""
        deadline = time.monotonic() + timeout
        while self.closed < count:
            assert time.monotonic() < deadline, f"{self.closed} of {count} connections closed"
            time.sleep(0.02)

    def connections(self) -> int:
        return len({port for _, port in self.requests})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=30)


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def recorder(no_proxy: None) -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.close()


def test_many_batches_travel_on_one_connection(recorder):
    transport = HttpTransport(recorder.url)
    for seq in range(1, 6):
        assert transport.send_batch("run-1", {"seq": seq, "scalars": []}) == {"ok": True}
    transport.close()
    assert len(recorder.requests) == 5 and recorder.connections() == 1
    assert [json.loads(b)["seq"] for b in recorder.bodies] == [1, 2, 3, 4, 5]


def test_a_connection_the_server_closed_while_idle_is_replaced_and_the_batch_sent(no_proxy):
    server = Recorder(idle_close_s=0.2)
    try:
        transport = HttpTransport(server.url)
        assert transport.send_batch("run-1", {"seq": 1, "scalars": []}) == {"ok": True}
        server.wait_closed()  # the server has closed the idle connection
        assert transport.send_batch("run-1", {"seq": 2, "scalars": []}) == {"ok": True}
        transport.close()
        assert [json.loads(b)["seq"] for b in server.bodies] == [1, 2] and server.connections() == 2
    finally:
        server.close()


def test_a_server_mounted_under_a_path_gets_the_full_path(recorder):
    transport = HttpTransport(recorder.url + "/gradwatch/")
    transport.create_run({"id": "r", "project": "p"})
    transport.close()
    assert recorder.requests[0][0] == "POST /gradwatch/api/v1/runs HTTP/1.1"


def test_a_proxy_named_by_the_environment_is_still_used(recorder, monkeypatch):
    proxy = Recorder()  # a forward proxy sees the absolute URL on its request line
    try:
        monkeypatch.setenv("http_proxy", proxy.url)
        monkeypatch.setenv("no_proxy", "")
        # urlopen keeps the opener it built first, with the proxies of that moment: a new one here.
        monkeypatch.setattr(urllib.request, "_opener", None)
        transport = HttpTransport(recorder.url)
        transport.create_run({"id": "r", "project": "p"})
        assert proxy.requests[0][0] == f"POST {recorder.url}/api/v1/runs HTTP/1.1"
        assert recorder.requests == []
    finally:
        proxy.close()


def test_a_server_that_is_gone_is_a_retryable_error(no_proxy):
    server = Recorder(idle_close_s=0.2)
    transport = HttpTransport(server.url, timeout=2)
    assert transport.send_batch("run-1", {"seq": 1, "scalars": []}) == {"ok": True}
    server.close()
    server.wait_closed()  # its connection closed too: the retry finds no server
    with pytest.raises(TransportError) as failed:
        transport.send_batch("run-1", {"seq": 2, "scalars": []})
    transport.close()
    assert failed.value.retryable and failed.value.status is None
