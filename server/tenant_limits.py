"""What one token's reads, live streams and new runs may cost everyone else on a team server.

Ingest has its own limits (ingest_limits.py). These hold the rest of what a token can ask for, on a
server with tokens (an open server has one user, nobody to isolate from anyone):
    reads         at most READS_IN_FLIGHT GET requests under /api/ per tenant at once; up to
                  READ_QUEUE more wait (at most READ_WAIT_S) for a slot, further ones are answered 429.
                  A read is CPU in the server's one process (SQLite decoding, JSON): eight threads of
                  the dearest reads from one token made every other tenant's requests 20x slower.
    live streams  at most STREAMS_PER_TENANT WebSockets per tenant and STREAMS_PER_PROCESS in all; more
                  are closed at once with 1013 (try again later). Each stream reads the database every
                  few seconds: 2,000 of them held another tenant's p95 above a second.
    run creation  a token bucket per tenant of RUNS_PER_S runs a second in bursts of RUN_BURST (a sweep
                  or a 64-rank job registers at once); beyond it 429 with Retry-After, which the agent
                  honours. Unlimited, one token created ~140 runs a second.
A tenant is a token (its hash) or, without one, the client address. 429 answers carry `limit`
("reads" or "run_creation"), `Retry-After` and `retry_after_s`, as ingest's do.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import Tokens, bearer, hash_token
from .auth_first import PRINCIPAL_SCOPE_KEY
from .http_errors import AsciiJSONResponse

__all__ = ["TenantLimitMiddleware", "TenantLimits", "stream_place", "tenant_of"]

READS_IN_FLIGHT = 2
READ_QUEUE = 32
READ_WAIT_S = 10.0
# Besides the slots, a tenant's reads may take READ_SECONDS_PER_S seconds a second (wall time, bursts of
# READ_BURST_S): two slots of reads a second long each still took two thirds of the server's one
# interpreter. A dashboard's page load is ~0.5 s of reads, its live polling a few hundredths a second.
READ_SECONDS_PER_S = 0.25
READ_BURST_S = 2.0
# A refused request is answered only after a hold, so that a client that asks again at once (from many
# threads, or 2,000 coroutines reconnecting a stream) cannot make the server refuse it thousands of times
# a second (each refusal costs the one event loop a fraction of a millisecond). Held requests cost a
# socket and a sleeping coroutine; beyond the cap a tenant's further ones are answered at once and closed.
# A stream's hold is spread over its last half: 2,000 streams refused together and answered together
# made one turn of the event loop 0.3 s long, and every other request waited for it.
READ_REFUSAL_HOLD_S = 2.0
READS_HELD_PER_TENANT = 16
STREAM_REFUSAL_HOLD_S = 10.0
STREAMS_HELD_PER_TENANT = 4096
STREAMS_PER_TENANT = 16
STREAMS_PER_PROCESS = 512
RUNS_PER_S = 2.0
RUN_BURST = 100.0
MAX_TENANTS = 10_000  # idle tenants beyond this many are forgotten
_RUNS_PATH = "/api/v1/runs"


def tenant_of(
    headers: list[tuple[bytes, bytes]], query_token: str | None, client: tuple[str, int] | None
) -> str:
    """The tenant of a request: its token's hash (header, or ?token= for a WebSocket), else its address.
    A made-up token is a tenant of its own, but authentication refuses it before it costs anything."""
    authorization = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
    try:
        token = query_token or bearer(authorization)
    except Exception:  # noqa: BLE001 - a malformed header: authentication will answer 401
        token = None
    if token:
        return "token:" + hash_token(token)[:32]
    return f"address:{client[0] if client else 'unknown'}"


@dataclass
class _Tenant:
    reads: int = 0
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)
    streams: int = 0
    streams_held: int = 0
    reads_held: int = 0
    runs_balance: float = RUN_BURST
    refilled_at: float = 0.0
    read_balance: float = READ_BURST_S
    read_refilled_at: float = 0.0


class TenantLimits:
    """Per-tenant read slots, stream counts and run-creation buckets. Used from the event loop only."""

    def __init__(
        self,
        reads_in_flight: int = READS_IN_FLIGHT,
        streams_per_tenant: int = STREAMS_PER_TENANT,
        streams_per_process: int = STREAMS_PER_PROCESS,
        runs_per_s: float = RUNS_PER_S,
        run_burst: float = RUN_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reads_in_flight = reads_in_flight
        self.streams_per_tenant = streams_per_tenant
        self.streams_per_process = streams_per_process
        self.runs_per_s = runs_per_s
        self.run_burst = run_burst
        self._clock = clock
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        self.streams = 0

    def _tenant(self, key: str) -> _Tenant:
        tenant = self._tenants.get(key)
        if tenant is None:
            now = self._clock()
            tenant = self._tenants[key] = _Tenant(
                runs_balance=self.run_burst, refilled_at=now, read_refilled_at=now
            )
            if len(self._tenants) > MAX_TENANTS:
                for old in list(self._tenants)[: len(self._tenants) - MAX_TENANTS]:
                    idle = self._tenants[old]
                    if not (idle.reads or idle.waiting or idle.streams):
                        del self._tenants[old]
        else:
            self._tenants.move_to_end(key)
        return tenant

    # -- reads ----------------------------------------------------------------------------------

    def read_wait(self, key: str) -> float:
        """Seconds until the tenant's read time is paid for (0: it may read now)."""
        tenant = self._tenant(key)
        now = self._clock()
        tenant.read_balance = min(
            READ_BURST_S, tenant.read_balance + (now - tenant.read_refilled_at) * READ_SECONDS_PER_S
        )
        tenant.read_refilled_at = now
        return 0.0 if tenant.read_balance > 0 else -tenant.read_balance / READ_SECONDS_PER_S + 0.01

    def charge_read(self, key: str, seconds: float) -> None:
        self._tenant(key).read_balance -= seconds

    async def acquire_read(self, key: str) -> bool:
        """Take one of the tenant's read slots, waiting up to READ_WAIT_S; False when refused."""
        wait = self.read_wait(key)
        if wait > READ_WAIT_S:
            return False
        if wait:
            await asyncio.sleep(wait)
        tenant = self._tenant(key)
        if tenant.reads < self.reads_in_flight and not tenant.waiting:
            tenant.reads += 1
            return True
        if len(tenant.waiting) >= READ_QUEUE:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        tenant.waiting.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), READ_WAIT_S)
            return True  # release_read handed its slot over
        except TimeoutError:
            self._give_up(key, tenant, waiter)
            return False
        except asyncio.CancelledError:  # the client went away while waiting
            self._give_up(key, tenant, waiter)
            raise

    def _give_up(self, key: str, tenant: _Tenant, waiter: asyncio.Future[None]) -> None:
        if waiter.done() and not waiter.cancelled():
            self.release_read(key)  # the slot came just as we gave up: pass it on
        else:
            waiter.cancel()
            if waiter in tenant.waiting:
                tenant.waiting.remove(waiter)

    def release_read(self, key: str) -> None:
        tenant = self._tenant(key)
        while tenant.waiting:
            waiter = tenant.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the next waiter: reads stays as it is
                return
        tenant.reads = max(0, tenant.reads - 1)

    # -- run creation ---------------------------------------------------------------------------

    def take_run(self, key: str) -> int | None:
        """Spend one run from the tenant's bucket: None when it may, else the seconds to wait."""
        tenant = self._tenant(key)
        now = self._clock()
        tenant.runs_balance = min(
            self.run_burst, tenant.runs_balance + (now - tenant.refilled_at) * self.runs_per_s
        )
        tenant.refilled_at = now
        if tenant.runs_balance >= 1.0:
            tenant.runs_balance -= 1.0
            return None
        return max(1, math.ceil((1.0 - tenant.runs_balance) / self.runs_per_s))

    # -- live streams ---------------------------------------------------------------------------

    def open_stream(self, key: str) -> str | None:
        """Count a new stream of the tenant: None when it may open, else why not."""
        refused = self.stream_refusal(key)
        if refused is not None:
            return refused
        tenant = self._tenant(key)
        tenant.streams += 1
        self.streams += 1
        return None

    async def hold_read_refusal(self, key: str) -> bool:
        """Before a read's 429: hold it up to READ_REFUSAL_HOLD_S (less when the tenant's read time is
        paid for sooner), at most READS_HELD_PER_TENANT at once. Returns whether it was held."""
        tenant = self._tenant(key)
        if tenant.reads_held >= READS_HELD_PER_TENANT:
            return False
        tenant.reads_held += 1
        try:
            await asyncio.sleep(min(READ_REFUSAL_HOLD_S, max(self.read_wait(key), 0.1)))
        finally:
            tenant.reads_held -= 1
        return True

    async def refuse_stream(self, key: str) -> bool:
        """Before a refused stream is answered: hold it half to all of STREAM_REFUSAL_HOLD_S (a client
        that reconnects at once cannot make the server refuse it thousands of times a second; a crowd
        refused at once is answered spread out), at most STREAMS_HELD_PER_TENANT of the tenant's at
        once. Returns whether it was held."""
        tenant = self._tenant(key)
        if tenant.streams_held >= STREAMS_HELD_PER_TENANT:
            return False
        tenant.streams_held += 1
        try:
            await asyncio.sleep(STREAM_REFUSAL_HOLD_S * random.uniform(0.5, 1.0))
        finally:
            tenant.streams_held -= 1
        return True

    def stream_refusal(self, key: str) -> str | None:
        """Why a new stream of the tenant would be refused now (before it is accepted), else None."""
        if self.streams >= self.streams_per_process:
            return f"the server holds its most live streams ({self.streams_per_process}); try again later"
        if self._tenant(key).streams >= self.streams_per_tenant:
            return (
                f"this token (or address) holds its most live streams ({self.streams_per_tenant});"
                " close one, or try again later"
            )
        return None

    def close_stream(self, key: str) -> None:
        tenant = self._tenant(key)
        tenant.streams = max(0, tenant.streams - 1)
        self.streams = max(0, self.streams - 1)


@asynccontextmanager
async def stream_place(limits: TenantLimits | None, key: str) -> AsyncIterator[str | None]:
    """`async with stream_place(limits, key) as refused:` a live stream's place among its tenant's (and
    the process's), held for the block; `refused` is None when it may stream, else why not. A refused
    stream is held first (TenantLimits.refuse_stream) and tried once more. limits None: no limit."""
    if limits is None:
        yield None
        return
    refused = limits.open_stream(key)
    if refused is not None and await limits.refuse_stream(key):
        refused = limits.open_stream(key)
    if refused is not None:
        yield refused
        return
    try:
        yield None
    finally:
        limits.close_stream(key)


def _too_many(detail: str, limit: str, retry_after: int, close: bool = False) -> AsciiJSONResponse:
    headers = {"Retry-After": str(retry_after)}
    if close:
        headers["Connection"] = "close"
    return AsciiJSONResponse(
        {"detail": detail, "limit": limit, "retry_after_s": retry_after}, status_code=429, headers=headers
    )


class TenantLimitMiddleware:
    """Holds reads and run creation to their per-tenant limits on a server with tokens. Inside
    AuthenticateBeforeBody: a write that gets here carries its authenticated principal."""

    def __init__(self, app: ASGIApp, limits: TenantLimits, tokens: Tokens) -> None:
        self.app = app
        self.limits = limits
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        reading = method in ("GET", "HEAD")
        creating = method == "POST" and scope["path"].rstrip("/") == _RUNS_PATH
        if not (reading or creating) or not self.tokens.required():
            await self.app(scope, receive, send)
            return
        key = tenant_of(scope["headers"], None, scope.get("client"))
        if creating:
            principal = scope.get(PRINCIPAL_SCOPE_KEY)
            wait = self.limits.take_run(key) if principal is not None and not principal.open else None
            if wait is not None:
                await _too_many(
                    f"run creation limit: {self.limits.runs_per_s:g} runs/s per token (bursts of"
                    f" {self.limits.run_burst:g}); retry in {wait} s",
                    "run_creation",
                    wait,
                )(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if not await self.limits.acquire_read(key):
            held = await self.limits.hold_read_refusal(key)
            await _too_many(
                f"read limit: {self.limits.reads_in_flight} reads in flight per token, {READ_QUEUE} more"
                f" waiting at most {READ_WAIT_S:g} s, {READ_SECONDS_PER_S:g} s of reads a second;"
                " retry in 1 s",
                "reads",
                1,
                close=not held,
            )(scope, receive, send)
            return
        began = time.monotonic()
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.release_read(key)
            self.limits.charge_read(key, time.monotonic() - began)
