"""The run page's pure views: API values in, components out (no HTTP, no callbacks).

    run_header     name, status (and why a crashed run crashed), facts, the agent's queue counters, a
                   distributed run's ranks
    run_details    config and metadata as JSON text, folded away
    events_table   the timeline: events (a skip streak is one row) and alerts, latest step first, each
                   step a button that marks it on the charts
    scaler_empty_text  what the loss-scale charts say without points: "no data yet", or that the
                   run has no GradScaler

Every user-supplied string (names, config, hints, layer names) is passed as a component's children or a
title attribute, which React renders as text, never as HTML.
"""

from __future__ import annotations

import json
from typing import Any

from dash import html

from .. import figures, verdict
from ..api_client import ApiError
from ..views import (
    alert_state,
    format_step,
    format_time,
    run_status,
    scale_text,
    status_badge,
    summarize_fields,
)

__all__ = [
    "AGENT_HEALTH_KEYS",
    "EVENTS_TABLE_ROWS",
    "events_table",
    "run_details",
    "run_header",
    "scaler_empty_text",
    "world_size",
]

EVENTS_TABLE_ROWS = 100
AGENT_HEALTH_KEYS = {
    "queued": "agent/queued",
    "sent": "agent/sent",
    "spooled": "agent/spooled",
    "dropped": "agent/dropped",
    "dead-lettered": "agent/dead_lettered",  # sent only once a batch was (the agent's dead-letter file)
}
_SHOWN_WHEN_KNOWN = frozenset({"dead-lettered"})  # left out of the line until the agent reports it
NO_SCALER_TEXT = "not applicable: this run has no GradScaler"


def world_size(run: dict[str, Any]) -> int:
    """How many processes the run has (its metadata's world_size); 1 when it does not say."""
    size = (run.get("metadata") or {}).get("world_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else 1


def scaler_empty_text(run: dict[str, Any]) -> str:
    """What a chart of what only a GradScaler gives (the loss scale, fp16 underflow) says when it has
    no points: NO_SCALER_TEXT for a run that has ended with steps recorded but never a loss scale
    (its summary's scale, the latest amp/scale: the agent records it every step under a GradScaler),
    else "no data yet" (a running run's first scale may be on its way)."""
    last_step = run.get("last_step")
    stepped = isinstance(last_step, int) and not isinstance(last_step, bool)
    summary = run.get("summary")
    # An older server's run may not say its scale: then nothing is known.
    never_scaled = isinstance(summary, dict) and "scale" in summary and summary["scale"] is None
    if run.get("status") != "running" and stepped and never_scaled:
        return NO_SCALER_TEXT
    return figures.NO_DATA_TEXT


def run_header(run: dict[str, Any], health: dict[str, Any], ranks: dict[str, Any] | None = None) -> html.Div:
    """Name, status and facts; the agent's latest counters (`health`, by AGENT_HEALTH_KEYS name) once
    known; one chip per rank of a distributed run (`ranks`: GET /runs/{id}/ranks)."""
    summary = run.get("summary") or {}
    facts = [
        ("project", str(run.get("project", ""))),
        ("last step", format_step(run.get("last_step"))),
        ("scale", scale_text(summary.get("scale"))),
        ("skipped steps", str(summary.get("skips") or 0)),
        ("created", format_time(run.get("created_at"))),
    ]
    reason = run.get("status_reason")
    title: list[Any] = [
        html.H1(str(run.get("name") or run.get("id")), className="run-name"),
        status_badge(run_status(run), reason),
    ]
    if reason and run.get("status") == "crashed":  # the exception type and message, or "no heartbeat"
        title.append(html.Span(str(reason), className="status-reason", id="status-reason"))
    children: list[Any] = [
        html.Div(title, className="run-title"),
        html.Dl(
            [html.Div([html.Dt(label), html.Dd(value)], className="fact") for label, value in facts],
            className="facts",
        ),
    ]
    if any(value is not None for value in health.values()):
        children.append(_agent_health(health))
    if ranks and ranks.get("data"):
        children.append(_ranks_line(ranks))
    return html.Div(children, className="run-header")


def _agent_health(health: dict[str, Any]) -> html.Div:
    """The agent's latest queue counters; dropped, spooled or dead-lettered points are flagged."""
    items = []
    for name in AGENT_HEALTH_KEYS:
        value = figures.finite_or_none(health.get(name))
        if value is None and name in _SHOWN_WHEN_KNOWN:
            continue
        text = "–" if value is None else f"{value:,.0f}"
        bad = name in ("dropped", "spooled", "dead-lettered") and value
        items.append(
            html.Span([html.Span(name, className="label"), html.Span(text, className="bad" if bad else None)])
        )
    return html.Div(
        [html.Span("agent", className="health-title"), *items], className="agent-health", id="agent-health"
    )


def _ranks_line(ranks: dict[str, Any]) -> html.Div:
    """One chip per rank of a distributed run: rank, host and how it ended; a crashed rank in red."""
    chips = []
    for info in ranks.get("data") or []:
        status = str(info.get("status") or "running")
        text = f"rank {info.get('rank')} · {info.get('host') or '?'} · {status}"
        chips.append(html.Span(text, className="rank-chip bad" if status == "crashed" else "rank-chip"))
    title = f"{ranks.get('world_size') or len(chips)} ranks, gradients {ranks.get('gradients') or '?'}"
    return html.Div(
        [html.Span(title, className="health-title"), *chips], className="ranks-line", id="ranks-line"
    )


def run_details(run: dict[str, Any]) -> html.Details:
    """Config and metadata as indented JSON text, folded away by default."""
    config = run.get("config") or {}
    metadata = run.get("metadata") or {}
    return html.Details(
        [
            html.Summary(f"Config ({len(config)} keys) and metadata ({len(metadata)} keys)"),
            html.Div(
                [
                    html.Div([html.H2("Config"), html.Pre(_pretty_json(config))], className="details-col"),
                    html.Div(
                        [html.H2("Metadata"), html.Pre(_pretty_json(metadata))], className="details-col"
                    ),
                ],
                className="details-grid",
            ),
        ],
        className="card run-details",
        id="run-details",
    )


def _pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str) if value else "–"


def events_table(
    events: list[dict[str, Any]],
    count: int,
    alerts: list[dict[str, Any]] | None = None,
    alerts_error: ApiError | None = None,
) -> Any:
    """The run's timeline, latest step first: events (skips, warnings) and alerts, each step a button
    that marks it on the charts."""
    alerts = alerts or []
    notes: list[Any] = []
    if alerts_error is not None:
        notes.append(html.P(f"Alerts could not be loaded: {alerts_error}", className="muted"))
    if not events and not alerts:
        return [html.P("No events: no skipped steps, no warnings, no alerts.", className="muted"), *notes]
    condensed = verdict.condense_events(events)  # a streak of skipped steps is one row
    entries = [("event", index, event) for index, event in enumerate(condensed)]
    entries += [("alert", index, alert) for index, alert in enumerate(alerts)]
    entries.sort(key=lambda entry: _timeline_step(entry[2]), reverse=True)
    shown = entries[:EVENTS_TABLE_ROWS]
    rows = [
        _alert_row(item, f"alert-{index}") if source == "alert" else _event_row(item, f"event-{index}")
        for source, index, item in shown
    ]
    header = html.Thead(html.Tr([html.Th("Step"), html.Th("Kind"), html.Th("Details"), html.Th("Hint")]))
    children: list[Any] = [html.Table([header, html.Tbody(rows)], className="table events"), *notes]
    hidden_events = count - sum(
        (item.get("streak") or {}).get("count", 1) for source, _, item in shown if source == "event"
    )
    if hidden_events > 0:
        children.append(
            html.P(
                f"Showing the latest {len(shown)} entries; {hidden_events} older events are not shown.",
                className="muted",
            )
        )
    return children


def _timeline_step(item: dict[str, Any]) -> int:
    """Where an event or alert stands in the timeline: its step; a skip streak's last step."""
    streak = item.get("streak")
    return _step_or_minus_one(streak["last_step"] if streak else item.get("step"))


def _step_or_minus_one(step: Any) -> int:
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def _step_button(step: Any, row: str) -> Any:
    """A step that marks itself on the charts when clicked (row keeps ids unique per table)."""
    if not isinstance(step, int) or isinstance(step, bool):
        return format_step(step)
    return html.Button(
        format_step(step),
        id={"type": "event-step", "step": step, "row": row},
        className="step-link",
        n_clicks=0,
    )


def _event_row(event: dict[str, Any], row: str) -> html.Tr:
    kind = str(event.get("kind", ""))
    data = event.get("data")
    if not isinstance(data, dict):
        data = {}
    streak = event.get("streak")  # skips at consecutive steps, condensed into one row
    label = f"{kind} ×{streak['count']}" if streak else kind
    step_cell: Any = _step_button(event.get("step"), row)
    if streak:
        step_cell = [step_cell, "–", _step_button(streak["last_step"], row + "-last")]
        details: Any = html.Span(streak["text"], title="\n".join(streak["layers"]) or None)
    else:
        details = _event_details(kind, data)
    return html.Tr(
        [
            html.Td(step_cell, className="num"),
            html.Td(html.Span(label, className="badge badge-bad" if kind == "skip" else "badge badge-warn")),
            html.Td(details, className="layers streak" if streak else "layers"),
            html.Td(str(data.get("hint") or ""), className="hint-cell"),
        ]
    )


def _alert_row(alert: dict[str, Any], row: str) -> html.Tr:
    state = alert_state(alert)
    severity = str(alert.get("severity") or "")
    details = [html.Span(str(alert.get("title") or alert.get("type") or "alert"), className="alert-title")]
    details.append(html.Span(f" · {state}", className="bad" if state == "open" else "muted"))
    return html.Tr(
        [
            html.Td(_step_button(alert.get("step"), row), className="num"),
            html.Td(
                html.Span(
                    f"alert: {alert.get('type', '')}",
                    className="badge badge-bad" if severity == "critical" else "badge badge-warn",
                    title=severity,
                )
            ),
            html.Td(details),
            html.Td(str(alert.get("hint") or ""), className="hint-cell"),
        ],
        className="alert-row",
    )


def _event_details(kind: str, data: dict[str, Any]) -> Any:
    """One line about an event: scale change and non-finite layers for a skip, key=value otherwise."""
    if kind == "skip":
        layers = figures.layer_names(data.get("non_finite_layers"))
        layer_count = data.get("non_finite_layer_count", len(layers))
        text = (
            f"scale {figures.format_scale(data.get('scale_before'))} → "
            f"{figures.format_scale(data.get('scale_after'))}"
        )
        if layers:
            text += f"; non-finite in {layer_count} layers: {figures.summarize_layers(layers)}"
        return html.Span(text, title="\n".join(layers[:50]) if layers else None)
    return summarize_fields(data, leave_out=("hint",))
