"""The Alerts page in real headless Chromium, against a real server: rules made in the UI fire on a
real training run, alerts are acknowledged, webhooks are tested against a real HTTP receiver on
127.0.0.1, and user-supplied names stay text."""

import re

import httpx
import pytest
from training import train
from webhook_receiver import WebhookReceiver

import gradwatch

pytestmark = pytest.mark.browser

WAIT_MS = 30_000  # the alerts list refreshes every 5 s
HOSTILE = "<script>alert('x')</script><img src=x onerror=alert(1)>"


def _param(page, scope: str, name: str):
    """The text field of rule parameter `name` in the form under `scope` (a CSS selector)."""
    label = page.locator(f"{scope} .param").filter(has=page.get_by_text(name, exact=True))
    return label.locator("input")


def _choose(page, dropdown_id: str, option: str) -> None:
    page.locator(f"#{dropdown_id}").click()
    page.get_by_role("option", name=option, exact=True).click()


def _create_rule(page, project: str, rule_type: str, params: dict[str, str], name: str = "") -> None:
    page.locator("#rule-project").fill(project)
    _choose(page, "rule-type", f"{rule_type} (critical)")
    for param, value in params.items():
        _param(page, "#rules-card", param).fill(value)
    if name:
        page.locator("#rule-name").fill(name)
    page.locator("#rule-create").click()


def _wait_for_marker(page, step: int) -> None:
    """Wait until the loss chart's step marker (a vertical line) stands at `step` alone."""
    page.wait_for_function(
        "step => {"
        " const shapes = document.querySelector('#loss-graph .js-plotly-plot')?.layout?.shapes || [];"
        " return shapes.length > 0 && shapes.every(s => s.x0 === step); }",
        arg=step,
        timeout=WAIT_MS,
    )


def _alert_row(page, text: str):
    return page.locator("#alerts-table tbody tr").filter(has_text=text)


def test_rule_made_in_the_ui_fires_on_a_training_run_and_shows_on_alerts_page_and_runs_list(
    full_server, browser_page
):
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/")
    page.get_by_role("link", name="Alerts", exact=True).click()  # linked from the header
    page.wait_for_url("**/dashboard/alerts")

    # Parameters and defaults come from the server's rule types.
    page.locator("#rule-project").fill("ui-alerts")
    _choose(page, "rule-type", "skip_storm (critical)")
    assert _param(page, "#rules-card", "count").input_value() == "4"
    assert _param(page, "#rules-card", "ignore_first").input_value() == "0"
    page.locator("#rule-type-doc").get_by_text("skipped optimizer steps", exact=False).wait_for()

    # A threshold the server refuses: its 422 message is shown next to the form.
    _param(page, "#rules-card", "count").fill("0")
    page.locator("#rule-create").click()
    error = page.locator("#rule-form-message .form-error")
    error.wait_for(timeout=WAIT_MS)
    assert "422" in error.inner_text() and "count must be at least 1" in error.inner_text()

    _param(page, "#rules-card", "count").fill("2")
    _param(page, "#rules-card", "window").fill("20")
    _param(page, "#rules-card", "ignore_first").fill("0")
    page.locator("#rule-name").fill("two skips")
    page.locator("#rule-create").click()
    page.locator("#rule-form-message .form-ok").get_by_text("Created rule", exact=False).wait_for(
        timeout=WAIT_MS
    )
    rule_row = page.locator("#rules-table tr").filter(has_text="two skips")
    rule_row.wait_for(timeout=WAIT_MS)
    assert "count=2" in rule_row.inner_text() and "ignore_first=0" in rule_row.inner_text()

    with gradwatch.init(
        project="ui-alerts", name="skippy", server=full_server.url, flush_interval=0.05
    ) as run:
        train(30, run=run, overflow_steps=(10, 11))

    row = _alert_row(page, "two skips")
    row.wait_for(timeout=WAIT_MS)
    assert "open" in row.locator("td").first.inner_text()
    assert "2 skipped steps" in row.inner_text()
    run_link = row.get_by_role("link", name="skippy", exact=True)
    assert run_link.get_attribute("href") == f"/dashboard/runs/{run.id}?step=11"

    # The run page opens at the alert's step: marked on the charts, and the alert is in the timeline.
    run_link.click()
    page.wait_for_url(f"**/dashboard/runs/{run.id}?step=11")
    _wait_for_marker(page, 11)
    timeline_alert = page.locator("#events-table tr.alert-row").filter(has_text="skip_storm")
    timeline_alert.wait_for(timeout=WAIT_MS)
    # Its step marks the charts like an event's does: mark another step first, then the alert's.
    skip_row = page.locator("#events-table tr:not(.alert-row)").filter(has_text="skip")
    skip_row.get_by_role("button", name="10", exact=True).first.click()
    _wait_for_marker(page, 10)
    timeline_alert.get_by_role("button", name="11", exact=True).click()
    _wait_for_marker(page, 11)

    page.get_by_role("link", name="Runs", exact=True).click()
    run_row = page.locator("#runs-table tr").filter(has=page.get_by_role("link", name="skippy", exact=True))
    badge = run_row.locator(".alerts-badge")
    badge.wait_for(timeout=WAIT_MS)
    assert re.fullmatch(r"\d+ open", badge.inner_text())
    assert page.problems == []


def test_rules_are_edited_disabled_and_deleted_in_the_ui(full_server, browser_page):
    with httpx.Client(base_url=full_server.url, timeout=30) as api:
        rule = api.post(
            "/api/v1/alert-rules", json={"project": "edit-me", "type": "scale_drop", "name": "drop"}
        )
        assert rule.status_code == 201, rule.text
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/alerts")
    row = page.locator(f"#rules-table tr[data-rule='{rule.json()['id']}']")
    row.wait_for(timeout=WAIT_MS)

    row.get_by_role("button", name="Edit", exact=True).click()
    editor = page.locator("#rule-editor")
    editor.wait_for(state="visible", timeout=WAIT_MS)
    assert _param(page, "#rule-editor", "factor").input_value() == "8"
    _param(page, "#rule-editor", "factor").fill("0.5")  # must be > 1: refused, and the editor stays open
    page.locator("#rule-edit-save").click()
    refused = page.locator("#rule-edit-message .form-error")
    refused.wait_for(timeout=WAIT_MS)
    assert "factor must be greater than 1" in refused.inner_text()
    _param(page, "#rule-editor", "factor").fill("4")
    page.locator("#rule-edit-save").click()
    editor.wait_for(state="hidden", timeout=WAIT_MS)
    page.wait_for_function(
        f"() => document.querySelector(\"#rules-table tr[data-rule='{rule.json()['id']}']\")"
        "?.innerText.includes('factor=4')",
        timeout=WAIT_MS,
    )

    row.get_by_role("button", name="Disable", exact=True).click()
    row.get_by_text("disabled", exact=True).wait_for(timeout=WAIT_MS)
    row.get_by_role("button", name="Enable", exact=True).click()
    row.get_by_text("enabled", exact=True).wait_for(timeout=WAIT_MS)
    row.get_by_role("button", name="Delete", exact=True).click()
    row.wait_for(state="detached", timeout=WAIT_MS)

    with httpx.Client(base_url=full_server.url, timeout=30) as api:
        assert api.get(f"/api/v1/alert-rules/{rule.json()['id']}").status_code == 404
    assert page.problems == []


def test_acknowledging_an_alert_in_the_ui(full_server, browser_page):
    with gradwatch.init(project="ack", name="to-ack", server=full_server.url, flush_interval=0.05) as run:
        train(30, run=run, overflow_steps=(10, 11, 12))  # the default scale_drop rule fires (2^16 → 2^13)
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/alerts")
    row = _alert_row(page, "to-ack").filter(has_text="scale drop")
    row.wait_for(timeout=WAIT_MS)
    alert_id = row.get_attribute("data-alert")
    row.get_by_role("button", name="Acknowledge", exact=True).click()

    page.locator("#alerts-message .form-ok").wait_for(timeout=WAIT_MS)
    acknowledged = page.locator(f"#alerts-table tr[data-alert='{alert_id}']")
    acknowledged.locator("td").first.get_by_text("acknowledged", exact=True).wait_for(timeout=WAIT_MS)
    assert acknowledged.get_by_role("button", name="Acknowledge").count() == 0
    with httpx.Client(base_url=full_server.url, timeout=30) as api:
        stored = api.get(f"/api/v1/alerts/{alert_id}").json()
    assert stored["status"] == "firing" and stored["acknowledged_at"]  # seen, still firing

    page.locator("#alerts-states").get_by_text("acknowledged", exact=True).click()  # filter them out
    acknowledged.wait_for(state="detached", timeout=WAIT_MS)
    assert page.problems == []


def test_webhook_made_in_the_ui_and_its_test_delivery_shown(full_server, browser_page):
    page = browser_page
    with WebhookReceiver() as receiver, WebhookReceiver(status=500) as broken:
        page.goto(f"{full_server.url}/dashboard/alerts")
        for url, webhook_format in ((receiver.url, "Slack"), (broken.url, "Generic JSON")):
            page.locator("#webhook-project").fill("hooks")
            page.locator("#webhook-url").fill(url)
            page.locator("#webhook-format").get_by_text(webhook_format, exact=True).click()
            page.locator("#webhook-create").click()
            page.locator("#webhooks-table tr").filter(has_text=url).wait_for(timeout=WAIT_MS)

        good = page.locator("#webhooks-table tr").filter(has_text=receiver.url)
        assert "Slack" in good.inner_text()
        good.get_by_role("button", name="Send test", exact=True).click()
        good.locator(".test-ok").get_by_text("Delivered: HTTP 200", exact=False).wait_for(timeout=WAIT_MS)
        (request,) = receiver.wait_for(1)
        assert "test notification" in request.json["text"]  # Slack's format: {"text", "blocks"}

        bad = page.locator("#webhooks-table tr").filter(has_text=broken.url)
        bad.get_by_role("button", name="Send test", exact=True).click()
        bad.locator(".test-bad").get_by_text("HTTP 500", exact=False).wait_for(timeout=WAIT_MS)
        assert broken.wait_for(1)[0].json["event"] == "test"

        # A URL the server refuses: its message next to the form.
        page.locator("#webhook-url").fill("ftp://127.0.0.1/nope")
        page.locator("#webhook-create").click()
        refused = page.locator("#webhook-form-message .form-error")
        refused.wait_for(timeout=WAIT_MS)
        assert "http:// or https://" in refused.inner_text()

        bad.get_by_role("button", name="Delete", exact=True).click()
        bad.wait_for(state="detached", timeout=WAIT_MS)
        assert good.count() == 1
    assert page.problems == []


def test_user_supplied_names_and_evidence_are_shown_as_text(full_server, browser_page):
    layer = "<img src=x onerror=alert(2)>.weight"
    with httpx.Client(base_url=full_server.url, timeout=30) as api:
        rule = {
            "project": HOSTILE,
            "type": "skip_storm",
            "name": HOSTILE,
            "params": {"count": 2, "window": 10, "ignore_first": 0},
        }
        assert api.post("/api/v1/alert-rules", json=rule).status_code == 201
        # A project of its own that raises no alerts: nothing is ever sent to this URL.
        webhook = {"project": HOSTILE + " quiet", "url": "http://127.0.0.1:9/<b>x</b>"}
        assert api.post("/api/v1/webhooks", json=webhook).status_code == 201
        run = api.post("/api/v1/runs", json={"project": HOSTILE, "name": HOSTILE}).json()
        skips = [
            {
                "step": step,
                "kind": "skip",
                "data": {"scale_before": 1024.0, "scale_after": 512.0, "non_finite_layers": [layer]},
            }
            for step in (12, 13)
        ]
        batch = {
            "seq": 0,
            "layers": [layer],  # 12 clean steps end the scaler's calibration, then two skips
            "scalars": [{"key": "amp/skipped", "steps": list(range(14)), "values": [0] * 12 + [1, 1]}],
            "events": skips,
        }
        assert api.post(f"/api/v1/runs/{run['id']}/batches", json=batch).status_code == 200
        assert api.get("/api/v1/alerts", params={"run_id": run["id"]}).json()["count"] >= 1

    page = browser_page
    page.goto(f"{full_server.url}/dashboard/alerts")
    row = page.locator("#alerts-table tbody tr").filter(has_text=layer)  # evidence names the layer, as text
    row.wait_for(timeout=WAIT_MS)
    assert row.get_by_text(HOSTILE, exact=True).count() >= 2  # the rule's name and the run's
    page.locator("#rules-table").get_by_text(HOSTILE, exact=True).first.wait_for(timeout=WAIT_MS)
    page.locator("#webhooks-table").get_by_text("http://127.0.0.1:9/<b>x</b>", exact=True).wait_for(
        timeout=WAIT_MS
    )
    _choose(page, "alerts-project", HOSTILE)  # a project picked from the filter, as text
    row.wait_for(timeout=WAIT_MS)
    assert page.locator("#alerts-card img, #rules-card img, #webhooks-card img").count() == 0
    assert page.locator("script:has-text(\"alert('x')\")").count() == 0

    page.goto(f"{full_server.url}/dashboard/runs/{run['id']}")
    page.locator("#events-table tr.alert-row").get_by_text("skip_storm", exact=False).wait_for(
        timeout=WAIT_MS
    )
    assert page.locator("#events-table img").count() == 0
    assert page.problems == []
