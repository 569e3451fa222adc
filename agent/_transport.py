"""How batches leave the process. The sender thread calls a Transport; tests pass their own."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Protocol


class TransportError(Exception):
    """A request failed; `retryable` says whether sending the same thing again can succeed."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class Transport(Protocol):
    def create_run(self, run: dict[str, Any]) -> None: ...

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> None: ...


class HttpTransport:
    """POSTs JSON to a gradwatch server with the standard library (no extra dependency)."""

    def __init__(self, server: str, token: str | None = None, timeout: float = 10.0) -> None:
        self.base = server.rstrip("/")
        self.token = token
        self.timeout = timeout

    def create_run(self, run: dict[str, Any]) -> None:
        self._post("/api/v1/runs", run)

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> None:
        self._post(f"/api/v1/runs/{run_id}/batches", batch)

    def _post(self, path: str, document: dict[str, Any]) -> None:
        body = json.dumps(document, allow_nan=False).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.base + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode("utf-8", "replace")
            # 5xx and 429 are the server's trouble and pass; other 4xx mean this request is wrong.
            retryable = exc.code >= 500 or exc.code in (408, 429)
            raise TransportError(f"POST {path}: HTTP {exc.code}: {detail}", retryable) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise TransportError(f"POST {path}: {exc}", retryable=True) from exc
