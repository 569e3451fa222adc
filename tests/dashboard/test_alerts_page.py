"""The Alerts page: its pure views, and its callbacks through Flask's test client against a fake API."""

from __future__ import annotations

import json

import httpx
import pytest
from dashboard_support import SKIP_STORM, AlertsApi, alert, callback_outputs, dash_call, render

from gradwatch.dashboard import create_dash_app, views
from gradwatch.dashboard.pages import alerts_views

# -- pure views ------------------------------------------------------------------------------------


def as_text(components):
    """Components as the JSON the browser gets (non-ASCII kept), to search in."""
    return json.dumps(components, default=lambda component: component.to_plotly_json(), ensure_ascii=False)


def run_href(run_id, step=None):
    return f"/dashboard/runs/{run_id}" + (f"?step={step}" if step is not None else "")


def test_alerts_table_lists_open_then_acknowledged_then_resolved_with_links_and_text():
    alerts = [
        alert(1, status="resolved", resolved_at="2024-05-01T13:00:00+00:00", resolved_step=40),
        alert(2, acknowledged_at="2024-05-01T12:02:00+00:00"),
        alert(3, run_name="<script>alert(1)</script>", step=12),
        alert(4, step=20),
    ]
    rules = {7: {"id": 7, "name": "<i>drop</i>"}}
    table = alerts_views.alerts_table(alerts, rules, run_href)

    rows = table.children[1].children
    assert [row.to_plotly_json()["props"]["data-alert"] for row in rows] == ["4", "3", "2", "1"]
    text = as_text(table)
    assert '"href": "/dashboard/runs/r1?step=12"' in text
    assert '"children": "<script>alert(1)</script>"' in text and '"children": "<i>drop</i>"' in text
    assert text.count('"Acknowledge"') == 2  # open ones only
    assert "key=amp/scale" in text and "link=" not in text  # evidence without the link
    assert "2024-05-01 13:00 UTC (step 40)" in text
    assert "dangerouslySetInnerHTML" not in text


def test_alert_states():
    assert views.alert_state(alert()) == "open"
    assert views.alert_state(alert(acknowledged_at="2024-05-01T12:02:00+00:00")) == "acknowledged"
    assert views.alert_state(alert(status="resolved", acknowledged_at="x")) == "resolved"


@pytest.mark.parametrize(
    ("text", "default", "value"),
    [
        ("2", 10, 2),
        ("0.5", 8.0, 0.5),
        ("1e-6", 1e-6, 1e-6),
        (" true ", 1.0, True),
        ("False", True, False),
        ("grad/norm", "update/ratio", "grad/norm"),
        ("12", "update/ratio", "12"),  # a string parameter stays a string
        ("abc", 8.0, "abc"),  # sent as typed: the server says what is wrong
        ("inf", 8.0, "inf"),
    ],
)
def test_parse_param(text, default, value):
    parsed = alerts_views.parse_param(text, default)
    assert parsed == value and type(parsed) is type(value)


def test_rule_params_leave_out_empty_fields_and_for_a_new_rule_the_defaults():
    texts = {"count": "2", "window": "100", "ignore_first": ""}
    assert alerts_views.rule_params(SKIP_STORM, texts, only_changed=True) == {"count": 2}
    assert alerts_views.rule_params(SKIP_STORM, texts) == {"count": 2, "window": 100}


def test_param_inputs_show_values_defaults_and_bounds():
    fields = alerts_views.param_inputs("rule-param", SKIP_STORM, {"count": 3})
    text = as_text(fields)

    assert '"value": "3"' in text and '"value": "100"' in text
    assert "skips · default 10 · min 1" in text
    assert '{"type": "rule-param", "param": "count"}' in text


def test_rules_table_has_edit_toggle_and_delete_per_rule():
    rules = [
        {
            "id": 1,
            "project": "llm",
            "run_id": None,
            "type": "skip_storm",
            "name": "<b>few</b>",
            "params": {"count": 2, "window": 20.0},
            "enabled": True,
            "cooldown_steps": 100,
            "severity": "critical",
        },
        {
            "id": 2,
            "project": "llm",
            "run_id": "r1",
            "type": "scale_floor",
            "name": "floor",
            "params": {"floor": 1.0},
            "enabled": False,
            "cooldown_steps": 0,
            "severity": "critical",
        },
    ]
    text = as_text(alerts_views.rules_table(rules))

    assert "count=2, window=20" in text and '"children": "<b>few</b>"' in text
    assert '{"type": "rule-toggle", "rule": 1, "enable": false}' in text  # "Disable"
    assert '{"type": "rule-toggle", "rule": 2, "enable": true}' in text  # "Enable"
    assert '{"type": "rule-delete", "rule": 2}' in text and "run r1" in text


@pytest.mark.parametrize(
    ("delivery", "state", "text"),
    [
        ({"status": "pending", "attempts": 0}, "sending", "Sending…"),
        ({"status": "sending", "attempts": 0}, "sending", "Sending…"),
        ({"status": "delivered", "attempts": 1, "response_status": 200}, "delivered", "Delivered: HTTP 200."),
        (
            {
                "status": "pending",
                "attempts": 1,
                "response_status": 500,
                "last_error": "HTTP 500",
                "next_attempt_at": "2024-05-01T12:00:05+00:00",
            },
            "failed",
            "Attempt 1 failed: HTTP 500; retrying at 2024-05-01 12:00 UTC.",
        ),
        (
            {"status": "failed", "attempts": 8, "response_status": None, "last_error": "connection refused"},
            "failed",
            "Failed after 8 attempts: connection refused.",
        ),
    ],
)
def test_delivery_outcome(delivery, state, text):
    assert alerts_views.delivery_outcome(delivery) == {"state": state, "text": text}


def test_webhooks_table_shows_urls_as_text_and_the_last_test():
    webhooks = [
        {
            "id": 5,
            "project": "llm",
            "url": "http://127.0.0.1:9/<b>x</b>",
            "format": "slack",
            "signed": True,
            "enabled": True,
            "created_at": "2024-05-01T12:00:00+00:00",
        }
    ]
    tests = {"5": {"state": "delivered", "text": "Delivered: HTTP 200."}}
    text = as_text(alerts_views.webhooks_table(webhooks, tests))

    assert '"children": "http://127.0.0.1:9/<b>x</b>"' in text and '"children": "Slack"' in text
    assert "Delivered: HTTP 200." in text and "test-ok" in text
    assert '{"type": "webhook-test", "webhook": 5}' in text


# -- callbacks through Flask, against a fake API ---------------------------------------------------


def alerts_client(api):
    app = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    )
    client = app.server.test_client()
    client.dash_app = app
    return client


CREATE_RULE = ["rule-form-message.children", "rules-version.data"]


def create_rule(client, project="llm", params=None):
    params = params if params is not None else {"count": "2", "window": "100", "ignore_first": "0"}
    return dash_call(
        client,
        CREATE_RULE,
        [(("rule-create", "n_clicks"), 1)],
        state=[
            (("rule-project", "value"), project),
            (("rule-type", "value"), "skip_storm"),
            (("rule-name", "value"), "<b>two</b>"),
            (("rule-cooldown", "value"), ""),
            (({"type": "rule-param", "param": ALL_}, "value"), list(params.values())),
            (
                ({"type": "rule-param", "param": ALL_}, "id"),
                [{"type": "rule-param", "param": p} for p in params],
            ),
            (("rule-types", "data"), [{"type": "skip_storm", "params": SKIP_STORM}]),
            (("rules-version", "data"), 4),
        ],
    )


ALL_ = ["ALL"]  # how the renderer writes a pattern's ALL in a callback's request


def test_the_alerts_page_offers_the_servers_rule_types_and_known_projects():
    page = json.dumps(render(alerts_client(AlertsApi()), "/dashboard/alerts"))
    for component_id in ("alerts-table", "rules-table", "webhooks-table", "rule-create", "webhook-create"):
        assert f'"id": "{component_id}"' in page
    assert '"label": "skip_storm (critical)", "value": "skip_storm"' in page


@pytest.mark.parametrize(
    ("identity", "allowed"),
    [
        ({"open": True}, True),
        ({"open": False, "project": "llm", "scopes": ["read"]}, False),
        ({"open": False, "project": "llm", "scopes": ["admin", "read"]}, True),
        ({"open": False, "project": "*", "scopes": ["*"]}, True),
        (None, True),  # not loaded: the server's 403 says why, if it comes to that
    ],
)
def test_a_read_token_is_told_up_front_that_changes_need_admin(identity, allowed):
    from plotly.utils import PlotlyJSONEncoder

    from gradwatch.dashboard.pages import alerts

    assert alerts.can_change(identity) is allowed
    page = json.dumps(alerts.alerts_layout([], ["llm"], changes_allowed=allowed), cls=PlotlyJSONEncoder)
    assert ('"id": "alerts-read-only"' in page) is not allowed
    for button in ("rule-create", "webhook-create"):
        props = next(
            c["props"] for c in _components(json.loads(page)) if c.get("props", {}).get("id") == button
        )
        assert props.get("disabled", False) is not allowed, button


def _components(node):
    """Every component of a layout as serialised to JSON."""
    if isinstance(node, dict):
        if "props" in node:
            yield node
        for value in node.values():
            yield from _components(value)
    elif isinstance(node, list):
        for item in node:
            yield from _components(item)


def test_creating_a_rule_posts_only_the_changed_parameters():
    api = AlertsApi(
        answers={
            ("POST", "/api/v1/alert-rules"): (
                201,
                {"id": 9, "name": "<b>two</b>", "type": "skip_storm", "project": "llm"},
            )
        }
    )
    response = create_rule(alerts_client(api))

    posted = json.loads(next(r for r in api.requests if r.method == "POST").content)
    assert posted == {
        "project": "llm",
        "type": "skip_storm",
        "name": "<b>two</b>",
        "params": {"count": 2, "ignore_first": 0},
    }
    assert "Created rule “<b>two</b>”" in json.dumps(response["rule-form-message"], ensure_ascii=False)
    assert response["rules-version"]["data"] == 5  # the rules table reloads


def test_a_rule_the_server_refuses_shows_its_message_next_to_the_form():
    detail = [
        {
            "loc": ["body", "params"],
            "msg": "skip_storm: count must be at least 1, got 0",
            "type": "value_error",
        }
    ]
    api = AlertsApi(answers={("POST", "/api/v1/alert-rules"): (422, {"detail": detail})})
    response = create_rule(alerts_client(api), params={"count": "0"})

    message = json.dumps(response["rule-form-message"])
    assert (
        "The server refused this (422): body.params: skip_storm: count must be at least 1, got 0" in message
    )
    assert '"role": "alert"' in message
    assert "rules-version" not in response


def test_a_rule_needs_a_project_before_it_is_sent():
    api = AlertsApi()
    response = create_rule(alerts_client(api), project="  ")
    assert "Enter the project" in json.dumps(response)
    assert not [r for r in api.requests if r.method == "POST"]


def click(client, outputs, clicked, state=(), other_patterns=0):
    """POST a callback the way the renderer does when button `clicked` (a concrete pattern-matching
    id) is clicked; other_patterns: how many more ALL inputs the callback has (sent with no buttons).
    Returns {component id: {property: value}}."""
    prop_id = json.dumps(clicked, sort_keys=True, separators=(",", ":")) + ".n_clicks"
    outputs = callback_outputs(client, outputs)
    body = {
        "output": outputs[0] if len(outputs) == 1 else ".." + "...".join(outputs) + "..",
        "outputs": [dict(zip(("id", "property"), output.split("."), strict=True)) for output in outputs],
        "inputs": [[{"id": clicked, "property": "n_clicks", "value": 1}]] + [[]] * other_patterns,
        "state": [{"id": i, "property": p, "value": v} for (i, p), v in state],
        "changedPropIds": [prop_id],
    }
    response = client.post("/_dash-update-component", json=body)
    assert response.status_code == 200, response.data
    return response.json["response"]


def test_acknowledge_posts_and_shows_what_the_server_refused():
    api = AlertsApi()  # a server without the acknowledge endpoint answers 404
    response = click(
        alerts_client(api),
        ["alerts-message.children", "alerts-version.data"],
        {"type": "alert-ack", "alert": 8},
        state=[(("alerts-version", "data"), 2)],
    )
    assert [(r.method, r.url.path) for r in api.requests] == [("POST", "/api/v1/alerts/8/acknowledge")]
    assert "The server refused this (404): Not Found" in json.dumps(response["alerts-message"])
    assert response["alerts-version"]["data"] == 3  # the list reloads either way


def test_send_test_queues_a_delivery_and_starts_following_it():
    api = AlertsApi(
        answers={("POST", "/api/v1/webhooks/5/test"): (202, {"id": 11, "status": "pending", "attempts": 0})}
    )
    response = click(
        alerts_client(api),
        [
            "webhooks-message.children",
            "webhooks-version.data",
            "webhook-tests.data",
            "webhook-test-poll.disabled",
        ],
        {"type": "webhook-test", "webhook": 5},
        state=[(("webhook-tests", "data"), {}), (("webhooks-version", "data"), 0)],
        other_patterns=1,
    )
    assert response["webhook-tests"]["data"]["5"]["delivery"] == 11
    assert response["webhook-tests"]["data"]["5"]["text"] == "Sending…"
    assert response["webhook-test-poll"]["disabled"] is False


def test_test_delivery_is_followed_until_the_receiver_answered():
    api = AlertsApi(
        answers={
            ("GET", "/api/v1/webhooks/5/deliveries"): (
                200,
                {
                    "data": [{"id": 11, "status": "delivered", "attempts": 1, "response_status": 200}],
                    "count": 1,
                },
            )
        }
    )
    tests = {"5": {"delivery": 11, "started": 0, "state": "sending", "text": "Sending…"}}
    response = dash_call(
        alerts_client(api),
        ["webhook-tests.data", "webhook-test-poll.disabled"],
        [(("webhook-test-poll", "n_intervals"), 1)],
        state=[(("webhook-tests", "data"), tests)],
    )
    assert response["webhook-tests"]["data"]["5"]["text"] == "Delivered: HTTP 200."
    assert response["webhook-test-poll"]["disabled"] is True


def test_the_webhooks_card_says_when_webhooks_are_sent_as_the_server_does():
    # Resolutions are sent only for webhooks made with send_resolved (the API's default is false).
    import json

    from gradwatch.dashboard.pages.webhooks import webhooks_card

    text = json.dumps(webhooks_card().to_plotly_json(), default=lambda o: o.to_plotly_json())
    assert "when they open and when their cause changes" in text and "send_resolved" in text
    assert "when they fire and when they resolve" not in text
