"""The dashboard in real headless Chromium, with real data from a real server and training loop."""

import re
import time

import pytest
from training import train

import gradwatch

pytestmark = pytest.mark.browser


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
    axis_type = page.evaluate(
        "() => document.querySelector('#scale-graph .js-plotly-plot').layout.yaxis.type"
    )
    assert axis_type == "log"
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.length === 40)")
    _graph_has(page, "grad-norm-graph", "data.some(t => t.x && t.x.length > 0)")
    assert page.locator("script:has-text(\"alert('x')\")").count() == 0
    assert page.problems == []


def test_an_alert_link_opens_its_projects_run_when_another_project_has_the_same_id(full_server, browser_page):
    """Issue 28: two projects may each have a run "job-9"; alert links and run.url name the project,
    so that they open that project's run even where ids are the server's (open server, every-project
    tokens), where the bare id is the run stored under it."""
    import httpx

    first = httpx.post(
        f"{full_server.url}/api/v1/runs", json={"project": "first", "id": "job-9", "name": "empty"}
    )
    assert first.status_code == 201
    with gradwatch.init(
        project="second", name="trained", run_id="job-9", server=full_server.url, flush_interval=0.05
    ) as run:
        train(30, run=run, overflow_steps=(10, 11, 12))
    assert run.id != "job-9" and run.url.endswith("/dashboard/runs/" + run.id + "?project=second")
    [incident] = httpx.get(f"{full_server.url}/api/v1/runs/{run.id}/incidents").json()["data"]
    assert incident["link"].endswith("/dashboard/runs/job-9?project=second&step=10")
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/{incident['link'].split('/dashboard/', 1)[1]}")
    page.get_by_text("trained", exact=True).wait_for(timeout=20_000)
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.length === 30)")
    page.goto(f"{full_server.url}/dashboard/runs/job-9")  # the bare id: the run stored under it
    page.get_by_text("empty", exact=True).wait_for(timeout=20_000)
    assert page.problems == []


def test_run_page_of_a_live_run_appends_new_points_and_keeps_the_zoom(full_server, browser_page):
    run = gradwatch.init(project="browser", name="live", server=full_server.url, flush_interval=0.05)
    for step in range(5):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run._flush(None)  # make sure the first points are out before the page loads
    page = browser_page
    responses: list = []
    page.on("response", lambda r: responses.append(r) if "/_dash-update-component" in r.url else None)
    page.goto(f"{full_server.url}/dashboard/runs/{run.id}")
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.length >= 5)")
    # Zoom in the way a user would (a relayout, which dcc.Graph writes into its figure).
    page.evaluate(
        "() => Plotly.relayout(document.querySelector('#loss-graph .js-plotly-plot'),"
        " {'xaxis.range': [0, 3]})"
    )
    for step in range(5, 12):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run._flush(None)
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.includes(11))")
    loss = page.evaluate(
        "() => { const g = document.querySelector('#loss-graph .js-plotly-plot');"
        " return {x: g.data[0].x, range: g.layout.xaxis.range}; }"
    )
    assert loss["x"] == list(range(12))  # each step once: the new points were appended, not repeated
    assert loss["range"] == [0, 3]  # the user's zoom survived the live update
    # The new points came as an append (a Patch that extends the trace), not as a whole new series.
    updates = [_body(response) for response in responses]
    assert any('"Extend"' in body and "loss-graph" in body for body in updates)
    run.finish()
    assert page.problems == []


def _live_run_page(full_server, page, name: str):
    """A running run with 5 loss points, its page open with the points drawn; and the times of the
    page's requests for its charts' refresh (the callback on the "refresh" interval; the heatmaps'
    refresh is rung at most every 10 s, so it may come late after news, and is left out)."""
    run = gradwatch.init(project="browser", name=name, server=full_server.url, flush_interval=0.05)
    for step in range(5):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run._flush(None)
    requests: list[float] = []

    def note(request) -> None:
        if "_dash-update-component" in request.url and '"id":"refresh"' in (request.post_data or ""):
            requests.append(time.monotonic())

    page.on("request", note)
    page.goto(f"{full_server.url}/dashboard/runs/{run.id}")
    _graph_has(page, "loss-graph", "data.some(t => t.x && t.x.length >= 5)")
    return run, requests


def _settled(page, requests: list[float], quiet_s: float = 1.5, timeout_s: float = 30.0) -> float:
    """Wait until the page has asked nothing for quiet_s (a loaded machine may take seconds to finish
    the refreshes an opening or a ring set off); the time it is quiet from."""
    deadline = time.monotonic() + timeout_s
    while (now := time.monotonic()) - max(requests, default=0.0) < quiet_s:
        assert now < deadline, f"the page kept asking for {timeout_s} s"
        page.wait_for_timeout(200)  # (not time.sleep: Playwright reports a page's requests while it waits)
    return now


def _log_and_see(run, page, step: int) -> None:
    run.log({"loss": 0.01}, step=step)
    run._flush(None)
    _graph_has(page, "loss-graph", f"data.some(t => t.x && t.x.includes({step}))")


def test_a_live_run_page_refreshes_when_the_server_rings_and_asks_nothing_while_the_run_is_idle(
    full_server, browser_page
):
    page = browser_page
    sockets: list = []
    page.on("websocket", lambda socket: sockets.append(socket))
    run, requests = _live_run_page(full_server, page, "doorbell")
    page.get_by_text("Live: streamed by the server.").wait_for(timeout=20_000)
    assert [socket.url.split("/dashboard/")[1] for socket in sockets] == [f"live/{run.id}"]
    _log_and_see(run, page, 5)  # the first ring after the page opened: its refreshes settle
    idle_from = _settled(page, requests)
    page.wait_for_timeout(5_000)  # polling every 2 s would ask twice
    assert [at for at in requests if at >= idle_from] == []
    _log_and_see(run, page, 6)  # rung: the page refreshes at once, without a poll
    run.finish()
    page.locator("#live-mode").wait_for(state="hidden", timeout=20_000)  # the run ended: nothing to stream
    for _ in range(100):  # (its close may have come already: no event to wait for then)
        if sockets[0].is_closed():
            break
        page.wait_for_timeout(200)
    assert sockets[0].is_closed()
    assert page.problems == []


def test_a_live_run_page_polls_when_the_stream_is_blocked(full_server, browser_page):
    page = browser_page
    # A proxy that does not pass WebSockets: every handshake fails.
    page.route_web_socket("**/dashboard/live/**", lambda socket: socket.close(code=1006))
    run, requests = _live_run_page(full_server, page, "no doorbell")
    page.get_by_text("Live: polling every 2 s.").wait_for(timeout=20_000)
    idle_from = time.monotonic()
    deadline = idle_from + 20
    while len([at for at in requests if at >= idle_from]) < 2:  # polls every 2 s, with nothing rung
        assert time.monotonic() < deadline, requests
        page.wait_for_timeout(200)
    _log_and_see(run, page, 5)
    run.finish()
    assert page.problems == []


def test_the_runs_list_shows_a_new_run_when_the_server_rings_and_asks_nothing_while_idle(
    full_server, browser_page
):
    page = browser_page
    requests: list[float] = []
    page.on(
        "request", lambda r: requests.append(time.monotonic()) if "_dash-update-component" in r.url else None
    )
    page.goto(f"{full_server.url}/dashboard/")
    page.get_by_text("Live: streamed by the server.").wait_for(timeout=20_000)
    idle_from = _settled(page, requests)
    page.wait_for_timeout(6_000)  # polling every 5 s would ask at least once
    assert [at for at in requests if at >= idle_from] == []
    run = gradwatch.init(project="browser", name="rung in", server=full_server.url, flush_interval=0.05)
    run.log({"loss": 1.0}, step=0)
    run._flush(None)
    page.get_by_text("rung in", exact=True).wait_for(timeout=20_000)
    run.finish()
    assert page.problems == []


def _body(response) -> str:
    """A response's body, or "" when Chromium no longer holds it (it drops older bodies, sooner on a
    busy machine); the newest, which the assertions look for, are there."""
    from playwright.sync_api import Error

    try:
        return response.text()
    except Error:
        return ""


def test_unknown_run_page_says_so(full_server, browser_page):
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/runs/does-not-exist")
    page.get_by_text("not found", exact=False).first.wait_for(timeout=20_000)


def test_run_page_shows_per_layer_heatmaps_and_the_histogram_of_a_chosen_layer(full_server, browser_page):
    options = {
        "layer_norms_every": 5,
        "histograms_every": 10,
        "update_ratio_every": 10,
        "dense_start_steps": 0,
    }
    with gradwatch.init(
        project="browser",
        name="layers",
        server=full_server.url,
        flush_interval=0.05,
        config={"lr": 0.01, "note": "<b>text</b>"},
    ) as run:
        train(30, run=run, overflow_steps=(12,), watch_options=options)
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/runs/{run.id}")

    # TinyNet has 6 parameter tensors: one heatmap row each, in model order, first at the top.
    layers = ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    _graph_has(page, "grad-norm-heatmap", "data.some(t => t.type === 'image' && t.hovertext.length === 6)")
    aliases, y_range = page.evaluate(
        "() => { const g = document.querySelector('#grad-norm-heatmap .js-plotly-plot');"
        " return [g.layout.yaxis.labelalias, g._fullLayout.yaxis.range]; }"
    )
    assert [aliases[str(row)] for row in range(6)] == layers
    assert y_range[0] > y_range[1]  # reversed: layer 0 at the top
    _graph_has(page, "grad-norm-heatmap", "data.some(t => t.name === 'non-finite' && t.x.includes(12))")
    _graph_has(page, "underflow-heatmap", "data.some(t => t.type === 'image' && t.hovertext.length === 6)")
    _graph_has(page, "update-ratio-heatmap", "data.some(t => t.type === 'image')")

    # Hovering a cell names its layer and step and shows its value; clicking it picks them.
    page.locator("#grad-norm-heatmap").scroll_into_view_if_needed()
    cell = page.evaluate(
        "() => { const g = document.querySelector('#grad-norm-heatmap .js-plotly-plot');"
        " const box = g.querySelector('.nsewdrag').getBoundingClientRect(), image = g.data[0];"
        " const xa = g._fullLayout.xaxis, ya = g._fullLayout.yaxis, column = image.hovertext[2].length - 1;"
        " return {x: box.left + xa.d2p(image.x0 + column * image.dx), y: box.top + ya.d2p(2),"
        " value: image.hovertext[2][column], step: image.x0 + column * image.dx}; }"
    )
    page.mouse.move(cell["x"], cell["y"])
    label = page.locator("#grad-norm-heatmap .hoverlayer .hovertext").first
    label.wait_for(timeout=10_000)
    assert "hidden.weight" in label.text_content() and cell["value"] in label.text_content()
    page.mouse.click(cell["x"], cell["y"])
    page.wait_for_function(
        "() => document.querySelector('#hist-graph .js-plotly-plot')"
        ".layout.title.text.includes('hidden.weight')",
        timeout=20_000,
    )
    page.wait_for_function(
        f"() => (document.querySelector('#loss-graph .js-plotly-plot').layout.shapes || [])"
        f".some(s => s.x0 === {round(cell['step'])})",
        timeout=20_000,
    )
    _graph_has(page, "scale-graph", "data.some(t => t.name === 'fp16 safe band')")

    # Pick another layer and see its histogram.
    _graph_has(page, "hist-graph", "data.some(t => t.type === 'bar')")
    page.locator("#hist-layer").click()
    page.get_by_role("option", name="inp.weight", exact=True).click()
    page.wait_for_function(
        "() => document.querySelector('#hist-graph .js-plotly-plot')"
        ".layout.title.text.includes('inp.weight')",
        timeout=20_000,
    )
    page.locator("#hist-layer").click()
    page.get_by_role("option", name="hidden.weight", exact=True).click()
    page.wait_for_function(
        "() => document.querySelector('#hist-graph .js-plotly-plot')"
        ".layout.title.text.includes('hidden.weight')",
        timeout=20_000,
    )
    _graph_has(page, "hist-time-graph", "data.some(t => t.type === 'heatmap' && t.x.length === 3)")
    bar, title = page.evaluate(
        "() => { const g = document.querySelector('#hist-graph .js-plotly-plot');"
        " return [g.data[0], g.layout.title.subtitle.text]; }"
    )
    zeros = int(re.search(r"zeros ([\d,]+)", title).group(1).replace(",", ""))
    assert sum(bar["y"]) + zeros == 32 * 32  # every element of hidden.weight's gradient is counted once

    # Clicking an event's step marks it on the charts and moves the histogram to the nearest step.
    page.locator("#events-table").get_by_role("button", name="12", exact=True).first.click()
    page.wait_for_function(
        "() => (document.querySelector('#loss-graph .js-plotly-plot').layout.shapes || [])"
        ".some(s => s.x0 === 12)",
        timeout=20_000,
    )
    page.wait_for_function(
        "() => document.querySelector('#hist-graph .js-plotly-plot').layout.title.text.includes('step 10')",
        timeout=20_000,
    )
    page.get_by_text("Config (2 keys)", exact=False).click()
    page.get_by_text("<b>text</b>", exact=False).wait_for(timeout=5_000)  # config is shown as text
    assert page.problems == []


def test_runs_list_search_and_compare_two_runs(full_server, browser_page):
    for name, lr in (("cmp-a", 1.0), ("cmp-b <i>x</i>", 2.0), ("other", 3.0)):
        with gradwatch.init(project="browser", name=name, server=full_server.url, flush_interval=0.05) as run:
            for step in range(20):
                run.log({"loss": lr / (step + 1)}, step=step)
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/")
    page.get_by_role("link", name="other", exact=True).wait_for(timeout=20_000)

    page.locator("#runs-search").fill("cmp-")
    page.get_by_role("link", name="other", exact=True).wait_for(state="detached", timeout=20_000)
    for name in ("cmp-a", "cmp-b <i>x</i>"):
        row = page.locator("tr").filter(has=page.get_by_role("link", name=name, exact=True))
        row.locator("input[type=checkbox]").check()
    page.locator("#compare-link").click()
    page.wait_for_url("**/dashboard/compare?runs=*")
    _graph_has(page, "compare-graph", "data.length === 2 && data.every(t => t.x.length === 20)")
    names = page.evaluate(
        "() => document.querySelector('#compare-graph .js-plotly-plot').data.map(t => t.name)"
    )
    assert sorted(names) == ["cmp-a", "cmp-b &lt;i&gt;x&lt;/i&gt;"]  # escaped for plotly: shown as text
    assert page.locator("#compare-graph i").count() == 0
    assert page.problems == []
