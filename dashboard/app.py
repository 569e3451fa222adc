"""The Dash app: a runs list and one page per run, reading everything through ApiClient.

Pages (one dcc.Location, routed by a callback on its pathname), with the default prefix:
    /dashboard/                 runs list
    /dashboard/runs/{run_id}    run page: loss, loss scale with skipped steps, grad norm, lr, skip events

Callbacks stay thin: fetch with the ApiClient, draw with `figures`, lay out with the view helpers
below. User-supplied names are only ever passed as component children, which Dash renders as text.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import dash
import httpx
import plotly.graph_objects as go
from dash import Input, Output, State, dcc, html

from . import figures
from .api_client import ApiClient, ApiError, ApiUnavailable, RunNotFound

__all__ = ["create_dash_app", "keep_view", "parse_route"]

RUN_REFRESH_MS = 2000
RUNS_LIST_REFRESH_MS = 5000
RUNS_LIST_LIMIT = 200
EVENTS_TABLE_ROWS = 100
SERIES_KEYS = {"loss": "loss", "scale": "amp/scale", "grad_norm": "grad/global_norm", "lr": "lr"}
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
    """("runs", None) for the runs list, ("run", run_id) for a run page, ("unknown", path) otherwise."""
    path = pathname or prefix
    root = prefix.rstrip("/")
    if path == root or path.startswith(root + "/"):
        path = path[len(root) :]
    parts = [part for part in path.split("/") if part]
    if not parts:
        return "runs", None
    if len(parts) == 2 and parts[0] == "runs":
        return "run", unquote(parts[1])
    return "unknown", path


# -- callbacks -------------------------------------------------------------------------------------


def _register_callbacks(app: dash.Dash, api: ApiClient, prefix: str) -> None:
    def run_href(run_id: str) -> str:
        return app.get_relative_path(f"/runs/{quote(run_id, safe='')}")

    @app.callback(Output("page", "children"), Input("url", "pathname"))
    def render_page(pathname: str | None) -> Any:
        page, run_id = parse_route(pathname, prefix)
        if page == "runs":
            return _runs_page()
        if page == "run" and run_id:
            try:
                run = api.get_run(run_id)
            except RunNotFound:
                return _not_found_page(app, "Run not found", f"There is no run with id “{run_id}”.")
            except ApiError as exc:
                return _api_error_page(app, exc)
            return _run_page(run)
        return _not_found_page(app, "Page not found", f"There is no dashboard page at “{pathname}”.")

    @app.callback(Output("runs-table", "children"), Input("runs-refresh", "n_intervals"))
    def refresh_runs(_n_intervals: int | None) -> Any:
        try:
            runs, count = api.list_runs(limit=RUNS_LIST_LIMIT)
        except ApiError as exc:
            return _error_banner(exc)
        return _runs_table(runs, count, run_href)

    @app.callback(
        Output("run-header", "children"),
        Output("loss-graph", "figure"),
        Output("scale-graph", "figure"),
        Output("grad-norm-graph", "figure"),
        Output("lr-graph", "figure"),
        Output("events-table", "children"),
        Output("refresh", "disabled"),
        Input("refresh", "n_intervals"),
        State("run-id", "data"),
    )
    def refresh_run(_n_intervals: int | None, run_id: str) -> tuple[Any, ...]:
        try:
            run = api.get_run(run_id)
            series = {name: api.series(run_id, key) for name, key in SERIES_KEYS.items()}
            skips, skip_count = api.events(run_id, kind="skip")
        except RunNotFound:
            header = _error_banner(f"Run “{run_id}” no longer exists.")
            return (header, *[dash.no_update] * 5, True)
        except ApiError as exc:
            # Keep what is drawn and keep polling: the server may be restarting.
            return (_error_banner(exc), *[dash.no_update] * 5, False)
        return (
            _run_header(run),
            keep_view(figures.loss_figure(series["loss"], uirevision=run_id)),
            keep_view(figures.scale_figure(series["scale"], skips, uirevision=run_id)),
            keep_view(figures.grad_norm_figure(series["grad_norm"], uirevision=run_id)),
            keep_view(figures.lr_figure(series["lr"], uirevision=run_id)),
            _events_table(skips, skip_count),
            run.get("status") != "running",
        )


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


# -- views (pure: data in, components out) -----------------------------------------------------------


def _shell(app: dash.Dash) -> html.Div:
    return html.Div(
        [
            dcc.Location(id="url", refresh=False),
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
            html.Div(html.P("Loading runs…", className="muted"), id="runs-table", className="card"),
            dcc.Interval(id="runs-refresh", interval=RUNS_LIST_REFRESH_MS),
        ]
    )


def _runs_table(runs: list[dict[str, Any]], count: int, run_href: Any) -> Any:
    if not runs:
        return html.P(
            "No runs yet. Start one with gradwatch.init(project=…) in a training script.", className="muted"
        )
    header = html.Thead(
        html.Tr(
            [
                html.Th(label)
                for label in ("Project", "Name", "Status", "Last step", "Scale", "Skips", "Created")
            ]
        )
    )
    rows = []
    for run in runs:
        summary = run.get("summary") or {}
        skips = summary.get("skips") or 0
        rows.append(
            html.Tr(
                [
                    html.Td(str(run.get("project", ""))),
                    html.Td(
                        dcc.Link(str(run.get("name") or run.get("id")), href=run_href(str(run.get("id"))))
                    ),
                    html.Td(_status_badge(run.get("status"))),
                    html.Td(_format_step(run.get("last_step")), className="num"),
                    html.Td(_scale_text(summary.get("scale")), className="num"),
                    html.Td(
                        html.Span(str(skips), className="badge badge-bad" if skips else "badge badge-ok")
                    ),
                    html.Td(_format_time(run.get("created_at")), className="muted"),
                ]
            )
        )
    children: list[Any] = [html.Table([header, html.Tbody(rows)], className="table")]
    if count > len(runs):
        children.append(html.P(f"Showing the newest {len(runs)} of {count} runs.", className="muted"))
    return children


def _run_page(run: dict[str, Any]) -> html.Div:
    run_id = str(run.get("id"))
    graphs = [
        ("loss-graph", figures.empty_figure("Loss", "loading…", uirevision=run_id)),
        ("scale-graph", figures.empty_figure("Loss scale", "loading…", uirevision=run_id)),
        (
            "grad-norm-graph",
            figures.empty_figure("Gradient norm (global, unscaled)", "loading…", uirevision=run_id),
        ),
        ("lr-graph", figures.empty_figure("Learning rate", "loading…", uirevision=run_id)),
    ]
    return html.Div(
        [
            dcc.Store(id="run-id", data=run_id),
            html.Div(_run_header(run), id="run-header"),
            html.Div(
                [
                    html.Div(dcc.Graph(id=graph_id, figure=figure, config=GRAPH_CONFIG), className="card")
                    for graph_id, figure in graphs
                ],
                className="graph-grid",
            ),
            html.Div(
                [html.H2("Skipped steps"), html.Div(id="events-table")],
                className="card",
            ),
            dcc.Interval(id="refresh", interval=RUN_REFRESH_MS, disabled=run.get("status") != "running"),
        ]
    )


def _run_header(run: dict[str, Any]) -> html.Div:
    summary = run.get("summary") or {}
    facts = [
        ("project", str(run.get("project", ""))),
        ("last step", _format_step(run.get("last_step"))),
        ("scale", _scale_text(summary.get("scale"))),
        ("skipped steps", str(summary.get("skips") or 0)),
        ("created", _format_time(run.get("created_at"))),
    ]
    return html.Div(
        [
            html.Div(
                [
                    html.H1(str(run.get("name") or run.get("id")), className="run-name"),
                    _status_badge(run.get("status")),
                ],
                className="run-title",
            ),
            html.Dl(
                [html.Div([html.Dt(label), html.Dd(value)], className="fact") for label, value in facts],
                className="facts",
            ),
        ],
        className="run-header",
    )


def _events_table(events: list[dict[str, Any]], count: int) -> Any:
    if not events:
        return html.P("No skipped steps.", className="muted")
    latest = list(reversed(events))[:EVENTS_TABLE_ROWS]
    rows = []
    for event in latest:
        data = event.get("data") if isinstance(event.get("data"), dict) else {}
        layers = figures.layer_names(data.get("non_finite_layers"))
        layer_count = data.get("non_finite_layer_count", len(layers))
        rows.append(
            html.Tr(
                [
                    html.Td(_format_step(event.get("step")), className="num"),
                    html.Td(
                        f"{figures.format_scale(data.get('scale_before'))} → "
                        f"{figures.format_scale(data.get('scale_after'))}",
                        className="num",
                    ),
                    html.Td(
                        figures.summarize_layers(layers) if layers else "–",
                        title="\n".join(layers[:50]) if layers else None,
                        className="layers",
                    ),
                    html.Td(str(layer_count), className="num"),
                ]
            )
        )
    header = html.Thead(
        html.Tr(
            [html.Th("Step"), html.Th("Scale before → after"), html.Th("Non-finite layers"), html.Th("#")]
        )
    )
    children: list[Any] = [html.Table([header, html.Tbody(rows)], className="table")]
    if count > len(latest):
        children.append(
            html.P(f"Showing the latest {len(latest)} of {count} skipped steps.", className="muted")
        )
    return children


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
    kind = {"running": "badge-live", "finished": "badge-ok", "crashed": "badge-bad"}.get(status, "")
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
