"""Compressed request bodies: agents send batches with Content-Encoding: gzip.

GzipRequestBody is a pure ASGI middleware: it inflates a gzip body before the application reads it,
stopping as soon as the inflated size passes a cap (a small gzip body can inflate to gigabytes), and
hands the application an ordinary identity-encoded request. Only where a body is expected: a POST, PUT
or PATCH under /api/, which AuthenticateBeforeBody (outside it) has let through with a token of the
scope the write needs; a compressed body of any other request is never read (a GET's, /healthz's:
four unauthenticated threads sending gzip bombs to /healthz held another tenant's ingest at 1.4 s).
The inflation runs on the thread pool, off the event loop. Outcomes:
    413  inflated body larger than max_bytes
    400  "invalid gzip body" (corrupt or truncated data)
    415  a Content-Encoding other than gzip or identity, or a compressed body outside /api/
Register it inside BodySizeLimit, which then caps the compressed size.
"""

from __future__ import annotations

import zlib

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_GZIP = 16 + zlib.MAX_WBITS  # zlib's window bits for the gzip container
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class _Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _Inflater:
    """Incremental gzip decoding (several concatenated members allowed), capped at max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.output = bytearray()
        self._decoder = zlib.decompressobj(_GZIP)

    def feed(self, data: bytes) -> None:
        try:
            while data:
                room = self.max_bytes - len(self.output) + 1  # one byte more than allowed detects "too big"
                self.output += self._decoder.decompress(data, room)
                if len(self.output) > self.max_bytes:
                    raise _Refused(413, f"request body larger than {self.max_bytes} bytes once decompressed")
                data = self._decoder.unconsumed_tail
                if self._decoder.eof:
                    data = self._decoder.unused_data + data
                    if data:
                        self._decoder = zlib.decompressobj(_GZIP)  # the next gzip member
        except zlib.error as exc:
            raise _Refused(400, f"invalid gzip body: {exc}") from None

    def finish(self) -> bytes:
        if not self._decoder.eof:
            raise _Refused(400, "invalid gzip body: the data ends before the gzip stream does")
        return bytes(self.output)


def _inflate(chunks: list[bytes], max_bytes: int) -> bytes:
    inflater = _Inflater(max_bytes)
    for chunk in chunks:
        inflater.feed(chunk)
    return inflater.finish()


class GzipRequestBody:
    """Inflate gzip request bodies (see the module docstring); other requests pass untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        encoding = b""
        headers = []
        for name, value in scope["headers"]:
            if name == b"content-encoding":
                encoding = value.strip().lower()
            elif name != b"content-length":
                headers.append((name, value))
        if encoding in (b"", b"identity") or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)  # a GET's (or DELETE's) body is never read
            return
        try:
            if not scope["path"].startswith("/api/"):
                raise _Refused(415, "compressed request bodies are taken under /api/ only")
            if encoding not in (b"gzip", b"x-gzip"):
                raise _Refused(
                    415, f"unsupported Content-Encoding {encoding.decode('latin-1')!r}; use gzip or none"
                )
            compressed = []  # at most BodySizeLimit's max_bytes (outside this middleware)
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client went away: nobody to answer
                compressed.append(message.get("body", b""))
                more = message.get("more_body", False)
            body = await run_in_threadpool(_inflate, compressed, self.max_bytes)
        except _Refused as refused:
            response = JSONResponse({"detail": refused.detail}, status_code=refused.status)
            await response(scope, receive, send)
            return
        headers.append((b"content-length", str(len(body)).encode()))
        delivered = False

        async def inflated_receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(dict(scope, headers=headers), inflated_receive, send)
