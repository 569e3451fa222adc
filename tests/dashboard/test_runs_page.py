"""The runs list and the compare page through Flask's test client against fake APIs."""

from __future__ import annotations

import json

import httpx
import pytest
from dashboard_support import (
    RUN,
    RUNS_OUTPUTS,
    FakeApi,
    alert,
    app_client,
    apply_patch,
    callback_outputs,
    dash_call,
    refresh_runs,
    render,
    run_api,
)

from gradwatch.dashboard import create_dash_app


@pytest.fixture
def fake_api():
    return run_api()


@pytest.fixture
def dash_client(fake_api):
    return app_client(fake_api)


def runs_api(count=30):
    runs = [
        {
            **RUN,
            "id": f"r{i}",
            "name": f"run-{i:02d}",
            "project": "vision" if i % 3 else "llm",
            "last_step": i * 10,
            "summary": {"skips": i % 4, "scale": 1024.0},
        }
        for i in range(count)
    ]

    def handler(request):
        if request.url.path == "/api/v1/runs":
            limit, offset = int(request.url.params["limit"]), int(request.url.params["offset"])
            return httpx.Response(200, json={"data": runs[offset : offset + limit], "count": len(runs)})
        return httpx.Response(404, json={"detail": "nope"})

    app = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(handler))
    )
    return app.server.test_client()


def shown_names(response):
    words = json.dumps(response["runs-table"]["children"]).split('"')
    return list(dict.fromkeys(word for word in words if word.startswith("run-") and word != "run-select"))


def test_runs_list_links_each_run_and_renders_names_as_text(dash_client):
    response = refresh_runs(dash_client)

    text = json.dumps(response)
    assert '"href": "/dashboard/runs/r1"' in text
    assert '"children": "<b>not bold</b>"' in text  # a plain string child: React renders it as text
    assert "dangerouslySetInnerHTML" not in text
    for column in ("Project", "Name", "Status", "Last step", "Scale", "Skips", "Created"):
        assert f'"children": "{column}"' in text


def test_runs_list_pages_on_the_server_and_searches_and_sorts_client_side():
    client = runs_api()

    first = refresh_runs(client)
    assert len(shown_names(first)) == 25 and first["runs-pager"]["children"] == "1–25 of 30 runs"
    second = refresh_runs(client, page=1)
    assert shown_names(second) == ["run-25", "run-26", "run-27", "run-28", "run-29"]

    llm = refresh_runs(client, search="LLM")
    assert shown_names(llm) == [f"run-{i:02d}" for i in range(0, 30, 3)]
    assert llm["runs-total"]["data"] == 10
    by_step = refresh_runs(client, search="run-1", sort="last_step")
    assert shown_names(by_step)[:2] == ["run-19", "run-18"]
    assert "No runs match" in json.dumps(refresh_runs(client, search="zzz")["runs-table"])


def test_selected_runs_stay_ticked_when_the_list_is_redrawn():
    client = runs_api()
    table = json.dumps(refresh_runs(client, selected=["r1", "r2"])["runs-table"])
    assert table.count('"value": ["r1"]') == 1 and table.count('"value": ["r2"]') == 1


def test_runs_list_filters_by_status_and_tags_on_the_server():
    asked = []
    runs = [
        {**RUN, "id": f"r{i}", "name": f"run-{i:02d}", "status": ("running", "finished")[i % 2]}
        for i in range(6)
    ]

    def handler(request):
        if request.url.path == "/api/v1/runs":
            statuses, tags = request.url.params.get_list("status"), request.url.params.get_list("tag")
            asked.append((statuses, tags))
            found = [run for run in runs if not statuses or run["status"] in statuses]
            return httpx.Response(200, json={"data": found, "count": len(found)})
        return httpx.Response(404, json={"detail": "nope"})

    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(handler))
    ).server.test_client()
    finished = refresh_runs(client, statuses=["finished", "exploded"], tag="lora, fp16")
    assert shown_names(finished) == ["run-01", "run-03", "run-05"]
    assert (["finished"], ["lora", "fp16"]) in asked  # unknown statuses dropped; tags split on , and spaces
    searched = refresh_runs(
        client, statuses=["running"], search="run-0"
    )  # client-side search keeps the filter
    assert shown_names(searched) == ["run-00", "run-02", "run-04"] and asked[-1][0] == ["running"]


def test_a_quiet_running_run_is_shown_as_silent():
    from datetime import datetime, timedelta, timezone

    from gradwatch.dashboard.views import run_status

    now = datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)
    recent = (now - timedelta(seconds=30)).isoformat()
    quiet = (now - timedelta(hours=1)).isoformat()
    assert run_status({"status": "running", "updated_at": recent}, now) == "running"
    assert run_status({"status": "running", "updated_at": quiet}, now) == "silent"
    assert run_status({"status": "finished", "updated_at": quiet}, now) == "finished"


def test_runs_list_shows_open_alerts_as_a_badge():
    api = FakeApi(alerts=[alert(1), alert(2, acknowledged_at="2024-05-01T12:02:00+00:00"), alert(3)])
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    )
    table = json.dumps(refresh_runs(client.server.test_client())["runs-table"])

    assert '"children": "Alerts"' in table
    assert '"children": "2 open"' in table  # the acknowledged one is not open


def test_runs_list_still_shows_runs_when_alerts_cannot_be_read():
    table = json.dumps(refresh_runs(runs_api(3))["runs-table"])  # this API has no /alerts
    assert "run-00" in table and '"title": "alerts could not be read"' in table


# -- compare page ----------------------------------------------------------------------------------


def test_compare_page_overlays_the_chosen_key_of_each_run(dash_client, fake_api):
    page = json.dumps(render(dash_client, "/dashboard/compare", "?runs=r1,missing"))
    assert '"id": "compare-graph"' in page and '"data": ["r1", "missing"]' in page

    runs = dash_call(
        dash_client,
        ["compare-runs.children", "compare-key.options", "compare-key.value"],
        [(("compare-ids", "data"), ["r1", "missing"])],
        state=[(("compare-key", "value"), None)],
    )
    assert runs["compare-key"]["value"] == "loss"
    assert "Not found: missing" in json.dumps(runs["compare-runs"])
    graph = dash_call(
        dash_client,
        ["compare-graph.figure"],
        [(("compare-key", "value"), "loss"), (("compare-log", "value"), [])],
        state=[(("compare-ids", "data"), ["r1", "missing"])],
    )
    figure = apply_patch(graph["compare-graph"]["figure"])
    assert [trace["name"] for trace in figure["data"]] == ["&lt;b&gt;not bold&lt;/b&gt;"]
    # One /compare request for all the runs (again without the one that is gone), none per run:
    asked = [r.url for r in fake_api.requests if r.url.path == "/api/v1/compare"]
    assert [url.params.get_list("run") for url in asked] == [["r1", "missing"], ["r1"]]
    assert not [r for r in fake_api.requests if r.url.path.endswith("/series")]


def test_a_runs_list_tick_reads_the_list_again_only_when_a_run_changed(dash_client, fake_api):
    first = refresh_runs(dash_client)
    seen = first["runs-seen"]["data"]
    fake_api.requests.clear()

    body = {
        "output": ".." + "...".join(callback_outputs(dash_client, RUNS_OUTPUTS)) + "..",
        "outputs": [dict(zip(("id", "property"), o.split("."), strict=True)) for o in RUNS_OUTPUTS],
        "inputs": [
            {"id": "runs-refresh", "property": "n_intervals", "value": 1},
            {"id": "runs-search", "property": "value", "value": None},
            {"id": "runs-sort", "property": "value", "value": "newest"},
            {"id": "runs-page", "property": "data", "value": 0},
            {"id": "runs-status", "property": "value", "value": None},
            {"id": "runs-tag", "property": "value", "value": None},
        ],
        "state": [
            {"id": "selected-runs", "property": "data", "value": []},
            {"id": "runs-seen", "property": "data", "value": seen},
        ],
        "changedPropIds": ["runs-refresh.n_intervals"],
    }
    quiet = dash_client.post("/_dash-update-component", json=body)
    assert quiet.status_code == 204  # nothing changed: nothing redrawn
    assert [r.url.path for r in fake_api.requests] == ["/api/v1/runs"]  # the runs only: no alerts read

    fake_api.run["updated_at"] = "2024-05-01T12:06:00+00:00"  # the run got data
    fake_api.requests.clear()
    changed = refresh_runs(dash_client, seen=seen, tick=2)
    assert '"href": "/dashboard/runs/r1"' in json.dumps(changed["runs-table"])  # read and drawn again
    assert any(r.url.path == "/api/v1/alerts" for r in fake_api.requests)


def test_the_pager_shows_only_the_buttons_that_lead_somewhere():
    from gradwatch.dashboard.pages.runs import RUNS_PAGE_SIZE, pager_buttons

    hidden = {"visibility": "hidden"}
    assert pager_buttons(3, 0) == (hidden, hidden)  # one page: neither "Newer" nor "Older"
    assert pager_buttons(0, 0) == (hidden, hidden)
    assert pager_buttons(RUNS_PAGE_SIZE + 1, 0) == (hidden, {})
    assert pager_buttons(RUNS_PAGE_SIZE + 1, 1) == ({}, hidden)
    assert pager_buttons(3 * RUNS_PAGE_SIZE, 1) == ({}, {})


def test_a_run_that_recovered_shows_its_resolved_incidents_not_none(sqlite_server):
    """A real run whose overflow burst opened incidents that then resolved, against a real server: its
    alerts badge says "N resolved" (blue, the newest incident's title on hover), not a green "none";
    a healthy run beside it still says "none"."""
    from training import train

    import gradwatch

    with gradwatch.init(
        project="recover", name="burst", server=sqlite_server.url, flush_interval=0.05
    ) as run:
        train(130, run=run, overflow_steps=(10, 11, 12))  # the NaN loss clears after 100 finite steps
    with gradwatch.init(
        project="recover", name="calm", server=sqlite_server.url, flush_interval=0.05
    ) as calm:
        train(20, run=calm)
    incidents = httpx.get(f"{sqlite_server.url}/api/v1/runs/{run.id}/incidents").json()["data"]
    resolved = [incident for incident in incidents if incident["status"] == "resolved"]
    assert resolved and len(resolved) == len(incidents)  # the run recovered from every incident

    client = create_dash_app(sqlite_server.url).server.test_client()
    table = refresh_runs(client)["runs-table"]
    badges = dict(_name_and_badge(table["children"]))
    assert badges["burst"]["children"] == f"{len(resolved)} resolved"
    assert "badge-recovered" in badges["burst"]["className"]
    assert badges["burst"]["title"].endswith(resolved[0]["title"])  # the newest first
    assert badges["calm"]["children"] == "none"


def _name_and_badge(component):
    """(run name, alerts badge props) of each row of the rendered runs table (Dash components as JSON)."""
    if isinstance(component, list):
        for item in component:
            yield from _name_and_badge(item)
        return
    if not isinstance(component, dict):
        return
    props = component.get("props", {})
    if component.get("type") == "Tr":
        cells = props.get("children") or []
        texts = [json.dumps(cell) for cell in cells]
        link = next((cell for cell, text in zip(cells, texts, strict=True) if '"type": "Link"' in text), None)
        badge = next(
            (
                c["props"]["children"]
                for c in cells
                if "alerts-badge" in json.dumps(c) or '"?"' in json.dumps(c)
            ),
            None,
        )
        if link is not None and badge is not None:
            yield link["props"]["children"]["props"]["children"], badge["props"]
        return
    yield from _name_and_badge(props.get("children"))
