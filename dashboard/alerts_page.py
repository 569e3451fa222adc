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
lay out with the pure view functions at the bottom (tested without a browser).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from .api_client import ApiClient, ApiError
from .views import (
    ALERT_STATES,
    alert_state,
    error_banner,
    form_message,
    format_step,
    format_time,
    severity_badge,
    status_badge,
    summarize_fields,
)

__all__ = [
    "ALERT_FILTERS",
    "alerts_layout",
    "alerts_table",
    "delivery_outcome",
    "param_inputs",
    "parse_param",
    "register_callbacks",
    "rule_params",
    "rules_table",
    "webhooks_table",
]

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
WEBHOOK_FORMATS = {"json": "Generic JSON", "slack": "Slack", "discord": "Discord"}
_STATE_ORDER = {state: index for index, state in enumerate(ALERT_STATES)}
_INTEGER = re.compile(r"^[+-]?\d+$")

RunHref = Callable[[str, Any], str]  # (run id, step or None) → the run page's URL


# -- callbacks -------------------------------------------------------------------------------------


def register_callbacks(app: dash.Dash, api: ApiClient, run_href: RunHref) -> None:
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
        if not (project or "").strip():
            return form_message("Enter the project the rule watches."), dash.no_update
        if spec is None:
            return form_message("Choose a rule type."), dash.no_update
        texts = {component_id["param"]: value for component_id, value in zip(ids, values)}
        rule: dict[str, Any] = {
            "project": project.strip(),
            "type": rule_type,
            "params": rule_params(spec.get("params") or {}, texts, only_changed=True),
        }
        if (name or "").strip():
            rule["name"] = name.strip()
        if str(cooldown or "").strip():
            rule["cooldown_steps"] = parse_param(str(cooldown), 0)
        try:
            created = api.create_alert_rule(rule)
        except ApiError as exc:
            return form_message(exc), dash.no_update
        text = f"Created rule “{created.get('name')}” ({created.get('type')}) for project “{created.get('project')}”."
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
        Output("rule-editor", "hidden"),
        Output("rule-edit-title", "children"),
        Output("rule-edit-params", "children"),
        Output("rule-edit-name", "value"),
        Output("rule-edit-cooldown", "value"),
        Output("rule-editing", "data"),
        Output("rule-edit-message", "children"),
        Input({"type": "rule-edit", "rule": ALL}, "n_clicks"),
        Input("rule-edit-cancel", "n_clicks"),
        State("rule-types", "data"),
        prevent_initial_call=True,
    )
    def open_editor(_edits: Any, _cancel: Any, types: list[dict[str, Any]] | None) -> tuple[Any, ...]:
        closed = (True, None, [], None, None, None, None)
        if ctx.triggered_id == "rule-edit-cancel":
            return closed
        rule_id = _clicked_id(ctx, "rule")
        if rule_id is None:
            return (dash.no_update,) * 7
        try:
            rule = api.alert_rule(rule_id)
        except ApiError as exc:
            return (False, f"Rule {rule_id}", [], None, None, None, form_message(exc))
        spec = _type_spec(types, rule.get("type")) or {"params": {}}
        title = f"Edit rule “{rule.get('name')}” ({rule.get('type')}, project “{rule.get('project')}”)"
        params = param_inputs("rule-edit-param", spec.get("params") or {}, rule.get("params") or {})
        return (False, title, params, rule.get("name"), str(rule.get("cooldown_steps", "")), rule_id, None)

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
        texts = {component_id["param"]: value for component_id, value in zip(ids, values)}
        try:
            rule = api.alert_rule(rule_id)
            spec = _type_spec(types, rule.get("type")) or {"params": {}}
            changes: dict[str, Any] = {"params": rule_params(spec.get("params") or {}, texts)}
            if (name or "").strip():
                changes["name"] = name.strip()
            if str(cooldown or "").strip():
                changes["cooldown_steps"] = parse_param(str(cooldown), 0)
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
        if not (project or "").strip():
            return form_message("Enter the project whose alerts the webhook receives."), dash.no_update
        if not (url or "").strip():
            return form_message("Enter the URL to send alerts to."), dash.no_update
        webhook = {"project": project.strip(), "url": url.strip(), "format": webhook_format or "json"}
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
                    "text": f"Not sent within {TEST_POLL_TIMEOUT_S:.0f} s: is the server's delivery worker on?",
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


# -- parameters ------------------------------------------------------------------------------------


def parse_param(text: Any, default: Any) -> Any:
    """A typed-in parameter as JSON for the API: true/false as booleans; for a parameter whose
    default is a string, the text; otherwise an int or float where the text is one. Anything else is
    sent as typed, so the server says what is wrong with it (422)."""
    if not isinstance(text, str):
        return text
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if isinstance(default, str):
        return text
    if _INTEGER.match(text):
        return int(text)
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def param_text(value: Any) -> str:
    """A parameter's value as the form shows it: 8, 0.01, 1e-06, true, update/ratio."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def rule_params(
    specs: dict[str, Any], texts: dict[str, Any], *, only_changed: bool = False
) -> dict[str, Any]:
    """The "params" of a rule from the form's texts (by parameter name). Empty fields are left out
    (the server uses the default); with only_changed, so are values equal to the default."""
    params: dict[str, Any] = {}
    for name, text in texts.items():
        if text is None or (isinstance(text, str) and not text.strip()):
            continue
        default = (specs.get(name) or {}).get("default")
        value = parse_param(text, default)
        if only_changed and _same(value, default):
            continue
        params[name] = value
    return params


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value == default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return float(value) == float(default)
    return value == default


def param_inputs(kind: str, specs: dict[str, Any], values: dict[str, Any] | None = None) -> list[Any]:
    """One labelled text field per parameter (id {"type": kind, "param": name}), holding the rule's
    value or else the default, with the parameter's doc, default and bounds beside it."""
    fields = []
    for name, spec in specs.items():
        spec = spec if isinstance(spec, dict) else {}
        value = (values or {}).get(name, spec.get("default"))
        fields.append(
            html.Label(
                [
                    html.Span(name, className="param-name"),
                    dcc.Input(
                        id={"type": kind, "param": name},
                        type="text",
                        value=param_text(value),
                        debounce=False,
                        className="param-input",
                    ),
                    html.Span(_param_help(spec), className="muted param-help"),
                ],
                className="param",
            )
        )
    if not fields:
        fields.append(html.P("This rule type has no parameters.", className="muted"))
    return fields


def _param_help(spec: dict[str, Any]) -> str:
    parts = [str(spec["doc"])] if spec.get("doc") else []
    if "default" in spec:
        parts.append(f"default {param_text(spec['default'])}")
    if spec.get("minimum") is not None:
        parts.append(f"min {param_text(spec['minimum'])}")
    if spec.get("maximum") is not None:
        parts.append(f"max {param_text(spec['maximum'])}")
    return " · ".join(parts)


# -- deliveries ------------------------------------------------------------------------------------


def delivery_outcome(delivery: dict[str, Any] | None) -> dict[str, str]:
    """{"state", "text"} of a test delivery for people. state: "sending" (no answer yet),
    "delivered", or "failed" (also a failed first attempt that will be retried). The text has the
    receiver's HTTP status, or the error when there was no answer (e.g. connection refused)."""
    delivery = delivery or {}
    status = delivery.get("status")
    code = delivery.get("response_status")
    attempts = delivery.get("attempts") or 0
    # The outbox records "HTTP 500: <body>" or the transport's error as last_error.
    what = delivery.get("last_error") or (f"HTTP {code}" if code is not None else "no answer")
    if status == "delivered":
        after = f" after {attempts} attempts" if attempts > 1 else ""
        return {"state": "delivered", "text": f"Delivered: HTTP {code}{after}."}
    if status == "failed":
        return {"state": "failed", "text": f"Failed after {attempts} attempts: {what}."}
    if status == "pending" and attempts > 0:
        retry = delivery.get("next_attempt_at")
        when = f"; retrying at {format_time(retry)}" if retry else ""
        return {"state": "failed", "text": f"Attempt {attempts} failed: {what}{when}."}
    return {"state": "sending", "text": "Sending…"}


# -- views (pure: data in, components out) ------------------------------------------------------------


def alerts_layout(
    rule_types: list[dict[str, Any]], projects: list[str], problem: ApiError | None = None
) -> html.Div:
    """The Alerts page: alerts, rules and webhooks. `rule_types` from GET /alert-rules/types,
    `projects` offered in the pickers; `problem`: why either could not be loaded."""
    type_options = [
        {"label": f"{spec.get('type')} ({spec.get('severity')})", "value": spec.get("type")}
        for spec in rule_types
    ]
    project_options = [{"label": project, "value": project} for project in projects]
    return html.Div(
        [
            html.H1("Alerts"),
            error_banner(problem) if problem is not None else None,
            dcc.Store(id="rule-types", data=rule_types),
            dcc.Store(id="alerts-version", data=0),
            dcc.Store(id="rules-version", data=0),
            dcc.Store(id="webhooks-version", data=0),
            dcc.Store(id="webhook-tests", data={}),
            dcc.Store(id="rule-editing", data=None),
            html.Datalist([html.Option(value=project) for project in projects], id="known-projects"),
            dcc.Interval(id="alerts-refresh", interval=ALERTS_REFRESH_MS),
            dcc.Interval(id="webhook-test-poll", interval=TEST_POLL_MS, disabled=True),
            html.Div(
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
                    html.Div(id="alerts-message"),
                    html.Div(html.P("Loading alerts…", className="muted"), id="alerts-table"),
                ],
                className="card",
                id="alerts-card",
            ),
            html.Div(
                [
                    html.H2("Rules"),
                    html.P(
                        "Rules are checked on every batch a run sends. New projects get the default "
                        "rules; a changed rule starts over and resolves its open alerts.",
                        className="muted hint",
                    ),
                    html.Div(id="rules-message"),
                    html.Div(html.P("Loading rules…", className="muted"), id="rules-table"),
                    _rule_editor(),
                    html.H3("New rule"),
                    html.Div(
                        [
                            _field(
                                "Project",
                                dcc.Input(
                                    id="rule-project",
                                    type="text",
                                    list="known-projects",
                                    placeholder="project",
                                    className="text-input",
                                ),
                            ),
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
                            _field(
                                "Name",
                                dcc.Input(
                                    id="rule-name",
                                    type="text",
                                    placeholder="optional",
                                    className="text-input",
                                ),
                            ),
                            _field(
                                "Cooldown steps",
                                dcc.Input(
                                    id="rule-cooldown",
                                    type="text",
                                    placeholder="default",
                                    className="text-input short",
                                ),
                            ),
                        ],
                        className="form-row",
                    ),
                    html.Div(id="rule-type-doc", className="type-doc"),
                    html.Div(id="rule-params", className="params"),
                    html.Button("Create rule", id="rule-create", className="button primary", n_clicks=0),
                    html.Div(id="rule-form-message"),
                ],
                className="card",
                id="rules-card",
            ),
            html.Div(
                [
                    html.H2("Webhooks"),
                    html.P(
                        "A project's alerts are POSTed to its webhooks when they fire and when they "
                        "resolve; with a secret, each request is signed (HMAC-SHA256).",
                        className="muted hint",
                    ),
                    html.Div(id="webhooks-message"),
                    html.Div(html.P("Loading webhooks…", className="muted"), id="webhooks-table"),
                    html.H3("New webhook"),
                    html.Div(
                        [
                            _field(
                                "Project",
                                dcc.Input(
                                    id="webhook-project",
                                    type="text",
                                    list="known-projects",
                                    placeholder="project",
                                    className="text-input",
                                ),
                            ),
                            _field(
                                "URL",
                                dcc.Input(
                                    id="webhook-url",
                                    type="text",
                                    placeholder="https://hooks.slack.com/services/…",
                                    className="text-input wide",
                                ),
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
                            _field(
                                "Secret",
                                dcc.Input(
                                    id="webhook-secret",
                                    type="password",
                                    placeholder="optional, signs requests",
                                    className="text-input",
                                ),
                            ),
                        ],
                        className="form-row",
                    ),
                    html.Button("Add webhook", id="webhook-create", className="button primary", n_clicks=0),
                    html.Div(id="webhook-form-message"),
                ],
                className="card",
                id="webhooks-card",
            ),
        ]
    )


def _field(label: str, control: Any) -> html.Label:
    return html.Label([html.Span(label, className="field-label"), control], className="field")


def _rule_editor() -> html.Div:
    return html.Div(
        [
            html.H3(id="rule-edit-title"),
            html.Div(id="rule-edit-params", className="params"),
            html.Div(
                [
                    _field("Name", dcc.Input(id="rule-edit-name", type="text", className="text-input")),
                    _field(
                        "Cooldown steps",
                        dcc.Input(id="rule-edit-cooldown", type="text", className="text-input short"),
                    ),
                ],
                className="form-row",
            ),
            html.Div(
                [
                    html.Button("Save", id="rule-edit-save", className="button primary", n_clicks=0),
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


def alerts_table(alerts: list[dict[str, Any]], rules: dict[Any, dict[str, Any]], run_href: RunHref) -> Any:
    """Alerts, open first, then acknowledged, then resolved; newest first within each."""
    if not alerts:
        return html.P("No alerts here. Quiet runs, or rules still to be written.", className="muted")
    ordered = sorted(alerts, key=lambda alert: (_STATE_ORDER[alert_state(alert)], -(alert.get("id") or 0)))
    header = html.Thead(
        html.Tr(
            [
                html.Th(label)
                for label in (
                    "State",
                    "Severity",
                    "Rule",
                    "Run",
                    "Step",
                    "What happened",
                    "Opened",
                    "Resolved",
                    "",
                )
            ]
        )
    )
    rows = [_alert_row(alert, rules, run_href) for alert in ordered]
    return html.Table([header, html.Tbody(rows)], className="table alerts")


def _alert_row(alert: dict[str, Any], rules: dict[Any, dict[str, Any]], run_href: RunHref) -> html.Tr:
    state = alert_state(alert)
    rule = rules.get(alert.get("rule_id"))
    rule_name = str(rule.get("name")) if rule else "(deleted rule)" if alert.get("rule_id") is None else "–"
    run_id = str(alert.get("run_id") or "")
    step = alert.get("step")
    evidence = alert.get("evidence") if isinstance(alert.get("evidence"), dict) else {}
    action: Any = None
    if state == "open" and isinstance(alert.get("id"), int):
        action = _row_button("Acknowledge", {"type": "alert-ack", "alert": alert["id"]})
    resolved = format_time(alert.get("resolved_at"))
    if isinstance(alert.get("resolved_step"), int):
        resolved += f" (step {format_step(alert['resolved_step'])})"
    return html.Tr(
        [
            html.Td(status_badge(state)),
            html.Td(severity_badge(alert.get("severity"))),
            html.Td(
                [html.Div(rule_name), html.Div(str(alert.get("type") or ""), className="muted small")],
                className="name-cell",
            ),
            html.Td(
                [
                    dcc.Link(str(alert.get("run_name") or run_id), href=run_href(run_id, step))
                    if run_id
                    else "–",
                    html.Div(str(alert.get("project") or ""), className="muted small"),
                ],
                className="name-cell",
            ),
            html.Td(format_step(step), className="num"),
            html.Td(
                [
                    html.Div(str(alert.get("title") or ""), className="alert-title"),
                    html.Div(summarize_fields(evidence, leave_out=("link",)), className="evidence"),
                    html.Div(str(alert.get("hint") or ""), className="muted small"),
                ]
            ),
            html.Td(format_time(alert.get("created_at")), className="muted time"),
            html.Td(resolved, className="muted time"),
            html.Td(action),
        ],
        className=f"alert-{state}",
        **{"data-alert": str(alert.get("id"))},
    )


def rules_table(rules: list[dict[str, Any]]) -> Any:
    """Rules by project, each with Edit, Enable/Disable and Delete buttons."""
    if not rules:
        return html.P(
            "No rules yet: a project gets the default rules when its first run arrives.", className="muted"
        )
    header = html.Thead(
        html.Tr(
            [html.Th(label) for label in ("Project", "Name", "Type", "Parameters", "Cooldown", "State", "")]
        )
    )
    rows = []
    for rule in sorted(rules, key=lambda rule: (str(rule.get("project")), rule.get("id") or 0)):
        rule_id = rule.get("id")
        enabled = bool(rule.get("enabled"))
        scope = f"run {rule['run_id']}" if rule.get("run_id") else "all runs"
        params = rule.get("params") if isinstance(rule.get("params"), dict) else {}
        rows.append(
            html.Tr(
                [
                    html.Td(
                        [html.Div(str(rule.get("project") or "")), html.Div(scope, className="muted small")]
                    ),
                    html.Td(str(rule.get("name") or "")),
                    html.Td(
                        [severity_badge(rule.get("severity")), " ", str(rule.get("type") or "")],
                        title=str(rule.get("description") or ""),
                    ),
                    html.Td(
                        ", ".join(f"{name}={param_text(value)}" for name, value in params.items()),
                        className="layers",
                    ),
                    html.Td(format_step(rule.get("cooldown_steps")), className="num"),
                    html.Td(
                        html.Span(
                            "enabled" if enabled else "disabled",
                            className="badge badge-ok" if enabled else "badge",
                        )
                    ),
                    html.Td(
                        [
                            _row_button("Edit", {"type": "rule-edit", "rule": rule_id}),
                            _row_button("Disable" if enabled else "Enable", {"type": "rule-toggle", "rule": rule_id, "enable": not enabled}),
                            _row_button("Delete", {"type": "rule-delete", "rule": rule_id}, danger=True),
                        ],
                        className="actions",
                    ),
                ],
                **{"data-rule": str(rule_id)},
            )
        )
    return html.Table([header, html.Tbody(rows)], className="table rules")


def webhooks_table(webhooks: list[dict[str, Any]], tests: dict[str, Any]) -> Any:
    """Webhooks with Send test and Delete buttons, and the outcome of the last test of each."""
    if not webhooks:
        return html.P("No webhooks yet: alerts show here only.", className="muted")
    header = html.Thead(
        html.Tr(
            [html.Th(label) for label in ("Project", "URL", "Format", "Signed", "Created", "Last test", "")]
        )
    )
    rows = []
    for webhook in webhooks:
        webhook_id = webhook.get("id")
        test = tests.get(str(webhook_id)) or {}
        result_class = {"delivered": "test-ok", "failed": "test-bad"}.get(test.get("state"), "muted")
        rows.append(
            html.Tr(
                [
                    html.Td(str(webhook.get("project") or "")),
                    html.Td(str(webhook.get("url") or ""), className="url"),
                    html.Td(
                        WEBHOOK_FORMATS.get(str(webhook.get("format")), str(webhook.get("format") or ""))
                    ),
                    html.Td("yes" if webhook.get("signed") else "no"),
                    html.Td(format_time(webhook.get("created_at")), className="muted time"),
                    html.Td(
                        str(test.get("text") or "–"), className=f"test-result {result_class}", role="status"
                    ),
                    html.Td(
                        [
                            _row_button("Send test", {"type": "webhook-test", "webhook": webhook_id}),
                            _row_button("Delete", {"type": "webhook-delete", "webhook": webhook_id}, danger=True),
                        ],
                        className="actions",
                    ),
                ],
                **{"data-webhook": str(webhook_id)},
            )
        )
    return html.Table([header, html.Tbody(rows)], className="table webhooks")


def _row_button(label: str, component_id: dict[str, Any], danger: bool = False) -> html.Button:
    """A small action button of a table row (Acknowledge, Edit, Delete…), told apart by its id."""
    return html.Button(label, id=component_id, className="button small danger" if danger else "button small",
                       n_clicks=0)
