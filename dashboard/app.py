"""The Dash app: a runs list, one page per run and a compare page, reading everything through ApiClient.

Pages (one dcc.Location, routed by a callback on its pathname), with the default prefix:
    /dashboard/                         runs list: search, sort, pages, health badges, pick runs to compare
    /dashboard/runs/{run_id}            run page: loss, loss scale with skipped steps and the fp16 safe
                                        band, grad norm, lr; per-layer heatmaps; a layer's histogram at a
                                        step and over steps; events; config and metadata; agent health
    /dashboard/compare?runs=id1,id2     one scalar key of several runs overlaid by step

Callbacks stay thin: fetch with the ApiClient, draw with `figures`, lay out with the view helpers
below. User-supplied names are only ever passed as component children, which Dash renders as text
(and escaped before they reach plotly, which would otherwise read tags in them).
"""

from __future__ import annotations

import html as html_text
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote

import dash
import httpx
import plotly.graph_objects as go
from dash import ALL, Input, Output, State, ctx, dcc, html

from . import figures
from .api_client import ApiClient, ApiError, ApiUnavailable, RunNotFound

__all__ = ["create_dash_app", "keep_view", "parse_route", "parse_run_ids"]

RUN_REFRESH_MS = 2000
LAYERS_REFRESH_MS = 10_000  # heatmaps and histograms of a live run: heavier, and they change slowly
RUNS_LIST_REFRESH_MS = 5000
RUNS_PAGE_SIZE = 25
RUNS_SEARCH_LIMIT = 500  # with a search or a sort the API cannot do, the newest this many are searched
SILENT_AFTER_S = 300  # a "running" run with nothing new for this long is shown as silent
EVENTS_TABLE_ROWS = 100
HEALTH_WINDOW_STEPS = 1000
MAX_COMPARE_RUNS = 8
SERIES_KEYS = {
    "loss": "loss",
    "scale": "amp/scale",
    "safe_min": "amp/safe_scale_min",
    "safe_max": "amp/safe_scale_max",
    "grad_norm": "grad/global_norm",
    "grad_norm_post_clip": "grad/global_norm_post_clip",
    "lr": "lr",
}
AGENT_HEALTH_KEYS = {
    "queued": "agent/queued",
    "sent": "agent/sent",
    "spooled": "agent/spooled",
    "dropped": "agent/dropped",
}
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
STEP_GRAPHS = ("loss-graph", "scale-graph", "grad-norm-graph", "lr-graph", *LAYER_HEATMAPS, "hist-time-graph")
RUNS_SORTS = {
    "newest": "Newest first",
    "oldest": "Oldest first",
    "name": "Name",
    "last_step": "Last step",
    "skips": "Most skips",
}
GRAPH_CONFIG = {"displaylogo": False, "responsive": True}
ASSETS_FOLDER = Path(__file__).parent / "assets"
_AXIS_KEY = re.compile(r"^[xy]axis\d*$")
_LIST_LAYOUT_KEYS = ("annotations", "shapes")


def create_dash_app(
    api_base_url: str,
    requests_pathname_prefix: str = "/dashboard/",
    *,
    token: str | None = None,
    http_client: httpx.Client | None = None,
) -> dash.Dash:
    """The dashboard as a Dash app whose Flask server (`app.server`) routes relative to "/".

    api_base_url: root of the gradwatch server whose /api/v1 the dashboard reads, e.g.
        "http://127.0.0.1:8765".
    requests_pathname_prefix: the URL path the app is mounted under, with leading and trailing "/";
        the browser requests pages and assets below it (mount the WSGI app there, e.g. with
        a2wsgi.WSGIMiddleware(app.server) at "/dashboard").
    token: a read-scope API token, sent as a Bearer token; None when the server needs none.
    http_client: an httpx.Client for API calls (tests pass one with a MockTransport); the caller owns it.
    """
    if not requests_pathname_prefix.startswith("/") or not requests_pathname_prefix.endswith("/"):
        raise ValueError(
            f"requests_pathname_prefix must start and end with '/', got {requests_pathname_prefix!r}"
        )
    api = ApiClient(api_base_url, token=token, client=http_client)
    app = dash.Dash(
        __name__,
        requests_pathname_prefix=requests_pathname_prefix,
        routes_pathname_prefix="/",
        title="gradwatch",
        update_title=None,  # no "Updating..." flicker in the tab title on every refresh
        serve_locally=True,
        suppress_callback_exceptions=True,
        assets_folder=str(ASSETS_FOLDER),
    )
    app.layout = _shell(app)
    _register_callbacks(app, api, requests_pathname_prefix)
    return app


def parse_route(pathname: str | None, prefix: str = "/dashboard/") -> tuple[str, str | None]:
    """("runs", None) for the runs list, ("run", run_id) for a run page, ("compare", None) for the
    compare page, ("unknown", path) otherwise."""
    path = pathname or prefix
    root = prefix.rstrip("/")
    if path == root or path.startswith(root + "/"):
        path = path[len(root) :]
    parts = [part for part in path.split("/") if part]
    if not parts:
        return "runs", None
    if len(parts) == 2 and parts[0] == "runs":
        return "run", unquote(parts[1])
    if parts == ["compare"]:
        return "compare", None
    return "unknown", path


def parse_run_ids(search: str | None) -> list[str]:
    """The run ids of a compare page's query string ("?runs=a,b"), in order, without repeats."""
    values = parse_qs((search or "").lstrip("?")).get("runs", [])
    ids = [run_id.strip() for value in values for run_id in value.split(",")]
    return list(dict.fromkeys(run_id for run_id in ids if run_id))


def compare_href(app: dash.Dash, run_ids: list[str]) -> str:
    """The compare page's URL for these runs."""
    return (
        app.get_relative_path("/compare") + "?runs=" + ",".join(quote(run_id, safe="") for run_id in run_ids)
    )


# -- callbacks -------------------------------------------------------------------------------------


def _register_callbacks(app: dash.Dash, api: ApiClient, prefix: str) -> None:
    # Independent API calls of one callback go out together: one page load waits for the slowest.
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gradwatch-dashboard")

    def fetch_all(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}

    def run_href(run_id: str) -> str:
        return app.get_relative_path(f"/runs/{quote(run_id, safe='')}")

    @app.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"))
    def render_page(pathname: str | None, search: str | None) -> Any:
        page, run_id = parse_route(pathname, prefix)
        if page == "runs":
            return _runs_page()
        if page == "compare":
            return _compare_page_for(parse_run_ids(search))
        if page == "run" and run_id:
            try:
                run = api.get_run(run_id)
            except RunNotFound:
                return _not_found_page(app, "Run not found", f"There is no run with id “{run_id}”.")
            except ApiError as exc:
                return _api_error_page(app, exc)
            try:
                layers = figures.layer_names_of(
                    api.vectors(run_id, LAYER_HEATMAPS["grad-norm-heatmap"][0], max_steps=1, end=0)
                )
            except ApiError:
                layers = []  # the layers refresh fills the picker later
            return _run_page(run, layers)
        return _not_found_page(app, "Page not found", f"There is no dashboard page at “{pathname}”.")

    # -- runs list ---------------------------------------------------------------------------------

    @app.callback(
        Output("runs-table", "children"),
        Output("runs-pager", "children"),
        Output("runs-total", "data"),
        Input("runs-refresh", "n_intervals"),
        Input("runs-search", "value"),
        Input("runs-sort", "value"),
        Input("runs-page", "data"),
        State("selected-runs", "data"),
    )
    def refresh_runs(
        _n_intervals: int | None, search: str | None, sort: str | None, page: int | None, selected: Any
    ) -> tuple[Any, ...]:
        search = (search or "").strip().lower()
        sort = sort if sort in RUNS_SORTS else "newest"
        page = page if isinstance(page, int) and page >= 0 else 0
        try:
            if not search and sort == "newest":  # the API's own order: page on the server
                runs, count = api.list_runs(limit=RUNS_PAGE_SIZE, offset=page * RUNS_PAGE_SIZE)
                matching, searched_all = count, True
            else:
                fetched, count = api.list_runs(limit=RUNS_SEARCH_LIMIT)
                found = _sort_runs(_filter_runs(fetched, search), sort)
                matching, searched_all = len(found), count <= len(fetched)
                runs = found[page * RUNS_PAGE_SIZE : (page + 1) * RUNS_PAGE_SIZE]
        except ApiError as exc:
            return _error_banner(exc), None, 0
        chosen = set(selected or [])
        pager = _pager_text(page, len(runs), matching, count, searched_all)
        return _runs_table(runs, run_href, chosen, searching=bool(search)), pager, matching

    @app.callback(
        Output("runs-page", "data"),
        Input("runs-prev", "n_clicks"),
        Input("runs-next", "n_clicks"),
        Input("runs-search", "value"),
        Input("runs-sort", "value"),
        State("runs-page", "data"),
        State("runs-total", "data"),
        prevent_initial_call=True,
    )
    def turn_page(
        _prev: Any, _next: Any, _search: Any, _sort: Any, page: int | None, total: int | None
    ) -> int:
        page = page or 0
        last_page = max(0, ((total or 0) - 1) // RUNS_PAGE_SIZE)
        if ctx.triggered_id == "runs-prev":
            return max(0, page - 1)
        if ctx.triggered_id == "runs-next":
            return min(last_page, page + 1)
        return 0  # a new search or sort starts on the first page

    @app.callback(
        Output("selected-runs", "data"),
        Output("compare-bar", "children"),
        Input({"type": "run-select", "run": ALL}, "value"),
        State({"type": "run-select", "run": ALL}, "id"),
        State("selected-runs", "data"),
    )
    def select_runs(values: list[Any], ids: list[dict[str, str]], selected: Any) -> tuple[Any, ...]:
        # Runs on other pages (or hidden by the search) stay selected; those shown take their box.
        shown = {component_id["run"] for component_id in ids}
        checked = [component_id["run"] for component_id, value in zip(ids, values) if value]
        kept = [run_id for run_id in (selected or []) if run_id not in shown]
        chosen = list(dict.fromkeys(kept + checked))[:MAX_COMPARE_RUNS]
        return chosen, _compare_bar(app, chosen)

    # -- run page ----------------------------------------------------------------------------------

    @app.callback(
        Output("run-header", "children"),
        Output("loss-graph", "figure"),
        Output("scale-graph", "figure"),
        Output("grad-norm-graph", "figure"),
        Output("lr-graph", "figure"),
        Output("events-table", "children"),
        Output("refresh", "disabled"),
        Output("layers-refresh", "disabled"),
        Output("scale-series", "data"),
        Input("refresh", "n_intervals"),
        State("run-id", "data"),
        State("selected-step", "data"),
    )
    def refresh_run(_n_intervals: int | None, run_id: str, selected_step: Any) -> tuple[Any, ...]:
        try:
            run = api.get_run(run_id)
            last_step = run.get("last_step") if isinstance(run.get("last_step"), int) else 0
            health_start = max(0, last_step - HEALTH_WINDOW_STEPS)
            calls: dict[str, Callable[[], Any]] = {
                name: (lambda key=key: api.series(run_id, key)) for name, key in SERIES_KEYS.items()
            }
            calls.update(
                {
                    "health/" + name: (lambda key=key: api.series(run_id, key, start=health_start))
                    for name, key in AGENT_HEALTH_KEYS.items()
                }
            )
            calls["events"] = lambda: api.events(run_id)
            fetched = fetch_all(calls)
        except RunNotFound:
            header = _error_banner(f"Run “{run_id}” no longer exists.")
            return (header, *[dash.no_update] * 5, True, True, dash.no_update)
        except ApiError as exc:
            # Keep what is drawn and keep polling: the server may be restarting.
            return (_error_banner(exc), *[dash.no_update] * 5, False, False, dash.no_update)
        events, event_count = fetched["events"]
        skips = [event for event in events if event.get("kind") == "skip"]
        health = {name: _latest(fetched["health/" + name]) for name in AGENT_HEALTH_KEYS}
        marker = figures.step_marker_shapes(selected_step)
        loss = figures.loss_figure(fetched["loss"], uirevision=run_id)
        scale = figures.scale_figure(
            fetched["scale"], skips, (fetched["safe_min"], fetched["safe_max"]), uirevision=run_id
        )
        grad_norm = figures.grad_norm_figure(
            fetched["grad_norm"], fetched["grad_norm_post_clip"], uirevision=run_id
        )
        lr = figures.lr_figure(fetched["lr"], uirevision=run_id)
        ended = run.get("status") != "running"
        return (
            _run_header(run, health),
            *(keep_view(_with_shapes(figure, marker)) for figure in (loss, scale, grad_norm, lr)),
            _events_table(events, event_count),
            ended,
            ended,
            _compact_series(fetched["scale"]),
        )

    @app.callback(
        *(Output(graph_id, "figure") for graph_id in LAYER_HEATMAPS),
        Output("hist-layer", "options"),
        Output("hist-layer", "value"),
        Input("layers-refresh", "n_intervals"),
        State("run-id", "data"),
        State("selected-step", "data"),
        State("hist-layer", "value"),
        State("hist-layer", "options"),
    )
    def refresh_layers(
        _n_intervals: int | None, run_id: str, selected_step: Any, layer: str | None, shown: Any
    ) -> tuple[Any, ...]:
        try:
            fetched = fetch_all(
                {
                    graph_id: (lambda key=spec[0]: api.vectors(run_id, key))
                    for graph_id, spec in LAYER_HEATMAPS.items()
                }
            )
        except ApiError as exc:
            message = figures.empty_figure("Per-layer data", str(exc), uirevision=run_id)
            return (*[keep_view(message)] * len(LAYER_HEATMAPS), dash.no_update, dash.no_update)
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
        return (
            *heatmaps,
            options if options != shown else dash.no_update,
            value if value != layer else dash.no_update,
        )

    @app.callback(
        Output("hist-step", "options"),
        Output("hist-step", "value"),
        Output("hist-graph", "figure"),
        Output("hist-time-graph", "figure"),
        Input("hist-layer", "value"),
        Input("hist-step", "value"),
        Input("selected-step", "data"),
        Input("layers-refresh", "n_intervals"),
        Input("scale-series", "data"),
        State("run-id", "data"),
    )
    def show_histogram(
        layer: str | None,
        step: Any,
        selected_step: Any,
        _n_intervals: int | None,
        scale_series: Any,
        run_id: str,
    ) -> tuple[Any, ...]:
        if not layer:
            message = "no per-layer histograms recorded (yet)"
            return (
                [],
                None,
                figures.empty_figure("Gradient histogram", message, uirevision=run_id),
                figures.empty_figure("Gradient histogram over steps", message, uirevision=run_id),
            )
        try:
            histograms = api.histograms(run_id, layer)
            steps = figures.histogram_steps(histograms)
            if ctx.triggered_id == "selected-step" and isinstance(selected_step, int):
                step = _nearest_step(steps, selected_step)
            elif step not in steps:
                step = steps[-1] if steps else None
            # The exact scale at that step (the stored series may be downsampled).
            at_step = (
                api.series(run_id, SERIES_KEYS["scale"], start=step, end=step + 1)
                if step is not None
                else None
            )
        except ApiError as exc:
            return (
                [],
                None,
                figures.empty_figure("Gradient histogram", str(exc), uirevision=run_id),
                figures.empty_figure("Gradient histogram over steps", str(exc), uirevision=run_id),
            )
        scale = _latest(at_step) if _latest(at_step) is not None else _value_at(scale_series, step)
        bar = figures.histogram_figure(histograms, step, scale, uirevision=f"{run_id}/{layer}")
        over_time = figures.histogram_time_figure(histograms, scale_series, uirevision=f"{run_id}/{layer}")
        over_time.update_layout(shapes=figures.step_marker_shapes(selected_step))
        options = [{"label": f"step {value:,}", "value": value} for value in reversed(steps)]
        # Both as updates that keep the user's zoom: a live run redraws them as the scale moves.
        return options, step, keep_view(bar), keep_view(over_time)

    @app.callback(
        Output("selected-step", "data"),
        Output("hist-layer", "value", allow_duplicate=True),
        Input({"type": "event-step", "step": ALL}, "n_clicks"),
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

    # -- compare page ------------------------------------------------------------------------------

    @app.callback(
        Output("compare-runs", "children"),
        Output("compare-key", "options"),
        Output("compare-key", "value"),
        Input("compare-ids", "data"),
        State("compare-key", "value"),
    )
    def load_compare(run_ids: list[str], key: str | None) -> tuple[Any, ...]:
        runs: list[dict[str, Any]] = []
        missing: list[str] = []
        keys: set[str] = set()
        for run_id in run_ids or []:
            try:
                runs.append(api.get_run(run_id))
                keys.update(api.keys(run_id))
            except RunNotFound:
                missing.append(run_id)
            except ApiError as exc:
                return _error_banner(exc), [], None
        options = sorted(keys)
        if key not in keys:
            key = "loss" if "loss" in keys else (options[0] if options else None)
        return _compare_run_list(runs, missing, run_href), options, key

    @app.callback(
        Output("compare-graph", "figure"),
        Input("compare-key", "value"),
        Input("compare-log", "value"),
        State("compare-ids", "data"),
    )
    def draw_compare(key: str | None, log_options: list[str] | None, run_ids: list[str]) -> Any:
        if not key:
            return figures.empty_figure("Compare", "pick runs with a common series")
        try:
            labelled = []
            for run_id in run_ids or []:
                try:
                    run = api.get_run(run_id)
                except RunNotFound:
                    continue
                labelled.append((str(run.get("name") or run_id), api.series(run_id, key)))
        except ApiError as exc:
            return figures.empty_figure("Compare", str(exc))
        figure = figures.compare_figure(
            labelled, key, log_y="log" in (log_options or []), uirevision=",".join(run_ids or [])
        )
        return keep_view(figure)


def keep_view(figure: go.Figure) -> dash.Patch:
    """`figure` as an update that replaces traces and layout but keeps the axis ranges on screen.

    dcc.Graph (Dash 4) writes every zoom and pan into its own `figure` prop, so sending a whole new
    figure would count as the app resetting the ranges, and `uirevision` alone could not keep the
    user's view on refresh. Ranges of fixed axes (the hidden marker axis) are the figure's own and
    are sent. `uirevision` still keeps legend clicks.
    """
    spec = figure.to_plotly_json()
    layout = spec.get("layout", {})
    patch = dash.Patch()
    patch["data"] = spec.get("data", [])
    for key in _LIST_LAYOUT_KEYS:  # left out of the JSON when empty, but must replace "no data yet"
        patch["layout"][key] = layout.get(key, [])
    for key, value in layout.items():
        if _AXIS_KEY.match(key) and isinstance(value, dict) and not value.get("fixedrange"):
            for axis_key, axis_value in value.items():
                if axis_key not in ("range", "autorange"):
                    patch["layout"][key][axis_key] = axis_value
        else:
            patch["layout"][key] = value
    return patch


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
    for at, value in zip(series.get("steps") or [], series.get("values") or []):
        if isinstance(at, int) and at <= step:
            found = value
    return found


def _nearest_step(steps: list[int], step: int) -> int | None:
    """The step of `steps` closest to `step` (the earlier one on a tie)."""
    return min(steps, key=lambda candidate: (abs(candidate - step), candidate)) if steps else None


# -- views (pure: data in, components out) -----------------------------------------------------------


def _shell(app: dash.Dash) -> html.Div:
    return html.Div(
        [
            dcc.Location(id="url", refresh=False),
            # Kept across pages, so picking runs to compare survives paging and searching.
            dcc.Store(id="selected-runs", data=[]),
            html.Header(
                [
                    dcc.Link("gradwatch", href=app.get_relative_path("/"), className="brand"),
                    html.Span("training health", className="tagline"),
                ],
                className="topbar",
            ),
            html.Main(id="page", className="page"),
        ],
        className="app",
    )


def _runs_page() -> html.Div:
    return html.Div(
        [
            html.H1("Runs"),
            html.Div(
                [
                    dcc.Input(
                        id="runs-search",
                        type="search",
                        placeholder="Search name or project…",
                        debounce=0.3,
                        className="search",
                    ),
                    dcc.Dropdown(
                        id="runs-sort",
                        options=[{"label": label, "value": value} for value, label in RUNS_SORTS.items()],
                        value="newest",
                        clearable=False,
                        searchable=False,
                        className="sort",
                    ),
                    html.Div(_compare_bar(None, []), id="compare-bar", className="compare-bar"),
                ],
                className="toolbar",
            ),
            html.Div(html.P("Loading runs…", className="muted"), id="runs-table", className="card"),
            html.Div(
                [
                    html.Button("← Newer", id="runs-prev", className="button"),
                    html.Span(id="runs-pager", className="muted"),
                    html.Button("Older →", id="runs-next", className="button"),
                ],
                className="pager",
            ),
            dcc.Store(id="runs-page", data=0),
            dcc.Store(id="runs-total", data=0),
            dcc.Interval(id="runs-refresh", interval=RUNS_LIST_REFRESH_MS),
        ]
    )


def _filter_runs(runs: list[dict[str, Any]], search: str) -> list[dict[str, Any]]:
    """Runs whose name, project or id contains `search` (already lower-cased)."""
    if not search:
        return runs
    return [
        run
        for run in runs
        if any(search in str(run.get(field) or "").lower() for field in ("name", "project", "id"))
    ]


def _sort_runs(runs: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    if sort == "oldest":
        return list(reversed(runs))  # the API sends newest first
    if sort == "name":
        return sorted(runs, key=lambda run: str(run.get("name") or "").lower())
    if sort == "last_step":
        return sorted(runs, key=lambda run: run.get("last_step") or 0, reverse=True)
    if sort == "skips":
        return sorted(runs, key=lambda run: (run.get("summary") or {}).get("skips") or 0, reverse=True)
    return runs


def _pager_text(page: int, shown: int, matching: int, total: int, searched_all: bool) -> str:
    if not shown:
        return "No matching runs." if matching == 0 and total else ""
    first = page * RUNS_PAGE_SIZE + 1
    text = f"{first}–{first + shown - 1} of {matching} runs"
    if not searched_all:
        text += f" (searching the newest {RUNS_SEARCH_LIMIT} of {total})"
    return text


def _compare_bar(app: dash.Dash | None, chosen: list[str]) -> list[Any]:
    if len(chosen) < 2:
        return [html.Span("Tick two or more runs to compare them.", className="muted")]
    href = compare_href(app, chosen) if app is not None else "#"
    return [
        dcc.Link(f"Compare {len(chosen)} runs →", href=href, id="compare-link", className="button primary")
    ]


def _runs_table(
    runs: list[dict[str, Any]], run_href: Any, chosen: set[str] | None = None, *, searching: bool = False
) -> Any:
    if not runs:
        if searching:
            return html.P("No runs match the search.", className="muted")
        return html.P(
            "No runs yet. Start one with gradwatch.init(project=…) in a training script.", className="muted"
        )
    chosen = chosen or set()
    header = html.Thead(
        html.Tr(
            [html.Th("", className="pick")]
            + [
                html.Th(label)
                for label in ("Project", "Name", "Status", "Last step", "Scale", "Skips", "Created")
            ]
        )
    )
    rows = []
    for run in runs:
        run_id = str(run.get("id"))
        summary = run.get("summary") or {}
        skips = summary.get("skips") or 0
        rows.append(
            html.Tr(
                [
                    html.Td(
                        dcc.Checklist(
                            id={"type": "run-select", "run": run_id},
                            options=[{"label": "", "value": run_id}],
                            value=[run_id] if run_id in chosen else [],
                            className="pick-box",
                        ),
                        className="pick",
                    ),
                    html.Td(str(run.get("project", ""))),
                    html.Td(dcc.Link(str(run.get("name") or run_id), href=run_href(run_id))),
                    html.Td(_status_badge(run_status(run))),
                    html.Td(_format_step(run.get("last_step")), className="num"),
                    html.Td(_scale_text(summary.get("scale")), className="num"),
                    html.Td(
                        html.Span(str(skips), className="badge badge-bad" if skips else "badge badge-ok")
                    ),
                    html.Td(_format_time(run.get("created_at")), className="muted"),
                ]
            )
        )
    return html.Table([header, html.Tbody(rows)], className="table")


def run_status(run: dict[str, Any], now: datetime | None = None) -> str:
    """The run's status for people: the API's, or "silent" for a running run quiet for SILENT_AFTER_S."""
    status = str(run.get("status") or "unknown")
    if status != "running" or not isinstance(run.get("updated_at"), str):
        return status
    try:
        updated = datetime.fromisoformat(run["updated_at"])
    except ValueError:
        return status
    if updated.tzinfo is None:
        updated = updated.replace(tzinfo=timezone.utc)
    quiet_s = ((now or datetime.now(timezone.utc)) - updated).total_seconds()
    return "silent" if quiet_s > SILENT_AFTER_S else status


def _run_page(run: dict[str, Any], layers: list[str] | None = None) -> html.Div:
    """The run page's layout; `layers` (model order) fill the histogram's layer picker up front, so
    the histogram loads alongside the heatmaps instead of after them."""
    run_id = str(run.get("id"))
    layers = layers or []
    running = run.get("status") == "running"

    def graph(graph_id: str, title: str) -> html.Div:
        figure = figures.empty_figure(title, "loading…", uirevision=run_id)
        return html.Div(dcc.Graph(id=graph_id, figure=figure, config=GRAPH_CONFIG), className="card")

    return html.Div(
        [
            dcc.Store(id="run-id", data=run_id),
            dcc.Store(id="selected-step", data=None),
            dcc.Store(id="scale-series", data=None),  # shared by the scale chart and the histograms
            html.Div(_run_header(run, {}), id="run-header"),
            _run_details(run),
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
                    html.H2("Events"),
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


def _run_header(run: dict[str, Any], health: dict[str, Any]) -> html.Div:
    summary = run.get("summary") or {}
    facts = [
        ("project", str(run.get("project", ""))),
        ("last step", _format_step(run.get("last_step"))),
        ("scale", _scale_text(summary.get("scale"))),
        ("skipped steps", str(summary.get("skips") or 0)),
        ("created", _format_time(run.get("created_at"))),
    ]
    children: list[Any] = [
        html.Div(
            [
                html.H1(str(run.get("name") or run.get("id")), className="run-name"),
                _status_badge(run_status(run)),
            ],
            className="run-title",
        ),
        html.Dl(
            [html.Div([html.Dt(label), html.Dd(value)], className="fact") for label, value in facts],
            className="facts",
        ),
    ]
    if any(value is not None for value in health.values()):
        children.append(_agent_health(health))
    return html.Div(children, className="run-header")


def _agent_health(health: dict[str, Any]) -> html.Div:
    """The agent's latest queue counters; dropped or spooled records are flagged."""
    items = []
    for name in AGENT_HEALTH_KEYS:
        value = figures.finite_or_none(health.get(name))
        text = "–" if value is None else f"{value:,.0f}"
        bad = name in ("dropped", "spooled") and value
        items.append(
            html.Span([html.Span(name, className="label"), html.Span(text, className="bad" if bad else None)])
        )
    return html.Div(
        [html.Span("agent", className="health-title"), *items], className="agent-health", id="agent-health"
    )


def _run_details(run: dict[str, Any]) -> html.Details:
    """Config and metadata as indented JSON text, folded away by default."""
    config = run.get("config") or {}
    metadata = run.get("metadata") or {}
    return html.Details(
        [
            html.Summary(f"Config ({len(config)} keys) and metadata ({len(metadata)} keys)"),
            html.Div(
                [
                    html.Div([html.H2("Config"), html.Pre(_pretty_json(config))], className="details-col"),
                    html.Div(
                        [html.H2("Metadata"), html.Pre(_pretty_json(metadata))], className="details-col"
                    ),
                ],
                className="details-grid",
            ),
        ],
        className="card run-details",
        id="run-details",
    )


def _pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str) if value else "–"


def _events_table(events: list[dict[str, Any]], count: int) -> Any:
    if not events:
        return html.P("No events: no skipped steps, no warnings.", className="muted")
    latest = list(reversed(events))[:EVENTS_TABLE_ROWS]
    rows = []
    for event in latest:
        step = event.get("step")
        kind = str(event.get("kind", ""))
        data = event.get("data") if isinstance(event.get("data"), dict) else {}
        step_cell: Any = _format_step(step)
        if isinstance(step, int):
            step_cell = html.Button(
                _format_step(step), id={"type": "event-step", "step": step}, className="step-link", n_clicks=0
            )
        rows.append(
            html.Tr(
                [
                    html.Td(step_cell, className="num"),
                    html.Td(
                        html.Span(kind, className="badge badge-bad" if kind == "skip" else "badge badge-warn")
                    ),
                    html.Td(_event_details(kind, data), className="layers"),
                    html.Td(str(data.get("hint") or ""), className="hint-cell"),
                ]
            )
        )
    header = html.Thead(html.Tr([html.Th("Step"), html.Th("Kind"), html.Th("Details"), html.Th("Hint")]))
    children: list[Any] = [html.Table([header, html.Tbody(rows)], className="table events")]
    if count > len(latest):
        children.append(html.P(f"Showing the latest {len(latest)} of {count} events.", className="muted"))
    return children


def _event_details(kind: str, data: dict[str, Any]) -> Any:
    """One line about an event: scale change and non-finite layers for a skip, key=value otherwise."""
    if kind == "skip":
        layers = figures.layer_names(data.get("non_finite_layers"))
        layer_count = data.get("non_finite_layer_count", len(layers))
        text = (
            f"scale {figures.format_scale(data.get('scale_before'))} → "
            f"{figures.format_scale(data.get('scale_after'))}"
        )
        if layers:
            text += f"; non-finite in {layer_count} layers: {figures.summarize_layers(layers)}"
        return html.Span(text, title="\n".join(layers[:50]) if layers else None)
    parts = []
    for key, value in data.items():
        if key == "hint":
            continue
        shown = figures.format_scale(value) if "scale" in key else value
        if isinstance(shown, list):
            shown = figures.summarize_layers([str(item) for item in shown])
        parts.append(f"{key}={shown}")
    text = ", ".join(str(part) for part in parts)
    return text if len(text) <= 200 else text[:199] + "…"


def _compare_page_for(run_ids: list[str]) -> html.Div:
    return html.Div(
        [
            html.H1("Compare runs"),
            dcc.Store(id="compare-ids", data=run_ids[:MAX_COMPARE_RUNS]),
            html.Div(id="compare-runs", className="compare-runs"),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Series", htmlFor="compare-key"),
                            dcc.Dropdown(
                                id="compare-key",
                                options=[],
                                value=None,
                                clearable=False,
                                className="layer-pick",
                            ),
                            dcc.Checklist(
                                id="compare-log",
                                options=[{"label": " log y", "value": "log"}],
                                value=[],
                                inline=True,
                                className="log-toggle",
                            ),
                        ],
                        className="toolbar",
                    ),
                    dcc.Graph(
                        id="compare-graph",
                        figure=figures.empty_figure("Compare", "loading…"),
                        config=GRAPH_CONFIG,
                    ),
                ],
                className="card",
            ),
        ]
    )


def _compare_run_list(runs: list[dict[str, Any]], missing: list[str], run_href: Any) -> list[Any]:
    items: list[Any] = []
    for index, run in enumerate(runs):
        color = figures.COMPARE_COLORS[index % len(figures.COMPARE_COLORS)]
        items.append(
            html.Span(
                [
                    html.Span(className="swatch", style={"background": color}),
                    dcc.Link(str(run.get("name") or run.get("id")), href=run_href(str(run.get("id")))),
                    html.Span(
                        f" {run.get('project', '')} · step {_format_step(run.get('last_step'))}",
                        className="muted",
                    ),
                ],
                className="compare-run",
            )
        )
    if not runs:
        items.append(html.P("No runs to compare: pick some on the runs list.", className="muted"))
    if missing:
        items.append(html.P("Not found: " + ", ".join(missing), className="bad"))
    return items


def _not_found_page(app: dash.Dash, title: str, message: str) -> html.Div:
    return html.Div(
        [
            html.H1(title),
            html.P(message),
            dcc.Link("← All runs", href=app.get_relative_path("/")),
        ],
        className="card not-found",
    )


def _api_error_page(app: dash.Dash, error: ApiError) -> html.Div:
    return html.Div([_error_banner(error), dcc.Link("← All runs", href=app.get_relative_path("/"))])


def _error_banner(error: ApiError | str) -> html.Div:
    if isinstance(error, ApiUnavailable):
        text = f"Cannot reach the gradwatch API; retrying. ({error})"
    else:
        text = str(error)
    return html.Div(text, className="banner banner-error", role="alert")


def _status_badge(status: Any) -> html.Span:
    status = str(status or "unknown")
    kind = {
        "running": "badge-live",
        "finished": "badge-ok",
        "crashed": "badge-bad",
        "silent": "badge-warn",
    }.get(status, "")
    return html.Span(status, className=f"badge {kind}".strip())


def _scale_text(scale: Any) -> Any:
    text = figures.format_scale(scale)
    if isinstance(scale, str):  # "NaN" / "Infinity": the scale itself has gone non-finite
        return html.Span(text, className="bad")
    return text


def _format_step(step: Any) -> str:
    return f"{step:,}" if isinstance(step, int) and not isinstance(step, bool) else "–"


def _format_time(iso: Any) -> str:
    if not isinstance(iso, str):
        return "–"
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M UTC")
