"""The Alerts page's pure pieces: API values in, components or API bodies out (no HTTP, no callbacks).

    alerts_table, rules_table, webhooks_table   the page's three tables, each row's buttons told
                                                apart by pattern-matching ids
    param_inputs, rule_params, parse_param      a rule's parameters as form fields, and the fields'
                                                texts back as the JSON the API takes
    rule_settings                               a rule form's name and cooldown fields as that JSON
    text_input                                  a one-line text field, as every form of the page has
    card, form_row, text_field, project_field,  the building blocks of the page's three cards and
    primary_button, ...                         their forms
    clicked_id                                  which row button a callback was triggered by
    delivery_outcome                            a test delivery's state for people

Every user- or server-supplied string is passed as a component's children or a title attribute, which
React renders as text, never as HTML.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from dash import dcc, html

from ..views import (
    ALERT_STATES,
    RunHref,
    alert_state,
    data_attributes,
    format_step,
    format_time,
    severity_badge,
    status_badge,
    summarize_fields,
)

__all__ = [
    "WEBHOOK_FORMATS",
    "alerts_table",
    "card",
    "clicked_id",
    "delivery_outcome",
    "field",
    "form_row",
    "heading",
    "param_inputs",
    "param_text",
    "parse_param",
    "primary_button",
    "project_field",
    "rule_params",
    "rule_settings",
    "rules_table",
    "text_field",
    "text_input",
    "webhooks_table",
]

WEBHOOK_FORMATS = {"json": "Generic JSON", "slack": "Slack", "discord": "Discord"}
_STATE_ORDER = {state: index for index, state in enumerate(ALERT_STATES)}
_INTEGER = re.compile(r"^[+-]?\d+$")


# -- tables ----------------------------------------------------------------------------------------


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
    evidence = alert.get("evidence")
    if not isinstance(evidence, dict):
        evidence = {}
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
        **data_attributes({"alert": str(alert.get("id"))}),
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
        params = rule.get("params")
        if not isinstance(params, dict):
            params = {}
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
                            _row_button(
                                "Disable" if enabled else "Enable",
                                {"type": "rule-toggle", "rule": rule_id, "enable": not enabled},
                            ),
                            _row_button("Delete", {"type": "rule-delete", "rule": rule_id}, danger=True),
                        ],
                        className="actions",
                    ),
                ],
                **data_attributes({"rule": str(rule_id)}),
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
    result_classes: dict[object, str] = {"delivered": "test-ok", "failed": "test-bad"}
    for webhook in webhooks:
        webhook_id = webhook.get("id")
        test = tests.get(str(webhook_id)) or {}
        result_class = result_classes.get(test.get("state"), "muted")
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
                            _row_button(
                                "Delete", {"type": "webhook-delete", "webhook": webhook_id}, danger=True
                            ),
                        ],
                        className="actions",
                    ),
                ],
                **data_attributes({"webhook": str(webhook_id)}),
            )
        )
    return html.Table([header, html.Tbody(rows)], className="table webhooks")


def _row_button(label: str, component_id: dict[str, Any], danger: bool = False) -> html.Button:
    """A small action button of a table row (Acknowledge, Edit, Delete…), told apart by its id."""
    return html.Button(
        label, id=component_id, className="button small danger" if danger else "button small", n_clicks=0
    )


def clicked_id(context: Any, key: str) -> int | None:
    """The integer `key` of the pattern-matched row button that was really clicked (`context`: dash's
    ctx; redrawn tables add buttons with no clicks, which trigger too), else None."""
    trigger = context.triggered_id
    clicked = context.triggered[0].get("value") if context.triggered else None
    if not isinstance(trigger, dict) or not clicked:
        return None
    value = trigger.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def rule_settings(name: str | None, cooldown: str | None) -> dict[str, Any]:
    """A rule form's Name and Cooldown steps fields as the API's "name" and "cooldown_steps", each
    left out while empty (a new rule gets the server's default, an edited one keeps its value)."""
    settings: dict[str, Any] = {}
    rule_name = (name or "").strip()
    if rule_name:
        settings["name"] = rule_name
    if str(cooldown or "").strip():
        settings["cooldown_steps"] = parse_param(str(cooldown), 0)
    return settings


def _same(value: object, default: object) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value == default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return float(value) == float(default)
    return value == default


def param_inputs(kind: str, specs: dict[str, Any], values: dict[str, Any] | None = None) -> list[Any]:
    """One labelled text field per parameter (id {"type": kind, "param": name}), holding the rule's
    value or else the default, with the parameter's doc, default and bounds beside it."""
    fields: list[Any] = []
    for name, spec in specs.items():
        spec = spec if isinstance(spec, dict) else {}
        value = (values or {}).get(name, spec.get("default"))
        fields.append(
            html.Label(
                [
                    html.Span(name, className="param-name"),
                    text_input(
                        {"type": kind, "param": name}, "param-input", value=param_text(value), debounce=False
                    ),
                    html.Span(_param_help(spec), className="muted param-help"),
                ],
                className="param",
            )
        )
    if not fields:
        fields.append(html.P("This rule type has no parameters.", className="muted"))
    return fields


def text_input(
    component_id: str | dict[str, Any],
    class_name: str = "text-input",
    input_type: Literal["text", "password"] = "text",
    **props: Any,
) -> dcc.Input:
    """A one-line text field (`input_type` "password" hides what is typed); `props` are further
    dcc.Input properties (placeholder, value, list, debounce), only those given."""
    return dcc.Input(id=component_id, type=input_type, className=class_name, **props)


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


# -- the page's building blocks: each card, form row and field is made by one of these -------------


def card(name: str, top: list[Any], *rest: Any) -> html.Div:
    """Card `{name}-card`: `top`, then `{name}-message` and `{name}-table` (filled by the callbacks,
    "Loading {name}…" until then), then `rest` (the card's form)."""
    loading = html.P(f"Loading {name}…", className="muted")
    return html.Div(
        [*top, html.Div(id=f"{name}-message"), html.Div(loading, id=f"{name}-table"), *rest],
        className="card",
        id=f"{name}-card",
    )


def heading(title: str, hint: str) -> list[Any]:
    """A card's title and the hint below it."""
    return [html.H2(title), html.P(hint, className="muted hint")]


def form_row(*fields: Any) -> html.Div:
    """Form fields side by side."""
    return html.Div(list(fields), className="form-row")


def field(label: str, control: Any) -> html.Label:
    """`control` with its label above it."""
    return html.Label([html.Span(label, className="field-label"), control], className="field")


def text_field(label: str, component_id: str, class_name: str = "text-input", **props: Any) -> html.Label:
    """A labelled text_input; `props` as text_input's (input_type, placeholder, list)."""
    return field(label, text_input(component_id, class_name, **props))


def project_field(component_id: str) -> html.Label:
    """The project a new rule or webhook is for: typed, with the known projects suggested."""
    return text_field("Project", component_id, list="known-projects", placeholder="project")


def primary_button(label: str, component_id: str, disabled: bool = False) -> html.Button:
    """A form's main button (Create rule, Add webhook, Save)."""
    return html.Button(label, id=component_id, className="button primary", n_clicks=0, disabled=disabled)
