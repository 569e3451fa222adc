"""A server that requires tokens, in real headless Chromium: the dashboard asks for a token, refuses a
wrong one, shows only the token's project once signed in, keeps the token in an HttpOnly
browser-session cookie (never in the page), and signing out asks again."""

import httpx
import pytest
from headless_chromium import launch

from gradwatch.server.auth import Tokens
from gradwatch.server.database import make_engine

pytestmark = pytest.mark.browser

WAIT_MS = 20_000


def test_dashboard_asks_for_a_token_and_keeps_it_only_in_the_session(full_server, sqlite_url, chromium_path):
    from playwright.sync_api import expect, sync_playwright

    engine = make_engine(sqlite_url)
    tokens = Tokens(engine)
    _, write_alpha = tokens.create("alpha", "ingest", "agents")
    _, read_alpha = tokens.create("alpha", "read", "alice")
    engine.dispose()
    with httpx.Client(base_url=full_server.url, headers={"Authorization": f"Bearer {write_alpha}"}) as api:
        for project, name in (("alpha", "<script>alert('alpha')</script>visible-run"), ("alpha", "second")):
            assert api.post("/api/v1/runs", json={"project": project, "name": name}).status_code == 201
    _, write_beta = Tokens(make_engine(sqlite_url)).create("beta", "ingest", "other team")
    with httpx.Client(base_url=full_server.url, headers={"Authorization": f"Bearer {write_beta}"}) as api:
        assert api.post("/api/v1/runs", json={"project": "beta", "name": "hidden-run"}).status_code == 201

    with sync_playwright() as playwright:
        browser = launch(playwright, chromium_path)
        context = browser.new_context()
        page = context.new_page()
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))

        page.goto(f"{full_server.url}/dashboard/alerts")
        expect(page.locator("#signin-token")).to_be_visible(timeout=WAIT_MS)
        page.locator("#signin-token").fill("gw_wrong")
        page.locator("#signin-submit").click()
        expect(page.locator("#signin-error")).to_contain_text("not accepted", timeout=WAIT_MS)
        assert "error=rejected" in page.url  # a code in the address, never the words shown
        # A link cannot make the page say what its author wants: only the page's own codes show.
        page.goto(
            f"{full_server.url}/dashboard/signin?error=Session+expired:+call+support+at+555-0100"
            "&next=/dashboard/alerts"
        )
        expect(page.locator("#signin-token")).to_be_visible(timeout=WAIT_MS)
        expect(page.locator("#signin-error")).to_have_count(0)
        expect(page.get_by_text("555-0100")).to_have_count(0)

        page.locator("#signin-token").fill(read_alpha)
        page.locator("#signin-submit").click()
        page.wait_for_url("**/dashboard/alerts", timeout=WAIT_MS)  # back where the person was
        page.locator("#nav-runs").click()
        expect(page.get_by_text("visible-run", exact=False)).to_be_visible(timeout=WAIT_MS)
        expect(page.get_by_text("<script>alert('alpha')</script>visible-run")).to_be_visible()
        expect(page.get_by_text("hidden-run")).to_have_count(0)  # another project's run

        [cookie] = [c for c in context.cookies() if c["name"] == "gradwatch_token"]
        assert (
            cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["expires"] == -1
        )  # session only
        assert read_alpha not in page.content()
        assert page.evaluate("document.cookie") == ""  # page scripts cannot read it
        assert (
            page.evaluate("JSON.stringify(sessionStorage) + JSON.stringify(localStorage)").count("gw_") == 0
        )

        page.goto(f"{full_server.url}/dashboard/signout")  # a link to it signs nobody out
        expect(page.locator("#signout")).to_be_visible(timeout=WAIT_MS)
        assert [c for c in context.cookies() if c["name"] == "gradwatch_token"]
        page.locator("#signout").click()  # the sign-out form (POST, with the CSRF token)
        expect(page.locator("#signin-token")).to_be_visible(timeout=WAIT_MS)
        expect(page.locator("#signout")).to_have_count(0)
        page.goto(f"{full_server.url}/dashboard/")
        expect(page.locator("#signin-token")).to_be_visible(timeout=WAIT_MS)
        assert not [c for c in context.cookies() if c["name"] == "gradwatch_token"]
        browser.close()
    assert problems == []


def test_signin_never_redirects_off_the_dashboard(full_server, sqlite_url):
    engine = make_engine(sqlite_url)
    _, token = Tokens(engine).create("alpha", "read")
    engine.dispose()
    with httpx.Client(base_url=full_server.url, follow_redirects=False) as client:
        client.cookies.set("gradwatch_csrf", "c" * 43)  # the double-submit pair a rendered form carries
        csrf = {"csrf": "c" * 43}
        response = client.post(
            "/dashboard/signin", data={"token": token, "next": "https://evil.example/"} | csrf
        )
        assert response.status_code == 302 and response.headers["location"] == "/dashboard/"
        response = client.post("/dashboard/signin", data={"token": token, "next": "//evil.example/x"} | csrf)
        assert response.headers["location"] == "/dashboard/"
        response = client.post("/dashboard/signin", data={"token": token, "next": "/dashboard/alerts"} | csrf)
        assert response.headers["location"] == "/dashboard/alerts"
        assert (
            "HttpOnly" in response.headers["set-cookie"]
            and "SameSite=Strict" in response.headers["set-cookie"]
        )


def test_signing_out_takes_the_forms_csrf_token(full_server, sqlite_url):
    """Deleting the cookie needs no cookie sent: without the double-submit token (another site's form,
    a GET from a link or an image) nobody is signed out."""
    engine = make_engine(sqlite_url)
    _, token = Tokens(engine).create("alpha", "read")
    engine.dispose()
    with httpx.Client(base_url=full_server.url, follow_redirects=False) as client:
        client.cookies.set("gradwatch_token", token, path="/dashboard/")
        for response in (
            client.get("/dashboard/signout"),
            client.post("/dashboard/signout"),
            client.post("/dashboard/signout", data={"csrf": "forged" * 8}),
        ):
            assert response.status_code == 302, response.text
            assert "gradwatch_token" not in response.headers.get("set-cookie", "")
        client.cookies.set("gradwatch_csrf", "c" * 43, path="/dashboard/")
        response = client.post("/dashboard/signout", data={"csrf": "c" * 43})
        assert response.status_code == 302 and response.headers["location"] == "/dashboard/signin"
        assert (
            response.headers["set-cookie"].startswith("gradwatch_token=;")
            and "Max-Age=0" in response.headers["set-cookie"]
        )


def test_every_page_works_signed_in_with_a_read_token(full_server, sqlite_url, chromium_path):
    """The run page, the runs list, compare and alerts fetch in worker threads: they must carry the
    signed-in person's token too (issue 14: they answered 401 and showed "?" badges). The run's id is
    another project's too: every page and link finds the team's own run by it (issue 28)."""
    from playwright.sync_api import expect, sync_playwright
    from training import train

    import gradwatch

    engine = make_engine(sqlite_url)
    tokens = Tokens(engine)
    _, write_token = tokens.create("team", "ingest", "agents")
    _, read_token = tokens.create("team", "read", "alice")
    _, rival_token = tokens.create("rival", "ingest", "another team")
    engine.dispose()
    rival = httpx.post(
        f"{full_server.url}/api/v1/runs",
        json={"project": "rival", "id": "shared-job", "name": "theirs"},
        headers={"Authorization": f"Bearer {rival_token}"},
    )
    assert rival.status_code == 201
    with gradwatch.init(
        project="team",
        name="signed-in",
        run_id="shared-job",
        server=full_server.url,
        token=write_token,
        flush_interval=0.05,
    ) as run:
        train(30, run=run, overflow_steps=(12, 13))
    assert run.id == "shared-job"

    with sync_playwright() as playwright:
        browser = launch(playwright, chromium_path)
        page = browser.new_page()
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(f"{full_server.url}/dashboard/")
        page.locator("#signin-token").fill(read_token)
        page.locator("#signin-submit").click()
        expect(page.get_by_text("signed-in", exact=True)).to_be_visible(timeout=WAIT_MS)
        badge = page.locator(".alerts-badge").first
        expect(badge).to_be_visible(timeout=WAIT_MS)
        assert badge.inner_text() != "?"

        page.goto(f"{full_server.url}/dashboard/runs/{run.id}")
        page.wait_for_function(
            "() => { const g = document.querySelector('#loss-graph .js-plotly-plot');"
            " return g && g.data && g.data.some(t => t.x && t.x.length === 30); }",
            timeout=WAIT_MS,
        )
        expect(page.locator("#run-verdict")).to_have_attribute("data-verdict", "critical", timeout=WAIT_MS)
        expect(page.locator("a[href*='/dashboard/runs/shared-job?step=']").first).to_be_visible()
        page.goto(f"{full_server.url}/dashboard/compare?runs={run.id}")
        page.wait_for_function(
            "() => document.querySelectorAll('.js-plotly-plot').length >= 1", timeout=WAIT_MS
        )
        page.goto(f"{full_server.url}/dashboard/alerts")
        expect(page.locator("#alerts-table")).to_contain_text("signed-in", timeout=WAIT_MS)
        expect(page.locator("#alerts-table")).not_to_contain_text("theirs")
        expect(page.locator("#alerts-read-only")).to_contain_text("admin scope")  # said up front
        expect(page.locator("#rule-create")).to_be_disabled()
        expect(page.locator("#webhook-create")).to_be_disabled()
        for url in ("/dashboard/", f"/dashboard/runs/{run.id}", f"/dashboard/compare?runs={run.id}"):
            page.goto(f"{full_server.url}{url}")
            page.wait_for_timeout(1500)  # the first refresh has run
            assert "401" not in page.inner_text("body"), url
        browser.close()
    assert problems == []
