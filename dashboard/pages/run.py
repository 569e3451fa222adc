"""The run page (/dashboard/runs/{run_id}[?step=N]): the verdict and incidents first, then loss, loss
scale with skipped steps and the fp16 safe band, gradient norm and learning rate (each with a dotted
line where the run was resumed from a checkpoint); the reason a crashed run crashed; per-layer heatmaps; a
layer's histogram at a step and over steps; events and alerts; config and metadata; agent health.
?step=N (alert links) marks step N from the start; clicking a step (a table row, a heatmap cell, the
histogram over steps) marks it on every chart and shows that step's histogram.

A live run page polls every RUN_REFRESH_MS for the points after the last step shown and appends them
to the charts (see `live`), redrawing in full only when appending could not draw the same; heatmaps
and histograms, heavier and slower to change, every LAYERS_REFRESH_MS.

Callbacks stay thin: fetch with the ApiClient (independent calls together, on the app's workers),
draw with `figures`, lay out with `run_views`.
"""

from __future__ import annotations

import html as html_text
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote

import dash
import plotly.graph_objects as go
from dash import ALL, Input, Output, State, ctx, dcc, html

from .. import figures, live, verdict
from ..api_client import ApiClient, ApiError, RunNotFound
from ..views import GRAPH_CONFIG, RunHref, error_banner, keep_view
from .run_views import AGENT_HEALTH_KEYS, EVENTS_TABLE_ROWS, events_table, run_details, run_header, world_size

if TYPE_CHECKING:
    from ..app import Background

__all__ = ["href", "layout", "parse_step", "register", "run_layout"]

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
# Per-layer heatmaps: graph id → (vector key, title, colour-bar label, log colour scale, fixed range).
LAYER_HEATMAPS = {
    "grad-norm-heatmap": ("grad/norm", "Gradient norm per layer", "‖g‖", True, None),
    "update-ratio-heatmap": ("update/ratio", "Update ratio per layer (‖Δw‖/‖w‖)", "ratio", True, None),
    "underflow-heatmap": (
        "grad/underflow_frac",
        "fp16 underflow fraction per layer",
        "fraction",
        False,
        (0, 1),
    ),
}
STEP_GRAPHS = (*LINE_CHARTS, *LAYER_HEATMAPS, "hist-time-graph")
# What one refresh of the page updates, by name: the line charts by their graph ids.
REFRESH_OUTPUTS = {
    "header": Output("run-header", "children"),
    **{graph_id: Output(graph_id, "figure") for graph_id in LINE_CHARTS},
    "timeline": Output("events-table", "children"),
    "stop_polling": Output("refresh", "disabled"),
    "stop_polling_layers": Output("layers-refresh", "disabled"),
    "scale_series": Output("scale-series", "data"),
    "cursor": Output("live-cursor", "data"),
}
UNCHANGED = dict.fromkeys(REFRESH_OUTPUTS, dash.no_update)


def parse_step(search: str | None) -> int | None:
    """The step of a run page's query string ("?step=120", as alert links carry), or None."""
    values = parse_qs((search or "").lstrip("?")).get("step", [])
    return int(values[0]) if values and values[0].isdigit() else None


def href(app: dash.Dash, run_id: str, step: Any = None) -> str:
    """The run page's URL; with a step, the page opens with that step marked (as alert links do)."""
    path: str = app.get_relative_path(f"/runs/{quote(run_id, safe='')}")
    return path + f"?step={step}" if isinstance(step, int) and not isinstance(step, bool) else path


def layout(api: ApiClient, run_id: str, selected_step: int | None = None) -> html.Div:
    """The page of run `run_id`, its layer picker filled (one small request for the layer names).
    Raises RunNotFound or ApiError when the run cannot be read."""
    run = api.get_run(run_id)
    try:
        layers = figures.layer_names_of(
            api.vectors(run_id, LAYER_HEATMAPS["grad-norm-heatmap"][0], max_steps=1, end=0)
        )
    except ApiError:
        layers = []  # the layers refresh fills the picker later
    return run_layout(run, layers, selected_step)


# -- callbacks -------------------------------------------------------------------------------------


def register(app: dash.Dash, api: ApiClient, background: Background, run_href: RunHref) -> None:
    """The run page's callbacks; `background` runs a refresh's independent API calls together,
    `run_href(run_id, step)` links a run page at a step (the incidents' links)."""

    @app.callback(
        output=REFRESH_OUTPUTS,
        inputs=[Input("refresh", "n_intervals")],
        state=[State("run-id", "data"), State("selected-step", "data"), State("live-cursor", "data")],
    )
    def refresh_run(_n_intervals: int | None, run_id: str, selected_step: Any, cursor: Any) -> dict[str, Any]:
        # A live run's charts get only the points after the last step shown, appended (see `live`);
        # the first call, an ended run and anything appending cannot draw right redraw in full.
        try:
            run = api.get_run(run_id)
            ended = run.get("status") != "running"
            starts = None if ended or not live.can_append(cursor, run_id) else live_starts(cursor)
            last_step = run.get("last_step")
            if not isinstance(last_step, int):
                last_step = 0
            health_start = max(0, last_step - HEALTH_WINDOW_STEPS)
            # A sharded run's ranks each measure their own shard: its global norm is theirs combined.
            ranks = api.ranks(run_id) if world_size(run) > 1 else None
            sharded = bool(ranks and ranks.get("gradients") == "sharded")
            calls = series_calls(run_id, starts, sharded)
            calls.update(
                {
                    "health/" + name: partial(api.series, run_id, key, start=health_start)
                    for name, key in AGENT_HEALTH_KEYS.items()
                }
            )
            calls["events"] = lambda: api.events(run_id)
            calls["alerts"] = lambda: run_alerts(run_id)
            calls["incidents"] = lambda: run_incidents(run_id)
            fetched = background.fetch_all(calls)
            events, event_count = fetched["events"]
            skips = [event for event in events if event.get("kind") == "skip"]
            resumes = [event for event in events if event.get("kind") == "resume"]
            appended = None if starts is None else append_new_points(cursor, fetched, skips, resumes)
            if starts is not None and appended is None:
                fetched.update(background.fetch_all(series_calls(run_id, None, sharded)))
        except RunNotFound:
            header = error_banner(f"Run “{run_id}” no longer exists.")
            return {**UNCHANGED, "header": header, "stop_polling": True, "stop_polling_layers": True}
        except ApiError as exc:
            # Keep what is drawn and keep polling: the server may be restarting.
            header = error_banner(exc)
            return {**UNCHANGED, "header": header, "stop_polling": False, "stop_polling_layers": False}
        health = {name: _latest(fetched["health/" + name]) for name in AGENT_HEALTH_KEYS}
        alerts, alerts_error = fetched["alerts"]
        # The verdict and incidents sit in the header's slot: right below the header, above the charts.
        incidents, run_verdict, incidents_error = fetched["incidents"]
        updates = {
            "header": [
                run_header(run, health, ranks),
                verdict.verdict_banner(run_verdict, incidents, incidents_error),
                verdict.incidents_section(incidents, run_href),
            ],
            "timeline": events_table(events, event_count, alerts, alerts_error),
            "stop_polling": ended,
            "stop_polling_layers": ended,
        }
        if appended is not None:
            charts, scale_data, new_cursor = appended
            return {**updates, **charts, "scale_series": scale_data, "cursor": new_cursor}
        marker = figures.step_marker_shapes(selected_step)
        drawn = {name: fetched[name] for name in SERIES_KEYS}
        charts = _line_charts(drawn, skips, run_id, resumes)
        return {
            **updates,
            **{graph_id: keep_view(_with_shapes(figure, marker)) for graph_id, figure in charts.items()},
            "scale_series": _compact_series(fetched["scale"]),
            "cursor": {**live.full_cursor(run_id, charts, drawn, len(skips)), "resumes": len(resumes)},
        }

    def live_starts(cursor: dict[str, Any]) -> dict[str, int]:
        return live.fetch_starts(cursor, SERIES_KEYS, inclusive=SAFE_BAND_SERIES)

    def series_calls(
        run_id: str, starts: dict[str, int] | None, sharded: bool = False
    ) -> dict[str, Callable[[], Any]]:
        """The line charts' series: whole (downsampled by the server), or from `starts` on. With
        sharded gradients the global norms are the ranks' combined (rank 0 alone has its shard's)."""
        calls: dict[str, Callable[[], Any]] = {}
        for name, key in SERIES_KEYS.items():
            start = None if starts is None else starts[name]
            fetch = api.combined_series if sharded and name in COMBINED_WHEN_SHARDED else api.series
            calls[name] = partial(fetch, run_id, key, start=start)
        return calls

    def run_alerts(run_id: str) -> tuple[list[dict[str, Any]], ApiError | None]:
        # The run page still works against a server without the alerts API (or with it failing).
        try:
            return api.alerts(run_id=run_id, limit=EVENTS_TABLE_ROWS)[0], None
        except ApiError as exc:
            return [], exc

    def run_incidents(run_id: str) -> tuple[list[dict[str, Any]], str | None, ApiError | None]:
        # Likewise without the incidents API (a 404 from an older server): "verdict unavailable".
        try:
            return (*api.run_incidents(run_id), None)
        except ApiError as exc:
            return [], None, exc

    @app.callback(
        output={
            "heatmaps": [Output(graph_id, "figure") for graph_id in LAYER_HEATMAPS],
            "layer_options": Output("hist-layer", "options"),
            "layer": Output("hist-layer", "value"),
        },
        inputs=[Input("layers-refresh", "n_intervals")],
        state=[
            State("run-id", "data"),
            State("selected-step", "data"),
            State("hist-layer", "value"),
            State("hist-layer", "options"),
        ],
    )
    def refresh_layers(
        _n_intervals: int | None, run_id: str, selected_step: Any, layer: str | None, shown: Any
    ) -> dict[str, Any]:
        try:
            fetched = background.fetch_all(
                {graph_id: partial(api.vectors, run_id, spec[0]) for graph_id, spec in LAYER_HEATMAPS.items()}
            )
        except ApiError as exc:
            message = keep_view(figures.empty_figure("Per-layer data", str(exc), uirevision=run_id))
            heatmaps = [message] * len(LAYER_HEATMAPS)
            return {"heatmaps": heatmaps, "layer_options": dash.no_update, "layer": dash.no_update}
        marker = figures.step_marker_shapes(selected_step)
        heatmaps = []
        for graph_id, (_, title, label, log_scale, value_range) in LAYER_HEATMAPS.items():
            figure = figures.layer_heatmap_figure(
                fetched[graph_id],
                title,
                label,
                log_scale=log_scale,
                value_range=value_range,
                uirevision=run_id,
            )
            heatmaps.append(keep_view(_with_shapes(figure, marker)))
        layers = next((names for names in map(figures.layer_names_of, fetched.values()) if names), [])
        options = [{"label": name, "value": name} for name in layers]
        value = layer if layer in layers else (layers[0] if layers else None)
        # Unchanged picker: no update, so the histogram is not fetched again for nothing.
        return {
            "heatmaps": heatmaps,
            "layer_options": options if options != shown else dash.no_update,
            "layer": value if value != layer else dash.no_update,
        }

    @app.callback(
        output={
            "step_options": Output("hist-step", "options"),
            "step": Output("hist-step", "value"),
            "at_step": Output("hist-graph", "figure"),
            "over_steps": Output("hist-time-graph", "figure"),
        },
        inputs=[
            Input("hist-layer", "value"),
            Input("hist-step", "value"),
            Input("selected-step", "data"),
            Input("layers-refresh", "n_intervals"),
            Input("scale-series", "data"),
        ],
        state=[State("run-id", "data")],
    )
    def show_histogram(
        layer: str | None,
        step: Any,
        selected_step: Any,
        _n_intervals: int | None,
        scale_series: Any,
        run_id: str,
    ) -> dict[str, Any]:
        if not layer:
            return _no_histogram("no per-layer histograms recorded (yet)", run_id)
        try:
            histograms = api.histograms(run_id, layer)
            steps = figures.histogram_steps(histograms)
            if isinstance(selected_step, int) and (ctx.triggered_id == "selected-step" or step is None):
                step = _nearest_step(steps, selected_step)  # a clicked step, or ?step=N on arrival
            elif step not in steps:
                step = steps[-1] if steps else None
            # The exact scale at that step (the stored series may be downsampled).
            at_step = (
                api.series(run_id, SERIES_KEYS["scale"], start=step, end=step + 1)
                if step is not None
                else None
            )
        except ApiError as exc:
            return _no_histogram(str(exc), run_id)
        scale = _latest(at_step) if _latest(at_step) is not None else _value_at(scale_series, step)
        bar = figures.histogram_figure(histograms, step, scale, uirevision=f"{run_id}/{layer}")
        over_time = figures.histogram_time_figure(histograms, scale_series, uirevision=f"{run_id}/{layer}")
        over_time.update_layout(shapes=figures.step_marker_shapes(selected_step))
        # Both as updates that keep the user's zoom: a live run redraws them as the scale moves.
        return {
            "step_options": [{"label": f"step {value:,}", "value": value} for value in reversed(steps)],
            "step": step,
            "at_step": keep_view(bar),
            "over_steps": keep_view(over_time),
        }

    @app.callback(
        Output("selected-step", "data"),
        Output("hist-layer", "value", allow_duplicate=True),
        Input({"type": "event-step", "step": ALL, "row": ALL}, "n_clicks"),
        *(Input(graph_id, "clickData") for graph_id in LAYER_HEATMAPS),
        Input("hist-time-graph", "clickData"),
        prevent_initial_call=True,
    )
    def select_step(*_inputs: Any) -> tuple[Any, Any]:
        trigger = ctx.triggered_id
        value = ctx.triggered[0].get("value") if ctx.triggered else None
        if isinstance(trigger, dict) and trigger.get("type") == "event-step":
            # Re-drawn tables add buttons with no clicks: only a real click selects.
            return (trigger["step"], dash.no_update) if value else (dash.no_update, dash.no_update)
        point = (value or {}).get("points", [{}])[0] if isinstance(value, dict) else {}
        step = point.get("x")
        if not isinstance(step, int):
            return dash.no_update, dash.no_update
        if trigger in LAYER_HEATMAPS and isinstance(point.get("y"), str):
            return step, html_text.unescape(point["y"])  # heatmap labels are escaped names
        return step, dash.no_update

    @app.callback(
        *(Output(graph_id, "figure", allow_duplicate=True) for graph_id in STEP_GRAPHS),
        Input("selected-step", "data"),
        prevent_initial_call=True,
    )
    def mark_step(step: Any) -> tuple[dash.Patch, ...]:
        patches = []
        for _ in STEP_GRAPHS:
            patch = dash.Patch()
            patch["layout"]["shapes"] = figures.step_marker_shapes(step)
            patches.append(patch)
        return tuple(patches)


def append_new_points(
    cursor: dict[str, Any],
    fetched: dict[str, Any],
    skips: list[dict[str, Any]],
    resumes: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], Any, dict[str, Any]] | None:
    """(chart patches by graph id, scale-series patch, cursor) that append the new points; None when
    the charts must be redrawn in full (new skip markers, a resume -- it rewrote steps already drawn --,
    a downsampled slice, anything `live` refuses to append)."""
    new = {name: fetched[name] for name in SERIES_KEYS}
    if len(skips) != cursor.get("skips") or len(resumes or ()) != cursor.get("resumes", 0):
        return None
    if any(series.get("downsampled") for series in new.values()):
        return None
    new_points = _line_charts(new, [], cursor["run_id"])  # the same builders, on the new points only
    patches = {
        graph_id: live.append_patch(cursor["charts"][graph_id], figure)
        for graph_id, figure in new_points.items()
    }
    if any(patch is None for patch in patches.values()):
        return None
    scale_data: Any = dash.no_update
    if new["scale"].get("steps"):
        scale_data = dash.Patch()
        scale_data["steps"].extend(new["scale"]["steps"])
        scale_data["values"].extend(new["scale"]["values"])
    counted = [name for name in SERIES_KEYS if name not in SAFE_BAND_SERIES]
    return patches, scale_data, live.advance(cursor, new, counted)


def _no_histogram(message: str, run_id: str) -> dict[str, Any]:
    """show_histogram's result when there is no histogram to draw: `message` in both charts."""
    return {
        "step_options": [],
        "step": None,
        "at_step": figures.empty_figure("Gradient histogram", message, uirevision=run_id),
        "over_steps": figures.empty_figure("Gradient histogram over steps", message, uirevision=run_id),
    }


# -- layout and drawing (pure: data in, components and figures out) --------------------------------


def run_layout(
    run: dict[str, Any], layers: list[str] | None = None, selected_step: int | None = None
) -> html.Div:
    """The run page's layout; `layers` (model order) fill the histogram's layer picker up front, so
    the histogram loads alongside the heatmaps instead of after them. `selected_step` (from an
    alert's link, ?step=N) is marked on the charts from the start."""
    run_id = str(run.get("id"))
    layers = layers or []
    running = run.get("status") == "running"

    def graph(graph_id: str, title: str) -> html.Div:
        figure = figures.empty_figure(title, "loading…", uirevision=run_id)
        return html.Div(dcc.Graph(id=graph_id, figure=figure, config=GRAPH_CONFIG), className="card")

    return html.Div(
        [
            dcc.Store(id="run-id", data=run_id),
            dcc.Store(id="selected-step", data=selected_step),
            dcc.Store(id="scale-series", data=None),  # shared by the scale chart and the histograms
            dcc.Store(id="live-cursor", data=None),  # what the line charts show, for live appends
            html.Div(run_header(run, {}), id="run-header"),
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
                                options=[{"label": name, "value": name} for name in layers],
                                value=layers[0] if layers else None,
                                clearable=False,
                                className="layer-pick",
                            ),
                            html.Label("Step", htmlFor="hist-step"),
                            dcc.Dropdown(
                                id="hist-step", options=[], value=None, clearable=False, className="step-pick"
                            ),
                        ],
                        className="toolbar",
                    ),
                    html.Div(
                        [
                            dcc.Graph(
                                id="hist-graph",
                                figure=figures.empty_figure(
                                    "Gradient histogram", "loading…", uirevision=run_id
                                ),
                                config=GRAPH_CONFIG,
                            ),
                            dcc.Graph(
                                id="hist-time-graph",
                                figure=figures.empty_figure(
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


def _line_charts(
    series: dict[str, Any],
    skips: list[dict[str, Any]],
    run_id: str,
    resumes: list[dict[str, Any]] | None = None,
) -> dict[str, go.Figure]:
    """The LINE_CHARTS by graph id, from the SERIES_KEYS series (by name), skip events and resume
    events (a dotted line on every chart where the run continued from a checkpoint)."""
    charts = {
        "loss-graph": figures.loss_figure(series["loss"], uirevision=run_id),
        "scale-graph": figures.scale_figure(
            series["scale"], skips, (series["safe_min"], series["safe_max"]), uirevision=run_id
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


def _compact_series(series: Any) -> dict[str, Any] | None:
    """Just the steps and values of an API series, for a dcc.Store."""
    if not isinstance(series, dict):
        return None
    return {"steps": series.get("steps") or [], "values": series.get("values") or []}


def _latest(series: Any) -> Any:
    """The last value of an API series, or None."""
    values = series.get("values") if isinstance(series, dict) else None
    return values[-1] if isinstance(values, list) and values else None


def _value_at(series: Any, step: Any) -> Any:
    """The value of an API series at `step`, or the last one before it; None when there is none."""
    if not isinstance(series, dict) or not isinstance(step, int):
        return None
    found = None
    for at, value in zip(series.get("steps") or [], series.get("values") or [], strict=False):
        if isinstance(at, int) and at <= step:
            found = value
    return found


def _nearest_step(steps: list[int], step: int) -> int | None:
    """The step of `steps` closest to `step` (the earlier one on a tie)."""
    return min(steps, key=lambda candidate: (abs(candidate - step), candidate)) if steps else None
