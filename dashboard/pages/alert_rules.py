"""The Alerts page's rules card: the rules of every project the token sees, with their parameters;
create one (its type, and its parameters' defaults and bounds, from GET /api/v1/alert-rules/types,
held in the page's `rule-types` store), edit a rule's parameters, name and cooldown in the editor its
Edit button opens, enable or disable it, delete it. What the server refuses is shown by the form.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from ..api_client import ApiError
from ..callbacks import PageCallbacks, services
from ..views import error_banner, form_message, severity_badge
from .alerts_views import (
    card,
    clicked_id,
    field,
    form_row,
    heading,
    param_inputs,
    primary_button,
    project_field,
    rule_params,
    rule_settings,
    rules_table,
    text_field,
)

__all__ = ["callbacks", "rules_card"]

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

callbacks = PageCallbacks()


def rules_card(rule_types: list[dict[str, Any]], changes_allowed: bool = True) -> html.Div:
    """The rules card: the table (filled by show_rules), the rule editor, the new-rule form (its
    types from `rule_types`; without `changes_allowed` its button is disabled)."""
    type_options = [
        {"label": f"{spec.get('type')} ({spec.get('severity')})", "value": spec.get("type")}
        for spec in rule_types
    ]
    return card(
        "rules",
        heading(
            "Rules",
            "Rules are checked on every batch a run sends. New projects get the default "
            "rules; a changed rule starts over and resolves its open alerts.",
        ),
        _rule_editor(),
        html.H3("New rule"),
        form_row(
            project_field("rule-project"),
            field(
                "Type",
                dcc.Dropdown(
                    id="rule-type",
                    options=type_options,
                    value=None,
                    placeholder="rule type",
                    className="type-pick",
                ),
            ),
            text_field("Name", "rule-name", placeholder="optional"),
            text_field("Cooldown steps", "rule-cooldown", "text-input short", placeholder="default"),
        ),
        html.Div(id="rule-type-doc", className="type-doc"),
        html.Div(id="rule-params", className="params"),
        primary_button("Create rule", "rule-create", disabled=not changes_allowed),
        html.Div(id="rule-form-message"),
    )


def _rule_editor() -> html.Div:
    return html.Div(
        [
            html.H3(id="rule-edit-title"),
            html.Div(id="rule-edit-params", className="params"),
            form_row(
                text_field("Name", "rule-edit-name"),
                text_field("Cooldown steps", "rule-edit-cooldown", "text-input short"),
            ),
            html.Div(
                [
                    primary_button("Save", "rule-edit-save"),
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


@callbacks.callback(Output("rules-table", "children"), Input("rules-version", "data"))
def show_rules(_version: Any) -> Any:
    """The rules table, as the page opens and after every change."""
    try:
        return rules_table(services().api.alert_rules())
    except ApiError as exc:
        return error_banner(exc)


@callbacks.callback(
    Output("rule-params", "children"),
    Output("rule-type-doc", "children"),
    Input("rule-type", "value"),
    State("rule-types", "data"),
)
def show_rule_type(rule_type: str | None, types: list[dict[str, Any]] | None) -> tuple[Any, Any]:
    """The new-rule form's parameter fields and description, for the type picked."""
    spec = _type_spec(types, rule_type)
    if spec is None:
        return [], None
    doc = [severity_badge(spec.get("severity")), " ", str(spec.get("description") or "")]
    return param_inputs("rule-param", spec.get("params") or {}), doc


@callbacks.callback(
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
    """Create rule: the form as a new rule (only the parameters changed from their defaults)."""
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
        created = services().api.create_alert_rule(rule)
    except ApiError as exc:
        return form_message(exc), dash.no_update
    text = (
        f"Created rule “{created.get('name')}” ({created.get('type')}) "
        f"for project “{created.get('project')}”."
    )
    return form_message(success=text), (version or 0) + 1


@callbacks.callback(
    Output("rules-message", "children"),
    Output("rules-version", "data", allow_duplicate=True),
    Input({"type": "rule-toggle", "rule": ALL, "enable": ALL}, "n_clicks"),
    Input({"type": "rule-delete", "rule": ALL}, "n_clicks"),
    State("rules-version", "data"),
    prevent_initial_call=True,
)
def change_rule(_toggles: Any, _deletes: Any, version: int | None) -> tuple[Any, Any]:
    """A rule's Enable/Disable or Delete button."""
    rule_id = clicked_id(ctx, "rule")
    if rule_id is None:
        return dash.no_update, dash.no_update
    api = services().api
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


@callbacks.callback(
    output=RULE_EDITOR_OUTPUTS,
    inputs=[Input({"type": "rule-edit", "rule": ALL}, "n_clicks"), Input("rule-edit-cancel", "n_clicks")],
    state=[State("rule-types", "data")],
    prevent_initial_call=True,
)
def open_editor(_edits: Any, _cancel: Any, types: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A rule's Edit button opens the editor with the rule as the server has it; Cancel closes it."""
    if ctx.triggered_id == "rule-edit-cancel":
        return EDITOR_CLOSED
    rule_id = clicked_id(ctx, "rule")
    if rule_id is None:
        return dict.fromkeys(RULE_EDITOR_OUTPUTS, dash.no_update)
    try:
        rule = services().api.alert_rule(rule_id)
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


@callbacks.callback(
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
    """The editor's Save: the rule's parameters, name and cooldown as the editor has them."""
    if not isinstance(rule_id, int):
        return (dash.no_update,) * 4
    texts = {component_id["param"]: value for component_id, value in zip(ids, values, strict=True)}
    api = services().api
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


def _type_spec(types: list[dict[str, Any]] | None, rule_type: str | None) -> dict[str, Any] | None:
    return next((spec for spec in types or [] if spec.get("type") == rule_type), None)
