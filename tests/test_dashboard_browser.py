"""The dashboard in real headless Chromium, with real data from a real server and training loop."""

import pytest
from training import train

import gradwatch

pytestmark = pytest.mark.browser

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture
def browser_page(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems: list[str] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("dialog", lambda d: (problems.append(f"dialog opened: {d.message}"), d.dismiss()))
        page.problems = problems
        yield page
        browser.close()


def _graph_has(page, graph_id: str, condition: str, timeout: float = 20_000) -> None:
    """Wait until the Plotly figure inside dcc.Graph `graph_id` satisfies a JS condition on `data`."""
    page.wait_for_function(
        f"""() => {{
            const el = document.querySelector('#{graph_id} .js-plotly-plot');
            if (!el || !el.data) return false;
            const data = el.data;
            return {condition};
        }}""",
        timeout=timeout,
    )


def test_runs_list_and_run_page_show_the_scale_drop_and_skips(full_server, browser_page):
    hostile = "<script>alert('x')</script><img src=x onerror=alert(1)>"
    with gradwatch.init(project="browser", name=hostile, server=full_server.url, flush_interval=0.05) as run:
        train(40, run=run, overflow_steps=(10, 11, 12))
    page = browser_page

    page.goto(f"{full_server.url}/dashboard/")
    link = page.get_by_text(hostile, exact=True)  # the name is shown as text, not parsed as HTML
    link.wait_for(timeout=20_000)
    link.click()
    page.wait_for_url(f"**/dashboard/runs/{run.id}")

    _graph_has(page, "scale-graph", "data.some(t => t.name === 'skipped step' && t.x.length >= 3)")
    skip_steps = page.evaluate(
        "() => document.querySelector('#scale-graph .js-plotly-plot').data"
        ".find(t => t.name === 'skipped step').x"
    )
    assert {10, 11, 12} <= set(skip_steps)
    axis_type = page.evaluate("() => document.querySelector('#scale-graph .js-plotly-plot').layout.yaxis.type")
    assert axis_type == "log"
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.length === 40)")
    _graph_has(page, "grad-norm-graph", "data.some(t => t.x && t.x.length > 0)")
    assert page.locator("script:has-text(\"alert('x')\")").count() == 0
    assert page.problems == []


def test_run_page_of_a_live_run_updates_by_itself(full_server, browser_page):
    run = gradwatch.init(project="browser", name="live", server=full_server.url, flush_interval=0.05)
    for step in range(5):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run._flush(None)  # make sure the first points are out before the page loads
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/runs/{run.id}")
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.length >= 5)")
    for step in range(5, 12):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run._flush(None)
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.includes(11))")
    run.finish()
    assert page.problems == []


def test_unknown_run_page_says_so(full_server, browser_page):
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/runs/does-not-exist")
    page.get_by_text("not found", exact=False).first.wait_for(timeout=20_000)
