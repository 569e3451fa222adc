"""Ingest limits per tenant: one token's traffic must not stall or fail another's.

A tenant is a token (its id), or on an open server a client address. Each tenant gets
    concurrency   at most `ingest_concurrency` batch requests in flight; up to QUEUE_PER_SLOT more per
                  slot wait (at most QUEUE_WAIT_S) for one, the rest are answered 429 at once
    rate          a token bucket of `ingest_points_per_s` points per second holding up to
                  `ingest_burst_points`; a batch the bucket cannot pay for is answered 429
and every batch is held to two caps, answered 413 before it is validated or stored:
    points        `max_batch_points`: scalar points, vector rows and histograms, as the agent counts
                  them (gradwatch._wire.batch_points), and events
    values        `max_batch_values`: every number the batch carries (a vector row holds one per
                  layer, a histogram layers x bins), 200 per event, a value per 8 characters of its
                  layer names
An open server (no tokens: one user, nobody to isolate from anyone) meters no rate: only the caps and
the concurrency slots hold there, so a local run's backlog uploads as fast as the server stores it.
413 and 429 answers name the limit in `limit`; a 429 carries `Retry-After` (whole seconds, >= 1) and
the same figure as `retry_after_s`. A setting of 0 turns its limit off. Limits are per server process.

Two checkpoints, because FastAPI reads and parses a request body on the event loop before any
dependency runs (a 5 MB batch: ~70 ms in which no other request moves):
- IngestLimitMiddleware, before the body is read: the concurrency slot, and a tenant still paying
  for its earlier batches is refused without reading its body (a body over DRAIN_AT_MOST also gets
  its connection closed rather than read and thrown away). Only the Authorization header is known
  here: a token this limiter has seen authenticate is its own tenant, any other request its client
  address's, so made-up tokens open no fresh slots. A body refused before it could be counted (a
  gzip body inflating past the byte limit, bad gzip, not JSON) costs the time it took, at
  POINTS_PER_LOOP_S.
- charge_ingest, a dependency of the ingest endpoint, after parsing and before validation: counts
  the batch, refuses it above the caps, and takes its cost from the bucket. A batch costs its
  points, or one point per VALUES_PER_POINT numbers when that is more (validating a vector or
  histogram number takes ~0.3-0.45 us, storing a scalar point ~10-20 us with the alert rules). A
  batch refused for its size is charged too: it was read and parsed.
- After storing, the CPU time the storing thread spent (time.thread_time around Store.ingest, so not
  time spent waiting for a lock or the database) is worth POINTS_PER_CPU_S points a second; a batch
  that cost more than it was charged, say one on which alert rules fire at every step, is charged
  the rest (not the server's first batch: its CPU includes the server's own warm-up).
A tenant's next batch is admitted only once its own bucket can pay what its last batch cost, so one
tenant's backlog is never paid for with another's time.

A 429 is cheap to send but not free (~1 ms of the one event loop, with the HTTP around it): a client
that ignores Retry-After and asks again at once, from a few threads, gets hundreds a second and slows
every other tenant's requests several times over. So a tenant that comes back before its last
Retry-After has passed is held: its next 429 is sent only when that time has come (at most
HOLD_AT_MOST_S later), with the body left unread; at most HELD_PER_TENANT of its requests are held at
once, any more are answered at once and their connections closed. An agent waits Retry-After and is
never held; the ranks of a job sharing a token may be, by up to HOLD_AT_MOST_S, on an answer they would
have had to wait for anyway.

Defaults: the agent flushes every second or every 100 steps (gradwatch.init); a model with 1000
parameter tensors at 30 steps/s sends ~130 points and ~130,000 histogram and vector numbers per
flush on rank 0 (a cost of ~6,600/s) and ~350 on each other rank: an 8-rank job ~9,000 points/s.
The agent seals batches of at most 50,000 points and 1,000,000 numbers. Against that: 20,000
points/s per token in bursts of 100,000 (two of the agent's largest batches), and per batch
100,000 points and 1,000,000 numbers. The caps bound how long one batch holds SQLite's single write
lock, which every other tenant's batch waits for: on two busy cores 2,000,000 numbers of per-layer
gradient norms held it 0.1-0.4 s (and with the alert rules' 25,000 rule-steps a batch, see
alerts.engine, 100,000 points of the keys they read about as long). A SQLite server
stores 50,000-100,000 points/s there, so a tenant at its rate limit gets a fifth to two fifths of it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from .._errors import GradwatchError
from .._wire import VALUES_PER_EVENT, layer_name_values
from .auth import Principal, bearer, hash_token
from .client_address import DEFAULT_IPV6_PREFIX_LENGTH, client_key
from .deps import PrincipalDep
from .settings import Settings

__all__ = [
    "RESPONSES",
    "IngestLimitMiddleware",
    "IngestLimited",
    "IngestLimits",
    "LimitedOut",
    "batch_size",
    "charge_ingest",
    "install",
]

INGEST_PATH = re.compile(r"^/api/v1/runs/[^/]+/batches/?$")
VALUES_PER_POINT = 20  # per-layer numbers that cost the server about what one scalar point does
QUEUE_WAIT_S = 2.0  # longest wait for a concurrency slot before 429
# Waiters allowed per concurrency slot; more are refused at once. The ranks of a distributed job share
# a token and flush at the same step: 64 of them queue behind 2 slots rather than being refused.
QUEUE_PER_SLOT = 32
MAX_TENANTS = 10_000  # idle tenants beyond this many are forgotten (their buckets are full anyway)
MAX_RETRY_AFTER_S = 3600
# What a second of the server's CPU spent storing a batch is worth in points (~20 us per scalar point
# with the alert rules), and the CPU time a request may use before that counts (HTTP and fixed costs).
POINTS_PER_CPU_S = 50_000
FREE_CPU_S = 0.05
# A second of the event loop (inflating and parsing bodies) holds up every request: worth 4x as much.
POINTS_PER_LOOP_S = 4 * POINTS_PER_CPU_S
DRAIN_AT_MOST = 1024 * 1024  # a request refused before its body is read keeps its connection up to this size
HOLD_AT_MOST_S = 2.0  # longest a 429 to a tenant that came back before its Retry-After is held back
HELD_PER_TENANT = 16  # requests of one tenant held at once; more are answered at once, connection closed


class LimitedOut(BaseModel):
    detail: str = Field(description="what was refused, and when to retry")
    limit: str | None = Field(
        default=None, description="concurrency | rate | batch_points | batch_values | rule_evaluations"
    )
    retry_after_s: int | None = Field(default=None, description="seconds to wait, as in Retry-After (429)")


# The ingest endpoint's answers from this module and from the database's write lock, for OpenAPI.
RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {"model": LimitedOut, "description": "the batch is larger than the server takes (or the body is)"},
    429: {"model": LimitedOut, "description": "this token's ingest limit: wait Retry-After seconds"},
    503: {
        "model": LimitedOut,
        "description": "the database is busy with other writes: wait Retry-After seconds",
    },
}


class IngestLimited(GradwatchError):
    """A batch refused by a limit: `status` 413 or 429, `limit` its name, `retry_after` seconds (429)."""

    def __init__(self, status: int, limit: str, detail: str, retry_after: int | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.limit = limit
        self.detail = detail
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        body: dict[str, Any] = {"detail": self.detail, "limit": self.limit}
        headers = None
        if self.retry_after is not None:
            body["retry_after_s"] = self.retry_after
            headers = {"Retry-After": str(self.retry_after)}
        return JSONResponse(body, status_code=self.status, headers=headers)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, list) else 0


def _packed_length(value: Any) -> int:
    """How many 8-byte numbers a base64 string (steps_i64, values_f64) holds, without decoding it."""
    if not isinstance(value, str):
        return 0
    return (len(value) // 4 * 3 - (len(value) - len(value.rstrip("=")))) // 8


def _items(document: dict[str, Any], name: str) -> list[dict[str, Any]]:
    items = document.get(name)
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def batch_size(document: Any) -> tuple[int, int]:
    """(points, values) of a wire batch as parsed from JSON: points as the agent counts them (scalar
    points, vector rows, histograms), values every number. Parts of the wrong shape count as their
    list lengths or not at all: validation reports them."""
    if not isinstance(document, dict):
        return 0, 0
    points = values = 0
    for series in _items(document, "scalars"):
        count = max(
            _length(series.get("steps")),
            _length(series.get("values")),
            _packed_length(series.get("steps_i64")),
            _packed_length(series.get("values_f64")),
        )
        points += count
        values += count
    for series in _items(document, "vectors"):
        rows = series.get("values")
        points += max(_length(series.get("steps")), _length(rows))
        if isinstance(rows, list):
            values += sum(len(row) if isinstance(row, list) else 1 for row in rows)
    for histogram in _items(document, "histograms"):
        points += 1
        counts = histogram.get("counts")
        if isinstance(counts, list):
            values += sum(len(row) if isinstance(row, list) else 1 for row in counts)
    # Events are stored a row each and fed to the alert rules like a step: a point each, and their
    # validation costs VALUES_PER_EVENT numbers' worth (_wire: at most 10,000 a batch). Layer names are
    # validated and stored as text: a value per 8 characters (_wire.layer_name_values: a 1,000-layer
    # model's names ~8,000 values; 50,000 names of 500 characters 3.2 million, over the cap).
    events = _length(document.get("events"))
    points += events
    return points, values + VALUES_PER_EVENT * events + layer_name_values(document.get("layers"))


@dataclass
class _Tenant:
    balance: float
    refilled_at: float
    expected: float = 0.0  # what this tenant's last batch cost: its next one must be affordable
    in_flight: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    retry_at: float = 0.0  # when the tenant's last Retry-After ends (clock time)
    held: int = 0  # its 429s being held back right now (IngestLimits.hold)


def _per(key: str) -> str:
    return "per token" if key.startswith("token:") else "per client address"


def _seconds(amount: float, per_second: float) -> int:
    """Whole seconds (>= 1) until `amount` points have flowed in at `per_second`."""
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(amount / per_second)))


class IngestLimits:
    """The per-tenant state: concurrency slots and token buckets. Used from the event loop only
    (the middleware and the async dependency), so it takes no thread lock."""

    def __init__(
        self,
        concurrency: int = 2,
        points_per_s: float = 20_000,
        burst_points: float = 100_000,
        max_batch_points: int = 100_000,
        max_batch_values: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
        ipv6_prefix_length: int = DEFAULT_IPV6_PREFIX_LENGTH,
    ) -> None:
        """0 turns a limit off. burst_points: what a full bucket holds (at least one point).
        ipv6_prefix_length: an IPv6 client without a token is one tenant per network of that many
        bits (server.client_address)."""
        for name, value in (
            ("concurrency", concurrency),
            ("points_per_s", points_per_s),
            ("burst_points", burst_points),
            ("max_batch_points", max_batch_points),
            ("max_batch_values", max_batch_values),
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"ingest limit {name} must be a number >= 0 (0: off), got {value!r}")
        if points_per_s and burst_points < 1:
            raise ValueError(f"burst_points must be >= 1 when points_per_s is set, got {burst_points!r}")
        self.concurrency = int(concurrency)
        self.points_per_s = float(points_per_s)
        self.burst_points = float(burst_points)
        self.max_batch_points = int(max_batch_points)
        self.max_batch_values = int(max_batch_values)
        self._clock = clock
        self.ipv6_prefix_length = ipv6_prefix_length
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        self._known_tokens: OrderedDict[str, str] = OrderedDict()  # token hash -> tenant key
        # The first batch a server stores also pays its warm-up (SQL statements compiled for its engine,
        # modules loaded on first use: ~1 s of CPU on PostgreSQL under load); that is the server's, not
        # the tenant's, so it is not charged on top (it made the tenant's next batch wait for a 52,000-
        # point debt).
        self._warmed_up = False

    @classmethod
    def from_settings(cls, settings: Settings) -> IngestLimits:
        return cls(
            settings.ingest_concurrency,
            settings.ingest_points_per_s,
            settings.ingest_burst_points,
            settings.max_batch_points,
            settings.max_batch_values,
            ipv6_prefix_length=settings.ipv6_prefix_length,
        )

    # -- who is asking --------------------------------------------------------------------------

    def principal_key(self, principal: Principal, client_host: str | None) -> str:
        if principal.token_id is not None:
            return f"token:{principal.token_id}"
        return self._address_key(client_host)

    def _address_key(self, client_host: str | None) -> str:
        return f"address:{client_key(client_host, self.ipv6_prefix_length) or 'unknown'}"

    def learn(self, token: str | None, key: str) -> None:
        """Remember that `token` authenticated as tenant `key`, so its next requests are its own."""
        if not token or not key.startswith("token:"):
            return
        digest = hash_token(token)
        self._known_tokens[digest] = key
        self._known_tokens.move_to_end(digest)
        while len(self._known_tokens) > MAX_TENANTS:
            self._known_tokens.popitem(last=False)

    def request_key(self, authorization: str | None, client_host: str | None) -> str:
        """The tenant of a request before its body is read: a known token's, else its address's."""
        try:
            token = bearer(authorization)
        except Exception:  # noqa: BLE001 - a malformed header: authentication will answer 401
            token = None
        if token:
            key = self._known_tokens.get(hash_token(token))
            if key is not None:
                return key
        return self._address_key(client_host)

    # -- state ----------------------------------------------------------------------------------

    def _tenant(self, key: str) -> _Tenant:
        now = self._clock()
        tenant = self._tenants.get(key)
        if tenant is None:
            tenant = self._tenants[key] = _Tenant(balance=self.burst_points, refilled_at=now)
            if len(self._tenants) > MAX_TENANTS:
                self._forget_idle()
        else:
            self._tenants.move_to_end(key)
            if self.points_per_s:
                tenant.balance = min(
                    self.burst_points, tenant.balance + (now - tenant.refilled_at) * self.points_per_s
                )
            tenant.refilled_at = now
        return tenant

    def _forget_idle(self) -> None:
        for key in list(self._tenants)[: len(self._tenants) - MAX_TENANTS]:
            tenant = self._tenants[key]
            if not tenant.in_flight and not tenant.waiters and not tenant.held:
                del self._tenants[key]

    def _rate_refusal(self, key: str, tenant: _Tenant, cost: float, what: str) -> IngestLimited | None:
        """429 unless the bucket holds `cost` points (a full bucket pays for any batch) and is not in debt."""
        if not self.points_per_s:
            return None
        needed = min(max(cost, 1.0), self.burst_points)
        if tenant.balance >= needed:
            return None
        wait = _seconds(needed - tenant.balance, self.points_per_s)
        return IngestLimited(
            429,
            "rate",
            f"ingest rate limit: {self.points_per_s:,.0f} points/s {_per(key)} (bursts of "
            f"{self.burst_points:,.0f}); {what}; retry in {wait} s",
            wait,
        )

    # -- the two checkpoints --------------------------------------------------------------------

    async def admit(self, key: str) -> None:
        """Before the body is read: take a concurrency slot (waiting up to QUEUE_WAIT_S) unless the
        tenant cannot yet pay for a batch like its last one; IngestLimited otherwise."""
        tenant = self._tenant(key)
        refusal = self._rate_refusal(
            key, tenant, tenant.expected, f"the last batch cost {tenant.expected:,.0f}"
        )
        if refusal is not None:
            raise refusal
        if not self.concurrency or tenant.in_flight < self.concurrency:
            tenant.in_flight += 1
            return
        if len(tenant.waiters) >= self.concurrency * QUEUE_PER_SLOT or not await self._wait_for_slot(
            key, tenant
        ):
            raise IngestLimited(
                429,
                "concurrency",
                f"ingest concurrency limit: {self.concurrency} batch requests in flight {_per(key)}; retry "
                "in 1 s",
                1,
            )

    async def _wait_for_slot(self, key: str, tenant: _Tenant) -> bool:
        """Wait for release() to hand over a slot; True when it did."""
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        tenant.waiters.append(slot)
        handed_over = False
        try:
            await asyncio.wait_for(asyncio.shield(slot), QUEUE_WAIT_S)
            handed_over = True
        except asyncio.TimeoutError:
            pass
        finally:  # also when the request is cancelled (the client went away)
            if not handed_over:
                if slot.done():
                    self.release(key)  # handed over just as the wait ended: pass it on
                else:
                    slot.cancel()
                    tenant.waiters.remove(slot)
        return handed_over

    def release(self, key: str) -> None:
        """A request admitted for `key` has ended: its slot goes to the first waiter, if any."""
        tenant = self._tenants.get(key)
        if tenant is None:
            return
        while tenant.waiters:
            slot = tenant.waiters.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        tenant.in_flight = max(tenant.in_flight - 1, 0)

    def charge(self, key: str, points: int, values: int, metered: bool = True) -> float:
        """After parsing: refuse a batch over the caps (413, charged: it was read) or one the
        tenant's bucket cannot pay for yet (429, not charged); else take its cost from the bucket.
        Unmetered (an open server: one user, no tenant to protect from another) only the caps hold."""
        tenant = self._tenant(key)
        cost = max(points, values // VALUES_PER_POINT)
        over_points = self.max_batch_points and points > self.max_batch_points
        over_values = self.max_batch_values and values > self.max_batch_values
        if metered:
            tenant.expected = cost
        if metered and not (over_points or over_values):
            refusal = self._rate_refusal(key, tenant, cost, f"this batch costs {cost:,.0f}")
            if refusal is not None:
                raise refusal
        if metered and self.points_per_s:
            tenant.balance -= cost
        if over_points:
            raise IngestLimited(
                413,
                "batch_points",
                f"the batch has {points:,} points (scalar points, vector rows and histograms); this server "
                f"takes at most {self.max_batch_points:,} per batch: send it as smaller batches",
            )
        if over_values:
            raise IngestLimited(
                413,
                "batch_values",
                f"the batch carries {values:,} numbers (vector and histogram entries count one each, an event"
                f" {VALUES_PER_EVENT}, a layer name one per 8 characters); this "
                f"server takes at most {self.max_batch_values:,} per batch: send it as smaller batches",
            )
        return cost

    def settle(self, key: str, cost: float, cpu_s: float) -> None:
        """After storing: a batch whose storing took more CPU than its cost accounts for (alert rules
        that fire on every step of it, say) is charged the difference."""
        worth = (cpu_s - FREE_CPU_S) * POINTS_PER_CPU_S
        warming_up, self._warmed_up = not self._warmed_up, True
        if not self.points_per_s or worth <= cost or warming_up:
            return
        tenant = self._tenant(key)
        tenant.balance -= worth - cost
        tenant.expected = max(tenant.expected, worth)

    async def hold(self, key: str, retry_after: int) -> bool:
        """Before a 429 with `retry_after` goes to `key`: wait while the tenant is early (it was told
        to come back later than now), up to HOLD_AT_MOST_S; then note when this Retry-After ends.
        False when the tenant has HELD_PER_TENANT answers held already: answer at once and close."""
        tenant = self._tenant(key)
        early_by = tenant.retry_at - self._clock()
        if early_by > 0:
            if tenant.held >= HELD_PER_TENANT:
                return False
            tenant.held += 1
            try:
                await asyncio.sleep(min(early_by, HOLD_AT_MOST_S))
            finally:
                tenant.held -= 1
        tenant.retry_at = max(tenant.retry_at, self._clock() + retry_after)
        return True

    def penalize(self, key: str, seconds: float) -> None:
        """A body refused before it could be counted (a gzip body inflating past the byte limit, not
        UTF-8, not JSON...) costs the time the event loop spent on it, at POINTS_PER_LOOP_S."""
        if self.points_per_s:
            self._tenant(key).balance -= seconds * POINTS_PER_LOOP_S


class _Ticket:
    """One admitted request, shared through the ASGI scope with charge_ingest and, in a context
    variable, with the thread that stores its batch."""

    def __init__(self) -> None:
        self.charged = False
        self.key: str | None = None  # the tenant charge_ingest charged
        self.cost = 0.0
        self.cpu_s = 0.0  # CPU time of the thread storing the batch


_SCOPE_KEY = "gradwatch.ingest_ticket"
_current_ticket: ContextVar[_Ticket | None] = ContextVar("gradwatch_ingest_ticket", default=None)


def _measuring(ingest: Callable[..., Any]) -> Callable[..., Any]:
    """Store.ingest, adding the CPU time of each call made for an admitted request to its ticket."""

    @functools.wraps(ingest)
    def measured(*args: Any, **kwargs: Any) -> Any:
        ticket = _current_ticket.get()
        if ticket is None:
            return ingest(*args, **kwargs)
        started = time.thread_time()  # CPU only: waiting for a lock, the database or the GIL is not
        try:
            return ingest(*args, **kwargs)
        finally:
            ticket.cpu_s += time.thread_time() - started

    return measured


# Answers given before charge_ingest could count the batch: the body was read (and perhaps inflated or
# parsed) but could not be counted. Such a request costs its time (IngestLimits.penalize).
_UNCOUNTED_REFUSALS = frozenset({400, 413, 415})


class IngestLimitMiddleware:
    """The checkpoint before the body: POSTs of batches are admitted, or refused unread (pure ASGI)."""

    def __init__(self, app: ASGIApp, limits: IngestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not INGEST_PATH.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        authorization = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None
        )
        client = scope.get("client")
        key = self.limits.request_key(authorization, client[0] if client else None)
        try:
            await self.limits.admit(key)
        except IngestLimited as refused:
            response = refused.response()
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
            held_back = refused.retry_after is None or await self.limits.hold(key, refused.retry_after)
            if not held_back or (declared.isdigit() and int(declared) > DRAIN_AT_MOST):
                # The body is left unread; reading a large one only to discard it would cost the server
                # ~1 ms per MB of every refused request: close the connection instead.
                response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        ticket = _Ticket()
        status = 0
        admitted_at = time.monotonic()

        async def watching_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 429:  # charge_ingest's refusal, after the body: held back the same way
                    retry_after = next((v for k, v in message["headers"] if k == b"retry-after"), b"1")
                    await self.limits.hold(key if ticket.key is None else ticket.key, int(retry_after))
            await send(message)

        try:
            await self.app({**scope, _SCOPE_KEY: ticket}, receive, watching_send)
        finally:
            self.limits.release(key)
            if status in _UNCOUNTED_REFUSALS and not ticket.charged:
                self.limits.penalize(key, time.monotonic() - admitted_at)
            elif ticket.key is not None and ticket.cpu_s:
                self.limits.settle(ticket.key, ticket.cost, ticket.cpu_s)


async def charge_ingest(request: Request, principal: PrincipalDep) -> None:
    """The ingest endpoint's dependency (the checkpoint after parsing; see the module docstring)."""
    limits: IngestLimits = request.app.state.ingest_limits
    key = limits.principal_key(principal, request.client.host if request.client else None)
    authorization = request.headers.get("authorization")
    if principal.token_id is not None:
        limits.learn(bearer(authorization), key)
    if "json" not in request.headers.get("content-type", ""):
        return  # FastAPI did not parse it as JSON: validation refuses it
    try:
        document = await request.json()  # parsed already: Starlette keeps the result
    except ValueError:  # no body or not JSON (FastAPI reads an empty body as none): validation says so
        return
    points, values = batch_size(document)
    ticket = request.scope.get(_SCOPE_KEY)
    if ticket is not None:
        ticket.charged = True
    cost = limits.charge(key, points, values, metered=not principal.open)
    if ticket is not None and not principal.open:
        ticket.key, ticket.cost = key, cost
        _current_ticket.set(ticket)  # the endpoint's thread runs in a copy of this context


def install(app: FastAPI, settings: Settings) -> IngestLimits:
    """Add the limiter to an app: its state, its middleware (add it around the body-size limits, so
    that it refuses before a byte of the body is read) and the handler of its refusals."""
    limits = IngestLimits.from_settings(settings)
    app.state.ingest_limits = limits
    store = app.state.store
    store.ingest = _measuring(store.ingest)  # the CPU a batch costs to store (IngestLimits.settle)

    async def _refused(_request: Request, exc: IngestLimited) -> JSONResponse:
        return exc.response()

    app.add_exception_handler(IngestLimited, _refused)  # type: ignore[arg-type]
    app.add_middleware(IngestLimitMiddleware, limits=limits)
    return limits
