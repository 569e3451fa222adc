"""The Alerts page's webhooks card: the webhooks a project's alerts are POSTed to; add one (generic
JSON, Slack, Discord; an optional secret signs each request), delete one. "Send test" queues a test
notification and follows its delivery (every TEST_POLL_MS, for TEST_POLL_TIMEOUT_S at most) until
the receiver answered; the outcome is kept in the page's `webhook-tests` store, by webhook id.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from ..api_client import ApiError
from ..callbacks import PageCallbacks, services
from ..views import error_banner, form_message
from .alerts_views import (
    WEBHOOK_FORMATS,
    card,
    clicked_id,
    delivery_outcome,
    field,
    form_row,
    heading,
    primary_button,
    project_field,
    text_field,
    webhooks_table,
)

__all__ = ["TEST_POLL_MS", "callbacks", "webhooks_card"]

TEST_POLL_MS = 700
TEST_POLL_TIMEOUT_S = 30.0

callbacks = PageCallbacks()


def webhooks_card(changes_allowed: bool = True) -> html.Div:
    """The webhooks card: the table (filled by show_webhooks) and the new-webhook form (its button
    disabled without `changes_allowed`)."""
    return card(
        "webhooks",
        heading(
            "Webhooks",
            "A project's incidents are POSTed to its webhooks when they open and when their cause "
            "changes (and when they resolve, for a webhook made with send_resolved through the API); "
            "with a secret, each request is signed (HMAC-SHA256).",
        ),
        html.H3("New webhook"),
        form_row(
            project_field("webhook-project"),
            text_field(
                "URL",
                "webhook-url",
                "text-input wide",
                placeholder="https://hooks.slack.com/services/…",
            ),
            field(
                "Format",
                dcc.RadioItems(
                    id="webhook-format",
                    options=[
                        {"label": f" {label}", "value": value} for value, label in WEBHOOK_FORMATS.items()
                    ],
                    value="json",
                    inline=True,
                    className="format-pick",
                ),
            ),
            text_field(
                "Secret",
                "webhook-secret",
                input_type="password",
                placeholder="optional, signs requests",
            ),
        ),
        primary_button("Add webhook", "webhook-create", disabled=not changes_allowed),
        html.Div(id="webhook-form-message"),
    )


# -- callbacks -------------------------------------------------------------------------------------


@callbacks.callback(
    Output("webhooks-table", "children"),
    Input("webhooks-version", "data"),
    Input("webhook-tests", "data"),
)
def show_webhooks(_version: Any, tests: dict[str, Any] | None) -> Any:
    """The webhooks table with each one's last test, as the page opens and after every change."""
    try:
        return webhooks_table(services().api.webhooks(), tests or {})
    except ApiError as exc:
        return error_banner(exc)


@callbacks.callback(
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
    """Add webhook: the form as a new webhook."""
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
        created = services().api.create_webhook(webhook)
    except ApiError as exc:
        return form_message(exc), dash.no_update
    return form_message(success=f"Added webhook {created.get('id')}."), (version or 0) + 1


@callbacks.callback(
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
    """A webhook's Send test (queued; follow_tests follows it) or Delete button."""
    webhook_id = clicked_id(ctx, "webhook")
    if webhook_id is None:
        return (dash.no_update,) * 4
    api = services().api
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


@callbacks.callback(
    Output("webhook-tests", "data", allow_duplicate=True),
    Output("webhook-test-poll", "disabled", allow_duplicate=True),
    Input("webhook-test-poll", "n_intervals"),
    State("webhook-tests", "data"),
    prevent_initial_call=True,
)
def follow_tests(_n_intervals: Any, tests: dict[str, Any] | None) -> tuple[Any, Any]:
    """Every TEST_POLL_MS while a test is sending: its delivery's state, from the delivery log; the
    polling stops once none is sending."""
    tests = dict(tests or {})
    waiting = {key: test for key, test in tests.items() if test.get("state") == "sending"}
    if not waiting:
        return dash.no_update, True
    api = services().api
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
