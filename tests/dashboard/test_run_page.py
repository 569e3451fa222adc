"""The run page's callbacks through Flask's test client against a fake API: refresh, timeline, header,
heatmaps and histograms."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from dashboard_support import (
    LAYERS,
    RUN,
    SCALE_SERIES,
    SKIPS,
    FakeApi,
    alert,
    app_client,
    apply_patch,
    dash_call,
    refresh,
    refresh_runs,
    render,
    run_api,
)

from gradwatch.dashboard import create_dash_app, figures
from gradwatch.dashboard.pages import run_layers
from gradwatch.dashboard.views import keep_view


@pytest.fixture
def fake_api():
    return run_api()


@pytest.fixture
def dash_client(fake_api):
    return app_client(fake_api)


# -- line charts and timeline ----------------------------------------------------------------------


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


def test_a_distributed_run_shows_its_ranks_and_a_crashed_one_stands_out(fake_api):
    single = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(fake_api))
    )
    assert "ranks-line" not in json.dumps(refresh(single.server.test_client())["run-header"])
    assert not [r for r in fake_api.requests if r.url.path.endswith("/ranks")]  # not asked for one process

    fake_api.run["metadata"] = {**(fake_api.run.get("metadata") or {}), "world_size": 2}
    fake_api.ranks = {
        "world_size": 2,
        "gradients": "sharded",
        "count": 2,
        "data": [
            {"rank": 0, "host": "node-a", "status": "finished", "batches": 10},
            {"rank": 1, "host": "<b>node-b</b>", "status": "crashed", "batches": 4},
        ],
    }
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(fake_api))
    ).server.test_client()
    header = json.dumps(refresh(client)["run-header"], ensure_ascii=False)
    assert "2 ranks, gradients sharded" in header
    assert "rank 0 \u00b7 node-a \u00b7 finished" in header
    assert (
        "rank 1 \u00b7 <b>node-b</b> \u00b7 crashed" in header and "rank-chip bad" in header
    )  # text, flagged


def test_a_sharded_run_draws_its_global_norm_combined_over_the_ranks(fake_api):
    fake_api.run["metadata"] = {**(fake_api.run.get("metadata") or {}), "world_size": 2}
    fake_api.series["grad/global_norm"] = {"steps": [0, 1, 2], "values": [0.3, 0.4, 0.5]}  # rank 0's shard
    fake_api.combined["grad/global_norm"] = {"steps": [0, 1, 2], "values": [1.0, 1.1, 1.2]}
    fake_api.ranks = {
        "world_size": 2,
        "gradients": "sharded",
        "count": 2,
        "data": [{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}],
    }
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(fake_api))
    ).server.test_client()
    norms = apply_patch(refresh(client)["grad-norm-graph"]["figure"])
    assert norms["data"][0]["y"] == [1.0, 1.1, 1.2]  # the combined norm, not rank 0's shard
    fake_api.ranks["gradients"] = "replicated"  # DDP: every rank has the whole gradient
    norms = apply_patch(refresh(client)["grad-norm-graph"]["figure"])
    assert norms["data"][0]["y"] == [0.3, 0.4, 0.5]


# -- per-layer heatmaps and histograms -------------------------------------------------------------


HEATMAPS = ("grad-norm-heatmap", "update-ratio-heatmap", "underflow-heatmap")


def refresh_heatmap(client, graph_id="grad-norm-heatmap", selected_step=None, live_cursor=None, drawn=None):
    """One heatmap's refresh; its figure and cursor: {"figure": ..., "cursor": ...}."""
    response = dash_call(
        client,
        [f"{graph_id}.figure", f"{graph_id}-cursor.data"],
        [(("layers-refresh", "n_intervals"), None)],
        state=[
            (("run-id", "data"), "r1"),
            (("selected-step", "data"), selected_step),
            (("live-cursor", "data"), live_cursor),
            ((f"{graph_id}-cursor", "data"), drawn),
        ],
    )
    return {
        "figure": response.get(graph_id, {}).get("figure"),
        "cursor": response.get(f"{graph_id}-cursor", {}).get("data"),
    }


FP32_SERIES = {
    "loss": {"steps": [0, 1, 2], "values": [2.0, 1.8, 1.5]},
    "grad/global_norm": {"steps": [0, 1, 2], "values": [1.0, 0.9, 0.8]},
}


def scaler_panels(api):
    """What the loss scale chart and the fp16 underflow heatmap say (their annotations' texts)."""
    client = app_client(api)
    scale = apply_patch(refresh(client)["scale-graph"]["figure"])
    underflow = apply_patch(refresh_heatmap(client, "underflow-heatmap")["figure"])
    return [[note["text"] for note in figure["layout"]["annotations"]] for figure in (scale, underflow)]


def test_a_finished_run_without_a_grad_scaler_says_its_scale_charts_do_not_apply():
    fp32 = {**RUN, "status": "finished", "last_step": 2, "summary": {"skips": 0, "scale": None}}
    not_applicable = ["not applicable: this run has no GradScaler"]

    assert scaler_panels(FakeApi(run=fp32, series=FP32_SERIES, events=[])) == [not_applicable] * 2
    crashed = {**fp32, "status": "crashed", "status_reason": "ValueError: x"}
    assert scaler_panels(FakeApi(run=crashed, series=FP32_SERIES, events=[])) == [not_applicable] * 2


@pytest.mark.parametrize(
    "run",
    [
        # A live fp16 run whose first points are on their way, and one that has sent some steps.
        {**RUN, "last_step": None, "summary": {"skips": 0, "scale": None}},
        {**RUN, "last_step": 2, "summary": {"skips": 0, "scale": None}},
        # A finished run that never recorded a step; a server that does not send the summary's scale.
        {**RUN, "status": "finished", "last_step": None, "summary": {"skips": 0, "scale": None}},
        {**RUN, "status": "finished", "last_step": 2, "summary": {}},
    ],
)
def test_scale_charts_without_points_say_no_data_yet_unless_the_run_has_no_scaler(run):
    no_data = [figures.NO_DATA_TEXT]
    assert scaler_panels(FakeApi(run=run, series=FP32_SERIES, events=[])) == [no_data] * 2


def fill_layer_picker(client, options=None):
    return dash_call(
        client,
        ["hist-layer.options", "hist-layer.value", "layer-names.data"],
        [(("layers-refresh", "n_intervals"), 1)],
        state=[(("run-id", "data"), "r1"), (("hist-layer", "options"), options)],
    )


def test_layers_refresh_draws_each_heatmap_and_fills_an_empty_layer_picker(dash_client, fake_api):
    drawn = {graph_id: refresh_heatmap(dash_client, graph_id, selected_step=13) for graph_id in HEATMAPS}

    heatmap = apply_patch(drawn["grad-norm-heatmap"]["figure"])
    assert heatmap["layout"]["yaxis"]["labelalias"]["2"] == "&lt;b&gt;head&lt;/b&gt;.weight"
    assert heatmap["data"][0]["type"] == "image"
    assert heatmap["layout"]["shapes"][0]["x0"] == 13  # the selected step stays marked
    assert drawn["grad-norm-heatmap"]["cursor"]["last"] == 20
    assert drawn["grad-norm-heatmap"]["cursor"]["layers"] == LAYERS  # the names clicks pick from
    assert figures.NO_DATA_TEXT in json.dumps(drawn["update-ratio-heatmap"]["figure"])
    assert {r.url.params["max_steps"] for r in fake_api.requests if r.url.path.endswith("/vectors")} == {
        "500"
    }
    response = fill_layer_picker(dash_client)
    assert [option["label"] for option in response["hist-layer"]["options"]] == LAYERS  # text, not HTML
    assert response["hist-layer"]["value"] == "fc1.weight"
    assert response["layer-names"]["data"] == LAYERS  # what the picker's search looks through
    fake_api.requests.clear()
    unchanged = dash_client.post(
        "/_dash-update-component",
        json={
            "output": "..hist-layer.options...hist-layer.value...layer-names.data..",
            "outputs": [
                {"id": "hist-layer", "property": "options"},
                {"id": "hist-layer", "property": "value"},
                {"id": "layer-names", "property": "data"},
            ],
            "inputs": [{"id": "layers-refresh", "property": "n_intervals", "value": 2}],
            "state": [
                {"id": "run-id", "property": "data", "value": "r1"},
                {"id": "hist-layer", "property": "options", "value": response["hist-layer"]["options"]},
            ],
            "changedPropIds": ["layers-refresh.n_intervals"],
        },
    )
    assert unchanged.status_code == 204 and fake_api.requests == []  # a filled picker: nothing asked


def test_a_live_heatmap_asks_only_for_new_steps_and_appends_them(dash_client, fake_api):
    first = refresh_heatmap(dash_client, live_cursor={"run": ["running", "t0", 20], "resumes": 0})
    fake_api.requests.clear()
    same = refresh_heatmap(
        dash_client, live_cursor={"run": ["running", "t0", 20], "resumes": 0}, drawn=first["cursor"]
    )
    assert fake_api.requests == [] and same == {"figure": None, "cursor": None}  # no news: nothing asked

    vectors = fake_api.vectors["grad/norm"]
    fake_api.vectors["grad/norm"] = {
        **vectors,
        "steps": [*vectors["steps"], 30],
        "values": [*vectors["values"], [0.5, 0.05, 5.0]],
    }
    grown = refresh_heatmap(
        dash_client, live_cursor={"run": ["running", "t1", 30], "resumes": 0}, drawn=first["cursor"]
    )
    asked = [r.url.params.get("start") for r in fake_api.requests if r.url.path.endswith("/vectors")]
    assert asked == ["21"]  # after the last step drawn
    operations = grown["figure"]["operations"]
    live_cells = first["cursor"]["uids"].index("live-cells")
    extended = {tuple(op["location"]): op["params"]["value"] for op in operations}
    assert all(op["operation"] == "Extend" for op in operations)
    assert extended == {
        ("data", live_cells, "x"): [30],
        **{
            ("data", live_cells, "z", row): [round(math.log10(v), 4)]
            for row, v in enumerate([0.5, 0.05, 5.0])
        },
        **{("data", live_cells, "hovertext", row): [text] for row, text in enumerate(["0.5", "0.05", "5"])},
    }
    assert grown["cursor"]["last"] == 30

    resumed = refresh_heatmap(
        dash_client, live_cursor={"run": ["running", "t2", 30], "resumes": 1}, drawn=grown["cursor"]
    )
    assert apply_patch(resumed["figure"])["data"][0]["x0"] == 0  # a resume: drawn again in full


HISTOGRAM_OUTPUTS = [
    "hist-step.options",
    "hist-steps.data",
    "hist-step.value",
    "hist-graph.figure",
    "hist-time-graph.figure",
    "hist-cursor.data",
]


def show_histogram(
    client, layer, step=None, selected_step=None, trigger="hist-layer", live_cursor=None, drawn=None
):
    inputs = [
        (("hist-layer", "value"), layer),
        (("hist-step", "value"), step),
        (("selected-step", "data"), selected_step),
        (("layers-refresh", "n_intervals"), None),
    ]
    body_inputs = sorted(inputs, key=lambda item: item[0][0] != trigger)  # the trigger goes first
    response = client.post(
        "/_dash-update-component",
        json={
            "output": ".." + "...".join(HISTOGRAM_OUTPUTS) + "..",
            "outputs": [dict(zip(("id", "property"), o.split("."), strict=True)) for o in HISTOGRAM_OUTPUTS],
            "inputs": [{"id": i, "property": p, "value": v} for (i, p), v in inputs],
            "state": [
                {"id": "run-id", "property": "data", "value": "r1"},
                {"id": "live-cursor", "property": "data", "value": live_cursor},
                {"id": "hist-cursor", "property": "data", "value": drawn},
            ],
            "changedPropIds": [f"{i}.{p}" for (i, p), _ in body_inputs[:1]],
        },
    )
    if response.status_code == 204:
        return None  # no update
    assert response.status_code == 200, response.data
    return response.json["response"]


def test_histogram_of_the_chosen_layer_at_the_latest_step_then_at_a_selected_step(dash_client):
    response = show_histogram(dash_client, "fc1.bias")
    assert response["hist-step"]["value"] == 20
    assert [option["value"] for option in response["hist-step"]["options"]] == [20, 0]
    assert response["hist-steps"]["data"] == [0, 20]  # what typing in the step picker searches
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


def test_a_live_tick_reads_the_histogram_again_only_when_the_run_has_news(dash_client, fake_api):
    live_cursor = {"run": ["running", "t0", 20]}
    drawn = show_histogram(dash_client, "fc1.bias", live_cursor=live_cursor)["hist-cursor"]["data"]
    fake_api.requests.clear()
    tick = show_histogram(
        dash_client, "fc1.bias", trigger="layers-refresh", live_cursor=live_cursor, drawn=drawn
    )
    assert tick is None and fake_api.requests == []
    news = show_histogram(
        dash_client,
        "fc1.bias",
        trigger="layers-refresh",
        live_cursor={"run": ["running", "t1", 30]},
        drawn=drawn,
    )
    assert news["hist-step"]["value"] == 20


def test_the_layer_picker_lists_a_few_layers_at_a_time_and_searches_the_rest():
    layers = [f"model.layers.{i}.mlp.weight" for i in range(200)]
    first = run_layers.picker_options(layers, None, layers[0])
    assert [o["value"] for o in first] == layers[: run_layers.MAX_PICKED_OPTIONS]

    found = run_layers.picker_options(layers, "LAYERS.17.", layers[0])
    assert [o["value"] for o in found] == [layers[0], layers[17]]  # the chosen one stays listed
    clicked = run_layers.picker_options(layers, None, layers[150])  # a heatmap click picked it
    assert layers[150] in [o["value"] for o in clicked] and len(clicked) == run_layers.MAX_PICKED_OPTIONS


def test_the_step_picker_lists_the_steps_around_the_chosen_one_and_searches_the_rest(dash_client):
    steps = list(range(0, 100_000, 1000))
    limit = run_layers.MAX_STEP_OPTIONS
    latest = [o["value"] for o in run_layers.step_picker_options(steps, None, 99_000)]
    assert latest == steps[::-1][:limit]  # latest first
    around = [o["value"] for o in run_layers.step_picker_options(steps, None, 50_000)]
    assert len(around) == limit and 50_000 in around and around == sorted(around, reverse=True)
    oldest = [o["value"] for o in run_layers.step_picker_options(steps, None, 0)]
    assert oldest[-1] == 0 and len(oldest) == limit
    typed = run_layers.step_picker_options(steps, "12,0", 99_000)
    assert [o["value"] for o in typed] == [99_000, 12_000]  # the chosen one stays listed
    assert typed[1]["label"] == "step 12,000"

    response = dash_call(
        dash_client,
        ["hist-step.options"],
        [(("hist-step", "search_value"), "3000")],
        state=[(("hist-step", "value"), 99_000), (("hist-steps", "data"), steps)],
    )
    assert [o["value"] for o in response["hist-step"]["options"]] == [
        99_000,
        93_000,
        83_000,
        73_000,
        63_000,
        53_000,
        43_000,
        33_000,
        30_000,
        23_000,
        13_000,
        3_000,
    ]


def test_typing_in_the_layer_picker_asks_the_dashboard_for_matching_layers(dash_client):
    response = dash_call(
        dash_client,
        ["hist-layer.options"],
        [(("hist-layer", "search_value"), "bias"), (("hist-layer", "value"), "fc1.weight")],
        state=[(("layer-names", "data"), LAYERS)],
    )
    assert [o["value"] for o in response["hist-layer"]["options"]] == ["fc1.weight", "fc1.bias"]
