"""Shared fixtures: real databases (SQLite files, a fresh PostgreSQL database per test) and real
servers on 127.0.0.1.

PostgreSQL tests use GRADWATCH_TEST_POSTGRES_URL (default: the local server). Without a reachable
server they are skipped with the reason shown; with GRADWATCH_CI=1 (set by .ci/run) they fail instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import headless_chromium
import httpx
import pytest

POSTGRES_ADMIN_URL = os.environ.get(
    "GRADWATCH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
IN_CI = os.environ.get("GRADWATCH_CI") == "1"
# The webhook tests' receivers listen on 127.0.0.1, which servers refuse as a webhook target by default
# (SSRF protection: server/alerts/egress.py). Allow it here, at import, so every Settings() built in
# tests and every server subprocess (which inherits the environment) allows it; the SSRF tests
# (tests/test_webhook_ssrf.py) pass webhook_allow_private=False explicitly.
os.environ.setdefault("GRADWATCH_WEBHOOK_ALLOW_PRIVATE", "1")


def unavailable(reason: str) -> None:
    """Skip on a developer's machine, fail in CI: CI must never silently skip a service test."""
    if IN_CI:
        pytest.fail(f"{reason} (GRADWATCH_CI=1: this must run in CI)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _postgres_database() -> Iterator[str]:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(POSTGRES_ADMIN_URL)
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        connection = psycopg.connect(conninfo, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL not reachable at {admin.render_as_string()}: {exc}".strip())
    name = f"gradwatch_test_{uuid.uuid4().hex[:12]}"
    with connection:
        connection.execute(f'CREATE DATABASE "{name}"')
        try:
            yield admin.set(database=name).render_as_string(hide_password=False)
        finally:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'gradwatch.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    yield from _postgres_database()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path) -> Iterator[str]:
    """Each test using this runs twice: on a SQLite file and on a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'gradwatch.db'}"
    else:
        yield from _postgres_database()


def api_only_server(database_url: str) -> Iterator:
    """A real uvicorn server with the API only on `database_url` (a generator: the fixtures' body)."""
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(
        Settings(database_url=database_url), "127.0.0.1", free_port(), with_dashboard=False
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def api_server(database_url) -> Iterator:
    """A real uvicorn server with the API only, on a free loopback port."""
    yield from api_only_server(database_url)


@pytest.fixture
def tokens(database_url, api_server) -> Iterator:
    """The api_server's token store (tokens made here are the server's at once)."""
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine

    engine = make_engine(database_url)
    yield Tokens(engine)
    engine.dispose()


@pytest.fixture
def sqlite_server(sqlite_url) -> Iterator:
    """The same on a SQLite file only: for tests of the agent against a real server, not of the storage."""
    yield from api_only_server(sqlite_url)


@pytest.fixture
def full_server(sqlite_url) -> Iterator:
    """A real uvicorn server with API and dashboard (SQLite), on a free loopback port."""
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(Settings(database_url=sqlite_url), "127.0.0.1", free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(api_server):
    import httpx

    with httpx.Client(base_url=api_server.url, timeout=30) as c:
        yield c


@pytest.fixture
def browser_page(chromium_path):
    """A Playwright page in headless Chromium; `page.problems` collects console errors, page errors
    and dialogs (a dialog would mean injected script ran): tests end by asserting it is empty."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = headless_chromium.launch(playwright, chromium_path)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems: list[str] = []
        page.on(
            "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
        )
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("dialog", lambda d: (problems.append(f"dialog opened: {d.message}"), d.dismiss()))
        page.problems = problems
        yield page
        browser.close()


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = headless_chromium.chromium_path()
    if path is None:
        unavailable(f"Chromium not found at {headless_chromium.CHROMIUM} (apt-get install -y chromium)")
    return path


@contextlib.contextmanager
def server_process(database_url: str, tmp_path) -> Iterator[str]:
    """`python -m gradwatch.cli server` on a free port; yields its URL; SIGINT (graceful) on exit."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradwatch.cli",
                "server",
                "--port",
                str(port),
                "--database-url",
                database_url,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"GRADWATCH_HOME": str(tmp_path)},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, log_path.read_text()
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert "Traceback" not in log_path.read_text(), log_path.read_text()


# -- `make test-fast`: the pure rooms --------------------------------------------------------------

# Fixtures that start a server, a database server, a browser or other processes: a test using one is
# marked `slow` (make test-fast leaves it out; make test runs everything).
SLOW_FIXTURES = frozenset(
    {
        "api_server",
        "sqlite_server",
        "full_server",
        "server_process",
        "client",
        "tokens",
        "browser_page",
        "chromium_path",
        "postgres_url",
    }
)
SLOW_FOLDERS = ("system", "dashboard")  # whole processes, servers and browsers
# Modules that start servers of their own (faulty, hostile or slow ones), or wait out real timeouts.
SLOW_MODULES = frozenset(
    {
        "test_ingest_limits.py",
        "test_webhook_ssrf.py",
        "test_webhook_fairness.py",
        "test_hostile_tenants.py",
        "test_live.py",
        "test_alerts.py",
        "test_transport_faults.py",
        "test_http_hostile_server.py",
        "test_finish_and_dead_letters.py",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts servers, browsers or processes (not in make test-fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.parent.name
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            folder in SLOW_FOLDERS
            or item.path.name in SLOW_MODULES
            or SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            or params.get("database_url") == "postgres"
        ):
            item.add_marker(pytest.mark.slow)
