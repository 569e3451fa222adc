"""Authentication before any work: a request under /api/ is authenticated, and a write's scope checked,
before a byte of its body is read or anything is counted for it.

The API checks tokens in a dependency, which FastAPI resolves after it has read the body: a gzip body
was inflated and JSON parsed for anyone, token or not (a 32 KB body inflating to 32 MB, from six
unauthenticated threads, slowed a real client 120x), and for a token of any scope. This pure-ASGI
middleware, outside the body limits, the gzip inflation and the per-tenant limits:

- checks the bearer token of every request under /api/ (reads too): a missing or unknown token is
  answered 401 at once (writes: with the body unread and the connection closed), so the per-tenant
  read limits only ever count verified tokens (a made-up token per request escaped them before);
- refuses a write whose token lacks the scope every such route needs (`ingest` to create runs and send
  batches, `admin` for every other write) with 403 before its body is read: a read-only token's gzip
  bomb is never inflated;
- holds the token lookups of one client address to PRE_AUTH_IN_FLIGHT at once (PRE_AUTH_QUEUE more
  wait; beyond, 429 `limit: "authentication"`): each lookup is a database query on the server's thread
  pool, and a flood of random tokens from one address took every other tenant's reads to 4.4 s.

The principal found is handed to the route's dependency in the scope, so a good token costs no second
lookup. The route still checks the project and the exact scope; this is the first gate, not the only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import Principal, Tokens, bearer
from .client_address import DEFAULT_IPV6_PREFIX_LENGTH, client_key
from .errors import Unauthenticated
from .http_errors import AsciiJSONResponse

PRINCIPAL_SCOPE_KEY = "gradwatch.principal"  # the principal this middleware authenticated
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
PRE_AUTH_IN_FLIGHT = 4
PRE_AUTH_QUEUE = 64


def write_scope(method: str, path: str) -> str:
    """The scope a write under /api/ needs: `ingest` to create a run or send its batches, else `admin`."""
    route = path.rstrip("/")
    if method == "POST" and (
        route == "/api/v1/runs" or (route.startswith("/api/v1/runs/") and route.endswith("/batches"))
    ):
        return "ingest"
    return "admin"


class AddressGate:
    """At most `in_flight` token lookups per client address at once, `queue` more waiting. Used from
    the event loop only."""

    def __init__(self, in_flight: int = PRE_AUTH_IN_FLIGHT, queue: int = PRE_AUTH_QUEUE) -> None:
        self.in_flight, self.queue = in_flight, queue
        self._gates: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @asynccontextmanager
    async def slot(self, address: str) -> AsyncIterator[bool]:
        """`async with gate.slot(address) as admitted:` a lookup slot held for the block (False: the
        address already has too many waiting; nothing is held)."""
        semaphore, users = self._gates.get(address, (asyncio.Semaphore(self.in_flight), 0))
        if users >= self.in_flight + self.queue:
            yield False
            return
        self._gates[address] = (semaphore, users + 1)
        try:
            async with semaphore:
                yield True
        finally:
            semaphore, users = self._gates[address]
            if users > 1:
                self._gates[address] = (semaphore, users - 1)
            else:
                del self._gates[address]


class AuthenticateBeforeBody:
    def __init__(
        self,
        app: ASGIApp,
        tokens: Tokens,
        gate: AddressGate,
        ipv6_prefix_length: int = DEFAULT_IPV6_PREFIX_LENGTH,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.gate = gate  # shared with the live streams' token checks (routers.live)
        self.ipv6_prefix_length = ipv6_prefix_length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        writing = method in _WRITES
        authorization = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None
        )
        if not writing and not authorization and not self.tokens.required():
            await self.app(scope, receive, send)  # an open server's plain read: nothing to look up
            return
        client = scope.get("client")
        address = client_key(client[0] if client else None, self.ipv6_prefix_length) or "unknown"
        close = {"Connection": "close"} if writing else {}
        async with self.gate.slot(address) as admitted:
            if not admitted:
                await AsciiJSONResponse(
                    {
                        "detail": f"too many requests waiting for authentication from this address (at most "
                        f"{PRE_AUTH_IN_FLIGHT} checked at once, {PRE_AUTH_QUEUE} waiting); retry in 1 s",
                        "limit": "authentication",
                        "retry_after_s": 1,
                    },
                    status_code=429,
                    headers={"Retry-After": "1", **close},
                )(scope, receive, send)
                return
            try:
                # The token store reads the database: off the event loop, as the dependency would be.
                principal: Principal = await run_in_threadpool(
                    self.tokens.authenticate, bearer(authorization)
                )
            except Unauthenticated as refused:
                await AsciiJSONResponse(
                    {"detail": str(refused)}, status_code=401, headers={"WWW-Authenticate": "Bearer", **close}
                )(scope, receive, send)
                return
        if writing and not principal.open:
            needed = write_scope(method, scope["path"])
            if needed not in principal.scopes:
                detail = (
                    f"this request needs a token with {needed} scope; this one has "
                    f"{', '.join(sorted(principal.scopes))}. An operator creates one with "
                    f"`gradwatch token create --project {principal.project} --scope {needed}`"
                )
                await AsciiJSONResponse({"detail": detail}, status_code=403, headers=close)(
                    scope, receive, send
                )
                return
        await self.app({**scope, PRINCIPAL_SCOPE_KEY: principal}, receive, send)
