"""The run page's verdict: pure builders from the API's incidents and events to components.

    verdict_banner   the run's health at the top of its page: HEALTHY / WARNING / CRITICAL and one
                     line naming the lead incident's cause ("verdict unavailable" when the server
                     could not say)
    incident_cards   one card per incident: severity, status, steps (linked to the run page at the
                     first step), the cause, the findings behind it, the next steps
    condense_events  the events table's rows: a streak of skipped steps is one row ("steps 169-298:
                     every step skipped, scale 2^-1 → 2^-119"), not one row per step

Every user- or server-supplied string (causes, titles, layer names) is passed as a component's
children or a title attribute, which React renders as text, never as HTML.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from dash import dcc, html

from .._text import scale_change
from . import figures
from .api_client import VERDICTS, ApiError
from .views import RunHref, data_attributes, format_step, severity_badge, status_badge

__all__ = [
    "condense_events",
    "incident_cards",
    "incidents_section",
    "skip_streak_text",
    "verdict_banner",
]

_SEVERITY_ORDER = {"critical": 0, "warning": 1}
# The incidents whose cure may be a rewind: a run that diverged, overflowed or met bad data.
REWINDABLE = ("divergence", "precision", "data")
MAX_STREAK_LAYERS = 50  # layers named in a skip streak's hover text


def verdict_banner(
    verdict: str | None, incidents: list[dict[str, Any]], error: ApiError | str | None = None
) -> html.Div:
    """The run's verdict as a coloured banner (id "run-verdict", classes "verdict verdict-<verdict>",
    attribute data-verdict): a badge HEALTHY / WARNING / CRITICAL and a one-line summary, e.g.
    "2 open incidents: the learning rate jumped 300× at step 1200 (steps 1,200–1,260; +1 more)".

    verdict: the API's "healthy" | "warning" | "critical"; None (or anything else) shows "verdict
    unavailable", with `error` (why the incidents could not be read) as the reason.
    """
    if verdict not in VERDICTS:
        return _banner("unavailable", "UNKNOWN", f"verdict unavailable{_reason(error)}")
    if verdict == "healthy" and incidents and all(item.get("status") != "open" for item in incidents):
        # Healthy now, not throughout: a green HEALTHY beside a red resolved incident read as a contradiction.
        return _banner("recovered", "RECOVERED", "recovered from " + _summary(incidents, resolved_only=True))
    return _banner(verdict, verdict.upper(), _summary(incidents))


def _reason(error: ApiError | str | None) -> str:
    if isinstance(error, ApiError) and error.status_code is not None:
        return f": the incidents could not be read ({error.status_code} {error.detail})"
    return f": {error}" if error is not None else ""


def _banner(verdict: str, label: str, summary: str) -> html.Div:
    return html.Div(
        [
            html.Span(label, className="verdict-badge", id="run-verdict-label"),
            html.Span(summary, className="verdict-summary", id="run-verdict-summary"),
        ],
        id="run-verdict",
        className=f"verdict verdict-{verdict}",
        role="status",
        **data_attributes({"verdict": verdict}),
    )


def _summary(incidents: list[dict[str, Any]], resolved_only: bool = False) -> str:
    """One line: how many incidents are open (else resolved) and the most severe, newest one's cause;
    resolved_only: "N incident(s): ..." (after "recovered from")."""
    if not incidents:
        return "No incidents"
    open_ones = [item for item in incidents if item.get("status") == "open"]
    shown = open_ones or incidents
    # Most severe first; the API's order (newest first) within a severity.
    lead = min(shown, key=lambda item: _SEVERITY_ORDER.get(str(item.get("severity")), 2))
    state = "open " if open_ones else "" if resolved_only else "resolved "
    text = f"{_count(len(shown), f'{state}incident')}: {_headline(lead)}"
    extras = [_steps_text(lead)] if _steps_text(lead) else []
    if len(shown) > 1:
        extras.append(f"+{len(shown) - 1} more")
    if open_ones and len(open_ones) < len(incidents):
        extras.append(f"{len(incidents) - len(open_ones)} resolved")
    return text + (f" ({'; '.join(extras)})" if extras else "")


def _headline(incident: dict[str, Any]) -> str:
    return str(incident.get("cause") or incident.get("title") or "an incident")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _steps_text(incident: dict[str, Any]) -> str:
    """ "step 1,200" or "steps 1,200–1,260"; "" without a first step."""
    first, last = incident.get("first_step"), incident.get("last_step")
    if not _is_step(first):
        return ""
    if not _is_step(last) or last == first:
        return f"step {format_step(first)}"
    return f"steps {format_step(first)}–{format_step(last)}"


def incidents_section(incidents: list[dict[str, Any]], run_href: RunHref) -> html.Div | None:
    """The run page's "Incidents" section (id "run-incidents"): the cards, or None without incidents
    (the banner already says "No incidents")."""
    if not incidents:
        return None
    return html.Div(
        [html.H2("Incidents", className="section"), *incident_cards(incidents, run_href)],
        id="run-incidents",
        className="incidents",
    )


def incident_cards(incidents: list[dict[str, Any]], run_href: RunHref) -> list[html.Div]:
    """One card per incident, open ones first, in the API's order (newest first) otherwise.

    Each card (id "incident-<id>", classes "card incident incident-<severity> incident-<status>")
    has the severity and status, the steps linked to the run page at the first step
    (`run_href(run_id, step)`), the title and cause, the findings (rule: title at step) and the next
    steps as a bullet list.
    """
    ordered = sorted(incidents, key=lambda item: item.get("status") != "open")
    return [_incident_card(incident, run_href) for incident in ordered]


def _incident_card(incident: dict[str, Any], run_href: RunHref) -> html.Div:
    severity = str(incident.get("severity") or "warning")
    status = str(incident.get("status") or "open")
    run_id = str(incident.get("run_id") or "")
    steps = _steps_text(incident)
    head: list[Any] = [
        severity_badge(severity),
        status_badge(status),
        html.Span(str(incident.get("title") or ""), className="incident-title"),
    ]
    if steps:
        first = incident.get("first_step")
        head.append(dcc.Link(steps, href=run_href(run_id, first), className="incident-steps"))
    if _is_step(incident.get("resolved_step")) and status == "resolved":
        head.append(
            html.Span(f"resolved at step {format_step(incident['resolved_step'])}", className="muted")
        )
    children: list[Any] = [html.Div(head, className="incident-head")]
    if incident.get("cause"):
        children.append(html.P(str(incident["cause"]), className="incident-cause"))
    first = incident.get("first_step")
    healthy = incident.get("last_healthy_step")  # the server's (one rewind point per trouble)
    if not (isinstance(healthy, int) and _is_step(healthy)):
        healthy = first - 1 if isinstance(first, int) and _is_step(first) else None
    if healthy is not None and healthy >= 0 and incident.get("family") in REWINDABLE:
        children.append(
            html.P(
                f"Last healthy step: {format_step(healthy)}. To rewind, restore a checkpoint from at or "
                "before it and skip the batches from there to where training stopped.",
                className="incident-rewind",
            )
        )
    findings = [item for item in incident.get("findings") or [] if isinstance(item, dict)]
    if findings:
        children.append(
            html.Div(
                [html.Span("Evidence", className="incident-label"), html.Ul([_finding(f) for f in findings])],
                className="incident-findings",
            )
        )
    next_steps = [str(item) for item in incident.get("next_steps") or []]
    if next_steps:
        children.append(
            html.Div(
                [
                    html.Span("Next steps", className="incident-label"),
                    html.Ul([html.Li(s) for s in next_steps]),
                ],
                className="incident-next",
            )
        )
    return html.Div(
        children,
        id=f"incident-{incident.get('id')}",
        className=f"card incident incident-{severity} incident-{status}",
    )


def _finding(finding: dict[str, Any]) -> html.Li:
    step = finding.get("step")
    at = f" at step {format_step(step)}" if _is_step(step) else ""
    return html.Li(
        [
            html.Span(str(finding.get("rule") or ""), className="finding-rule"),
            f" {finding.get('title') or ''}{at}",
        ],
        title=str(finding.get("severity") or ""),
    )


# -- the events table --------------------------------------------------------------------------------


def condense_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events table's rows: each streak of 2+ skip events of one rank at consecutive steps becomes
    one row, other events (and single skips) pass through unchanged, in the order of their first event.

    A streak's row is shaped like an event (step = its first step, kind "skip", the rank, data with
    the first skip's scale_before and the last one's scale_after) plus "streak": {"first_step",
    "last_step", "count", "layer" (the layer non-finite in most of its steps, or None),
    "layer_steps", "layers" (the most frequent ones as "name: N steps"), "text"}; see
    `skip_streak_text`.
    """
    rows: list[dict[str, Any] | list[dict[str, Any]]] = []
    open_streaks: dict[Any, list[dict[str, Any]]] = {}  # rank → the skips of its streak so far
    for event in events:
        if event.get("kind") != "skip" or not _is_step(event.get("step")):
            rows.append(event)
            continue
        rank = event.get("rank")
        streak = open_streaks.get(rank)
        if streak is not None and event["step"] == streak[-1]["step"] + 1:
            streak.append(event)
            continue
        streak = [event]
        open_streaks[rank] = streak
        rows.append(streak)  # filled in place while it grows
    return [row if isinstance(row, dict) else _streak_row(row) for row in rows]


def _streak_row(skips: list[dict[str, Any]]) -> dict[str, Any]:
    if len(skips) == 1:
        return skips[0]
    first, last = skips[0], skips[-1]
    first_data, last_data = _data(first), _data(last)
    layer_counts: Counter[str] = Counter()
    for skip in skips:
        layer_counts.update(dict.fromkeys(figures.layer_names(_data(skip).get("non_finite_layers")), 1))
    ranked = layer_counts.most_common(MAX_STREAK_LAYERS)
    layer, layer_steps = ranked[0] if ranked else (None, 0)
    streak = {
        "first_step": first["step"],
        "last_step": last["step"],
        "count": len(skips),
        "layer": layer,
        "layer_steps": layer_steps,
        "layers": [f"{name}: {steps} steps" for name, steps in ranked],
    }
    scale_before, scale_after = first_data.get("scale_before"), last_data.get("scale_after")
    streak["text"] = skip_streak_text(streak, scale_before, scale_after)
    return {
        "step": first["step"],
        "kind": "skip",
        "rank": first.get("rank"),
        "data": {"scale_before": scale_before, "scale_after": scale_after},
        "streak": streak,
    }


def skip_streak_text(streak: dict[str, Any], scale_before: Any, scale_after: Any) -> str:
    """ "steps 169-298: every step skipped, scale 2^-1 -> 2^-119 (...x)", then the layer non-finite in
    most of the streak's steps when the skips name one ("; non-finite most often in fc1.weight (130 of
    130 steps)"). The scale's fall is worded by the one function the scale_drop alert uses too."""
    text = (
        f"steps {format_step(streak['first_step'])}-{format_step(streak['last_step'])}: every step skipped, "
        f"scale {scale_change(scale_before, scale_after)}"
    )
    if streak.get("layer") is not None:
        text += (
            f"; non-finite most often in {streak['layer']} "
            f"({streak['layer_steps']} of {streak['count']} steps)"
        )
    return text


def _data(event: dict[str, Any]) -> dict[str, Any]:
    data = event.get("data")
    return data if isinstance(data, dict) else {}


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
