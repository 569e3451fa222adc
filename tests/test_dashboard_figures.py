"""The dashboard without a browser or a server: figure builders as pure functions, the API client over
httpx.MockTransport, and the Dash app's pages and callbacks through Flask's test client."""

from __future__ import annotations

import gc
import json
import math
import re

import dash
import gradwatch.dashboard
import httpx
import pytest
from gradwatch.dashboard import alerts_page, create_dash_app, figures, live, views
from gradwatch.dashboard.api_client import ApiClient, ApiError, ApiUnavailable, RunNotFound
from gradwatch.dashboard.app import keep_view, parse_route, parse_run_ids, parse_step

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

    def __init__(self, run=RUN, series=None, events=SKIPS, vectors=None, alerts=()):
        self.run = dict(run)
        self.series = series if series is not None else {"amp/scale": SCALE_SERIES}
        self.vectors = vectors if vectors is not None else {"grad/norm": GRAD_NORMS}
        self.events = events
        self.alerts = list(alerts)
        self.ranks = {"data": [], "count": 0, "world_size": 1, "gradients": "local"}
        self.combined: dict = {}  # key -> {"steps", "values"} from /ranks/series
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
        if path == run_path + "/ranks":
            return httpx.Response(200, json=self.ranks)
        if path == run_path + "/ranks/series":
            key = request.url.params["key"]
            body = self.combined.get(key, {"steps": [], "values": []})
            return httpx.Response(200, json={"key": key, "combine": "l2", "downsampled": False, **body})
        if path == run_path + "/histograms":
            layer = request.url.params["layer"]
            if layer not in LAYERS:
                return httpx.Response(404, json={"detail": f"layer {layer!r} is not one of the run's layers"})
            return httpx.Response(200, json={**HISTOGRAMS, "layer": layer})
        if path == run_path + "/series":
            key = request.url.params["key"]
            body = self.series.get(key, {"steps": [], "values": []})
            start = int(request.url.params.get("start", 0))
            points = [(step, value) for step, value in zip(body["steps"], body["values"]) if step >= start]
            return httpx.Response(
                200,
                json={
                    "key": key,
                    "rank": 0,
                    "downsampled": False,
                    "steps": [step for step, _ in points],
                    "values": [value for _, value in points],
                },
            )
        if path == "/api/v1/alerts":
            params = request.url.params
            acknowledged = {None: None, "true": True, "false": False}[params.get("acknowledged")]
            alerts = [
                alert
                for alert in self.alerts
                if all(params.get(name) in (None, alert[name]) for name in ("run_id", "status", "project"))
                and acknowledged in (None, bool(alert.get("acknowledged_at")))
            ]
            return httpx.Response(200, json={"data": alerts, "count": len(alerts)})
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
    for module in (gradwatch.dashboard, figures, live, views, alerts_page):
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
        ("/dashboard/alerts", ("alerts", None)),
        ("/dashboard/alerts/", ("alerts", None)),
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


def callback_outputs(client, outputs):
    """The outputs as the renderer names them: an allow_duplicate output carries its callback's
    "@hash" (found in the app's callback map when the client knows its Dash app)."""
    app = getattr(client, "dash_app", None)
    plain = outputs[0] if len(outputs) == 1 else ".." + "...".join(outputs) + ".."
    if app is None:
        return outputs
    key = next(k for k in app.callback_map if re.sub(r"@[0-9a-f]+", "", k) == plain)
    return key.strip(".").split("...") if len(outputs) > 1 else [key]


def dash_call(client, outputs, inputs, state=()):
    """POST one callback the way the Dash renderer does; returns {component id: {property: value}}."""
    outputs = callback_outputs(client, outputs)
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


def refresh_runs(client, search=None, sort="newest", page=0, selected=(), statuses=None, tag=None):
    return dash_call(
        client,
        RUNS_OUTPUTS,
        [
            (("runs-refresh", "n_intervals"), None),
            (("runs-search", "value"), search),
            (("runs-sort", "value"), sort),
            (("runs-page", "data"), page),
            (("runs-status", "value"), statuses),
            (("runs-tag", "value"), tag),
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
    "live-cursor.data",
]


def refresh(client, run_id="r1", selected_step=None, cursor=None):
    return dash_call(
        client,
        REFRESH_OUTPUTS,
        [(("refresh", "n_intervals"), 3)],
        state=[
            (("run-id", "data"), run_id),
            (("selected-step", "data"), selected_step),
            (("live-cursor", "data"), cursor),
        ],
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


# -- live updates: append only the new points ----------------------------------------------------------


def loss_series(steps, values):
    return {"key": "loss", "steps": list(steps), "values": list(values)}


def test_append_patch_extends_the_trace_with_the_same_uid():
    shown = live.chart_shape(figures.loss_figure(loss_series([0, 1, 2], [2.0, 1.8, 1.5])))
    patch = live.append_patch(shown, figures.loss_figure(loss_series([3, 4], [1.4, 1.3])))

    operations = patch.to_plotly_json()["operations"]
    assert {(tuple(op["location"]), tuple(op["params"]["value"])) for op in operations} == {
        (("data", 0, "x"), (3, 4)),
        (("data", 0, "y"), (1.4, 1.3)),
    }
    assert all(op["operation"] == "Extend" for op in operations)


def test_append_patch_extends_markers_the_chart_already_has():
    shown = live.chart_shape(figures.loss_figure(loss_series([0, 1, 2], [2.0, "NaN", 1.5])))
    patch = live.append_patch(shown, figures.loss_figure(loss_series([3, 4], ["Infinity", 1.3])))

    locations = [op["location"] for op in patch.to_plotly_json()["operations"]]
    assert ["data", 1, "x"] in locations and ["data", 1, "hovertext"] in locations  # the NaN markers


@pytest.mark.parametrize(
    ("shown", "new"),
    [
        # the first NaN brings a marker trace the chart does not have
        (loss_series([0, 1], [2.0, 1.8]), loss_series([2], ["NaN"])),
        # "no data yet" on screen: the first points need a real chart
        (loss_series([], []), loss_series([0], [1.0])),
    ],
)
def test_append_patch_refuses_what_only_a_redraw_draws_right(shown, new):
    assert live.append_patch(live.chart_shape(figures.loss_figure(shown)), figures.loss_figure(new)) is None


def test_scale_appends_within_its_power_of_two_ticks_and_redraws_beyond_them():
    shown = live.chart_shape(figures.scale_figure(SCALE_SERIES))  # 2^13 … 2^16
    inside = {"steps": [6, 7], "values": [16384.0, 32768.0]}
    below = {"steps": [6], "values": [2.0**-3]}

    assert live.append_patch(shown, figures.scale_figure(inside)) is not None
    assert live.append_patch(shown, figures.scale_figure(below)) is None


def test_a_constant_learning_rate_that_changes_is_redrawn():
    shown = live.chart_shape(figures.lr_figure({"steps": [0, 1], "values": [1e-3, 1e-3]}))

    assert live.append_patch(shown, figures.lr_figure({"steps": [2], "values": [1e-3]})) is not None
    assert live.append_patch(shown, figures.lr_figure({"steps": [2], "values": [5e-4]})) is None


def test_nothing_new_is_no_update():
    shown = live.chart_shape(figures.loss_figure(loss_series([0], [1.0])))
    assert live.append_patch(shown, figures.loss_figure(loss_series([], []))) is dash.no_update


def test_cursor_fetch_starts_and_advance():
    charts = {"loss-graph": figures.loss_figure(loss_series([0, 5], [1.0, 0.5]))}
    cursor = live.full_cursor(
        "r1", charts, {"loss": loss_series([0, 5], [1, 0.5]), "band": {"steps": [4]}}, 2
    )

    assert live.can_append(cursor, "r1") and not live.can_append(cursor, "r2")
    assert live.fetch_starts(cursor, ["loss", "band", "lr"], inclusive=["band"]) == {
        "loss": 6,
        "band": 4,
        "lr": 0,
    }
    moved = live.advance(cursor, {"loss": loss_series([6, 7], [0.4, 0.3]), "band": {"steps": [4]}}, ["loss"])
    assert moved["last"] == {"loss": 7, "band": 4}
    assert moved["appended"] == 2
    full = {**moved, "appended": live.MAX_APPENDED_POINTS}
    assert not live.can_append(full, "r1")  # grown enough: downsample again with a full redraw


def live_api():
    return FakeApi(
        series={
            "amp/scale": {"steps": [0, 1, 2], "values": [65536.0, 65536.0, 65536.0]},
            "loss": {"steps": [0, 1, 2], "values": [2.0, 1.8, 1.5]},
            "lr": {"steps": [0, 1, 2], "values": [1e-3, 1e-3, 1e-3]},
        },
        events=[],
    )


def grow(api, key, step, value):
    series = api.series[key]
    api.series[key] = {"steps": [*series["steps"], step], "values": [*series["values"], value]}


def operations_of(response, graph_id):
    return [op["operation"] for op in response[graph_id]["figure"]["operations"]]


def test_live_refresh_fetches_from_the_last_step_shown_and_appends():
    api = live_api()
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    )
    client = client.server.test_client()
    first = refresh(client)
    cursor = first["live-cursor"]["data"]
    assert cursor["last"]["loss"] == 2

    grow(api, "loss", 3, 1.4)
    grow(api, "amp/scale", 3, 65536.0)
    api.requests.clear()
    second = refresh(client, cursor=cursor)

    starts = {
        r.url.params["key"]: r.url.params.get("start") for r in api.requests if r.url.path.endswith("/series")
    }
    assert starts["loss"] == "3" and starts["amp/scale"] == "3" and starts["lr"] == "3"
    assert set(operations_of(second, "loss-graph")) == {"Extend"}
    assert set(operations_of(second, "scale-graph")) == {"Extend"}
    assert "lr-graph" not in second  # nothing new: no update
    scale_store = second["scale-series"]["data"]["operations"]
    assert [op["params"]["value"] for op in scale_store] == [[3], [65536.0]]
    assert second["live-cursor"]["data"]["last"]["loss"] == 3


@pytest.mark.parametrize(
    "change",
    [
        lambda api: grow(api, "loss", 3, "NaN"),  # a first NaN marker
        lambda api: api.events.append(skip_event(3, 65536.0, 32768.0)),  # a new skip marker
        lambda api: api.run.update(status="finished"),  # the final view is drawn in full
    ],
)
def test_live_refresh_redraws_in_full_when_appending_would_not_be_right(change):
    api = live_api()
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    )
    client = client.server.test_client()
    cursor = refresh(client)["live-cursor"]["data"]

    change(api)
    second = refresh(client, cursor=cursor)

    assert "Extend" not in operations_of(second, "loss-graph")
    assert apply_patch(second["loss-graph"]["figure"])["data"][0]["x"][0] == 0  # the whole series
    assert second["live-cursor"]["data"]["appended"] == 0


@pytest.mark.parametrize(
    ("search", "step"), [("?step=120", 120), ("?step=x", None), ("", None), (None, None)]
)
def test_parse_step(search, step):
    assert parse_step(search) == step


def test_an_alert_link_opens_the_run_page_with_its_step_marked(dash_client):
    page = json.dumps(render(dash_client, "/dashboard/runs/r1", "?step=4"))
    assert '"id": "selected-step", "data": 4' in page


# -- alerts on the run page and the runs list ------------------------------------------------------------


def alert(alert_id=1, *, run_id="r1", step=3, status="firing", **fields):
    return {
        "id": alert_id,
        "project": "llm",
        "run_id": run_id,
        "run_name": "qlora-7b",
        "rule_id": 7,
        "type": "scale_drop",
        "severity": "critical",
        "status": status,
        "step": step,
        "last_step": step,
        "resolved_step": None,
        "occurrences": 1,
        "title": "loss scale fell 8x in 3 steps",
        "hint": "<b>lower</b> the learning rate",
        "evidence": {"key": "amp/scale", "steps": [0, step], "values": [65536.0, 8192.0], "link": "http://x"},
        "link": f"http://x/dashboard/runs/{run_id}?step={step}",
        "created_at": "2024-05-01T12:01:00+00:00",
        "resolved_at": None,
        **fields,
    }


def test_the_run_timeline_has_the_runs_alerts_with_clickable_steps():
    api = FakeApi(alerts=[alert(1, step=3, title="<img src=x onerror=alert(1)>"), alert(2, run_id="other")])
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    )
    response = refresh(client.server.test_client())

    table = json.dumps(response["events-table"]["children"])
    assert "alert: scale_drop" in table and "<img src=x onerror=alert(1)>" in table
    assert '"type": "event-step", "step": 3, "row": "alert-0"' in table
    assert table.count("alert: scale_drop") == 1  # only this run's alerts
    assert "dangerouslySetInnerHTML" not in table
    alerts_request = next(r for r in api.requests if r.url.path == "/api/v1/alerts")
    assert alerts_request.url.params["run_id"] == "r1"


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


# -- the Alerts page: pure views -----------------------------------------------------------------------------


def as_text(components):
    """Components as the JSON the browser gets (non-ASCII kept), to search in."""
    return json.dumps(components, default=lambda component: component.to_plotly_json(), ensure_ascii=False)


def run_href(run_id, step=None):
    return f"/dashboard/runs/{run_id}" + (f"?step={step}" if step is not None else "")


def test_alerts_table_lists_open_then_acknowledged_then_resolved_with_links_and_text():
    alerts = [
        alert(1, status="resolved", resolved_at="2024-05-01T13:00:00+00:00", resolved_step=40),
        alert(2, acknowledged_at="2024-05-01T12:02:00+00:00"),
        alert(3, run_name="<script>alert(1)</script>", step=12),
        alert(4, step=20),
    ]
    rules = {7: {"id": 7, "name": "<i>drop</i>"}}
    table = alerts_page.alerts_table(alerts, rules, run_href)

    rows = table.children[1].children
    assert [row.to_plotly_json()["props"]["data-alert"] for row in rows] == ["4", "3", "2", "1"]
    text = as_text(table)
    assert '"href": "/dashboard/runs/r1?step=12"' in text
    assert '"children": "<script>alert(1)</script>"' in text and '"children": "<i>drop</i>"' in text
    assert text.count('"Acknowledge"') == 2  # open ones only
    assert "key=amp/scale" in text and "link=" not in text  # evidence without the link
    assert "2024-05-01 13:00 UTC (step 40)" in text
    assert "dangerouslySetInnerHTML" not in text


def test_alert_states():
    assert views.alert_state(alert()) == "open"
    assert views.alert_state(alert(acknowledged_at="2024-05-01T12:02:00+00:00")) == "acknowledged"
    assert views.alert_state(alert(status="resolved", acknowledged_at="x")) == "resolved"


@pytest.mark.parametrize(
    ("text", "default", "value"),
    [
        ("2", 10, 2),
        ("0.5", 8.0, 0.5),
        ("1e-6", 1e-6, 1e-6),
        (" true ", 1.0, True),
        ("False", True, False),
        ("grad/norm", "update/ratio", "grad/norm"),
        ("12", "update/ratio", "12"),  # a string parameter stays a string
        ("abc", 8.0, "abc"),  # sent as typed: the server says what is wrong
        ("inf", 8.0, "inf"),
    ],
)
def test_parse_param(text, default, value):
    parsed = alerts_page.parse_param(text, default)
    assert parsed == value and type(parsed) is type(value)


SKIP_STORM = {
    "count": {"default": 10, "minimum": 1.0, "maximum": None, "doc": "skips"},
    "window": {"default": 100, "minimum": 1.0, "maximum": None, "doc": "steps"},
    "ignore_first": {"default": 50, "minimum": 0.0, "maximum": None, "doc": "calibration steps not counted"},
}


def test_rule_params_leave_out_empty_fields_and_for_a_new_rule_the_defaults():
    texts = {"count": "2", "window": "100", "ignore_first": ""}
    assert alerts_page.rule_params(SKIP_STORM, texts, only_changed=True) == {"count": 2}
    assert alerts_page.rule_params(SKIP_STORM, texts) == {"count": 2, "window": 100}


def test_param_inputs_show_values_defaults_and_bounds():
    fields = alerts_page.param_inputs("rule-param", SKIP_STORM, {"count": 3})
    text = as_text(fields)

    assert '"value": "3"' in text and '"value": "100"' in text
    assert "skips · default 10 · min 1" in text
    assert '{"type": "rule-param", "param": "count"}' in text


def test_rules_table_has_edit_toggle_and_delete_per_rule():
    rules = [
        {
            "id": 1,
            "project": "llm",
            "run_id": None,
            "type": "skip_storm",
            "name": "<b>few</b>",
            "params": {"count": 2, "window": 20.0},
            "enabled": True,
            "cooldown_steps": 100,
            "severity": "critical",
        },
        {
            "id": 2,
            "project": "llm",
            "run_id": "r1",
            "type": "scale_floor",
            "name": "floor",
            "params": {"floor": 1.0},
            "enabled": False,
            "cooldown_steps": 0,
            "severity": "critical",
        },
    ]
    text = as_text(alerts_page.rules_table(rules))

    assert "count=2, window=20" in text and '"children": "<b>few</b>"' in text
    assert '{"type": "rule-toggle", "rule": 1, "enable": false}' in text  # "Disable"
    assert '{"type": "rule-toggle", "rule": 2, "enable": true}' in text  # "Enable"
    assert '{"type": "rule-delete", "rule": 2}' in text and "run r1" in text


@pytest.mark.parametrize(
    ("delivery", "state", "text"),
    [
        ({"status": "pending", "attempts": 0}, "sending", "Sending…"),
        ({"status": "sending", "attempts": 0}, "sending", "Sending…"),
        ({"status": "delivered", "attempts": 1, "response_status": 200}, "delivered", "Delivered: HTTP 200."),
        (
            {
                "status": "pending",
                "attempts": 1,
                "response_status": 500,
                "last_error": "HTTP 500",
                "next_attempt_at": "2024-05-01T12:00:05+00:00",
            },
            "failed",
            "Attempt 1 failed: HTTP 500; retrying at 2024-05-01 12:00 UTC.",
        ),
        (
            {"status": "failed", "attempts": 8, "response_status": None, "last_error": "connection refused"},
            "failed",
            "Failed after 8 attempts: connection refused.",
        ),
    ],
)
def test_delivery_outcome(delivery, state, text):
    assert alerts_page.delivery_outcome(delivery) == {"state": state, "text": text}


def test_webhooks_table_shows_urls_as_text_and_the_last_test():
    webhooks = [
        {
            "id": 5,
            "project": "llm",
            "url": "http://127.0.0.1:9/<b>x</b>",
            "format": "slack",
            "signed": True,
            "enabled": True,
            "created_at": "2024-05-01T12:00:00+00:00",
        }
    ]
    tests = {"5": {"state": "delivered", "text": "Delivered: HTTP 200."}}
    text = as_text(alerts_page.webhooks_table(webhooks, tests))

    assert '"children": "http://127.0.0.1:9/<b>x</b>"' in text and '"children": "Slack"' in text
    assert "Delivered: HTTP 200." in text and "test-ok" in text
    assert '{"type": "webhook-test", "webhook": 5}' in text


# -- the Alerts page: callbacks through Flask, against a fake API ----------------------------------------------


class AlertsApi:
    """A MockTransport handler for the alerts endpoints; records requests, answers what it is told."""

    def __init__(self, answers=None):
        self.requests: list[httpx.Request] = []
        self.answers = answers or {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        key = (request.method, request.url.path)
        if key in self.answers:
            status, body = self.answers[key]
            return httpx.Response(status, json=body) if body is not None else httpx.Response(status)
        if request.method == "GET" and request.url.path == "/api/v1/alert-rules/types":
            return httpx.Response(
                200,
                json={
                    "data": [
                        {
                            "type": "skip_storm",
                            "severity": "critical",
                            "description": "skips",
                            "params": SKIP_STORM,
                        }
                    ]
                },
            )
        if request.method == "GET":
            return httpx.Response(200, json={"data": [], "count": 0})
        return httpx.Response(404, json={"detail": "Not Found"})


def alerts_client(api):
    app = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    )
    client = app.server.test_client()
    client.dash_app = app
    return client


CREATE_RULE = ["rule-form-message.children", "rules-version.data"]


def create_rule(client, project="llm", params=None):
    params = params if params is not None else {"count": "2", "window": "100", "ignore_first": "0"}
    return dash_call(
        client,
        CREATE_RULE,
        [(("rule-create", "n_clicks"), 1)],
        state=[
            (("rule-project", "value"), project),
            (("rule-type", "value"), "skip_storm"),
            (("rule-name", "value"), "<b>two</b>"),
            (("rule-cooldown", "value"), ""),
            (({"type": "rule-param", "param": ALL_}, "value"), list(params.values())),
            (
                ({"type": "rule-param", "param": ALL_}, "id"),
                [{"type": "rule-param", "param": p} for p in params],
            ),
            (("rule-types", "data"), [{"type": "skip_storm", "params": SKIP_STORM}]),
            (("rules-version", "data"), 4),
        ],
    )


ALL_ = ["ALL"]  # how the renderer writes a pattern's ALL in a callback's request


def test_the_alerts_page_offers_the_servers_rule_types_and_known_projects():
    page = json.dumps(render(alerts_client(AlertsApi()), "/dashboard/alerts"))
    for component_id in ("alerts-table", "rules-table", "webhooks-table", "rule-create", "webhook-create"):
        assert f'"id": "{component_id}"' in page
    assert '"label": "skip_storm (critical)", "value": "skip_storm"' in page


def test_creating_a_rule_posts_only_the_changed_parameters():
    api = AlertsApi(
        answers={
            ("POST", "/api/v1/alert-rules"): (
                201,
                {"id": 9, "name": "<b>two</b>", "type": "skip_storm", "project": "llm"},
            )
        }
    )
    response = create_rule(alerts_client(api))

    posted = json.loads(next(r for r in api.requests if r.method == "POST").content)
    assert posted == {
        "project": "llm",
        "type": "skip_storm",
        "name": "<b>two</b>",
        "params": {"count": 2, "ignore_first": 0},
    }
    assert "Created rule “<b>two</b>”" in json.dumps(response["rule-form-message"], ensure_ascii=False)
    assert response["rules-version"]["data"] == 5  # the rules table reloads


def test_a_rule_the_server_refuses_shows_its_message_next_to_the_form():
    detail = [
        {
            "loc": ["body", "params"],
            "msg": "skip_storm: count must be at least 1, got 0",
            "type": "value_error",
        }
    ]
    api = AlertsApi(answers={("POST", "/api/v1/alert-rules"): (422, {"detail": detail})})
    response = create_rule(alerts_client(api), params={"count": "0"})

    message = json.dumps(response["rule-form-message"])
    assert (
        "The server refused this (422): body.params: skip_storm: count must be at least 1, got 0" in message
    )
    assert '"role": "alert"' in message
    assert "rules-version" not in response


def test_a_rule_needs_a_project_before_it_is_sent():
    api = AlertsApi()
    response = create_rule(alerts_client(api), project="  ")
    assert "Enter the project" in json.dumps(response)
    assert not [r for r in api.requests if r.method == "POST"]


def click(client, outputs, clicked, state=(), other_patterns=0):
    """POST a callback the way the renderer does when button `clicked` (a concrete pattern-matching
    id) is clicked; other_patterns: how many more ALL inputs the callback has (sent with no buttons).
    Returns {component id: {property: value}}."""
    prop_id = json.dumps(clicked, sort_keys=True, separators=(",", ":")) + ".n_clicks"
    outputs = callback_outputs(client, outputs)
    body = {
        "output": outputs[0] if len(outputs) == 1 else ".." + "...".join(outputs) + "..",
        "outputs": [dict(zip(("id", "property"), output.split("."))) for output in outputs],
        "inputs": [[{"id": clicked, "property": "n_clicks", "value": 1}]] + [[]] * other_patterns,
        "state": [{"id": i, "property": p, "value": v} for (i, p), v in state],
        "changedPropIds": [prop_id],
    }
    response = client.post("/_dash-update-component", json=body)
    assert response.status_code == 200, response.data
    return response.json["response"]


def test_acknowledge_posts_and_shows_what_the_server_refused():
    api = AlertsApi()  # a server without the acknowledge endpoint answers 404
    response = click(
        alerts_client(api),
        ["alerts-message.children", "alerts-version.data"],
        {"type": "alert-ack", "alert": 8},
        state=[(("alerts-version", "data"), 2)],
    )
    assert [(r.method, r.url.path) for r in api.requests] == [("POST", "/api/v1/alerts/8/acknowledge")]
    assert "The server refused this (404): Not Found" in json.dumps(response["alerts-message"])
    assert response["alerts-version"]["data"] == 3  # the list reloads either way


def test_send_test_queues_a_delivery_and_starts_following_it():
    api = AlertsApi(
        answers={("POST", "/api/v1/webhooks/5/test"): (202, {"id": 11, "status": "pending", "attempts": 0})}
    )
    response = click(
        alerts_client(api),
        [
            "webhooks-message.children",
            "webhooks-version.data",
            "webhook-tests.data",
            "webhook-test-poll.disabled",
        ],
        {"type": "webhook-test", "webhook": 5},
        state=[(("webhook-tests", "data"), {}), (("webhooks-version", "data"), 0)],
        other_patterns=1,
    )
    assert response["webhook-tests"]["data"]["5"]["delivery"] == 11
    assert response["webhook-tests"]["data"]["5"]["text"] == "Sending…"
    assert response["webhook-test-poll"]["disabled"] is False


def test_test_delivery_is_followed_until_the_receiver_answered():
    api = AlertsApi(
        answers={
            ("GET", "/api/v1/webhooks/5/deliveries"): (
                200,
                {
                    "data": [{"id": 11, "status": "delivered", "attempts": 1, "response_status": 200}],
                    "count": 1,
                },
            )
        }
    )
    tests = {"5": {"delivery": 11, "started": 0, "state": "sending", "text": "Sending…"}}
    response = dash_call(
        alerts_client(api),
        ["webhook-tests.data", "webhook-test-poll.disabled"],
        [(("webhook-test-poll", "n_intervals"), 1)],
        state=[(("webhook-tests", "data"), tests)],
    )
    assert response["webhook-tests"]["data"]["5"]["text"] == "Delivered: HTTP 200."
    assert response["webhook-test-poll"]["disabled"] is True


# -- API client: alerts, rules, webhooks -------------------------------------------------------------------------


def test_alert_endpoints_use_the_right_methods_paths_and_bodies():
    api = AlertsApi(
        answers={
            ("DELETE", "/api/v1/alert-rules/3"): (204, None),
            ("PATCH", "/api/v1/alert-rules/3"): (200, {"id": 3, "enabled": False}),
            ("POST", "/api/v1/webhooks/5/test"): (202, {"id": 11, "status": "pending"}),
            ("POST", "/api/v1/alerts/8/acknowledge"): (200, {"id": 8, "acknowledged_at": "x"}),
        }
    )
    client = client_for(api)

    assert client.alerts(project="llm", status="firing") == ([], 0)
    assert dict(api.requests[-1].url.params) == {
        "project": "llm",
        "status": "firing",
        "limit": "100",
        "offset": "0",
    }
    assert client.rule_types()[0]["type"] == "skip_storm"
    assert client.update_alert_rule(3, {"enabled": False}) == {"id": 3, "enabled": False}
    assert json.loads(api.requests[-1].content) == {"enabled": False}
    assert client.delete_alert_rule(3) is None
    assert client.send_test(5)["status"] == "pending"
    assert client.acknowledge_alert(8)["acknowledged_at"] == "x"
    assert [(r.method, r.url.path) for r in api.requests[-4:]] == [
        ("PATCH", "/api/v1/alert-rules/3"),
        ("DELETE", "/api/v1/alert-rules/3"),
        ("POST", "/api/v1/webhooks/5/test"),
        ("POST", "/api/v1/alerts/8/acknowledge"),
    ]
    with pytest.raises(TypeError):
        client.delete_webhook("5; drop")
    with pytest.raises(ApiError) as caught:
        client.create_webhook({"url": "ftp://x"})
    assert caught.value.status_code == 404 and caught.value.detail == "Not Found"


def test_runs_list_filters_by_status_and_tags_on_the_server():
    asked = []
    runs = [{**RUN, "id": f"r{i}", "name": f"run-{i:02d}", "status": ("running", "finished")[i % 2]} for i in range(6)]

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
    searched = refresh_runs(client, statuses=["running"], search="run-0")  # client-side search keeps the filter
    assert shown_names(searched) == ["run-00", "run-02", "run-04"] and asked[-1][0] == ["running"]


def test_a_distributed_run_shows_its_ranks_and_a_crashed_one_stands_out(fake_api):
    single = create_dash_app("http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(fake_api)))
    assert "ranks-line" not in json.dumps(refresh(single.server.test_client())["run-header"])
    assert not [r for r in fake_api.requests if r.url.path.endswith("/ranks")]  # not asked for one process

    fake_api.run["metadata"] = {**(fake_api.run.get("metadata") or {}), "world_size": 2}
    fake_api.ranks = {"world_size": 2, "gradients": "sharded", "count": 2, "data": [
        {"rank": 0, "host": "node-a", "status": "finished", "batches": 10},
        {"rank": 1, "host": "<b>node-b</b>", "status": "crashed", "batches": 4},
    ]}
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(fake_api))
    ).server.test_client()
    header = json.dumps(refresh(client)["run-header"], ensure_ascii=False)
    assert "2 ranks, gradients sharded" in header
    assert "rank 0 \u00b7 node-a \u00b7 finished" in header
    assert "rank 1 \u00b7 <b>node-b</b> \u00b7 crashed" in header and "rank-chip bad" in header  # text, flagged


def test_a_sharded_run_draws_its_global_norm_combined_over_the_ranks(fake_api):
    fake_api.run["metadata"] = {**(fake_api.run.get("metadata") or {}), "world_size": 2}
    fake_api.series["grad/global_norm"] = {"steps": [0, 1, 2], "values": [0.3, 0.4, 0.5]}  # rank 0's shard
    fake_api.combined["grad/global_norm"] = {"steps": [0, 1, 2], "values": [1.0, 1.1, 1.2]}
    fake_api.ranks = {"world_size": 2, "gradients": "sharded", "count": 2,
                      "data": [{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}]}
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(fake_api))
    ).server.test_client()
    norms = apply_patch(refresh(client)["grad-norm-graph"]["figure"])
    assert norms["data"][0]["y"] == [1.0, 1.1, 1.2]  # the combined norm, not rank 0's shard
    fake_api.ranks["gradients"] = "replicated"  # DDP: every rank has the whole gradient
    norms = apply_patch(refresh(client)["grad-norm-graph"]["figure"])
    assert norms["data"][0]["y"] == [0.3, 0.4, 0.5]
