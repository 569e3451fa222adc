"""Browser-facing protections (server.web_security, dashboard.signin) against real uvicorn servers on
127.0.0.1: DNS rebinding (the Host allow-list), cross-site forms and fetches (the Origin check) on the
API, the dashboard's sign-in and live WebSockets, login CSRF (the sign-in form's double-submit token),
framing headers on every response, and an --open server beyond loopback that becomes open while serving
(the ASGI app called with a scope from another machine). One test drives real headless Chromium: an
attacker's page on another origin submits a sign-in form and frames the dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import free_port
from headless_chromium import launch
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from gradwatch.server.auth import Tokens
from gradwatch.server.database import make_engine
from gradwatch.server.serve import BackgroundServer
from gradwatch.server.settings import Settings

EVIL = "http://evil.example"
WAIT_MS = 20_000


def _host_port(url: str) -> str:
    return url.removeprefix("http://")


def _alert_and_webhook(api: httpx.Client) -> tuple[int, int]:
    """An alert (a NaN loss fires the default rule loss_non_finite) and a webhook of another project, so
    that the alert's incident never enqueues a delivery to it: every delivery counted is a test's."""
    run = api.post("/api/v1/runs", json={"project": "alerts", "name": "nan"}).json()
    batch = {"seq": 0, "scalars": [{"key": "loss", "steps": [0, 1], "values": [1.0, "NaN"]}]}
    assert api.post(f"/api/v1/runs/{run['id']}/batches", json=batch).status_code == 200  # no Origin: an agent
    [alert] = api.get("/api/v1/alerts", params={"run_id": run["id"]}).json()["data"]
    hook = api.post("/api/v1/webhooks", json={"project": "hooks", "url": "http://127.0.0.1:9/hook"})
    assert hook.status_code == 201, hook.text
    return alert["id"], hook.json()["id"]


# -- DNS rebinding: the Host allow-list -------------------------------------------------------------


def test_a_rebound_host_name_is_refused_and_loopback_names_are_answered(full_server):
    port = full_server.url.rsplit(":", 1)[1]
    with httpx.Client(base_url=full_server.url, timeout=30) as client:
        for path in ("/api/v1/runs", "/dashboard/", "/healthz"):
            refused = client.get(path, headers={"Host": f"evil.example:{port}"})
            assert refused.status_code == 400, (path, refused.text)
            detail = refused.json()["detail"]
            assert f"'evil.example:{port}'" in detail and "GRADWATCH_ALLOWED_HOSTS" in detail
        posted = client.post("/api/v1/runs", json={"project": "rebound"}, headers={"Host": "evil.example"})
        assert posted.status_code == 400
        assert client.get("/api/v1/runs", params={"project": "rebound"}).json()["data"] == []
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost", "10.0.0.5:8080"):
            assert client.get("/api/v1/runs", headers={"Host": host}).status_code == 200, host
        assert client.get("/dashboard/", headers={"Host": f"localhost:{port}"}).status_code == 200
        malformed = client.get("/healthz", headers={"Host": "a@evil.example"})
        assert malformed.status_code == 400


def test_configured_hosts_and_the_public_url_host_are_answered(sqlite_url, monkeypatch):
    monkeypatch.setenv("GRADWATCH_ALLOWED_HOSTS", " gw.example , team.example:9000 ")
    settings = Settings(database_url=sqlite_url, public_url="https://dash.example", alert_worker=False)
    assert settings.allowed_hosts == ("gw.example", "team.example:9000")
    server = BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for host, status in (
                ("gw.example", 200),
                ("GW.example:1234", 200),
                ("dash.example", 200),
                ("team.example:9000", 200),
                ("team.example:9001", 400),
                ("evil.example", 400),
            ):
                assert client.get("/healthz", headers={"Host": host}).status_code == status, host
    finally:
        server.stop()
    anything = BackgroundServer(
        Settings(database_url=sqlite_url, allowed_hosts=("*",), alert_worker=False),
        "127.0.0.1",
        free_port(),
        with_dashboard=False,
    ).start()
    try:
        assert httpx.get(f"{anything.url}/healthz", headers={"Host": "evil.example"}).status_code == 200
    finally:
        anything.stop()


def test_a_malformed_allowed_host_is_refused_when_the_app_is_built(sqlite_url):
    from gradwatch.server.app import create_app

    with pytest.raises(ValueError, match=re.escape("'gw.example/path'")):
        create_app(Settings(database_url=sqlite_url, allowed_hosts=("gw.example/path",), alert_worker=False))


# -- cross-site requests: the Origin check ----------------------------------------------------------


def test_cross_site_form_posts_change_nothing_and_same_origin_ones_do(full_server):
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what an HTML form on evil.example sends
    with httpx.Client(base_url=full_server.url, timeout=30) as api:
        alert_id, hook_id = _alert_and_webhook(api)
        acknowledge, test = f"/api/v1/alerts/{alert_id}/acknowledge", f"/api/v1/webhooks/{hook_id}/test"
        for headers in (
            {"Origin": EVIL},
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site"},
            {"Origin": full_server.url.replace("127.0.0.1", "localhost")},  # another origin
            {"Origin": full_server.url.replace("http:", "https:")},
        ):
            for path in (acknowledge, test):
                refused = api.post(path, content=b"", headers=form | headers)
                assert refused.status_code == 403, (path, headers, refused.text)
                assert "cross-site" in refused.json()["detail"]
        assert f"origin '{EVIL}'" in api.post(acknowledge, headers={"Origin": EVIL}).json()["detail"]
        assert "'null'" in api.post(test, headers={"Origin": "null"}).json()["detail"]
        assert api.get(f"/api/v1/alerts/{alert_id}").json()["acknowledged_at"] is None
        assert api.get(f"/api/v1/webhooks/{hook_id}/deliveries").json()["count"] == 0
        for method in ("PATCH", "DELETE", "PUT"):
            assert (
                api.request(method, f"/api/v1/webhooks/{hook_id}", headers={"Origin": EVIL}).status_code
                == 403
            )
        assert api.get(f"/api/v1/webhooks/{hook_id}").status_code == 200  # the DELETE did not happen
        assert api.get("/api/v1/runs", headers={"Origin": EVIL}).status_code == 200  # reads are not checked

        same_origin = {"Origin": full_server.url, "Sec-Fetch-Site": "same-origin"}
        assert api.post(acknowledge, headers=same_origin).status_code == 200
        assert api.post(test, headers=same_origin).status_code == 202
        assert api.get(f"/api/v1/alerts/{alert_id}").json()["acknowledged_at"] is not None
        assert api.get(f"/api/v1/webhooks/{hook_id}/deliveries").json()["count"] == 1


def test_behind_a_proxy_that_forwards_host_without_its_port_the_page_s_own_origin_passes(full_server):
    """server/deploy/nginx.conf forwards `Host $host` (no port) with X-Forwarded-For: a dashboard opened
    at http://gw.example:8080 posts with that Origin, and the request says Host: gw.example."""
    proxied = {"Host": "127.0.0.1", "X-Forwarded-For": "10.0.0.9", "X-Forwarded-Proto": "http"}
    with httpx.Client(base_url=full_server.url, timeout=30) as api:
        for origin in ("http://127.0.0.1:8080", "http://127.0.0.1"):
            posted = api.post("/api/v1/runs", json={"project": "p"}, headers=proxied | {"Origin": origin})
            assert posted.status_code == 201, posted.text
        for headers in (
            proxied | {"Origin": EVIL},
            proxied | {"Origin": "https://127.0.0.1:8080"},
            {"Host": "127.0.0.1", "Origin": "http://127.0.0.1:8080"},
        ):  # not proxied: another port
            assert api.post("/api/v1/runs", json={"project": "p"}, headers=headers).status_code == 403, (
                headers
            )


def test_dash_callbacks_from_another_site_are_refused(full_server):
    body = {
        "output": "page.children",
        "outputs": {"id": "page", "property": "children"},
        "inputs": [
            {"id": "url", "property": "pathname", "value": "/dashboard/"},
            {"id": "url", "property": "search", "value": ""},
        ],
        "changedPropIds": ["url.pathname"],
        "state": [],
    }
    with httpx.Client(base_url=full_server.url, timeout=30) as client:
        refused = client.post("/dashboard/_dash-update-component", json=body, headers={"Origin": EVIL})
        assert refused.status_code == 403 and EVIL in refused.json()["detail"]
        answered = client.post(
            "/dashboard/_dash-update-component", json=body, headers={"Origin": full_server.url}
        )
        assert answered.status_code == 200, answered.text


def test_live_streams_refuse_pages_of_other_sites_and_rebound_names(full_server):
    with httpx.Client(base_url=full_server.url, timeout=30) as api:
        run = api.post("/api/v1/runs", json={"project": "live", "id": "watched"}).json()
    url = f"ws://{_host_port(full_server.url)}/api/v1/runs/{run['id']}/live"
    for origin in (EVIL, "null"):
        with pytest.raises(InvalidStatus) as refused:
            connect(url, origin=origin, proxy=None, open_timeout=10)
        assert refused.value.response.status_code == 403
        assert "cross-site WebSocket" in json.loads(refused.value.response.body)["detail"]
    port = int(full_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock, pytest.raises(InvalidStatus) as rebound:
        connect(f"ws://evil.example:{port}/api/v1/runs/{run['id']}/live", sock=sock, open_timeout=10)
    assert rebound.value.response.status_code == 400
    for origin in (full_server.url, None):  # the dashboard's own page; a client that is not a browser
        with connect(url, origin=origin, proxy=None, open_timeout=10, close_timeout=2) as live:
            assert json.loads(live.recv(timeout=10))["type"] == "status"


# -- the dashboard's sign-in: Origin check and double-submit token ----------------------------------


@pytest.fixture
def read_token(full_server, sqlite_url) -> str:
    """A read token on full_server's database: the server now requires tokens."""
    engine = make_engine(sqlite_url)
    _, token = Tokens(engine).create("alpha", "read", "alice")
    engine.dispose()
    return token


def _sign_in(
    client: httpx.Client, token: str, cookie: str | None, field: str | None, **headers
) -> httpx.Response:
    client.cookies.clear()
    if cookie is not None:
        client.cookies.set("gradwatch_csrf", cookie, path="/dashboard/")
    form = {"token": token, "next": "/dashboard/alerts"} | ({"csrf": field} if field is not None else {})
    return client.post("/dashboard/signin", data=form, headers=headers)


def test_sign_in_needs_the_double_submit_token_and_a_same_origin_form(full_server, read_token):
    value = "c" * 43
    with httpx.Client(base_url=full_server.url, follow_redirects=False, timeout=30) as client:
        for cookie, field in ((None, None), (None, value), (value, None), (value, "d" * 43), ("", "")):
            refused = _sign_in(client, read_token, cookie, field)
            assert refused.status_code == 302, (cookie, field)
            assert refused.headers["location"].startswith("/dashboard/signin?error=")
            assert "gradwatch_token" not in refused.headers.get("set-cookie", "")
        cross_site = _sign_in(client, read_token, value, value, Origin=EVIL)
        assert cross_site.status_code == 403 and EVIL in cross_site.json()["detail"]
        assert "gradwatch_token" not in cross_site.headers.get("set-cookie", "")
        signed_in = _sign_in(client, read_token, value, value, Origin=full_server.url)
        assert signed_in.status_code == 302 and signed_in.headers["location"] == "/dashboard/alerts"
        assert "gradwatch_token=" in signed_in.headers["set-cookie"]


@contextlib.contextmanager
def _attacker_site(dashboard_url: str, token: str) -> Iterator[str]:
    """Another origin (http://localhost:PORT, another site than 127.0.0.1) serving pages that submit a
    sign-in form to the dashboard and frame it; yields its URL."""
    pages = {
        "/login-csrf": (
            f'<form method="POST" action="{dashboard_url}/dashboard/signin">'
            f'<input name="token" value="{token}"><input name="next" value="/dashboard/"></form>'
            "<script>addEventListener('load', () => setTimeout(() => document.forms[0].submit(), 50))"
            "</script>"
        ),
        "/frame": f'<iframe id="victim" src="{dashboard_url}/dashboard/" width="800" height="600"></iframe>',
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, "").encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def attacker_token(full_server, sqlite_url, read_token) -> str:
    engine = make_engine(sqlite_url)
    _, token = Tokens(engine).create("attacker", "read", "mallory")
    engine.dispose()
    return token


@pytest.mark.browser
def test_another_site_can_neither_sign_the_browser_in_nor_frame_the_dashboard(
    full_server, read_token, attacker_token, chromium_path
):
    from playwright.sync_api import expect, sync_playwright

    with _attacker_site(full_server.url, attacker_token) as attacker, sync_playwright() as playwright:
        browser = launch(playwright, chromium_path)
        context = browser.new_context()
        page = context.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda e: problems.append(str(e)))
        console: list[str] = []
        page.on("console", lambda m: console.append(m.text))

        with page.expect_response(f"{full_server.url}/dashboard/signin") as answer:
            page.goto(f"{attacker}/login-csrf")
        page.wait_for_url(f"{full_server.url}/dashboard/signin")
        assert answer.value.status == 403  # the browser sent Origin: http://localhost:PORT
        assert "cross-site POST" in page.inner_text("body")
        assert not [c for c in context.cookies() if c["name"] == "gradwatch_token"]

        page.goto(f"{attacker}/frame")
        # Until the browser has refused the frame and said why (a condition, not a fixed wait).
        deadline = time.monotonic() + WAIT_MS / 1000
        while True:
            refused = any("frame-ancestors 'none'" in message for message in console)
            [victim] = [frame for frame in page.frames if frame != page.main_frame]
            if refused and victim.url.startswith("chrome-error://"):  # not the dashboard
                break
            assert time.monotonic() < deadline, (victim.url, console)
            page.wait_for_timeout(100)

        page.goto(f"{full_server.url}/dashboard/")  # the victim's own visit: the form carries the token
        expect(page.locator("#signin-token")).to_be_visible(timeout=WAIT_MS)
        [csrf] = [c for c in context.cookies() if c["name"] == "gradwatch_csrf"]
        assert csrf["httpOnly"] and csrf["sameSite"] == "Strict" and csrf["path"] == "/dashboard/"
        assert page.locator("input[name=csrf]").get_attribute("value") == csrf["value"]
        assert page.evaluate("document.cookie") == ""
        page.locator("#signin-token").fill(read_token)
        page.locator("#signin-submit").click()
        expect(page.locator("#nav-runs")).to_be_visible(timeout=WAIT_MS)
        expect(page.locator("#signin-token")).to_have_count(0, timeout=WAIT_MS)
        assert [c for c in context.cookies() if c["name"] == "gradwatch_token"]
        browser.close()
    assert problems == []


# -- framing and sniffing headers ------------------------------------------------------------------


def test_every_response_forbids_framing_and_sniffing(full_server):
    with httpx.Client(base_url=full_server.url, follow_redirects=False, timeout=30) as client:
        responses = {
            "json": client.get("/healthz"),
            "not found": client.get("/api/v1/runs/nope"),
            "redirect": client.get("/"),
            "dashboard page": client.get("/dashboard/"),
            "dashboard asset": client.get("/dashboard/_dash-layout"),
            "refused host": client.get("/healthz", headers={"Host": "evil.example"}),
            "refused origin": client.post("/api/v1/runs", json={"project": "p"}, headers={"Origin": EVIL}),
            "openapi": client.get("/openapi.json"),
        }
        for what, response in responses.items():
            assert response.headers["content-security-policy"] == "frame-ancestors 'none'", what
            assert response.headers["x-frame-options"] == "DENY", what
            assert response.headers["x-content-type-options"] == "nosniff", what
            assert response.headers["referrer-policy"] == "same-origin", what
            assert len(response.headers.get_list("x-frame-options")) == 1, what


def test_a_page_s_own_content_security_policy_is_kept_and_framing_added():
    from starlette.responses import PlainTextResponse

    from gradwatch.server.web_security import WebSecurity, WebSecurityPolicy

    async def page(scope, receive, send):
        await PlainTextResponse("hi", headers={"Content-Security-Policy": "default-src 'self';"})(
            scope, receive, send
        )

    async def framed(scope, receive, send):
        response = PlainTextResponse(
            "hi",
            headers={"Content-Security-Policy": "frame-ancestors 'self'", "X-Frame-Options": "SAMEORIGIN"},
        )
        await response(scope, receive, send)

    async def get(app) -> httpx.Response:
        guarded = WebSecurity(app, WebSecurityPolicy(Settings(database_url="sqlite://")), tokens=None)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(guarded), base_url="http://127.0.0.1"
        ) as c:
            return await c.get("/")

    headers = asyncio.run(get(page)).headers
    assert headers["content-security-policy"] == "default-src 'self'; frame-ancestors 'none'"
    headers = asyncio.run(get(framed)).headers  # the page's own choice stands
    assert (
        headers["content-security-policy"] == "frame-ancestors 'self'"
        and headers["x-frame-options"] == "SAMEORIGIN"
    )


# -- open and exposed while serving ----------------------------------------------------------------


def _get_as(app, client_address: tuple[str, int], path: str, token: str | None = None) -> httpx.Response:
    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app, client=client_address)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8765") as client:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return await client.get(path, headers=headers)

    return asyncio.run(get())


@pytest.fixture
def exposed_apps(sqlite_url) -> Iterator:
    from gradwatch.server.app import create_app

    apps = []

    def make(**options):
        app = create_app(Settings(database_url=sqlite_url, alert_worker=False, **options))
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.state.store.engine.dispose()


def test_an_open_server_beyond_loopback_refuses_other_machines_once_the_last_token_is_revoked(exposed_apps):
    from gradwatch.server.serve import check_exposure

    elsewhere, here = ("10.1.2.3", 5000), ("127.0.0.1", 5000)
    app = exposed_apps(open_after_revocation=True)  # gradwatch server --host 0.0.0.0 --open
    record, token = app.state.tokens.create("team", "read")
    check_exposure(app, "0.0.0.0", insecure=False)  # tokens exist: it may start
    assert _get_as(app, elsewhere, "/api/v1/runs", token).status_code == 200
    app.state.tokens.revoke(record.id)  # now open
    refused = _get_as(app, elsewhere, "/api/v1/runs")
    assert refused.status_code == 503
    assert "open and exposed" in refused.json()["detail"] and "--insecure" in refused.json()["detail"]
    assert _get_as(app, elsewhere, "/healthz").status_code == 503
    assert _get_as(app, here, "/api/v1/runs").status_code == 200  # this machine (the dashboard's own calls)
    app.state.tokens.create("team", "read")
    assert _get_as(app, elsewhere, "/api/v1/runs").status_code == 401  # protected again: tokens required

    insecure = exposed_apps(open_after_revocation=True)  # the same database, started with --insecure
    check_exposure(insecure, "0.0.0.0", insecure=True)
    for stored in insecure.state.tokens.list():
        insecure.state.tokens.revoke(stored.id)
    assert _get_as(insecure, elsewhere, "/api/v1/runs").status_code == 200

    on_loopback = exposed_apps(open_after_revocation=True)
    check_exposure(on_loopback, "127.0.0.1", insecure=False)
    assert _get_as(on_loopback, elsewhere, "/api/v1/runs").status_code == 200  # through a local proxy

    without_open = exposed_apps()
    check_exposure(without_open, "0.0.0.0", insecure=False)  # a token was ever created: it stays required
    assert _get_as(without_open, elsewhere, "/api/v1/runs").status_code == 401
