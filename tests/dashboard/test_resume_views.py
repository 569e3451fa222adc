"""The run page's crash and resume views: the resume marker on the line charts (figures and the page's
refresh, live appending included) and the reason a crashed run crashed in its header."""

from __future__ import annotations

import json

import httpx
from dash import html
from dashboard_support import RUN, FakeApi, apply_patch, refresh, skip_event

from gradwatch.dashboard import create_dash_app, figures
from gradwatch.dashboard.pages.run_views import run_header
from gradwatch.dashboard.views import status_badge

RESUME = {
    "step": 30,
    "kind": "resume",
    "rank": 0,
    "data": {
        "mode": "must",
        "step_from": "run.step",
        "previous_last_step": 47,
        "previous_status": "crashed",
        "previous_status_reason": "no heartbeat <script>",
    },
}
LOSS = {"steps": list(range(60)), "values": [2.0 - s / 100 for s in range(60)]}


def _resume_trace(figure):
    [trace] = [trace for trace in figure.data if trace.uid == "resume"]
    return trace


def test_a_resume_is_a_dotted_line_across_the_chart_saying_what_it_replaced():
    figure = figures.add_resume_markers(figures.loss_figure(LOSS), [skip_event(3, 2.0, 1.0), RESUME])
    trace = _resume_trace(figure)
    assert list(trace.x) == [30, 30, None] and list(trace.y) == [0, 1, None]
    assert trace.yaxis == "y2" and figure.layout.yaxis2.range == (0, 1)  # whatever the y zoom
    hover = trace.hovertext[0]
    assert "resumed at step 30" in hover
    assert "reached step 47; its steps 30–47 are replaced" in hover
    assert "crashed: no heartbeat &lt;script&gt;" in hover  # escaped: plotly would render tags
    assert figure.data[0].x == tuple(LOSS["steps"])  # the line itself is one line


def test_a_continuation_says_where_the_earlier_attempt_ended_and_no_resume_draws_nothing():
    continued = {**RESUME, "step": 48, "data": {"previous_last_step": 47, "previous_status": "finished"}}
    hover = _resume_trace(figures.add_resume_markers(figures.loss_figure(LOSS), [continued])).hovertext[0]
    assert "reached step 47" in hover and "replaced" not in hover and "it had ended finished" in hover
    plain = figures.loss_figure(LOSS)
    assert figures.add_resume_markers(plain, []) is plain and len(plain.data) == 1
    empty = figures.loss_figure(None)  # "no data yet" stays as it is
    assert not figures.add_resume_markers(empty, [RESUME]).data
    nothing_before = {**RESUME, "data": {"previous_last_step": None}}  # the run had no data yet
    junk = [{"kind": "resume", "step": "x"}, {"kind": "resume"}, "nonsense", nothing_before]
    assert not [
        t for t in figures.add_resume_markers(figures.loss_figure(LOSS), junk).data if t.uid == "resume"
    ]


def _client(api):
    http_client = httpx.Client(transport=httpx.MockTransport(api))
    return create_dash_app("http://gradwatch.test", http_client=http_client).server.test_client()


def test_the_run_page_marks_the_resume_on_every_line_chart():
    api = FakeApi(
        series={"loss": LOSS, "amp/scale": {"steps": [0, 1], "values": [65536.0, 65536.0]}, "lr": LOSS},
        events=[RESUME],
    )
    response = refresh(_client(api))
    for graph_id in ("loss-graph", "scale-graph", "lr-graph"):
        drawn = apply_patch(response[graph_id]["figure"])
        assert [trace["x"] for trace in drawn["data"] if trace.get("uid") == "resume"] == [[30, 30, None]]
    assert response["live-cursor"]["data"]["resumes"] == 1
    assert "resume" in json.dumps(response["events-table"]["children"])  # and in the timeline


def test_a_resume_while_the_page_is_live_redraws_the_charts_in_full():
    api = FakeApi(series={"loss": {"steps": [0, 1, 2], "values": [2.0, 1.8, 1.5]}}, events=[])
    client = _client(api)
    cursor = refresh(client)["live-cursor"]["data"]
    # The run resumed at step 1: its steps from there were rewritten, below the last step shown.
    api.series["loss"] = {"steps": [0, 1, 2, 3], "values": [2.0, 1.7, 1.6, 1.4]}
    api.events.append({**RESUME, "step": 1})
    second = refresh(client, cursor=cursor)
    drawn = apply_patch(second["loss-graph"]["figure"])
    assert drawn["data"][0]["x"] == [0, 1, 2, 3] and drawn["data"][0]["y"] == [2.0, 1.7, 1.6, 1.4]
    assert second["live-cursor"]["data"]["resumes"] == 1


def _texts(component) -> list[str]:
    """Every string in a component tree."""
    found: list[str] = []

    def walk(node):
        if isinstance(node, str):
            found.append(node)
        elif isinstance(node, (list, tuple)):
            for child in node:
                walk(child)
        elif hasattr(node, "children"):
            walk(node.children)

    walk(component)
    return found


def test_a_crashed_run_shows_why_in_its_header():
    crashed = {**RUN, "status": "crashed", "status_reason": "ValueError: loss exploded at step 12"}
    header = run_header(crashed, {})
    assert "ValueError: loss exploded at step 12" in _texts(header)
    badge = header.children[0].children[1]
    assert badge.children == "crashed" and badge.title == "ValueError: loss exploded at step 12"
    running = run_header({**RUN, "status": "running", "status_reason": None}, {})
    assert not [t for t in _texts(running) if "Error" in t]


def test_the_status_badge_carries_the_reason_as_its_hover_text():
    assert status_badge("crashed", "no heartbeat").title == "no heartbeat"
    assert status_badge("finished").title is None
    assert isinstance(status_badge("running"), html.Span)
