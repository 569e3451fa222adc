"""The Alerts page (/dashboard/alerts): alerts with their evidence, the rules that raise them, and the
webhooks they are sent to; a card each, a module each.

    alerts     (here) open first, then acknowledged, then resolved; filtered by state and project;
               each with its rule, run (linked to the run page at the alert's step), evidence and
               times, and an Acknowledge button while open
    rules      (`alert_rules`) the project's rules with their parameters; create one (its type and
               the parameters' defaults and bounds come from the server: GET
               /api/v1/alert-rules/types), edit its parameters, name and cooldown, enable or disable
               it, delete it
    webhooks   (`webhooks`) create (generic JSON, Slack, Discord; optional HMAC secret) and delete;
               "Send test" queues a test notification and follows its delivery until the receiver
               answered

Every change goes through the API; what the server refuses (e.g. 422 for a threshold out of bounds)
is shown next to the form with the server's message. Callbacks are thin: fetch with the app's
ApiClient (`services()`), lay out with the pure views of `alerts_views` (tested without a browser).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from ..api_client import ApiClient, ApiError
from ..callbacks import PageCallbacks, services
from ..views import ALERT_STATES, error_banner, form_message
from . import alert_rules, webhooks
from .alerts_views import alerts_table, card, clicked_id

if TYPE_CHECKING:
    from ..app import Background

__all__ = ["ALERT_FILTERS", "alerts_layout", "callbacks", "can_change", "layout"]

ALERTS_REFRESH_MS = 5000
ALERTS_LIMIT = 200  # the page shows the newest this many alerts of each state
# What the API is asked for each state the page shows.
ALERT_FILTERS: dict[str, dict[str, Any]] = {
    "open": {"status": "firing", "acknowledged": False},
    "acknowledged": {"status": "firing", "acknowledged": True},
    "resolved": {"status": "resolved"},
}
RUNS_FOR_PROJECTS = 500  # the newest runs whose projects the project pickers offer

callbacks = PageCallbacks()


def layout(api: ApiClient, background: Background) -> html.Div:
    """The Alerts page, with the server's rule types and the projects known from runs, rules and
    webhooks for its pickers (read together on the app's workers)."""
    problem = None
    try:
        fetched = background.fetch_all(
            {
                "types": api.rule_types,
                "runs": lambda: api.list_runs(limit=RUNS_FOR_PROJECTS)[0],
                "rules": api.alert_rules,
                "webhooks": api.webhooks,
                "identity": api.whoami,
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
    return alerts_layout(fetched.get("types", []), projects, problem, can_change(fetched.get("identity")))


def can_change(identity: Any) -> bool:
    """Whether GET /auth/whoami's answer allows changing rules, webhooks and alerts (admin scope, or
    an open server); unknown (not loaded): True, and the server's 403 says why if not."""
    if not isinstance(identity, dict) or identity.get("open"):
        return True
    scopes = identity.get("scopes") or []
    return "admin" in scopes or "*" in scopes


def alerts_layout(
    rule_types: list[dict[str, Any]],
    projects: list[str],
    problem: ApiError | None = None,
    changes_allowed: bool = True,
) -> html.Div:
    """The Alerts page: alerts, rules and webhooks. `rule_types` from GET /alert-rules/types,
    `projects` offered in the pickers; `problem`: why either could not be loaded; without
    `changes_allowed` (a read token) it says so up front and its create buttons are disabled."""
    project_options = [{"label": project, "value": project} for project in projects]
    return html.Div(
        [
            html.H1("Alerts"),
            error_banner(problem) if problem is not None else None,
            None
            if changes_allowed
            else html.Div(
                "Signed in with a read token: you see every alert, rule and webhook of your project; "
                "creating, editing, acknowledging and deleting them needs a token with admin scope "
                "(gradwatch token create --scope admin).",
                className="banner banner-info",
                id="alerts-read-only",
            ),
            dcc.Store(id="rule-types", data=rule_types),
            dcc.Store(id="alerts-version", data=0),
            dcc.Store(id="rules-version", data=0),
            dcc.Store(id="webhooks-version", data=0),
            dcc.Store(id="webhook-tests", data={}),
            dcc.Store(id="rule-editing", data=None),
            html.Datalist([html.Option(value=project) for project in projects], id="known-projects"),
            dcc.Interval(id="alerts-refresh", interval=ALERTS_REFRESH_MS),
            dcc.Interval(id="webhook-test-poll", interval=webhooks.TEST_POLL_MS, disabled=True),
            card(
                "alerts",
                [
                    html.Div(
                        [
                            html.Label("Show", htmlFor="alerts-states"),
                            dcc.Checklist(
                                id="alerts-states",
                                options=[{"label": f" {state}", "value": state} for state in ALERT_STATES],
                                value=list(ALERT_STATES),
                                inline=True,
                                className="state-filter",
                            ),
                            html.Label("Project", htmlFor="alerts-project"),
                            dcc.Dropdown(
                                id="alerts-project",
                                options=project_options,
                                value=None,
                                placeholder="All projects",
                                className="project-pick",
                            ),
                        ],
                        className="toolbar",
                    ),
                ],
            ),
            alert_rules.rules_card(rule_types, changes_allowed),
            webhooks.webhooks_card(changes_allowed),
        ]
    )


# -- callbacks -------------------------------------------------------------------------------------


@callbacks.callback(
    Output("alerts-table", "children"),
    Input("alerts-refresh", "n_intervals"),
    Input("alerts-states", "value"),
    Input("alerts-project", "value"),
    Input("alerts-version", "data"),
)
def show_alerts(_n_intervals: Any, states: list[str] | None, project: str | None, _version: Any) -> Any:
    """The alerts of the states ticked (and the project picked), every ALERTS_REFRESH_MS and after a
    change."""
    states = [state for state in ALERT_STATES if state in (states or [])]
    if not states:
        return html.P("Tick a state to see its alerts.", className="muted")
    api = services().api
    try:
        found = {
            state: api.alerts(project=project, limit=ALERTS_LIMIT, **ALERT_FILTERS[state]) for state in states
        }
        rules = {rule.get("id"): rule for rule in api.alert_rules(project)}
    except ApiError as exc:
        return error_banner(exc)
    alerts = [alert for shown, _ in found.values() for alert in shown]
    hidden = [
        f"{count - len(shown)} {state}" for state, (shown, count) in found.items() if count > len(shown)
    ]
    table = alerts_table(alerts, rules, services().run_href)
    if not hidden:
        return table
    note = f"Showing the newest {ALERTS_LIMIT} per state; not shown: {', '.join(hidden)}."
    return [table, html.P(note, className="muted")]


@callbacks.callback(
    Output("alerts-message", "children"),
    Output("alerts-version", "data"),
    Input({"type": "alert-ack", "alert": ALL}, "n_clicks"),
    State("alerts-version", "data"),
    prevent_initial_call=True,
)
def acknowledge(_clicks: list[Any], version: int | None) -> tuple[Any, Any]:
    """An alert's Acknowledge button: acknowledged through the API, the table then redrawn."""
    alert_id = clicked_id(ctx, "alert")
    if alert_id is None:
        return dash.no_update, dash.no_update
    try:
        services().api.acknowledge_alert(alert_id)
    except ApiError as exc:
        return form_message(exc), (version or 0) + 1
    return form_message(success=f"Alert {alert_id} acknowledged."), (version or 0) + 1
