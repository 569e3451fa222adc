"""The compare page (/dashboard/compare?runs=id1,id2): one scalar key of several runs overlaid by step,
on a linear or log y axis; the runs come from the runs list's ticks."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, quote

import dash
from dash import Input, Output, State, dcc, html

from .. import figures
from ..api_client import ApiClient, ApiError, RunNotFound
from ..callbacks import PageCallbacks, services
from ..views import GRAPH_CONFIG, RunHref, error_banner, format_step, keep_view

__all__ = ["MAX_COMPARE_RUNS", "callbacks", "href", "layout", "parse_run_ids"]

MAX_COMPARE_RUNS = 8

callbacks = PageCallbacks()


def parse_run_ids(search: str | None) -> list[str]:
    """The run ids of a compare page's query string ("?runs=a,b"), in order, without repeats."""
    values = parse_qs((search or "").lstrip("?")).get("runs", [])
    ids = [run_id.strip() for value in values for run_id in value.split(",")]
    return list(dict.fromkeys(run_id for run_id in ids if run_id))


def href(app: dash.Dash, run_ids: list[str]) -> str:
    """The compare page's URL for these runs."""
    path: str = app.get_relative_path("/compare")
    return path + "?runs=" + ",".join(quote(run_id, safe="") for run_id in run_ids)


def layout(run_ids: list[str]) -> html.Div:
    """The compare page for these runs (the first MAX_COMPARE_RUNS): filled in by its callbacks."""
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


# -- callbacks -------------------------------------------------------------------------------------


@callbacks.callback(
    Output("compare-runs", "children"),
    Output("compare-key", "options"),
    Output("compare-key", "value"),
    Input("compare-ids", "data"),
    State("compare-key", "value"),
)
def load_compare(run_ids: list[str], key: str | None) -> tuple[Any, ...]:
    """The runs compared (each linked to its page), the series they have, the series picked."""
    api = services().api
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
    return _compare_run_list(runs, missing, services().run_href), options, key


@callbacks.callback(
    Output("compare-graph", "figure"),
    Input("compare-key", "value"),
    Input("compare-log", "value"),
    State("compare-ids", "data"),
)
def draw_compare(key: str | None, log_options: list[str] | None, run_ids: list[str]) -> Any:
    """The picked series of every run, overlaid."""
    if not key:
        return figures.empty_figure("Compare", "pick runs with a common series")
    try:
        labelled = [
            (str(series.get("name") or series.get("run_id")), series)
            for series in _compared(services().api, run_ids or [], key)
        ]
    except ApiError as exc:
        return figures.empty_figure("Compare", str(exc))
    figure = figures.compare_figure(
        labelled, key, log_y="log" in (log_options or []), uirevision=",".join(run_ids or [])
    )
    return keep_view(figure)


def _compared(api: ApiClient, run_ids: list[str], key: str) -> list[dict[str, Any]]:
    """The key of every run in one request (GET /compare); runs deleted since the page loaded are left
    out (the request names one that is gone: ask again without the missing ones)."""
    if not run_ids:
        return []
    try:
        return api.compare(run_ids, key)
    except ApiError as exc:
        if exc.status_code != 404:
            raise
        present = []
        for run_id in run_ids:
            try:
                api.get_run(run_id)
                present.append(run_id)
            except RunNotFound:
                continue
        return api.compare(present, key) if present else []


def _compare_run_list(runs: list[dict[str, Any]], missing: list[str], run_href: RunHref) -> list[Any]:
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
