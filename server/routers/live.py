"""WebSocket /api/v1/runs/{run_id}/live: a run's new points, events and status as they are stored."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Iterator
from functools import partial
from typing import Any

import anyio
from fastapi import APIRouter, WebSocket
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocketDisconnect

from ..auth import Principal, Tokens, bearer
from ..auth_first import AddressGate
from ..client_address import client_key
from ..deps import authorize_run
from ..errors import Forbidden, NotFound, Unauthenticated
from ..live import LiveHub, RunsWatch
from ..schemas import json_float
from ..storage import LiveCursor, LiveUpdate, Store
from ..tenant_limits import TenantLimits, stream_place, tenant_of

router = APIRouter(prefix="/api/v1/runs", tags=["live"])
logger = logging.getLogger("gradwatch.live")

CLOSE_BAD_REQUEST = 4400  # the HTTP status + 4000, as WebSocket close codes 4000-4999 are the application's
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013  # before accept: the handshake is answered 403
_MAX_REASON_BYTES = 123  # a close frame's reason fits in 125 bytes with the 2-byte code
_PARAMETERS = ("key", "rank", "since", "token")


class _BadQuery(ValueError):
    pass


def _query(params: QueryParams) -> tuple[frozenset[str] | None, int | None, int | None]:
    unknown = sorted(set(params) - set(_PARAMETERS))
    if unknown:
        raise _BadQuery(f"unknown query parameter {unknown[0]!r}; expected key, rank, since, token")
    keys = params.getlist("key")
    for key in keys:
        if not 1 <= len(key) <= 250:
            raise _BadQuery(f"key must have 1 to 250 characters, not {len(key)}")
    return frozenset(keys) or None, _integer(params, "rank", 0), _integer(params, "since", -1)


def _integer(params: QueryParams, name: str, lowest: int) -> int | None:
    values = params.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise _BadQuery(f"{name} may be given once, not {len(values)} times")
    try:
        value = int(values[0])
    except ValueError:
        raise _BadQuery(f"{name} must be an integer, not {values[0][:40]!r}") from None
    if not lowest <= value <= 2**62:
        raise _BadQuery(f"{name} must be between {lowest} and 2**62, not {value}")
    return value


# What a refusal closes a stream with: the HTTP status it would have been, + 4000.
_REFUSAL_CODES: tuple[tuple[type[Exception], int], ...] = (
    (_BadQuery, CLOSE_BAD_REQUEST),
    (Unauthenticated, CLOSE_UNAUTHENTICATED),
    (Forbidden, CLOSE_FORBIDDEN),
    (NotFound, CLOSE_NOT_FOUND),
)


async def _refuse(websocket: WebSocket, exc: Exception) -> None:
    """Close with the code of `exc`'s refusal (_REFUSAL_CODES) and its message as the reason."""
    code = next(code for kind, code in _REFUSAL_CODES if isinstance(exc, kind))
    await _close(websocket, code, str(exc))


async def _close(websocket: WebSocket, code: int, reason: str) -> None:
    encoded = reason.encode()[:_MAX_REASON_BYTES]
    await websocket.close(code, encoded.decode(errors="ignore"))


async def _known_token(websocket: WebSocket, token_of: Callable[[], str | None]) -> bool:
    """On a server with tokens, before a stream takes a place: whether its token is a valid one. A
    missing, malformed or unknown token is refused here (accepted, then closed 4401), so that it never
    holds one of the process's stream places (doorbells without a cookie filled them, and real ones
    waited seconds); one address's lookups go through the pre-authentication gate (auth_first), which
    closes a stream past it with 1013."""
    tokens: Tokens = websocket.app.state.tokens
    gate: AddressGate = websocket.app.state.pre_auth_gate
    client = websocket.scope.get("client")
    address = client_key(client[0] if client else None, websocket.app.state.settings.ipv6_prefix_length)
    try:
        token = token_of()
        async with gate.slot(address or "unknown") as admitted:
            if not admitted:
                await websocket.close(CLOSE_TRY_AGAIN_LATER)
                return False
            await anyio.to_thread.run_sync(tokens.authenticate, token)
    except Unauthenticated as exc:
        await websocket.accept()  # a close code and reason reach the client only on an open socket
        await _refuse(websocket, exc)
        return False
    return True


def _authorize(websocket: WebSocket, run_id: str, token: str | None) -> str:
    """As the HTTP endpoints do: the run's stored id (deps.authorize_run), or Unauthenticated, Forbidden
    or NotFound unless the token may read the run."""
    tokens: Tokens = websocket.app.state.tokens
    store: Store = websocket.app.state.store
    return authorize_run(store, tokens.authenticate(token), run_id, "read")


def _dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, allow_nan=False, separators=(",", ":"))


def status_message(status: tuple[str, int | None]) -> dict[str, Any]:
    return {"type": "status", "status": status[0], "last_step": status[1]}


def messages(update: LiveUpdate, max_points: int = 5_000, max_events: int = 500) -> Iterator[dict[str, Any]]:
    """A read's news as protocol messages (see live()): points per (key, rank) in pieces of at most
    max_points, events in pieces of at most max_events, the status last."""
    for chunk in update.points:
        for lo in range(0, len(chunk.steps), max_points):
            yield {
                "type": "points",
                "key": chunk.key,
                "rank": chunk.rank,
                "steps": chunk.steps[lo : lo + max_points],
                "values": [json_float(v) for v in chunk.values[lo : lo + max_points]],
            }
    for lo in range(0, len(update.events), max_events):
        yield {
            "type": "events",
            "data": [
                {"step": e.step, "kind": e.kind, "rank": e.rank, "data": e.data}
                for e in update.events[lo : lo + max_events]
            ],
        }
    if update.status is not None:
        yield status_message(update.status)


@router.websocket("/{run_id}/live")
async def live(websocket: WebSocket, run_id: str) -> None:
    """A run's data as it is stored, pushed within about a second of ingest (from any server process
    of the same database).

    Query parameters (all optional):
      key    a scalar key to stream, repeatable (key=loss&key=lr); default every scalar key of the
             run, keys that first appear later included
      rank   only this rank; default every rank
      since  a step: first send what is stored after it (step > since; since=-1: the whole run),
             then what arrives; default only what arrives after connecting
      token  a read token of the run's project, when the server has tokens (or send the header
             Authorization: Bearer <token>)

    Server → client: JSON text frames, one object each, with "type":
      {"type": "status", "status": "running", "last_step": 12}
          first, once the subscription is live (from then on nothing is missed), then whenever the
          run's status or last step changes
      {"type": "points", "key": "loss", "rank": 0, "steps": [13, 14], "values": [0.5, "NaN"]}
          new points of one key and rank in step order; NaN/±Inf as "NaN"/"Infinity"/"-Infinity";
          a large backlog arrives in several messages
      {"type": "events", "data": [{"step": 13, "kind": "skip", "rank": 0, "data": {...}}]}
    Each point and event is sent once. Per (key, rank) only steps after the last one sent follow, so
    a rewritten step is not sent again, nor one that arrives after a newer step of the same key and
    rank (late data of another rank is sent); events likewise per rank. After a reconnect,
    since=<the last step received> resumes. Messages the client sends are ignored.

    Close codes, with the reason as text: 4400 bad query parameters, 4401 no valid token, 4403 a
    token that may not read the run, 4404 unknown (or deleted) run (the HTTP status + 4000); 1011
    the database could not be read at connect; 1012 the server shuts down. A token (or a server) at its
    most live streams (tenant_limits.STREAMS_PER_TENANT, STREAMS_PER_PROCESS) is refused at the
    handshake, HTTP 403 after a hold of 5 to 10 s (STREAM_REFUSAL_HOLD_S).
    """
    # The token: ?token= (browsers cannot set headers on a WebSocket), or the header (a malformed one
    # is refused with 4401 once the stream has its place).
    query_token = websocket.query_params.get("token")
    await serve_stream(
        websocket,
        run_id,
        tenant_of(websocket.scope["headers"], query_token, websocket.scope.get("client")),
        lambda: query_token or bearer(websocket.headers.get("authorization")),
        lambda: _query(websocket.query_params),
    )


async def doorbell(websocket: WebSocket, run_id: str, token: str | None) -> None:
    """The dashboard's stream of a run (the run page's doorbell): its status messages and events, no
    points (the page reads those itself when rung), with the token of the signed-in person's cookie.
    The server mounts it at /dashboard/live/{run_id}, where the browser sends that cookie; the web
    security middleware refuses a handshake from another site's page, as for every WebSocket."""
    tenant = tenant_of([], token, websocket.scope.get("client"))
    await serve_stream(websocket, run_id, tenant, lambda: token, lambda: (frozenset(), None, None))


RUNS_DOORBELL_MIN_S = 1.0  # the runs list's doorbell rings at most this often


async def runs_doorbell(websocket: WebSocket, token: str | None) -> None:
    """The dashboard's stream of the runs list (its doorbell): {"type": "runs"} first, then whenever a
    run that the token may read moved (a batch stored: new data, a status), at most once a second;
    nothing else. The token is the signed-in person's cookie's (the server mounts this at
    /dashboard/live); a token without read scope is closed with 4403, none where one is needed 4401."""
    tenant = tenant_of([], token, websocket.scope.get("client"))
    tokens: Tokens = websocket.app.state.tokens
    limits: TenantLimits | None = websocket.app.state.tenant_limits if tokens.required() else None
    if limits is not None and not await _known_token(websocket, lambda: token):
        return
    async with stream_place(limits, tenant) as refused:
        if refused is not None:
            await websocket.close(CLOSE_TRY_AGAIN_LATER)
            return
        await websocket.accept()
        try:
            principal = await anyio.to_thread.run_sync(_reader, tokens, token)
        except (Unauthenticated, Forbidden) as exc:
            await _refuse(websocket, exc)
            return
        hub: LiveHub = websocket.app.state.live
        store: Store = websocket.app.state.store
        with hub.watch_runs() as watch:
            try:
                await websocket.send_text(_dumps({"type": "runs"}))
            except WebSocketDisconnect:
                return
            _, lost = await _serve_until_done(
                websocket,
                _ring_for_runs(websocket, hub, store, watch, principal),
                _keep_reader(tokens, token),
            )
            await _close_if_access_lost(websocket, lost)


def _reader(tokens: Tokens, token: str | None) -> Principal:
    """The token's principal, when it may read runs (Unauthenticated, Forbidden otherwise)."""
    principal = tokens.authenticate(token)
    if not principal.open and "read" not in principal.scopes:
        raise Forbidden("the runs list needs a token with read scope")
    return principal


async def _keep_reader(tokens: Tokens, token: str | None) -> None:
    while True:  # as _keep_authorized: a revoked token's doorbell closes
        await anyio.sleep(ACCESS_RECHECK_S)
        await anyio.to_thread.run_sync(_reader, tokens, token)


async def _ring_for_runs(
    websocket: WebSocket, hub: LiveHub, store: Store, watch: RunsWatch, principal: Principal
) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await watch.wake.wait()
        moved = watch.take()
        if not principal.open and None not in moved:
            # Only news of the token's own projects: another project's activity is not its business.
            ids = {run_id for run_id in moved if run_id is not None}
            projects = await hub.read(partial(store.live.projects_of, ids))
            if not any(principal.sees(project) for project in projects):
                continue
        await websocket.send_text(_dumps({"type": "runs"}))
        rang = loop.time()
        await anyio.sleep(max(0.0, rang + RUNS_DOORBELL_MIN_S - loop.time()))


async def serve_stream(
    websocket: WebSocket,
    run_id: str,
    tenant: str,
    token_of: Callable[[], str | None],
    query: Callable[[], tuple[frozenset[str] | None, int | None, int | None]],
) -> None:
    """Serve one stream (the protocol of live()) to `tenant` (tenant_limits.tenant_of), as the token
    that token_of() returns may (or the Unauthenticated it raises): what query() returns (keys, rank,
    since), or the _BadQuery it raises, once the stream has its place."""
    # A stream takes its place among its tenant's before anything else is done (no thread, no database):
    # 2,000 streams opened at once by one token would otherwise queue 2,000 authorizations for the
    # worker threads every other request needs. A tenant at its most is held a while, then refused.
    tokens: Tokens = websocket.app.state.tokens
    limits: TenantLimits | None = websocket.app.state.tenant_limits if tokens.required() else None
    if limits is not None and not await _known_token(websocket, token_of):
        return
    async with stream_place(limits, tenant) as refused:
        if refused is not None:
            await websocket.close(CLOSE_TRY_AGAIN_LATER)  # before accept: HTTP 403 to the handshake
            return
        await websocket.accept()  # first: a close code and reason reach the client only on an open socket
        try:
            keys, rank, since = query()
            token = token_of()
            stored = await anyio.to_thread.run_sync(_authorize, websocket, run_id, token)
        except (_BadQuery, Unauthenticated, Forbidden, NotFound) as exc:
            await _refuse(websocket, exc)
            return
        await _stream(websocket, run_id, stored, token, keys, rank, since)


async def _stream(
    websocket: WebSocket,
    run_id: str,
    stored: str,
    token: str | None,
    keys: frozenset[str] | None,
    rank: int | None,
    since: int | None,
) -> None:
    hub: LiveHub = websocket.app.state.live
    store: Store = websocket.app.state.store
    with hub.subscribe(stored) as wake:  # before the cursor: nothing stored meanwhile is missed
        try:
            cursor = await hub.read(lambda: store.live.open_cursor(stored, keys, rank, since))
        except NotFound:  # deleted since it was authorized (the store's message names the stored id)
            await _close(websocket, CLOSE_NOT_FOUND, f"run {run_id!r} does not exist")
            return
        except Exception:
            logger.exception("gradwatch: could not open a live stream of run %r", run_id)
            await _close(websocket, CLOSE_INTERNAL_ERROR, "the server could not read the run; try again")
            return
        assert cursor.status is not None
        try:
            await websocket.send_text(_dumps(status_message(cursor.status)))
        except WebSocketDisconnect:
            return
        wake.set()  # read at once: the backlog after `since`, and whatever was stored since the cursor
        failure, lost = await _serve_until_done(
            websocket,
            _push(websocket, hub, store, cursor, wake),
            _keep_authorized(websocket, run_id, stored, token),
        )
        if await _close_if_access_lost(websocket, lost):
            return
        if isinstance(failure, NotFound) or isinstance(lost, NotFound):
            await _close(websocket, CLOSE_NOT_FOUND, f"run {run_id!r} was deleted")
        elif failure is not None and not isinstance(failure, WebSocketDisconnect):
            raise failure


async def _serve_until_done(
    websocket: WebSocket, pusher: Coroutine[Any, Any, None], access: Coroutine[Any, Any, None]
) -> tuple[BaseException | None, BaseException | None]:
    """Run a stream's pusher and its access checks until either ends or the client leaves; what the
    pusher and the access check raised, if they ended so."""
    receiver = asyncio.create_task(_until_disconnect(websocket))
    pushing, checking = asyncio.create_task(pusher), asyncio.create_task(access)
    try:
        await asyncio.wait((receiver, pushing, checking), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (receiver, pushing, checking):
            task.cancel()
        await asyncio.gather(receiver, pushing, checking, return_exceptions=True)
    failure = None if pushing.cancelled() else pushing.exception()
    lost = None if checking.cancelled() else checking.exception()
    return failure, lost


async def _close_if_access_lost(websocket: WebSocket, lost: BaseException | None) -> bool:
    """Close with 4401 / 4403 when the stream's token stopped being accepted; whether it did."""
    if not isinstance(lost, (Unauthenticated, Forbidden)):
        return False
    await _refuse(websocket, lost)
    return True


ACCESS_RECHECK_S = 2.0  # a revoked token's open stream closes within this long


async def _keep_authorized(websocket: WebSocket, run_id: str, stored: str, token: str | None) -> None:
    """Check the stream's token again every ACCESS_RECHECK_S: revoking a token closes its open streams
    (raises Unauthenticated / Forbidden / NotFound like the first check; NotFound too once run_id names
    another run than the stream's)."""
    while True:
        await anyio.sleep(ACCESS_RECHECK_S)
        if await anyio.to_thread.run_sync(_authorize, websocket, run_id, token) != stored:
            raise NotFound(f"run {run_id!r} was deleted")


async def _until_disconnect(websocket: WebSocket) -> None:
    """Read (and ignore) what the client sends, until it disconnects."""
    while (await websocket.receive())["type"] != "websocket.disconnect":
        pass


async def _push(
    websocket: WebSocket, hub: LiveHub, store: Store, cursor: LiveCursor, wake: asyncio.Event
) -> None:
    """Read what is new whenever woken (or every refresh interval) and send it; one read at a time,
    wake-ups during a read or a slow send merge into the next read."""
    loop = asyncio.get_running_loop()
    last_read = loop.time()
    failures = 0
    while True:
        await hub.wait(wake, last_read)
        last_read = loop.time()
        try:
            update = await hub.read(lambda: store.live.read_new(cursor))
        except NotFound:
            raise
        except Exception:  # the database may be back by the next read; the cursor did not move
            failures += 1
            if failures == 1:
                logger.exception("gradwatch: live read for run %r failed; retrying", cursor.run_id)
            await anyio.sleep(min(hub.refresh_interval_s, 0.5 * failures))
            wake.set()
            continue
        failures = 0
        for message in messages(update):
            await websocket.send_text(_dumps(message))
        if update.more:
            wake.set()
