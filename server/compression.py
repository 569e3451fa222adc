"""Compressed request bodies: agents send batches with Content-Encoding: gzip.

GzipRequestBody is a pure ASGI middleware: it inflates a gzip body before the application reads it,
stopping as soon as the inflated size passes a cap (a small gzip body can inflate to gigabytes), and
hands the application an ordinary identity-encoded request. Outcomes:
    413  inflated body larger than max_bytes
    400  "invalid gzip body" (corrupt or truncated data)
    415  a Content-Encoding other than gzip or identity
Register it inside BodySizeLimit, which then caps the compressed size.
"""

from __future__ import annotations

import zlib

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_GZIP = 16 + zlib.MAX_WBITS  # zlib's window bits for the gzip container


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
        if encoding in (b"", b"identity"):
            await self.app(scope, receive, send)
            return
        try:
            if encoding not in (b"gzip", b"x-gzip"):
                raise _Refused(
                    415, f"unsupported Content-Encoding {encoding.decode('latin-1')!r}; use gzip or none"
                )
            inflater = _Inflater(self.max_bytes)
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client went away: nobody to answer
                inflater.feed(message.get("body", b""))
                more = message.get("more_body", False)
            body = inflater.finish()
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
