"""Composition root: the API and the dashboard in one process on one port.

This is the only module of the server that imports the dashboard; the dashboard in turn reads data
only through the API's HTTP endpoints (api_base_url).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from urllib.parse import unquote_plus

import uvicorn
from fastapi import FastAPI, WebSocket
from fastapi.responses import RedirectResponse

from .._errors import GradwatchError
from . import connections
from .app import create_app
from .auth import TOKEN_PREFIX
from .listener import GuardedServer
from .settings import Settings
from .web_security import is_loopback


def create_full_app(settings: Settings, api_base_url: str) -> FastAPI:
    """API under /api/v1 plus the Dash dashboard under /dashboard/."""
    import httpx
    from a2wsgi import WSGIMiddleware

    from gradwatch.dashboard import create_dash_app
    from gradwatch.dashboard.pages import signin

    from .routers import live

    app = create_app(settings)
    # The dashboard's connection pool to the API; closed with the server.
    http_client = httpx.Client(timeout=30.0)
    app.state.on_shutdown.append(http_client.close)
    dash_app = create_dash_app(
        api_base_url, requests_pathname_prefix="/dashboard/", http_client=http_client, live_doorbell=True
    )

    # The live pages' doorbells (see dashboard/assets/live_doorbell.js): under the dashboard's path,
    # where the browser sends the signed-in person's cookie (HttpOnly: page scripts cannot read it).
    @app.websocket("/dashboard/live/{run_id}")
    async def _run_doorbell(websocket: WebSocket, run_id: str) -> None:
        await live.doorbell(websocket, run_id, websocket.cookies.get(signin.COOKIE) or None)

    @app.websocket("/dashboard/live")
    async def _runs_doorbell(websocket: WebSocket) -> None:
        await live.runs_doorbell(websocket, websocket.cookies.get(signin.COOKIE) or None)

    @app.get("/", include_in_schema=False)
    @app.get("/dashboard", include_in_schema=False)
    def _to_dashboard() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    app.mount("/dashboard", WSGIMiddleware(dash_app.server))  # type: ignore[arg-type]
    return app


def local_url(host: str, port: int) -> str:
    """The URL this machine reaches a server bound to host:port by (0.0.0.0 → 127.0.0.1)."""
    reachable = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{reachable}:{port}"


class BackgroundServer:
    """A uvicorn server on its own thread (the demo and tests); stop() shuts it down cleanly."""

    def __init__(
        self, settings: Settings, host: str, port: int, with_dashboard: bool = True, insecure: bool = False
    ) -> None:
        url = local_url(host, port)
        app = create_full_app(settings, url) if with_dashboard else create_app(settings)
        check_exposure(app, host, insecure)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on", **connections.uvicorn_options()
        )
        redact_tokens_in_logs()
        self.server = GuardedServer(config, settings.connections_per_address, settings.ipv6_prefix_length)
        self.url = url
        self._thread = threading.Thread(target=self.server.run, name="gradwatch-server", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url} (is the port in use?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url} within {timeout:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


class ExposureRefused(GradwatchError, RuntimeError):
    """Binding beyond this machine with no tokens configured: anyone on the network could read and write."""


def check_exposure(app: FastAPI, host: str, insecure: bool) -> None:
    """Refuse (or, with insecure, warn about) serving an open server on a non-loopback address. The app's
    web security is told where it listens: it refuses other machines should it become open while serving."""
    app.state.web_security.listening_on(host, insecure)
    if is_loopback(host) or app.state.tokens.required():
        return
    if not insecure:
        raise ExposureRefused(
            f"refusing to listen on {host}: no access tokens exist, so anyone who can reach this address "
            "could read and write every run. Create tokens first (`gradwatch token create --project NAME "
            "--scope ingest`, with the same --database-url), or bind to 127.0.0.1, or pass --insecure "
            "on a network you trust"
        )
    print(
        f"gradwatch: WARNING: listening on {host} with no access tokens (--insecure): anyone who can reach "
        "this address can read and write every run",
        file=sys.stderr,
    )


class _RedactTokens(logging.Filter):
    """Access and WebSocket log lines show the request path; a token in it must not reach the log:
    the value of any query parameter whose name, as parsed, holds "token" (token, access_token,
    token[], tok%65n; after ?, & or ;), and anything shaped like a gradwatch token (gw_ and 16 or
    more token characters), wherever it stands."""

    # A query parameter: its name as sent (percent-encoded, any case), then its value.
    _pattern = re.compile(r"([?&;])([^=&;\s\"]+)=([^&;\s\"]*)")
    _shaped = re.compile(TOKEN_PREFIX + r"[A-Za-z0-9_\-]{16,}")

    @classmethod
    def _redact(cls, text: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = unquote_plus(match.group(2)).strip().lower()
            return f"{match.group(1)}{match.group(2)}=[redacted]" if "token" in name else match.group(0)

        return cls._shaped.sub(TOKEN_PREFIX + "[redacted]", cls._pattern.sub(one, text))

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._redact(arg) if isinstance(arg, str) else arg for arg in record.args)
        elif isinstance(record.msg, str):
            record.msg = self._redact(record.msg)
        return True


def redact_tokens_in_logs() -> None:
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactTokens) for f in logger.filters):
            logger.addFilter(_RedactTokens())


def serve_forever(settings: Settings, host: str, port: int, insecure: bool = False) -> None:
    """Run the full app in the foreground until Ctrl-C."""
    app = create_full_app(settings, local_url(host, port))
    check_exposure(app, host, insecure)
    config = uvicorn.Config(  # configures logging
        app, host=host, port=port, log_level="info", lifespan="on", **connections.uvicorn_options()
    )
    redact_tokens_in_logs()
    url = local_url(host, port)
    # What a user opens: uvicorn's own line names only the address it binds.
    print(f"gradwatch: the dashboard is at {url}/dashboard/ (the API at {url}/api/v1)", flush=True)
    try:
        GuardedServer(config, settings.connections_per_address, settings.ipv6_prefix_length).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C/SIGINT after its graceful shutdown
        pass
