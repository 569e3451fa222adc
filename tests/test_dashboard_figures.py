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
from gradwatch.dashboard.app import keep_view, parse_route, parse_run_ids

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


LAYERS = ["fc1.weight", "fc1.bias", "<b>head</b>.weight"]
GRAD_NORMS = {
    "key": "grad/norm",
    "layers": LAYERS,
    "steps": [0, 10, 13, 20],
    "values": [[0.1, 0.01, 1.0], [0.2, 0.02, 2.0], ["NaN", "Infinity", 3.0], [0.0, 0.03, 4.0]],
}
EXPONENTS = list(range(-80, 41))


def histogram_counts(peak, total=100):
    row = [0] * len(EXPONENTS)
    row[EXPONENTS.index(peak)] = total
    return row


HISTOGRAMS = {
    "key": "grad/hist",
    "rank": 0,
    "exponents": EXPONENTS,
    "steps": [0, 20],
    "counts": [histogram_counts(-10), histogram_counts(-12)],
    "zeros": [3, 4],
    "non_finite": [0, 1],
}


class FakeApi:
    """A MockTransport handler serving one run; records every request it gets."""

    def __init__(self, run=RUN, series=None, events=SKIPS, vectors=None):
        self.run = dict(run)
        self.series = series if series is not None else {"amp/scale": SCALE_SERIES}
        self.vectors = vectors if vectors is not None else {"grad/norm": GRAD_NORMS}
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
            kind = request.url.params.get("kind", "scalar")
            keys = {"scalar": sorted(self.series), "vector": sorted(self.vectors), "histogram": ["grad/hist"]}
            return httpx.Response(200, json={"data": keys[kind], "kind": kind})
        if path == run_path + "/vectors":
            key = request.url.params["key"]
            body = self.vectors.get(key, {"layers": [], "steps": [], "values": []})
            return httpx.Response(200, json={"key": key, "rank": 0, "downsampled": False, **body})
        if path == run_path + "/histograms":
            layer = request.url.params["layer"]
            if layer not in LAYERS:
                return httpx.Response(404, json={"detail": f"layer {layer!r} is not one of the run's layers"})
            return httpx.Response(200, json={**HISTOGRAMS, "layer": layer})
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


RUNS_OUTPUTS = ["runs-table.children", "runs-pager.children", "runs-total.data"]


def refresh_runs(client, search=None, sort="newest", page=0, selected=()):
    return dash_call(
        client,
        RUNS_OUTPUTS,
        [
            (("runs-refresh", "n_intervals"), None),
            (("runs-search", "value"), search),
            (("runs-sort", "value"), sort),
            (("runs-page", "data"), page),
        ],
        state=[(("selected-runs", "data"), list(selected))],
    )


def render(client, pathname, search=""):
    return dash_call(
        client, ["page.children"], [(("url", "pathname"), pathname), (("url", "search"), search)]
    )


def test_runs_list_links_each_run_and_renders_names_as_text(dash_client):
    response = refresh_runs(dash_client)

    text = json.dumps(response)
    assert '"href": "/dashboard/runs/r1"' in text
    assert '"children": "<b>not bold</b>"' in text  # a plain string child: React renders it as text
    assert "dangerouslySetInnerHTML" not in text
    for column in ("Project", "Name", "Status", "Last step", "Scale", "Skips", "Created"):
        assert f'"children": "{column}"' in text


def test_run_page_has_the_four_graphs_and_a_live_refresh(dash_client):
    page = render(dash_client, "/dashboard/runs/r1")

    text = json.dumps(page)
    for graph_id in ("loss-graph", "scale-graph", "grad-norm-graph", "lr-graph"):
        assert f'"id": "{graph_id}"' in text
    assert '"id": "refresh"' in text and '"interval": 2000' in text
    for graph_id in (
        "grad-norm-heatmap",
        "update-ratio-heatmap",
        "underflow-heatmap",
        "hist-graph",
        "hist-time-graph",
    ):
        assert f'"id": "{graph_id}"' in text
    assert '"value": "fc1.weight"' in text  # the histogram's layer picker is filled up front


def test_unknown_run_shows_a_friendly_not_found_page(dash_client):
    page = render(dash_client, "/dashboard/runs/unknown")

    assert "Run not found" in json.dumps(page)


REFRESH_OUTPUTS = [
    "run-header.children",
    "loss-graph.figure",
    "scale-graph.figure",
    "grad-norm-graph.figure",
    "lr-graph.figure",
    "events-table.children",
    "refresh.disabled",
    "layers-refresh.disabled",
    "scale-series.data",
]


def refresh(client, run_id="r1", selected_step=None):
    return dash_call(
        client,
        REFRESH_OUTPUTS,
        [(("refresh", "n_intervals"), 3)],
        state=[(("run-id", "data"), run_id), (("selected-step", "data"), selected_step)],
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
    assert response["scale-series"]["data"] == {
        "steps": SCALE_SERIES["steps"],
        "values": SCALE_SERIES["values"],
    }
    full_series = [
        r for r in fake_api.requests if r.url.path.endswith("/series") and "start" not in r.url.params
    ]
    assert {r.url.params["max_points"] for r in full_series} == {"2000"}  # downsampled by the server


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

    response = refresh(dash_client)
    assert response["refresh"]["disabled"] is True
    assert response["layers-refresh"]["disabled"] is True


def test_unreachable_api_shows_a_banner_instead_of_failing():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    app = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(refuse))
    )
    client = app.server.test_client()

    runs = refresh_runs(client)
    assert "Cannot reach the gradwatch API" in json.dumps(runs)
    response = refresh(client)
    assert "Cannot reach the gradwatch API" in json.dumps(response["run-header"])
    assert response["refresh"]["disabled"] is False  # keeps retrying


def test_constant_learning_rate_gets_a_range_around_its_value():
    figure = figures.lr_figure({"steps": [0, 1, 2], "values": [3e-4, 3e-4, 3e-4]})
    assert tuple(figure.layout.yaxis.range) == (0, 6e-4)


# -- figures: safe band, post-clip norm, step marker ---------------------------------------------------


def test_safe_band_is_a_step_shaped_fill_behind_the_scale_reaching_the_last_step():
    low = {"steps": [0, 3], "values": [2.0**-4, 2.0**-2]}
    high = {"steps": [0, 3], "values": [2.0**18, "NaN"]}  # a NaN edge drops that band point

    figure = figures.scale_figure(SCALE_SERIES, SKIPS, (low, high))

    band = trace_named(figure, "fp16 safe band")
    assert band.fill == "tonexty" and band.line.shape == "hv"
    assert list(band.x) == [0, 5]  # held from the histogram step to the last scale step
    assert list(band.y) == [2.0**18, 2.0**18]
    assert figure.data[0].name == "safe band (low)" and list(figure.data[0].y) == [2.0**-4, 2.0**-4]
    assert [trace.name for trace in figure.data].index("scale") > 1  # drawn over the band
    assert min(figure.layout.yaxis.tickvals) <= 2.0**-4  # the axis spans the band


def test_scale_without_band_data_has_no_band():
    figure = figures.scale_figure(SCALE_SERIES, SKIPS, ({"steps": [], "values": []}, None))
    assert "fp16 safe band" not in [trace.name for trace in figure.data]


def test_grad_norm_draws_pre_and_post_clip():
    pre = {"steps": [0, 1, 2], "values": [3.0, "NaN", 0.5]}
    post = {"steps": [0, 1, 2], "values": [1.0, "NaN", 0.5]}

    figure = figures.grad_norm_figure(pre, post)

    assert list(trace_named(figure, "pre-clip").y) == [3.0, None, 0.5]
    assert list(trace_named(figure, "post-clip").y) == [1.0, None, 0.5]
    assert figure.layout.showlegend is True
    only_post = figures.grad_norm_figure(None, post)
    assert [trace.name for trace in only_post.data] == ["post-clip"]


def test_step_marker_is_a_vertical_line_at_the_step():
    (shape,) = figures.step_marker_shapes(42)
    assert (shape["x0"], shape["x1"], shape["yref"]) == (42, 42, "paper")
    assert figures.step_marker_shapes(None) == [] and figures.step_marker_shapes("7") == []


# -- figures: per-layer heatmaps -----------------------------------------------------------------------


def test_layer_heatmap_has_layers_in_model_order_top_down_and_log10_values():
    figure = figures.layer_heatmap_figure(GRAD_NORMS, "Gradient norm per layer", "‖g‖")

    heatmap = figure.data[0]
    assert heatmap.type == "heatmap"
    escaped = ["fc1.weight", "fc1.bias", "&lt;b&gt;head&lt;/b&gt;.weight"]
    assert list(heatmap.y) == escaped
    assert list(figure.layout.yaxis.categoryarray) == escaped[::-1]  # first layer at the top
    assert list(heatmap.x) == [0, 10, 13, 20]
    assert heatmap.z[0][0] == -1.0 and heatmap.z[2][1] == round(math.log10(2.0), 3)
    assert heatmap.z[0][3] is None  # a zero norm has no log: a blank cell, not an error
    assert "1e0" in heatmap.colorbar.ticktext


def test_layer_heatmap_marks_non_finite_cells_with_their_layer_and_step():
    figure = figures.layer_heatmap_figure(GRAD_NORMS, "g", "‖g‖")

    markers = trace_named(figure, "non-finite")
    assert list(markers.x) == [13, 13]
    assert list(markers.y) == ["fc1.weight", "fc1.bias"]
    assert markers.marker.color == figures.NON_FINITE_CELL_COLOR
    assert "NaN at step 13" in markers.hovertext[0] and "Infinity" in markers.hovertext[1]
    assert figure.data[0].z[0][2] is None


def test_fraction_heatmap_has_a_fixed_linear_range():
    fractions = {"layers": ["a", "b"], "steps": [0], "values": [[0.25, 1.0]]}
    figure = figures.layer_heatmap_figure(fractions, "u", "fraction", log_scale=False, value_range=(0, 1))
    heatmap = figure.data[0]
    assert (heatmap.zmin, heatmap.zmax) == (0, 1)
    assert [row[0] for row in heatmap.z] == [0.25, 1.0]


def test_many_layers_stay_readable():
    names = [f"model.layers.{i}.mlp.down_proj.weight.with_a_long_suffix" for i in range(200)]
    vectors = {"layers": names, "steps": [0, 10], "values": [[1.0] * 200, [2.0] * 200]}

    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")

    assert figure.layout.height == figures.HEATMAP_MAX_HEIGHT_PX
    ticks = list(figure.layout.yaxis.tickvals)
    assert 20 <= len(ticks) <= 70 and ticks[0] == names[0]
    assert all(len(text) <= figures.MAX_TICK_LABEL_CHARS for text in figure.layout.yaxis.ticktext)
    assert "200 layers" in annotation_texts(figure)[0]
    assert len(figure.data[0].y) == 200  # every layer still has its row (and its name in hover)


def test_heatmap_height_grows_with_layers_within_bounds():
    assert figures.heatmap_height(1) == figures.HEATMAP_MIN_HEIGHT_PX
    assert figures.heatmap_height(20) == 20 * figures.HEATMAP_ROW_PX + figures.HEATMAP_MARGIN_PX
    assert figures.heatmap_height(10_000) == figures.HEATMAP_MAX_HEIGHT_PX


@pytest.mark.parametrize("vectors", [None, {}, {"layers": ["a"], "steps": [], "values": []}, {"layers": "x"}])
def test_heatmap_without_data_says_so(vectors):
    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")
    assert figures.NO_DATA_TEXT in annotation_texts(figure)


# -- figures: histograms ---------------------------------------------------------------------------------


def test_fp16_thresholds_move_with_the_scale():
    assert figures.fp16_thresholds(2.0**16) == (-40.0, pytest.approx(math.log2(65504) - 16))
    assert figures.fp16_thresholds(1.0)[0] == -24.0
    assert figures.fp16_thresholds("NaN") is None and figures.fp16_thresholds(0) is None


def test_histogram_at_a_step_draws_bins_and_the_fp16_limits():
    figure = figures.histogram_figure({**HISTOGRAMS, "layer": "<b>x</b>"}, 25, 2.0**10)

    bars = figure.data[0]
    assert bars.type == "bar"
    heights = dict(zip(bars.customdata, bars.y))
    assert heights[-12] == 100 and sum(bars.y) == 100  # step 25 shows the snapshot of step 20
    assert dict(zip(bars.customdata, bars.x))[-12] == -12.5  # bin -12 spans log2|g| in [-13, -12)
    assert min(bars.customdata) == -36 and max(bars.customdata) <= 8  # from the underflow limit up
    assert "step 20" in figure.layout.title.text and "&lt;b&gt;x&lt;/b&gt;" in figure.layout.title.text
    assert "zeros 4" in figure.layout.title.text and "NaN/Inf 1" in figure.layout.title.text
    assert sorted(shape.x0 for shape in figure.layout.shapes) == [-34.0, pytest.approx(math.log2(65504) - 10)]


def test_histogram_step_defaults_to_the_latest_and_before_the_first_to_the_first():
    assert "step 20" in figures.histogram_figure(HISTOGRAMS, None).layout.title.text
    assert "step 0" in figures.histogram_figure(HISTOGRAMS, 0).layout.title.text
    assert figures.histogram_figure(HISTOGRAMS, 5).layout.shapes == ()  # no scale: no limit lines
    assert figures.histogram_steps(HISTOGRAMS) == [0, 20]


def test_histogram_over_time_is_an_exponent_by_step_heatmap_with_the_limits():
    scale = {"steps": [0, 10, 20], "values": [2.0**16, 2.0**15, "NaN"]}

    figure = figures.histogram_time_figure(HISTOGRAMS, scale)

    heatmap = figure.data[0]
    assert list(heatmap.x) == [0, 20]
    rows = dict(zip([y + 0.5 for y in heatmap.y], heatmap.z))
    assert rows[-10] == [2.0, None] and rows[-12] == [None, 2.0]  # log10 of the counts
    underflow = trace_named(figure, "fp16 underflow")
    assert list(underflow.y) == [-40.0, -39.0, None]


@pytest.mark.parametrize(
    "histograms",
    [
        None,
        {},
        {**HISTOGRAMS, "counts": [[1, 2]]},
        {**HISTOGRAMS, "exponents": ["a"]},
        {**HISTOGRAMS, "steps": []},
    ],
)
def test_histograms_without_usable_rows_say_no_data(histograms):
    assert figures.NO_DATA_TEXT in annotation_texts(figures.histogram_figure(histograms, 0))
    assert figures.NO_DATA_TEXT in annotation_texts(figures.histogram_time_figure(histograms))


# -- figures: compare --------------------------------------------------------------------------------------


def test_compare_overlays_runs_by_step_with_escaped_names():
    figure = figures.compare_figure(
        [
            ("<i>a</i>", {"steps": [0, 1], "values": [2.0, 1.0]}),
            ("b", {"steps": [0, 5], "values": [3.0, "NaN"]}),
            ("empty", {"steps": [], "values": []}),
        ],
        "loss",
    )
    assert [trace.name for trace in figure.data] == ["&lt;i&gt;a&lt;/i&gt;", "b"]
    assert list(figure.data[1].y) == [3.0, None]
    assert figure.data[0].line.color != figure.data[1].line.color
    assert figures.NO_DATA_TEXT in annotation_texts(figures.compare_figure([], "loss"))
    assert (
        figures.compare_figure([("a", {"steps": [0], "values": [2.0]})], "loss", log_y=True).layout.yaxis.type
        == "log"
    )


# -- API client: per-layer data ---------------------------------------------------------------------------


def test_vectors_histograms_and_keys_by_kind():
    api = FakeApi()
    client = client_for(api)

    assert client.vectors("r1", "grad/norm")["layers"] == LAYERS
    assert dict(api.requests[-1].url.params) == {"key": "grad/norm", "max_steps": "500"}
    assert client.histograms("r1", "fc1.bias")["steps"] == [0, 20]
    assert dict(api.requests[-1].url.params) == {"layer": "fc1.bias", "key": "grad/hist", "max_steps": "200"}
    assert client.keys("r1", "vector") == ["grad/norm"]
    with pytest.raises(ApiError, match="not one of") as caught:
        client.histograms("r1", "nope")
    assert caught.value.status_code == 404 and not isinstance(caught.value, RunNotFound)
    with pytest.raises(ValueError, match="max_steps"):
        client.vectors("r1", "grad/norm", max_steps=501)
    with pytest.raises(ValueError, match="kind"):
        client.keys("r1", "tensor")


# -- the Dash app: run page additions --------------------------------------------------------------------


LAYER_OUTPUTS = [
    "grad-norm-heatmap.figure",
    "update-ratio-heatmap.figure",
    "underflow-heatmap.figure",
    "hist-layer.options",
    "hist-layer.value",
]


def refresh_layers(client, layer=None, selected_step=None, options=None):
    return dash_call(
        client,
        LAYER_OUTPUTS,
        [(("layers-refresh", "n_intervals"), None)],
        state=[
            (("run-id", "data"), "r1"),
            (("selected-step", "data"), selected_step),
            (("hist-layer", "value"), layer),
            (("hist-layer", "options"), options),
        ],
    )


def test_layers_refresh_draws_heatmaps_and_offers_the_layers(dash_client, fake_api):
    response = refresh_layers(dash_client, selected_step=13)

    heatmap = apply_patch(response["grad-norm-heatmap"]["figure"])
    assert heatmap["data"][0]["y"][2] == "&lt;b&gt;head&lt;/b&gt;.weight"
    assert heatmap["layout"]["shapes"][0]["x0"] == 13  # the selected step stays marked
    assert figures.NO_DATA_TEXT in json.dumps(response["update-ratio-heatmap"]["figure"])
    assert [option["label"] for option in response["hist-layer"]["options"]] == LAYERS  # text, not HTML
    assert response["hist-layer"]["value"] == "fc1.weight"
    assert {r.url.params["max_steps"] for r in fake_api.requests if r.url.path.endswith("/vectors")} == {
        "500"
    }
    options = response["hist-layer"]["options"]
    unchanged = refresh_layers(dash_client, layer="fc1.bias", options=options)
    assert "hist-layer" not in unchanged  # same layers, a valid choice: the picker is left alone


HISTOGRAM_OUTPUTS = ["hist-step.options", "hist-step.value", "hist-graph.figure", "hist-time-graph.figure"]


def show_histogram(client, layer, step=None, selected_step=None, trigger="hist-layer"):
    inputs = [
        (("hist-layer", "value"), layer),
        (("hist-step", "value"), step),
        (("selected-step", "data"), selected_step),
        (("layers-refresh", "n_intervals"), None),
        (("scale-series", "data"), SCALE_SERIES),
    ]
    body_inputs = sorted(inputs, key=lambda item: item[0][0] != trigger)  # the trigger goes first
    response = client.post(
        "/_dash-update-component",
        json={
            "output": ".." + "...".join(HISTOGRAM_OUTPUTS) + "..",
            "outputs": [dict(zip(("id", "property"), o.split("."))) for o in HISTOGRAM_OUTPUTS],
            "inputs": [{"id": i, "property": p, "value": v} for (i, p), v in inputs],
            "state": [{"id": "run-id", "property": "data", "value": "r1"}],
            "changedPropIds": [f"{i}.{p}" for (i, p), _ in body_inputs[:1]],
        },
    )
    assert response.status_code == 200, response.data
    return response.json["response"]


def test_histogram_of_the_chosen_layer_at_the_latest_step_then_at_a_selected_step(dash_client):
    response = show_histogram(dash_client, "fc1.bias")
    assert response["hist-step"]["value"] == 20
    assert [option["value"] for option in response["hist-step"]["options"]] == [20, 0]
    assert "fc1.bias" in apply_patch(response["hist-graph"]["figure"])["layout"]["title"]["text"]
    assert "S=2^13" in json.dumps(apply_patch(response["hist-graph"]["figure"])["layout"]["annotations"])
    over_time = apply_patch(response["hist-time-graph"]["figure"])
    assert "fp16 underflow" in [trace["name"] for trace in over_time["data"]]  # from the shared scale series

    moved = show_histogram(dash_client, "fc1.bias", step=20, selected_step=3, trigger="selected-step")
    assert moved["hist-step"]["value"] == 0  # the histogram step nearest the clicked event
    assert "step 0" in apply_patch(moved["hist-graph"]["figure"])["layout"]["title"]["text"]


def test_histogram_of_an_unknown_layer_says_so(dash_client):
    response = show_histogram(dash_client, "gone.weight")
    assert "not one of" in json.dumps(response["hist-graph"]["figure"])


def test_events_table_lists_every_kind_with_its_hint_and_a_clickable_step():
    events = [
        *SKIPS,
        {
            "step": 7,
            "kind": "clip_before_unscale",
            "rank": 0,
            "data": {"hint": "<script>x</script> unscale first", "scale": 1024.0},
        },
    ]
    app = create_dash_app(
        "http://gradwatch.test",
        http_client=httpx.Client(transport=httpx.MockTransport(FakeApi(events=events))),
    )
    response = refresh(app.server.test_client())

    table = json.dumps(response["events-table"]["children"])
    assert "clip_before_unscale" in table and "<script>x</script> unscale first" in table
    assert "scale=2^10" in table
    assert '"type": "event-step", "step": 7' in table
    assert "dangerouslySetInnerHTML" not in table


def test_run_header_shows_agent_health_and_the_page_shows_config_as_text():
    health = {"steps": [5], "values": [3.0]}
    api = FakeApi(
        run={**RUN, "config": {"lr": "<img src=x onerror=alert(1)>"}},
        series={
            "amp/scale": SCALE_SERIES,
            "agent/queued": health,
            "agent/dropped": {"steps": [5], "values": [2.0]},
        },
    )
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    ).server.test_client()

    header = json.dumps(refresh(client)["run-header"])
    assert '"id": "agent-health"' in header and '"children": "3"' in header
    page = json.dumps(render(client, "/dashboard/runs/r1"))
    assert "<img src=x onerror=alert(1)>" in page and '"id": "run-details"' in page


# -- the Dash app: runs list and compare -------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("search", "ids"), [("?runs=a,b", ["a", "b"]), ("?runs=a,,a,b%2Fc", ["a", "b/c"]), ("", []), (None, [])]
)
def test_parse_run_ids(search, ids):
    assert parse_run_ids(search) == ids


def test_compare_page_overlays_the_chosen_key_of_each_run(dash_client):
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


def test_a_quiet_running_run_is_shown_as_silent():
    from datetime import datetime, timedelta, timezone

    from gradwatch.dashboard.app import run_status

    now = datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)
    recent = (now - timedelta(seconds=30)).isoformat()
    quiet = (now - timedelta(hours=1)).isoformat()
    assert run_status({"status": "running", "updated_at": recent}, now) == "running"
    assert run_status({"status": "running", "updated_at": quiet}, now) == "silent"
    assert run_status({"status": "finished", "updated_at": quiet}, now) == "finished"
