"""The dashboard without a browser or a server: figure builders as pure functions, the API client over
httpx.MockTransport, and the Dash app's pages and callbacks through Flask's test client."""

from __future__ import annotations

import gc
import json
import math

import gradwatch.dashboard
import httpx
import pytest
from gradwatch.dashboard import create_dash_app, figures
from gradwatch.dashboard.api_client import ApiClient, ApiError, ApiUnavailable, RunNotFound
from gradwatch.dashboard.app import keep_view, parse_route

# -- figures: loss scale -----------------------------------------------------------------------------


def skip_event(step, scale_before, scale_after, layers=()):
    return {
        "step": step,
        "kind": "skip",
        "rank": 0,
        "data": {
            "scale_before": scale_before,
            "scale_after": scale_after,
            "non_finite_layers": list(layers),
            "non_finite_layer_count": len(layers),
        },
    }


SCALE_SERIES = {
    "key": "amp/scale",
    "steps": [0, 1, 2, 3, 4, 5],
    "values": [65536.0, 32768.0, 32768.0, 16384.0, 8192.0, 8192.0],
}
SKIPS = [
    skip_event(1, 65536.0, 32768.0, ["fc1.weight"]),
    skip_event(3, 32768.0, 16384.0),
    skip_event(4, 16384.0, 8192.0),
]


def trace_named(figure, name):
    matches = [trace for trace in figure.data if trace.name == name]
    assert len(matches) == 1, [trace.name for trace in figure.data]
    return matches[0]


def annotation_texts(figure):
    return [annotation.text for annotation in figure.layout.annotations]


def test_scale_figure_uses_a_log_axis_labelled_in_powers_of_two():
    figure = figures.scale_figure(SCALE_SERIES, SKIPS)

    assert figure.layout.title.text == "Loss scale"
    assert figure.layout.yaxis.type == "log"
    assert "2^16" in figure.layout.yaxis.ticktext
    for value, text in zip(figure.layout.yaxis.tickvals, figure.layout.yaxis.ticktext):
        assert text == f"2^{round(math.log2(value))}"
        assert math.log2(value) == round(math.log2(value))


def test_scale_figure_has_one_skip_marker_per_event_at_the_scale_before_the_skip():
    figure = figures.scale_figure(SCALE_SERIES, SKIPS)

    markers = trace_named(figure, "skipped step")
    assert markers.mode == "markers"
    assert markers.marker.symbol == "x"
    assert markers.marker.color == figures.ALERT_COLOR
    assert list(markers.x) == [1, 3, 4]
    assert list(markers.y) == [65536.0, 32768.0, 16384.0]
    assert "2^16 → 2^15" in markers.hovertext[0]
    assert "fc1.weight" in markers.hovertext[0]


def test_skip_without_a_usable_scale_before_takes_the_last_recorded_scale():
    events = [skip_event(3, "NaN", 8192.0), {"step": 4, "kind": "skip", "rank": 0, "data": {}}]

    markers = trace_named(figures.scale_figure(SCALE_SERIES, events), "skipped step")

    assert list(markers.x) == [3, 4]
    assert list(markers.y) == [32768.0, 16384.0]  # the scales recorded at steps 2 and 3


def test_skip_hover_text_escapes_layer_names_and_abbreviates_long_lists():
    layers = ["<img src=x onerror=alert(1)>"] + [f"layer{i}" for i in range(10)]

    markers = trace_named(
        figures.scale_figure(SCALE_SERIES, [skip_event(1, 65536.0, 32768.0, layers)]), "skipped step"
    )

    assert "<img" not in markers.hovertext[0]
    assert "&lt;img src=x onerror=alert(1)&gt;" in markers.hovertext[0]
    assert "(+6 more)" in markers.hovertext[0]


def test_non_finite_and_non_positive_scales_are_gaps():
    series = {"steps": [0, 1, 2, 3, 4, 5], "values": [65536.0, "NaN", "Infinity", "-Infinity", 0.0, None]}

    figure = figures.scale_figure(series, [])

    line = trace_named(figure, "scale")
    assert list(line.y) == [65536.0, None, None, None, None, None]
    assert line.connectgaps is False
    assert figure.layout.yaxis.type == "log"


def test_collapsed_scale_far_below_one_still_gets_power_of_two_ticks():
    series = {"steps": list(range(200)), "values": [2.0 ** (16 - step) for step in range(200)]}

    figure = figures.scale_figure(series, [])

    ticks = figure.layout.yaxis.ticktext
    assert 2 <= len(ticks) <= 12
    assert all(text.startswith("2^") for text in ticks)
    assert figure.layout.yaxis.tickvals[0] <= 2.0 ** (16 - 199)


# -- figures: loss, grad norm, lr --------------------------------------------------------------------


def test_non_finite_losses_are_gaps_in_the_line_and_markers_at_the_top():
    series = {"steps": [0, 1, 2, 3, 4], "values": [2.5, "NaN", 2.0, "Infinity", "-Infinity"]}

    figure = figures.loss_figure(series)

    line = trace_named(figure, "loss")
    assert list(line.y) == [2.5, None, 2.0, None, None]
    assert line.connectgaps is False
    markers = trace_named(figure, "non-finite")
    assert list(markers.x) == [1, 3, 4]
    assert list(markers.hovertext) == ["NaN at step 1", "Infinity at step 3", "-Infinity at step 4"]
    # Drawn on a hidden 0..1 axis overlaying y, so they sit at the top whatever the loss values are.
    assert markers.yaxis == "y2"
    assert all(y == figures.NON_FINITE_MARKER_Y for y in markers.y)
    assert figure.layout.yaxis2.overlaying == "y"
    assert tuple(figure.layout.yaxis2.range) == (0, 1)
    json.loads(figure.to_json())  # serialisable as Dash will send it


def test_python_float_nan_and_inf_are_treated_like_the_api_strings():
    figure = figures.loss_figure({"steps": [0, 1, 2], "values": [1.0, math.nan, math.inf]})

    assert list(trace_named(figure, "loss").y) == [1.0, None, None]
    assert list(trace_named(figure, "non-finite").hovertext) == ["NaN at step 1", "Infinity at step 2"]


def test_a_loss_that_is_only_nan_is_still_drawn_as_markers():
    figure = figures.loss_figure({"steps": [0, 1], "values": ["NaN", "NaN"]})

    assert figures.NO_DATA_TEXT not in annotation_texts(figure)
    assert len(trace_named(figure, "non-finite").x) == 2


def test_grad_norm_uses_a_log_axis_while_the_marker_axis_stays_linear():
    series = {"steps": [0, 1, 2, 3], "values": [0.5, 1200.0, "Infinity", 0.0]}

    figure = figures.grad_norm_figure(series)

    assert figure.layout.yaxis.type == "log"
    assert figure.layout.yaxis2.type in (None, "linear", "-")
    assert list(figure.data[0].y) == [0.5, 1200.0, None, None]
    assert list(trace_named(figure, "non-finite").x) == [2]
    assert figures.grad_norm_figure(series, log_y=False).layout.yaxis.type == "linear"


def test_lr_figure_draws_the_schedule():
    figure = figures.lr_figure({"steps": [0, 1, 2], "values": [1e-4, 2e-4, 3e-4]})

    assert list(figure.data[0].x) == [0, 1, 2]
    assert list(figure.data[0].y) == [1e-4, 2e-4, 3e-4]
    assert figure.layout.title.text == "Learning rate"


@pytest.mark.parametrize(
    "build",
    [
        figures.loss_figure,
        figures.grad_norm_figure,
        figures.lr_figure,
        lambda series: figures.scale_figure(series, []),
        lambda series: figures.scale_figure(series, None),
    ],
)
@pytest.mark.parametrize(
    "series",
    [
        {"key": "loss", "steps": [], "values": [], "downsampled": False},
        None,
        {},
        {"steps": "garbage", "values": None},
        {"steps": [0, 1], "values": [None, None]},
    ],
)
def test_empty_or_malformed_data_gives_a_no_data_figure(build, series):
    figure = build(series)

    assert figures.NO_DATA_TEXT in annotation_texts(figure)
    json.loads(figure.to_json())


def test_mismatched_or_junk_points_never_raise():
    series = {"steps": [0, 1, "two", 3, True], "values": [1.0, "oops", 3.0, {"x": 1}, 5.0, 6.0]}

    figure = figures.loss_figure(series)

    assert list(figure.data[0].x) == [0, 1, 3]
    assert list(figure.data[0].y) == [1.0, None, None]


def test_uirevision_is_set_so_refreshes_keep_the_users_zoom():
    assert (
        figures.loss_figure({"steps": [0], "values": [1.0]}, uirevision="run-7").layout.uirevision == "run-7"
    )
    assert figures.scale_figure(SCALE_SERIES, SKIPS, uirevision="run-7").layout.uirevision == "run-7"
    assert figures.empty_figure("Loss", uirevision="run-7").layout.uirevision == "run-7"


@pytest.mark.parametrize(
    ("scale", "text"),
    [
        (65536.0, "2^16"),
        (1.0, "2^0"),
        (2.0**-130, "2^-130"),
        (3000.0, "3000"),
        ("NaN", "NaN"),
        ("Infinity", "Infinity"),
        (None, "–"),
        (math.inf, "Infinity"),
    ],
)
def test_format_scale(scale, text):
    assert figures.format_scale(scale) == text


# -- API client --------------------------------------------------------------------------------------

RUN = {
    "id": "r1",
    "project": "llm",
    "name": "qlora-7b",
    "status": "running",
    "created_at": "2024-05-01T12:00:00+00:00",
    "updated_at": "2024-05-01T12:05:00+00:00",
    "last_step": 5,
    "config": {},
    "metadata": {},
    "summary": {"skips": 3, "scale": 8192.0},
}


class FakeApi:
    """A MockTransport handler serving one run; records every request it gets."""

    def __init__(self, run=RUN, series=None, events=SKIPS):
        self.run = dict(run)
        self.series = series if series is not None else {"amp/scale": SCALE_SERIES}
        self.events = events
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path, run_path = request.url.path, f"/api/v1/runs/{self.run['id']}"
        if path == "/api/v1/runs":
            return httpx.Response(200, json={"data": [self.run], "count": 1})
        if path == run_path:
            return httpx.Response(200, json=self.run)
        if path == run_path + "/keys":
            return httpx.Response(200, json={"data": sorted(self.series)})
        if path == run_path + "/series":
            key = request.url.params["key"]
            body = self.series.get(key, {"steps": [], "values": []})
            return httpx.Response(200, json={"key": key, "rank": 0, "downsampled": False, **body})
        if path == run_path + "/events":
            return httpx.Response(200, json={"data": self.events, "count": len(self.events)})
        return httpx.Response(404, json={"detail": "run 'unknown' does not exist"})


def client_for(handler, **options) -> ApiClient:
    return ApiClient(
        "http://gradwatch.test/", client=httpx.Client(transport=httpx.MockTransport(handler)), **options
    )


def test_list_runs_sends_paging_and_token_and_returns_runs_with_total():
    api = FakeApi()

    runs, count = client_for(api, token="s3cret").list_runs("llm", limit=10, offset=20)

    assert (runs, count) == ([RUN], 1)
    request = api.requests[0]
    assert str(request.url).startswith("http://gradwatch.test/api/v1/runs?")
    assert dict(request.url.params) == {"project": "llm", "limit": "10", "offset": "20"}
    assert request.headers["Authorization"] == "Bearer s3cret"


def test_no_token_sends_no_authorization_header():
    api = FakeApi()
    client_for(api).get_run("r1")
    assert "Authorization" not in api.requests[0].headers


def test_series_passes_key_and_range_and_keeps_non_finite_strings():
    api = FakeApi(series={"loss": {"steps": [0, 1], "values": [1.5, "NaN"]}})

    body = client_for(api).series("r1", "loss", start=0, end=100)

    assert body["values"] == [1.5, "NaN"]
    assert dict(api.requests[0].url.params) == {
        "key": "loss",
        "max_points": "2000",
        "start": "0",
        "end": "100",
    }
    client_for(api).series("r1", "loss", max_points=50)
    assert dict(api.requests[1].url.params) == {"key": "loss", "max_points": "50"}


@pytest.mark.parametrize("max_points", [1, 2001, 100_000])
def test_series_refuses_more_than_2000_points(max_points):
    with pytest.raises(ValueError, match=str(max_points)):
        client_for(FakeApi()).series("r1", "loss", max_points=max_points)


def test_events_and_keys():
    api = FakeApi()
    client = client_for(api)

    events, count = client.events("r1", kind="skip")
    assert (len(events), count) == (3, 3)
    assert api.requests[0].url.params["kind"] == "skip"
    assert client.keys("r1") == ["amp/scale"]


def test_unknown_run_raises_run_not_found_with_the_servers_message():
    with pytest.raises(RunNotFound, match="does not exist") as caught:
        client_for(FakeApi()).get_run("unknown")
    assert caught.value.run_id == "unknown"
    assert caught.value.status_code == 404


@pytest.mark.parametrize(
    ("run_id", "segment"), [("a/b", "a%2Fb"), ("..", "%2E%2E"), (".", "%2E"), ("x?y", "x%3Fy")]
)
def test_run_ids_stay_one_path_segment(run_id, segment):
    api = FakeApi()
    with pytest.raises(RunNotFound):
        client_for(api).get_run(run_id)
    assert api.requests[0].url.raw_path.decode() == f"/api/v1/runs/{segment}"


def test_connection_failure_and_server_errors_are_api_unavailable():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ApiUnavailable, match="did not answer"):
        client_for(refuse).list_runs()
    with pytest.raises(ApiUnavailable) as caught:
        client_for(lambda request: httpx.Response(503, json={"detail": "database is locked"})).list_runs()
    assert caught.value.status_code == 503
    assert "database is locked" in str(caught.value)


def test_other_client_errors_are_api_errors_with_the_detail():
    with pytest.raises(ApiError, match="limit must be") as caught:
        client_for(lambda request: httpx.Response(422, json={"detail": "limit must be <= 500"})).list_runs()
    assert not isinstance(caught.value, (ApiUnavailable, RunNotFound))
    with pytest.raises(ApiError, match="not JSON"):
        client_for(lambda request: httpx.Response(200, text="<html>")).list_runs()


@pytest.mark.parametrize("base_url", ["127.0.0.1:8765", "", "ftp://x"])
def test_base_url_must_be_http(base_url):
    with pytest.raises(ValueError, match="base_url"):
        ApiClient(base_url)


def test_close_leaves_a_passed_in_client_open_and_closes_its_own():
    passed = httpx.Client(transport=httpx.MockTransport(FakeApi()))
    with ApiClient("http://x", client=passed):
        pass
    assert not passed.is_closed
    passed.close()

    own = ApiClient("http://x")
    own.close()
    own.close()
    assert own._client.is_closed


def test_an_own_client_is_closed_when_the_api_client_is_collected():
    # A Dash app holds its ApiClient without a shutdown hook; pooled sockets must not be left to the GC.
    api = ApiClient("http://x")
    own = api._client
    del api
    gc.collect()
    assert own.is_closed


# -- the Dash app --------------------------------------------------------------------------------------


def test_package_exports_exactly_create_dash_app():
    assert gradwatch.dashboard.__all__ == ["create_dash_app"]
    for module in (gradwatch.dashboard, figures):
        for name in module.__all__:
            assert hasattr(module, name), name


@pytest.mark.parametrize(
    ("pathname", "route"),
    [
        ("/dashboard/", ("runs", None)),
        ("/dashboard", ("runs", None)),
        (None, ("runs", None)),
        ("/dashboard/runs/abc", ("run", "abc")),
        ("/dashboard/runs/abc/", ("run", "abc")),
        ("/dashboard/runs/a%2Fb", ("run", "a/b")),
        ("/dashboard/nope", ("unknown", "/nope")),
        ("/dashboard/runs", ("unknown", "/runs")),
    ],
)
def test_parse_route(pathname, route):
    assert parse_route(pathname, "/dashboard/") == route


def test_prefix_must_be_slash_delimited():
    with pytest.raises(ValueError, match="requests_pathname_prefix"):
        create_dash_app("http://127.0.0.1:1", "dashboard")


@pytest.fixture
def fake_api():
    return FakeApi(
        run={**RUN, "name": "<b>not bold</b>"},
        series={
            "amp/scale": SCALE_SERIES,
            "loss": {"steps": [0, 1, 2], "values": [2.0, "NaN", 1.5]},
            "grad/global_norm": {"steps": [0, 1, 2], "values": [1.0, "Infinity", 0.8]},
        },
    )


@pytest.fixture
def dash_client(fake_api):
    app = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(fake_api))
    )
    return app.server.test_client()


def get(client, path):
    response = client.get(path)
    response.close()  # static files are streamed; an unclosed one warns
    return response


def test_index_layout_and_assets_are_served_relative_to_the_mount(dash_client):
    index = get(dash_client, "/")
    assert index.status_code == 200
    assert b"<title>gradwatch</title>" in index.data
    assert b"/dashboard/assets/style.css" in index.data  # browser URLs carry the mount prefix

    layout = get(dash_client, "/_dash-layout")
    assert layout.status_code == 200
    layout_text = json.dumps(layout.json)
    assert '"id": "url"' in layout_text and '"id": "page"' in layout_text

    assert get(dash_client, "/runs/r1").status_code == 200  # deep links serve the app too
    assert get(dash_client, "/assets/style.css").status_code == 200


def dash_call(client, outputs, inputs, state=()):
    """POST one callback the way the Dash renderer does; returns {component id: {property: value}}."""
    body = {
        "output": outputs[0] if len(outputs) == 1 else ".." + "...".join(outputs) + "..",
        "outputs": [dict(zip(("id", "property"), output.split("."))) for output in outputs],
        "inputs": [{"id": i, "property": p, "value": v} for (i, p), v in inputs],
        "state": [{"id": i, "property": p, "value": v} for (i, p), v in state],
        "changedPropIds": [f"{i}.{p}" for (i, p), _ in inputs],
    }
    if len(outputs) == 1:
        body["outputs"] = body["outputs"][0]
    response = client.post("/_dash-update-component", json=body)
    assert response.status_code == 200, response.data
    return response.json["response"]


def test_runs_list_links_each_run_and_renders_names_as_text(dash_client):
    response = dash_call(dash_client, ["runs-table.children"], [(("runs-refresh", "n_intervals"), None)])

    text = json.dumps(response)
    assert '"href": "/dashboard/runs/r1"' in text
    assert '"children": "<b>not bold</b>"' in text  # a plain string child: React renders it as text
    assert "dangerouslySetInnerHTML" not in text
    for column in ("Project", "Name", "Status", "Last step", "Scale", "Skips", "Created"):
        assert f'"children": "{column}"' in text


def test_run_page_has_the_four_graphs_and_a_live_refresh(dash_client):
    page = dash_call(dash_client, ["page.children"], [(("url", "pathname"), "/dashboard/runs/r1")])

    text = json.dumps(page)
    for graph_id in ("loss-graph", "scale-graph", "grad-norm-graph", "lr-graph"):
        assert f'"id": "{graph_id}"' in text
    assert '"id": "refresh"' in text and '"interval": 2000' in text


def test_unknown_run_shows_a_friendly_not_found_page(dash_client):
    page = dash_call(dash_client, ["page.children"], [(("url", "pathname"), "/dashboard/runs/unknown")])

    assert "Run not found" in json.dumps(page)


REFRESH_OUTPUTS = [
    "run-header.children",
    "loss-graph.figure",
    "scale-graph.figure",
    "grad-norm-graph.figure",
    "lr-graph.figure",
    "events-table.children",
    "refresh.disabled",
]


def refresh(client, run_id="r1"):
    return dash_call(
        client, REFRESH_OUTPUTS, [(("refresh", "n_intervals"), 3)], state=[(("run-id", "data"), run_id)]
    )


def apply_patch(patch):
    """The figure a Dash Patch (as sent to the browser) makes out of an empty one."""
    assert patch["__dash_patch_update"] == "__dash_patch_update"
    figure: dict = {}
    for operation in patch["operations"]:
        assert operation["operation"] == "Assign", operation
        *parents, last = operation["location"]
        target = figure
        for key in parents:
            target = target.setdefault(key, {})
        target[last] = operation["params"]["value"]
    return figure


def test_refresh_draws_the_figures_and_keeps_polling_a_running_run(dash_client, fake_api):
    response = refresh(dash_client)

    scale = apply_patch(response["scale-graph"]["figure"])
    assert scale["layout"]["yaxis"]["type"] == "log"
    assert [trace["x"] for trace in scale["data"] if trace["name"] == "skipped step"] == [[1, 3, 4]]
    loss = apply_patch(response["loss-graph"]["figure"])
    assert loss["data"][0]["y"] == [2.0, None, 1.5]
    assert loss["layout"]["uirevision"] == "r1"
    assert loss["layout"]["annotations"] == []  # replaces the "loading…" placeholder
    lr = apply_patch(response["lr-graph"]["figure"])
    assert figures.NO_DATA_TEXT in [annotation["text"] for annotation in lr["layout"]["annotations"]]
    assert "fc1.weight" in json.dumps(response["events-table"]["children"])
    assert response["refresh"]["disabled"] is False
    max_points = {r.url.params["max_points"] for r in fake_api.requests if r.url.path.endswith("/series")}
    assert max_points == {"2000"}


def test_keep_view_updates_everything_but_the_zoomable_axis_ranges():
    figure = figures.loss_figure({"steps": [0, 1, 2], "values": [2.0, "NaN", 1.5]}, uirevision="r1")
    figure.update_xaxes(range=[0, 1], autorange=False)

    patch = keep_view(figure).to_plotly_json()

    locations = [operation["location"] for operation in patch["operations"]]
    assert ["data"] in locations
    assert ["layout", "xaxis", "title"] in locations
    assert not [
        loc for loc in locations if loc[1:2] in (["xaxis"], ["yaxis"]) and loc[-1] in ("range", "autorange")
    ]
    # The hidden marker axis is fixed: its 0..1 range belongs to the figure and is always sent.
    assert ["layout", "yaxis2"] in locations
    assert apply_patch(patch)["layout"]["yaxis2"]["range"] == [0, 1]


@pytest.mark.parametrize("status", ["finished", "crashed"])
def test_refresh_stops_when_the_run_has_ended(dash_client, fake_api, status):
    fake_api.run["status"] = status

    assert refresh(dash_client)["refresh"]["disabled"] is True


def test_unreachable_api_shows_a_banner_instead_of_failing():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    app = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(refuse))
    )
    client = app.server.test_client()

    runs = dash_call(client, ["runs-table.children"], [(("runs-refresh", "n_intervals"), None)])
    assert "Cannot reach the gradwatch API" in json.dumps(runs)
    response = refresh(client)
    assert "Cannot reach the gradwatch API" in json.dumps(response["run-header"])
    assert response["refresh"]["disabled"] is False  # keeps retrying


def test_constant_learning_rate_gets_a_range_around_its_value():
    figure = figures.lr_figure({"steps": [0, 1, 2], "values": [3e-4, 3e-4, 3e-4]})
    assert tuple(figure.layout.yaxis.range) == (0, 6e-4)
