"""The run page's verdict: the pure builders (banner, incident cards, condensed skip streaks), the API
client's incident calls over httpx.MockTransport, the refresh callback through Flask's test client,
and one run page in real headless Chromium against a real server."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from dashboard_support import FakeApi, refresh, skip_event

import gradwatch
from gradwatch.dashboard import create_dash_app, verdict
from gradwatch.dashboard.api_client import ApiClient, ApiError, ApiUnavailable, RunNotFound

HOSTILE = "<script>alert('x')</script><img src=x onerror=alert(1)>"


def as_text(components):
    """Components as the JSON the browser gets (non-ASCII kept), to search in."""
    return json.dumps(components, default=lambda component: component.to_plotly_json(), ensure_ascii=False)


def run_href(run_id, step=None):
    return f"/dashboard/runs/{run_id}" + (f"?step={step}" if step is not None else "")


def incident(incident_id=1, *, status="open", severity="critical", **fields):
    return {
        "id": incident_id,
        "project": "llm",
        "run_id": "r1",
        "run_name": "qlora-7b",
        "status": status,
        "severity": severity,
        "cause": "the learning rate jumped 300× at step 1200",
        "title": "gradient explosion",
        "first_step": 1200,
        "last_step": 1260,
        "resolved_step": None,
        "rules": ["grad_norm_spike", "loss_spike"],
        "findings": [
            {
                "rule": "grad_norm_spike",
                "title": "gradient norm up 1000× in 40 steps",
                "step": 1210,
                "severity": "critical",
                "evidence": {"ratio": 1000.0},
            },
            {
                "rule": "loss_spike",
                "title": "loss up 8× in 20 steps",
                "step": 1230,
                "severity": "warning",
                "evidence": {},
            },
        ],
        "next_steps": ["halve the lr (3e-4 → 1.5e-4) and rewind to the checkpoint before step 1200"],
        "link": "http://x/dashboard/runs/r1?step=1200",
        "created_at": "2024-05-01T12:01:00+00:00",
        "updated_at": "2024-05-01T12:02:00+00:00",
        "resolved_at": None,
        "notified_at": None,
        **fields,
    }


# -- the banner ------------------------------------------------------------------------------------------


def banner_props(component):
    return component.to_plotly_json()["props"]


def test_a_healthy_run_says_no_incidents_in_green():
    banner = verdict.verdict_banner("healthy", [])

    props = banner_props(banner)
    assert props["id"] == "run-verdict"
    assert props["className"] == "verdict verdict-healthy"
    assert props["data-verdict"] == "healthy"
    text = as_text(banner)
    assert '"children": "HEALTHY"' in text and '"children": "No incidents"' in text


def test_a_critical_run_names_the_lead_incidents_cause_and_counts_the_open_ones():
    incidents = [
        incident(3, severity="warning", cause="updates round away in fc2"),
        incident(2, cause="the learning rate jumped 300× at step 1200"),
        incident(1, status="resolved", cause="calibration never ended"),
    ]
    banner = verdict.verdict_banner("critical", incidents)

    assert banner_props(banner)["className"] == "verdict verdict-critical"
    summary = banner.children[1].children
    assert summary == (
        "2 open incidents: the learning rate jumped 300× at step 1200 "
        "(steps 1,200–1,260; +1 more; 1 resolved)"
    )
    assert banner.children[0].children == "CRITICAL"


def test_a_warning_with_one_open_incident_at_one_step():
    banner = verdict.verdict_banner("warning", [incident(severity="warning", first_step=7, last_step=7)])
    assert banner.children[0].children == "WARNING"
    assert (
        banner.children[1].children == "1 open incident: the learning rate jumped 300× at step 1200 (step 7)"
    )


def test_a_healthy_run_with_only_resolved_incidents_says_it_recovered_from_them():
    banner = verdict.verdict_banner("healthy", [incident(status="resolved", cause=None, title="scale drop")])
    assert banner.children[0].children == "RECOVERED"
    assert banner.children[1].children == "recovered from 1 incident: scale drop (steps 1,200–1,260)"
    assert "verdict-recovered" in banner.className


@pytest.mark.parametrize("answer", [None, "", "fine", 3])
def test_without_a_verdict_the_banner_says_unavailable_with_the_reason(answer):
    error = ApiError("GET /api/v1/runs/r1/incidents → 404: Not Found", 404, "Not Found")
    banner = verdict.verdict_banner(answer, [], error)

    props = banner_props(banner)
    assert props["className"] == "verdict verdict-unavailable" and props["data-verdict"] == "unavailable"
    assert (
        banner.children[1].children == "verdict unavailable: the incidents could not be read (404 Not Found)"
    )
    assert (
        verdict.verdict_banner(None, [], "no answer").children[1].children == "verdict unavailable: no answer"
    )


# -- incident cards --------------------------------------------------------------------------------------


def test_an_incident_card_has_severity_status_linked_steps_cause_findings_and_next_steps():
    (card,) = verdict.incident_cards([incident(7)], run_href)

    props = card.to_plotly_json()["props"]
    assert props["id"] == "incident-7"
    assert props["className"] == "card incident incident-critical incident-open"
    text = as_text(card)
    assert '"children": "critical"' in text and '"children": "open"' in text
    assert '"children": "steps 1,200–1,260", "href": "/dashboard/runs/r1?step=1200"' in text
    assert '"children": "the learning rate jumped 300× at step 1200"' in text
    assert '"children": "grad_norm_spike"' in text
    assert " gradient norm up 1000× in 40 steps at step 1,210" in text
    assert "halve the lr (3e-4 → 1.5e-4) and rewind to the checkpoint before step 1200" in text


def test_open_incidents_come_first_and_resolved_ones_say_when():
    cards = verdict.incident_cards(
        [incident(1, status="resolved", resolved_step=1300), incident(2, severity="warning")], run_href
    )
    assert [card.id for card in cards] == ["incident-2", "incident-1"]
    assert "resolved at step 1,300" in as_text(cards[1])


def test_hostile_causes_titles_and_steps_are_text_never_html():
    hostile = incident(
        cause=HOSTILE,
        title=HOSTILE,
        findings=[{"rule": HOSTILE, "title": HOSTILE, "step": 3, "severity": "critical", "evidence": {}}],
        next_steps=[HOSTILE],
    )
    text = as_text(
        [verdict.verdict_banner("critical", [hostile]), *verdict.incident_cards([hostile], run_href)]
    )

    assert text.count(json.dumps(HOSTILE)[1:-1]) >= 5  # every one a plain string child
    assert "dangerouslySetInnerHTML" not in text
    assert '"type": "Script"' not in text and '"type": "Img"' not in text


def test_no_incidents_no_section():
    assert verdict.incidents_section([], run_href) is None
    section = verdict.incidents_section([incident()], run_href)
    assert section.id == "run-incidents" and '"children": "Incidents"' in as_text(section)


# -- skip streaks in the events table --------------------------------------------------------------------


def skip_storm(first=169, count=130, layers=("fc1.weight",)):
    """`count` skips from step `first`, the scale halving each time from 2^0."""
    return [skip_event(first + i, 2.0**-i, 2.0 ** -(i + 1), layers) for i in range(count)]


def test_a_130_step_skip_storm_is_one_row():
    events = [
        {"step": 5, "kind": "clip_before_unscale", "rank": 0, "data": {"hint": "unscale first"}},
        *skip_storm(),
        {"step": 400, "kind": "rank_disagreement", "rank": 0, "data": {}},
    ]
    rows = verdict.condense_events(events)

    assert [row["kind"] for row in rows] == ["clip_before_unscale", "skip", "rank_disagreement"]
    assert rows[0] is events[0] and rows[2] is events[-1]  # other kinds pass through unchanged
    streak = rows[1]["streak"]
    assert (rows[1]["step"], streak["first_step"], streak["last_step"], streak["count"]) == (
        169,
        169,
        298,
        130,
    )
    assert streak["text"] == (
        "steps 169-298: every step skipped, scale 2^0 -> 2^-130 (2^130x); "
        "non-finite most often in fc1.weight (130 of 130 steps)"
    )


def test_the_streaks_scales_come_from_its_first_and_last_skip_and_other_scales_get_3_digits():
    events = [skip_event(169, 0.5, 0.25), skip_event(170, 0.25, 0.125), skip_event(171, 0.125, 2.0**-119)]
    assert verdict.condense_events(events)[0]["streak"]["text"] == (
        "steps 169-171: every step skipped, scale 2^-1 -> 2^-119 (2^118x)"
    )
    events = [skip_event(1, 1000.0, 500.0), skip_event(2, 500.0, 123.456)]
    assert verdict.condense_events(events)[0]["streak"]["text"] == (
        "steps 1-2: every step skipped, scale 1e+03 -> 123 (8.1x)"
    )


def test_the_most_frequent_non_finite_layer_is_named():
    events = [
        skip_event(10, 8.0, 4.0, ["a", "b"]),
        skip_event(11, 4.0, 2.0, ["b"]),
        skip_event(12, 2.0, 1.0, ["<b>c</b>", "b", "b"]),  # a layer counts once per step
    ]
    streak = verdict.condense_events(events)[0]["streak"]
    assert streak["text"].endswith("; non-finite most often in b (3 of 3 steps)")
    assert streak["layers"] == ["b: 3 steps", "a: 1 steps", "<b>c</b>: 1 steps"]


def test_non_consecutive_skips_stay_separate_and_a_single_skip_is_a_normal_row():
    events = [
        skip_event(3, 8.0, 4.0),
        skip_event(5, 4.0, 2.0),
        skip_event(6, 2.0, 1.0),
        skip_event(9, 1.0, 0.5),
    ]
    rows = verdict.condense_events(events)

    assert rows[0] is events[0] and rows[2] is events[3]
    assert rows[1]["streak"]["first_step"] == 5 and rows[1]["streak"]["count"] == 2
    assert verdict.condense_events([]) == []


def test_streaks_are_per_rank():
    events = []
    for step in (20, 21, 22):
        events += [{**skip_event(step, 2.0, 1.0), "rank": 0}, {**skip_event(step, 2.0, 1.0), "rank": 1}]
    rows = verdict.condense_events(events)

    assert [(row["rank"], row["streak"]["count"]) for row in rows] == [(0, 3), (1, 3)]


# -- the API client --------------------------------------------------------------------------------------


class IncidentsApi(FakeApi):
    """FakeApi plus the incidents endpoints; `incidents` None: a server without them (404)."""

    def __init__(self, incidents=None, verdict="healthy", **options):
        super().__init__(**options)
        self.incidents = incidents
        self.verdict = verdict

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.incidents is not None and path == f"/api/v1/runs/{self.run['id']}/incidents":
            self.requests.append(request)
            body = {"data": self.incidents, "count": len(self.incidents), "verdict": self.verdict}
            return httpx.Response(200, json=body)
        if self.incidents is not None and path == "/api/v1/incidents":
            self.requests.append(request)
            status = request.url.params.get("status")
            found = [item for item in self.incidents if status in (None, item["status"])]
            return httpx.Response(200, json={"data": found, "count": len(found)})
        if path.endswith("/incidents"):
            self.requests.append(request)
            return httpx.Response(404, json={"detail": "Not Found"})
        return super().__call__(request)


def client_for(handler) -> ApiClient:
    return ApiClient("http://gradwatch.test/", client=httpx.Client(transport=httpx.MockTransport(handler)))


def test_run_incidents_returns_the_incidents_and_the_verdict():
    api = IncidentsApi([incident()], verdict="critical")

    incidents, run_verdict = client_for(api).run_incidents("r1")

    assert (incidents, run_verdict) == ([incident()], "critical")
    assert api.requests[0].url.path == "/api/v1/runs/r1/incidents"


def test_an_unknown_verdict_is_none():
    assert client_for(IncidentsApi([], verdict="meh")).run_incidents("r1") == ([], None)


def test_a_server_without_incidents_is_an_api_error_404_not_run_not_found():
    with pytest.raises(ApiError) as caught:
        client_for(IncidentsApi(None)).run_incidents("r1")
    assert caught.value.status_code == 404 and not isinstance(caught.value, RunNotFound)
    with pytest.raises(ApiUnavailable):
        client_for(lambda request: httpx.Response(500, json={"detail": "boom"})).run_incidents("r1")


def test_incidents_filters_by_project_run_and_status():
    api = IncidentsApi([incident(1), incident(2, status="resolved")])

    found, count = client_for(api).incidents(project="llm", run_id="r1", status="open", limit=10, offset=5)

    assert ([item["id"] for item in found], count) == ([1], 1)
    assert dict(api.requests[0].url.params) == {
        "project": "llm",
        "run_id": "r1",
        "status": "open",
        "limit": "10",
        "offset": "5",
    }
    client_for(api).incidents()
    assert dict(api.requests[1].url.params) == {"limit": "100", "offset": "0"}
    with pytest.raises(ValueError, match="firing"):
        client_for(api).incidents(status="firing")


# -- the refresh callback (Flask's test client) ----------------------------------------------------------


def refreshed(api):
    app = create_dash_app(
        "http://gradwatch.test", http_client=httpx.Client(transport=httpx.MockTransport(api))
    )
    return refresh(app.server.test_client())


def test_refresh_puts_the_verdict_and_the_incident_cards_below_the_header():
    response = refreshed(IncidentsApi([incident(4, title=HOSTILE)], verdict="critical"))

    header = json.dumps(response["run-header"]["children"], ensure_ascii=False)
    assert header.index('"run-header"') < header.index('"run-verdict"') < header.index('"run-incidents"')
    assert '"data-verdict": "critical"' in header and '"id": "incident-4"' in header
    assert '"href": "/dashboard/runs/r1?step=1200"' in header
    assert json.dumps(HOSTILE)[1:-1] in header and "dangerouslySetInnerHTML" not in header


def test_refresh_without_the_incidents_api_says_verdict_unavailable_and_draws_the_rest():
    response = refreshed(IncidentsApi(None))

    header = json.dumps(response["run-header"]["children"])
    assert '"data-verdict": "unavailable"' in header and "verdict unavailable" in header
    assert '"run-incidents"' not in header
    assert response["loss-graph"]["figure"]["__dash_patch_update"]  # the charts are drawn as before
    assert "fc1.weight" in json.dumps(response["events-table"]["children"])
    assert response["refresh"]["disabled"] is False


def test_refresh_shows_a_skip_storm_as_one_row_of_the_events_table():
    response = refreshed(IncidentsApi([], events=skip_storm(169, 130)))

    table = json.dumps(response["events-table"]["children"], ensure_ascii=False)
    assert table.count('"children": "skip ×130"') == 1
    # One row, whose step cell marks the first or the last step of the streak on the charts.
    assert table.count('"type": "event-step"') == 2
    assert '"step": 169, "row": "event-0"' in table and '"step": 298, "row": "event-0-last"' in table
    assert "steps 169-298: every step skipped, scale 2^0 -> 2^-130 (2^130x)" in table
    assert "older events are not shown" not in table


def test_a_skip_streak_stands_in_the_timeline_where_it_ended():
    events = [*skip_storm(10, 5), {"step": 12, "kind": "bad_batch", "rank": 0, "data": {"key": "loss"}}]
    response = refreshed(IncidentsApi([], events=events))

    table = json.dumps(response["events-table"]["children"], ensure_ascii=False)
    assert table.index("steps 10-14: every step skipped") < table.index("bad_batch")


# -- the run page in real headless Chromium --------------------------------------------------------------


@pytest.mark.browser
def test_run_page_opens_with_the_verdict(full_server, browser_page):
    run = gradwatch.init(project="browser", name="verdict", server=full_server.url, flush_interval=0.05)
    for step in range(20):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run.finish()
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/runs/{run.id}")

    banner = page.locator("#run-verdict")
    banner.wait_for(timeout=20_000)
    assert banner.get_attribute("data-verdict") == "healthy"
    assert page.locator("#run-verdict-label").inner_text() == "HEALTHY"
    assert "No incidents" in banner.inner_text()
    page.wait_for_function(
        "() => { const g = document.querySelector('#loss-graph .js-plotly-plot');"
        " return g && g.data && g.data.some(t => t.x && t.x.length === 20); }",
        timeout=20_000,
    )
    # The banner sits right below the run header, above the charts.
    order = page.evaluate(
        "() => ['.run-header', '#run-verdict', '#loss-graph'].map(s => document.querySelector(s)"
        ".getBoundingClientRect().top)"
    )
    assert order == sorted(order)
    assert page.problems == []


@pytest.mark.browser
def test_run_page_opens_with_a_critical_verdict_and_the_incident_diagnosis(full_server, browser_page):
    run = gradwatch.init(project="browser", name="nan", server=full_server.url, flush_interval=0.05)
    for step in range(40):
        run.log_batch([f"sample-{step}"], step=step)
        run.log({"loss": math.nan if step == 25 else 1.0 / (step + 1)}, step=step)
    run.finish()
    health = httpx.get(f"{full_server.url}/api/v1/runs/{run.id}/incidents", timeout=10).json()
    assert health["verdict"] == "critical" and health["count"] == 1
    page = browser_page
    page.goto(f"{full_server.url}/dashboard/runs/{run.id}")
    banner = page.locator("#run-verdict")
    banner.wait_for(timeout=20_000)
    page.wait_for_function(
        "() => document.querySelector('#run-verdict').dataset.verdict === 'critical'", timeout=20_000
    )
    assert page.locator("#run-verdict-label").inner_text() == "CRITICAL"
    card = page.locator(f"#incident-{health['data'][0]['id']}")
    card.wait_for(timeout=20_000)
    assert "step 25" in card.inner_text() and "sample-25" in card.inner_text()
    assert page.problems == []


def test_an_incident_card_names_the_last_healthy_step_to_rewind_to_where_a_rewind_may_cure_it():
    (card,) = verdict.incident_cards([incident(3, family="divergence")], run_href)
    assert "Last healthy step: 1,199. To rewind, restore a checkpoint from at or before it" in as_text(card)
    (stalled,) = verdict.incident_cards([incident(4, family="stalled")], run_href)
    assert "Last healthy step" not in as_text(stalled)  # a frozen layer is not cured by a rewind
    # the server's point wins (a warning of the same trouble began earlier): one rewind point per trouble
    (announced,) = verdict.incident_cards([incident(5, family="precision", last_healthy_step=1100)], run_href)
    assert "Last healthy step: 1,100." in as_text(announced)
