"""Live updates of the run page: append only the new points (live's patches), and the refresh that
uses them."""

from __future__ import annotations

import dash
import httpx
import pytest
from dashboard_support import (
    HEADER_OUTPUTS,
    REFRESH_OUTPUTS,
    SCALE_SERIES,
    FakeApi,
    apply_patch,
    dash_call,
    refresh,
    skip_event,
)

from gradwatch.dashboard import create_dash_app, figures, live


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


# -- live refresh through the app ------------------------------------------------------------------


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
    second = refresh(client, cursor=cursor, header_cursor=first["header-cursor"]["data"])

    starts = {
        r.url.params["key"]: r.url.params.get("start") for r in api.requests if r.url.path.endswith("/series")
    }
    assert starts["loss"] == "3" and starts["amp/scale"] == "3" and starts["lr"] == "3"
    assert set(operations_of(second, "loss-graph")) == {"Extend"}
    assert set(operations_of(second, "scale-graph")) == {"Extend"}
    assert "lr-graph" not in second  # nothing new: no update
    assert "events-table" not in second  # the same events and alerts: the timeline is left as it is
    header_ops = second["run-header"]["children"]["operations"]
    assert [op["location"] for op in header_ops] == [[0]]  # only the header line, not the verdict
    assert second["live-cursor"]["data"]["last"]["loss"] == 3


def _failing_on_demand():
    """A live run's API, a switch (failing[0] = True: every request answered 503 "restarting") and a
    dashboard test client on it."""
    api = live_api()
    failing = [False]

    def transport(request):
        if failing[0]:
            return httpx.Response(503, json={"detail": "restarting"})
        return api(request)

    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(transport))
    ).server.test_client()
    return api, failing, client


def test_after_an_error_banner_the_next_news_draws_the_whole_header_again():
    api, failing, client = _failing_on_demand()
    first = refresh(client)
    cursor = first["live-cursor"]["data"]

    failing[0] = True
    broken = refresh(client, cursor=cursor, header_cursor=first["header-cursor"]["data"])
    assert "restarting" in str(broken["run-header"]["children"])  # the banner fills the header's slot
    assert broken["header-cursor"]["data"] is None  # so what the header showed is forgotten

    failing[0] = False
    grow(api, "loss", 3, 1.4)
    news = refresh(client, cursor=cursor, header_cursor=broken["header-cursor"]["data"])
    header = news["run-header"]["children"]
    assert isinstance(header, list) and len(header) == 3  # header, verdict and incidents: no patch
    assert "restarting" not in str(header)


def test_once_the_api_answers_again_an_error_banner_goes_without_waiting_for_news():
    _, failing, client = _failing_on_demand()
    first = refresh(client)
    cursor, shown = first["live-cursor"]["data"], first["header-cursor"]["data"]
    quiet = refresh(client, cursor=cursor, header_cursor=shown)
    assert "live-cursor" not in quiet and "run-header" not in quiet  # the header drawn: nothing sent

    failing[0] = True
    broken = refresh(client, cursor=cursor, header_cursor=shown)
    assert "restarting" in str(broken["run-header"]["children"])

    failing[0] = False  # back, and the run has nothing new: the banner still goes at the next tick
    back = refresh(client, cursor=cursor, header_cursor=broken["header-cursor"]["data"])
    header = back["run-header"]["children"]
    assert isinstance(header, list) and len(header) == 3 and "restarting" not in str(header)
    assert back["header-cursor"]["data"] is not None  # and the ticks after it are quiet again
    after = refresh(client, cursor=back["live-cursor"]["data"], header_cursor=back["header-cursor"]["data"])
    assert "live-cursor" not in after and "run-header" not in after


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


def test_a_live_tick_with_no_news_asks_only_for_the_run():
    api = live_api()
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    ).server.test_client()
    first = refresh(client)
    cursor = first["live-cursor"]["data"]
    api.requests.clear()

    quiet = refresh(client, cursor=cursor, header_cursor=first["header-cursor"]["data"])

    assert [r.url.path for r in api.requests] == ["/api/v1/runs/r1"]
    assert "live-cursor" not in quiet and "loss-graph" not in quiet  # nothing redrawn


def test_a_live_tick_reads_events_and_agent_counters_after_those_shown():
    api = live_api()
    api.events = [skip_event(1, 65536.0, 32768.0)]
    api.series["agent/sent"] = {"steps": [0, 2], "values": [10.0, 30.0]}
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    ).server.test_client()
    first = refresh(client)
    cursor, header_cursor = first["live-cursor"]["data"], first["header-cursor"]["data"]
    assert header_cursor["health"]["sent"] == [3, 30.0]

    grow(api, "loss", 3, 1.4)
    grow(api, "amp/scale", 3, 32768.0)
    api.events.append(skip_event(3, 65536.0, 32768.0))
    api.requests.clear()
    second = refresh(client, cursor=cursor, header_cursor=header_cursor)

    asked = {r.url.path.rsplit("/", 1)[-1]: r.url.params for r in api.requests}
    assert asked["events"]["after_id"] == "1"  # only the events stored since
    sent = next(r for r in api.requests if r.url.params.get("key") == "agent/sent")
    assert sent.url.params["start"] == "3"
    # The new skip joins the skip markers drawn: appended, not redrawn.
    extended = {
        tuple(op["location"]): op["params"]["value"] for op in second["scale-graph"]["figure"]["operations"]
    }
    skipped = [location for location in extended if location[-1] == "x" and extended[location] == [3]]
    assert len(skipped) == 2  # the scale line's new point and the new skip marker
    assert second["live-cursor"]["data"]["skips"] == 2


def test_the_line_charts_do_not_wait_for_what_only_the_header_and_timeline_read():
    api = live_api()
    client = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    ).server.test_client()
    charts = dash_call(
        client,
        REFRESH_OUTPUTS,
        [(("refresh", "n_intervals"), 0)],
        state=[
            (("run-id", "data"), "r1"),
            (("selected-step", "data"), None),
            (("live-cursor", "data"), None),
            (("header-cursor", "data"), None),
        ],
    )

    asked = [r.url.params.get("key") or r.url.path.rsplit("/", 1)[-1] for r in api.requests]
    assert "loss-graph" in charts and "live-cursor" in charts and "run-header" not in charts
    assert not any(name.startswith("agent/") or name in ("alerts", "incidents") for name in asked)
    api.requests.clear()
    header = dash_call(
        client,
        HEADER_OUTPUTS,
        [(("live-cursor", "data"), charts["live-cursor"]["data"])],
        state=[(("run-id", "data"), "r1"), (("header-cursor", "data"), None)],
    )

    assert "run-header" in header and "events-table" in header
    assert "events" not in [r.url.path.rsplit("/", 1)[-1] for r in api.requests]  # the charts' read kept
