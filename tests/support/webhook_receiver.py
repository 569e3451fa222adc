"""A real HTTP receiver on 127.0.0.1 for webhook tests: records every POST it gets."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class WebhookReceiver:
    """start() on a port (0: any free one), stop(); `status` is what it answers (e.g. 500 to fail)."""

    def __init__(self, port: int = 0, status: int = 200) -> None:
        self.port = port
        self.status = status
        self.redirect_to: str | None = None  # answer 307 with this Location instead
        self.hold: threading.Event | None = None  # answer only once this is set (a slow receiver)
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> WebhookReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.received.append(Received(self.path, dict(self.headers.items()), body))
                if receiver.hold is not None:
                    receiver.hold.wait(60)
                self.send_response(307 if receiver.redirect_to else receiver.status)
                if receiver.redirect_to:
                    self.send_header("Location", receiver.redirect_to)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="webhook-receiver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(5)
            self._server = None

    def __enter__(self) -> WebhookReceiver:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def bodies(self) -> list[Any]:
        with self._lock:
            return [r.json for r in self.received]

    def wait_for(self, count: int, timeout: float = 15.0) -> list[Received]:
        """Wait until at least `count` requests arrived; returns them all."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if len(self.received) >= count:
                    return list(self.received)
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"expected {count} webhook requests within {timeout} s, got {len(self.received)}"
                )
            time.sleep(0.02)


def settled_deliveries(
    api: Any, webhook_id: int, count: int = 1, timeout: float = 30.0
) -> list[dict[str, Any]]:
    """A webhook's deliveries (newest first) through the API client `api`, once at least `count` exist
    and all are delivered or failed: the outbox records a delivery after the receiver has answered."""
    deadline = time.monotonic() + timeout
    while True:
        data: list[dict[str, Any]] = api.get(f"/api/v1/webhooks/{webhook_id}/deliveries").json()["data"]
        if len(data) >= count and all(d["status"] in ("delivered", "failed") for d in data):
            return data
        assert time.monotonic() < deadline, data
        time.sleep(0.05)


class MisbehavingReceiver:
    """A webhook receiver on 127.0.0.1 that reads the request, then either drips its answer a byte every
    `drip_s` seconds ("drip") or answers 200 with a 1 GB body it keeps sending ("huge"); counts what it
    sent. Used by the hostile-tenant tests and bench/ingest_isolation.py's slow_webhooks attack."""

    def __init__(self, mode: str, drip_s: float = 1.0) -> None:
        self.mode = mode
        self.drip_s = drip_s
        self.sent = 0
        self.requests = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/hook"
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection) -> None:
        with connection:
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(
                next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            )
            while len(body) < length:
                body += connection.recv(65536)
            self.requests += 1
            try:
                if self.mode == "drip":
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                        connection.sendall(bytes([byte]))
                        self.sent += 1
                        time.sleep(self.drip_s)
                else:
                    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
                    chunk = b"x" * (1 << 20)
                    while self.sent < 1_000_000_000 and not self._stop.is_set():
                        connection.sendall(chunk)
                        self.sent += len(chunk)
            except OSError:
                pass  # the client went away: what was sent is counted

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
