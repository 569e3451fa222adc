"""The Alerts page (/dashboard/alerts): alerts with their evidence, the rules that raise them, and the
webhooks they are sent to.

    alerts     open first, then acknowledged, then resolved; filtered by state and project; each with
               its rule, run (linked to the run page at the alert's step), evidence and times, and an
               Acknowledge button while open
    rules      the project's rules with their parameters; create one (its type and the parameters'
               defaults and bounds come from the server: GET /api/v1/alert-rules/types), edit its
               parameters, name and cooldown, enable or disable it, delete it
    webhooks   create (generic JSON, Slack, Discord; optional HMAC secret) and delete; "Send test"
               queues a test notification and follows its delivery until the receiver answered

Every change goes through the API; what the server refuses (e.g. 422 for a threshold out of bounds)
is shown next to the form with the server's message. Callbacks are thin: fetch with the ApiClient,
lay out with the pure views of `alerts_views` (tested without a browser).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from ..api_client import ApiClient, ApiError
from ..views import ALERT_STATES, RunHref, error_banner, form_message, severity_badge
from .alerts_views import (
    WEBHOOK_FORMATS,
    alerts_table,
    delivery_outcome,
    param_inputs,
    rule_params,
    rule_settings,
    rules_table,
    text_input,
    webhooks_table,
)

if TYPE_CHECKING:
    from ..app import Background

__all__ = ["ALERT_FILTERS", "alerts_layout", "layout", "register"]

ALERTS_REFRESH_MS = 5000
ALERTS_LIMIT = 200  # the page shows the newest this many alerts of each state
# What the API is asked for each state the page shows.
ALERT_FILTERS: dict[str, dict[str, Any]] = {
    "open": {"status": "firing", "acknowledged": False},
    "acknowledged": {"status": "firing", "acknowledged": True},
    "resolved": {"status": "resolved"},
}
RUNS_FOR_PROJECTS = 500  # the newest runs whose projects the project pickers offer
TEST_POLL_MS = 700
TEST_POLL_TIMEOUT_S = 30.0
# The rule editor (opened by a rule's Edit button), by name.
RULE_EDITOR_OUTPUTS = {
    "hidden": Output("rule-editor", "hidden"),
    "title": Output("rule-edit-title", "children"),
    "params": Output("rule-edit-params", "children"),
    "name": Output("rule-edit-name", "value"),
    "cooldown": Output("rule-edit-cooldown", "value"),
    "rule_id": Output("rule-editing", "data"),
    "message": Output("rule-edit-message", "children"),
}
EDITOR_CLOSED: dict[str, Any] = {
    "hidden": True,
    "title": None,
    "params": [],
    "name": None,
    "cooldown": None,
    "rule_id": None,
    "message": None,
}


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
    type_options = [
        {"label": f"{spec.get('type')} ({spec.get('severity')})", "value": spec.get("type")}
        for spec in rule_types
    ]
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
            dcc.Interval(id="webhook-test-poll", interval=TEST_POLL_MS, disabled=True),
            _card(
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
            _card(
                "rules",
                _heading(
                    "Rules",
                    "Rules are checked on every batch a run sends. New projects get the default "
                    "rules; a changed rule starts over and resolves its open alerts.",
                ),
                _rule_editor(),
                html.H3("New rule"),
                _form_row(
                    _project_field("rule-project"),
                    _field(
                        "Type",
                        dcc.Dropdown(
                            id="rule-type",
                            options=type_options,
                            value=None,
                            placeholder="rule type",
                            className="type-pick",
                        ),
                    ),
                    _text_field("Name", "rule-name", placeholder="optional"),
                    _text_field("Cooldown steps", "rule-cooldown", "text-input short", placeholder="default"),
                ),
                html.Div(id="rule-type-doc", className="type-doc"),
                html.Div(id="rule-params", className="params"),
                _primary_button("Create rule", "rule-create", disabled=not changes_allowed),
                html.Div(id="rule-form-message"),
            ),
            _card(
                "webhooks",
                _heading(
                    "Webhooks",
                    "A project's alerts are POSTed to its webhooks when they fire and when they "
                    "resolve; with a secret, each request is signed (HMAC-SHA256).",
                ),
                html.H3("New webhook"),
                _form_row(
                    _project_field("webhook-project"),
                    _text_field(
                        "URL",
                        "webhook-url",
                        "text-input wide",
                        placeholder="https://hooks.slack.com/services/…",
                    ),
                    _field(
                        "Format",
                        dcc.RadioItems(
                            id="webhook-format",
                            options=[
                                {"label": f" {label}", "value": value}
                                for value, label in WEBHOOK_FORMATS.items()
                            ],
                            value="json",
                            inline=True,
                            className="format-pick",
                        ),
                    ),
                    _text_field(
                        "Secret",
                        "webhook-secret",
                        input_type="password",
                        placeholder="optional, signs requests",
                    ),
                ),
                _primary_button("Add webhook", "webhook-create", disabled=not changes_allowed),
                html.Div(id="webhook-form-message"),
            ),
        ]
    )


# -- the page's building blocks: each card, form row and field is made by one of these -------------


def _card(name: str, top: list[Any], *rest: Any) -> html.Div:
    """Card `{name}-card`: `top`, then `{name}-message` and `{name}-table` (filled by the callbacks,
    "Loading {name}…" until then), then `rest` (the card's form)."""
    loading = html.P(f"Loading {name}…", className="muted")
    return html.Div(
        [*top, html.Div(id=f"{name}-message"), html.Div(loading, id=f"{name}-table"), *rest],
        className="card",
        id=f"{name}-card",
    )


def _heading(title: str, hint: str) -> list[Any]:
    return [html.H2(title), html.P(hint, className="muted hint")]


def _form_row(*fields: Any) -> html.Div:
    return html.Div(list(fields), className="form-row")


def _field(label: str, control: Any) -> html.Label:
    return html.Label([html.Span(label, className="field-label"), control], className="field")


def _text_field(label: str, component_id: str, class_name: str = "text-input", **props: Any) -> html.Label:
    """A labelled text_input; `props` as text_input's (input_type, placeholder, list)."""
    return _field(label, text_input(component_id, class_name, **props))


def _project_field(component_id: str) -> html.Label:
    """The project a new rule or webhook is for: typed, with the known projects suggested."""
    return _text_field("Project", component_id, list="known-projects", placeholder="project")


def _primary_button(label: str, component_id: str, disabled: bool = False) -> html.Button:
    return html.Button(label, id=component_id, className="button primary", n_clicks=0, disabled=disabled)


def _rule_editor() -> html.Div:
    return html.Div(
        [
            html.H3(id="rule-edit-title"),
            html.Div(id="rule-edit-params", className="params"),
            _form_row(
                _text_field("Name", "rule-edit-name"),
                _text_field("Cooldown steps", "rule-edit-cooldown", "text-input short"),
            ),
            html.Div(
                [
                    _primary_button("Save", "rule-edit-save"),
                    html.Button("Cancel", id="rule-edit-cancel", className="button", n_clicks=0),
                ],
                className="buttons",
            ),
            html.Div(id="rule-edit-message"),
        ],
        id="rule-editor",
        className="editor",
        hidden=True,
    )


# -- callbacks -------------------------------------------------------------------------------------


def register(app: dash.Dash, api: ApiClient, run_href: RunHref) -> None:
    """The Alerts page's callbacks; `run_href(run_id, step)` links a run page at a step."""

    # -- alerts ------------------------------------------------------------------------------------

    @app.callback(
        Output("alerts-table", "children"),
        Input("alerts-refresh", "n_intervals"),
        Input("alerts-states", "value"),
        Input("alerts-project", "value"),
        Input("alerts-version", "data"),
    )
    def show_alerts(_n_intervals: Any, states: list[str] | None, project: str | None, _version: Any) -> Any:
        states = [state for state in ALERT_STATES if state in (states or [])]
        if not states:
            return html.P("Tick a state to see its alerts.", className="muted")
        try:
            found = {
                state: api.alerts(project=project, limit=ALERTS_LIMIT, **ALERT_FILTERS[state])
                for state in states
            }
            rules = {rule.get("id"): rule for rule in api.alert_rules(project)}
        except ApiError as exc:
            return error_banner(exc)
        alerts = [alert for shown, _ in found.values() for alert in shown]
        hidden = [
            f"{count - len(shown)} {state}" for state, (shown, count) in found.items() if count > len(shown)
        ]
        table = alerts_table(alerts, rules, run_href)
        if not hidden:
            return table
        note = f"Showing the newest {ALERTS_LIMIT} per state; not shown: {', '.join(hidden)}."
        return [table, html.P(note, className="muted")]

    @app.callback(
        Output("alerts-message", "children"),
        Output("alerts-version", "data"),
        Input({"type": "alert-ack", "alert": ALL}, "n_clicks"),
        State("alerts-version", "data"),
        prevent_initial_call=True,
    )
    def acknowledge(_clicks: list[Any], version: int | None) -> tuple[Any, Any]:
        alert_id = _clicked_id(ctx, "alert")
        if alert_id is None:
            return dash.no_update, dash.no_update
        try:
            api.acknowledge_alert(alert_id)
        except ApiError as exc:
            return form_message(exc), (version or 0) + 1
        return form_message(success=f"Alert {alert_id} acknowledged."), (version or 0) + 1

    # -- rules -------------------------------------------------------------------------------------

    @app.callback(Output("rules-table", "children"), Input("rules-version", "data"))
    def show_rules(_version: Any) -> Any:
        try:
            return rules_table(api.alert_rules())
        except ApiError as exc:
            return error_banner(exc)

    @app.callback(
        Output("rule-params", "children"),
        Output("rule-type-doc", "children"),
        Input("rule-type", "value"),
        State("rule-types", "data"),
    )
    def show_rule_type(rule_type: str | None, types: list[dict[str, Any]] | None) -> tuple[Any, Any]:
        spec = _type_spec(types, rule_type)
        if spec is None:
            return [], None
        doc = [severity_badge(spec.get("severity")), " ", str(spec.get("description") or "")]
        return param_inputs("rule-param", spec.get("params") or {}), doc

    @app.callback(
        Output("rule-form-message", "children"),
        Output("rules-version", "data", allow_duplicate=True),
        Input("rule-create", "n_clicks"),
        State("rule-project", "value"),
        State("rule-type", "value"),
        State("rule-name", "value"),
        State("rule-cooldown", "value"),
        State({"type": "rule-param", "param": ALL}, "value"),
        State({"type": "rule-param", "param": ALL}, "id"),
        State("rule-types", "data"),
        State("rules-version", "data"),
        prevent_initial_call=True,
    )
    def create_rule(
        _clicks: Any,
        project: str | None,
        rule_type: str | None,
        name: str | None,
        cooldown: str | None,
        values: list[Any],
        ids: list[dict[str, str]],
        types: list[dict[str, Any]] | None,
        version: int | None,
    ) -> tuple[Any, Any]:
        spec = _type_spec(types, rule_type)
        project_name = (project or "").strip()
        if not project_name:
            return form_message("Enter the project the rule watches."), dash.no_update
        if spec is None:
            return form_message("Choose a rule type."), dash.no_update
        texts = {component_id["param"]: value for component_id, value in zip(ids, values, strict=True)}
        rule: dict[str, Any] = {
            "project": project_name,
            "type": rule_type,
            "params": rule_params(spec.get("params") or {}, texts, only_changed=True),
            **rule_settings(name, cooldown),
        }
        try:
            created = api.create_alert_rule(rule)
        except ApiError as exc:
            return form_message(exc), dash.no_update
        text = (
            f"Created rule “{created.get('name')}” ({created.get('type')}) "
            f"for project “{created.get('project')}”."
        )
        return form_message(success=text), (version or 0) + 1

    @app.callback(
        Output("rules-message", "children"),
        Output("rules-version", "data", allow_duplicate=True),
        Input({"type": "rule-toggle", "rule": ALL, "enable": ALL}, "n_clicks"),
        Input({"type": "rule-delete", "rule": ALL}, "n_clicks"),
        State("rules-version", "data"),
        prevent_initial_call=True,
    )
    def change_rule(_toggles: Any, _deletes: Any, version: int | None) -> tuple[Any, Any]:
        rule_id = _clicked_id(ctx, "rule")
        if rule_id is None:
            return dash.no_update, dash.no_update
        try:
            if ctx.triggered_id["type"] == "rule-delete":
                api.delete_alert_rule(rule_id)
                text = f"Deleted rule {rule_id}."
            else:
                enable = bool(ctx.triggered_id["enable"])
                api.update_alert_rule(rule_id, {"enabled": enable})
                text = f"{'Enabled' if enable else 'Disabled'} rule {rule_id}."
        except ApiError as exc:
            return form_message(exc), (version or 0) + 1
        return form_message(success=text), (version or 0) + 1

    @app.callback(
        output=RULE_EDITOR_OUTPUTS,
        inputs=[Input({"type": "rule-edit", "rule": ALL}, "n_clicks"), Input("rule-edit-cancel", "n_clicks")],
        state=[State("rule-types", "data")],
        prevent_initial_call=True,
    )
    def open_editor(_edits: Any, _cancel: Any, types: list[dict[str, Any]] | None) -> dict[str, Any]:
        if ctx.triggered_id == "rule-edit-cancel":
            return EDITOR_CLOSED
        rule_id = _clicked_id(ctx, "rule")
        if rule_id is None:
            return dict.fromkeys(RULE_EDITOR_OUTPUTS, dash.no_update)
        try:
            rule = api.alert_rule(rule_id)
        except ApiError as exc:
            failed = {"hidden": False, "title": f"Rule {rule_id}", "message": form_message(exc)}
            return {**EDITOR_CLOSED, **failed}
        spec = _type_spec(types, rule.get("type")) or {"params": {}}
        title = f"Edit rule “{rule.get('name')}” ({rule.get('type')}, project “{rule.get('project')}”)"
        return {
            "hidden": False,
            "title": title,
            "params": param_inputs("rule-edit-param", spec.get("params") or {}, rule.get("params") or {}),
            "name": rule.get("name"),
            "cooldown": str(rule.get("cooldown_steps", "")),
            "rule_id": rule_id,
            "message": None,
        }

    @app.callback(
        Output("rule-edit-message", "children", allow_duplicate=True),
        Output("rule-editor", "hidden", allow_duplicate=True),
        Output("rules-message", "children", allow_duplicate=True),
        Output("rules-version", "data", allow_duplicate=True),
        Input("rule-edit-save", "n_clicks"),
        State("rule-editing", "data"),
        State("rule-edit-name", "value"),
        State("rule-edit-cooldown", "value"),
        State({"type": "rule-edit-param", "param": ALL}, "value"),
        State({"type": "rule-edit-param", "param": ALL}, "id"),
        State("rule-types", "data"),
        State("rules-version", "data"),
        prevent_initial_call=True,
    )
    def save_rule(
        _clicks: Any,
        rule_id: int | None,
        name: str | None,
        cooldown: str | None,
        values: list[Any],
        ids: list[dict[str, str]],
        types: list[dict[str, Any]] | None,
        version: int | None,
    ) -> tuple[Any, ...]:
        if not isinstance(rule_id, int):
            return (dash.no_update,) * 4
        texts = {component_id["param"]: value for component_id, value in zip(ids, values, strict=True)}
        try:
            rule = api.alert_rule(rule_id)
            spec = _type_spec(types, rule.get("type")) or {"params": {}}
            changes: dict[str, Any] = {
                "params": rule_params(spec.get("params") or {}, texts),
                **rule_settings(name, cooldown),
            }
            saved = api.update_alert_rule(rule_id, changes)
        except ApiError as exc:
            return form_message(exc), False, dash.no_update, dash.no_update
        text = f"Saved rule “{saved.get('name')}”."
        return None, True, form_message(success=text), (version or 0) + 1

    # -- webhooks ----------------------------------------------------------------------------------

    @app.callback(
        Output("webhooks-table", "children"),
        Input("webhooks-version", "data"),
        Input("webhook-tests", "data"),
    )
    def show_webhooks(_version: Any, tests: dict[str, Any] | None) -> Any:
        try:
            return webhooks_table(api.webhooks(), tests or {})
        except ApiError as exc:
            return error_banner(exc)

    @app.callback(
        Output("webhook-form-message", "children"),
        Output("webhooks-version", "data", allow_duplicate=True),
        Input("webhook-create", "n_clicks"),
        State("webhook-project", "value"),
        State("webhook-url", "value"),
        State("webhook-format", "value"),
        State("webhook-secret", "value"),
        State("webhooks-version", "data"),
        prevent_initial_call=True,
    )
    def create_webhook(
        _clicks: Any,
        project: str | None,
        url: str | None,
        webhook_format: str | None,
        secret: str | None,
        version: int | None,
    ) -> tuple[Any, Any]:
        project_name = (project or "").strip()
        if not project_name:
            return form_message("Enter the project whose alerts the webhook receives."), dash.no_update
        target_url = (url or "").strip()
        if not target_url:
            return form_message("Enter the URL to send alerts to."), dash.no_update
        webhook = {"project": project_name, "url": target_url, "format": webhook_format or "json"}
        if secret:
            webhook["secret"] = secret
        try:
            created = api.create_webhook(webhook)
        except ApiError as exc:
            return form_message(exc), dash.no_update
        return form_message(success=f"Added webhook {created.get('id')}."), (version or 0) + 1

    @app.callback(
        Output("webhooks-message", "children"),
        Output("webhooks-version", "data", allow_duplicate=True),
        Output("webhook-tests", "data", allow_duplicate=True),
        Output("webhook-test-poll", "disabled", allow_duplicate=True),
        Input({"type": "webhook-test", "webhook": ALL}, "n_clicks"),
        Input({"type": "webhook-delete", "webhook": ALL}, "n_clicks"),
        State("webhook-tests", "data"),
        State("webhooks-version", "data"),
        prevent_initial_call=True,
    )
    def webhook_action(
        _tests: Any, _deletes: Any, tests: dict[str, Any] | None, version: int | None
    ) -> tuple[Any, ...]:
        webhook_id = _clicked_id(ctx, "webhook")
        if webhook_id is None:
            return (dash.no_update,) * 4
        tests = dict(tests or {})
        try:
            if ctx.triggered_id["type"] == "webhook-delete":
                api.delete_webhook(webhook_id)
                tests.pop(str(webhook_id), None)
                return (
                    form_message(success=f"Deleted webhook {webhook_id}."),
                    (version or 0) + 1,
                    tests,
                    dash.no_update,
                )
            delivery = api.send_test(webhook_id)
        except ApiError as exc:
            return form_message(exc), (version or 0) + 1, dash.no_update, dash.no_update
        tests[str(webhook_id)] = {
            "delivery": delivery.get("id"),
            "started": time.time(),
            **delivery_outcome(delivery),
        }
        return None, dash.no_update, tests, False

    @app.callback(
        Output("webhook-tests", "data", allow_duplicate=True),
        Output("webhook-test-poll", "disabled", allow_duplicate=True),
        Input("webhook-test-poll", "n_intervals"),
        State("webhook-tests", "data"),
        prevent_initial_call=True,
    )
    def follow_tests(_n_intervals: Any, tests: dict[str, Any] | None) -> tuple[Any, Any]:
        tests = dict(tests or {})
        waiting = {key: test for key, test in tests.items() if test.get("state") == "sending"}
        if not waiting:
            return dash.no_update, True
        for key, test in waiting.items():
            try:
                deliveries = api.deliveries(int(key))
            except ApiError as exc:
                tests[key] = {
                    **test,
                    "state": "failed",
                    "text": f"Could not read the delivery log: {exc.detail}",
                }
                continue
            delivery = next((d for d in deliveries if d.get("id") == test.get("delivery")), None)
            outcome = delivery_outcome(delivery) if delivery else {"state": "sending", "text": "Sending…"}
            if outcome["state"] == "sending" and time.time() - test.get("started", 0) > TEST_POLL_TIMEOUT_S:
                outcome = {
                    "state": "failed",
                    "text": (
                        f"Not sent within {TEST_POLL_TIMEOUT_S:.0f} s: is the server's delivery worker on?"
                    ),
                }
            tests[key] = {**test, **outcome}
        still_waiting = any(test.get("state") == "sending" for test in tests.values())
        return tests, not still_waiting


def _clicked_id(context: Any, key: str) -> int | None:
    """The integer `key` of the pattern-matched button that was really clicked (redrawn tables add
    buttons with no clicks, which trigger too), else None."""
    trigger = context.triggered_id
    clicked = context.triggered[0].get("value") if context.triggered else None
    if not isinstance(trigger, dict) or not clicked:
        return None
    value = trigger.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _type_spec(types: list[dict[str, Any]] | None, rule_type: str | None) -> dict[str, Any] | None:
    return next((spec for spec in types or [] if spec.get("type") == rule_type), None)
