"""The runs list (/dashboard/): search, status and tag filters, sort, pages, health badges (status,
open alerts, scale, skips); tick runs to compare them.

The server pages the list in its own order (newest first) and filters by status and tag; a search or
another order is applied to the newest RUNS_SEARCH_LIMIT runs it sends.

Every RUNS_LIST_REFRESH_MS (or, when the server's doorbell is open, whenever a run moved: see
`doorbell`) the list reads its page of runs; only when a run shown changed (new data,
a new status: its update time moves), the count changed, or RUNS_LIST_FULL_REFRESH_S passed (a run
turning silent or crashing for want of a heartbeat moves no update time) are the open alerts read
and the table drawn again.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from .. import doorbell
from ..api_client import ApiClient, ApiError
from ..callbacks import PageCallbacks, services
from ..views import error_banner, format_step, format_time, run_status, scale_text, status_badge
from . import compare
from .alerts import ALERT_FILTERS

__all__ = ["callbacks", "layout"]

RUNS_LIST_REFRESH_MS = 5000
RUNS_LIST_FULL_REFRESH_S = 60.0
RUNS_PAGE_SIZE = 25
RUNS_SEARCH_LIMIT = 500  # with a search or a sort the API cannot do, the newest this many are searched
MAX_OPEN_ALERTS = 1000  # open alerts read for the runs list's badges (the API's largest page)
RUN_STATUSES = ("running", "finished", "crashed")  # what GET /api/v1/runs?status= filters by
RUNS_SORTS = {
    "newest": "Newest first",
    "oldest": "Oldest first",
    "name": "Name",
    "last_step": "Last step",
    "skips": "Most skips",
}

callbacks = PageCallbacks()


# -- callbacks -------------------------------------------------------------------------------------


@callbacks.callback(
    Output("runs-table", "children"),
    Output("runs-pager", "children"),
    Output("runs-total", "data"),
    Output("runs-seen", "data"),
    Input("runs-refresh", "n_intervals"),
    Input("runs-search", "value"),
    Input("runs-sort", "value"),
    Input("runs-page", "data"),
    Input("runs-status", "value"),
    Input("runs-tag", "value"),
    State("selected-runs", "data"),
    State("runs-seen", "data"),
)
def refresh_runs(
    _n_intervals: int | None,
    search: str | None,
    sort: str | None,
    page: int | None,
    statuses: list[str] | None,
    tag: str | None,
    selected: Any,
    seen: Any = None,
) -> tuple[Any, ...]:
    """The page of runs asked for (searched, filtered, sorted) and its pager; on a refresh tick
    only when something shown changed."""
    search = (search or "").strip().lower()
    sort = sort if sort in RUNS_SORTS else "newest"
    page = page if isinstance(page, int) and page >= 0 else 0
    # Status and tag filter on the server; search and the other orders within what it sends.
    wanted_statuses = [s for s in statuses or [] if s in RUN_STATUSES]
    wanted_tags = [t for t in (tag or "").replace(",", " ").split() if t]
    api = services().api
    try:
        if not search and sort == "newest":  # the API's own order: page on the server
            runs, count = api.list_runs(
                limit=RUNS_PAGE_SIZE,
                offset=page * RUNS_PAGE_SIZE,
                statuses=wanted_statuses,
                tags=wanted_tags,
            )
            matching, searched_all = count, True
        else:
            fetched, count = api.list_runs(
                limit=RUNS_SEARCH_LIMIT, statuses=wanted_statuses, tags=wanted_tags
            )
            found = _sort_runs(_filter_runs(fetched, search), sort)
            matching, searched_all = len(found), count <= len(fetched)
            runs = found[page * RUNS_PAGE_SIZE : (page + 1) * RUNS_PAGE_SIZE]
    except ApiError as exc:
        return error_banner(exc), None, 0, None
    changes = [count, [[run.get("id"), run.get("updated_at"), run.get("status")] for run in runs]]
    if (
        ctx.triggered_id == "runs-refresh"
        and isinstance(seen, dict)
        and seen.get("changes") == changes
        and time.time() - float(seen.get("read_at") or 0) < RUNS_LIST_FULL_REFRESH_S
    ):
        raise dash.exceptions.PreventUpdate  # the runs shown are as they were: nothing more read
    background = services().background
    open_alerts = background.submit(partial(_open_alerts_by_run, api))
    resolved = {  # the shown runs' resolved incidents: a run that recovered is not "none"
        str(run.get("id")): background.submit(partial(_resolved_incidents, api, str(run.get("id"))))
        for run in runs
    }
    chosen = set(selected or [])
    pager = _pager_text(page, len(runs), matching, count, searched_all)
    table = _runs_table(
        runs,
        services().run_href,
        chosen,
        searching=bool(search),
        open_alerts=open_alerts.result(),
        resolved={run_id: future.result() for run_id, future in resolved.items()},
    )
    return table, pager, matching, {"changes": changes, "read_at": time.time()}


@callbacks.callback(
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
    _prev: Any,
    _next: Any,
    _search: Any,
    _sort: Any,
    _status: Any,
    _tag: Any,
    page: int | None,
    total: int | None,
) -> int:
    """The page of the list shown: Newer, Older, or the first after a new search, sort or filter."""
    page = page or 0
    last_page = max(0, ((total or 0) - 1) // RUNS_PAGE_SIZE)
    if ctx.triggered_id == "runs-prev":
        return max(0, page - 1)
    if ctx.triggered_id == "runs-next":
        return min(last_page, page + 1)
    return 0  # a new search or sort starts on the first page


@callbacks.callback(
    Output("selected-runs", "data"),
    Output("compare-bar", "children"),
    Input({"type": "run-select", "run": ALL}, "value"),
    State({"type": "run-select", "run": ALL}, "id"),
    State("selected-runs", "data"),
)
def select_runs(values: list[Any], ids: list[dict[str, str]], selected: Any) -> tuple[Any, ...]:
    """The runs ticked to compare (at most MAX_COMPARE_RUNS) and the compare bar's link."""
    # Runs on other pages (or hidden by the search) stay selected; those shown take their box.
    shown = {component_id["run"] for component_id in ids}
    checked = [component_id["run"] for component_id, value in zip(ids, values, strict=True) if value]
    kept = [run_id for run_id in (selected or []) if run_id not in shown]
    chosen = list(dict.fromkeys(kept + checked))[: compare.MAX_COMPARE_RUNS]
    return chosen, _compare_bar(services().app, chosen)


def _resolved_incidents(api: ApiClient, run_id: str) -> tuple[int, str] | None:
    """How many incidents of the run resolved, and the newest one's title; None when the API cannot
    say."""
    try:
        found, count = api.incidents(run_id=run_id, status="resolved", limit=1)
    except ApiError:
        return None
    return count, str(found[0].get("title") or "") if found else ""


def _open_alerts_by_run(api: ApiClient) -> dict[str, list[dict[str, Any]]] | None:
    """Open (firing, unacknowledged) alerts by run id; None when the API cannot say."""
    try:
        found, _ = api.alerts(limit=MAX_OPEN_ALERTS, **ALERT_FILTERS["open"])
    except ApiError:
        return None
    by_run: dict[str, list[dict[str, Any]]] = {}
    for alert in found:
        by_run.setdefault(str(alert.get("run_id")), []).append(alert)
    return by_run


# -- views (pure: data in, components out) -----------------------------------------------------------


def layout(streams: str | None = None) -> html.Div:
    """The runs list: search, filters, sort, the compare bar, the table and its pager. `streams`: the
    URL path of the server's doorbells (Services.live_doorbell); the list then refreshes when its
    doorbell rings, else it polls."""
    bell = doorbell.Bell("runs-bell", every=1_000, normal=RUNS_LIST_REFRESH_MS)
    polling = f"polling every {RUNS_LIST_REFRESH_MS // 1000} s"
    return html.Div(
        [
            html.H1("Runs"),
            *doorbell.components(streams.rstrip("/") if streams else None, (bell,), polling),
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
                        id="runs-tag",
                        type="search",
                        placeholder="Tags…",
                        debounce=0.3,
                        className="tag-filter",
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
            dcc.Store(id="runs-seen", data=None),  # the runs shown (id, update time, status) when drawn
            dcc.Interval(id="runs-refresh", interval=RUNS_LIST_REFRESH_MS),
        ]
    )


@callbacks.callback(
    Output("runs-prev", "style"),
    Output("runs-next", "style"),
    Input("runs-total", "data"),
    Input("runs-page", "data"),
)
def pager_buttons(total: int | None, page: int | None) -> tuple[dict[str, str], dict[str, str]]:
    """ "← Newer" only past the first page, "Older →" only before the last (none with one page)."""
    page = page if isinstance(page, int) and page >= 0 else 0
    pages = -(-(total or 0) // RUNS_PAGE_SIZE)
    shown: dict[str, str] = {}
    hidden = {"visibility": "hidden"}
    return (shown if page > 0 else hidden), (shown if page + 1 < pages else hidden)


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
    href = compare.href(app, chosen) if app is not None else "#"
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
    resolved: dict[str, tuple[int, str] | None] | None = None,
) -> Any:
    """The runs list. open_alerts: open alerts by run id, shown as a health badge per run (None: the
    alerts could not be read, and the badge says so); resolved: per run id, how many of its incidents
    resolved and the newest one's title (None: could not be read)."""
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
                    html.Td(status_badge(run_status(run), run.get("status_reason"))),
                    html.Td(
                        _alerts_badge(
                            None if open_alerts is None else open_alerts.get(run_id, []),
                            (resolved or {}).get(run_id, (0, "")),
                        )
                    ),
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


def _alerts_badge(
    alerts: list[dict[str, Any]] | None, resolved: tuple[int, str] | None = (0, "")
) -> html.Span:
    """A run's health as to alerts: "N open" in red (the titles on hover); else "N resolved" in blue
    when incidents of the run resolved (it recovered: the newest one's title on hover), as the run
    page's RECOVERED verdict says; else "none" in green."""
    if alerts is None or (not alerts and resolved is None):
        return html.Span("?", className="badge", title="alerts could not be read")
    if not alerts and resolved is not None and resolved[0] > 0:
        count, title = resolved
        return html.Span(
            f"{count} resolved",
            className="badge badge-recovered alerts-badge",
            title=f"recovered from {count} incident{'s' if count != 1 else ''}; the last: {title}",
        )
    if not alerts:
        return html.Span("none", className="badge badge-ok alerts-badge")
    titles = "\n".join(str(alert.get("title") or alert.get("type") or "") for alert in alerts[:10])
    return html.Span(f"{len(alerts)} open", className="badge badge-bad alerts-badge", title=titles)
