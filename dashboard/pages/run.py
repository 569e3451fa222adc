"""The run page (/dashboard/runs/{run_id}[?step=N]): the verdict and incidents first, then loss, loss
scale with skipped steps and the fp16 safe band, gradient norm and learning rate (each with a dotted
line where the run was resumed from a checkpoint); the reason a crashed run crashed; per-layer heatmaps; a
layer's histogram at a step and over steps; events and alerts; config and metadata; agent health.
?step=N (alert links) marks step N from the start; clicking a step (a table row, a heatmap cell, the
histogram over steps) marks it on every chart and shows that step's histogram.

A live run page refreshes whenever the server's doorbell rings (`doorbell`; every RUN_REFRESH_MS when
the stream is not open): one request for the run; only when its signature moved
(new data, a new status: `live.run_signature`) the points after the last step shown (appended to the
charts, see `live`; redrawn in full only when appending could not draw the same) and the events
stored since (`event_log`: new skips are appended to the scale chart). Once that has moved the live
cursor, a second callback reads what only the header and the timeline show: the agent's counters
after the last ones shown, the alerts and the incidents (so the charts, on a page's first load too,
do not wait for those calls). Heatmaps and histograms, heavier and slower to
change, every LAYERS_REFRESH_MS, the same way (`run_layers`).

Callbacks stay thin: fetch with the app's ApiClient (`services()`; independent calls together, on
the app's workers), draw with `figures`, lay out with `run_views`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import parse_qs, quote

import dash
import plotly.graph_objects as go
from dash import ALL, Input, Output, State, ctx, dcc, html

from .. import doorbell, figures, live, verdict
from ..api_client import ApiClient, ApiError, RunNotFound
from ..callbacks import PageCallbacks, services
from ..views import GRAPH_CONFIG, error_banner, keep_view, run_status
from . import run_layers, run_views
from .run_layers import LAYER_HEATMAPS, heatmap_cursor_id
from .run_views import AGENT_HEALTH_KEYS, EVENTS_TABLE_ROWS, events_table, run_details, run_header, world_size

__all__ = ["callbacks", "href", "layout", "parse_step", "run_layout"]

RUN_REFRESH_MS = 2000
LAYERS_REFRESH_MS = 10_000  # heatmaps and histograms of a live run: heavier, and they change slowly
HEALTH_WINDOW_STEPS = 1000
SERIES_KEYS = {
    "loss": "loss",
    "scale": "amp/scale",
    "safe_min": "amp/safe_scale_min",
    "safe_max": "amp/safe_scale_max",
    "grad_norm": "grad/global_norm",
    "grad_norm_post_clip": "grad/global_norm_post_clip",
    "lr": "lr",
}
SAFE_BAND_SERIES = ("safe_min", "safe_max")
# Drawn from GET /runs/{id}/ranks/series (combined over the ranks) when a run's gradients are sharded.
COMBINED_WHEN_SHARDED = ("grad_norm", "grad_norm_post_clip")
LINE_CHARTS = ("loss-graph", "scale-graph", "grad-norm-graph", "lr-graph")
STEP_GRAPHS = (*LINE_CHARTS, *LAYER_HEATMAPS, "hist-time-graph")
# What one refresh of the page updates, by name: the line charts by their graph ids. The header's
# slot gets only what went wrong here (the header and the timeline have a callback of their own).
REFRESH_OUTPUTS = {
    "header": Output("run-header", "children"),
    **{graph_id: Output(graph_id, "figure") for graph_id in LINE_CHARTS},
    "stop_polling": Output("refresh", "disabled"),
    "stop_polling_layers": Output("layers-refresh", "disabled"),
    "cursor": Output("live-cursor", "data"),
    # Cleared when the header's slot shows an error instead: the header's next refresh draws it all.
    "header_cursor": Output("header-cursor", "data", allow_duplicate=True),
}
UNCHANGED = dict.fromkeys(REFRESH_OUTPUTS, dash.no_update)
# What the header's refresh updates, once the line charts' has moved the live cursor.
HEADER_OUTPUTS = {
    "header": Output("run-header", "children", allow_duplicate=True),
    "timeline": Output("events-table", "children"),
    "shown": Output("header-cursor", "data"),
}

callbacks = PageCallbacks()  # the per-layer part's are `run_layers.callbacks`


def parse_step(search: str | None) -> int | None:
    """The step of a run page's query string ("?step=120", as alert links carry), or None."""
    values = parse_qs((search or "").lstrip("?")).get("step", [])
    return int(values[0]) if values and values[0].isdigit() else None


def parse_project(search: str | None) -> str | None:
    """The project of a run page's query string ("?project=team", as alert links carry), or None."""
    values = parse_qs((search or "").lstrip("?")).get("project", [])
    return values[0] if values and values[0] else None


def href(app: dash.Dash, run_id: str, step: Any = None) -> str:
    """The run page's URL; with a step, the page opens with that step marked (as alert links do)."""
    path: str = app.get_relative_path(f"/runs/{quote(run_id, safe='')}")
    return path + f"?step={step}" if isinstance(step, int) and not isinstance(step, bool) else path


def layout(
    api: ApiClient, run_id: str, selected_step: int | None = None, project: str | None = None
) -> html.Div:
    """The page of run `run_id` (of `project`, as alert links name runs: two projects may each have a
    run of that id), its layer picker filled (one small request for the layer names). Raises
    RunNotFound or ApiError when the run cannot be read."""
    run = api.get_run(run_id, project)
    run_id = str(run.get("id"))  # the id the signed-in token knows the run by
    try:
        layers = figures.layer_names_of(
            api.vectors(run_id, LAYER_HEATMAPS["grad-norm-heatmap"][0], max_steps=1, end=0)
        )
    except ApiError:
        layers = []  # the layers refresh fills the picker later
    streams = services().live_doorbell
    stream = streams + quote(run_id, safe="") if streams else None
    return run_layout(run, layers, selected_step, stream=stream)


# -- callbacks -------------------------------------------------------------------------------------


@callbacks.callback(
    output=REFRESH_OUTPUTS,
    inputs=[Input("refresh", "n_intervals")],
    state=[
        State("run-id", "data"),
        State("selected-step", "data"),
        State("live-cursor", "data"),
        State("header-cursor", "data"),
    ],
    prevent_initial_call="initial_duplicate",  # called as the page opens; header-cursor is shared
)
def refresh_run(
    n_intervals: int | None, run_id: str, selected_step: Any, cursor: Any, header_cursor: Any = None
) -> dict[str, Any]:
    # The line charts only: the header and the timeline follow once the cursor has moved
    # (refresh_header), so the charts do not wait for the calls only those need. A live run's
    # charts get only the points after the last step shown, appended (see `live`); the first
    # call, an ended run and anything appending cannot draw right redraw in full.
    api, background, event_log = services().api, services().background, services().event_log
    try:
        run = api.get_run(run_id)
        ended = run.get("status") != "running"
        signature = [*live.run_signature(run), run_status(run)]
        appendable = not ended and live.can_append(cursor, run_id)
        if appendable and cursor.get("run") == signature:  # nothing new
            quiet = {**UNCHANGED, "stop_polling": False, "stop_polling_layers": False}
            if header_cursor is None:
                # The header's slot still shows an error banner, and the API answers again: the
                # cursor moved by a tick number alone makes the header's refresh draw it in full.
                return {**quiet, "cursor": {**cursor, "header_redraw": n_intervals}}
            return quiet
        starts = _live_starts(cursor) if appendable else None
        # A sharded run's ranks each measure their own shard: its global norm is theirs combined.
        ranks = api.ranks(run_id) if world_size(run) > 1 else None
        sharded = bool(ranks and ranks.get("gradients") == "sharded")
        calls = _series_calls(api, run_id, starts, sharded)
        calls["events"] = lambda: event_log.read(api, run_id)  # only what is new, when it can
        fetched = background.fetch_all(calls)
        events, _event_count, continued = fetched["events"]
        skips = [event for event in events if event.get("kind") == "skip"]
        resumes = [event for event in events if event.get("kind") == "resume"]
        # Continued: the events shown before, then those stored since, so the new skips are last.
        new_skips = skips[cursor.get("skips", 0) :] if appendable and continued else None
        appended = None
        if starts is not None and new_skips is not None:
            appended = append_new_points(cursor, fetched, skips, resumes, new_skips)
        if starts is not None and appended is None:
            fetched.update(background.fetch_all(_series_calls(api, run_id, None, sharded)))
    except RunNotFound:
        event_log.forget(run_id)
        header = error_banner(f"Run “{run_id}” no longer exists.")
        return {
            **UNCHANGED,
            "header": header,
            "stop_polling": True,
            "stop_polling_layers": True,
            "header_cursor": None,
        }
    except ApiError as exc:
        # Keep what is drawn and keep polling: the server may be restarting. The banner replaces
        # the header's slot, so the header's next refresh must draw it in full, not patch a part.
        header = error_banner(exc)
        return {
            **UNCHANGED,
            "header": header,
            "stop_polling": False,
            "stop_polling_layers": False,
            "header_cursor": None,
        }
    updates = {
        "header": dash.no_update,
        "stop_polling": ended,
        "stop_polling_layers": ended,
        "header_cursor": dash.no_update,
    }
    if appended is not None:
        charts, new_cursor = appended
        return {**updates, **charts, "cursor": {**new_cursor, "run": signature}}
    marker = figures.step_marker_shapes(selected_step)
    drawn = {name: fetched[name] for name in SERIES_KEYS}
    charts = _line_charts(drawn, skips, run_id, resumes, run_views.scaler_empty_text(run))
    return {
        **updates,
        **{graph_id: keep_view(_with_shapes(figure, marker)) for graph_id, figure in charts.items()},
        "cursor": {
            **live.full_cursor(run_id, charts, drawn, len(skips)),
            "resumes": len(resumes),
            "run": signature,
        },
    }


@callbacks.callback(
    output=HEADER_OUTPUTS,
    inputs=[Input("live-cursor", "data")],
    state=[State("run-id", "data"), State("header-cursor", "data")],
    prevent_initial_call=True,
)
def refresh_header(cursor: Any, run_id: str, header_cursor: Any) -> dict[str, Any]:
    # After every refresh that moved the live cursor (news, or the first drawing): the header
    # line with the agent's counters read after the last ones shown, the verdict and incidents,
    # the timeline (the events the line charts' refresh has just read, alerts).
    if not isinstance(cursor, dict):
        raise dash.exceptions.PreventUpdate
    same_run = isinstance(header_cursor, dict) and header_cursor.get("run_id") == run_id
    before = header_cursor if same_run else {}
    api, background, event_log = services().api, services().background, services().event_log
    try:
        run = api.get_run(run_id)
        ranks = api.ranks(run_id) if world_size(run) > 1 else None
        shown_health = _shown_health(before or None, run)
        calls: dict[str, Callable[[], Any]] = {
            "health/" + name: partial(api.series, run_id, key, start=shown_health[name][0])
            for name, key in AGENT_HEALTH_KEYS.items()
        }
        calls["events"] = lambda: event_log.kept(run_id) or event_log.read(api, run_id)[:2]
        calls["alerts"] = lambda: _run_alerts(api, run_id)
        calls["incidents"] = lambda: _run_incidents(api, run_id)
        fetched = background.fetch_all(calls)
    except ApiError as exc:  # RunNotFound included: the line charts' refresh says so too
        # Drawn in full on the next refresh that works.
        return {"header": error_banner(exc), "timeline": dash.no_update, "shown": None}
    events, event_count = fetched["events"]
    health = _latest_health(shown_health, fetched)
    alerts, alerts_error = fetched["alerts"]
    # The verdict and incidents sit in the header's slot: right below the header, above the charts.
    incidents, run_verdict, incidents_error = fetched["incidents"]
    header = run_header(run, {name: value for name, (_, value) in health.items()}, ranks)
    # What the verdict and the timeline show: when a live tick leaves it as it was, only the
    # header line is sent (a patch of the slot's first child) and the timeline not at all.
    shown = {
        "verdict": _digest([run_verdict, incidents, str(incidents_error or "")]),
        "timeline": _digest([event_count, events[-EVENTS_TABLE_ROWS:], alerts, str(alerts_error or "")]),
    }
    shown_before = before.get("shown")
    drawn: dict[str, Any] = shown_before if isinstance(shown_before, dict) else {}
    header_update: Any = [
        header,
        verdict.verdict_banner(run_verdict, incidents, incidents_error),
        verdict.incidents_section(incidents, services().run_href),
    ]
    if drawn.get("verdict") == shown["verdict"]:
        header_update = dash.Patch()
        header_update[0] = header
    timeline: Any = dash.no_update
    if drawn.get("timeline") != shown["timeline"]:
        # In step order (the events read since the last refresh come in the order they were stored).
        timeline = events_table(sorted(events, key=_step_of), event_count, alerts, alerts_error)
    return {
        "header": header_update,
        "timeline": timeline,
        "shown": {"run_id": run_id, "health": health, "shown": shown},
    }


@callbacks.callback(
    Output("selected-step", "data"),
    Output("hist-layer", "value", allow_duplicate=True),
    Input({"type": "event-step", "step": ALL, "row": ALL}, "n_clicks"),
    *(Input(graph_id, "clickData") for graph_id in LAYER_HEATMAPS),
    Input("hist-time-graph", "clickData"),
    *(State(heatmap_cursor_id(graph_id), "data") for graph_id in LAYER_HEATMAPS),
    prevent_initial_call=True,
)
def select_step(*inputs: Any) -> tuple[Any, Any]:
    trigger = ctx.triggered_id
    value = ctx.triggered[0].get("value") if ctx.triggered else None
    if isinstance(trigger, dict) and trigger.get("type") == "event-step":
        # Re-drawn tables add buttons with no clicks: only a real click selects.
        return (trigger["step"], dash.no_update) if value else (dash.no_update, dash.no_update)
    point = (value or {}).get("points", [{}])[0] if isinstance(value, dict) else {}
    step = point.get("x")
    if isinstance(step, float) and math.isfinite(step):
        step = round(step)  # a heatmap column's centre
    if not isinstance(step, int) or isinstance(step, bool):
        return dash.no_update, dash.no_update
    if trigger in LAYER_HEATMAPS:
        # A heatmap's y is the layer's index; its names are in what the heatmap's cursor drew.
        drawn = dict(zip(LAYER_HEATMAPS, inputs[-len(LAYER_HEATMAPS) :], strict=True))[trigger]
        layers = drawn.get("layers") if isinstance(drawn, dict) else None
        row = point.get("y")
        if isinstance(layers, list) and isinstance(row, (int, float)) and 0 <= round(row) < len(layers):
            return step, layers[round(row)]
    return step, dash.no_update


@callbacks.callback(
    *(Output(graph_id, "figure", allow_duplicate=True) for graph_id in STEP_GRAPHS),
    Output("opened-step", "data"),
    Input("selected-step", "data"),
    State("opened-step", "data"),
    prevent_initial_call=True,
)
def mark_step(step: Any, opened: Any) -> tuple[Any, ...]:
    # Dash calls this once as the page's layout is inserted, with the step the page opened at
    # (`opened-step` still holds it): its charts are drawn with that step's marker (or none)
    # already, and a patch now would only draw each of them once more, placeholders included.
    if ctx.triggered_id is None or (isinstance(opened, dict) and opened.get("step") == step):
        return (*(dash.no_update for _ in STEP_GRAPHS), None)
    patches = []
    for _ in STEP_GRAPHS:
        patch = dash.Patch()
        patch["layout"]["shapes"] = figures.step_marker_shapes(step)
        patches.append(patch)
    return (*patches, None if opened is not None else dash.no_update)


def _live_starts(cursor: dict[str, Any]) -> dict[str, int]:
    """Per SERIES_KEYS name, the first step after those the live cursor's charts show."""
    return live.fetch_starts(cursor, SERIES_KEYS, inclusive=SAFE_BAND_SERIES)


def _series_calls(
    api: ApiClient, run_id: str, starts: dict[str, int] | None, sharded: bool = False
) -> dict[str, Callable[[], Any]]:
    """The line charts' series: whole (downsampled by the server), or from `starts` on. With
    sharded gradients the global norms are the ranks' combined (rank 0 alone has its shard's)."""
    calls: dict[str, Callable[[], Any]] = {}
    for name, key in SERIES_KEYS.items():
        start = None if starts is None else starts[name]
        fetch = api.combined_series if sharded and name in COMBINED_WHEN_SHARDED else api.series
        calls[name] = partial(fetch, run_id, key, start=start)
    return calls


def _run_alerts(api: ApiClient, run_id: str) -> tuple[list[dict[str, Any]], ApiError | None]:
    # The run page still works against a server without the alerts API (or with it failing).
    try:
        return api.alerts(run_id=run_id, limit=EVENTS_TABLE_ROWS)[0], None
    except ApiError as exc:
        return [], exc


def _run_incidents(api: ApiClient, run_id: str) -> tuple[list[dict[str, Any]], str | None, ApiError | None]:
    # Likewise without the incidents API (a 404 from an older server): "verdict unavailable".
    try:
        return (*api.run_incidents(run_id), None)
    except ApiError as exc:
        return [], None, exc


def append_new_points(
    cursor: dict[str, Any],
    fetched: dict[str, Any],
    skips: list[dict[str, Any]],
    resumes: list[dict[str, Any]] | None = None,
    new_skips: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(chart patches by graph id, cursor) that append the new points and the
    skip markers of `new_skips` (the skip events stored since the last refresh); None when the
    charts must be redrawn in full (skips other than those, a resume -- it rewrote steps already
    drawn --, a downsampled slice, anything `live` refuses to append, the first skip marker)."""
    new = {name: fetched[name] for name in SERIES_KEYS}
    new_skips = new_skips or []
    if len(skips) != cursor.get("skips", 0) + len(new_skips):
        return None
    if len(resumes or ()) != cursor.get("resumes", 0):
        return None
    if any(series.get("downsampled") for series in new.values()):
        return None
    # The same builders, on the new points (and skips) only.
    new_points = _line_charts(new, new_skips, cursor["run_id"])
    patches = {
        graph_id: live.append_patch(cursor["charts"][graph_id], figure)
        for graph_id, figure in new_points.items()
    }
    if any(patch is None for patch in patches.values()):
        return None
    counted = [name for name in SERIES_KEYS if name not in SAFE_BAND_SERIES]
    return patches, {**live.advance(cursor, new, counted), "skips": len(skips)}


def _digest(value: Any) -> str:
    """A short fingerprint of JSON-able `value`: equal fingerprints, the same view."""
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _step_of(event: dict[str, Any]) -> int:
    step = event.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def _shown_health(cursor: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, list[Any]]:
    """Per AGENT_HEALTH_KEYS name, [the first step to fetch, the latest value shown]: after the last
    step shown (`cursor`: the header's), else the last HEALTH_WINDOW_STEPS steps of the run."""
    shown = cursor.get("health") if isinstance(cursor, dict) else None
    if isinstance(shown, dict) and all(isinstance(shown.get(name), list) for name in AGENT_HEALTH_KEYS):
        return {name: list(shown[name]) for name in AGENT_HEALTH_KEYS}
    last_step = run.get("last_step")
    start = max(0, last_step - HEALTH_WINDOW_STEPS) if isinstance(last_step, int) else 0
    return {name: [start, None] for name in AGENT_HEALTH_KEYS}


def _latest_health(shown: dict[str, list[Any]], fetched: dict[str, Any]) -> dict[str, list[Any]]:
    """The agent's counters after a refresh: the newest fetched value of each, else the one shown."""
    health = {}
    for name, (start, value) in shown.items():
        series = fetched["health/" + name]
        last = live.last_step(series)
        health[name] = [start, value] if last is None else [last + 1, _latest(series)]
    return health


# -- layout and drawing (pure: data in, components and figures out) --------------------------------


def run_layout(
    run: dict[str, Any],
    layers: list[str] | None = None,
    selected_step: int | None = None,
    stream: str | None = None,
) -> html.Div:
    """The run page's layout; `layers` (model order) fill the histogram's layer picker up front, so
    the histogram loads alongside the heatmaps instead of after them. `selected_step` (from an
    alert's link, ?step=N) is marked on the charts from the start. `stream`: the URL path of the
    run's doorbell (a live run page then refreshes when it rings), None to poll."""
    run_id = str(run.get("id"))
    layers = layers or []
    running = run.get("status") == "running"

    def graph(graph_id: str, title: str) -> html.Div:
        # Plain dicts: the page is built before anything else can happen (~30 ms a go.Figure).
        if graph_id in LAYER_HEATMAPS:
            figure = figures.heatmap_placeholder(
                title, "loading…", uirevision=run_id, layer_count=len(layers)
            )
        else:
            figure = figures.empty_figure_dict(title, "loading…", uirevision=run_id)
        return html.Div(dcc.Graph(id=graph_id, figure=figure, config=GRAPH_CONFIG), className="card")

    return html.Div(
        [
            dcc.Store(id="run-id", data=run_id),
            dcc.Store(id="selected-step", data=selected_step),
            # The step the page opened at, until the step marker's first call has seen it (mark_step).
            dcc.Store(id="opened-step", data={"step": selected_step}),
            dcc.Store(id="live-cursor", data=None),  # what the line charts show, for live appends
            dcc.Store(id="header-cursor", data=None),  # what the header and the timeline show
            *(dcc.Store(id=heatmap_cursor_id(graph_id), data=None) for graph_id in LAYER_HEATMAPS),
            dcc.Store(id="hist-cursor", data=None),  # what the histogram shows
            html.Div(run_header(run, {}), id="run-header"),
            *_doorbell(stream, running),  # and the line saying how the page stays live
            run_details(run),
            html.Div(
                [
                    graph("loss-graph", "Loss"),
                    graph("scale-graph", "Loss scale"),
                    graph("grad-norm-graph", "Gradient norm (global, unscaled)"),
                    graph("lr-graph", "Learning rate"),
                ],
                className="graph-grid",
            ),
            html.H2("Per layer", className="section"),
            html.P(
                "Layers in model order, first at the top. Red cells are NaN/Inf. "
                "Click a cell to see that layer's histogram at that step.",
                className="muted hint",
            ),
            *(graph(graph_id, spec[1]) for graph_id, spec in LAYER_HEATMAPS.items()),
            html.Div(
                [
                    html.H2("Gradient histogram of a layer"),
                    html.Div(
                        [
                            html.Label("Layer", htmlFor="hist-layer"),
                            dcc.Dropdown(
                                id="hist-layer",
                                options=run_layers.picker_options(
                                    layers, None, layers[0] if layers else None
                                ),
                                value=layers[0] if layers else None,
                                clearable=False,
                                className="layer-pick",
                                placeholder="type to search the layers",
                            ),
                            dcc.Store(id="layer-names", data=layers),
                            html.Label("Step", htmlFor="hist-step"),
                            dcc.Dropdown(
                                id="hist-step",
                                options=[],
                                value=None,
                                clearable=False,
                                className="step-pick",
                                placeholder="type to search the steps",
                            ),
                            dcc.Store(id="hist-steps", data=[]),  # every step the histogram has
                        ],
                        className="toolbar",
                    ),
                    html.Div(
                        [
                            dcc.Graph(
                                id="hist-graph",
                                figure=figures.empty_figure_dict(
                                    "Gradient histogram", "loading…", uirevision=run_id
                                ),
                                config=GRAPH_CONFIG,
                            ),
                            dcc.Graph(
                                id="hist-time-graph",
                                figure=figures.empty_figure_dict(
                                    "Gradient histogram over steps", "loading…", uirevision=run_id
                                ),
                                config=GRAPH_CONFIG,
                            ),
                        ],
                        className="graph-grid inner",
                    ),
                ],
                className="card",
            ),
            html.Div(
                [
                    html.H2("Events and alerts"),
                    html.P(
                        "Click a step to mark it on the charts and show its histogram.",
                        className="muted hint",
                    ),
                    html.Div(id="events-table"),
                ],
                className="card",
            ),
            dcc.Interval(id="refresh", interval=RUN_REFRESH_MS, disabled=not running),
            dcc.Interval(id="layers-refresh", interval=LAYERS_REFRESH_MS, disabled=not running),
        ]
    )


def _doorbell(url: str | None, running: bool) -> list[Any]:
    """A live run page refreshes when its stream rings (see `doorbell`), else polls."""
    if not running:
        return []
    polling = f"polling every {RUN_REFRESH_MS // 1000} s"
    bells = (
        doorbell.Bell("live-bell", every=250, normal=RUN_REFRESH_MS),
        doorbell.Bell("layers-bell", every=LAYERS_REFRESH_MS, normal=LAYERS_REFRESH_MS),
    )
    return doorbell.components(url, bells, polling)


def _line_charts(
    series: dict[str, Any],
    skips: list[dict[str, Any]],
    run_id: str,
    resumes: list[dict[str, Any]] | None = None,
    no_scale_text: str = figures.NO_DATA_TEXT,
) -> dict[str, go.Figure]:
    """The LINE_CHARTS by graph id, from the SERIES_KEYS series (by name), skip events and resume
    events (a dotted line on every chart where the run continued from a checkpoint); the loss scale
    chart says `no_scale_text` when it has nothing to draw."""
    band = (series["safe_min"], series["safe_max"])
    charts = {
        "loss-graph": figures.loss_figure(series["loss"], uirevision=run_id),
        "scale-graph": figures.scale_figure(
            series["scale"], skips, band, empty_text=no_scale_text, uirevision=run_id
        ),
        "grad-norm-graph": figures.grad_norm_figure(
            series["grad_norm"], series["grad_norm_post_clip"], uirevision=run_id
        ),
        "lr-graph": figures.lr_figure(series["lr"], uirevision=run_id),
    }
    return {graph_id: figures.add_resume_markers(figure, resumes) for graph_id, figure in charts.items()}


def _with_shapes(figure: go.Figure, shapes: list[dict[str, Any]]) -> go.Figure:
    if shapes and figure.data:
        figure.update_layout(shapes=shapes)
    return figure


def _latest(series: Any) -> Any:
    """The last value of an API series, or None."""
    values = series.get("values") if isinstance(series, dict) else None
    return values[-1] if isinstance(values, list) and values else None
