"""How batches leave the process. The sender's upload thread calls a Transport; tests pass their own.

TransportError          a request failed; .retryable says whether the same request can succeed later
"""

from __future__ import annotations

import gzip
import http.client
import ipaddress
import json
import math
import random
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol

from ._delivery import classify
from ._errors import GradwatchError
from ._http import read_bounded
from ._wire import dumps

# Bodies smaller than this go uncompressed: gzip's header and CPU are not worth it (bytes).
COMPRESS_ABOVE = 1024
# zlib level 1: ~2.7x on batch JSON at a third of level 6's CPU time (measured on batch documents).
COMPRESS_LEVEL = 1


def is_loopback_url(url: str) -> bool:
    """Whether an http(s) URL names this machine: localhost, 127.0.0.0/8 or ::1."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# The longest Retry-After the agent honours (seconds): a server asking for more is retried sooner.
MAX_RETRY_AFTER = 300.0


def parse_retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds, at most MAX_RETRY_AFTER; None when absent or not a number of
    seconds (the HTTP-date form is not used by gradwatch servers)."""
    try:
        seconds = float((value or "").strip())
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER) if math.isfinite(seconds) else None


class TransportError(GradwatchError):
    """A request failed; `retryable` says whether sending the same thing again can succeed.

    `status` is the HTTP status when the server answered, else None (connection refused, timeout).
    `retry_after`: seconds the server asked to wait (a 429 or 503's Retry-After), else None.
    """

    def __init__(
        self, message: str, retryable: bool, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after


class Transport(Protocol):
    def create_run(self, run: dict[str, Any]) -> Any: ...

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> Any: ...


class HttpTransport:
    """POSTs JSON to a gradwatch server with the standard library (no dependency), gzip-compressed
    unless the server is on this machine.

    `timeout` (seconds) bounds each request, connection included. `compress`: True or False, or None
    (the default) to compress except to a loopback address (localhost, 127.0.0.0/8, ::1), where bytes
    cost nothing to carry and deflating them costs the agent about a third of a microsecond a point.
    A server that cannot read gzip (one older than this agent) is detected on the first refusal and
    sent plain JSON from then on.

    Each thread keeps its connection open between requests (HTTP keep-alive): no TCP (or TLS)
    handshake per batch, and a batch does not wait in the server's accept queue behind a flood of new
    connections. A kept connection that the server has closed meanwhile (its keep-alive timeout) is
    replaced once, at once. Where the environment names a proxy for the server (http_proxy,
    https_proxy, no_proxy), requests go through urllib, a connection each, as before.
    """

    def __init__(
        self, server: str, token: str | None = None, timeout: float = 10.0, compress: bool | None = None
    ) -> None:
        if not server.startswith(("http://", "https://")):
            raise ValueError(f"server must be an http:// or https:// URL, got {server!r}")
        self.base = server.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.compress = not is_loopback_url(self.base) if compress is None else compress
        parts = urllib.parse.urlsplit(self.base)
        self._https = parts.scheme == "https"
        self._netloc = parts.netloc
        self._prefix = parts.path  # a server mounted under a path: https://host/gradwatch
        self._direct = not _proxied(parts.scheme, parts.hostname or "")
        self.ask_incidents = False  # answers carry the run's open incidents (a guard: gradwatch._guard)
        self._kept = threading.local()
        self._lock = threading.Lock()
        self._open: list[http.client.HTTPConnection] = []  # every thread's kept connection, for close()

    def create_run(self, run: dict[str, Any]) -> dict[str, Any]:
        """Create (or find) the run on the server; idempotent. Returns the run as stored (its "id" is
        the one to send batches to)."""
        return self._post("/api/v1/runs", json.dumps(run, allow_nan=False).encode())

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """Store one batch; returns the server's acknowledgement ({"duplicate", "points", "events"})."""
        return self.send_encoded(run_id, dumps(batch).encode())

    def send_encoded(self, run_id: str, body: bytes) -> dict[str, Any]:
        """send_batch for a batch already encoded as JSON (a spool record is sent as it was written).
        With ask_incidents (a guard watches the run), the answer carries the run's open incidents."""
        query = "?guard=true" if self.ask_incidents else ""
        # quoted: a run id read from a spool file is not trusted to be one path segment (u1/../../alert-rules)
        return self._post(f"/api/v1/runs/{urllib.parse.quote(run_id, safe='')}/batches{query}", body)

    def close(self) -> None:
        """Close the kept connections (a later request opens a new one)."""
        with self._lock:
            connections, self._open = self._open, []
        for connection in connections:
            connection.close()

    def _post(self, path: str, body: bytes) -> dict[str, Any]:
        compressed = self.compress and len(body) > COMPRESS_ABOVE
        try:
            return self._request(path, body, compressed)
        except TransportError as exc:
            # An older server reads the gzip bytes as (invalid) JSON: 400/415/422. Try once without.
            if not compressed or exc.status not in (400, 415, 422):
                raise
            answer = self._request(path, body, compressed=False)
            self.compress = False
            return answer

    def _request(self, path: str, body: bytes, compressed: bool) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if compressed:
            body = gzip.compress(body, compresslevel=COMPRESS_LEVEL)
            headers["Content-Encoding"] = "gzip"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self._direct:
            status, answer, retry_after = self._kept_alive(path, body, headers)
        else:
            status, answer, retry_after = self._through_urllib(path, body, headers)
        if status >= 300:
            detail = answer[:500].decode("utf-8", "replace")
            verdict = classify(status)  # what each status means: gradwatch._delivery.classify
            wait = parse_retry_after(retry_after) if verdict.honours_retry_after else None
            raise TransportError(f"POST {path}: HTTP {status}: {detail}", verdict.retryable, status, wait)
        try:
            parsed = json.loads(answer) if answer else {}
        except ValueError:
            parsed = {}
        return parsed if isinstance(parsed, dict) else {}

    def _kept_alive(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str | None]:
        connection = getattr(self._kept, "connection", None)
        reused = connection is not None and connection.sock is not None
        if connection is None:
            connection = self._kept.connection = self._connection()
        try:
            return self._exchange(connection, path, body, headers)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
            connection.close()
            if not reused:
                raise TransportError(f"POST {path}: {type(exc).__name__}: {exc}", retryable=True) from None
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise TransportError(f"POST {path}: {type(exc).__name__}: {exc}", retryable=True) from None
        # The server closed the kept connection while it idled: the request never reached it (a batch
        # that did is stored once all the same: the server drops a repeated seq). Once more, anew.
        try:
            return self._exchange(connection, path, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise TransportError(f"POST {path}: {type(exc).__name__}: {exc}", retryable=True) from None

    def _exchange(
        self, connection: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        connection.request("POST", self._prefix + path, body=body, headers=headers)
        response = connection.getresponse()
        try:  # bounded in size and in time as a whole: a broken or hostile server holds no memory
            answer = read_bounded(response, time.monotonic() + self.timeout if self.timeout else None)
        except ConnectionError as exc:
            connection.close()
            raise TransportError(f"POST {path}: {exc}", retryable=True) from None
        if response.will_close:
            connection.close()
        return response.status, answer, response.getheader("Retry-After")

    def _connection(self) -> http.client.HTTPConnection:
        connection: http.client.HTTPConnection
        if self._https:
            connection = http.client.HTTPSConnection(
                self._netloc, timeout=self.timeout, context=ssl.create_default_context()
            )
        else:
            connection = http.client.HTTPConnection(self._netloc, timeout=self.timeout)
        with self._lock:
            self._open.append(connection)
        return connection

    def _through_urllib(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        request = urllib.request.Request(self.base + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                deadline = time.monotonic() + self.timeout if self.timeout else None
                return response.status, read_bounded(response, deadline), None
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read()[:500], exc.headers.get("Retry-After")
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise TransportError(f"POST {path}: {type(exc).__name__}: {reason}", retryable=True) from None


def _proxied(scheme: str, host: str) -> bool:
    """Whether urllib would send a request for `scheme://host` through a proxy (environment variables
    or, on macOS and Windows, the system's settings)."""
    try:
        return scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(host)
    except Exception:  # noqa: BLE001 - a broken proxy configuration: leave it to urllib, as before
        return True


@dataclass
class Backoff:
    """Exponential backoff with jitter: the n-th failure in a row waits min(cap, base·2^(n-1)) seconds
    times a random factor in [0.5, 1), so many agents recovering together do not retry in step."""

    base: float = 0.25
    cap: float = 30.0
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError(
                f"backoff needs 0 < base <= cap (seconds), got base={self.base!r}, cap={self.cap!r}"
            )

    def next_delay(self) -> float:
        self.failures += 1
        return min(self.cap, self.base * 2.0 ** min(self.failures - 1, 30)) * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0
