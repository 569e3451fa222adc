"""The Dash app: a runs list, one page per run and a compare page, reading everything through ApiClient.

Pages (one dcc.Location, routed by a callback on its pathname), with the default prefix:
    /dashboard/                         runs list: search, sort, pages, health badges (status, open
                                        alerts, scale, skips), pick runs to compare
    /dashboard/runs/{run_id}[?step=N]   run page: loss, loss scale with skipped steps and the fp16 safe
                                        band, grad norm, lr; per-layer heatmaps; a layer's histogram at a
                                        step and over steps; events and alerts; config and metadata;
                                        agent health; first of all the verdict (healthy, warning,
                                        critical) and its incidents (see `verdict`). ?step=N (alert
                                        links) marks step N from the start
    /dashboard/compare?runs=id1,id2     one scalar key of several runs overlaid by step
    /dashboard/alerts                   alerts, rules and webhooks (see `alerts_page`)

A live run page polls every RUN_REFRESH_MS for the points after the last step shown and appends them
to the charts (see `live`), redrawing in full only when appending could not draw the same.

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
import flask
import httpx
import plotly.graph_objects as go
from dash import ALL, Input, Output, State, ctx, dcc, html

from . import alerts_page, figures, live, signin, verdict
from .api_client import ApiClient, ApiError, RunNotFound
from .views import (
    alert_state,
    error_banner,
    format_step,
    format_time,
    scale_text,
    status_badge,
    summarize_fields,
)

__all__ = ["create_dash_app", "keep_view", "parse_route", "parse_run_ids", "parse_step"]

RUN_REFRESH_MS = 2000
LAYERS_REFRESH_MS = 10_000  # heatmaps and histograms of a live run: heavier, and they change slowly
RUNS_LIST_REFRESH_MS = 5000
RUNS_PAGE_SIZE = 25
RUNS_SEARCH_LIMIT = 500  # with a search or a sort the API cannot do, the newest this many are searched
SILENT_AFTER_S = 300  # a "running" run with nothing new for this long is shown as silent
EVENTS_TABLE_ROWS = 100
HEALTH_WINDOW_STEPS = 1000
MAX_COMPARE_RUNS = 8
MAX_OPEN_ALERTS = 1000  # open alerts read for the runs list's badges (the API's largest page)
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
RUN_STATUSES = ("running", "finished", "crashed")  # what GET /api/v1/runs?status= filters by
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
    token: an API token, sent as a Bearer token; None when the server needs none. A read-scope token
        shows everything; the Alerts page's changes (rules, acknowledging, webhooks) need admin scope,
        and what the server refuses is shown next to the form.
    http_client: an httpx.Client for API calls (tests pass one with a MockTransport); the caller owns it.
    """
    if not requests_pathname_prefix.startswith("/") or not requests_pathname_prefix.endswith("/"):
        raise ValueError(
            f"requests_pathname_prefix must start and end with '/', got {requests_pathname_prefix!r}"
        )
    # Each API call carries the token of the person asking (their session cookie), else `token`.
    api = ApiClient(api_base_url, token=token, token_provider=signin.token_from_request, client=http_client)
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
    signin.register_routes(app.server, api, requests_pathname_prefix)
    _register_callbacks(app, api, requests_pathname_prefix)
    return app


def parse_route(pathname: str | None, prefix: str = "/dashboard/") -> tuple[str, str | None]:
    """("runs", None) for the runs list, ("run", run_id) for a run page, ("compare", None) for the
    compare page, ("alerts", None) for the alerts page, ("unknown", path) otherwise."""
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
    if parts == ["alerts"]:
        return "alerts", None
    if parts == ["signin"]:
        return "signin", None
    return "unknown", path


def parse_step(search: str | None) -> int | None:
    """The step of a run page's query string ("?step=120", as alert links carry), or None."""
    values = parse_qs((search or "").lstrip("?")).get("step", [])
    return int(values[0]) if values and values[0].isdigit() else None


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

    def in_background(call: Callable[[], Any]) -> Any:
        """Run `call` on the pool inside a copy of this request's context: the API client reads the
        signed-in person's token from the request's cookie, and a worker thread has no request."""
        if flask.has_request_context():
            call = flask.copy_current_request_context(call)
        return pool.submit(call)

    def fetch_all(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        futures = {name: in_background(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}

    def run_href(run_id: str, step: Any = None) -> str:
        """The run page's URL; with a step, the page opens with that step marked (as alert links do)."""
        href = app.get_relative_path(f"/runs/{quote(run_id, safe='')}")
        return href + f"?step={step}" if isinstance(step, int) and not isinstance(step, bool) else href

    alerts_page.register_callbacks(app, api, run_href)

    @app.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"))
    def render_page(pathname: str | None, search: str | None) -> Any:
        page, run_id = parse_route(pathname, prefix)
        query = parse_qs((search or "").lstrip("?"))
        if page == "signin":
            return signin.signin_page(
                prefix, (query.get("next") or [prefix])[0], (query.get("error") or [None])[0],
                signed_in=signin.token_from_request() is not None,
            )
        try:
            api.whoami()  # a server with tokens: sign in first (one small request per page)
        except ApiError as exc:
            if exc.status_code == 401:
                here = (pathname or prefix) + (search or "")
                message = "Signed-in token no longer accepted." if signin.token_from_request() else None
                return signin.signin_page(prefix, here, message, signed_in=False)
        if page == "runs":
            return _runs_page()
        if page == "compare":
            return _compare_page_for(parse_run_ids(search))
        if page == "alerts":
            return alerts_page_for()
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
            return _run_page(run, layers, selected_step=parse_step(search))
        return _not_found_page(app, "Page not found", f"There is no dashboard page at “{pathname}”.")

    def alerts_page_for() -> html.Div:
        """The Alerts page, with the server's rule types and the projects known from runs, rules
        and webhooks for its pickers."""
        problem = None
        try:
            fetched = fetch_all(
                {
                    "types": api.rule_types,
                    "runs": lambda: api.list_runs(limit=alerts_page.RUNS_FOR_PROJECTS)[0],
                    "rules": api.alert_rules,
                    "webhooks": api.webhooks,
                }
            )
        except ApiError as exc:
            fetched, problem = {}, exc
        projects = sorted(
            {
                str(item.get("project"))
                for name in ("runs", "rules", "webhooks")
                for item in fetched.get(name, [])
                if item.get("project")
            }
        )
        return alerts_page.alerts_layout(fetched.get("types", []), projects, problem)

    # -- runs list ---------------------------------------------------------------------------------

    @app.callback(
        Output("runs-table", "children"),
        Output("runs-pager", "children"),
        Output("runs-total", "data"),
        Input("runs-refresh", "n_intervals"),
        Input("runs-search", "value"),
        Input("runs-sort", "value"),
        Input("runs-page", "data"),
        Input("runs-status", "value"),
        Input("runs-tag", "value"),
        State("selected-runs", "data"),
    )
    def refresh_runs(
        _n_intervals: int | None, search: str | None, sort: str | None, page: int | None,
        statuses: list[str] | None, tag: str | None, selected: Any,
    ) -> tuple[Any, ...]:
        search = (search or "").strip().lower()
        sort = sort if sort in RUNS_SORTS else "newest"
        page = page if isinstance(page, int) and page >= 0 else 0
        # Status and tag filter on the server; search and the other orders within what it sends.
        filters = {
            "statuses": [s for s in statuses or [] if s in RUN_STATUSES],
            "tags": [t for t in (tag or "").replace(",", " ").split() if t],
        }
        open_alerts = in_background(open_alerts_by_run)
        try:
            if not search and sort == "newest":  # the API's own order: page on the server
                runs, count = api.list_runs(limit=RUNS_PAGE_SIZE, offset=page * RUNS_PAGE_SIZE, **filters)
                matching, searched_all = count, True
            else:
                fetched, count = api.list_runs(limit=RUNS_SEARCH_LIMIT, **filters)
                found = _sort_runs(_filter_runs(fetched, search), sort)
                matching, searched_all = len(found), count <= len(fetched)
                runs = found[page * RUNS_PAGE_SIZE : (page + 1) * RUNS_PAGE_SIZE]
        except ApiError as exc:
            return error_banner(exc), None, 0
        chosen = set(selected or [])
        pager = _pager_text(page, len(runs), matching, count, searched_all)
        table = _runs_table(runs, run_href, chosen, searching=bool(search), open_alerts=open_alerts.result())
        return table, pager, matching

    def open_alerts_by_run() -> dict[str, list[dict[str, Any]]] | None:
        """Open (firing, unacknowledged) alerts by run id; None when the API cannot say."""
        try:
            found, _ = api.alerts(limit=MAX_OPEN_ALERTS, **alerts_page.ALERT_FILTERS["open"])
        except ApiError:
            return None
        by_run: dict[str, list[dict[str, Any]]] = {}
        for alert in found:
            by_run.setdefault(str(alert.get("run_id")), []).append(alert)
        return by_run

    @app.callback(
        Output("runs-page", "data"),
        Input("runs-prev", "n_clicks"),
        Input("runs-next", "n_clicks"),
        Input("runs-search", "value"),
        Input("runs-sort", "value"),
        Input("runs-status", "value"),
        Input("runs-tag", "value"),
        State("runs-page", "data"),
        State("runs-total", "data"),
        prevent_initial_call=True,
    )
    def turn_page(
        _prev: Any, _next: Any, _search: Any, _sort: Any, _status: Any, _tag: Any, page: int | None,
        total: int | None,
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
        Output("live-cursor", "data"),
        Input("refresh", "n_intervals"),
        State("run-id", "data"),
        State("selected-step", "data"),
        State("live-cursor", "data"),
    )
    def refresh_run(
        _n_intervals: int | None, run_id: str, selected_step: Any, cursor: Any
    ) -> tuple[Any, ...]:
        # A live run's charts get only the points after the last step shown, appended (see `live`);
        # the first call, an ended run and anything appending cannot draw right redraw in full.
        try:
            run = api.get_run(run_id)
            ended = run.get("status") != "running"
            starts = None if ended or not live.can_append(cursor, run_id) else live_starts(cursor)
            last_step = run.get("last_step") if isinstance(run.get("last_step"), int) else 0
            health_start = max(0, last_step - HEALTH_WINDOW_STEPS)
            # A sharded run's ranks each measure their own shard: its global norm is theirs combined.
            ranks = api.ranks(run_id) if _world_size(run) > 1 else None
            sharded = bool(ranks) and ranks.get("gradients") == "sharded"
            calls = series_calls(run_id, starts, sharded)
            calls.update(
                {
                    "health/" + name: (lambda key=key: api.series(run_id, key, start=health_start))
                    for name, key in AGENT_HEALTH_KEYS.items()
                }
            )
            calls["events"] = lambda: api.events(run_id)
            calls["alerts"] = lambda: run_alerts(run_id)
            calls["incidents"] = lambda: run_incidents(run_id)
            fetched = fetch_all(calls)
            events, event_count = fetched["events"]
            skips = [event for event in events if event.get("kind") == "skip"]
            appended = None if starts is None else append_new_points(cursor, fetched, skips)
            if starts is not None and appended is None:
                fetched.update(fetch_all(series_calls(run_id, None, sharded)))
        except RunNotFound:
            header = error_banner(f"Run “{run_id}” no longer exists.")
            return (header, *[dash.no_update] * 5, True, True, dash.no_update, dash.no_update)
        except ApiError as exc:
            # Keep what is drawn and keep polling: the server may be restarting.
            return (error_banner(exc), *[dash.no_update] * 5, False, False, dash.no_update, dash.no_update)
        health = {name: _latest(fetched["health/" + name]) for name in AGENT_HEALTH_KEYS}
        alerts, alerts_error = fetched["alerts"]
        timeline = _events_table(events, event_count, alerts, alerts_error)
        # The verdict and incidents sit in the header's slot: right below the header, above the charts.
        incidents, run_verdict, incidents_error = fetched["incidents"]
        header = [
            _run_header(run, health, ranks),
            verdict.verdict_banner(run_verdict, incidents, incidents_error),
            verdict.incidents_section(incidents, run_href),
        ]
        if appended is not None:
            charts, scale_data, new_cursor = appended
            return (header, *charts, timeline, ended, ended, scale_data, new_cursor)
        marker = figures.step_marker_shapes(selected_step)
        drawn = {name: fetched[name] for name in SERIES_KEYS}
        charts = _line_charts(drawn, skips, run_id)
        return (
            header,
            *(keep_view(_with_shapes(figure, marker)) for figure in charts.values()),
            timeline,
            ended,
            ended,
            _compact_series(fetched["scale"]),
            live.full_cursor(run_id, charts, drawn, len(skips)),
        )

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
            calls[name] = lambda key=key, start=start, fetch=fetch: fetch(run_id, key, start=start)
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

    def append_new_points(
        cursor: dict[str, Any], fetched: dict[str, Any], skips: list[dict[str, Any]]
    ) -> tuple[list[Any], Any, dict[str, Any]] | None:
        """(chart patches, scale-series patch, cursor) that append the new points; None when the
        charts must be redrawn in full (new skip markers, a downsampled slice, anything `live`
        refuses to append)."""
        new = {name: fetched[name] for name in SERIES_KEYS}
        if len(skips) != cursor.get("skips") or any(series.get("downsampled") for series in new.values()):
            return None
        new_points = _line_charts(new, [], cursor["run_id"])  # the same builders, on the new points only
        patches = [
            live.append_patch(cursor["charts"][graph_id], new_points[graph_id]) for graph_id in new_points
        ]
        if any(patch is None for patch in patches):
            return None
        scale_data: Any = dash.no_update
        if new["scale"].get("steps"):
            scale_data = dash.Patch()
            scale_data["steps"].extend(new["scale"]["steps"])
            scale_data["values"].extend(new["scale"]["values"])
        counted = [name for name in SERIES_KEYS if name not in SAFE_BAND_SERIES]
        return patches, scale_data, live.advance(cursor, new, counted)

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
                return error_banner(exc), [], None
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


def _line_charts(series: dict[str, Any], skips: list[dict[str, Any]], run_id: str) -> dict[str, go.Figure]:
    """The run page's line charts by graph id, from the SERIES_KEYS series (by name) and skip events."""
    return {
        "loss-graph": figures.loss_figure(series["loss"], uirevision=run_id),
        "scale-graph": figures.scale_figure(
            series["scale"], skips, (series["safe_min"], series["safe_max"]), uirevision=run_id
        ),
        "grad-norm-graph": figures.grad_norm_figure(
            series["grad_norm"], series["grad_norm_post_clip"], uirevision=run_id
        ),
        "lr-graph": figures.lr_figure(series["lr"], uirevision=run_id),
    }


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
                    html.Nav(
                        [
                            dcc.Link("Runs", href=app.get_relative_path("/"), id="nav-runs"),
                            dcc.Link("Alerts", href=app.get_relative_path("/alerts"), id="nav-alerts"),
                            dcc.Link("Token", href=app.get_relative_path("/signin"), id="nav-signin"),
                        ],
                        className="nav",
                    ),
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
                        id="runs-status",
                        options=[{"label": status, "value": status} for status in RUN_STATUSES],
                        multi=True,
                        placeholder="Any status",
                        className="status-filter",
                    ),
                    dcc.Input(
                        id="runs-tag", type="search", placeholder="Tags…", debounce=0.3, className="tag-filter"
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
    runs: list[dict[str, Any]],
    run_href: Any,
    chosen: set[str] | None = None,
    *,
    searching: bool = False,
    open_alerts: dict[str, list[dict[str, Any]]] | None = None,
) -> Any:
    """The runs list. open_alerts: open alerts by run id, shown as a health badge per run (None: the
    alerts could not be read, and the badge says so)."""
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
                for label in ("Project", "Name", "Status", "Alerts", "Last step", "Scale", "Skips", "Created")
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
                    html.Td(status_badge(run_status(run))),
                    html.Td(_alerts_badge(None if open_alerts is None else open_alerts.get(run_id, []))),
                    html.Td(format_step(run.get("last_step")), className="num"),
                    html.Td(scale_text(summary.get("scale")), className="num"),
                    html.Td(
                        html.Span(str(skips), className="badge badge-bad" if skips else "badge badge-ok")
                    ),
                    html.Td(format_time(run.get("created_at")), className="muted"),
                ]
            )
        )
    return html.Table([header, html.Tbody(rows)], className="table")


def _alerts_badge(alerts: list[dict[str, Any]] | None) -> html.Span:
    """A run's health as to alerts: "N open" in red (the titles on hover), "none" in green."""
    if alerts is None:
        return html.Span("?", className="badge", title="alerts could not be read")
    if not alerts:
        return html.Span("none", className="badge badge-ok alerts-badge")
    titles = "\n".join(str(alert.get("title") or alert.get("type") or "") for alert in alerts[:10])
    return html.Span(f"{len(alerts)} open", className="badge badge-bad alerts-badge", title=titles)


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


def _run_page(
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


def _world_size(run: dict[str, Any]) -> int:
    size = (run.get("metadata") or {}).get("world_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else 1


def _ranks_line(ranks: dict[str, Any]) -> html.Div:
    """One chip per rank of a distributed run: rank, host and how it ended; a crashed rank in red."""
    chips = []
    for info in ranks.get("data") or []:
        status = str(info.get("status") or "running")
        text = f"rank {info.get('rank')} · {info.get('host') or '?'} · {status}"
        chips.append(html.Span(text, className="rank-chip bad" if status == "crashed" else "rank-chip"))
    title = f"{ranks.get('world_size') or len(chips)} ranks, gradients {ranks.get('gradients') or '?'}"
    return html.Div([html.Span(title, className="health-title"), *chips], className="ranks-line", id="ranks-line")


def _run_header(run: dict[str, Any], health: dict[str, Any], ranks: dict[str, Any] | None = None) -> html.Div:
    summary = run.get("summary") or {}
    facts = [
        ("project", str(run.get("project", ""))),
        ("last step", format_step(run.get("last_step"))),
        ("scale", scale_text(summary.get("scale"))),
        ("skipped steps", str(summary.get("skips") or 0)),
        ("created", format_time(run.get("created_at"))),
    ]
    children: list[Any] = [
        html.Div(
            [
                html.H1(str(run.get("name") or run.get("id")), className="run-name"),
                status_badge(run_status(run)),
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
    if ranks and ranks.get("data"):
        children.append(_ranks_line(ranks))
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


def _events_table(
    events: list[dict[str, Any]],
    count: int,
    alerts: list[dict[str, Any]] | None = None,
    alerts_error: ApiError | None = None,
) -> Any:
    """The run's timeline, latest step first: events (skips, warnings) and alerts, each step a button
    that marks it on the charts."""
    alerts = alerts or []
    notes: list[Any] = []
    if alerts_error is not None:
        notes.append(html.P(f"Alerts could not be loaded: {alerts_error}", className="muted"))
    if not events and not alerts:
        return [html.P("No events: no skipped steps, no warnings, no alerts.", className="muted"), *notes]
    condensed = verdict.condense_events(events)  # a streak of skipped steps is one row
    entries = [("event", index, event) for index, event in enumerate(condensed)]
    entries += [("alert", index, alert) for index, alert in enumerate(alerts)]
    entries.sort(key=lambda entry: _timeline_step(entry[2]), reverse=True)
    shown = entries[:EVENTS_TABLE_ROWS]
    rows = [
        _alert_row(item, f"alert-{index}") if source == "alert" else _event_row(item, f"event-{index}")
        for source, index, item in shown
    ]
    header = html.Thead(html.Tr([html.Th("Step"), html.Th("Kind"), html.Th("Details"), html.Th("Hint")]))
    children: list[Any] = [html.Table([header, html.Tbody(rows)], className="table events"), *notes]
    hidden_events = count - sum(
        (item.get("streak") or {}).get("count", 1) for source, _, item in shown if source == "event"
    )
    if hidden_events > 0:
        children.append(
            html.P(
                f"Showing the latest {len(shown)} entries; {hidden_events} older events are not shown.",
                className="muted",
            )
        )
    return children


def _timeline_step(item: dict[str, Any]) -> int:
    """Where an event or alert stands in the timeline: its step; a skip streak's last step."""
    streak = item.get("streak")
    return _step_or_minus_one(streak["last_step"] if streak else item.get("step"))


def _step_or_minus_one(step: Any) -> int:
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def _step_button(step: Any, row: str) -> Any:
    """A step that marks itself on the charts when clicked (row keeps ids unique per table)."""
    if not isinstance(step, int) or isinstance(step, bool):
        return format_step(step)
    return html.Button(
        format_step(step),
        id={"type": "event-step", "step": step, "row": row},
        className="step-link",
        n_clicks=0,
    )


def _event_row(event: dict[str, Any], row: str) -> html.Tr:
    kind = str(event.get("kind", ""))
    data = event.get("data") if isinstance(event.get("data"), dict) else {}
    streak = event.get("streak")  # skips at consecutive steps, condensed into one row
    label = f"{kind} ×{streak['count']}" if streak else kind
    step_cell: Any = _step_button(event.get("step"), row)
    if streak:
        step_cell = [step_cell, "–", _step_button(streak["last_step"], row + "-last")]
        details: Any = html.Span(streak["text"], title="\n".join(streak["layers"]) or None)
    else:
        details = _event_details(kind, data)
    return html.Tr(
        [
            html.Td(step_cell, className="num"),
            html.Td(html.Span(label, className="badge badge-bad" if kind == "skip" else "badge badge-warn")),
            html.Td(details, className="layers streak" if streak else "layers"),
            html.Td(str(data.get("hint") or ""), className="hint-cell"),
        ]
    )


def _alert_row(alert: dict[str, Any], row: str) -> html.Tr:
    state = alert_state(alert)
    severity = str(alert.get("severity") or "")
    details = [html.Span(str(alert.get("title") or alert.get("type") or "alert"), className="alert-title")]
    details.append(html.Span(f" · {state}", className="bad" if state == "open" else "muted"))
    return html.Tr(
        [
            html.Td(_step_button(alert.get("step"), row), className="num"),
            html.Td(
                html.Span(
                    f"alert: {alert.get('type', '')}",
                    className="badge badge-bad" if severity == "critical" else "badge badge-warn",
                    title=severity,
                )
            ),
            html.Td(details),
            html.Td(str(alert.get("hint") or ""), className="hint-cell"),
        ],
        className="alert-row",
    )


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
    return summarize_fields(data, leave_out=("hint",))


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
                        f" {run.get('project', '')} · step {format_step(run.get('last_step'))}",
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
    return html.Div([error_banner(error), dcc.Link("← All runs", href=app.get_relative_path("/"))])
