"""The API application factory: settings in, a FastAPI app out; nothing is created at import time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import http_errors, ingest_limits
from .alerts import AlertEngine, AlertService, OutboxWorker
from .auth import Tokens
from .auth_first import AddressGate, AuthenticateBeforeBody
from .compression import GzipRequestBody
from .database import make_engine, prepare_schema
from .live import LiveHub
from .routers import alerts as alerts_router
from .routers import health, runs, series
from .routers import live as live_router
from .routers import ranks as ranks_router
from .settings import Settings
from .storage import Store
from .storage.liveness import mark_silent_runs
from .tenant_limits import TenantLimitMiddleware, TenantLimits
from .web_security import WebSecurity, WebSecurityPolicy


class BodySizeLimit:
    """Refuse request bodies above a size with 413, before they are read into memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(
            {"detail": f"request body larger than {self.max_bytes} bytes"}, status_code=413
        )
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _alerts(settings: Settings, store: Store) -> tuple[OutboxWorker | None, AlertService]:
    """The alert engine hooked into ingest, the API's alert service and (optionally) the delivery worker."""
    worker: OutboxWorker | None = None
    engine = AlertEngine(
        settings.public_url,
        group_wait_steps=settings.incident_group_wait_steps,
        group_wait_s=settings.incident_group_wait_s,
    )
    if settings.alert_worker:
        # Runs none of whose ranks reports any more become "crashed" (a SIGKILLed job says nothing).
        silent_runs = partial(mark_silent_runs, silent_s=settings.crashed_after_s)
        worker = OutboxWorker(
            store.engine,
            settings,
            periodic=(
                (settings.heartbeat_check_interval_s, silent_runs),
                (settings.heartbeat_check_interval_s, engine.check_heartbeats),
                (settings.incident_check_interval_s, engine.notify_due_incidents),
            ),
        )
        engine.on_enqueued = worker.wake
    store.before_ingest.append(engine.before_ingest)
    store.after_ingest.append(engine.after_ingest)
    return worker, AlertService(store.engine, engine, settings)


def create_app(settings: Settings, store: Store | None = None) -> FastAPI:
    """The JSON API. The database schema is checked (and an empty database migrated) here."""
    if store is None:
        engine = make_engine(settings.database_url)
        prepare_schema(engine, settings.database_url)
        store = Store(engine)
    store.second_writer_after_s = settings.second_writer_after_s
    worker, alerts = _alerts(settings, store)
    live = LiveHub(store.engine)  # live streams; on PostgreSQL across processes (LISTEN/NOTIFY)
    store.after_commit.append(live.after_commit)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if worker is not None:
            worker.start()
            app.state.on_shutdown.insert(0, worker.stop)
        live.start()
        app.state.on_shutdown.insert(0, live.stop)
        yield
        for close in app.state.on_shutdown:
            close()
        store.engine.dispose()  # close pooled connections on shutdown

    app = FastAPI(
        lifespan=lifespan,
        title="gradwatch",
        version="1",
        summary="Training-health monitoring for PyTorch: ingest, query and stream training signals.",
        responses=http_errors.ERROR_RESPONSES,
        # Non-ASCII escaped: any stored string renders, even one with a lone surrogate that a database
        # of an earlier version accepted (encoded as UTF-8 it would fail the whole answer: 500).
        default_response_class=http_errors.AsciiJSONResponse,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.on_shutdown = []  # callables run at shutdown, e.g. by the composition root
    app.state.alerts = alerts
    app.state.tokens = Tokens(store.engine, open_after_revocation=settings.open_after_revocation)
    app.state.live = live
    app.state.web_security = WebSecurityPolicy(settings)  # serve.check_exposure says where it listens

    http_errors.install(app)  # every exception handler of the API
    for router in (health.router, runs.router, series.router, series.compare_router, alerts_router.router):
        app.include_router(router)
    app.include_router(ranks_router.router)
    app.include_router(live_router.router)
    app.add_middleware(GzipRequestBody, max_bytes=settings.max_body_bytes)  # inside the size limit
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    ingest_limits.install(app, settings)  # around the body limits: refuses before a byte is read
    # Reads, live streams and run creation per tenant (inside authentication: writes carry their principal).
    app.state.tenant_limits = TenantLimits()
    app.add_middleware(TenantLimitMiddleware, limits=app.state.tenant_limits, tokens=app.state.tokens)
    # Around the limiters: a request without a valid token (a write without its scope) is refused before
    # anything else is done, and the limiters count verified tokens only.
    app.state.pre_auth_gate = AddressGate()  # one address's token lookups at once (HTTP and streams)
    app.add_middleware(
        AuthenticateBeforeBody,
        tokens=app.state.tokens,
        gate=app.state.pre_auth_gate,
        ipv6_prefix_length=settings.ipv6_prefix_length,
    )
    app.add_middleware(WebSecurity, policy=app.state.web_security, tokens=app.state.tokens)  # outermost
    return app
